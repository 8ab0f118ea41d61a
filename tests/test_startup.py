"""Start-up is a feature: what ``ddptrain`` imports before its first line. ``--help``, ``--cfg`` and a config error
answer without torch, transformers or the data and plotting libraries (each costs a second or more of a fresh
process), and a worker imports only what its run uses. Each case runs the command's own entry (``run_cli``) in a
fresh interpreter and reads ``sys.modules`` after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import test_env

REPO = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "datasets", "pyarrow", "pandas", "numpy", "matplotlib", "peft", "bitsandbytes",
         "triton", "wandb", "scipy")
# Parts of a library a run imports only when it uses them: our Triton kernels; torch.distributed.optim (its
# functional optimizers are TorchScript classes, compiled at import: 0.2 s of a worker's start-up that only ZeRO-1
# needs).
LAZY = ("ddptrain.kernels.triton_ops", "torch.distributed.optim")
PROBE = """
import json, sys
from ddptrain.app.cli import run_cli
code = run_cli(sys.argv[1:])
heavy = {heavy!r}
print("EXIT", code, json.dumps(sorted(m for m in (*heavy, *{lazy!r}) if m in sys.modules)))
"""


def imported_by(args: list[str], cwd: Path) -> tuple[int, list[str], str]:
    """Exit code of ``ddptrain <args>`` in a fresh interpreter, the heavy modules loaded when it returned, and its
    stderr."""
    env = test_env(cwd / "cache")
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, lazy=LAZY), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("EXIT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    code, _, modules = line.removeprefix("EXIT ").partition(" ")
    return int(code), json.loads(modules), done.stderr


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job", "+experiment=quickstart"]], ids=["help", "cfg"])
def test_help_and_cfg_import_no_heavy_library(args: list[str], tmp_path: Path) -> None:
    code, modules, stderr = imported_by(args, tmp_path)
    assert code == 0, stderr[-2000:]
    assert modules == []


@pytest.mark.parametrize(("args", "message"), [
    (["launch.nproc_per_node=0"], "launch.nproc_per_node must be >= 1"),  # the schema's own check
    (["data.global_batch_size=3", "data.micro_batch_size=2"], "not divisible"),  # preflight, in this process
    (["data.global_batch_size=3", "data.micro_batch_size=2", "launch.nproc_per_node=2"], "not divisible"),  # launcher
], ids=["schema", "preflight", "launcher"])
def test_a_config_error_is_answered_before_torch_is_imported(args: list[str], message: str, tmp_path: Path) -> None:
    code, modules, stderr = imported_by(args, tmp_path)
    assert code == 2 and message in stderr, stderr[-2000:]
    assert modules == []


@pytest.mark.slow  # a one-step run in a fresh interpreter: torch and transformers imported, a model built
# embedded: the default corpus, 40 of its documents: a BPE trained on the whole standard library made the case 25
# CPU s, on 40 documents 12 (the synthetic case 11); what is imported to train, cache and load a tokenizer does not
# depend on how much text it reads
@pytest.mark.parametrize("data", [["data=synthetic", "data.num_samples=16"], ["data.max_documents=40"]],
                         ids=["synthetic", "embedded"])
def test_a_worker_imports_no_data_finetuning_or_plotting_library(data: list[str], tmp_path: Path) -> None:
    """torch and transformers it needs; ``datasets`` (and its Arrow and pandas), peft, bitsandbytes, matplotlib,
    wandb, our Triton kernels and torch.distributed.optim it does not, on synthetic data and on the embedded
    default corpus (its tokenizer trained, cached and loaded; a checkpoint saved and the model exported). Triton
    and scipy themselves are imported by transformers' model classes (through torch._dynamo and its loss
    utilities) whenever they are installed, as they are here."""
    args = [*data, "data.seq_len=16", "data.global_batch_size=4", "data.micro_batch_size=4", "model.num_layers=1",
            "train.steps=1", "train.eval_every=0", "logger.progress=false", "hydra.run.dir=run"]
    code, modules, stderr = imported_by(args, tmp_path)
    assert code == 0, stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir() and (tmp_path / "run" / "model").is_dir()
    assert sorted(set(modules) - {"triton", "scipy"}) == ["numpy", "torch", "transformers"]
