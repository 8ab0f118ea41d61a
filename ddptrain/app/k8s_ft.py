"""``ddptrain-k8s --replica-groups R``: torchft replica groups on Kubernetes. Plain dicts, as ``k8s_manifest``.

Three documents: the lighthouse's ``Service`` and ``Deployment`` (torchft's quorum server, one replica), then a
``JobSet`` of R replicated jobs, ``group-0`` .. ``group-<R-1>``, one Job each. Every pod of group g runs the same
``ddptrain`` command as the other kinds plus ``ft.replica_groups=R ft.replica_id=g ft.lighthouse=<the Service>``;
inside a group the pods meet through torchrun as a plain JobSet's do (``PET_*``, the group's first pod the master).

**One group restarts alone.** JobSet v0.9.1 has no action that recreates one child Job: a failed Job triggers its
``failurePolicy`` (``FailJobSet``, ``RestartJobSet`` or ``RestartJobSetAndIgnoreMaxRestarts``, every one of which
acts on all Jobs; ``RecreateJob`` is a later proposal, kubernetes-sigs/jobset#918). So the restart happens below the
JobSet: each group's Job has ``backoffLimit`` = ``ft.group_restarts`` x nodes, and the Job controller replaces a
failed pod of that Job (same completion index, same host name) while the Job stays active; the JobSet sees no
failed Job, and the other groups' pods are never touched. Only when a group has used its budget does its Job fail,
and then the JobSet's own policy applies: ``RestartJobSet`` of every group up to ``--max-restarts`` times (restart
the world, from the last checkpoint), except for a Job failed by its ``podFailurePolicy``, which fails the JobSet
at once.

Each Job's ``podFailurePolicy`` (restartPolicy Never, as it needs): exit code 2 of the container, what ddptrain
returns for bad input before anything starts, fails the Job (``FailJob``: a retry would be refused the same way),
and the JobSet rule ``onJobFailureReasons: [PodFailurePolicy]`` -> ``FailJobSet`` stops everything; a pod evicted or
preempted (condition ``DisruptionTarget``) is replaced without counting against the group's budget (``Ignore``).

**Host names.** torchft advertises ``socket.gethostname()`` to the lighthouse and its peers (the Manager's default
``hostname``, the HTTP checkpoint transport's URL), and a JobSet pod's host name is its short one,
``<jobset>-group-<g>-0-<i>``, whose DNS record lives under the JobSet's headless service
(``<host>.<jobset>.<namespace>.svc.<cluster domain>``). The pods' ``dnsConfig`` therefore adds that domain to their
search list, so a short host name resolves in every pod; which is why ``--replica-groups`` needs ``--namespace``.
"""

from __future__ import annotations

import dataclasses

from ddptrain.app.k8s_manifest import (
    COMPLETION_INDEX,
    CONTAINER,
    IMAGE_UID,
    MASTER_PORT,
    Doc,
    JobSpec,
    metadata,
    pod_spec,
)

LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's default --bind port
LIGHTHOUSE_BIND = f"[::]:{LIGHTHOUSE_PORT}"  # its default bind: every address, IPv6 and IPv4 (dual stack)
PORT_NAME = "lighthouse"  # the container port's name (an IANA service name: at most 15 characters)
GROUP = "group"  # the replicated jobs' prefix: group-0 .. group-<R-1>
BAD_INPUT_EXIT = 2  # ddptrain's exit code for input it refuses (a config error): retrying cannot help
BAD_INPUT_RULE = "bad_input"  # JobSet failure-policy rule names: ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$
INSTANCE, COMPONENT = "app.kubernetes.io/instance", "app.kubernetes.io/component"
GROUP_LABEL = "ddptrain.dev/replica-group"


def group_name(g: int) -> str:
    return f"{GROUP}-{g}"


def lighthouse_name(name: str) -> str:
    """The lighthouse's Service and Deployment: ``<name>-lighthouse``."""
    return f"{name}-lighthouse"


def lighthouse_url(name: str) -> str:
    """The lighthouse as the pods reach it: its Service's short name (same namespace) and port."""
    return f"http://{lighthouse_name(name)}:{LIGHTHOUSE_PORT}"


def ft_overrides(name: str, groups: int, g: int) -> list[str]:
    """What every pod of group ``g`` adds to the run's overrides (after them: these win)."""
    return [f"ft.replica_groups={groups}", f"ft.replica_id={g}", f"ft.lighthouse={lighthouse_url(name)}"]


def group_master(spec: JobSpec, g: int) -> str:
    """Group ``g``'s first pod under the JobSet's headless service: ``<jobset>-group-<g>-0-0.<jobset>``."""
    return f"{spec.name}-{group_name(g)}-0-0.{spec.name}"


def longest_pod_name(name: str, groups: int, nodes: int) -> str:
    """The longest pod name JobSet generates for R groups of ``nodes`` pods, with the pod's random suffix (what its
    webhook checks against 63 characters)."""
    return f"{name}-{group_name(groups - 1)}-0-{nodes - 1}-abcde"


def labels(spec: JobSpec, component: str) -> dict[str, str]:
    return {**metadata(spec)["labels"], INSTANCE: spec.name, COMPONENT: component}


def search_domain(spec: JobSpec) -> str:
    assert spec.ft is not None
    return f"{spec.name}.{spec.ft.namespace}.svc.{spec.ft.cluster_domain}"


def group_job(spec: JobSpec, g: int) -> Doc:
    """Group ``g``: one indexed Job of ``nodes`` pods, restarted pod by pod by the Job controller (module doc)."""
    assert spec.ft is not None
    pet = [{"name": "PET_NNODES", "value": str(spec.nodes)},
           {"name": "PET_NPROC_PER_NODE", "value": str(spec.procs_per_node)},
           {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
           {"name": "PET_MASTER_ADDR", "value": group_master(spec, g)},
           {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)}]
    group = dataclasses.replace(spec, args=[*spec.args, *ft_overrides(spec.name, spec.ft.groups, g)])
    pod = pod_spec(group, CONTAINER["jobset"], "Never", pet)
    pod["dnsConfig"] = {"searches": [search_domain(spec)]}
    failure = {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER["jobset"], "operator": "In",
                                              "values": [BAD_INPUT_EXIT]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}
    job = {"parallelism": spec.nodes, "completions": spec.nodes, "completionMode": "Indexed",
           "backoffLimit": spec.ft.group_restarts * spec.nodes, "podFailurePolicy": failure,
           "template": {"metadata": {"labels": {**labels(spec, "replica-group"), GROUP_LABEL: str(g)}},
                        "spec": pod}}
    return {"name": group_name(g), "replicas": 1, "template": {"spec": job}}


def job_set(spec: JobSpec) -> Doc:
    """The replica groups: R replicated jobs behind the JobSet's headless service (module doc)."""
    assert spec.ft is not None
    policy = {"maxRestarts": spec.max_restarts, "rules": [
        {"name": BAD_INPUT_RULE, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata(spec),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": policy,
                     "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
                     "replicatedJobs": [group_job(spec, g) for g in range(spec.ft.groups)]}}


def lighthouse_deployment(spec: JobSpec) -> Doc:
    """torchft's lighthouse, the wheel's ``torchft_lighthouse``, as one pod: ``Recreate`` (two lighthouses at once,
    during a rolling update, would each hold half of the groups), the image's non-root user, a readiness probe on its
    port, a small CPU and memory request."""
    assert spec.ft is not None
    selected = labels(spec, "lighthouse")
    container = {
        "name": "lighthouse", "image": spec.image, "command": ["torchft_lighthouse"],
        "args": ["--min_replicas", str(spec.ft.min_replicas), "--bind", LIGHTHOUSE_BIND,
                 "--join_timeout_ms", str(spec.ft.join_timeout_ms)],
        "ports": [{"name": PORT_NAME, "containerPort": LIGHTHOUSE_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [container]}
    meta = {**metadata(spec), "name": lighthouse_name(spec.name), "labels": selected}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": dict(selected)},
                     "template": {"metadata": {"labels": dict(selected)}, "spec": pod}}}


def lighthouse_service(spec: JobSpec) -> Doc:
    """The lighthouse's stable name, ``<name>-lighthouse``, the host of every pod's ``ft.lighthouse``."""
    selected = labels(spec, "lighthouse")
    meta = {**metadata(spec), "name": lighthouse_name(spec.name), "labels": selected}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": dict(selected),
                     "ports": [{"name": PORT_NAME, "port": LIGHTHOUSE_PORT, "targetPort": PORT_NAME,
                                "protocol": "TCP"}]}}


def documents(spec: JobSpec) -> list[Doc]:
    """The lighthouse first (its Service, then its Deployment), then the groups: the groups' first quorum finds the
    lighthouse's name in place."""
    return [lighthouse_service(spec), lighthouse_deployment(spec), job_set(spec)]

