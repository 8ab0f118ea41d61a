"""The memory a run plans for is its GPU's own: ``data.micro_batch_size=auto`` and the dry run read the device's
total memory less what is already in use (not a preset matched by name), NCCL is counted by the communicators the
run's process groups make, and fragmentation by the allocator's settings. ``torch.cuda`` is faked to answer as
each named GPU would (tests/helpers/fake_cuda.py); the step is traced on fake tensors as a run traces it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from ddptrain.app import cli
from ddptrain.app.launch import agreed_micro_batch
from ddptrain.app.preflight import validate_config
from ddptrain.config.choices import Precision
from ddptrain.config.compose import Run, build_config
from ddptrain.config.schema import Config, DistConfig
from ddptrain.plan import dry_run
from ddptrain.plan.dry_run import plan_for_target
from ddptrain.plan.memory import auto_batch
from ddptrain.plan.memory.auto_batch import AUTO_MARGIN, StepNeed, choose_micro_batch, planned_run
from ddptrain.plan.memory.overheads import (
    NCCL_FIRST_COMMUNICATOR,
    NCCL_FURTHER_COMMUNICATOR,
    NVLS_PER_GROUP,
    RunOverheads,
)
from ddptrain.plan.memory.planner import (
    DEVICES,
    Allowances,
    Device,
    GiB,
    Tracer,
    compute_dtype,
    context_allowance,
    target_device,
)
from ddptrain.plan.memory.present import device_for_plan, present_device, this_device, with_memory
from ddptrain.runtime import process_group
from ddptrain.runtime.allocator import (
    CONF_VARS,
    EXPANDABLE,
    expandable_segments,
    startup_line,
    use_expandable_segments,
)
from ddptrain.runtime.process_group import DistEnv, device_precision
from tests.helpers.fake_cuda import A100, GH200, H100, H100_MIG_1G, L4, RTX_4090, T4, FakeGPU, fake_cuda
from tests.helpers.tiny import TINY_MODEL

VOCAB = 256
ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)


def tiny_auto(global_batch: int = 12, **sections: dict) -> Config:
    return build_config({"model": {**TINY_MODEL, "vocab_size": VOCAB},
                         "data": {"seq_len": 32, "vocab_size": VOCAB, "global_batch_size": global_batch,
                                  "micro_batch_size": "auto"},
                         "train": {"loss_chunk_tokens": 16}}, sections)


@pytest.fixture(scope="module")
def traced() -> dict:
    return {}


@pytest.fixture
def tracer_of(traced: dict, monkeypatch: pytest.MonkeyPatch) -> Callable[[Config, int, Device], Tracer]:
    """One ``Tracer`` of the tiny config per device type and precision, for every test here: a trace depends on
    the config and on the device's type and compute dtype, never on its memory (the searches and the dry run
    would otherwise trace the same steps again for each GPU)."""

    def tracer(cfg: Config, vocab: int, device: Device) -> Tracer:
        assert OmegaConf.structured(cfg).model == OmegaConf.structured(tiny_auto()).model and vocab == VOCAB
        key = (device.device_type, device.bf16, cfg.data.seq_len, cfg.data.format)
        if key not in traced:
            traced[key] = Tracer(cfg, vocab, device)
        return traced[key]

    monkeypatch.setattr(auto_batch, "Tracer", tracer)
    monkeypatch.setattr(dry_run, "Tracer", tracer)
    return tracer


def at_start_up(cfg: Config) -> int:
    """The micro batch rank 0 of a one-rank run resolves auto to at start-up, on the (faked) cuda:0."""
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    typed, _ = agreed_micro_batch(Run(None, cfg, resolved), ONE_RANK, torch.device("cuda", 0))  # type: ignore[arg-type]
    return typed.data.micro_batch_size


@pytest.mark.parametrize("gpu", [H100_MIG_1G.using(1.0), GH200.using(2.0), H100.using(2.0), RTX_4090.using(2.0)],
                         ids=lambda gpu: gpu.name)
def test_auto_plans_the_gpus_own_memory_less_what_is_in_use(gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch,
                                                          tracer_of: Callable) -> None:
    """A MIG slice reports the whole card's name and a GH200's name contains "H200": each is planned with its own
    total_memory, less what mem_get_info says is in use, never a preset's."""
    fake_cuda(monkeypatch, gpu)
    cfg = tiny_auto()
    assert validate_config(cfg, 1) is None  # no plan.device_memory_gib needed where a GPU is present
    chosen = choose_micro_batch(cfg, 1, this_device(torch.device("cuda", 0)), VOCAB)
    assert chosen.device.name == gpu.name
    assert chosen.usable == pytest.approx((gpu.total_memory - gpu.used) * (1 - AUTO_MARGIN))
    assert f"{gpu.used / GiB:.2f} in use" in chosen.line()


def test_auto_fits_the_memory_another_process_left_on_the_gpu(monkeypatch: pytest.MonkeyPatch,
                                                               tracer_of: Callable) -> None:
    """Through the run's own start-up: with the GPU free every sequence fits at once; with another process holding
    all but room for 5 of the 12 sequences per rank, auto takes 4 (the largest that fits and divides 12)."""
    cuda = fake_cuda(monkeypatch, H100)
    cfg = tiny_auto(global_batch=12)
    assert at_start_up(cfg) == 12
    device = this_device(torch.device("cuda", 0))
    need = StepNeed(tracer_of(cfg, VOCAB, device), planned_run(cfg, 1, device), 12,
                    RunOverheads.of(cfg, 1, os.environ))
    five, six = (need(m, cfg.model.activation_checkpointing, 0) for m in (5, 6))
    left = (five + six) / 2 / (1 - AUTO_MARGIN)  # 5 fits, 6 does not
    cuda.use(0, (H100.total_memory - left) / GiB)
    assert at_start_up(cfg) == 4
    chosen = choose_micro_batch(cfg, 1, this_device(torch.device("cuda", 0)), VOCAB)
    assert (chosen.largest, chosen.grad_accum) == (5, 3) and chosen.usable == pytest.approx(left * (1 - AUTO_MARGIN))


def test_plan_device_memory_gib_replaces_the_gpus_free_memory(monkeypatch: pytest.MonkeyPatch,
                                                               tracer_of: Callable) -> None:
    fake_cuda(monkeypatch, H100.using(30.0))
    cfg = tiny_auto()
    cfg.plan.device_memory_gib = 20.0
    _, _, record = plan_for_target(cfg, 1)
    assert record["device_memory_bytes"] == 20.0 * GiB
    assert record["micro_batch_auto"]["usable_bytes_per_rank"] == pytest.approx(20.0 * GiB * (1 - AUTO_MARGIN))


def test_the_dry_run_on_a_gpu_machine_plans_that_gpu_as_it_is(monkeypatch: pytest.MonkeyPatch,
                                                               tracer_of: Callable) -> None:
    """Without plan.device the dry run plans the GPU it runs on: a MIG slice's 9.75 GiB less 1 in use (it used to
    plan the H100 preset's 79.1)."""
    gpu = H100_MIG_1G.using(1.0)
    fake_cuda(monkeypatch, gpu)
    _, text, record = plan_for_target(tiny_auto(), 1)
    assert record["device"] == gpu.name and record["device_memory_bytes"] == pytest.approx(gpu.total_memory)
    usable = (gpu.total_memory - gpu.used) * (1 - AUTO_MARGIN)
    assert record["micro_batch_auto"]["usable_bytes_per_rank"] == pytest.approx(usable)
    assert "9.75 GiB (1.00 in use)" in text


def test_a_present_gpu_is_read_from_its_properties_and_its_kind_gives_only_the_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, H100_MIG_1G, GH200, T4)
    mig, gh200, t4 = (present_device(i) for i in range(3))
    assert mig.memory_gib == pytest.approx(9.75) and mig.bf16 and not mig.nvls
    assert mig.peak_tflops == pytest.approx(DEVICES["h100"].peak_tflops / 7)  # one of seven compute slices
    assert gh200.memory_gib == pytest.approx(95.0) and gh200.nvls and gh200.peak_tflops == DEVICES["h200"].peak_tflops
    assert not t4.bf16 and not t4.nvls and t4.memory_gib == pytest.approx(T4.total_memory / GiB)


def _nccl(cfg: Config, world_size: int, ranks_per_node: int, device: str = "h100", environ: dict | None = None,
          stage: int | None = None) -> dict[str, float]:
    overheads = RunOverheads.of(cfg, ranks_per_node, environ or {})
    allowances = Allowances.for_run(target_device(device, None, None), {"activations": 1.0 * GiB, "gradients": 0.0},
                                    cfg.parallel.zero_stage if stage is None else stage, world_size, 0.0, True,
                                    overheads)
    return {k: v for k, v in allowances.items.items() if k.startswith(("NCCL", "NVLink SHARP"))}


def test_nccl_is_counted_per_communicator_the_runs_groups_make() -> None:
    """One communicator for DDP, ZeRO-1 and ZeRO-2/3 over every rank (the default group), three under HSDP (the
    default group, the shard and the replicate group), none alone; NVLS buffers for each group of more than two
    GPUs of a node on an NVSwitch-class GPU; the asynchronous checkpoint's gloo group costs no GPU memory."""
    ddp, zero3 = tiny_auto(), tiny_auto(parallel={"zero_stage": 3})
    hsdp = tiny_auto(parallel={"zero_stage": 3, "shard_group": "node"})
    one, three = NCCL_FIRST_COMMUNICATOR, NCCL_FIRST_COMMUNICATOR + 2 * NCCL_FURTHER_COMMUNICATOR
    assert three == pytest.approx(6.0e9)  # NVIDIA/nccl#864: ~6 GB with three communicators
    assert _nccl(ddp, 1, 1) == {}
    assert list(_nccl(ddp, 2, 2).values()) == [one]  # two GPUs: no NVLS
    assert list(_nccl(zero3, 2, 2).values()) == [one]
    assert list(_nccl(ddp, 2, 2, device="rtx4090").values()) == [one]
    assert sorted(_nccl(ddp, 8, 8).values()) == [NVLS_PER_GROUP, one]
    assert sorted(_nccl(ddp, 8, 8, device="a100").values()) == [one]  # no NVLS before Hopper
    assert sorted(_nccl(hsdp, 16, 8).values()) == [2 * NVLS_PER_GROUP, three]
    assert sorted(_nccl(hsdp, 16, 8, stage=0).values()) == [NVLS_PER_GROUP, one]  # the planner weighing DDP
    assert sorted(_nccl(hsdp, 16, 8, environ={"NCCL_NVLS_ENABLE": "0"}).values()) == [three]
    async_save = tiny_auto(checkpoint={"async_save": True})
    assert _nccl(async_save, 8, 8) == _nccl(ddp, 8, 8)
    assert _nccl(ddp, 8, 8, device="cpu") == {}


def test_fragmentation_is_counted_by_whether_shapes_vary_and_expandable_segments_are_on() -> None:
    packed, examples = tiny_auto(), tiny_auto(data={"format": "prompt_completion"})

    def share(cfg: Config, environ: dict) -> float:
        return RunOverheads.of(cfg, 1, environ).fragmentation()[0]

    assert share(packed, {}) == share(examples, {}) == 0.10  # expandable segments, as ddptrain sets them
    assert share(examples, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == 0.10
    assert share(examples, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == 0.20
    # torch 2.13 reads expandable_segments from PYTORCH_ALLOC_CONF when set: the CUDA variable's are not read
    assert share(examples, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                            "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"}) == 0.20
    assert share(packed, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == 0.10  # one shape throughout
    allowances = Allowances.for_run(target_device("h100", None, None), {"activations": 10.0 * GiB}, 0, 1, 0.0,
                                    False, RunOverheads.of(examples, 1, {"PYTORCH_CUDA_ALLOC_CONF": "x:1"}))
    [(label, value)] = [(k, v) for k, v in allowances.items.items() if k.startswith("allocator fragmentation")]
    assert value == 2.0 * GiB and "expandable segments are off" in label


def test_the_command_turns_on_expandable_segments_unless_the_user_set_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ddptrain``'s entry sets PYTORCH_ALLOC_CONF before anything starts CUDA (torchrun's workers inherit it); a
    user's own setting in either variable stands."""
    for var in CONF_VARS:
        monkeypatch.setenv(var, "restored at teardown")
        monkeypatch.delenv(var)
    seen: dict[str, str] = {}
    monkeypatch.setattr(cli.atexit, "register", lambda *_: None)  # main's exit handler would end pytest
    monkeypatch.setattr(cli, "run_cli", lambda argv: seen.update(os.environ) or 0)
    with pytest.raises(SystemExit):
        cli.main()
    assert seen.get("PYTORCH_ALLOC_CONF") == EXPANDABLE
    own = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert not use_expandable_segments(own) and own == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


BOTH_SET = [({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
             True),
            ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
             False)]


@pytest.mark.parametrize(("environ", "on"), BOTH_SET, ids=["alloc-on-cuda-off", "alloc-off-cuda-on"])
def test_with_both_allocator_variables_set_the_plan_follows_pytorch_alloc_conf(environ: dict, on: bool) -> None:
    """torch 2.13: ``expandable_segments`` is a device-generic key, read from PYTORCH_ALLOC_CONF when it is set;
    PYTORCH_CUDA_ALLOC_CONF only "with lower priority" (c10/core/AllocatorConfig.h), i.e. when the other is
    unset. The fragmentation allowance and the start-up line follow the variable torch reads."""
    examples = tiny_auto(data={"format": "prompt_completion"})
    overheads = RunOverheads.of(examples, 1, environ)
    assert overheads.expandable_segments is on
    assert overheads.fragmentation()[0] == (0.10 if on else 0.20)
    allowances = Allowances.for_run(target_device("h100", None, None), {"activations": 10.0 * GiB}, 0, 1, 0.0,
                                    False, overheads)
    [fragmentation] = [v for k, v in allowances.items.items() if k.startswith("allocator fragmentation")]
    assert fragmentation == (1.0 if on else 2.0) * GiB
    line = startup_line(environ)
    assert line is not None and line.startswith(
        f"CUDA caching allocator: PYTORCH_ALLOC_CONF={environ['PYTORCH_ALLOC_CONF']} "
        f"(expandable segments {'on' if on else 'off'})")
    assert f"PYTORCH_CUDA_ALLOC_CONF={environ['PYTORCH_CUDA_ALLOC_CONF']} is read for CUDA-only keys" in line
    # the CUDA variable alone is read, and named alone
    cuda_only = {"PYTORCH_CUDA_ALLOC_CONF": environ["PYTORCH_CUDA_ALLOC_CONF"]}
    assert expandable_segments(cuda_only) is not on
    assert startup_line(cuda_only) == (f"CUDA caching allocator: PYTORCH_CUDA_ALLOC_CONF="
                                       f"{cuda_only['PYTORCH_CUDA_ALLOC_CONF']} (expandable segments "
                                       f"{'off' if on else 'on'})")
    assert startup_line({}) is None


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_last_expandable_segments_option_of_a_variable_wins(var: str) -> None:
    """As torch's parser sets the key at each occurrence: both orders of True and False in one variable."""
    examples = tiny_auto(data={"format": "prompt_completion"})
    on_then_off = {var: "expandable_segments:True,max_split_size_mb:128,expandable_segments:False"}
    off_then_on = {var: "expandable_segments:False, max_split_size_mb:128, expandable_segments:True"}
    assert not expandable_segments(on_then_off) and expandable_segments(off_then_on)
    # torch takes only True and False (ConfigTokenizer::toBool: "Expected 'True' or 'False'"): not on
    assert not expandable_segments({var: "expandable_segments:true"})
    assert RunOverheads.of(examples, 1, on_then_off).fragmentation()[0] == 0.20
    assert RunOverheads.of(examples, 1, off_then_on).fragmentation()[0] == 0.10


def test_auto_counts_this_processs_cuda_context_and_nccls_init_memory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto plans inside the process group, after this process's CUDA context and NCCL's eager init exist. The
    memory in use is read before the group is made (NCCL's init is its allowance's), and the context allowance
    leaves out the context the reading holds: another process's 2 GiB + this context's 0.5 GiB + 0.25 GiB of
    workspaces are counted, not NCCL's 1 GiB of init again nor a second context."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "restored at teardown")
    cuda = fake_cuda(monkeypatch, H100.using(2.0), context_gib=0.5)

    def init_group(cfg: DistConfig, env: DistEnv, device: torch.device, cpu_collectives: bool = False) -> None:
        cuda.use(device.index, cuda.gpus[device.index].used / GiB + 1.0)  # NCCL's communicator, made eagerly

    monkeypatch.setattr(process_group, "init_process_group", init_group)
    with process_group.distributed(DistConfig()) as (_, device):
        assert device == torch.device("cuda", 0) and cuda.gpus[0].used == round(3.0 * GiB)  # NCCL's 1 GiB is in
        gpu = this_device(device)
        assert gpu.in_use_gib == pytest.approx(2.5)  # the other process and this context, read before the group
        [(label, context)] = context_allowance(gpu).items()
        assert context == pytest.approx(0.25 * GiB) and "less 0.50 of this process's context" in label
        assert gpu.in_use_gib * GiB + context == pytest.approx((2.0 + 0.5 + 0.25) * GiB)
        allowances = Allowances.for_run(gpu, {"activations": 1.0 * GiB}, 0, 1, 0.0, False,
                                        RunOverheads.of(tiny_auto(), 1, {}))
        assert label in allowances.items
    assert this_device(device).in_use_gib == pytest.approx(3.5)  # the group gone, the reading is forgotten
    # where the memory is not read here the whole allowance stands: a preset, or plan.device_memory_gib
    assert list(context_allowance(DEVICES["h100"]).values()) == [0.75 * GiB]
    assert list(context_allowance(with_memory(gpu, 20.0)).values()) == [0.75 * GiB]
    # a reading below the assumed context: only what was read is in there
    assert list(context_allowance(replace(gpu, in_use_gib=0.2)).values()) == [pytest.approx(0.55 * GiB)]


def test_the_reading_before_the_groups_is_this_ranks_device_and_is_forgotten_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Local rank 1 of 2 reads and plans cuda:1 (2 GiB in use beside cuda:0's 5 GiB), from its reading before
    NCCL's init (+1 GiB); a run that fails inside the group forgets the reading as a clean one does."""
    for var, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "restored at teardown")
    cuda = fake_cuda(monkeypatch, H100.using(5.0), H100.using(2.0))

    def init_group(cfg: DistConfig, env: DistEnv, device: torch.device, cpu_collectives: bool = False) -> None:
        cuda.use(device.index, cuda.gpus[device.index].used / GiB + 1.0)  # NCCL's communicator, made eagerly

    class Failed(Exception):
        pass

    monkeypatch.setattr(process_group, "init_process_group", init_group)
    with pytest.raises(Failed), process_group.distributed(DistConfig()) as (_, device):
        assert device == torch.device("cuda", 1)
        assert this_device(device).in_use_gib == pytest.approx(2.0)  # cuda:1's reading, not cuda:0's nor NCCL's
        raise Failed
    assert this_device(device).in_use_gib == pytest.approx(3.0)  # the group gone: read as it is now


@pytest.mark.parametrize("gpu", [A100, L4, RTX_4090], ids=lambda gpu: gpu.name)
def test_a_present_gpu_of_compute_capability_8_is_planned_in_bf16(gpu: FakeGPU,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ampere and Ada (8.0, 8.6, 8.9) compute bf16 natively: auto resolves to bf16 there, as the run does."""
    fake_cuda(monkeypatch, gpu, T4)
    present = present_device(0)
    assert present.bf16 and compute_dtype("auto", present) == torch.bfloat16
    assert device_precision("auto", torch.device("cuda", 0)) == Precision.bf16  # the run's own rule agrees
    assert compute_dtype("auto", present_device(1)) == torch.float16  # a T4 (7.5): fp16


def test_plan_device_plans_its_preset_beside_a_present_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan.device=h100`` on a machine with an RTX 4090: the dry run's target is the H100 preset (its 79.1 GiB,
    all free, NVLS), not the 4090 here; its memory and peak overrides apply to the preset."""
    fake_cuda(monkeypatch, RTX_4090.using(2.0))
    assert device_for_plan("h100", None, None) == DEVICES["h100"]
    assert device_for_plan("h100", 40.0, 500.0) == replace(DEVICES["h100"], memory_gib=40.0, peak_tflops=500.0)
    here = device_for_plan(None, None, None)  # without plan.device: the GPU here, as it is
    assert here.name == RTX_4090.name and here.in_use_gib == pytest.approx(2.0) and not here.nvls


def test_nccl_nvls_enable_1_plans_the_nvls_buffers_as_unset() -> None:
    """NCCL_NVLS_ENABLE=1 turns NVLS on as unset does; only 0 turns it off."""
    ddp, hsdp = tiny_auto(), tiny_auto(parallel={"zero_stage": 3, "shard_group": "node"})
    for cfg, world, groups in ((ddp, 8, 1), (hsdp, 16, 2)):
        unset = _nccl(cfg, world, 8)
        assert [v for k, v in unset.items() if k.startswith("NVLink SHARP")] == [groups * NVLS_PER_GROUP]
        assert _nccl(cfg, world, 8, environ={"NCCL_NVLS_ENABLE": "1"}) == unset
        off = _nccl(cfg, world, 8, environ={"NCCL_NVLS_ENABLE": "0"})
        assert not [k for k in off if k.startswith("NVLink SHARP")] and len(off) == 1


def test_the_memory_in_use_before_the_groups_is_read_on_the_ranks_device_or_the_current_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``note`` on a CUDA device with an index reads that device; without one, the current device; on the CPU
    nothing. CUDA's calls faked: device i has 100 + i bytes, 100 - 10 i free."""
    from ddptrain.runtime import memory_before_groups as before

    def mem_get_info(index: int) -> tuple[int, int]:
        assert isinstance(index, int), index
        return 100 - 10 * index, 100 + index

    monkeypatch.setattr(before, "_in_use", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    before.note(torch.device("cpu"))
    before.note(torch.device("cuda", 1))
    assert [before.in_use_before_groups(i) for i in range(3)] == [None, 11, None]
    before.note(torch.device("cuda"))
    assert [before.in_use_before_groups(i) for i in range(3)] == [None, 11, 22]
    before.forget()
    assert before.in_use_before_groups(1) is None
