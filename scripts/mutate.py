"""On-demand mutation check (not in CI): does the suite notice when a feature silently stops working?

    python scripts/mutate.py                 # every mutant, after a baseline run of their tests
    python scripts/mutate.py -k kernels      # the mutants whose name contains "kernels" (-k again: or another)
    python scripts/mutate.py --list          # names, files and tests, nothing run

Each mutant is a scripted edit (file, exact old text, new text; several edits for one mutant where a feature has
several call sites) and the tests that should notice it. The working tree (tracked and untracked files, not
ignored ones) is copied once to a temporary directory and installed editable into a venv of its own beside it
(seeing this environment's packages; ``tests/helpers/install.py``), so that the command-line tests, which run the
installed ``ddptrain`` with nothing on ``PYTHONPATH``, run the mutated copy too; each mutant is applied there, its
tests run by that venv's python with the copy first on ``PYTHONPATH``, and the files are restored before the
next. "killed": a test failed; "survived": every test passed with the feature broken; "stale": the old text is no
longer in the file (update the mutant). A baseline run first checks that each mutant's tests pass unmutated (a
kill on a failing test proves nothing).
Prints a markdown table ready for docs/mutation.md; exits 1 when a mutant survived or went stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers.install import venv_with  # noqa: E402  # the checkout's own test helper, by path


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the silent no-op it stands for
    edits: tuple[tuple[str, str, str], ...]  # (file, exact old text, new text)
    tests: tuple[str, ...]  # pytest arguments: node ids, files, or "-k" expressions


MUTANTS = [
    Mutant("checkpointing-off", "gradient checkpointing never enabled, plain or k-bit model",
           (("ddptrain/models/lora.py", "model, use_gradient_checkpointing=ckpt_kwargs is not None,",
             "model, use_gradient_checkpointing=False,"),
            ("ddptrain/models/lora.py", "model.activation_checkpointing_enable(", "(lambda **_: None)(")),
           ("tests/test_finetune.py",)),
    Mutant("selective-keeps-nothing", "the selective policy recomputes every op (full checkpointing)",
           (("ddptrain/models/checkpointing.py",
             "return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE",
             "return CheckpointPolicy.PREFER_RECOMPUTE"),),
           ("tests/test_activation_checkpointing.py",)),
    Mutant("selective-keeps-everything", "the selective policy keeps every op's output (no checkpointing)",
           (("ddptrain/models/checkpointing.py",
             "return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE",
             "return CheckpointPolicy.MUST_SAVE"),),
           ("tests/test_activation_checkpointing.py",)),
    Mutant("triton-selects-torch", "select_kernels('triton') returns the torch kernels",
           (("ddptrain/kernels/__init__.py", "    return _auto_kernels() if mode == \"auto\" else _triton_kernels()\n",
             "    return TORCH_KERNELS\n"),),
           ("tests/test_kernels.py",)),
    Mutant("loop-ignores-kernels", "the loop ignores parallel.kernels: engine, bf16 hook and clip on torch",
           (("ddptrain/train/trainer.py", "clip_gradients(self.model, cfg.optim.grad_clip, cfg.parallel.kernels)",
             'clip_gradients(self.model, cfg.optim.grad_clip, "torch")'),
            ("ddptrain/parallel/wrap.py", "collective=cfg.collective, kernels=cfg.kernels,",
             'collective=cfg.collective, kernels="torch",'),
            ("ddptrain/parallel/compression.py", "kernels = select_kernels(cfg.kernels, next(",
             'kernels = select_kernels("torch", next(')),
           ("tests/test_kernels.py", "-k", "training_loop")),
    Mutant("host-fit-constant", "the validation script's measure_host discards its measurements: a constant fit",
           (("scripts/cpu_host_fit.py", "    return HostFit(max(1.0, short / statistics.median(alone)),",
             "    return HostFit(1.2, 100.0, 500.0, 1.0, 0.01, 300.0, 1000.0)\n"
             "    return HostFit(max(1.0, short / statistics.median(alone)),"),),
           ("tests/test_predict.py", "-k", "host_fit")),
    Mutant("skew-not-from-telemetry", "the calibration ignores the rank skew its run's straggler telemetry measured",
           (("ddptrain/plan/whatif/calibration.py", "float(steady.rank_wait_for_slowest_pct or 0.0) / 100,",
             "0.0,"),),
           ("tests/test_predict.py", "-k", "skew or slowest")),
    Mutant("flat-ring-ignores-network", "the flat ring ignores the inter-node link",
           (("ddptrain/plan/whatif/layout.py",
             "slow = layout.inter if layout.inter.bandwidth_gbps < layout.intra.bandwidth_gbps else layout.intra",
             "slow = layout.intra"),),
           ("tests/test_predict.py", "-k", "flat_ring or anchor")),
    Mutant("readiness-not-contended", "buckets' readiness no longer scaled by contention",
           (("ddptrain/plan/whatif/predictor.py", "buckets = [(lead * contention, n) for lead, n in cal.buckets]",
             "buckets = list(cal.buckets)"),),
           ("tests/test_predict.py", "-k", "contention")),
    Mutant("async-save-synchronous", "every save synchronous: the background writer never used",
           (("ddptrain/checkpoint/checkpointer.py",
             "        if self._writer is None:\n            try:\n                dcp.save(",
             "        if True:\n            try:\n                dcp.save("),),
           ("tests/test_checkpoint_format.py", "-k", "asynchronous")),
    Mutant("grad-norm-to-host", "grad_norm.to('cpu') on every step (a device-to-host sync on CUDA)",
           (("ddptrain/train/trainer.py", "nonfinite = ~torch.isfinite(grad_norm)",
             'nonfinite = ~torch.isfinite(grad_norm.to("cpu"))'),),
           ("tests/test_hot_path.py", "-k", "steady")),
    Mutant("help-skips-sections", "schema_keys skips two sections of the schema",
           (("ddptrain/app/help.py", "        if dataclasses.is_dataclass(tp):\n            keys += schema_keys",
             '        if dataclasses.is_dataclass(tp):\n            if f.name in ("profile", "metrics"):\n'
             "                continue\n            keys += schema_keys"),),
           ("tests/test_hydra_app.py", "-k", "help_lists")),
    # beyond the table: where a silent no-op would still train and look plausible
    Mutant("reducer-sums-not-averages", "the engines' reducer skips the division by the world size",
           (("ddptrain/engines/reducer.py", "bucket.finish(used, 1.0 / self._world, self.kernels)",
             "bucket.finish(used, 1.0, self.kernels)"),),
           ("tests/test_engines.py", "-k", "matches_torch_ddp and not triton")),
    Mutant("engine-never-overlaps", "the engines launch no bucket during backward (all at its end)",
           (("ddptrain/engines/reducer.py", "if bucket.pending == 0 and self.policy.overlap:",
             "if bucket.pending == 0 and False:"),),
           ("tests/test_engines.py", "-k", "overlapping")),
    Mutant("token-share-not-per-rank", "token-weighted loss divides by the global tokens, not the rank's share",
           (("ddptrain/step/weighting.py", "per_rank_share = total.clamp(min=1).to(torch.float32) / world",
             "per_rank_share = total.clamp(min=1).to(torch.float32)"),),
           ("tests/test_finetune.py", "-k", "token_weighted")),
    Mutant("loss-tokens-count-the-first", "loss tokens counted without the causal shift",
           (("ddptrain/step/tokens.py", "return (labels[:, 1:] != IGNORE).sum()", "return (labels != IGNORE).sum()"),),
           ("tests/test_tokens.py", "tests/test_finetune.py", "-k",
            "first_label or token_weighted or prompt_and_padding")),
    Mutant("kernels-unchecked", "select_kernels no longer refuses Triton where it cannot run",
           (("ddptrain/kernels/__init__.py", "    check_kernels(mode, device.type)\n", ""),),
           ("tests/test_kernels.py", "-k", "refused or startup_error")),
    Mutant("async-commit-before-write", "the background writer commits before the write has finished",
           (("ddptrain/checkpoint/checkpointer.py",
             "        staged.result()\n        if self.rank == 0:  # the checksums are taken here, on the writer "
             "thread, not the training thread\n            self._commit(tmp, final, meta)",
             "        if self.rank == 0:\n            self._commit(tmp, final, meta)\n        staged.result()\n"
             "        if self.rank == 0:"),),
           ("tests/test_checkpoint_format.py", "tests/test_reliability.py")),
    Mutant("last-save-not-awaited", "save(wait=True) returns before the background write is committed",
           (("ddptrain/checkpoint/checkpointer.py", "        if wait:\n            self.wait()\n",
             "        if wait:\n            pass\n"),),
           ("tests/test_checkpoint_format.py", "tests/test_reliability.py")),
    Mutant("calibration-drops-data-time", "the predictor's compute leaves out the data phase",
           (("ddptrain/plan/whatif/calibration.py", 'micro = (_needed(steady.time_data_s, "time_data_s") + (',
             "micro = (0.0 + ("),),
           ("tests/test_predict.py", "-k", "records_its_buckets")),
    Mutant("calibration-drops-readiness", "the predictor takes every bucket as ready at the end of backward",
           (("ddptrain/plan/whatif/calibration.py", "buckets = [(float(lead), int(n)) for lead, n in",
             "buckets = [(0.0, int(n)) for lead, n in"),),
           ("tests/test_predict.py", "-k", "records_its_buckets")),
    # issue 33: mutants of the previous round's features that survived an audit, and the assertion that kills each
    Mutant("packed-leak-check-skipped", "a packed prompt/completion run never checks that packed examples stay apart",
           (("ddptrain/train/trainer.py",
             "            check_packed_attention(model, data.vocab_size, self.autocast)",
             "            pass"),),
           ("tests/test_packing.py", "-k", "leak or refused")),
    Mutant("zero2-unsharded-scaler", "ZeRO-2/3 under fp16 gets torch's GradScaler: each rank checks only its shard",
           (("ddptrain/train/trainer.py", "sharded=cfg.parallel.zero_stage >= 2", "sharded=False"),),
           ("tests/test_fp16.py", "-k", "overflow")),
    Mutant("tokens-seen-drops-untimed", "tokens_seen leaves out the steps kept out of a window (the memory tracker's)",
           (("ddptrain/telemetry/metrics.py", "        self._untimed += self.tokens.take()[0]",
             "        self.tokens.take()"),),
           ("tests/test_telemetry.py", "-k", "tokens_seen or metrics_are_present")),
    Mutant("ckpt-info-skips-sizes", "ddptrain-ckpt info reads a checkpoint without the recorded-size check",
           (("ddptrain/checkpoint/offline.py", "    checkpoint, meta, state = open_checkpoint(path)\n    now = ",
             "    checkpoint = find_checkpoint(path, \"checkpoints\", \"PATH\")\n"
             "    meta, state = read_trainer_state(checkpoint, \"PATH\")\n    now = "),),
           ("tests/test_checkpoint_safety.py", "-k", "info or export")),
    Mutant("ckpt-export-skips-sizes", "ckpt export reads a checkpoint without its recorded sizes and checksums",
           (("ddptrain/checkpoint/offline.py", "    checkpoint, _, _ = open_checkpoint(path, checksums=True)",
             "    checkpoint = find_checkpoint(path, \"checkpoints\", \"PATH\")"),),
           ("tests/test_checkpoint_safety.py", "-k", "info or export")),
    # (issue 40 rewrote the verdict: it follows "waits for" links now, with no highest collective to pick; this is
    # the same behaviour's break there, a waiter below the others' collective never named as the late one)
    Mutant("verdict-lowest-waiter", "the hang verdict never names a waiter whose peers all went past it as late",
           (("ddptrain/diagnose/verdict.py", "    return {m for m in reached if not behind.get(m)}",
             "    return {m for m in reached if m not in waiters}"),),
           ("tests/test_verdict.py",)),
    Mutant("prepare-reencodes-finished", "a resumed preparation encodes every document again (finished shards kept)",
           (("ddptrain/data/prepare.py",
             "        return index >= resume[\"val\" if is_validation(index, val_fraction) else \"train\"]",
             "        return True"),),
           ("tests/test_data_prepare.py", "-k", "interrupted")),
    Mutant("stream-position-per-rank", "the streaming position counts this rank's windows, not all ranks'",
           (("ddptrain/data/streaming.py", "self.position += self.shape.micro_batch_size * self.shape.dp",
             "self.position += self.shape.micro_batch_size"),),
           ("tests/test_data_prepare.py", "-k", "stream and not training_run")),
    Mutant("plan-recommends-unfit", "the memory plan recommends micro batches whose peak fits but not with allowances",
           (("ddptrain/plan/memory/planner.py",
             "        return sum(categories.values()) + allowances(categories, stage).total",
             "        return sum(categories.values())"),),
           ("tests/test_memory_trace.py", "-k", "plan_json or recommend")),
    Mutant("plan-fits-ignores-allowances", "plan.json's fits compares the traced peak alone with the device",
           (("ddptrain/plan/memory/planner.py", "return self.total <= self.device.free_gib * GiB",
             "return self.peak <= self.device.free_gib * GiB"),),
           ("tests/test_memory_trace.py", "-k", "plan_json or recommend")),
    Mutant("pretrain-step-builds-cache", "the pretraining step's forward leaves use_cache at the config's True",
           (("ddptrain/step/weighting.py", "module(input_ids=ids, labels=ids, use_cache=False)",
             "module(input_ids=ids, labels=ids)"),),
           ("tests/test_pretrained.py", "-k", "cache")),
    Mutant("rope-theta-dropped", "model.rope_theta never reaches the built Llama/Qwen3 config (10000 instead)",
           (("ddptrain/models/build.py", "rope_theta=cfg.rope_theta, ", ""),),
           ("tests/test_flops.py",)),
    Mutant("fp16-unscale-after-clip", "fp16: the gradients are clipped while still scaled, then unscaled",
           (("ddptrain/train/trainer.py",
             "            if self.scaler is not None:\n                self.scaler.unscale(self.optimizer)  # fp16: "
             "true gradients before the norm and clipping\n            grad_norm = clip_gradients(self.model, "
             "cfg.optim.grad_clip, cfg.parallel.kernels)\n",
             "            grad_norm = clip_gradients(self.model, cfg.optim.grad_clip, cfg.parallel.kernels)\n"
             "            if self.scaler is not None:\n                self.scaler.unscale(self.optimizer)\n"),),
           ("tests/test_fp16.py", "-k", "gradient_norm")),  # the loss comparison alone catches it by a hair
    # issue 31: one non-finite step under compression and fp16
    Mutant("topk-keeps-bad-residuals", "a skipped step leaves top-k's non-finite residuals behind",
           (("ddptrain/parallel/compression.py", "            residual.masked_fill_(nonfinite, 0.0)",
             "            pass"),),
           ("tests/test_nonfinite.py", "-k", "compressed")),
    Mutant("powersgd-keeps-bad-state", "a skipped step leaves PowerSGD's non-finite error and Q behind",
           (("ddptrain/parallel/compression.py",
             "if not (powersgd.error_dict or powersgd.q_memory_dict) or not bool(nonfinite):", "if True:"),),
           ("tests/test_nonfinite.py", "-k", "compressed")),
    Mutant("fp16-overflow-is-an-event", "fp16 counts an overflow from a finite loss as a nan_policy event",
           (("ddptrain/step/control.py",
             "self.events[slot] = torch.where(torch.isfinite(loss.detach()), 0, step)",
             "self.events[slot] = torch.where(nonfinite_gradients, step, 0)"),),
           ("tests/test_nonfinite.py", "-k", "fp16")),
    Mutant("fp16-nan-loss-is-a-back-off", "fp16 treats a non-finite loss as the scaler's back-off",
           (("ddptrain/step/control.py",
             "self.events[slot] = torch.where(torch.isfinite(loss.detach()), 0, step)",
             "self.events[slot] = 0"),),
           ("tests/test_nonfinite.py", "-k", "fp16")),
    # issue 40 (top-k's sum in rank order) and issue 41 (top-k's residuals after a skipped step)
    Mutant("topk-zeroes-only-bad-residuals", "a skipped step zeroes only top-k's non-finite residual entries",
           (("ddptrain/parallel/compression.py", "            residual.masked_fill_(nonfinite, 0.0)",
             "            residual.masked_fill_(nonfinite & ~torch.isfinite(residual), 0.0)"),),
           ("tests/test_compression.py", "-k", "skipped_step")),
    Mutant("topk-scatter-add", "top-k adds every rank's entries with one index_add_ (any order on CUDA)",
           (("ddptrain/parallel/compression.py",
             "    for rank_values, rank_index in zip(values, index, strict=True):\n"
             "        out[rank_index] = out[rank_index] + rank_values\n    return out\n",
             "    return out.index_add_(0, index.flatten(), values.flatten())\n"),),
           ("tests/test_compression.py", "-k", "topk")),
    # issue 40: replicas that drift apart
    Mutant("drift-check-blind", "the check never sees replicas that differ (a slot's max taken for its min)",
           (("ddptrain/train/drift.py", "if words[:WORDS] != [~w for w in words[WORDS:]]]",
             "if words[:WORDS] != words[:WORDS]]"),),
           ("tests/test_drift.py", "-k", "drifted_ddp_replica")),
    Mutant("drift-policy-ignored", "train.drift_policy=rebroadcast compares nothing (as off would)",
           (("ddptrain/train/drift.py", "return self.policy != DriftPolicy.off and self.groups.comparable",
             "return self.policy == DriftPolicy.abort and self.groups.comparable"),),
           ("tests/test_fault_matrix.py", "-k", "rebroadcast and not compiled")),
    Mutant("drift-fingerprint-on-host", "the fingerprint is computed on a host copy of each parameter",
           (("ddptrain/train/drift.py", "replica = self.combined([tensor for _, tensor in",
             "replica = self.combined([tensor.cpu() for _, tensor in"),),
           ("tests/test_hot_path.py", "-k", "check_and_logging")),
    Mutant("k8s-pod-ignores-operator", "ddptrain in an operator's pod starts a standalone torchrun, not the job's",
           (("ddptrain/app/launch.py", '    return "PET_NNODES" in os.environ and not is_worker()',
             "    return False"),),
           ("tests/test_k8s.py", "-k", "starts_torchrun")),
    Mutant("k8s-v1-master-dropped", "a Training Operator v1 pod's MASTER_ADDR/MASTER_PORT are not passed to torchrun",
           (("ddptrain/app/launch.py",
             "        if f\"PET_{option.upper().replace('-', '_')}\" not in env and fallback in env:",
             "        if False:"),),
           ("tests/test_k8s.py", "-k", "starts_torchrun")),
    Mutant("k8s-schema-lax", "the CRD check lets unknown fields through (what kubectl's strict validation refuses)",
           (("tests/helpers/crds.py", "        out[\"additionalProperties\"] = False", "        pass"),),
           ("tests/test_k8s.py", "-k", "schema_check")),
    Mutant("k8s-env-twice", "an --env variable the manifest sets already is listed twice (the API server refuses it)",
           (("ddptrain/app/k8s_manifest.py", "return list(by_name.values())",
             'return [*env, *({"name": k, "value": v} for k, v in spec.env)]'),),
           ("tests/test_k8s.py", "-k", "replaces")),
    Mutant("ray-attempt-not-counted", "a Ray restart is not an attempt: no forced resume, the fault fires again",
           (("ddptrain/app/ray_worker.py", 'os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)',
             'os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"'),),
           ("tests/test_ray.py", "-k", "killed")),
    # what an H100/H200 run found wrong (docs/benchmarks.md, "On a GPU")
    Mutant("plan-traces-cpu-autocast-for-a-gpu", "a GPU's step is traced under the CPU's autocast dtypes",
           (("ddptrain/plan/memory/trace.py",
             'policy = (cuda_autocast_policy() if setup.device_type == "cuda" and setup.compute_dtype is not None',
             'policy = (cuda_autocast_policy() if False'),),
           ("tests/test_cuda_autocast.py", "-k", "gelu")),
    Mutant("auto-clips-with-triton", "parallel.kernels=auto clips with the fused kernels (slower on an H100)",
           (("ddptrain/kernels/clip.py", 'if fusable and mode != "auto" else TORCH_KERNELS',
             "if fusable else TORCH_KERNELS"),),
           ("tests/test_kernels.py", "-k", "auto_clips")),
    Mutant("window-counts-checkpoint-save", "a checkpoint's save is counted as step time in its logging window",
           (("ddptrain/train/trainer.py",
             "saving = self.metrics.excluded() if self.checkpoints.due(step, last) or done.stop else nullcontext()",
             "saving = nullcontext()"),),
           ("tests/test_telemetry.py", "-k", "checkpoint_saves")),
    # the GPU path on CPU: the image's build context, what a run reads from its GPU (faked torch.cuda)
    Mutant("gpu-image-forgets-plugin", "the Dockerfile no longer copies hydra_plugins/ (pip cannot build the package)",
           (("Dockerfile", "COPY hydra_plugins ./hydra_plugins\n", ""),),
           ("tests/test_dockerfile.py", "-k", "build_context")),
    Mutant("gpu-auto-ignores-memory-in-use", "auto and the dry run plan a GPU's whole memory, whatever is in use",
           (("ddptrain/plan/memory/present.py", "in_use_gib=in_use / GiB,", "in_use_gib=0.0,"),),
           ("tests/test_device_memory.py", "-k", "in_use or left")),
    Mutant("gpu-auto-plans-preset-memory", "a present GPU is planned with the memory of the preset its name matches",
           (("ddptrain/plan/memory/present.py", "return Device(name, properties.total_memory / GiB,",
             "return Device(name, DEVICES[kind].memory_gib if kind else properties.total_memory / GiB,"),),
           ("tests/test_device_memory.py", "-k", "own_memory or as_it_is")),
    Mutant("gpu-flash-below-sm80", "FlashAttention-2 chosen on a GPU below compute capability 8.0",
           (("ddptrain/models/attention.py", "    if (major, minor) >= (8, 0):\n        return None",
             "    if True:\n        return None"),),
           ("tests/test_gpu_path.py", "-k", "flash_attention_is_chosen")),
    Mutant("gpu-nccl-one-communicator", "HSDP's shard and replicate communicators not counted",
           (("ddptrain/plan/memory/overheads.py", "return 3 if self.hsdp and stage >= 2 else 1", "return 1"),),
           ("tests/test_device_memory.py", "-k", "nccl")),
    Mutant("gpu-allocator-left-default", "the command no longer turns on expandable segments",
           (("ddptrain/app/cli.py", "    use_expandable_segments(os.environ)  # before", "    pass  # before"),),
           ("tests/test_device_memory.py", "-k", "expandable")),
    Mutant("gpu-host-note-never", "the plan never says eager selective checkpointing makes the host the bound",
           (("ddptrain/plan/memory/host_cost.py", "    if host <= block_s:\n        return None",
             "    if True:\n        return None"),),
           ("tests/test_memory_trace.py", "-k", "host_the_bound")),
    Mutant("checkpoint-reentrant-ignored", "model.checkpoint_reentrant=true runs torch's non-reentrant checkpoint",
           (("ddptrain/models/checkpointing.py", 'return {"use_reentrant": cfg.checkpoint_reentrant}',
             'return {"use_reentrant": False}'),),
           ("tests/test_activation_checkpointing.py", "-k", "reentrant")),
    Mutant("saved-ops-typo-sdpa-flash", "a typo in the selective policy's set: SDPA's CUDA flash kernel recomputed",
           (("ddptrain/models/checkpointing.py", '"aten::_scaled_dot_product_flash_attention", "aten::_scaled',
             '"aten::_scaled_dot_product_flash_atention", "aten::_scaled'),),
           ("tests/test_activation_checkpointing.py", "-k", "exists")),
    Mutant("saved-ops-typo-flash-attn", "a typo in the selective policy's set: flash-attn's varlen kernel recomputed",
           (("ddptrain/models/checkpointing.py", '"flash_attn::_flash_attn_varlen_forward"',
             '"flash_attn::_flash_attn_varlen_fwd"'),),
           ("tests/test_activation_checkpointing.py", "-k", "exists or flash")),
    # issue 41 (verdict): what the hang verdict reads, and issue 40's two defects kept fixed
    Mutant("verdict-record-ignores-dump", "a rank's record with no collectives ignores its NCCL dump",
           (("ddptrain/diagnose/verdict.py", "        if not rec.get(\"collectives\") and dumps.get(r):",
             "        if False:"),),
           ("tests/test_verdict.py",)),
    Mutant("verdict-reads-checkpoint-group", "the async checkpoint's gloo group is read with the training's groups",
           (("ddptrain/diagnose/trace.py", "and _group(e) is not None and _desc(e) not in SIDE_GROUPS]",
             "and _group(e) is not None]"),),
           ("tests/test_verdict.py",)),
    Mutant("verdict-last-entries-only", "the verdict reads a dump's last 8 entries, not the whole ring",
           (("ddptrain/diagnose/trace.py", "    out = [_collective(e) for e in entries]\n",
             "    out = [_collective(e) for e in entries[-8:]]\n"),),
           ("tests/test_verdict.py",)),
    Mutant("verdict-default-group-only", "the verdict reads the default process group's collectives only",
           (("ddptrain/diagnose/trace.py", "and _group(e) is not None and _desc(e) not in SIDE_GROUPS]",
             "and _group(e) == DEFAULT_GROUP and _desc(e) not in SIDE_GROUPS]"),),
           ("tests/test_verdict.py",)),
    # issue 41: the chunked loss's mutants that survived an audit
    Mutant("chunked-logsoftmax-not-upcast", "the chunked loss's log-softmax in the autocast dtype, not fp32",
           (("ddptrain/models/chunked_loss.py", "logp = torch.log_softmax(torch.mm(h, w.t()).float(), dim=1)",
             "logp = torch.log_softmax(torch.mm(h, w.t()), dim=1).float()"),),
           ("tests/test_chunked_loss.py", "-k", "autocast")),
    Mutant("chunked-head-matmul-fp32", "the chunked head's logits matmul in fp32 under bf16/fp16 autocast",
           (("ddptrain/models/chunked_loss.py", "logp = torch.log_softmax(torch.mm(h, w.t()).float(), dim=1)",
             "logp = torch.log_softmax(torch.mm(h.float(), w.t().float()), dim=1)"),),
           ("tests/test_chunked_loss.py", "-k", "autocast")),
    Mutant("chunked-eval-computes-gradients", "evaluation (no_grad) computes the chunked head's gradients too",
           (("ddptrain/models/chunked_loss.py",
             "    if not torch.is_grad_enabled():  # evaluation: no gradient to compute in forward\n"
             "        hidden, weight = hidden.detach(), weight.detach()\n", ""),),
           ("tests/test_chunked_loss.py", "-k", "evaluation")),
    Mutant("chunked-default-chunk-by-hidden", "the default chunk sized by the hidden size, not the vocabulary",
           (("ddptrain/models/chunked_loss.py", "chunk_tokens_for(head.out_features,",
             "chunk_tokens_for(head.in_features,"),),
           ("tests/test_chunked_loss.py", "-k", "default_chunk")),
    Mutant("help-imports-matplotlib", "the sweep report imports matplotlib at module import (every --help pays)",
           (("ddptrain/app/sweep_report.py", "from hydra.experimental.callback import Callback\n",
             "from hydra.experimental.callback import Callback\nimport matplotlib.figure\n"),),
           ("tests/test_startup.py", "-k", "help")),
    Mutant("preflight-imports-torch-first", "the start-up checks import torch before the checks that need none",
           (("ddptrain/app/preflight.py", "    validate_source(cfg.data)\n",
             "    import torch  # noqa: F401\n    validate_source(cfg.data)\n"),),
           ("tests/test_startup.py", "-k", "config_error")),
    Mutant("synthetic-imports-datasets", "every data source, synthetic too, goes through datasets' import",
           (("ddptrain/data/dataset.py", "    if uses_datasets(cfg):\n", "    if True:\n"),),
           ("tests/test_startup.py", "-k", "synthetic")),
    Mutant("budget-never-fails", "the fast tier's budget is measured and never enforced",
           (("tests/helpers/timing.py",
             '        if budget and tier(item) == "fast" and report.passed and cpu > budget:',
             "        if False:"),),
           ("tests/test_suite_tools.py", "-k", "budget")),
    Mutant("xdist-groups-nothing", "tests sharing a module fixture get no xdist group (each worker sets it up)",
           (("tests/helpers/xdist_groups.py", "            item.add_marker(pytest.mark.xdist_group(group))",
             "            pass"),),
           ("tests/test_suite_tools.py", "-k", "xdist")),
    Mutant("run-cache-runs-again", "the run cache starts a run again for every test that asks",
           (("tests/helpers/run_cache.py", "            if not record.is_file():", "            if True:"),),
           ("tests/test_suite_tools.py", "-k", "each_distinct_run")),
    # issue 41: mutants of the previous round that survived an audit (auto micro batch, goodput, FLOPs,
    # tokens_seen, malformed records, sweeps), and the assertions that kill them
    Mutant("auto-whole-batch-unchecked", "auto takes the whole per-rank batch on the fit's word, no exact trace",
           (("ddptrain/plan/memory/auto_batch.py",
             "if per_rank > 1 and fits(per_rank):",
             "if per_rank > 1 and fits(per_rank, fitted=True):"),),
           ("tests/test_auto_batch.py", "-k", "whole_per_rank or whole_batch or largest")),
    Mutant("auto-whole-batch-accumulates", "auto plans the whole per-rank batch as an accumulating micro batch",
           (("ddptrain/plan/memory/auto_batch.py", "n, accumulating = plan.batch.dp, micro_batch < self.per_rank",
             "n, accumulating = plan.batch.dp, micro_batch <= self.per_rank"),),
           ("tests/test_auto_batch.py", "-k", "whole_per_rank or whole_batch or largest")),
    Mutant("goodput-blocking-is-productive", "a step's eval and save time also counted as productive",
           (("ddptrain/telemetry/goodput.py", "seconds[bucket] += now - self._step_start - self._inside",
             "seconds[bucket] += now - self._step_start"),),
           ("tests/test_goodput.py",)),
    Mutant("goodput-save-not-recorded", "a save on a step that does not log is recorded only later (a kill loses it)",
           (("ddptrain/telemetry/goodput.py", "if record or saved or now - self.attempt.recorded_at >= RECORD_EVERY_S:",
             "if record or now - self.attempt.recorded_at >= RECORD_EVERY_S:"),),
           ("tests/test_goodput.py",)),
    Mutant("goodput-redone-over-step-number", "redone time prorated over the step number, not the attempt's steps",
           (("ddptrain/telemetry/goodput.py",
             "return productive * (a.last_step - kept_upto) / done if done else 0.0",
             "return productive * (a.last_step - kept_upto) / a.last_step if done else 0.0"),),
           ("tests/test_goodput.py",)),
    Mutant("flops-pretrained-no-attention", "a pretrained model's FLOPs per token leave out attention",
           (("ddptrain/train/trainer.py",
             "return TokenFlops(4.0 * self.n_params + 2.0 * self.trainable + attention * seq_len, attention)",
             "return TokenFlops(4.0 * self.n_params + 2.0 * self.trainable, attention)"),),
           ("tests/test_pretrained.py", "-k", "every_step_of_a_run")),
    Mutant("flops-gqa-per-kv-head", "a pretrained model's attention FLOPs counted per key/value head (GQA)",
           (("ddptrain/models/flops.py", "    heads = config.num_attention_heads\n",
             "    heads = getattr(config, \"num_key_value_heads\", None) or config.num_attention_heads\n"),),
           ("tests/test_flops.py",)),
    Mutant("tokens-seen-streamed-restarts", "a streamed run resumed from a checkpoint without the count restarts at 0",
           (("ddptrain/train/trainer.py", "batches.tokens_seen = per_step * start",
             "batches.tokens_seen = 0"),),
           ("tests/test_data_prepare.py", "-k", "streamed_training_run")),
    Mutant("parquet-record-per-batch", "a parquet record's number restarts at every 1,024-row Arrow batch",
           (("ddptrain/data/corpus.py",
             "    number = 0\n    for batch in parquet.iter_batches(batch_size=batch_rows, columns=present):\n",
             "    for batch in parquet.iter_batches(batch_size=batch_rows, columns=present):\n        number = 0\n"),),
           ("tests/test_malformed_records.py",)),
    Mutant("hub-record-counted-after", "a hub record is counted after it is read (record 3 reported as 2)",
           (("ddptrain/data/instruct.py",
             "            number += 1\n            yield _pair({cfg.prompt_field: prompt, cfg.completion_field: "
             "completion}, fields,\n                        f\"data.name={cfg.name}: record {number}\")\n",
             "            yield _pair({cfg.prompt_field: prompt, cfg.completion_field: completion}, fields,\n"
             "                        f\"data.name={cfg.name}: record {number}\")\n            number += 1\n"),),
           ("tests/test_malformed_records.py",)),
    Mutant("fail-fast-any-launcher", "--fail-fast accepted with a launcher that runs the jobs at once",
           (("ddptrain/app/sweep.py", 'if fail_fast and chosen.get("hydra/launcher", "ddptrain") != "ddptrain":',
             'if fail_fast and chosen.get("hydra.launcher", "ddptrain") != "ddptrain":'),),
           ("tests/test_sweep.py", "-k", "one_line_before_any_job")),
    Mutant("sweep-md-objective-3-digits", "sweep.md rounds the objective to 3 digits (2.123449 and 2.123351: 2.12)",
           (("ddptrain/app/sweep_report.py", '        return f"{value:.6g}"\n', '        return f"{value:.3g}"\n'),),
           ("tests/test_sweep.py", "-k", "digits or optuna_search_gets")),
    Mutant("step-holds-micro-loss", "the step keeps a micro batch's loss, and its graph, through the next forward",
           (("ddptrain/step/compute.py", "        del loss  # its graph", "        pass  # its graph"),),
           ("tests/test_step.py",)),
    # issue 44, the fast tier's pace: what made tests wait or spin, each pinned by a test
    Mutant("loader-keeps-failed-workers", "a loader whose worker hit a damaged shard keeps its workers until garbage "
                                          "collected (torch's 5 s join, in whichever test collected it)",
           (("ddptrain/data/loader.py", "            exc.__traceback__ = None\n            self._it = None\n", ""),),
           ("tests/test_data_prepare.py", "-k", "damaged_in_place")),
    Mutant("xdist-workers-every-core", "each pytest-xdist worker's torch takes a thread per core (4 on 2 cores)",
           (("tests/helpers/xdist_threads.py", "        torch.set_num_threads(", "        int("),),
           ("tests/test_suite_tools.py", "-k", "share_of_the_cores")),
    Mutant("stdlib-corpus-enters-tests", "the stdlib corpus walks into its test folders (and keeps their sources)",
           (("ddptrain/data/corpus.py", "        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]\n",
             ""),),
           ("tests/test_data.py", "-k", "stdlib")),
    # issues 51 and 52 (diagnose): torch's pg_status from -1, and the verdict's rules no test needed before
    Mutant("verdict-status-minus-one-as-is", "torch's -1 (no collective completed) read as a number: an unfinished "
                                             "collective #0 invented, a first-collective hang gets no verdict",
           (("ddptrain/diagnose/trace.py", "max(0, int(status.get(\"last_completed_collective\") or 0)))",
             "int(status.get(\"last_completed_collective\") or 0))"),),
           ("tests/test_verdict.py", "-k", "minus_one or first_collective")),
    Mutant("nccl-twin-status-from-zero", "the NCCL twin's pg_status starts at 0, not torch's -1",
           (("tests/helpers/nccl_twin.py",
             'INITIAL_STATUS = {"last_enqueued_collective": -1, "last_started_collective": -1, '
             '"last_completed_collective": -1}',
             'INITIAL_STATUS = {"last_enqueued_collective": 0, "last_started_collective": -1, '
             '"last_completed_collective": 0}'),),
           ("tests/test_verdict.py", "-k", "minus_one or first_collective")),
    Mutant("verdict-one-name-one-ranks", "a group name read with one set of ranks for every rank (torch names HSDP's "
                                         "replica group alike on every rank)",
           (("ddptrain/diagnose/verdict.py",
             "return sorted(self.own.get((rank, group)) or self.ranks.get(group) or [rank])",
             "return sorted(self.ranks.get(group) or [rank])"),),
           ("tests/test_verdict.py", "-k", "one_group_name")),
    Mutant("verdict-run-ahead-peer-not-behind", "a peer whose host enqueued past the waiter's collective but is "
                                                "stuck before it is not behind",
           (("ddptrain/diagnose/verdict.py",
             "if m != r and (progress(traces.get(m), group) < seq or _stuck_before(traces.get(m), group, seq)):",
             "if m != r and progress(traces.get(m), group) < seq:"),),
           ("tests/test_verdict.py", "-k", "ran_past")),
    Mutant("verdict-completion-from-pg-status-only", "completion read from pg_status only, not the entries' states",
           (("ddptrain/diagnose/trace.py", '        if e.get("state") == "completed":', "        if False:"),),
           ("tests/test_verdict.py", "-k", "pg_status_lags")),
    Mutant("verdict-pg-config-ranks-unread", "pg_config's ranks string not read: a group's ranks only from the ranks "
                                             "that recorded its collectives",
           (("ddptrain/diagnose/trace.py", '"ranks": _ranks(config.get("ranks"))}', '"ranks": None}'),),
           ("tests/test_verdict.py", "-k", "from_pg_config")),
    # issues 51 and 52: ddptrain-k8s against the operators' webhooks, the pods' volume and capabilities, Ray's env
    Mutant("k8s-manager-not-domain", "the TrainJob's runtime patch manager is not a domain-prefixed path (Trainer's "
                                     "webhook refuses it at apply)",
           (("ddptrain/app/k8s_manifest.py", 'MANAGER = "ddptrain.dev/ddptrain-k8s"', 'MANAGER = "ddptrain-k8s"'),),
           ("tests/test_k8s.py", "-k", "passes_its_operators")),
    Mutant("k8s-no-fsgroup", "the pods set no fsGroup: uid 10001 cannot write a fresh volume's root",
           (("ddptrain/app/k8s_manifest.py", 'return {"fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"}',
             'return {"fsGroupChangePolicy": "OnRootMismatch"}'),),
           ("tests/test_k8s.py", "-k", "images_group")),
    Mutant("k8s-ipc-lock-for-non-root", "a non-root container asks for IPC_LOCK, which execve drops",
           (("ddptrain/app/k8s_manifest.py", "    if not spec.ib_root:\n        return None",
             '    if not spec.ib_root:\n        return {"capabilities": {"add": ["IPC_LOCK"]}}'),),
           ("tests/test_k8s.py", "-k", "images_group")),
    Mutant("ray-pytorch-env-dropped", "Ray workers on other hosts run without the driver's PYTORCH_* allocator setting",
           (("ddptrain/app/ray_launch.py", '"TORCH_", "PYTORCH_", "NCCL_"', '"TORCH_", "NCCL_"'),),
           ("tests/test_ray.py", "-k", "allocator_settings")),
    Mutant("k8s-docs-port-29400", "docs/multinode.md states Trainer v2's master port as 29400 again",
           (("docs/multinode.md", "`PET_MASTER_PORT` (29500)", "`PET_MASTER_PORT` (29400)"),),
           ("tests/test_k8s.py", "-k", "master_port_is")),
    Mutant("k8s-one-default-name", "every job without --name shares one run dir (a second job resumes the first)",
           (("ddptrain/app/k8s.py", "        args.name = default_name()", '        args.name = "ddptrain"'),),
           ("tests/test_k8s.py", "-k", "own_run_dir")),
    Mutant("k8s-claim-never-printed", "--claim-size prints no PersistentVolumeClaim",
           (("ddptrain/app/k8s_manifest.py",
             "return [*([volume_claim(spec)] if spec.claim_size else []), manifest(kind, spec)]",
             "return [manifest(kind, spec)]"),),
           ("tests/test_k8s.py", "-k", "claim_is_printed")),
    Mutant("k8s-pytorchjob-shared-template", "the PyTorchJob's Worker shares the Master's template (printed as a YAML "
                                             "anchor without the printer's guard; edited together)",
           (("ddptrain/app/k8s_manifest.py", '        replicas["Worker"] = replica(spec.nodes - 1)',
             '        replicas["Worker"] = {**replicas["Master"], "replicas": spec.nodes - 1}'),),
           ("tests/test_k8s.py", "-k", "without_anchors")),
    Mutant("k8s-run-dir-string-prefix", "hydra.run.dir=/mnt/ddptrain-old/run passes as on the volume /mnt/ddptrain",
           (("ddptrain/app/k8s.py", "        if not absolute or not under(path, mount):",
             "        if not absolute or not path.startswith(mount) or path == mount:"),),
           ("tests/test_k8s.py", "-k", "refused_in_one_line")),
    Mutant("launch-elastic-min-nodes", "an elastic job (PET_NNODES=MIN:MAX) is checked at MIN nodes, not MAX",
           (("ddptrain/app/launch.py", 'nnodes = env["PET_NNODES"].split(":")[-1]',
             'nnodes = env["PET_NNODES"].split(":")[0]'),),
           ("tests/test_k8s.py", "-k", "elastic")),
    Mutant("ray-ended-exits-1", "a Ray run the workers ended on purpose (exit 4) makes the driver exit 1",
           (("ddptrain/app/ray_launch.py", "        return int(metrics[EXIT_CODE])", "        return 1"),),
           ("tests/test_ray.py", "-k", "ended_on_purpose")),
    Mutant("cli-operator-pod-alone", "an operator's pod of one process per node trains alone, without torchrun",
           (("ddptrain/app/cli.py", "(run.typed.launch.nproc_per_node > 1 or launch.operator_pod())",
             "run.typed.launch.nproc_per_node > 1"),),
           ("tests/test_k8s.py", "-k", "one_process_per_node")),
    # issues 51 (items 5, 6) and 52 (the GPU-only choices, reached on CPU with fake_cuda and FakeTensors)
    Mutant("allocator-cuda-conf-first", "expandable_segments read from PYTORCH_CUDA_ALLOC_CONF before "
                                        "PYTORCH_ALLOC_CONF (torch 2.13 reads the generic key the other way)",
           (("ddptrain/runtime/allocator.py", 'CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")',
             'CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")'),),
           ("tests/test_device_memory.py", "-k", "both_allocator_variables")),
    Mutant("allocator-first-expandable-wins", "expandable_segments:True,...,expandable_segments:False read as on",
           (("ddptrain/runtime/allocator.py", '            on = value.strip() == "True"',
             '            on = on or value.strip() == "True"'),),
           ("tests/test_device_memory.py", "-k", "last_expandable_segments")),
    Mutant("auto-reads-nccl-init-as-in-use", "auto reads the memory in use after NCCL's communicator exists and "
                                             "counts it again in the NCCL allowance",
           (("ddptrain/plan/memory/present.py", "        in_use = min(in_use, before)", "        in_use = in_use"),),
           ("tests/test_device_memory.py", "-k", "context_and_nccls_init")),
    Mutant("auto-counts-its-context-twice", "the context allowance keeps the context the memory in use holds",
           (("ddptrain/plan/memory/planner.py",
             "    counted = min(CUDA_CONTEXT, device.in_use_gib * GiB) if device.context_in_use else 0.0",
             "    counted = 0.0"),),
           ("tests/test_device_memory.py", "-k", "context_and_nccls_init")),
    Mutant("plan-device-ignored-beside-a-gpu", "plan.device=h100 on a machine with an RTX 4090 plans the 4090",
           (("ddptrain/plan/memory/present.py", "    if name is None and torch.cuda.is_available():",
             "    if torch.cuda.is_available():"),),
           ("tests/test_device_memory.py", "-k", "plan_device_plans_its_preset")),
    Mutant("present-bf16-from-hopper", "an A100 / L4 / RTX 4090 (compute capability 8.x) planned without bf16",
           (("ddptrain/plan/memory/present.py", "    bf16 = properties.major >= 8",
             "    bf16 = properties.major >= 9"),),
           ("tests/test_device_memory.py", "-k", "capability_8")),
    Mutant("nvls-only-when-unset", "NCCL_NVLS_ENABLE=1 plans no NVLS buffers",
           (("ddptrain/plan/memory/overheads.py", 'environ.get("NCCL_NVLS_ENABLE", "").strip() != "0"',
             'environ.get("NCCL_NVLS_ENABLE", "").strip() == ""'),),
           ("tests/test_device_memory.py", "-k", "nvls_enable_1")),
    Mutant("cuda-autocast-twin-bf16-only", "the CUDA autocast twin leaves fp16 alone (a T4 fp16 plan's activations)",
           (("ddptrain/plan/memory/cuda_autocast.py", "LOWER = (torch.bfloat16, torch.float16)",
             "LOWER = (torch.bfloat16,)"),),
           ("tests/test_cuda_autocast.py",)),
    Mutant("chunk-cuda-head-gets-cpu-chunk", "a head on CUDA gets the CPU's chunk (110 tokens, not 1,024)",
           (("ddptrain/models/chunked_loss.py", "device_type or head.weight.device.type", 'device_type or "cpu"'),),
           ("tests/test_chunked_loss.py", "-k", "follows_the_device_the_head_is_on")),
    Mutant("chunk-frozen-head-as-trainable", "a frozen head on CUDA gets 1,024 tokens per chunk, not 256",
           (("ddptrain/models/chunked_loss.py", "head.weight.device.type,\n" + " " * 45 + "head.weight.requires_grad)",
             "head.weight.device.type,\n" + " " * 45 + "True)"),),
           ("tests/test_chunked_loss.py", "-k", "follows_the_device_the_head_is_on")),
    Mutant("mask-rows-not-padded-to-8", "the ready mask's rows not padded to 8: CUDA's kernel copies it every call",
           (("ddptrain/models/attention.py", "    width = -(-keys // 8) * 8", "    width = keys"),),
           ("tests/test_flash_attention.py", "-k", "strided_by_a_multiple_of_8")),
    Mutant("auto-raises-to-an-unfitted-whole-batch", "auto takes the whole per-rank batch when one less fits "
                                                     "accumulating, without checking the whole batch fits",
           (("ddptrain/plan/memory/auto_batch.py", "        if largest == below and fits(per_rank):",
             "        if largest == below:"),),
           ("tests/test_auto_batch.py", "-k", "one_less_accumulating")),
    Mutant("streamed-count-defaults-to-0", "a streamed checkpoint without tokens_seen resumes the count at 0 (the "
                                           "trainer's steps x tokens fallback never runs)",
           (("ddptrain/data/streaming.py", '        self.tokens_seen = state.get("tokens_seen")',
             '        self.tokens_seen = state.get("tokens_seen", 0)'),),
           ("tests/test_data_prepare.py", "-k", "without_a_token_count")),
    # issue 52's rows in train/ and telemetry/, issue 50's loss names and stop: each pinned by a fast test
    Mutant("drift-repairs-from-the-first-group", "under HSDP every drifted group is repaired from the first drifted "
                                                 "group's source, outside its own",
           (("ddptrain/train/drift.py", "self._repair(findings[differing.index(self.groups.slot)])",
             "self._repair(findings[0])"),),
           ("tests/test_drift.py", "-k", "two_drifted_groups")),
    Mutant("drift-checks-by-log-period", "train.check_every ignored: replicas compared at logging and save steps only",
           (("ddptrain/train/trainer.py",
             "check = log_step or self.checkpoints.due(step, last) or step % cfg.train.check_every == 0",
             "check = log_step or self.checkpoints.due(step, last)"),),
           ("tests/test_drift.py", "-k", "check_every_step")),
    Mutant("drift-save-unchecked", "a save step off the logging and check periods saves without comparing replicas",
           (("ddptrain/train/trainer.py",
             "check = log_step or self.checkpoints.due(step, last) or step % cfg.train.check_every == 0",
             "check = log_step or step % cfg.train.check_every == 0"),),
           ("tests/test_drift.py", "-k", "save_off")),
    Mutant("window-excludes-last-save-only", "several saves in one logging window: only the last left out",
           (("ddptrain/telemetry/metrics.py", "self._excluded += self._clock() - start",
             "self._excluded = self._clock() - start"),),
           ("tests/test_telemetry.py", "-k", "checkpoint_saves or injected_clock")),
    Mutant("window-save-time-carries", "a window's excluded save time is taken off the later windows too",
           (("ddptrain/telemetry/metrics.py", "self._start, self._steps, self._excluded = self._clock(), 0, 0.0",
             "self._start, self._steps = self._clock(), 0"),),
           ("tests/test_telemetry.py", "-k", "checkpoint_saves or injected_clock")),
    Mutant("summary-first-val-loss", "summary.json's final_val_loss is the first evaluation's",
           (("ddptrain/train/trainer.py", "for m in reversed(history) if \"val_loss\" in m)",
             "for m in history if \"val_loss\" in m)"),),
           ("tests/test_run_summary.py", "-k", "same_order")),
    Mutant("first-step-loss-is-logged-window", "summary.json's step-1 loss is the first logged window's (step 10's)",
           (("ddptrain/train/trainer.py",
             "first_step_loss=global_mean(first_loss) if first_loss is not None else None,",
             "first_step_loss=history[0][\"loss\"] if history else None,"),),
           ("tests/test_run_summary.py", "-k", "same_order")),
    Mutant("stop-step-not-logged", "a stop at a step that is no logging step writes no metrics line for it",
           (("ddptrain/train/trainer.py", "if log_step or done.stop:", "if log_step:"),),
           ("tests/test_hot_path.py", "-k", "stop_logs")),
    Mutant("stop-notice-next-step", "the stop notice names the next step, not the next check step",
           (("ddptrain/step/control.py", "latest = (self.step // self.check_every + 1) * self.check_every",
             "latest = self.step + 1"),),
           ("tests/test_hot_path.py", "-k", "stop_logs")),
    Mutant("scaling-efficiency-per-rank-missing", "scaling efficiency against one rank's tokens/s, not N ranks'",
           (("ddptrain/telemetry/metrics.py", "tokens_per_s / (dp * self.baseline)", "tokens_per_s / self.baseline"),),
           ("tests/test_telemetry.py", "-k", "present_and_sane")),
    Mutant("host-fit-slope-takes-lateness", "the host fit's skew slope is read from the long wait alone: a rank's "
                                            "constant lateness leaks into the part that grows with compute",
           (("scripts/cpu_host_fit.py", "skew = max(0.0, (wait_long - wait_short) / (long - short)) if long > short",
             "skew = max(0.0, wait_long / long) if long > short"),),
           ("tests/test_predict.py", "-k", "late_to_every_sync")),
    # audit of issues 51/52's diagnose change: the verdict's mutants that survived the fast tier, and the rule the
    # audit fixed (a peer stuck in an earlier collective of another group is behind)
    Mutant("verdict-peer-at-the-collective-behind", "a peer that enqueued just the waiter's collective counts as "
                                                    "behind it (< read as <=)",
           (("ddptrain/diagnose/verdict.py",
             "if m != r and (progress(traces.get(m), group) < seq or _stuck_before(",
             "if m != r and (progress(traces.get(m), group) <= seq or _stuck_before("),),
           ("tests/test_verdict.py", "-k", "stuck_as_a_whole")),
    Mutant("verdict-peer-in-the-collective-behind", "a peer stuck in the waiter's own collective counts as behind "
                                                    "it: a group stuck as a whole gets no verdict",
           (("ddptrain/diagnose/verdict.py", "        return first < mine\n", "        return first <= mine\n"),),
           ("tests/test_verdict.py", "-k", "stuck_as_a_whole")),
    Mutant("verdict-mismatch-every-rank-of-the-name", "a mismatch compares the collective with every rank's of that "
                                                      "group name, not the waiter's group's ranks",
           (("ddptrain/diagnose/verdict.py", "same = {m: c for m in groups.members(group, r) if",
             "same = {m: c for m in traces if"),),
           ("tests/test_verdict.py", "-k", "replica_group_names")),
    Mutant("verdict-finished-dump-is-a-waiter", "a rank with an NCCL dump and no record is a waiter even when all "
                                                "its collectives finished",
           (("ddptrain/diagnose/verdict.py", "        if r not in records and unfinished(dump[\"collectives\"]):",
             "        if r not in records and dump[\"collectives\"]:"),),
           ("tests/test_verdict.py", "-k", "every_collective_finished")),
    Mutant("verdict-peer-stuck-by-number", "a peer's first unfinished collective of another group compared with the "
                                           "waiter's by collective number, not by enqueue order",
           (("ddptrain/diagnose/verdict.py", "        return first < mine\n",
             "        return collectives[first][\"seq\"] < seq\n"),),
           ("tests/test_verdict.py", "-k", "another_groups_earlier")),
    Mutant("verdict-peer-stuck-in-its-group-only", "a peer is behind only when stuck earlier in the waiter's group: "
                                                   "HSDP's failed replica link gets no verdict",
           (("ddptrain/diagnose/verdict.py", "    if mine is not None:\n        return first < mine\n",
             "    if False:\n        return first < mine\n"),),
           ("tests/test_verdict.py", "-k", "another_groups_earlier")),
    Mutant("verdict-peer-stuck-ring-fallback-off", "a peer whose ring lost the waiter's collective is never behind "
                                                   "by being stuck before it",
           (("ddptrain/diagnose/verdict.py",
             '    return there is not None and there.get("completed") is False and there["seq"] < seq',
             "    return False"),),
           ("tests/test_verdict.py", "-k", "no_longer_holds")),
    # an audit of the issue 51/52 cluster change: its survivors, the run-dir bug found, the ported webhook rules
    Mutant("k8s-name-longer-than-jobset-allows", "--name takes 63 characters: the JobSet's pod names pass 63 and its "
                                                 "webhook refuses the job at apply",
           (("ddptrain/app/k8s.py", "MAX_NAME = 40", "MAX_NAME = 63"),),
           ("tests/test_k8s.py", "-k", "cli_accepts")),
    Mutant("k8s-run-dir-not-normalized", "hydra.run.dir=/mnt/ddptrain/../scratch/run passes as on the volume",
           (("ddptrain/app/k8s.py", "        path = posixpath.normpath(value)\n", "        path = value\n"),),
           ("tests/test_k8s.py", "-k", "refused_in_one_line")),
    Mutant("k8s-storage-class-unchecked", "--storage-class Fast_SSD printed into the claim (the API server refuses it)",
           (("ddptrain/app/k8s.py", "(args.claim_size is None or not SUBDOMAIN.match(args.storage_class))",
             "args.claim_size is None"),),
           ("tests/test_k8s.py", "-k", "refused_in_one_line")),
    Mutant("k8s-run-dir-first-override", "a key's first override is checked, Hydra applies its last: "
                                         "hydra.run.dir=/mnt/ddptrain/a hydra.run.dir=/tmp/b passes",
           (("ddptrain/app/k8s.py", "            last[key] = value", "            last.setdefault(key, value)"),),
           ("tests/test_k8s.py", "-k", "refused_in_one_line or last_hydra")),
    Mutant("k8s-trainjob-patch-unknown-container", "the TrainJob's patch names a container the runtime lacks (Trainer "
                                                   "admits it; the JobSet gets a container without an image)",
           (("ddptrain/app/k8s_manifest.py", 'node: Doc = {"name": CONTAINER["trainjob"],',
             'node: Doc = {"name": "trainer",'),),
           ("tests/test_k8s.py", "-k", "only_the_runtimes")),
    Mutant("ray-forward-any-py", "Ray workers get every PY* variable of the driver (PYTHONSTARTUP, PYTHONUSERBASE...)",
           (("ddptrain/app/ray_launch.py", '"TORCH_", "PYTORCH_", "NCCL_", "PYTHONPATH",',
             '"TORCH_", "PY", "NCCL_",'),),
           ("tests/test_ray.py", "-k", "allocator_settings")),
    Mutant("ray-signal-stop-exits-0", "a Ray run stopped by SIGTERM (143) makes the driver exit 0",
           (("ddptrain/app/ray_launch.py", "        return int(metrics[EXIT_CODE])",
             "        return int(metrics[EXIT_CODE]) if int(metrics[EXIT_CODE]) < 128 else 0"),),
           ("tests/test_ray.py", "-k", "ended_on_purpose")),
    Mutant("webhook-domain-path-one-slash", "the ported IsDomainPrefixedPath refuses acme.io/foo/bar (Go splits at "
                                            "the first slash only)",
           (("tests/helpers/webhooks.py", '    host, slash, rest = value.partition("/")\n',
             '    parts = value.split("/")\n'
             '    host, slash, rest = (parts[0], "/", parts[1]) if len(parts) == 2 else ("", "", "")\n'),),
           ("tests/test_k8s.py", "-k", "domain_prefixed")),
    Mutant("webhook-http-path-unanchored", "the ported HTTP path rule matches a prefix: acme.io/foo bar admitted",
           (("tests/helpers/webhooks.py", "if not re.fullmatch(HTTP_PATH, rest):",
             "if not re.match(HTTP_PATH, rest):"),),
           ("tests/test_k8s.py", "-k", "domain_prefixed")),
    Mutant("webhook-subdomain-unanchored", "the ported RFC 1123 subdomain rule matches a prefix: ddptrain.Dev admitted",
           (("tests/helpers/webhooks.py", "if not re.fullmatch(DNS1123_SUBDOMAIN, value):",
             "if not re.match(DNS1123_SUBDOMAIN, value):"),),
           ("tests/test_k8s.py", "-k", "domain_prefixed")),
    Mutant("webhook-patch-names-unmerged", "the ported Trainer rule checks a patch's names against the runtime before "
                                           "the patches are merged (Go checks the merged template)",
           (("tests/helpers/webhooks.py", "    jobs = merged_names(RUNTIMES[key], patches)",
             "    jobs = RUNTIMES[key]"),),
           ("tests/test_k8s.py", "-k", "refuse_what_each")),
    Mutant("webhook-reserved-env-any-pet", "the ported Torch rule refuses every PET_* in trainer.env (Go: five names)",
           (("tests/helpers/webhooks.py",
             'reserved = sorted({e["name"] for e in (spec.get("trainer") or {}).get("env", [])} & '
             'set(TORCHRUN_RESERVED_ENV))',
             'reserved = sorted({e["name"] for e in (spec.get("trainer") or {}).get("env", []) '
             'if e["name"].startswith("PET_")})'),),
           ("tests/test_k8s.py", "-k", "five_variables")),
    # issue 50: what the launcher decides before any worker starts, the workers' exit code, Ctrl-C, hang/
    Mutant("run-dir-writability-unchecked", "the launcher leaves an unwritable hydra.run.dir to the workers",
           (("ddptrain/app/before_start.py", "    check_writable(run_dir)\n    if cfg", "    if cfg"),),
           ("tests/test_before_start.py", "-k", "unwritable")),
    Mutant("owned-run-dir-unchecked", "the launcher starts a fresh run in a run dir holding another run's checkpoints",
           (("ddptrain/checkpoint/before_start.py", "        if found and not cfg.checkpoint.overwrite:",
             "        if found and cfg.checkpoint.overwrite:"),),
           ("tests/test_before_start.py", "-k", "another_runs_checkpoints")),
    Mutant("damaged-resume-unchecked", "the launcher takes train.resume's checkpoint without checking its files",
           (("ddptrain/checkpoint/before_start.py", "    chosen, _, problem = newest_intact(candidates)",
             "    chosen, problem = (str(candidates[-1]) if candidates else None), None"),),
           ("tests/test_before_start.py", "-k", "damaged")),
    Mutant("resume-shapes-unchecked", "the launcher trusts a checkpoint whose model.* differs where only shapes tell",
           (("ddptrain/checkpoint/before_start.py", "        same = same_fingerprint(cfg.model, path)",
             "        same = True"),),
           ("tests/test_before_start.py", "-k", "another_model")),
    Mutant("first-line-after-the-workers", "the launcher starts the workers without its first line",
           (("ddptrain/app/launch.py", "    say(f\"{time.strftime('%H:%M:%S')} run dir",
             "    (f\"{time.strftime('%H:%M:%S')} run dir"),),
           ("tests/test_before_start.py", "-k", "reaches_the_workers")),
    Mutant("workers-code-dropped", "the command exits 1 with the agent's line after a worker's own refusal or abort",
           (("ddptrain/app/launch.py", "        if failure.exitcode in SAID_BY_WORKER:", "        if False:"),),
           ("tests/test_before_start.py", "-k", "exit_code")),
    Mutant("every-rank-waits-to-say", "rank 0 too waits out the grace before its line (every rank's line, late)",
           (("ddptrain/app/cli.py", ' > 1 and int(os.environ.get("RANK", "0")) != 0:\n        if grace_s <= 0:',
             ' > 1:\n        if grace_s <= 0:'),),
           ("tests/test_before_start.py", "-k", "grace")),
    Mutant("waiting-rank-deaf-to-ctrl-c", "ranks waiting for rank 0's data wait natively, deaf to Ctrl-C",
           (("ddptrain/runtime/process_group.py", "    while not store.check([key]):",
             "    store.wait([key], timedelta(seconds=timeout_s))\n    while not store.check([key]):"),),
           ("tests/test_interrupt.py", "-k", "within_a_second")),
    Mutant("healthy-run-keeps-hang", "a rank that ends well leaves its empty hang/ evidence in the run dir",
           (("ddptrain/app/launch.py", "        evidence.discard()  # a healthy run",
             "        pass  # a healthy run"),),
           ("tests/test_cli.py", "-k", "share_one_run_dir")),
    # issue 50, a console only for us and numbers that count ddptrain's own work
    Mutant("goodput-from-process-start", "goodput's start is the process's start: a shell that exec'd ddptrain "
                                         "(sh -c 'pip install ... && exec ddptrain') counts as start-up",
           (("ddptrain/telemetry/goodput.py", "    return repr(entry_start())", "    return repr(process_start())"),
            ("ddptrain/telemetry/goodput.py", "        return process_start()\n    return entry_start()",
             "        return process_start()\n    return process_start()")),
           ("tests/test_goodput.py", "-k", "exec_d")),
    Mutant("startup-line-warmup-bytes", "the start-up line gives PowerSGD's plain warm-up payload as the bytes per "
                                        "step (7.61 MB) while the logged comm_bytes say 0.30 MB",
           (("ddptrain/train/first_step.py", "sample.compressed_bytes if sample else None",
             "sample.payload_bytes if sample else None"),),
           ("tests/test_compression.py", "-k", "first_steps_line")),
    Mutant("qlora-cpu-inference-layout", "4-bit layers take bitsandbytes' CPU inference layout at the first "
                                         "evaluation; later training forwards drop the base's gradient (gemv_4bit)",
           (("ddptrain/models/lora.py", "            layer.support_avx512bf16_for_cpu = False",
             "            pass"),),
           ("tests/test_finetune.py", "-k", "dequantized_base")),
    Mutant("ckpt-tool-dcp-warning", "ddptrain-ckpt verify/export print DCP's 'torch.distributed is disabled' warning",
           (("ddptrain/checkpoint/offline.py",
             '        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or '
             'uninitialized",\n                                category=UserWarning)\n', ""),),
           ("tests/test_checkpoint_safety.py", "-k", "own_lines")),
    Mutant("ckpt-export-progress-bars", "ddptrain-ckpt export prints transformers' progress bars",
           (("ddptrain/checkpoint/offline.py", "    hf_logging.disable_progress_bar()  # \"Writing",
             "    hf_logging.enable_progress_bar()  # \"Writing"),),
           ("tests/test_checkpoint_safety.py", "-k", "own_lines")),
    Mutant("gpt2-loss-unnamed", "a GPT-2 model's first loss warns `loss_type=None` (the dry run's first line)",
           (("ddptrain/models/build.py", '        model.loss_type = "ForCausalLM"', "        pass"),),
           ("tests/test_console_noise.py", "-k", "loss_type")),
    Mutant("optuna-colours-in-logs", "Optuna's lines carry ANSI colour escapes in a log that is not a terminal",
           (("ddptrain/app/sweep.py", '        os.environ.setdefault("NO_COLOR", "1")', "        pass"),),
           ("tests/test_sweep.py", "-k", "colour_escapes")),
    Mutant("stop-notice-every-rank", "every rank prints the SIGINT/SIGTERM notice (rank 1 in its own format)",
           (("ddptrain/step/control.py", "        announce = not dist.is_initialized() or dist.get_rank() == 0",
             "        announce = True"),),
           ("tests/test_console_noise.py", "-k", "stop_signal")),
    Mutant("wandb-offline-unnamed", "an offline W&B run ends without naming its directory or `wandb sync`",
           (("ddptrain/telemetry/sinks.py", "        if offline:  # nothing was uploaded",
             "        if False:  # nothing was uploaded"),),
           ("tests/test_console_noise.py", "-k", "wandb")),
    Mutant("unknown-key-no-suggestion", "an unknown key gets no 'did you mean' (train.max_steps: train.steps)",
           (("ddptrain/errors.py", "        close = difflib.get_close_matches(name, known, n=1)",
             "        close: list[str] = []"),),
           ("tests/test_bad_inputs.py", "-k", "closest or max_steps")),
    Mutant("bare-list-no-hint", "data.paths=/x gets no hint to write the list in brackets",
           (("ddptrain/errors.py", '    if "is not a ListConfig, list or tuple" in message:',
             '    if "is not a ListConfig, list or tuple!" in message:'),),
           ("tests/test_bad_inputs.py", "-k", "Invalid and assigned")),
    Mutant("ray-preemption-watcher-local", "a local Ray instance runs Ray Train's preemption watcher (its E line)",
           (("ddptrain/app/ray_launch.py", "    if address:\n        return env\n",
             "    if True:\n        return env\n"),),
           ("tests/test_ray.py", "-k", "preemption_watcher")),
    Mutant("readme-optuna-no-extra", "README's Optuna command does not say which extra installs the sweeper",
           (("README.md", "# Hydra's plugins (pip install 'ddptrain[optuna]')", "# Hydra's plugins"),),
           ("tests/test_sweep.py", "-k", "names_the_extra")),
    Mutant("scaling-writes-into-cwd", "scripts/scaling.py writes scaling.* into the current directory by default",
           (("scripts/scaling.py", "    out = (args.out or runs_dir).absolute()", "    out = args.out or Path('.')"),),
           ("tests/test_scaling_outputs.py",)),
    Mutant("ckpt-info-diffs-defaults", "ddptrain-ckpt info diffs the checkpoint against the defaults, not its run's "
                                       "config.yaml",
           (("ddptrain/checkpoint/offline.py",
             "    return build_config(base, OmegaConf.from_dotlist(dotted))",
             "    return build_config(OmegaConf.from_dotlist(dotted))"),),
           ("tests/test_checkpoint_format.py", "-k", "info_diffs")),
    Mutant("sweep-png-labels-collide", "sweep.png's job labels sit side by side and run into each other",
           (("ddptrain/app/sweep_report.py", '        axes.set_xticks(xs, labels, rotation=90, fontsize="small")',
             "        axes.set_xticks(xs, labels)"),),
           ("tests/test_sweep.py", "-k", "sweep_png")),
    Mutant("sweep-png-legend-on-bars", "sweep.png's breakdown legend sits inside its panel, over the bars",
           (("ddptrain/app/sweep_report.py",
             '    parts.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)',
             '    parts.legend(fontsize="small", loc="upper left")'),),
           ("tests/test_sweep.py", "-k", "sweep_png")),
    Mutant("oversubscribed-workers-unnoted", "launch.nproc_per_node=8 on 2 cores starts without a note",
           (("ddptrain/runtime/topology.py", "    if workers <= cores:\n        return None\n",
             "    if True:\n        return None\n"),),
           ("tests/test_console_noise.py", "-k", "more_local_workers")),
    Mutant("threads-ignore-load", "a worker takes a thread per core however busy the machine is (0.15x at load 12)",
           (("ddptrain/runtime/topology.py", "    idle = max(1.0, cores - busy)", "    idle = float(cores)"),),
           ("tests/test_console_noise.py", "-k", "leaves_idle")),
    Mutant("budget-judges-wall-time", "a fast-tier test also fails over the budget in wall seconds (load-dependent)",
           (("tests/helpers/timing.py",
             '        if budget and tier(item) == "fast" and report.passed and cpu > budget:',
             '        if budget and tier(item) == "fast" and report.passed and (cpu > budget or wall > budget):'),),
           ("tests/test_suite_tools.py", "-k", "budget")),
    # issue 49, one plan, one answer: the dry run's figures are full traces of the settings they name
    Mutant("plan-row-stops-at-its-start", "an option's search keeps its starting micro batch where a larger one fits",
           (("ddptrain/plan/memory/planner.py", "        while i + 1 < len(ds) and fits(ds[i + 1]):",
             "        while False:"),),
           ("tests/test_plan_consistency.py", "-k", "default_target or any_guess")),
    Mutant("plan-options-against-full-memory", "the options table and recommendation chosen against the whole "
                                               "memory, auto against it less its margin",
           (("ddptrain/plan/memory/planner.py", "    limit = usable_bytes(device)\n",
             "    limit = device.free_gib * GiB\n"),),
           ("tests/test_plan_consistency.py", "-k", "default_target")),
    Mutant("plan-by-checkpointing-from-the-fit", "the by-checkpointing line from the fit of small traces",
           (("ddptrain/plan/memory/planner.py",
             "    by_mode = {c: configured if c == mode else planned(batch.micro_batch_size, c, stage, accumulating)",
             "    by_mode = {c: configured if c == mode else planned(batch.micro_batch_size, c, stage, accumulating, "
             "True)"),),
           ("tests/test_plan_consistency.py", "-k", "default_target")),
    Mutant("plan-recommendation-says-not-why", "the recommendation names a smaller micro batch than another option "
                                               "that fits without saying why",
           (("ddptrain/plan/memory/render.py", '              + ("" if note is None else f"; {note}") + ".")',
             '              + ".")'),),
           ("tests/test_plan_consistency.py", "-k", "default_target")),
    Mutant("plan-fit-ignores-moment-switch", "the fit of small traces mixes corners that peak at different moments",
           (("ddptrain/plan/memory/planner.py",
             "        if not moments_switch(fit.traced, micro_batches[-2:], fit.depths)",
             "        if True or not moments_switch(fit.traced, micro_batches[-2:], fit.depths)"),),
           ("tests/test_plan_consistency.py", "-k", "follows_the_moment")),
    # audit of issue 52's train/telemetry rows and issue 50's loss names and stop: survivors of the fast tier, each
    # now killed by the test named
    Mutant("stop-notice-at-the-step-in-progress", "the stop notice rounds the step in progress up to a check step: "
                                                  "'step 0' before a fresh run, step 6 when step 6's check has passed",
           (("ddptrain/step/control.py", "latest = (self.step // self.check_every + 1) * self.check_every",
             "latest = -(-self.step // self.check_every) * self.check_every"),),
           ("tests/test_hot_path.py", "-k", "stop_notice")),
    Mutant("stop-notice-past-the-last-step", "the stop notice names a check step after the run's last step",
           (("ddptrain/step/control.py", "            latest = min(latest, max(self.last_step, self.step))\n",
             "            pass\n"),),
           ("tests/test_hot_path.py", "-k", "stop_notice")),
    Mutant("stop-notice-counts-from-the-step-before", "the loop sets the notice's step after the step has run: a "
                                                      "signal within a check step counts from the step before",
           (("ddptrain/train/trainer.py",
             "                self.stop.step = step  # what a stop request's notice counts from\n"
             "                done = self.train_step(step, check)\n",
             "                done = self.train_step(step, check)\n"
             "                self.stop.step = step  # what a stop request's notice counts from\n"),),
           ("tests/test_run_summary.py", "-k", "same_order")),
    Mutant("first-step-loss-of-a-resumed-run", "a resumed run's summary has its first step's loss as step 1's",
           (("ddptrain/train/trainer.py", "                if step == 1:\n",
             "                if first_loss is None:\n"),),
           ("tests/test_tokens_seen.py", "-k", "resumed_runs_summary")),
    Mutant("first-logged-step-from-log-every", "the summary's first logged step is train.log_every's, a resumed "
                                               "run's too",
           (("ddptrain/train/trainer.py", 'first_logged_step=history[0]["step"] if history else None,',
             "first_logged_step=min(cfg.train.log_every, cfg.train.steps) if history else None,"),),
           ("tests/test_tokens_seen.py", "-k", "resumed_runs_summary")),
    Mutant("first-step-loss-this-ranks", "the summary's step-1 loss is each rank's own, not the ranks' mean",
           (("ddptrain/train/trainer.py",
             "first_step_loss=global_mean(first_loss) if first_loss is not None else None,",
             "first_step_loss=float(first_loss) if first_loss is not None else None,"),),
           ("tests/test_tokens_seen.py", "-k", "resumed_runs_summary")),
    Mutant("stop-save-kept-in-its-window", "the stop's checkpoint save is timed into its step's line",
           (("ddptrain/train/trainer.py",
             "saving = self.metrics.excluded() if self.checkpoints.due(step, last) or done.stop else",
             "saving = self.metrics.excluded() if self.checkpoints.due(step, last) else"),),
           ("tests/test_telemetry.py", "-k", "stop_logs")),
    Mutant("stop-step-logged-twice", "a stop at a logging step writes its window twice (the second of no steps)",
           (("ddptrain/train/trainer.py",
             "                if log_step or done.stop:  # a stop's step is logged too: metrics.jsonl ends where the"
             " run stopped\n"
             "                    history.append(self.log_window(step, done, skipped))\n"
             "                if done.stop:\n",
             "                if log_step:\n"
             "                    history.append(self.log_window(step, done, skipped))\n"
             "                if done.stop:\n"
             "                    history.append(self.log_window(step, done, skipped))\n"),),
           ("tests/test_telemetry.py", "-k", "stop_logs")),
    Mutant("window-clock-without-device-sync", "the windows' default clock is the host's, not the device's "
                                               "(CUDA: queued steps unfinished)",
           (("ddptrain/telemetry/metrics.py",
             "self.clock = clock if clock is not None else (lambda: device_clock(device))",
             "self.clock = clock if clock is not None else time.perf_counter"),
            ("ddptrain/telemetry/metrics.py", "import statistics\n", "import statistics\nimport time\n")),
           ("tests/test_telemetry.py", "-k", "default_clock")),
    Mutant("window-save-time-reset-only-when-logged", "a window restarted without logging (compilation, the memory "
                                                      "tracker's step) keeps an earlier save's excluded time",
           (("ddptrain/telemetry/metrics.py", "self._start, self._steps, self._excluded = self._clock(), 0, 0.0",
             "self._start, self._steps = self._clock(), 0"),
            ("ddptrain/telemetry/metrics.py", "        self.samples.clear()\n        return metrics\n",
             "        self.samples.clear()\n        self._excluded = 0.0\n        return metrics\n")),
           ("tests/test_telemetry.py", "-k", "every_one_of_its_checkpoint_saves")),
    Mutant("host-fit-intercept-from-the-long-wait", "the host fit's intercept read at the long unit: wrong when the "
                                                    "slope is clamped at 0",
           (("scripts/cpu_host_fit.py", "return skew, max(0.0, wait_short - skew * short) * 1e6",
             "return skew, max(0.0, wait_long - skew * long) * 1e6"),),
           ("tests/test_predict.py", "-k", "skew_is_the_line")),
    Mutant("host-fit-negative-skew", "the host fit's skew slope may be negative",
           (("scripts/cpu_host_fit.py",
             "skew = max(0.0, (wait_long - wait_short) / (long - short)) if long > short else 0.0",
             "skew = (wait_long - wait_short) / (long - short) if long > short else 0.0"),),
           ("tests/test_predict.py", "-k", "skew_is_the_line")),
    # the audit of issues 51 (items 5, 6) and 52's GPU rows: mutants the area's tests let through before
    Mutant("launch-allocator-line-at-debug", "a CUDA worker logs the allocator's start-up line at DEBUG (not seen)",
           (("ddptrain/app/launch.py", 'log.info("%s", alloc)', 'log.debug("%s", alloc)'),),
           ("tests/test_gpu_path.py", "-k", "allocator_line_at_start_up")),
    Mutant("allocator-lowercase-true-on", "expandable_segments:true read as on (torch refuses all but True/False)",
           (("ddptrain/runtime/allocator.py", '            on = value.strip() == "True"',
             '            on = value.strip().lower() == "true"'),),
           ("tests/test_device_memory.py", "-k", "last_expandable_segments")),
    Mutant("reading-forgotten-only-on-clean-exit", "a run that fails inside its group keeps the memory reading for "
                                                   "the next group in the process",
           (("ddptrain/runtime/process_group.py",
             "        clean = True\n    finally:\n        memory_before_groups.forget()\n",
             "        clean = True\n        memory_before_groups.forget()\n    finally:\n"),),
           ("tests/test_device_memory.py", "-k", "forgotten_after_a_failure")),
    Mutant("present-reads-device-0s-reading", "local rank 1 plans from cuda:0's reading before the groups",
           (("ddptrain/plan/memory/present.py", "in_use_before_groups(index)", "in_use_before_groups(0)"),),
           ("tests/test_device_memory.py", "-k", "forgotten_after_a_failure")),
    Mutant("mask-width-one-past", "an aligned key count's mask rows get a spare block of 8 (16 keys: stride 24)",
           (("ddptrain/models/attention.py", "    width = -(-keys // 8) * 8", "    width = (keys // 8 + 1) * 8"),),
           ("tests/test_flash_attention.py", "-k", "padded_to_the_next_multiple_of_8")),
    # the audit of issue 50's change: survivors of hand-written mutants, each with the test that now kills it
    Mutant("run-dir-permission-unchecked", "the launcher checks only that the run dir's nearest parent is a directory, "
                                           "not that it may write there",
           (("ddptrain/app/before_start.py", "    elif not os.access(existing, os.W_OK | os.X_OK):",
             "    elif False:"),),
           ("tests/test_before_start.py", "-k", "may_not_write")),
    Mutant("explicit-resume-vs-run-dirs-checkpoint", "train.resume=<path> is compared with the run dir's newest "
                                                     "checkpoint, not the one it names",
           (("ddptrain/checkpoint/before_start.py", "    path = Path(chosen)\n",
             "    path = found[-1] if found else Path(chosen)\n"),),
           ("tests/test_before_start.py", "-k", "explicit_resume_is")),
    Mutant("resume-vocab-not-compared", "model.vocab_size is left out of the keys that decide 'the same model'",
           (("ddptrain/checkpoint/before_start.py", '"max_position_embeddings", "vocab_size", "tie_embeddings")',
             '"max_position_embeddings", "tie_embeddings")'),),
           ("tests/test_before_start.py", "-k", "vocabulary")),
    Mutant("worker-exit-2-becomes-1", "a worker's refusal (exit 2) makes the command exit 1 with the agent's line",
           (("ddptrain/app/launch.py", "SAID_BY_WORKER = frozenset({2, 3, 4})", "SAID_BY_WORKER = frozenset({3, 4})"),),
           ("tests/test_before_start.py", "-k", "refusal_or_abort")),
    Mutant("ctrl-c-second-launcher-line", "on Ctrl-C before any checkpoint the launcher adds its own line to rank 0's",
           (("ddptrain/app/launch.py", "        elif exc.sigval != signal.SIGINT:", "        else:"),),
           ("tests/test_before_start.py", "-k", "stop_before")),
    Mutant("hang-evidence-discarded-when-recorded", "a rank that recorded a hang removes its stacks on the way out",
           (("ddptrain/diagnose/evidence.py", "        recorded is kept.\"\"\"\n        if self._recorded:\n"
             "            return\n", "        recorded is kept.\"\"\"\n"),),
           ("tests/test_before_start.py", "-k", "discarded")),
    Mutant("config-yaml-before-resume-check", "rank 0 writes config.yaml before the trainer's resume check refuses",
           (("ddptrain/app/launch.py",
             "        try:\n            trainer = Trainer(typed, env, device, run_dir, resolved, shape)\n",
             "        if env.is_main:\n"
             "            (run_dir / \"config.yaml\").write_text(OmegaConf.to_yaml(resolved))\n"
             "        try:\n            trainer = Trainer(typed, env, device, run_dir, resolved, shape)\n"),),
           ("tests/test_before_start.py", "-k", "worker_refusing")),
    Mutant("data-phase-misnamed", "a Ctrl-C while preparing the data is said to interrupt the model's building",
           (("ddptrain/train/trainer.py", 'with starting("preparing the data", f"cache',
             'with starting("building the model", f"cache'),),
           ("tests/test_before_start.py", "-k", "prepares_the_data")),
    Mutant("await-main-deadline-minutes", "the polled wait for rank 0 reads data.prepare_timeout_s as minutes",
           (("ddptrain/runtime/process_group.py", "    deadline = time.monotonic() + timeout_s\n",
             "    deadline = time.monotonic() + timeout_s * 60\n"),),
           ("tests/test_interrupt.py", "-k", "gives_up")),
    Mutant("tokenizer-worker-takes-ctrl-c", "a tokenizer pool worker keeps Ctrl-C (its own traceback per worker)",
           (("ddptrain/data/encode.py", "        signal.signal(signal.SIGINT, signal.SIG_IGN)\n", ""),),
           ("tests/test_interrupt.py", "-k", "pool_worker")),
    # issue 50 audit: launch_workers' wiring and errors.py's hints, which the rules' own tests did not reach
    Mutant("launch-note-unwired", "the launcher computes the oversubscription note and never prints it",
           (("ddptrain/app/launch.py",
             "    if (note := oversubscription_note(local)) is not None:\n        say(note)\n",
             "    if (note := oversubscription_note(local)) is not None:\n        pass\n"),),
           ("tests/test_before_start.py", "-k", "idle_cores")),
    Mutant("launch-threads-ignore-load", "the launcher sets OMP_NUM_THREADS without the load average (busy cores)",
           (("ddptrain/app/launch.py", "threads_per_worker(local, busy=os.getloadavg()[0])",
             "threads_per_worker(local)"),),
           ("tests/test_before_start.py", "-k", "idle_cores")),
    Mutant("did-you-mean-loose", "a did-you-mean cutoff of 0.4 guesses unrelated keys (precision: train?)",
           (("ddptrain/errors.py", "difflib.get_close_matches(name, known, n=1)",
             "difflib.get_close_matches(name, known, n=1, cutoff=0.4)"),),
           ("tests/test_bad_inputs.py", "-k", "loosely")),
    Mutant("bracket-hint-any-type-error", "any value of a wrong type gets the list-in-brackets hint (train.steps=abc)",
           (("ddptrain/errors.py", '    if "is not a ListConfig, list or tuple" in message:',
             '    if getattr(cause, "value", None) is not None:'),),
           ("tests/test_bad_inputs.py", "-k", "loosely")),
    Mutant("goodput-entry-read-late", "the launcher's goodput start is when it is read (after composing and checking "
                                      "the config), not ddptrain's first line",
           (("ddptrain/telemetry/goodput.py", "    return ddptrain.ENTERED_AT\n", "    return time.time()\n"),),
           ("tests/test_goodput.py", "-k", "when_ddptrains_code_began")),
    Mutant("goodput-start-in-worker", "a worker's first attempt ignores DDPTRAIN_LAUNCH_START: the launcher's "
                                      "start-up is not counted",
           (("ddptrain/telemetry/goodput.py",
             'if env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and env.get(LAUNCH_START_ENV):',
             "if False and env.get(LAUNCH_START_ENV):"),),
           ("tests/test_goodput.py", "-k", "first_attempt_starts")),
    # the merge's integration fix: a forked child's goodput starts at the fork
    Mutant("forked-child-keeps-parents-entry", "a forked child (a fork server's rank) keeps its parent's import time "
                                               "as ddptrain's start: goodput's start-up is the parent's whole life",
           (("ddptrain/__init__.py", "_os.register_at_fork(after_in_child=_forked)", "_forked"),),
           ("tests/test_goodput.py", "-k", "forked_child")),
    Mutant("plan-moments-switch-direction", "moments_switch sees a switch where a category grows, not shrinks",
           (("ddptrain/plan/memory/planner.py", "        return any(b[c] < a[c] for c in a)",
             "        return any(b[c] > a[c] for c in a)"),),
           ("tests/test_plan_consistency.py", "-k", "shrinks_between")),
    Mutant("plan-accumulation-not-subtracted", "an option's accumulation bytes always 0 (alone traced accumulating)",
           (("ddptrain/plan/memory/planner.py",
             "    alone = sum(planned(w.micro_batch, w.checkpointing, w.stage, False).values()) if accumulating"
             " else peak",
             "    alone = sum(planned(w.micro_batch, w.checkpointing, w.stage, accumulating).values())"),),
           ("tests/test_plan_consistency.py", "-k", "accumulating_adds")),
    Mutant("plan-note-slower-inverted", "the note calls the larger option slower when it is faster",
           (("ddptrain/plan/memory/planner.py", 'why = "slower" if other.step_s > best.step_s else',
             'why = "slower" if other.step_s < best.step_s else'),),
           ("tests/test_plan_consistency.py", "-k", "note_names")),
    Mutant("plan-speedup-ratio-inverted", "an option's speedup is its step over one device's (below 1)",
           (("ddptrain/plan/memory/planner.py",
             "allowances(categories, w.stage).total, step, single / step if step and single else None,",
             "allowances(categories, w.stage).total, step, step / single if step and single else None,"),),
           ("tests/test_plan_consistency.py", "-k", "accumulating_adds")),
    # issue 52 (suite time): the test trace cache's key leaves out parallel.* and the device's name and memory
    Mutant("trace-reads-the-zero-stage", "a traced step takes the low-precision working copy by the configured ZeRO "
           "stage, not by its caller (a trace would then depend on parallel.*, which the tests' shared key drops)",
           (("ddptrain/plan/memory/planner.py",
             "dtype if working_copy else None, representative_chunks=True)",
             "dtype if working_copy or cfg.parallel.zero_stage >= 2 else None, representative_chunks=True)"),),
           ("tests/test_memory_trace.py", "-k", "shared_traces_key")),
    Mutant("hsdp-shard-group-default-timeout", "HSDP's shard groups built without dist.timeout_s (torch's default, "
           "30 minutes on gloo)",
           (("ddptrain/parallel/zero.py",
             'layout.tolist(), timeout=timeout, group_desc="mesh_shard"',
             'layout.tolist(), group_desc="mesh_shard"'),),
           ("tests/test_hsdp.py", "-k", "time_out_at_dist")),
]

def _copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored) into ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _pytest(tree: Path, tests: tuple[str, ...], timeout: int) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    python = tree.parent / "venv" / "bin" / "python"  # the venv the copy is installed in (main)
    try:
        done = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return done.returncode, (failed[0] if failed else done.stdout.strip().splitlines()[-1] if done.stdout else "")


def _apply(tree: Path, mutant: Mutant) -> dict[Path, str] | None:
    """Apply every edit; the original texts to restore, or None (nothing applied) when an edit is stale."""
    originals: dict[Path, str] = {}
    for rel, old, new in mutant.edits:
        path = tree / rel
        text = originals.get(path, path.read_text())
        current = path.read_text()
        if current.count(old) != 1:
            for p, t in originals.items():
                p.write_text(t)
            return None
        originals.setdefault(path, text)
        path.write_text(current.replace(old, new))
    return originals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", action="append", default=[],
                        help="only the mutants whose name contains this (repeat it for several)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each mutant's tests")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  edits: {', '.join(sorted({e[0] for e in m.edits}))}\n"
                  f"  tests: {' '.join(m.tests)}")
        return 0
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="ddptrain-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(tree)
        venv_with(tree, Path(tmp) / "venv", editable=True)
        for m in chosen:
            start = time.perf_counter()
            if not args.no_baseline:
                code, line = _pytest(tree, m.tests, args.timeout)
                if code != 0:
                    rows.append((m, "baseline fails", line, time.perf_counter() - start))
                    bad += 1
                    print(f"{m.name}: baseline fails: {line}", flush=True)
                    continue
            originals = _apply(tree, m)
            if originals is None:
                rows.append((m, "stale", "old text not found exactly once", 0.0))
                bad += 1
                print(f"{m.name}: stale", flush=True)
                continue
            try:
                code, line = _pytest(tree, m.tests, args.timeout)
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            verdict = {0: "survived", 5: "no tests ran", -1: "timed out"}.get(code, "killed")
            bad += verdict != "killed"
            rows.append((m, verdict, line if verdict == "killed" else "", time.perf_counter() - start))
            print(f"{m.name}: {verdict} {line}", flush=True)
    print("\n| mutant | what it breaks | tests run | verdict | first failure |\n|---|---|---|---|---|")
    for m, verdict, line, _ in rows:
        print(f"| `{m.name}` | {m.what} | `{' '.join(m.tests)}` | {verdict} | {line.replace('|', '/')} |")
    print(f"\n{len(rows)} mutants, {sum(r[1] == 'killed' for r in rows)} killed, "
          f"{sum(r[1] == 'survived' for r in rows)} survived, {bad} not killed in all; "
          f"{sum(r[3] for r in rows):.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
