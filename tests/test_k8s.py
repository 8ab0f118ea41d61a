"""``ddptrain-k8s``: the manifests of the three kinds against their operators' CRD schemas, the refusals, and the
operators' environment contract executed: a manifest's pods run as local processes with the environment each pod
would get (``tests/helpers/pods.py``), train as one job, and a pod restarted after a kill continues from the
volume."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddptrain.app import k8s
from ddptrain.app.k8s_manifest import KINDS, manifest
from ddptrain.errors import ConfigError
from tests.helpers import procs
from tests.helpers.cli import test_env
from tests.helpers.crds import CRDS, PINNED, duplicates, schema_errors, strict
from tests.helpers.pods import Pod, pods
from tests.helpers.run_cache import RunCache
from tests.helpers.webhooks import CONTAINER_TRAINER_PORT, TORCH_DISTRIBUTED, admission_errors, merged_names
from tests.helpers.worker_run import reference_losses

BIN = Path(sys.executable).parent
IMAGE = "ghcr.io/example/ddptrain:1"
VARIANTS = {  # flags beyond the kind: GPU nodes with InfiniBand and W&B, CPU pods, one node
    "gpu-ib-wandb": ["--nodes", "2", "--gpus-per-node", "8", "--ib", "rdma/ib", "--ib-hca", "mlx5",
                     "--wandb-secret", "wandb:api-key", "--env", "NCCL_SOCKET_IFNAME=eth0",
                     "data.global_batch_size=256"],
    "cpu": ["--nodes", "3", "--gpus-per-node", "0", "launch.nproc_per_node=2", "data.global_batch_size=48",
            "--namespace", "research", "--name", "tiny-run"],
    "one-node": ["--nodes", "1", "--gpus-per-node", "4", "hydra.run.dir=/mnt/ddptrain/runs/mine"],
}


def generated(kind: str, flags: list[str]) -> dict[str, Any]:
    args = k8s.parse_args(["--image", IMAGE, "--kind", kind, *flags])
    return manifest(kind, k8s.job_spec(args))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_manifest_passes_its_operators_crd_and_admission_webhook(kind: str, variant: str) -> None:
    """What ``kubectl apply`` checks: the CRD's schema, then the operator's validating webhook (ported rules)."""
    doc = generated(kind, VARIANTS[variant])
    assert schema_errors(doc) == []
    assert admission_errors(doc) == []
    assert doc["kind"] == {"trainjob": "TrainJob", "pytorchjob": "PyTorchJob", "jobset": "JobSet"}[kind]


def test_the_schema_check_refuses_an_unknown_field_a_wrong_type_and_a_bad_quantity() -> None:
    doc = generated("jobset", VARIANTS["gpu-ib-wandb"])
    pod = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = []  # a typo kubectl's strict validation refuses
    pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "eight"
    doc["spec"]["failurePolicy"]["maxRestarts"] = "3"
    errors = "\n".join(schema_errors(doc))
    assert "'volumeMount' was unexpected" in errors
    assert "'eight' does not match" in errors
    assert "'3' is not of type 'integer'" in errors


def _holders(doc: Any, key: str) -> list[dict[str, Any]]:
    """Every mapping in ``doc`` that has ``key``, outermost first."""
    if isinstance(doc, list):
        return [h for v in doc for h in _holders(v, key)]
    if not isinstance(doc, dict):
        return []
    return ([doc] if key in doc else []) + [h for v in doc.values() for h in _holders(v, key)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_crd_refuses_a_typo_deep_in_the_pod_and_a_missing_required_field(kind: str) -> None:
    """Strictness reaches the core Kubernetes types the operators embed (the pod template, or the TrainJob's
    runtime patch), not only the operator's own fields."""
    doc = generated(kind, VARIANTS["gpu-ib-wandb"])
    container = _holders(doc, "volumeMounts")[0]
    container["volumeMount"] = container.pop("volumeMounts")
    claim = _holders(doc, "claimName")[0]
    claim["readonly"] = claim.pop("claimName")
    errors = "\n".join(schema_errors(doc))
    assert "'volumeMount' was unexpected" in errors, errors
    assert "'readonly' was unexpected" in errors and "'claimName' is a required property" in errors, errors

@pytest.mark.parametrize("kind", KINDS)
def test_a_variable_given_with_env_replaces_the_manifests_own_of_that_name(kind: str) -> None:
    """A container's env is a list map keyed by name: the API server refuses a name given twice."""
    doc = generated(kind, [*VARIANTS["gpu-ib-wandb"], "--env", "NCCL_DEBUG=WARN", "--env", "X=1", "--env", "X=2"])
    assert schema_errors(doc) == []
    for holder in _holders(doc, "env"):
        values = [(e["name"], e.get("value")) for e in holder["env"]]
        assert ("NCCL_DEBUG", "WARN") in values and ("X", "2") in values, values


def test_the_strict_schema_closes_named_objects_keeps_preserved_ones_open_and_takes_int_or_string() -> None:
    """The derivation on a schema of each form, including those the vendored CRDs do not use."""
    import jsonschema

    named = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = strict({"type": "object", "properties": {
        "closed": named, "kept": {**named, "x-kubernetes-preserve-unknown-fields": True},
        "quantity": {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+Gi$"}}})

    def errors(doc: dict[str, Any]) -> list[str]:
        return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]

    assert errors({"closed": {"a": "x"}, "kept": {"a": "x", "b": 1}, "quantity": 8}) == []
    assert errors({"quantity": "16Gi"}) == []
    assert errors({"closed": {"b": 1}}) == ["Additional properties are not allowed ('b' was unexpected)"]
    assert errors({"other": 1}) == ["Additional properties are not allowed ('other' was unexpected)"]
    assert len(errors({"quantity": 1.5})) == len(errors({"quantity": "lots"})) == 1

def test_list_maps_and_sets_refuse_an_item_twice_a_left_out_key_counting_with_its_default() -> None:
    item = {"type": "object", "properties": {"port": {"type": "integer"}, "protocol": {"type": "string",
                                                                                       "default": "TCP"}}}
    schema = {"type": "object", "properties": {
        "ports": {"type": "array", "items": item, "x-kubernetes-list-type": "map",
                  "x-kubernetes-list-map-keys": ["port", "protocol"]},
        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
        "args": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "atomic"}}}
    assert duplicates({"ports": [{"port": 1}, {"port": 1, "protocol": "UDP"}], "tags": ["a", "b"],
                       "args": ["x", "x"]}, schema) == []
    assert duplicates({"ports": [{"port": 1}, {"port": 1, "protocol": "TCP"}], "tags": ["a", "a"]}, schema) == [
        "/ports/1: Duplicate value: [1, 'TCP']", "/tags/1: Duplicate value: 'a'"]

def test_the_crds_are_the_upstream_files_at_their_release_tags_as_the_readme_says() -> None:
    """The vendored CRDs are byte for byte the upstream files at the pinned tags: nobody trims or edits them by
    hand, and the README beside them names the same tag, commit, path and hash."""
    import hashlib

    readme = (CRDS / "README.md").read_text()
    for pinned in PINNED:
        assert hashlib.sha256((CRDS / pinned.file).read_bytes()).hexdigest() == pinned.sha256, pinned.file
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{pinned.file}`")), "")
        for value in (pinned.repository, pinned.tag, pinned.commit, pinned.path, pinned.sha256):
            assert value in row, (pinned.file, value)

def test_the_pods_have_what_nccl_needs_and_the_run_dir_on_the_volume() -> None:
    doc = generated("pytorchjob", VARIANTS["gpu-ib-wandb"])
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]}
    env = {e["name"]: e for e in container["env"]}
    assert container["command"] == ["ddptrain"] and container["args"][:2] == ["train.resume=auto",
                                                                            "data.global_batch_size=256"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1}
    assert "securityContext" not in container  # a capability would not survive execve for uid 10001
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {"/dev/shm": "dshm",
                                                                             "/mnt/ddptrain": "runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "ddptrain-runs"}
    assert env["DDPTRAIN_RUN_DIR"]["value"] == f"/mnt/ddptrain/runs/{doc['metadata']['name']}"
    assert (env["NCCL_IB_HCA"]["value"], env["NCCL_DEBUG"]["value"]) == ("mlx5", "INFO")
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
    assert doc["spec"]["nprocPerNode"] == "8" and doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1


def test_a_trainjob_leaves_torchruns_variables_to_the_operator_and_has_a_name_it_accepts() -> None:
    """Trainer's Torch plugin refuses PET_* in trainer.env (a webhook, not the schema); the CRD's CEL rule wants
    an RFC 1035 name."""
    doc = generated("trainjob", VARIANTS["cpu"])
    assert not [e["name"] for e in doc["spec"]["trainer"]["env"] if e["name"].startswith("PET_")]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert (doc["spec"]["trainer"]["numNodes"], doc["spec"]["trainer"]["numProcPerNode"]) == (3, 2)
    assert "resourcesPerNode" not in doc["spec"]["trainer"]  # CPU pods ask for no GPU



def test_trainers_webhook_refuses_a_patch_manager_without_a_domain_which_its_crd_accepts() -> None:
    """Trainer v2.3 checks every runtimePatches[].manager with IsDomainPrefixedPath (a webhook rule the CRD, which
    bounds only its length, does not hold): the manager ddptrain-k8s printed before was refused at apply."""
    doc = generated("trainjob", VARIANTS["cpu"])
    (patch,) = doc["spec"]["runtimePatches"]
    assert admission_errors(doc) == [] and "/" in patch["manager"]
    patch["manager"] = "ddptrain-k8s"
    assert schema_errors(doc) == []
    assert admission_errors(doc) == ['spec.runtimePatches.manager: Invalid value: "ddptrain-k8s": must be a '
                                     'domain-prefixed path (such as "acme.io/foo")']
    patch["manager"] = "DDPtrain.dev/k8s"  # the domain must be a lower-case RFC 1123 subdomain
    assert admission_errors(doc)[0].startswith('spec.runtimePatches.manager: Invalid value: "DDPtrain.dev": a '
                                               "lowercase RFC 1123 subdomain")


def test_the_ported_webhook_rules_refuse_what_each_operator_refuses() -> None:
    """Each ported rule that touches a field ddptrain-k8s writes, seen refusing (so the passing checks above mean
    something): Trainer's patch and env rules, the PyTorchJob's replica rules, the JobSet's name lengths."""
    trainjob = generated("trainjob", VARIANTS["gpu-ib-wandb"])
    job = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    container = job["template"]["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "X", "value": "1"}]
    trainjob["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    errors = admission_errors(trainjob)
    assert "spec.runtimePatches: Invalid value: must not have envs for the dataset-initializer, model-initializer, "\
           "node containers" in errors
    assert "spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: [PET_NNODES]" \
           in errors
    # Trainer merges the patches into the runtime's template (by name) before its plugins validate: a container or
    # a replicated job the runtime lacks is by then in the template, and the "doesn't exist" rules admit it
    trainjob["spec"]["trainer"]["env"].pop()
    container["name"] = "trainer"  # the env rule holds only for the node and initializer containers
    assert admission_errors(trainjob) == []
    job["name"] = "worker"
    assert admission_errors(trainjob) == []

    pytorchjob = generated("pytorchjob", ["--nodes", "3", "--gpus-per-node", "8", "data.global_batch_size=192"])
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["replicas"] = 2
    replicas["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    assert admission_errors(pytorchjob) == [
        "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
        "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: must have at least one container "
        "with name pytorch"]

    jobset = generated("jobset", ["--nodes", "2", "--gpus-per-node", "8", "data.global_batch_size=128"])
    jobset["metadata"]["name"] = "a" * 50  # longer than ddptrain-k8s allows: the pods' names pass 63 characters
    assert [e.rsplit(": ", 1)[-1] for e in admission_errors(jobset)] == [
        "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters"]


def test_a_trainjobs_patch_names_only_the_runtimes_job_and_container() -> None:
    """Trainer admits a patch naming a job or container the runtime lacks (merged into its template by name, see
    the previous test); the JobSet it creates would then hold a container without an image, refused only when its
    Job is created. So the patch must name the torch-distributed runtime's own job and container."""
    doc = generated("trainjob", VARIANTS["gpu-ib-wandb"])
    assert merged_names(TORCH_DISTRIBUTED, doc["spec"]["runtimePatches"]) == TORCH_DISTRIBUTED


# apimachinery v0.36.2 IsDomainPrefixedPath: the manager values Go admits (None) or refuses (its message's end);
# the regexps as validation.go writes them (httpPathFmt, dns1123SubdomainFmt)
GO_PATH_ERROR = r"Invalid path (regex used for validation is '[A-Za-z0-9/\-._~%!$&'()*+,;=:]+')"
GO_SUBDOMAIN_FMT = r"regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
NO_DOMAIN = 'must be a domain-prefixed path (such as "acme.io/foo")'
MANAGERS = [
    ("ddptrain.dev/ddptrain-k8s", None),
    ("ddptrain.dev/k8s/v1", None),  # SplitN(.., "/", 2): the rest, slashes and all, is the HTTP path
    ("acme.io//foo", None),
    ("a.b-c.d/x:y;z=1,2+3*(4)!$&'~%", None),  # characters of the HTTP path's class
    ("ddptrain-k8s", NO_DOMAIN),
    ("acme.io/", NO_DOMAIN),
    ("/foo", NO_DOMAIN),
    ("", "Required value"),
    ("acme.io/foo bar", GO_PATH_ERROR),
    ("acme.io/foo?q", GO_PATH_ERROR),
    ("acme.io/foo\n", GO_PATH_ERROR),
    ("ddptrain.Dev/k8s", GO_SUBDOMAIN_FMT),
    ("ddptrain.dev-/k8s", GO_SUBDOMAIN_FMT),
    ("a" * 254 + "/k8s", "must be no more than 253 characters"),
]


@pytest.mark.parametrize(("manager", "refusal"), MANAGERS, ids=[repr(m[:24]) for m, _ in MANAGERS])
def test_the_ported_domain_prefixed_path_admits_and_refuses_what_go_does(manager: str, refusal: str | None) -> None:
    """Go's regexps are anchored at both ends (``^...$`` without multi-line: a trailing newline is refused too)
    and only the first slash splits the domain from the path."""
    from tests.helpers.webhooks import is_domain_prefixed_path

    errors = is_domain_prefixed_path("spec.runtimePatches.manager", manager)
    if refusal is None:
        assert errors == [], errors
    else:
        assert errors and errors[0].endswith(refusal), errors


def test_trainers_torch_plugin_refuses_torchruns_five_variables_and_no_other() -> None:
    """``TorchRunReservedEnvNames`` (pkg/constants/constants.go, v2.3.0) holds five names, not every PET_*:
    a trainer env of PET_MAX_RESTARTS (torchrun's --max-restarts) is admitted."""
    doc = generated("trainjob", VARIANTS["cpu"])
    doc["spec"]["trainer"]["env"] += [{"name": "PET_MAX_RESTARTS", "value": "5"}, {"name": "PET_RDZV_ID", "value": "x"}]
    assert admission_errors(doc) == []
    doc["spec"]["trainer"]["env"].append({"name": "PET_MASTER_PORT", "value": "29400"})
    assert admission_errors(doc) == ["spec.trainer.env: Invalid value: must not have reserved envs, invalid envs "
                                     "configured: [PET_MASTER_PORT]"]


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of a manifest (a TrainJob's: its runtime patch's)."""
    if doc["kind"] == "TrainJob":
        jobs = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        return [j["template"]["spec"]["template"]["spec"] for j in jobs]
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    return [j["template"]["spec"]["template"]["spec"] for j in doc["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("kind", KINDS)
def test_every_pod_has_the_images_group_on_the_checkpoint_volume_and_no_capability_it_cannot_use(kind: str) -> None:
    """The image runs as uid/gid 10001: fsGroup 10001 makes a fresh volume (root:root 0755) writable for it. A
    capability added to a non-root container is dropped at execve: only --ib-root pods (root) carry IPC_LOCK."""
    doc = generated(kind, VARIANTS["gpu-ib-wandb"])
    specs = _pod_specs(doc)
    assert len(specs) == (2 if kind == "pytorchjob" else 1)
    for pod in specs:
        assert pod["securityContext"] == {"fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch"}
    assert _holders(doc, "capabilities") == [] and _holders(doc, "runAsUser") == []

    root = generated(kind, [*VARIANTS["gpu-ib-wandb"], "--ib-root"])
    assert schema_errors(root) == [] and admission_errors(root) == []
    for pod in _pod_specs(root):
        (container,) = pod["containers"]
        assert container["securityContext"] == {"runAsUser": 0, "runAsGroup": 0,
                                                "capabilities": {"add": ["IPC_LOCK"]}}


def test_trainer_v2s_master_port_is_the_one_the_docs_and_the_module_state() -> None:
    """Trainer v2.3 sets PET_MASTER_PORT to its ContainerTrainerPort, 29500 (pkg/constants/constants.go)."""
    from ddptrain.app import k8s_manifest

    docs = (Path(__file__).parents[1] / "docs" / "multinode.md").read_text()
    for text in (docs, k8s_manifest.__doc__ or ""):
        stated = re.findall(r"PET_MASTER_PORT``?\s*\((\d+)", text)
        assert stated and {int(p) for p in stated} == {CONTAINER_TRAINER_PORT}, stated
    jobset = generated("jobset", ["--nodes", "2", "--gpus-per-node", "8", "data.global_batch_size=128"])
    env = {e["name"]: e.get("value") for e in _pod_specs(jobset)[0]["containers"][0]["env"]}
    assert env["PET_MASTER_PORT"] == str(CONTAINER_TRAINER_PORT)  # a JobSet's pods use the same port


def test_each_job_without_a_name_gets_its_own_run_dir_and_a_name_given_again_continues_its_run() -> None:
    """Every pod runs train.resume=auto in <mount>/runs/<name>: two jobs of one default name would share a run
    dir, and the second would continue the first's run."""
    first, second = (generated("jobset", []) for _ in range(2))
    names = [d["metadata"]["name"] for d in (first, second)]
    assert names[0] != names[1], names
    for doc, name in zip((first, second), names, strict=True):
        assert re.fullmatch(r"ddptrain-[bcdfghjklmnpqrstvwxz2456789]{5}", name), name
        env = {e["name"]: e.get("value") for e in _pod_specs(doc)[0]["containers"][0]["env"]}
        assert env["DDPTRAIN_RUN_DIR"] == f"/mnt/ddptrain/runs/{name}"
    again = [generated("jobset", ["--name", names[0]]) for _ in range(2)]
    assert {d["metadata"]["name"] for d in again} == {names[0]}
    header = k8s.render("jobset", k8s.job_spec(k8s.parse_args(["--image", IMAGE, "--kind", "jobset"]))).split("\n")[0]
    assert re.search(r"--name ddptrain-\w{5} continues this run", header), header
    assert "(the claim must exist)" in header


def test_the_claim_is_printed_before_the_job_when_asked_for() -> None:
    def printed(*flags: str) -> list[dict[str, Any]]:
        args = k8s.parse_args(["--image", IMAGE, "--kind", "trainjob", "--claim", "runs-7", *flags])
        return list(yaml.safe_load_all(k8s.render("trainjob", k8s.job_spec(args))))

    assert [d["kind"] for d in printed()] == ["TrainJob"]
    claim, job = printed("--claim-size", "500Gi", "--storage-class", "nfs-client", "--nodes", "2",
                         "--gpus-per-node", "8", "data.global_batch_size=128", "--namespace", "ml")
    assert (claim["apiVersion"], claim["kind"], claim["metadata"]["name"]) == ("v1", "PersistentVolumeClaim", "runs-7")
    assert claim["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "500Gi"}},
                             "storageClassName": "nfs-client"}
    assert _holders(job, "claimName")[0]["claimName"] == "runs-7"
    (one,) = [d for d in printed("--claim-size", "50Gi") if d["kind"] == "PersistentVolumeClaim"]
    assert one["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}}


def test_a_pytorchjob_is_printed_without_anchors_and_its_master_and_workers_are_edited_apart() -> None:
    args = k8s.parse_args(["--image", IMAGE, "--kind", "pytorchjob", "--nodes", "3", "--gpus-per-node", "8",
                           "data.global_batch_size=192"])
    built = manifest("pytorchjob", k8s.job_spec(args))["spec"]["pytorchReplicaSpecs"]
    assert built["Master"]["template"] is not built["Worker"]["template"]  # what the printer would tie together
    text = k8s.render("pytorchjob", k8s.job_spec(args))
    assert not re.search(r"[&*]id\d+", text), text
    doc = yaml.safe_load(text)
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["template"]["spec"]["containers"][0]["image"] = "edited"
    replicas["Master"]["template"]["metadata"]["labels"]["role"] = "master"
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    assert "role" not in replicas["Worker"]["template"]["metadata"]["labels"]
    assert admission_errors(doc) == [] and schema_errors(doc) == []

REFUSED = [
    (["--nodes", "0"], "--nodes 0: expected at least 1 node"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1: expected 0 (CPU pods) or more"),
    (["--image", " "], "--image: empty; expected the container image"),
    (["hydra.run.dir=/tmp/run"], "hydra.run.dir=/tmp/run: not on the checkpoint volume mounted at /mnt/ddptrain"),
    (["hydra.run.dir=outputs/x"], "hydra.run.dir=outputs/x: not on the checkpoint volume"),
    (["checkpoint.dir=/scratch/ckpt"], "checkpoint.dir=/scratch/ckpt: not on the checkpoint volume"),
    (["--name", "My_Run"], "--name My_Run: expected lower-case letters"),
    (["--nodes", "3", "--gpus-per-node", "8"], "data.global_batch_size=32 is not divisible by"),
    (["launch.backend=ray"], "launch.backend=ray: the pods start their workers with torchrun"),
    (["optim.lrr=1"], "Key 'lrr' not in 'OptimConfig'"),
    (["--shm-size", "lots"], "--shm-size lots: expected a Kubernetes quantity"),
    (["--env", "DDPTRAIN_RUN_DIR=/x"], "--env DDPTRAIN_RUN_DIR=/x: set by ddptrain-k8s (the run dir"),
    (["--env", "PET_NODE_RANK=1"], "--env PET_NODE_RANK=1: set by ddptrain-k8s (the run dir: hydra.run.dir) or the"),
    # a sibling directory whose name begins like the mount's is not on the volume
    (["hydra.run.dir=/mnt/ddptrain-old/run"], "hydra.run.dir=/mnt/ddptrain-old/run: not on the checkpoint volume"),
    (["checkpoint.dir=/mnt/ddptrain2/ckpt"], "checkpoint.dir=/mnt/ddptrain2/ckpt: not on the checkpoint volume"),
    (["hydra.run.dir=/mnt/ddptrain/"], "hydra.run.dir=/mnt/ddptrain/: not on the checkpoint volume"),
    (["--ib-root"], "--ib-root needs --ib RESOURCE"),
    (["--claim-size", "lots"], "--claim-size lots: expected a Kubernetes quantity"),
    (["--storage-class", "fast"], "--storage-class fast: expected a storage class name"),
    (["--claim-size", "1Gi", "--storage-class", "Fast_SSD"], "--storage-class Fast_SSD: expected a storage class"),
    # a path whose components climb out of the volume
    (["hydra.run.dir=/mnt/ddptrain/../scratch/run"], "hydra.run.dir=/mnt/ddptrain/../scratch/run: not on the"),
    # Hydra applies a key's last override: each one is checked, after an on-volume run dir too
    (["hydra.run.dir=/mnt/ddptrain/runs/mine", "checkpoint.dir=/scratch/ckpt"],
     "checkpoint.dir=/scratch/ckpt: not on the checkpoint volume"),
    (["hydra.run.dir=/mnt/ddptrain/runs/a", "hydra.run.dir=/tmp/b"], "hydra.run.dir=/tmp/b: not on the checkpoint"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_what_cannot_work_is_refused_in_one_line(flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--image", IMAGE, *flags] if "--image" not in flags else flags
    assert k8s.run(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ddptrain-k8s: error: ") and message in err, err


def test_the_run_dir_is_the_last_hydra_run_dir_as_hydra_applies_it() -> None:
    """Hydra composes a key given twice with its last value: the pods' run dir is that one, on the volume."""
    later = ["hydra.run.dir=/tmp/b", "checkpoint.dir=/scratch/c", "hydra.run.dir=/mnt/ddptrain/runs/a/",
             "checkpoint.dir=/mnt/ddptrain/ckpt"]
    assert k8s.run_dir_on_volume(later, "/mnt/ddptrain", "job") == "/mnt/ddptrain/runs/a"
    assert k8s.run_dir_on_volume(["checkpoint.dir=ckpt"], "/mnt/ddptrain/", "job") == "/mnt/ddptrain/runs/job"


@pytest.mark.parametrize("length", [40, 41, 50, 63])
def test_a_name_the_cli_accepts_is_admitted_by_every_kinds_webhook(length: int) -> None:
    """The JobSet webhook wants <name>-node-0-<last pod>-abcde within 63 characters: a name --name takes must leave
    room for it (a longer one is refused here, in one line, not by the API server)."""
    name = "a" * length
    for kind in KINDS:
        flags = ["--name", name, "--nodes", "100", "--gpus-per-node", "0", "data.global_batch_size=100",
                 "data.micro_batch_size=1"]
        try:
            doc = generated(kind, flags)
        except ConfigError as exc:
            assert length > k8s.MAX_NAME and f"--name {name}: expected" in str(exc)
            continue
        assert admission_errors(doc) == [], (kind, length)


def test_help_in_process_names_the_program_each_flag_with_its_value_and_the_examples(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` as the command prints it (the fresh-interpreter test below is not run by mutmut's stats)."""
    with pytest.raises(SystemExit) as done:
        k8s.parse_args(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0 and text.startswith("usage: ddptrain-k8s ")
    for flag in ("--image IMAGE", "--replica-groups R", "--claim-size SIZE", "--ib RESOURCE", "--ib-root",
                 "--wandb-secret SECRET[:KEY]", "--env KEY=VALUE", "--namespace NAMESPACE", "--max-restarts"):
        assert flag in text, flag
    assert k8s.EPILOG.splitlines()[1] in text  # the examples, as written (RawDescriptionHelpFormatter)


def test_the_flags_in_docs_are_what_help_prints(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """docs/multinode.md's copy of ``ddptrain-k8s --help``'s flags is the command's own, word for word (at 100
    columns, argparse's width from COLUMNS): a flag or its help changed in one place and not the other fails."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        k8s.parse_args(["--help"])
    text = capsys.readouterr().out
    printed = text[text.index("options:\n"):text.index("\nexamples:")].rstrip("\n")
    docs = (Path(__file__).parents[1] / "docs" / "multinode.md").read_text()
    after = docs.split("<!-- ddptrain-k8s --help: options -->\n```text\n", 1)[1]
    assert after.split("\n```", 1)[0] == printed

def test_help_lists_the_flags_and_printing_a_manifest_imports_no_torch(tmp_path: Path) -> None:
    helped = subprocess.run([str(BIN / "ddptrain-k8s"), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    for flag in ("--image", "--kind", "--nodes", "--gpus-per-node", "--claim", "--mount", "--ib", "--wandb-secret",
                 "--max-restarts", "trainjob", "pytorchjob", "jobset"):
        assert flag in helped.stdout
    probe = ("import sys; from ddptrain.app.k8s import run; code = run(['--image', 'img', '--kind', 'jobset']); "
             "print('torch' in sys.modules, code, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.stderr.strip().splitlines()[-1] == "False 0", done.stderr[-2000:]
    assert yaml.safe_load(done.stdout.split("\n", 1)[1])["kind"] == "JobSet"  # after the header comment


@pytest.mark.parametrize("kind", KINDS)
def test_each_pod_of_a_manifest_starts_torchrun_where_the_operator_says(kind: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's torchrun arguments in each pod, from the environment the operator gives that pod."""
    from torch.distributed.run import get_args_parser

    from ddptrain.app.launch import torchrun_options

    doc = generated(kind, ["--nodes", "3", "--gpus-per-node", "4", "data.global_batch_size=96"])
    for rank, pod in enumerate(pods(doc, "/tmp/volume", 4321)):
        for key in [k for k in os.environ if k.startswith("PET_") or k in ("MASTER_ADDR", "MASTER_PORT")]:
            monkeypatch.delenv(key)
        for key, value in pod.env.items():
            monkeypatch.setenv(key, value)
        options, world_size, local = torchrun_options(nproc_per_node=1, max_restarts=0)
        args = get_args_parser().parse_args([*options, "-m", "ddptrain"])
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("3", rank, "4")
        assert (args.master_addr, args.master_port, world_size, local) == ("127.0.0.1", 4321, 12, 4)
        assert pod.env["DDPTRAIN_RUN_DIR"] == f"/tmp/volume/runs/{doc['metadata']['name']}"
        assert pod.argv[:2] == ["ddptrain", "train.resume=auto"]



def _operator_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process as a pod of a training operator: ``env`` and nothing else of torchrun's."""
    for key in [k for k in os.environ if k.startswith("PET_") or k in (
            "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_an_elastic_jobs_world_size_is_checked_at_its_largest_node_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """PET_NNODES=MIN:MAX (an elastic PyTorchJob): the batch must divide over MAX nodes x the local processes."""
    from ddptrain.app.launch import torchrun_options

    for nnodes, world in (("1:2", 4), ("2:3", 6), ("3", 6)):
        _operator_env(monkeypatch, {"PET_NNODES": nnodes, "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"})
        _, world_size, local = torchrun_options(nproc_per_node=1, max_restarts=0)
        assert (world_size, local) == (world, 2), nnodes


@pytest.mark.parametrize(("nnodes", "nproc"), [("two", "2"), ("2", "many")])
def test_an_operators_count_that_is_no_number_is_one_line_naming_both_variables(
        nnodes: str, nproc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PET_NNODES or PET_NPROC_PER_NODE torchrun cannot read: one line with both values as the pod has them."""
    from ddptrain.app.launch import torchrun_options

    _operator_env(monkeypatch, {"PET_NNODES": nnodes, "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": "0"})
    with pytest.raises(ConfigError) as refused:
        torchrun_options(nproc_per_node=1, max_restarts=0)
    assert str(refused.value) == (f"PET_NNODES={nnodes}, PET_NPROC_PER_NODE={nproc}: expected numbers of nodes and "
                                  "processes per node (set by the training operator)")


def test_an_operators_pod_of_one_process_per_node_still_starts_its_node_through_torchrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's command, ``ddptrain train.resume=auto OVERRIDES`` with launch.nproc_per_node=1: one process per
    node must still be torchrun's agent of this node (it meets the others at node 0), not a lone rank."""
    import torch.distributed.run

    from ddptrain.app import launch
    from ddptrain.app.cli import run_cli as ddptrain_main
    from ddptrain.telemetry.goodput import LAUNCH_START_ENV

    _operator_env(monkeypatch, {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
                                "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"})
    for key in ("DDPTRAIN_RUN_DIR", LAUNCH_START_ENV, "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(key, raising=False)  # launch_workers sets them; restored after the test
    started: list[Any] = []
    monkeypatch.setattr(torch.distributed.run, "run", started.append)
    monkeypatch.setattr(launch, "elastic_records_to_run_log", lambda run_dir: None)
    monkeypatch.setattr(launch, "run_worker", lambda *a, **k: pytest.fail("the pod trained alone, without torchrun"))
    monkeypatch.chdir(tmp_path)
    overrides = ["train.resume=auto", *RUN, "launch.nproc_per_node=1", f"hydra.run.dir={tmp_path / 'run'}"]
    assert ddptrain_main(overrides) == 0
    (args,) = started
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "1")
    assert (args.master_addr, args.master_port) == ("job-node-0-0.job", 29500)
    assert (args.module, args.training_script, args.training_script_args) == (True, "ddptrain", overrides)

# ---- the pods as processes (slow) -----------------------------------------------------------------------------

RUN = ["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
       "data.seq_len=32", "data.global_batch_size=8", "data.micro_batch_size=2", "train.steps=4", "train.log_every=1",
       "train.eval_every=0", "logger.progress=false", "checkpoint.every_n_steps=1", "checkpoint.export=false",
       "dist.timeout_s=60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory: pytest.TempPathFactory, cli_runs: RunCache) -> dict[int, float]:
    """The losses of the same run as one machine's 2 ranks: a reference, not what these tests guard (the pods are),
    so trained in forked ranks (``tests/helpers/worker_run.py``: about 2 CPU s, 17 through the command)."""
    losses, _ = reference_losses(RUN, 2, tmp_path_factory.mktemp("one-machine") / "run", cli_runs.data_cache)
    return losses


def run_pods(made: list[Pod], cwd: Path, fault: str | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Start every pod's command with that pod's environment (and the test's fault), wait for all."""
    started = []
    for pod in made:
        env = {**test_env(cwd / "unused-cache"), **pod.env, **({"DDPTRAIN_FAULT": fault} if fault else {})}
        argv = [str(BIN / pod.argv[0]), *pod.argv[1:]]  # the image's ddptrain: this environment's
        started.append(procs.start(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, text=True))
    results = []
    for proc in started:
        out, err = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _manifest(kind: str, tmp: Path) -> dict[str, Any]:
    args = k8s.parse_args(["--image", IMAGE, "--kind", kind, "--nodes", "2", "--gpus-per-node", "0",
                           "--name", "ddptrain", *RUN])
    return yaml.safe_load(k8s.render(kind, k8s.job_spec(args)))  # the printed manifest, read back


@pytest.mark.slow
def test_two_pods_of_a_trainjob_train_as_one_machines_two_ranks(tmp_path: Path,
                                                                one_machine: dict[int, float]) -> None:
    volume = tmp_path / "volume"
    made = pods(_manifest("trainjob", tmp_path), str(volume), _free_port())
    assert [p.env["PET_NODE_RANK"] for p in made] == ["0", "1"]
    results = run_pods(made, tmp_path)
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    run = volume / "runs" / "ddptrain"
    assert "2 node(s) x 1 rank(s) per node" in results[0].stderr
    assert _losses(run) == pytest.approx(one_machine, rel=1e-6)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_jobset_pods_restarted_after_a_kill_resume_from_the_volume(tmp_path: Path,
                                                                  one_machine: dict[int, float]) -> None:
    volume = tmp_path / "volume"
    doc = _manifest("jobset", tmp_path)
    killed = run_pods(pods(doc, str(volume), _free_port()), tmp_path, fault="kill@step:3")
    assert all(r.returncode != 0 for r in killed), [r.stderr[-2000:] for r in killed]
    run = volume / "runs" / "ddptrain"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    restarted = run_pods(pods(doc, str(volume), _free_port()), tmp_path)  # JobSet recreates both pods
    assert all(r.returncode == 0 for r in restarted), [r.stderr[-3000:] for r in restarted]
    assert "step_000002 at step 2" in restarted[0].stderr
    assert _losses(run) == pytest.approx(one_machine, rel=1e-6)
    goodput = json.loads((run / "summary.json").read_text())["goodput"]
    assert goodput["attempts"] == 2, goodput  # the killed pods' attempt and the restarted pods' one
