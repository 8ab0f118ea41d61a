"""``ddptrain-k8s``: the manifests of the three kinds against their operators' CRD schemas, the refusals, and the
operators' environment contract executed: a manifest's pods run as local processes with the environment each pod
would get (``tests/helpers/pods.py``), train as one job, and a pod restarted after a kill continues from the
volume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddptrain.app import k8s
from ddptrain.app.k8s_manifest import KINDS, manifest
from tests.helpers import procs
from tests.helpers.cli import run_cli, test_env
from tests.helpers.crds import CRDS, PINNED, duplicates, schema_errors, strict
from tests.helpers.pods import Pod, pods

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
def test_every_kind_of_manifest_is_valid_against_its_operators_crd(kind: str, variant: str) -> None:
    doc = generated(kind, VARIANTS[variant])
    assert schema_errors(doc) == []
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
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {"/dev/shm": "dshm",
                                                                             "/mnt/ddptrain": "runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "ddptrain-runs"}
    assert env["DDPTRAIN_RUN_DIR"]["value"] == "/mnt/ddptrain/runs/ddptrain"
    assert (env["NCCL_IB_HCA"]["value"], env["NCCL_DEBUG"]["value"]) == ("mlx5", "INFO")
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
    assert doc["spec"]["nprocPerNode"] == "8" and doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1


def test_a_trainjob_leaves_torchruns_variables_to_the_operator_and_has_a_name_it_accepts() -> None:
    """Trainer's Torch plugin refuses PET_* in trainer.env (a webhook, not the schema); the CRD's CEL rule wants
    an RFC 1035 name."""
    import re

    doc = generated("trainjob", VARIANTS["cpu"])
    assert not [e["name"] for e in doc["spec"]["trainer"]["env"] if e["name"].startswith("PET_")]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert (doc["spec"]["trainer"]["numNodes"], doc["spec"]["trainer"]["numProcPerNode"]) == (3, 2)
    assert "resourcesPerNode" not in doc["spec"]["trainer"]  # CPU pods ask for no GPU


REFUSED = [
    (["--nodes", "0"], "--nodes 0: expected at least 1 node"),
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
]


@pytest.mark.parametrize(("flags", "message"), REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_what_cannot_work_is_refused_in_one_line(flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--image", IMAGE, *flags] if "--image" not in flags else flags
    assert k8s.run(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ddptrain-k8s: error: ") and message in err, err


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
        assert pod.env["DDPTRAIN_RUN_DIR"] == "/tmp/volume/runs/ddptrain"
        assert pod.argv[:2] == ["ddptrain", "train.resume=auto"]


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
def one_machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run as one machine's 2 ranks (ddptrain's own launcher)."""
    tmp = tmp_path_factory.mktemp("one-machine")
    done = run_cli([*RUN, "launch.nproc_per_node=2", f"hydra.run.dir={tmp / 'run'}"], cwd=tmp, cache=tmp / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


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
    args = k8s.parse_args(["--image", IMAGE, "--kind", kind, "--nodes", "2", "--gpus-per-node", "0", *RUN])
    return yaml.safe_load(k8s.render(kind, k8s.job_spec(args)))  # the printed manifest, read back


@pytest.mark.slow
def test_two_pods_of_a_trainjob_train_as_one_machines_two_ranks(tmp_path: Path, one_machine: Path) -> None:
    volume = tmp_path / "volume"
    made = pods(_manifest("trainjob", tmp_path), str(volume), _free_port())
    assert [p.env["PET_NODE_RANK"] for p in made] == ["0", "1"]
    results = run_pods(made, tmp_path)
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    run = volume / "runs" / "ddptrain"
    assert "2 node(s) x 1 rank(s) per node" in results[0].stderr
    assert _losses(run) == pytest.approx(_losses(one_machine), rel=1e-6)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_jobset_pods_restarted_after_a_kill_resume_from_the_volume(tmp_path: Path, one_machine: Path) -> None:
    volume = tmp_path / "volume"
    doc = _manifest("jobset", tmp_path)
    killed = run_pods(pods(doc, str(volume), _free_port()), tmp_path, fault="kill@step:3")
    assert all(r.returncode != 0 for r in killed), [r.stderr[-2000:] for r in killed]
    run = volume / "runs" / "ddptrain"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    restarted = run_pods(pods(doc, str(volume), _free_port()), tmp_path)  # JobSet recreates both pods
    assert all(r.returncode == 0 for r in restarted), [r.stderr[-3000:] for r in restarted]
    assert "step_000002 at step 2" in restarted[0].stderr
    assert _losses(run) == pytest.approx(_losses(one_machine), rel=1e-6)
    goodput = json.loads((run / "summary.json").read_text())["goodput"]
    assert goodput["attempts"] == 2, goodput  # the killed pods' attempt and the restarted pods' one
