"""The dry run's plan for a target device: the planner's model state, batch and communication, and the memory
plan traced on fake tensors, as the text the dry run prints and the record it writes to ``plan.json``."""

from __future__ import annotations

import os
from dataclasses import replace

from ddptrain.config.schema import AUTO, Config
from ddptrain.errors import ConfigError
from ddptrain.models.build import model_vocab_size
from ddptrain.plan.analytic.planner import Plan, backward_seconds, build_plan
from ddptrain.plan.memory.auto_batch import choose_micro_batch, memory_unknown, with_micro_batch
from ddptrain.plan.memory.overheads import RunOverheads, ranks_per_node
from ddptrain.plan.memory.planner import Tracer, plan_memory
from ddptrain.plan.memory.present import device_for_plan
from ddptrain.plan.memory.render import render_memory_plan


def plan_for_target(cfg: Config, world_size: int) -> tuple[Plan, str, dict]:
    """The dry run's plan for ``plan.device`` (precision resolved for it), the memory section's text and
    plan.json's record. With ``plan.params`` there is no shape to trace: model state only."""
    device = device_for_plan(cfg.plan.device, cfg.plan.device_memory_gib, cfg.metrics.peak_tflops)
    overheads = RunOverheads.of(cfg, ranks_per_node(cfg, world_size), os.environ)
    vocab = model_vocab_size(cfg.model, cfg.data.vocab_size)
    tracer, auto_line, auto_record = Tracer(cfg, vocab, device), "", {}
    if cfg.data.micro_batch_size == AUTO:  # chosen for the target device, as a run on it would choose
        if cfg.plan.params:
            raise ConfigError("data.micro_batch_size=auto needs a model shape to trace: unset plan.params")
        if (error := memory_unknown(cfg, device)) is not None:
            raise error
        chosen = choose_micro_batch(cfg, cfg.plan.world_size or world_size, device, vocab, tracer, overheads)
        cfg = with_micro_batch(cfg, chosen.micro_batch)
        auto_line = chosen.line() + "\n"
        auto_record = {"micro_batch_auto": {"micro_batch_size": chosen.micro_batch, "grad_accum": chosen.grad_accum,
                                            "largest_fitting": chosen.largest, "need_bytes_per_rank": chosen.need,
                                            "usable_bytes_per_rank": chosen.usable}}
    on_gpu = device.device_type == "cuda"
    plan = build_plan(cfg, world_size, device.name.upper() if on_gpu else None, bf16_capable=device.bf16)
    if on_gpu and plan.peak_tflops is None:  # a GPU without bf16, which telemetry/peak.py does not list
        micro_tokens = plan.batch.micro_batch_size * plan.sequence_tokens
        plan = replace(plan, peak_tflops=device.peak_tflops, backward_s=backward_seconds(
            plan.flops_per_token, micro_tokens, device.peak_tflops, plan.assumed_mfu))
    record: dict = {**auto_record, "world_size": plan.batch.dp, "device": device.name,
                    "precision": plan.precision.name, "model_state_bytes_per_rank": plan.memory[plan.zero_stage].total}
    if cfg.plan.params:
        note = "plan.params: no model shape to trace, so model state only (no activations)"
        return plan, auto_line + note, {**record, "peak_bytes_per_rank": None, "by_category": None,
                                        "recommendation": None, "note": note}
    mp = plan_memory(cfg, plan, vocab, device, overheads, tracer)
    return plan, auto_line + render_memory_plan(mp, plan.batch.dp), {**record, **mp.to_json()}
