"""The pods a manifest of ``ddptrain-k8s`` becomes, as local processes: each pod's command and environment, derived
from the manifest by the operator's contract, not written by hand.

What each operator adds to the container it runs (read in their sources, see ``ddptrain/app/k8s_manifest.py``):

- Trainer v2's Torch plugin: ``PET_NNODES`` = ``trainer.numNodes``, ``PET_NPROC_PER_NODE`` = ``numProcPerNode``,
  ``PET_NODE_RANK`` = the pod's Job completion index, ``PET_MASTER_ADDR`` = ``<name>-node-0-0.<name>``,
  ``PET_MASTER_PORT`` = 29500 (its ``ContainerTrainerPort``), after ``trainer.env``; the runtime patch mounts the
  volumes;
- Training Operator v1: ``PYTHONUNBUFFERED``, ``MASTER_ADDR`` = ``<name>-master-0``, ``MASTER_PORT`` = 23456,
  ``WORLD_SIZE`` = pods x ``nprocPerNode``, ``RANK`` = the pod's rank (master 0, worker i: i + 1),
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` = that rank, ``PET_NNODES`` = pods;
- JobSet: nothing of torchrun's; the completion index through the downward API (the manifest's ``PET_NODE_RANK``).

On one machine the pods' host names resolve to the loopback address, the master's port is a free one (another
job here may hold the operator's), and the checkpoint volume is a directory: the claim's mount path is replaced
by it in the environment and the arguments. A Secret's variable (W&B's key) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.helpers.webhooks import CONTAINER_TRAINER_PORT

COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@dataclass(frozen=True)
class Pod:
    argv: list[str]  # command + args
    env: dict[str, str]


def pods(manifest: dict[str, Any], volume: str, port: int) -> list[Pod]:
    """One ``Pod`` per node of ``manifest``, with ``volume`` for the checkpoint claim and ``port`` for the master."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    if kind == "TrainJob":
        trainer = manifest["spec"]["trainer"]
        patch = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod_spec = patch["template"]["spec"]["template"]["spec"]
        nodes = trainer["numNodes"]
        made = []
        for index in range(nodes):
            env = resolve(trainer["env"], index) | {
                "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                "PET_MASTER_PORT": str(CONTAINER_TRAINER_PORT)}
            made.append(local(Pod([*trainer["command"], *trainer["args"]], env), pod_spec["containers"][0], volume,
                              port, name))
        return made
    if kind == "PyTorchJob":
        spec = manifest["spec"]
        replicas = [("master", spec["pytorchReplicaSpecs"]["Master"])]
        if "Worker" in spec["pytorchReplicaSpecs"]:
            replicas.append(("worker", spec["pytorchReplicaSpecs"]["Worker"]))
        total = sum(r["replicas"] for _, r in replicas)
        nproc = spec["nprocPerNode"]
        made = []
        for role, replica in replicas:
            (container,) = replica["template"]["spec"]["containers"]
            for i in range(replica["replicas"]):
                rank = i if role == "master" else i + 1
                env = resolve(container["env"], rank) | {
                    "PYTHONUNBUFFERED": "0", "MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": "23456",
                    "WORLD_SIZE": str(total * int(nproc)), "RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
                    "PET_NODE_RANK": str(rank), "PET_NNODES": str(total)}
                made.append(local(Pod([*container["command"], *container["args"]], env), container, volume, port,
                                  name))
        return made
    if kind == "JobSet":  # every replicated job's pods, job by job (ddptrain-k8s prints one Job per replicated job)
        made = []
        for job in manifest["spec"]["replicatedJobs"]:
            spec = job["template"]["spec"]
            (container,) = spec["template"]["spec"]["containers"]
            made += [local(Pod([*container["command"], *container["args"]], resolve(container["env"], index)),
                           container, volume, port, name) for index in range(spec["completions"])]
        return made
    raise ValueError(f"unknown kind {kind}")


def resolve(env: list[dict[str, Any]], completion_index: int) -> dict[str, str]:
    """A container's ``env`` as the kubelet gives it to the process (a Secret's variable left out)."""
    out = {}
    for var in env:
        if "value" in var:
            out[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == COMPLETION_INDEX:
            out[var["name"]] = str(completion_index)
        elif "secretKeyRef" not in var.get("valueFrom", {}):
            raise ValueError(f"cannot resolve {var}")
    return out


def local(pod: Pod, container: dict[str, Any], volume: str, port: int, name: str) -> Pod:
    """``pod`` on this machine: the claim's mount is ``volume``, the job's host names are the loopback address."""
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "runs"]

    def here(text: str) -> str:
        text = text.replace(mount, volume)
        return "127.0.0.1" if text in (f"{name}-node-0-0.{name}", f"{name}-master-0") else text

    env = {k: here(v) for k, v in pod.env.items()}
    for key in ("PET_MASTER_PORT", "MASTER_PORT"):
        if key in env:
            env[key] = str(port)
    return Pod([here(a) for a in pod.argv], env)
