"""The dry run's plan for a target device: the planner's model state, batch and communication, and the memory
plan traced on fake tensors, as the text the dry run prints and the record it writes to ``plan.json``."""

from __future__ import annotations

from dataclasses import replace

from ddptrain.config.schema import Config
from ddptrain.models.build import model_vocab_size
from ddptrain.plan.memory_plan import plan_memory, target_device, this_machine
from ddptrain.plan.memory_render import render_memory_plan
from ddptrain.plan.planner import Plan, backward_seconds, build_plan


def plan_for_target(cfg: Config, world_size: int) -> tuple[Plan, str, dict]:
    """The dry run's plan for ``plan.device`` (precision resolved for it), the memory section's text and
    plan.json's record. With ``plan.params`` there is no shape to trace: model state only."""
    device = target_device(cfg.plan.device or this_machine(), cfg.plan.device_memory_gib, cfg.metrics.peak_tflops)
    on_gpu = device.device_type == "cuda"
    plan = build_plan(cfg, world_size, device.name.upper() if on_gpu else None, bf16_capable=device.bf16)
    if on_gpu and plan.peak_tflops is None:  # a GPU without bf16, which telemetry/peak.py does not list
        micro_tokens = plan.batch.micro_batch_size * plan.sequence_tokens
        plan = replace(plan, peak_tflops=device.peak_tflops, backward_s=backward_seconds(
            plan.flops_per_token, micro_tokens, device.peak_tflops, plan.assumed_mfu))
    record: dict = {"world_size": plan.batch.dp, "device": device.name, "precision": plan.precision.name,
                    "model_state_bytes_per_rank": plan.memory[plan.zero_stage].total}
    if cfg.plan.params:
        note = "plan.params: no model shape to trace, so model state only (no activations)"
        return plan, note, {**record, "peak_bytes_per_rank": None, "by_category": None, "recommendation": None,
                            "note": note}
    mp = plan_memory(cfg, plan, model_vocab_size(cfg.model, cfg.data.vocab_size), device)
    return plan, render_memory_plan(mp, plan.batch.dp), {**record, **mp.to_json()}
