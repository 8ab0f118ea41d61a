"""Kubernetes manifests that run one ddptrain job: a Kubeflow Trainer v2 ``TrainJob``, a Training Operator v1
``PyTorchJob`` or a ``JobSet``. Plain dicts, ready for ``yaml.safe_dump``; no cluster, no Kubernetes client.

Every kind runs the same container, ``ddptrain train.resume=auto <overrides>``, one pod per node. The operators
differ only in who tells the pod where it sits in the job, as torchrun's ``PET_*`` variables:

- Trainer v2's ``torch-distributed`` runtime (its Torch plugin) sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the pod's Job completion index), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``) and
  ``PET_MASTER_PORT`` (29500, its ``ContainerTrainerPort``) itself, and refuses them in ``trainer.env``;
- Training Operator v1 sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and ``MASTER_ADDR`` /
  ``MASTER_PORT`` (the master pod's service), plus ``RANK`` and ``WORLD_SIZE`` of the pod;
- JobSet sets none: the manifest writes them, with the node rank from the completion index through the downward
  API and the first pod's name under the JobSet's headless service as the master.

``ddptrain`` started without torchrun in a pod that has ``PET_NNODES`` starts its workers through torchrun's own
code with those values (``ddptrain/app/launch.py``), so each node runs one torchrun agent and the agents meet at
node 0. The run directory is fixed (``DDPTRAIN_RUN_DIR`` on the checkpoint volume, named after the job), so a pod
restarted after a failure finds the checkpoints of the run it belongs to and continues (``train.resume=auto``).

Every pod runs as the image's user (uid/gid 10001, see the Dockerfile) with ``fsGroup`` 10001, so the kubelet makes
the checkpoint volume group-writable for it (where the volume's driver supports it: not most NFS, see
docs/multinode.md). Added capabilities are not ambient in Kubernetes: a non-root process loses ``IPC_LOCK`` at
``execve`` (kubernetes/kubernetes#56374), so NCCL's InfiniBand registration is bound by the node's locked-memory
limit (``RLIMIT_MEMLOCK``, inherited from the container runtime); only ``--ib-root`` pods, which run as root, are
given ``IPC_LOCK``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTAINER = {"trainjob": "node", "pytorchjob": "pytorch", "jobset": "node"}  # names the operators look for
KINDS = tuple(CONTAINER)
SHM_VOLUME, RUNS_VOLUME = "dshm", "runs"
# the port of node 0's rendezvous: Trainer v2's ContainerTrainerPort (pkg/constants/constants.go, v2.3.0), which
# sets it itself; the JobSet manifest uses the same
MASTER_PORT = 29500
MANAGER = "ddptrain.dev/ddptrain-k8s"  # a TrainJob's runtimePatches[].manager: Trainer wants a domain-prefixed path
IMAGE_UID = 10001  # the image's user and group (Dockerfile: USER 10001:10001)
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

Doc = dict[str, Any]


@dataclass(frozen=True)
class FtSpec:
    """``--replica-groups``: torchft replica groups, each a Job of the JobSet restarted alone, and their lighthouse
    (``ddptrain/app/k8s_ft.py``)."""

    groups: int  # R, at least 2
    min_replicas: int  # the lighthouse's --min_replicas (ft.min_replicas)
    group_restarts: int  # restarts of one group before its Job fails (ft.group_restarts)
    join_timeout_ms: int  # the lighthouse's wait for stragglers before it issues a quorum
    namespace: str  # the pods' DNS search domain names it
    cluster_domain: str  # the cluster's DNS domain (cluster.local)


@dataclass(frozen=True)
class JobSpec:
    """What the pods of one job need, whatever operator runs them."""

    name: str
    image: str
    nodes: int
    gpus_per_node: int  # 0: CPU pods
    procs_per_node: int
    args: list[str]  # ddptrain's arguments (overrides)
    run_dir: str  # on the checkpoint volume
    claim: str  # the PersistentVolumeClaim of the checkpoint volume
    mount: str  # where the claim is mounted
    cache_dir: str  # the data cache, on the volume too (prepared once, shared by the nodes and restarts)
    shm_size: str
    namespace: str | None = None
    ib_resource: str | None = None  # the RDMA/InfiniBand device plugin's resource, e.g. rdma/ib
    ib_hca: str | None = None  # NCCL_IB_HCA
    wandb_secret: tuple[str, str] | None = None  # (secret, key) holding W&B's API key
    env: list[tuple[str, str]] = field(default_factory=list)  # --env KEY=VALUE, each name once
    max_restarts: int = 3
    labels: dict[str, str] = field(default_factory=dict)
    ib_root: bool = False  # run the pods as root with IPC_LOCK (NCCL may then pin past the node's memlock limit)
    claim_size: str | None = None  # emit the PersistentVolumeClaim too, of this size
    storage_class: str | None = None  # its storage class (default: the cluster's default class)
    ft: FtSpec | None = None  # --replica-groups: a JobSet of replica groups and the lighthouse

    @property
    def pods(self) -> int:
        """Every pod of the job: nodes, times the replica groups."""
        return self.nodes * (self.ft.groups if self.ft else 1)


def manifest(kind: str, spec: JobSpec) -> Doc:
    """The manifest of ``kind`` (trainjob, pytorchjob or jobset) for ``spec``."""
    return {"trainjob": train_job, "pytorchjob": pytorch_job, "jobset": job_set}[kind](spec)


def documents(kind: str, spec: JobSpec) -> list[Doc]:
    """What ``ddptrain-k8s`` prints: the checkpoint volume's claim when asked for (``--claim-size``), then the job."""
    return [*([volume_claim(spec)] if spec.claim_size else []), manifest(kind, spec)]


def volume_claim(spec: JobSpec) -> Doc:
    """The checkpoint volume's PersistentVolumeClaim: ReadWriteMany when several nodes mount it at once (the
    storage class must offer it: NFS, CephFS, a cloud file store), ReadWriteOnce for one node."""
    claim: Doc = {"accessModes": ["ReadWriteMany" if spec.pods > 1 else "ReadWriteOnce"],
                  "resources": {"requests": {"storage": spec.claim_size}}}
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    meta = {**metadata(spec), "name": spec.claim}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def metadata(spec: JobSpec) -> Doc:
    meta: Doc = {"name": spec.name, "labels": {"app.kubernetes.io/name": "ddptrain", **spec.labels}}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def environment(spec: JobSpec) -> list[Doc]:
    """The container's variables (the operator adds the ``PET_*`` ones it owns)."""
    env: list[Doc] = [
        {"name": "DDPTRAIN_RUN_DIR", "value": spec.run_dir},
        {"name": "DDPTRAIN_CACHE_DIR", "value": spec.cache_dir},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if spec.ib_resource:  # NCCL's InfiniBand transport, and its choice in the log (NET/IB : Using ...)
        env += [{"name": "NCCL_IB_DISABLE", "value": "0"}, {"name": "NCCL_DEBUG", "value": "INFO"},
                {"name": "NCCL_DEBUG_SUBSYS", "value": "INIT,NET"}]
        if spec.ib_hca:
            env.append({"name": "NCCL_IB_HCA", "value": spec.ib_hca})
    if spec.wandb_secret:
        secret, key = spec.wandb_secret
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    # a name given with --env replaces the manifest's own variable in place: env is a list map keyed by name in
    # every operator's CRD, and the API server refuses a name twice
    by_name = {e["name"]: e for e in env} | {k: {"name": k, "value": v} for k, v in spec.env}
    return list(by_name.values())


def resources(spec: JobSpec) -> Doc:
    limits: dict[str, Any] = {}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = spec.gpus_per_node
    if spec.ib_resource:
        limits[spec.ib_resource] = 1
    return {"limits": limits} if limits else {}


def volume_mounts(spec: JobSpec) -> list[Doc]:
    return [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, {"name": RUNS_VOLUME, "mountPath": spec.mount}]


def volumes(spec: JobSpec) -> list[Doc]:
    """A memory-backed /dev/shm (NCCL's intra-node transport and the loader's workers; a container's default is
    64 MiB) and the checkpoint volume."""
    return [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
            {"name": RUNS_VOLUME, "persistentVolumeClaim": {"claimName": spec.claim}}]


def pod_security() -> Doc:
    """The pod's securityContext: volumes that support ownership management (block devices, most CSI drivers) are
    made group-owned by the image's group, so uid 10001 can create its run dir on a fresh volume (whose root is
    root:root 0755). OnRootMismatch: the kubelet walks the volume only when its root is not already right (a walk
    of every checkpoint at each pod start is minutes on a big volume)."""
    return {"fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"}


def container_security(spec: JobSpec) -> Doc | None:
    """``--ib-root``: the container runs as root with IPC_LOCK, so NCCL may register (pin) its buffers with the
    adapters beyond the node's RLIMIT_MEMLOCK. Otherwise nothing: a capability added to a non-root container is
    not ambient and is dropped at execve (kubernetes/kubernetes#56374), so it would do nothing for uid 10001."""
    if not spec.ib_root:
        return None
    return {"runAsUser": 0, "runAsGroup": 0, "capabilities": {"add": ["IPC_LOCK"]}}


def container(spec: JobSpec, name: str, extra_env: list[Doc] | None = None) -> Doc:
    """The training container: ``ddptrain`` with the run's overrides, continuing from the volume after a restart
    (a later ``train.resume=...`` among the overrides wins)."""
    body: Doc = {"name": name, "image": spec.image, "command": ["ddptrain"], "args": ["train.resume=auto", *spec.args],
                 "env": [*environment(spec), *(extra_env or [])], "volumeMounts": volume_mounts(spec)}
    if security := container_security(spec):
        body["securityContext"] = security
    if res := resources(spec):
        body["resources"] = res
    return body


def pod_spec(spec: JobSpec, name: str, restart_policy: str, extra_env: list[Doc] | None = None) -> Doc:
    return {"restartPolicy": restart_policy, "securityContext": pod_security(),
            "containers": [container(spec, name, extra_env)], "volumes": volumes(spec)}


def train_job(spec: JobSpec) -> Doc:
    """Kubeflow Trainer v2: a ``TrainJob`` on the ``torch-distributed`` ClusterTrainingRuntime. The trainer's
    fields set the image, command, nodes, processes and resources; the volumes, their mounts and the security
    contexts go through a runtime patch of the runtime's ``node`` job (the Trainer API has no field of its own for
    them; the patch may not carry the ``node`` container's env, which the trainer's fields set)."""
    trainer: Doc = {"image": spec.image, "command": ["ddptrain"], "args": ["train.resume=auto", *spec.args],
                    "env": environment(spec), "numNodes": spec.nodes, "numProcPerNode": spec.procs_per_node}
    if res := resources(spec):
        trainer["resourcesPerNode"] = res
    node: Doc = {"name": CONTAINER["trainjob"], "volumeMounts": volume_mounts(spec)}
    if security := container_security(spec):
        node["securityContext"] = security
    patch = {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
        "securityContext": pod_security(), "volumes": volumes(spec), "containers": [node],
    }}}}}]}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": metadata(spec),
            "spec": {"runtimeRef": {"name": "torch-distributed", "kind": "ClusterTrainingRuntime",
                                    "apiGroup": "trainer.kubeflow.org"},
                     "trainer": trainer,
                     "runtimePatches": [{"manager": MANAGER, "trainingRuntimeSpec": patch}]}}


def pytorch_job(spec: JobSpec) -> Doc:
    """Training Operator v1: a ``PyTorchJob`` of one Master and ``nodes - 1`` Workers. The operator restarts a
    failed pod (``OnFailure``) up to ``runPolicy.backoffLimit`` times. Master and Worker are built apart: one
    template shared by both would be printed as a YAML anchor and alias, and editing one would edit the other."""
    def replica(count: int) -> Doc:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": dict(metadata(spec)["labels"])},
                             "spec": pod_spec(spec, CONTAINER["pytorchjob"], "OnFailure")}}

    replicas: Doc = {"Master": replica(1)}
    if spec.nodes > 1:
        replicas["Worker"] = replica(spec.nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata(spec),
            "spec": {"nprocPerNode": str(spec.procs_per_node),
                     "runPolicy": {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": replicas}}


def jobset_master(spec: JobSpec) -> str:
    """The first pod's name under the JobSet's headless service (named after the JobSet):
    ``<jobset>-<replicated job>-<job index>-<pod index>.<service>``."""
    return f"{spec.name}-node-0-0.{spec.name}"


def job_set(spec: JobSpec) -> Doc:
    """A ``JobSet`` of one indexed Job of ``nodes`` pods behind a headless service; JobSet recreates every Job (all
    pods) after a failure, up to ``failurePolicy.maxRestarts`` times, and the pods continue from the volume."""
    pet = [{"name": "PET_NNODES", "value": str(spec.nodes)},
           {"name": "PET_NPROC_PER_NODE", "value": str(spec.procs_per_node)},
           {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
           {"name": "PET_MASTER_ADDR", "value": jobset_master(spec)},
           {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)}]
    job = {"parallelism": spec.nodes, "completions": spec.nodes, "completionMode": "Indexed", "backoffLimit": 0,
           "template": {"metadata": {"labels": dict(metadata(spec)["labels"])},
                        "spec": pod_spec(spec, CONTAINER["jobset"], "Never", pet)}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata(spec),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": spec.max_restarts},
                     "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]}}
