"""The dry run's memory section: the traced peak per rank by category next to the device's memory, what the
trace cannot see, and the recommendation, in human units."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from ddptrain.plan.memory.planner import AUTO_MARGIN, STAGE_NAMES, GiB, MemoryPlan, Option

_STAGE_NAMES = STAGE_NAMES


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f} GiB"


def render_memory_plan(mp: MemoryPlan, world_size: int) -> str:
    out = Console(file=io.StringIO(), width=110, record=True, color_system=None)
    device = f"{mp.device.name} ({mp.device.memory_text()})"
    table = Table(title=f"Peak memory per rank on {device}: one training step traced on fake tensors "
                        f"(micro batch {mp.micro_batch}, checkpointing {mp.checkpointing}, {mp.dtype} compute, "
                        f"{_STAGE_NAMES[mp.stage]} on {world_size} ranks)")
    for column in ("at the peak", "per rank"):
        table.add_column(column, justify="left" if column == "at the peak" else "right")
    for category, nbytes in mp.by_category.items():
        table.add_row(category, _gib(nbytes))
    table.add_row(f"peak (in {mp.traced.phase})", _gib(mp.peak))
    for label, nbytes in mp.allowances.items.items():
        table.add_row(f"+ {label}", _gib(nbytes))
    verdict = "fits" if mp.fits else "does NOT fit"
    table.add_row("total", f"{_gib(mp.total)}: {verdict} in {mp.device.free_gib:,.1f} GiB")
    out.print(table)
    if mp.logits is not None:
        share = mp.logits
        how = (f"on, chunks of {share.chunk_tokens} tokens" if mp.chunked_loss else
               "off" if share.chunk_tokens is not None else "off: not exact for this model's head")
        out.print(f"LM head and loss at the peak (train.chunked_loss {how}): "
                  + ", ".join(f"{_gib(share.bytes[k])} with {k} (peak {_gib(share.peak[k])})" for k in share.bytes))
    out.print("Activations by model.activation_checkpointing (this micro batch and stage): " + ", ".join(
        f"{mode}: {_gib(by['activations'])} (peak {_gib(sum(by.values()))})" for mode, by in mp.by_mode.items()))
    out.print("The allowances are assumptions, not traced. ZeRO-1/2/3 figures shard the single-rank trace by "
              "formula (checked against 2-rank runs on CPU). The traced peak was checked on one GPU (gpt2_small, "
              "llama_1b: within 0.3% of torch.cuda.max_memory_allocated); sharding and allowances were not.")
    if not mp.options:
        out.print("Recommendation: no micro batch fits, at any ZeRO stage, in any checkpointing mode.")
        return out.export_text()
    usable = f"{mp.usable / GiB:,.1f} GiB usable ({mp.device.free_gib:,.1f} less a {AUTO_MARGIN:.0%} margin, as auto)"
    gaps = [o.fit_gap for o in mp.options if o.fit_gap is not None]
    fit = (f"; auto's search started from a fit of small traces, off by {min(gaps):+.1%} to {max(gaps):+.1%} "
           "there" if gaps else "")
    rec = Table(title=f"Largest micro batch that fits {usable}, per ZeRO stage and checkpointing mode, fastest "
                      f"first: each row a full trace at its micro batch{fit}")
    for column in ("stage", "checkpointing", "micro batch", "grad_accum", "per rank (with allowances)",
                   "predicted step", "speedup"):
        rec.add_column(column, justify="left" if column == "stage" else "right")
    for o in mp.options:
        held = f" (+{o.accumulation / GiB:,.2f} GiB)" if o.accumulation > 0 else ""
        rec.add_row(_STAGE_NAMES[o.stage], str(o.checkpointing), str(o.micro_batch),
                    f"{o.grad_accum}{held}", f"{o.total / GiB:,.1f} of {mp.usable / GiB:,.1f} GiB",
                    "?" if o.step_s is None else f"{o.step_s * 1e3:,.1f} ms",
                    "?" if o.speedup is None else f"{o.speedup:.2f}x on {world_size}")
    out.print(rec)
    if any(o.accumulation > 0 for o in mp.options):
        out.print("grad_accum (+x GiB): what accumulating holds of the row's bytes per rank (the earlier micro "
                  "batches' gradients), which a step without accumulation does not.")
    best = mp.options[0]
    note = mp.recommendation_note
    out.print(f"Recommendation: micro batch {best.micro_batch} (grad_accum {best.grad_accum}), checkpointing "
              f"{best.checkpointing}, {_STAGE_NAMES[best.stage]}: fits ({_bytes(best, mp.usable)})"
              + ("" if best.speedup is None else f", predicted {best.speedup:.2f}x on {world_size} devices")
              + ("" if best.step_s is None else f" ({best.step_s * 1e3:,.1f} ms a step)")
              + ("" if note is None else f"; {note}") + ".")
    if mp.host_note:
        out.print(f"Host: {mp.host_note}.")
    return out.export_text()


def _bytes(option: Option, usable: float) -> str:
    """An option's bytes per rank against the usable memory, with what accumulating adds shown where it does (the
    earlier micro batches' gradients: why a smaller micro batch can plan more than the undivided batch)."""
    held = f", {option.accumulation / GiB:,.2f} of it accumulation" if option.accumulation > 0 else ""
    return f"{option.total / GiB:,.1f} of {usable / GiB:,.1f} GiB{held}"
