"""``ddptrain-k8s``: print the Kubernetes manifest of a run, for ``kubectl apply -f -``.

The overrides are composed and checked as ``ddptrain`` would (keys, types, the batch over the job's world size)
before anything is printed; what cannot work on a cluster is refused in one line. It imports no torch: printing a
manifest takes a second.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import secrets
import sys
from pathlib import PurePosixPath

from ddptrain.app import k8s_ft
from ddptrain.app.k8s_manifest import KINDS, Doc, FtSpec, JobSpec, documents, volume_claim
from ddptrain.errors import ConfigError, say

# Trainer v2 checks the TrainJob's name with this rule (RFC 1035 label); a pod's host name, <name>-node-<i>-<j>,
# must stay within 63 characters
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40
OWNED_ENV = ("DDPTRAIN_RUN_DIR",)  # with the PET_* ones: what --env may not set (the run dir, the pod's place)
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # a storage class's name
# the characters of the random suffix Kubernetes gives a generateName (apimachinery's util/rand: no vowels, no
# digits that read as letters), so a default job name looks like the ones kubectl users know
SUFFIX = "bcdfghjklmnpqrstvwxz2456789"
MAX_POD_NAME = 63  # JobSet's webhook: a generated pod name (with its 5-character suffix) is an RFC 1035 label
FT_KEYS = ("ft.replica_groups", "ft.replica_id", "ft.lighthouse")  # what --replica-groups writes in each pod

EPILOG = """\
examples:
  ddptrain-k8s +experiment=gpt2_small --image ghcr.io/me/ddptrain:1 --nodes 2 --gpus-per-node 8 | kubectl apply -f -
  ddptrain-k8s +experiment=gpt2_small --image IMG --nodes 4 --gpus-per-node 8 --ib rdma/ib --ib-hca mlx5 --kind jobset
  ddptrain-k8s logger=wandb +experiment=gpt2_small --image IMG --wandb-secret wandb:api-key --kind pytorchjob
  ddptrain-k8s +experiment=gpt2_small --image IMG --replica-groups 4 --nodes 1 --gpus-per-node 8 --namespace ml

Every kind runs `ddptrain train.resume=auto OVERRIDES` in one pod per node; torchrun's agent in each pod reads
the PET_* variables the operator (or, for a JobSet, the manifest) sets. Checkpoints go to the volume of --claim,
mounted at --mount, in <mount>/runs/<name>: a restarted pod continues the run, a job printed with another name
starts a new one. Without --name each manifest gets a new name (ddptrain-xxxxx, in its first line); give that
name again to continue its run in a new job. The claim must exist (ReadWriteMany for several nodes), or add
--claim-size SIZE to print it before the job.

--replica-groups R (torchft, the image needs ddptrain[ft]) prints the lighthouse's Service and Deployment and a
JobSet of R replicated jobs, group-0..group-<R-1>, each of --nodes pods; a group whose pod fails is restarted
alone by its Job (ft.group_restarts x nodes pod failures), the others keep training.
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ddptrain-k8s", description="Print the Kubernetes manifest that runs this ddptrain job.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="the run's Hydra overrides, as for ddptrain")
    parser.add_argument("--image", required=True, help="the container image with ddptrain installed")
    parser.add_argument("--kind", choices=KINDS,
                        help="trainjob: Kubeflow Trainer v2 on the torch-distributed runtime (default); pytorchjob: "
                             "Training Operator v1; jobset: a JobSet with a headless service (the default with "
                             "--replica-groups, the only kind it takes)")
    parser.add_argument("--nodes", type=int, default=1, help="pods, one per node (default 1; per replica group "
                                                             "with --replica-groups)")
    parser.add_argument("--replica-groups", type=int, metavar="R",
                        help="torchft replica groups (2 or more): a JobSet of R groups of --nodes pods, each restarted "
                             "alone, and the torchft lighthouse's Deployment and Service; needs --namespace")
    parser.add_argument("--cluster-domain", default="cluster.local",
                        help="the cluster's DNS domain, for the replica groups' host names (default cluster.local)")
    parser.add_argument("--gpus-per-node", type=int, default=1,
                        help="nvidia.com/gpu per pod and processes per pod (0: CPU pods with "
                             "launch.nproc_per_node processes)")
    parser.add_argument("--name", help="the job's name; the run dir, <mount>/runs/<name>, is named after it, so the "
                                       "same name continues that run (default: a new name, ddptrain-xxxxx)")
    parser.add_argument("--namespace", help="the job's namespace (default: kubectl's)")
    parser.add_argument("--claim", default="ddptrain-runs",
                        help="the PersistentVolumeClaim holding run dirs and checkpoints (ReadWriteMany for "
                             "several nodes); it must exist, unless --claim-size prints it")
    parser.add_argument("--claim-size", metavar="SIZE",
                        help="print the claim too, asking for SIZE (e.g. 500Gi), before the job")
    parser.add_argument("--storage-class", help="the printed claim's storage class (default: the cluster's default)")
    parser.add_argument("--mount", default="/mnt/ddptrain", help="where the claim is mounted in the pods")
    parser.add_argument("--shm-size", default="16Gi", help="the memory-backed /dev/shm's size limit")
    parser.add_argument("--ib", metavar="RESOURCE",
                        help="the RDMA/InfiniBand device resource to request (e.g. rdma/ib); adds NCCL_IB_* and "
                             "NCCL_DEBUG=INFO")
    parser.add_argument("--ib-hca", help="NCCL_IB_HCA, the adapters NCCL may use (with --ib)")
    parser.add_argument("--ib-root", action="store_true",
                        help="run the pods as root with IPC_LOCK (with --ib), for nodes whose container runtime "
                             "does not give containers an unlimited locked-memory limit (docs/multinode.md)")
    parser.add_argument("--wandb-secret", metavar="SECRET[:KEY]",
                        help="the Secret (and key, default api-key) holding WANDB_API_KEY")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="another variable, or a new value for one the manifest sets (NCCL_DEBUG=WARN)")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts after a failure (JobSet failurePolicy, PyTorchJob backoffLimit; a TrainJob's "
                             "come from its runtime)")
    args = parser.parse_args(argv)
    if args.kind is None:
        args.kind = "jobset" if args.replica_groups is not None else "trainjob"
    return args


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The job's spec from the flags and the composed run; raises ConfigError for what cannot work."""
    if args.name is None:
        args.name = default_name()
    check_flags(args)
    if args.replica_groups is not None:
        check_groups(args)
    # group 0's ft overrides: every group's differ only in ft.replica_id
    ft = k8s_ft.ft_overrides(args.name, args.replica_groups, 0) if args.replica_groups else []
    typed = composed(args.overrides + ft)
    if args.replica_groups is None and typed.ft.replica_groups:
        raise ConfigError(f"ft.replica_groups={typed.ft.replica_groups}: on Kubernetes the replica groups are pods of "
                          "their own; expected --replica-groups R instead")
    procs = args.gpus_per_node or typed.launch.nproc_per_node
    check_batch(typed, args.nodes * procs * (args.replica_groups or 1))
    run_dir = run_dir_on_volume(args.overrides, args.mount, args.name)
    env: dict[str, str] = {}  # a name given twice: the later value, as in a shell
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {item}: expected KEY=VALUE")
        if key in OWNED_ENV or key.startswith("PET_"):
            raise ConfigError(f"--env {item}: set by ddptrain-k8s (the run dir: hydra.run.dir) or the operator "
                              "(torchrun's PET_* variables); expected another variable")
        env[key] = value
    secret = None
    if args.wandb_secret:
        name, _, key = args.wandb_secret.partition(":")
        secret = (name, key or "api-key")
    return JobSpec(name=args.name, image=args.image, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   procs_per_node=procs, args=list(args.overrides), run_dir=run_dir, claim=args.claim,
                   mount=args.mount, cache_dir=posixpath.join(args.mount, "cache"), shm_size=args.shm_size,
                   namespace=args.namespace, ib_resource=args.ib, ib_hca=args.ib_hca, wandb_secret=secret,
                   env=list(env.items()), max_restarts=args.max_restarts, ib_root=args.ib_root,
                   claim_size=args.claim_size, storage_class=args.storage_class, ft=ft_spec(args, typed))


def ft_spec(args: argparse.Namespace, typed) -> FtSpec | None:
    """The replica groups' spec from the flags and the composed ``ft`` node: the lighthouse's quorum size is
    ``ft.min_replicas``; it waits for stragglers half of ``ft.quorum_timeout_s`` after that many have joined, so a
    step's quorum request (which waits ``ft.quorum_timeout_s``) is answered before it gives up."""
    if args.replica_groups is None:
        return None
    return FtSpec(groups=args.replica_groups, min_replicas=typed.ft.min_replicas,
                  group_restarts=typed.ft.group_restarts, join_timeout_ms=int(typed.ft.quorum_timeout_s * 500),
                  namespace=args.namespace, cluster_domain=args.cluster_domain)


def check_groups(args: argparse.Namespace) -> None:
    """What ``--replica-groups`` cannot do, in one line each."""
    groups = args.replica_groups
    if args.kind != "jobset":
        raise ConfigError(f"--replica-groups with --kind {args.kind}: expected --kind jobset (the only kind whose "
                          "groups are Jobs of their own, each restarted alone; docs/multinode.md)")
    if groups < 2:
        raise ConfigError(f"--replica-groups {groups}: expected 2 or more groups (one group is a plain job: leave "
                          "--replica-groups out)")
    if not args.namespace:
        raise ConfigError("--replica-groups needs --namespace NS: the pods' DNS search domain names it (torchft "
                          "advertises each pod's short host name, which resolves under <name>.<NS>.svc)")
    if not SUBDOMAIN.match(args.cluster_domain):
        raise ConfigError(f"--cluster-domain {args.cluster_domain}: expected a DNS domain such as cluster.local")
    pod = k8s_ft.longest_pod_name(args.name, groups, args.nodes)
    if len(pod) > MAX_POD_NAME:
        raise ConfigError(f"--name {args.name}: too long for {groups} replica groups of {args.nodes} node(s): the pod "
                          f"name {pod} would pass {MAX_POD_NAME} characters; expected at most "
                          f"{len(args.name) - len(pod) + MAX_POD_NAME} characters")
    for item in args.overrides:
        key = item.lstrip("+~").partition("=")[0]
        if key in FT_KEYS:
            raise ConfigError(f"{item}: set in each pod by --replica-groups; expected it left out")


def default_name() -> str:
    """A new job name, ``ddptrain-`` and five random characters: each job its own run dir, unless --name names
    the run to continue (every job of one name would share a run dir, and train.resume=auto would continue the
    previous job's run)."""
    return "ddptrain-" + "".join(secrets.choice(SUFFIX) for _ in range(5))


def check_flags(args: argparse.Namespace) -> None:
    if not args.image.strip():
        raise ConfigError("--image: empty; expected the container image with ddptrain installed")
    if args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: expected at least 1 node")
    if args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: expected 0 (CPU pods) or more")
    if not NAME.match(args.name) or len(args.name) > MAX_NAME:
        raise ConfigError(f"--name {args.name}: expected lower-case letters, digits and '-', starting with a letter, "
                          f"at most {MAX_NAME} characters")
    if not posixpath.isabs(args.mount):
        raise ConfigError(f"--mount {args.mount}: expected an absolute path in the container")
    if not QUANTITY.match(args.shm_size):
        raise ConfigError(f"--shm-size {args.shm_size}: expected a Kubernetes quantity such as 16Gi")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    if args.ib_hca and not args.ib:
        raise ConfigError("--ib-hca needs --ib RESOURCE (the RDMA device the pods request)")
    if args.ib_root and not args.ib:
        raise ConfigError("--ib-root needs --ib RESOURCE (the RDMA device the pods request)")
    if args.claim_size is not None and not QUANTITY.match(args.claim_size):
        raise ConfigError(f"--claim-size {args.claim_size}: expected a Kubernetes quantity such as 500Gi")
    if args.storage_class is not None and (args.claim_size is None or not SUBDOMAIN.match(args.storage_class)):
        raise ConfigError(f"--storage-class {args.storage_class}: expected a storage class name (lower-case letters, "
                          "digits, '-' and '.'), with --claim-size")


def composed(overrides: list[str]):  # -> Config (the schema's dataclass)
    """The typed run config, composed as ``ddptrain`` composes it (schema checks included)."""
    from ddptrain.config.compose import compose_config, typed_config

    typed = typed_config(compose_config(overrides)).typed
    if typed.launch.backend != "torchrun":
        raise ConfigError(f"launch.backend={typed.launch.backend}: the pods start their workers with torchrun; run "
                          "Ray jobs on Kubernetes through KubeRay (docs/multinode.md)")
    if typed.launch.dry_run:
        raise ConfigError("launch.dry_run=true: plan on this machine with ddptrain, not in a cluster job")
    return typed


def check_batch(typed, world_size: int) -> None:
    """The batch must divide over every rank of the job (as the job's first rank would check, minutes later)."""
    from ddptrain.config.schema import AUTO
    from ddptrain.data.batch import BatchShape

    if typed.data.micro_batch_size == AUTO:
        if typed.data.global_batch_size % world_size:
            raise ConfigError(f"data.global_batch_size={typed.data.global_batch_size} is not divisible by "
                              f"dp={world_size}: data.micro_batch_size=auto needs a whole number of sequences per rank")
        return
    BatchShape.from_config(typed, world_size)


def run_dir_on_volume(overrides: list[str], mount: str, name: str) -> str:
    """The run directory: ``hydra.run.dir`` when the overrides set it (it must be on the volume, or a restarted pod
    would not find its checkpoints), else ``<mount>/runs/<name>``."""
    mount = posixpath.normpath(mount)
    last: dict[str, str] = {}
    for item in overrides:  # Hydra applies a key's last override: that one is checked, wherever the others stand
        key, _, value = item.lstrip("+~").partition("=")
        if key in ("hydra.run.dir", "checkpoint.dir"):
            last[key] = value
    for key, value in last.items():
        absolute = posixpath.isabs(value)
        if key == "checkpoint.dir" and not absolute:
            continue  # under the run dir
        path = posixpath.normpath(value)
        # by path components: /mnt/ddptrain-old/run is not under /mnt/ddptrain
        if not absolute or not under(path, mount):
            raise ConfigError(f"{key}={value}: not on the checkpoint volume mounted at {mount} (--mount); a restarted "
                              "pod would not find the run's checkpoints")
    if "hydra.run.dir" in last:
        return posixpath.normpath(last["hydra.run.dir"])
    return posixpath.join(mount, "runs", name)


def under(path: str, mount: str) -> bool:
    """True when normalized ``path`` lies strictly below ``mount``, component by component."""
    inner, outer = PurePosixPath(path), PurePosixPath(mount)
    return inner != outer and inner.is_relative_to(outer)


def printed(kind: str, spec: JobSpec) -> list[Doc]:
    """The documents ``ddptrain-k8s`` prints: the claim when asked for, then the job (with --replica-groups: the
    lighthouse's Service and Deployment, then the JobSet of the groups)."""
    if spec.ft is None:
        return documents(kind, spec)
    return [*([volume_claim(spec)] if spec.claim_size else []), *k8s_ft.documents(spec)]


def render(kind: str, spec: JobSpec) -> str:
    """The manifest as YAML, each document apart (``---``), without anchors and aliases: every mapping is
    written out where it stands, as a reader (and an editor) of a manifest expects."""
    import yaml

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    groups = (f"{spec.ft.groups} replica groups x " if spec.ft else "")
    lighthouse = (f", lighthouse {k8s_ft.lighthouse_url(spec.name)} (quorum of {spec.ft.min_replicas} group(s))"
                  if spec.ft else "")
    header = (f"# ddptrain-k8s: {kind} {spec.name}: {groups}{spec.nodes} node(s) x {spec.procs_per_node} "
              f"process(es){lighthouse}, run dir {spec.run_dir} on claim {spec.claim}"
              f"{'' if spec.claim_size else ' (the claim must exist)'}; --name {spec.name} continues this run\n")
    return header + yaml.dump_all(printed(kind, spec), Dumper=Plain, sort_keys=False, default_flow_style=False)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        spec = job_spec(args)
    except ConfigError as exc:
        say(f"ddptrain-k8s: error: {exc}")
        return 2
    print(render(args.kind, spec), end="")
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))
