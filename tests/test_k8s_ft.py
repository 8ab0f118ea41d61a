"""``ddptrain-k8s --replica-groups R``: the torchft lighthouse's Service and Deployment and a JobSet of R replica
groups, checked as the other manifests are (the JobSet's CRD schema and ported webhook; the core objects' name,
label, port and selector rules), each group's pod command composed with ddptrain's own config, and the refusals.
No cluster and no process: every manifest is built in this process (one config composition each)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from ddptrain.app import k8s, k8s_ft
from ddptrain.config.compose import compose_config, typed_config
from ddptrain.errors import ConfigError
from tests.helpers.core_rules import core_errors, restricted_errors, selects, wiring_errors
from tests.helpers.crds import schema_errors
from tests.helpers.pods import pods
from tests.helpers.webhooks import admission_errors

IMAGE = "ghcr.io/example/ddptrain:1"
# 3 groups of 2 CPU nodes x 2 processes: 12 ranks; ft.min_replicas=2 and ft.group_restarts=5 (not the defaults);
# --ib and --wandb-secret, which every group's pods must carry as a plain job's do
GROUPS = ["--replica-groups", "3", "--nodes", "2", "--gpus-per-node", "0", "--namespace", "ml", "--name", "ftrun",
          "--claim-size", "1Ti", "--ib", "rdma/ib", "--wandb-secret", "wandb",
          "launch.nproc_per_node=2", "data.global_batch_size=96", "ft.min_replicas=2",
          "ft.group_restarts=5"]


def printed(flags: list[str]) -> list[dict[str, Any]]:
    """What ddptrain-k8s prints for ``flags``, read back from its YAML."""
    args = k8s.parse_args(["--image", IMAGE, *flags])
    return list(yaml.safe_load_all(k8s.render(args.kind, k8s.job_spec(args))))


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in printed(GROUPS)}


def _jobs(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    return [j["template"]["spec"] for j in jobset["spec"]["replicatedJobs"]]


def test_the_documents_come_lighthouse_first_and_each_passes_what_kubectl_apply_checks(docs) -> None:
    assert list(docs) == ["PersistentVolumeClaim", "Service", "Deployment", "JobSet"]
    jobset, service, deployment = docs["JobSet"], docs["Service"], docs["Deployment"]
    assert schema_errors(jobset) == [] and admission_errors(jobset) == []
    assert core_errors(service) == [] and core_errors(deployment) == []
    assert wiring_errors(service, deployment) == []
    # a namespace that enforces the "restricted" Pod Security Standard admits the lighthouse (checked in this test,
    # the first to use the module's documents: mutmut credits a module fixture's calls to that test alone)
    assert restricted_errors(deployment["spec"]["template"]["spec"]) == []
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # 6 pods share the run dir
    for doc in docs.values():
        assert doc["metadata"]["namespace"] == "ml"
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "ddptrain"


def test_one_replicated_job_per_group_each_restarted_alone_by_its_own_job(docs) -> None:
    """JobSet v0.9.1 acts on every Job when one fails: a group restarts alone only below it, by its Job's
    backoffLimit (ft.group_restarts=5 x 2 nodes pod failures), the JobSet's policy left for a group past its budget
    and for bad input (exit 2: FailJob, then FailJobSet)."""
    jobset = docs["JobSet"]
    assert [j["name"] for j in jobset["spec"]["replicatedJobs"]] == ["group-0", "group-1", "group-2"]
    assert {j["replicas"] for j in jobset["spec"]["replicatedJobs"]} == {1}
    assert not any("dependsOn" in j for j in jobset["spec"]["replicatedJobs"])
    for job in _jobs(jobset):
        assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
        assert job["backoffLimit"] == 10
        assert job["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy needs
        rules = job["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In",
                                                                 "values": [2]}}
        assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [
        {"name": "bad_input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    # the budget follows ft.group_restarts (the default 3 here) and the group's node count
    default = {d["kind"]: d for d in printed(["--replica-groups", "2", "--namespace", "ml", "--nodes", "4",
                                                     "data.global_batch_size=64"])}
    assert {j["backoffLimit"] for j in _jobs(default["JobSet"])} == {12}


def test_each_groups_pods_compose_with_ddptrains_config_and_find_the_lighthouse(docs) -> None:
    """Each pod's command, derived from the printed manifest by JobSet's contract, composed by ddptrain's own
    config: the group's ft.replica_id, the lighthouse the Service names on the port it listens on."""
    service, deployment = docs["Service"], docs["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    made = pods(docs["JobSet"], "/tmp/volume", 29500)
    assert len(made) == 6
    by_group: dict[int, list[Any]] = {}
    for pod in made:
        assert pod.argv[:2] == ["ddptrain", "train.resume=auto"]
        typed = typed_config(compose_config(pod.argv[1:])).typed
        by_group.setdefault(typed.ft.replica_id, []).append(pod)
        assert (typed.ft.replica_groups, typed.ft.min_replicas, typed.ft.group_restarts) == (3, 2, 5)
        url = urlsplit(typed.ft.lighthouse)
        assert (url.scheme, url.hostname) == ("http", service["metadata"]["name"])
        (port,) = service["spec"]["ports"]
        assert url.port == port["port"] == k8s_ft.LIGHTHOUSE_PORT
        assert container["args"][container["args"].index("--bind") + 1].endswith(f":{url.port}")
        assert container["args"][container["args"].index("--min_replicas") + 1] == str(typed.ft.min_replicas)
    assert sorted(by_group) == [0, 1, 2]
    for g, group in by_group.items():  # the group's nodes meet at the group's first pod, ranks 0 and 1
        assert {p.env["PET_MASTER_ADDR"] for p in group} == {f"ftrun-group-{g}-0-0.ftrun"}
        assert sorted(p.env["PET_NODE_RANK"] for p in group) == ["0", "1"]
        assert {p.env["DDPTRAIN_RUN_DIR"] for p in group} == {"/tmp/volume/runs/ftrun"}  # one run dir for all


def test_the_lighthouse_runs_as_the_images_user_and_its_service_selects_only_it(docs) -> None:
    deployment, service = docs["Deployment"], docs["Service"]
    pod = deployment["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsNonRoot"]) == (10001, True)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = pod["containers"]
    assert container["command"] == ["torchft_lighthouse"] and container["image"] == IMAGE
    assert container["readinessProbe"]["tcpSocket"]["port"] == "lighthouse"
    assert "limits" in container["resources"] and "requests" in container["resources"]
    for job in _jobs(docs["JobSet"]):  # the training pods are not behind the lighthouse's Service
        assert not selects(service["spec"]["selector"], job["template"]["metadata"]["labels"])
        assert job["template"]["spec"]["securityContext"]["fsGroup"] == 10001
        assert job["template"]["spec"]["dnsConfig"] == {"searches": ["ftrun.ml.svc.cluster.local"]}
        (node,) = job["template"]["spec"]["containers"]
        env = {e["name"]: e for e in node["env"]}
        assert node["resources"]["limits"] == {"rdma/ib": 1} and env["NCCL_IB_DISABLE"]["value"] == "0"
        assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}


def test_the_checks_refuse_what_the_api_server_and_the_webhook_refuse(docs) -> None:
    """Each check, seen refusing a broken copy (so the passing checks above mean something)."""
    import copy

    jobset, service, deployment = (copy.deepcopy(docs[k]) for k in ("JobSet", "Service", "Deployment"))
    jobset["spec"]["failurePolicy"]["rules"][0]["name"] = "bad-input"
    jobset["spec"]["replicatedJobs"][1]["dependsOn"] = [{"name": "group-9", "status": "Ready"}]
    assert admission_errors(jobset) == [
        "replicatedJob: group-1 cannot depend on replicatedJob: group-9",
        "invalid failure policy rule name 'bad-input', a failure policy rule name must start with an alphabetic "
        "character, optionally followed by a string of alphanumeric characters or '_,:', and must end with an "
        "alphanumeric character or '_'"]
    deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "other"
    assert "`selector` does not match template `labels`" in "\n".join(core_errors(deployment))
    service["spec"]["ports"][0]["port"] = 29511
    service["spec"]["ports"][0]["targetPort"] = "lighthouse-port-1"  # 17 characters: no IANA service name
    assert any("must be no more than 15 characters" in e for e in core_errors(service))
    assert wiring_errors(service, deployment) == [
        "the Service's selector does not select the Deployment's pods",
        "the Service's targetPort lighthouse-port-1 is no port of the container"]
    service["metadata"]["name"] = "1-lighthouse"
    assert "a DNS-1035 label" in core_errors(service)[0]
    service["apiVersion"], deployment["apiVersion"] = "apps/v1", "v1"  # each the other's group: no such kind there
    assert core_errors(service)[0] == 'no matches for kind "Service" in version "apps/v1" (expected v1)'
    assert core_errors(deployment)[0] == 'no matches for kind "Deployment" in version "v1" (expected apps/v1)'
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    container["securityContext"]["capabilities"] = {"drop": ["NET_RAW"], "add": ["SYS_ADMIN"]}
    del container["securityContext"]["allowPrivilegeEscalation"]
    pod["securityContext"] = {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}}
    assert restricted_errors(pod) == [
        "spec.containers[0].securityContext.allowPrivilegeEscalation != false",
        'spec.containers[0].securityContext.capabilities.drop=["ALL"] is not set',
        "spec.containers[0].securityContext.capabilities.add holds more than NET_BIND_SERVICE",
        "spec.containers[0].securityContext.runAsNonRoot != true (nor the pod's)",
        "spec.containers[0].securityContext.runAsUser=0",
        "spec.containers[0].securityContext.seccompProfile.type is 'Unconfined', not RuntimeDefault or Localhost "
        "(nor the pod's)"]
    # the container's own settings win over the pod's
    container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "Localhost"}}
    assert restricted_errors(pod) == []



def test_restricted_checks_every_container_refuses_privileged_and_leaves_an_unset_uid_to_the_image() -> None:
    """The rules the lighthouse's passing pod does not reach: ``privileged`` (baseline's, which restricted keeps),
    each container checked (not only the first), and ``runAsUser`` refused only at 0 (unset, the image's user runs:
    ``runAsNonRoot`` makes the kubelet check it); a document without ``apiVersion`` maps to no kind either."""
    good = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pod = {"containers": [{"name": "a", "securityContext": dict(good)},
                          {"name": "b", "securityContext": dict(good, privileged=True)}]}
    assert restricted_errors(pod) == ["spec.containers[1].securityContext.privileged=true"]
    pod["containers"][1]["securityContext"] = dict(good, runAsUser=0)
    assert restricted_errors(pod) == ["spec.containers[1].securityContext.runAsUser=0"]
    pod["containers"][1]["securityContext"] = dict(good)
    assert restricted_errors(pod) == []
    service = {"kind": "Service", "metadata": {"name": "lighthouse"},
               "spec": {"selector": {"app": "x"}, "ports": [{"name": "lighthouse", "port": 29510}]}}
    assert core_errors({"apiVersion": "v1", **service}) == []
    assert core_errors(service) == ['no matches for kind "Service" in version "None" (expected v1)']

def test_kind_defaults_to_jobset_with_replica_groups_only() -> None:
    assert k8s.parse_args(["--image", IMAGE]).kind == "trainjob"
    assert k8s.parse_args(["--image", IMAGE, "--replica-groups", "2"]).kind == "jobset"


@pytest.mark.parametrize(("groups", "nodes"), [(2, 1), (3, 100), (10, 10_000_000)])
def test_the_longest_name_the_cli_takes_for_r_groups_is_admitted_and_one_more_is_refused(groups: int,
                                                                                         nodes: int) -> None:
    """The JobSet webhook wants <name>-group-<R-1>-0-<nodes-1>-abcde within 63 characters."""
    budget = 63 - len(k8s_ft.longest_pod_name("", groups, nodes))
    flags = ["--replica-groups", str(groups), "--nodes", str(nodes), "--gpus-per-node", "0", "--namespace", "ml",
             f"data.global_batch_size={groups * nodes * 8}", "data.micro_batch_size=1"]
    longest = min(budget, k8s.MAX_NAME)
    (jobset,) = [d for d in printed([*flags, "--name", "a" * longest]) if d["kind"] == "JobSet"]
    assert admission_errors(jobset) == []
    if budget < k8s.MAX_NAME:  # one character more: refused here, and by the webhook
        with pytest.raises(ConfigError, match=f"too long for {groups} replica groups"):
            k8s.job_spec(k8s.parse_args(["--image", IMAGE, *flags, "--name", "a" * (budget + 1)]))
        jobset["metadata"]["name"] = "a" * (budget + 1)
        assert admission_errors(jobset)[0].endswith("pod names generated for this JobSet will exceed 63 characters")


REFUSED = [
    (["--replica-groups", "2", "--kind", "trainjob"], "--replica-groups with --kind trainjob: expected --kind jobset"),
    (["--replica-groups", "2", "--kind", "pytorchjob"], "--replica-groups with --kind pytorchjob: expected"),
    (["--replica-groups", "1"], "--replica-groups 1: expected 2 or more groups"),
    (["--replica-groups", "0"], "--replica-groups 0: expected 2 or more groups"),
    (["--replica-groups", "2", "--namespace", ""], "--replica-groups needs --namespace NS"),
    (["--replica-groups", "2", "--cluster-domain", "Cluster_Local"], "--cluster-domain Cluster_Local: expected"),
    (["--replica-groups", "10", "--name", "a" * 40, "--nodes", "10000000"],
     f"--name {'a' * 40}: too long for 10 replica groups of 10000000 node(s)"),
    (["--replica-groups", "2", "data.global_batch_size=64", "ft.replica_id=1"],
     "ft.replica_id=1: set in each pod by --replica-groups"),
    (["--replica-groups", "2", "ft.lighthouse=http://x:1"], "ft.lighthouse=http://x:1: set in each pod by"),
    (["--replica-groups", "2", "+ft.replica_groups=4"], "+ft.replica_groups=4: set in each pod by"),
    (["ft.replica_groups=2"], "ft.replica_groups=2: on Kubernetes the replica groups are pods of their own"),
    (["--replica-groups", "3", "ft.min_replicas=4"], "ft.min_replicas=4: expected 1 to ft.replica_groups (3)"),
    # the batch divides over every group's ranks: 3 groups x 2 nodes x 4 GPUs = 24
    (["--replica-groups", "3", "--nodes", "2", "--gpus-per-node", "4", "data.global_batch_size=64"],
     "data.global_batch_size=64 is not divisible by"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED, ids=[m[:36] for _, m in REFUSED])
def test_what_replica_groups_cannot_do_is_refused_in_one_line(flags: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    namespace = [] if "--namespace" in flags or "--replica-groups" not in flags else ["--namespace", "ml"]
    assert k8s.run(["--image", IMAGE, *namespace, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ddptrain-k8s: error: ") and message in err, err
