"""Kubernetes manifests that run one ddptrain job: a Kubeflow Trainer v2 ``TrainJob``, a Training Operator v1
``PyTorchJob`` or a ``JobSet``. Plain dicts, ready for ``yaml.safe_dump``; no cluster, no Kubernetes client.

Every kind runs the same container, ``ddptrain train.resume=auto <overrides>``, one pod per node. The operators
differ only in who tells the pod where it sits in the job, as torchrun's ``PET_*`` variables:

- Trainer v2's ``torch-distributed`` runtime (its Torch plugin) sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the pod's Job completion index), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``) and
  ``PET_MASTER_PORT`` (29400) itself, and refuses them in ``trainer.env``;
- Training Operator v1 sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and ``MASTER_ADDR`` /
  ``MASTER_PORT`` (the master pod's service), plus ``RANK`` and ``WORLD_SIZE`` of the pod;
- JobSet sets none: the manifest writes them, with the node rank from the completion index through the downward
  API and the first pod's name under the JobSet's headless service as the master.

``ddptrain`` started without torchrun in a pod that has ``PET_NNODES`` starts its workers through torchrun's own
code with those values (``ddptrain/app/launch.py``), so each node runs one torchrun agent and the agents meet at
node 0. The run directory is fixed (``DDPTRAIN_RUN_DIR`` on the checkpoint volume), so a pod restarted after a
failure finds the checkpoints of the run it belongs to and continues (``train.resume=auto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTAINER = {"trainjob": "node", "pytorchjob": "pytorch", "jobset": "node"}  # names the operators look for
KINDS = tuple(CONTAINER)
SHM_VOLUME, RUNS_VOLUME = "dshm", "runs"
JOBSET_MASTER_PORT = 29500
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

Doc = dict[str, Any]


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


def manifest(kind: str, spec: JobSpec) -> Doc:
    """The manifest of ``kind`` (trainjob, pytorchjob or jobset) for ``spec``."""
    return {"trainjob": train_job, "pytorchjob": pytorch_job, "jobset": job_set}[kind](spec)


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


# IPC_LOCK: NCCL pins (registers) its buffers with the network adapter, past the default locked-memory limit
SECURITY = {"capabilities": {"add": ["IPC_LOCK"]}}


def container(spec: JobSpec, name: str, extra_env: list[Doc] | None = None) -> Doc:
    """The training container: ``ddptrain`` with the run's overrides, continuing from the volume after a restart
    (a later ``train.resume=...`` among the overrides wins)."""
    body: Doc = {"name": name, "image": spec.image, "command": ["ddptrain"], "args": ["train.resume=auto", *spec.args],
                 "env": [*environment(spec), *(extra_env or [])], "volumeMounts": volume_mounts(spec),
                 "securityContext": SECURITY}
    if res := resources(spec):
        body["resources"] = res
    return body


def pod_spec(spec: JobSpec, name: str, restart_policy: str, extra_env: list[Doc] | None = None) -> Doc:
    return {"restartPolicy": restart_policy, "containers": [container(spec, name, extra_env)], "volumes": volumes(spec)}


def train_job(spec: JobSpec) -> Doc:
    """Kubeflow Trainer v2: a ``TrainJob`` on the ``torch-distributed`` ClusterTrainingRuntime. The trainer's
    fields set the image, command, nodes, processes and resources; the volumes, their mounts and the capability go
    through a runtime patch of the runtime's ``node`` job (the Trainer API has no field of its own for them)."""
    trainer: Doc = {"image": spec.image, "command": ["ddptrain"], "args": ["train.resume=auto", *spec.args],
                    "env": environment(spec), "numNodes": spec.nodes, "numProcPerNode": spec.procs_per_node}
    if res := resources(spec):
        trainer["resourcesPerNode"] = res
    patch = {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
        "volumes": volumes(spec),
        "containers": [{"name": CONTAINER["trainjob"], "volumeMounts": volume_mounts(spec),
                        "securityContext": SECURITY}],
    }}}}}]}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": metadata(spec),
            "spec": {"runtimeRef": {"name": "torch-distributed", "kind": "ClusterTrainingRuntime",
                                    "apiGroup": "trainer.kubeflow.org"},
                     "trainer": trainer,
                     "runtimePatches": [{"manager": "ddptrain-k8s", "trainingRuntimeSpec": patch}]}}


def pytorch_job(spec: JobSpec) -> Doc:
    """Training Operator v1: a ``PyTorchJob`` of one Master and ``nodes - 1`` Workers. The operator restarts a
    failed pod (``OnFailure``) up to ``runPolicy.backoffLimit`` times."""
    replica = {"replicas": 1, "restartPolicy": "OnFailure",
               "template": {"metadata": {"labels": dict(metadata(spec)["labels"])},
                            "spec": pod_spec(spec, CONTAINER["pytorchjob"], "OnFailure")}}
    replicas: Doc = {"Master": replica}
    if spec.nodes > 1:
        replicas["Worker"] = {**replica, "replicas": spec.nodes - 1}
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
           {"name": "PET_MASTER_PORT", "value": str(JOBSET_MASTER_PORT)}]
    job = {"parallelism": spec.nodes, "completions": spec.nodes, "completionMode": "Indexed", "backoffLimit": 0,
           "template": {"metadata": {"labels": dict(metadata(spec)["labels"])},
                        "spec": pod_spec(spec, CONTAINER["jobset"], "Never", pet)}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata(spec),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": spec.max_restarts},
                     "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]}}
