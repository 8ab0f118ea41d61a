"""Fine-tuning under data parallelism: LoRA/QLoRA gradients, exact token-weighted loss, checkpointing, outputs."""

from __future__ import annotations

import json
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from ddptrain.config.schema import LoraSettings, ModelConfig, ParallelConfig
from ddptrain.data.instruct import PadCollate, encode, generated_instructions
from ddptrain.data.tokenizer import train_bpe
from ddptrain.data.types import IGNORE
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.models.flops import lora_param_count
from ddptrain.models.lora import parameter_counts, prepare_for_finetuning
from ddptrain.parallel import wrap_model
from ddptrain.plan.analytic.planner import Plan, build_plan
from ddptrain.plan.analytic.render import render_plan
from ddptrain.step.compute import accumulate_gradients
from ddptrain.step.weighting import TOKEN_MEAN_LOSS
from tests.helpers.cli import run_cli
from tests.helpers.dist import run_distributed
from tests.helpers.pretrained import count_checkpoint_calls, train_each_watched
from tests.helpers.runs import make_config

LORA = LoraSettings(enabled=True, r=4, alpha=8.0)
# Completion lengths per sequence: rank 0's micro batches hold 1-2 loss tokens, rank 1's 20+ (mbs 2, accum 2).
COMPLETIONS = [1, 2, 1, 1, 22, 20, 18, 21]
B, ACCUM, WIDTH = 2, 2, 28


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny "pretrained" Qwen3 (the seeds' architecture: QK-norm, grouped-query attention) and its tokenizer,
    saved with save_pretrained (what a user brings).

    Widths 64 and 128: bitsandbytes packs 4-bit weights for the CPU in blocks of 64 input features.
    """
    out = tmp_path_factory.mktemp("base")
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(400)], 320)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _global_batch() -> dict[str, torch.Tensor]:
    """8 padded sequences with very different numbers of completion (loss) tokens."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for completion in COMPLETIONS:
        prompt = int(torch.randint(3, 6, (), generator=g))
        ids = torch.randint(0, 320, (prompt + completion,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return PadCollate(pad_id=0)(rows)


def _micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    batch = _global_batch()
    mine = {k: v[rank * B * ACCUM : (rank + 1) * B * ACCUM] for k, v in batch.items()}
    return [{k: v[i * B : (i + 1) * B] for k, v in mine.items()} for i in range(ACCUM)]


def _lora_model(base: Path, **model: object) -> torch.nn.Module:
    """The adapted base; LoRA's B starts at zero, so it is set at random (seeded) to give A a gradient too."""
    cfg = ModelConfig(pretrained=str(base), lora=LORA, **model)  # type: ignore[arg-type]
    torch.manual_seed(1)
    peft = prepare_for_finetuning(build_model(cfg, 384), cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft


def _adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _grads_on_two_ranks(rank: int, world_size: int, base: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Adapter gradients after one accumulated step: exact (checkpointing off, full, reentrant, selective) and naive
    mean of means."""
    out = {}
    checkpointed = {"activation_checkpointing": "full"}
    reentrant = {**checkpointed, "checkpoint_reentrant": True}
    ran = {}
    selective = {"activation_checkpointing": "selective"}
    for variant, kwargs in (("exact", {}), ("checkpointed", checkpointed), ("reentrant", reentrant),
                            ("selective", selective)):
        model = _lora_model(base, **kwargs)
        calls = count_checkpoint_calls(model)
        wrapped = wrap_model(model, ParallelConfig(), torch.device("cpu"))
        accumulate_gradients(wrapped.outer, iter(_micro_batches(rank)), ACCUM, wrapped.maybe_sync, nullcontext(),
                             TOKEN_MEAN_LOSS)
        out[variant] = _adapter_grads(model)
        ran[variant] = {"checkpoint_calls": calls[0], "training": all(m.training for m in model.modules())}
    out["ran"] = ran
    model = _lora_model(base)
    wrapped = wrap_model(model, ParallelConfig(), torch.device("cpu"))
    for i, micro in enumerate(_micro_batches(rank)):  # the classic bug: each micro batch's own token mean
        with wrapped.maybe_sync(i == ACCUM - 1):
            (wrapped.outer(**micro).loss / ACCUM).backward()
    out["mean_of_means"] = _adapter_grads(model)
    return out


def test_lora_token_weighted_gradients_equal_one_process_on_the_whole_batch(base: Path) -> None:
    reference = _lora_model(base)
    reference(**_global_batch()).loss.backward()  # the model's own mean over every loss token of the batch
    expected = _adapter_grads(reference)
    assert len(expected) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 layers: adapters only
    results = run_distributed(_grads_on_two_ranks, 2, base)
    for rank, grads in enumerate(results):
        for variant in ("exact", "checkpointed", "reentrant", "selective"):
            assert grads[variant].keys() == expected.keys()
            for name, grad in grads[variant].items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank} {variant} {name}")
        # The checkpointed variants really checkpointed: each of the 2 blocks once per micro batch, all in training
        # mode (a loaded model starts in eval mode, where transformers skips checkpointing).
        ran = grads["ran"]
        assert ran["exact"] == {"checkpoint_calls": 0, "training": True}
        assert ran["checkpointed"] == ran["reentrant"] == ran["selective"] == {"checkpoint_calls": 2 * ACCUM,
                                                                               "training": True}
        naive = grads["mean_of_means"]
        worst = max((naive[n] - g).abs().max() / g.abs().max() for n, g in expected.items())
        assert worst > 0.05, f"mean of means should be visibly wrong here, off by {worst:.3g} at most"


def _train_with_failing_backward(rank: int, world_size: int, tmp: str, base: dict) -> dict[bool, str]:
    """Train with a backward that fails as torch DDP does when a gradient is marked ready twice."""
    from ddptrain.train.trainer import Trainer
    from tests.helpers.trainers import train_each_with

    class FailingBackward(Trainer):
        def accumulate(self, step: int, micro_batches: object) -> torch.Tensor:
            raise RuntimeError("Expected to mark a variable ready only once. This error is caused by one of the "
                               "following reasons: 1) Use of a module parameter outside the `forward` function.")

    out = {}
    for reentrant in (True, False):
        model = {"activation_checkpointing": "full", "checkpoint_reentrant": reentrant}
        try:
            train_each_with(FailingBackward, rank, world_size, tmp, base,
                            [{"model": model, "checkpoint": {"export": False}}])
            out[reentrant] = "no error"
        except (ConfigError, RuntimeError) as exc:
            out[reentrant] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_reentrant_checkpointing_failure_says_what_to_change(base: Path, tmp_path: Path) -> None:
    """Reentrant checkpointing trained correctly under DDP here (see the gradient test above); where it fails
    (other torch versions, models), the failure becomes one line that names the key to change."""
    (messages,) = run_distributed(_train_with_failing_backward, 1, str(tmp_path), _finetune_base(base))
    assert messages[True].startswith("ConfigError: model.checkpoint_reentrant=true: backward failed under data "
                                     "parallelism (Expected to mark a variable ready only once.")
    assert messages[True].endswith("set model.checkpoint_reentrant=false") and "\n" not in messages[True]
    # Without reentrant checkpointing the same failure is not ours to explain: it propagates unchanged.
    assert messages[False].startswith("RuntimeError: Expected to mark a variable ready only once")


def test_prompt_and_padding_carry_no_loss(base: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    cfg = make_config(str(base), {"data": {"seq_len": 40, "chat_template": True}}).data
    plain = encode([("What is 1 plus 2?", "3."), ("Spell 'os' backwards.", "'so'.")], tok, cfg)
    prompt = tok("What is 1 plus 2?")["input_ids"]
    row = plain[0]
    assert row["labels"][: len(prompt)] == [IGNORE] * len(prompt)
    assert row["labels"][len(prompt) :] == row["input_ids"][len(prompt) :] and row["input_ids"][-1] == tok.eos_token_id
    batch = PadCollate(pad_id=0)([plain[0], plain[1]])
    short = int(batch["attention_mask"].sum(1).argmin())
    pad = batch["attention_mask"][short] == 0
    assert pad.any() and (batch["labels"][short][pad] == IGNORE).all()
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    templated = encode([("What is 1 plus 2?", "3.")], tok, cfg)[0]
    assert tok.decode(templated["input_ids"]).startswith("<user>What is 1 plus 2?</user><bot>")
    assert len(templated["input_ids"]) - templated["labels"].count(IGNORE) == len(row["input_ids"]) - len(prompt)


def _finetune_base(base: Path) -> dict:
    return {
        "model": {"pretrained": str(base), "lora": {"enabled": True, "r": 4, "alpha": 8.0}},
        "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(base), "num_samples": 160,
                 "seq_len": 40, "global_batch_size": 8, "micro_batch_size": 2},
        "train": {"steps": 4, "log_every": 1, "eval_every": 4}, "optim": {"lr": 1e-2, "warmup_steps": 0},
        "checkpoint": {"export": True, "every_n_steps": 2},
    }


@pytest.fixture(scope="module")
def lora_runs_first(base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 2-rank process group trains LoRA on torch DDP, ZeRO-1 and a from-scratch engine."""
    tmp = tmp_path_factory.mktemp("lora")
    variants = [{}, {"parallel": {"zero_stage": 1}}, {"parallel": {"engine": "bucketed"}}]
    return run_distributed(train_each_watched, 2, str(tmp), _finetune_base(base), variants, timeout=400)[0]


@pytest.fixture(scope="module")
def lora_runs(base: Path, tmp_path_factory: pytest.TempPathFactory, lora_runs_first: list[dict]) -> list[dict]:
    """The first three runs, then a second group's: QLoRA, the first run resumed from its step 2, fp16. Two groups,
    not one: a module fixture's work is charged to the first test asking for it, and the six runs in one group took
    12 CPU s quiet, 17 under load, near the fast tier's budget of 20."""
    tmp = tmp_path_factory.mktemp("lora")
    first = Path(lora_runs_first[0]["dir"])
    variants = [
        {"model": {"quantize": "nf4", "activation_checkpointing": "full"}},
        {"train": {"resume": str(first / "checkpoints" / "step_000002")}},
        {"parallel": {"compression": "fp16"}},
    ]
    return [*lora_runs_first,
            *run_distributed(train_each_watched, 2, str(tmp), _finetune_base(base), variants, timeout=400)[0]]


@pytest.mark.parametrize(("run", "what", "width"),
                         [(0, "torch DDP", 4), (1, "ZeRO-1", 4), (2, "bucketed engine", 4), (3, "QLoRA", 4),
                          (5, "fp16 compression", 2)])
def test_only_adapter_gradients_cross_the_wire(request: pytest.FixtureRequest, lora_runs_first: list[dict], run: int,
                                               what: str, width: int) -> None:
    # the first group's runs without waiting for the second's (each group charged to its own first test)
    lora_runs = lora_runs_first if run < 3 else request.getfixturevalue("lora_runs")
    summary, metrics = lora_runs[run]["summary"], lora_runs[run]["metrics"]
    trainable = summary["trainable_parameters"]
    assert 0 < trainable < summary["parameters"] / 4, what
    assert [m["comm_bytes"] for m in metrics] == [width * trainable] * 4, what  # adapter gradients, exactly
    assert all(m["loss"] == m["loss"] for m in metrics) and metrics[-1]["loss"] < metrics[0]["loss"], what
    assert "val_loss" in metrics[-1]
    # Every module trained in training mode at every step, also after the evaluation, and no forward built a cache.
    assert lora_runs[run]["training"] == [True] * 4 and lora_runs[run]["kv_caches"] == 0, what
    # QLoRA is the only variant with gradient checkpointing: 2 blocks x 2 micro batches per rank x 4 steps.
    assert lora_runs[run]["checkpoint_calls"] == (2 * 2 * 4 if what == "QLoRA" else 0), what


def _base_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft state dict's frozen base weights under the base model's own names."""
    return {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in state.items()
            if "lora_" not in k}


def test_frozen_base_is_bit_identical_after_training(base: Path, lora_runs: list[dict]) -> None:
    from ddptrain.checkpoint.offline import read_tensors, tensor_entries

    checkpoint = Path(lora_runs[0]["dir"]) / "checkpoints" / "step_000004"
    keys = [k for k in tensor_entries(checkpoint) if k.startswith("model.")]
    trained = {k.removeprefix("model."): v for k, v in read_tensors(checkpoint, keys).items()}
    original = load_file(base / "model.safetensors")
    after = _base_weights(trained)
    assert original.keys() <= after.keys()
    for name, weight in original.items():
        assert torch.equal(after[name], weight), name


def test_merged_export_loads_with_transformers_and_matches_the_adapter(base: Path, lora_runs: list[dict]) -> None:
    from peft import PeftModel

    for run in (0, 3):  # full-precision base (merged in place) and NF4 base (merged into the unquantized weights)
        run_dir = Path(lora_runs[run]["dir"])
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")
        ids = _global_batch()["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-4)
        assert (run_dir / "model" / "tokenizer.json").is_file()


def test_resume_restores_adapter_and_optimizer_exactly(lora_runs: list[dict]) -> None:
    straight, resumed = (Path(lora_runs[i]["dir"]) for i in (0, 4))
    assert [m["step"] for m in lora_runs[4]["metrics"]] == [3, 4]
    assert lora_runs[4]["metrics"][-1]["loss"] == lora_runs[0]["metrics"][-1]["loss"]
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_parameter_counts_see_through_4bit_packing(base: Path) -> None:
    full = ModelConfig(pretrained=str(base))
    nf4 = ModelConfig(pretrained=str(base), quantize="nf4", lora=LORA)  # type: ignore[arg-type]
    _, total = parameter_counts(build_model(full, 384))
    trainable, total_nf4 = parameter_counts(prepare_for_finetuning(build_model(nf4, 384), nf4))
    assert total_nf4 == total + trainable


@pytest.mark.slow
def test_lora_quickstart_trains_through_the_cli_and_the_completion_loss_falls(base: Path, tmp_path: Path) -> None:
    result = run_cli(["+experiment=lora_quickstart", f"model.pretrained={base}", "data.num_samples=600",
                      "train.steps=60", "train.log_every=1", "train.eval_every=30", "optim.lr=1e-2"],
                     cwd=tmp_path, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "outputs").iterdir()
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The test's base is untrained (step 1 sits at chance, ln 384 = 5.95), so adapters alone move the completion
    # loss slowly; 60 steps took the last steps' mean about 0.5 nats below the first step's.
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses
    assert re.search(r"[\d.]+K of [\d.]+K trainable; [\d.]+ MB all-reduced per step", (run / "train.log").read_text())
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "model" / "config.json").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_planner_counts_the_adapters_peft_builds(arch: str) -> None:
    kv_heads, head_dim = (1, 64) if arch == "qwen3" else (2, None)
    cfg = ModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=kv_heads, head_dim=head_dim,
                      lora=LORA)
    trainable, _ = parameter_counts(prepare_for_finetuning(build_model(cfg, 384), cfg))
    assert lora_param_count(cfg) == trainable
    only_q = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, lora=LoraSettings(True, 4, 8.0, 0.0, ["q_proj"]))
    assert lora_param_count(only_q) == parameter_counts(prepare_for_finetuning(build_model(only_q, 384), only_q))[0]


def test_planner_sends_adapter_gradients_only_and_shrinks_the_frozen_base() -> None:
    def plan(**model: object) -> Plan:
        cfg = make_config("/tmp", {"model": {"lora": {"enabled": True}, **model}, "data": {"vocab_size": 8192}})
        return build_plan(cfg, 2, None)

    bf16, nf4 = plan(dtype="bf16"), plan(quantize="nf4", pretrained="x")
    trainable = lora_param_count(make_config("/tmp", {"model": {"lora": {"enabled": True}}}).model)
    assert bf16.trainable == nf4.trainable == trainable
    assert bf16.comm[0].nbytes == 4 * trainable  # 2(N-1)/N x 4 bytes x adapters, N = 2
    assert bf16.memory[0].grads == 4 * trainable and bf16.memory[1].optimizer == 8 * trainable / 2
    assert nf4.memory[0].params < bf16.memory[0].params < plan(dtype="fp32").memory[0].params
    assert "LoRA adapter parameters (frozen base in nf4" in render_plan(nf4)


class _Dequantized(torch.nn.Module):
    """A ``Linear4bit``'s weight dequantized into a plain linear, computed as it computes (in its compute dtype)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        import bitsandbytes.functional as bnb_functional

        super().__init__()
        self.weight = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).detach()
        self.bias, self.compute_dtype = layer.bias, layer.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(xc.dtype)
        return torch.nn.functional.linear(xc, self.weight.to(xc.dtype), bias).to(x.dtype)


def test_qlora_adapter_gradients_match_a_dequantized_base_before_and_after_an_evaluation(base: Path) -> None:
    """On an AVX512-BF16 CPU (this one) bitsandbytes repacks 4-bit weights for inference at the first forward in
    eval mode, and training then ran a kernel torch cannot differentiate (``gemv_4bit``: "an autograd kernel was
    not registered"), dropping the gradient through the base: after the first evaluation the adapters' gradients
    were 98-184 % off. Checked against the same adapters on the base dequantized to plain linears, for a training
    batch and for one-row, two-token input (the inference-shaped path), before and after an evaluation."""
    import copy
    import warnings

    import bitsandbytes as bnb

    cfg = ModelConfig(pretrained=str(base), quantize="nf4", lora=LORA)  # type: ignore[arg-type]
    model = prepare_for_finetuning(build_model(cfg, 384), cfg)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: no gradient would reach A through it
            p.data.normal_(0, 0.05)
    reference = copy.deepcopy(model)
    quantized = [m for m in reference.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for parent in list(reference.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                setattr(parent, child_name, _Dequantized(child))
    assert len(quantized) == 14  # 2 blocks x 7 projections: the base is 4-bit

    def grads(m: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    g = torch.Generator().manual_seed(0)
    batches = {"training batch": torch.randint(0, 384, (4, 16), generator=g),
               "one row of two tokens": torch.randint(0, 384, (1, 2), generator=g)}
    for when in ("before", "after"):
        if when == "after":
            model.eval()
            with torch.no_grad():
                evaluated = model(input_ids=batches["training batch"]).logits
                # bf16 compute: bitsandbytes' inference kernel rounds differently from dequantize + linear
                torch.testing.assert_close(evaluated, reference(input_ids=batches["training batch"]).logits,
                                           rtol=1e-2, atol=1e-2)
            model.train()
        for what, ids in batches.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = grads(model, ids)
            want = grads(reference, ids)
            assert got.keys() == want.keys() and len(got) == 28  # every adapter A and B
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=f"{when} an evaluation, {what}: {name}")
            assert not [w for w in caught if "autograd kernel was not registered" in str(w.message)]
