"""Devices: what a run resolves ``auto``, ``cpu`` and ``cuda`` to, its process-group backend, the
device each rank uses, and the refusals (one line each) before any process starts.

Pure functions with CUDA's presence stubbed, so the CPU suite checks the logic a GPU run takes;
what needs a real GPU is in the CUDA-only tests (skipped without one).
"""

from __future__ import annotations

import pytest
import torch

import posttrain.device as device
from posttrain.dp import EngineConfig
from posttrain.launch import run_ranks


@pytest.fixture
def fake_cuda(monkeypatch):
    """This machine as if torch saw ``n`` CUDA devices."""

    def make(n: int) -> None:
        monkeypatch.setattr(device, "_cuda_available", lambda: n > 0)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: n)

    return make


def test_auto_takes_cuda_only_where_torch_sees_it_and_the_run_supports_it(fake_cuda):
    fake_cuda(0)
    assert device.resolve("auto") == "cpu" and device.resolve("cpu") == "cpu"
    fake_cuda(2)
    assert device.resolve("auto") == "cuda" and device.resolve("cuda") == "cuda"
    assert device.resolve("auto", ("cpu",)) == "cpu"  # a trainer or engine that runs on the CPU only


@pytest.mark.parametrize("name, supported, message", [
    ("tpu", ("cpu", "cuda"), "device='tpu' is not one of auto, cpu, cuda"),
    ("cuda", ("cpu",), "device='cuda': this run runs on cpu only so far"),
    ("cuda", ("cpu", "cuda"), "device='cuda' but torch"),
])
def test_a_device_the_run_cannot_use_is_one_line(fake_cuda, name, supported, message):
    fake_cuda(0)
    with pytest.raises(ValueError) as e:
        device.resolve(name, supported)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_backend_keeps_gloo_for_cpu_tensors_and_nccl_for_cuda_tensors(fake_cuda):
    assert device.backend("cpu") == "gloo"
    assert device.backend("cuda") == "cpu:gloo,cuda:nccl"
    assert device.backend("cuda", shared=True) == "gloo"  # ranks sharing a GPU: NCCL would refuse them
    fake_cuda(2)
    assert not device.shares_devices("cuda", 2) and device.shares_devices("cuda", 3)
    assert not device.shares_devices("cpu", 64)


def test_each_rank_takes_its_local_device_and_nccl_gets_one_rank_per_gpu(fake_cuda, monkeypatch):
    fake_cuda(2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [device.rank_device("cuda", r) for r in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun: the rank on this host, not the global one
    assert device.rank_device("cuda", 7) == torch.device("cuda", 1)
    assert device.rank_device("cpu", 7) == torch.device("cpu")
    device.check_world("cuda", 2)
    device.check_world("cpu", 64)
    with pytest.raises(ValueError, match=r"world_size=3 ranks on this host but it has 2 cuda device.*use flat ODC"):
        device.check_world("cuda", 3)
    device.check_world("cuda", 3, shared_ok=True)  # an engine whose ranks may share a GPU
    device.check_world("cuda", 16, local_world_size=2)  # torchrun: 2 on this host, the rest elsewhere


def test_a_run_shares_gpus_only_with_an_engine_that_needs_no_nccl(fake_cuda):
    """Flat ODC moves data through its device transport and all-reduces the rest (gloo carries
    that on CUDA), so its ranks may share a GPU; FSDP2's all-gathers need NCCL, one rank a GPU."""
    from posttrain.train.core import check_run
    from posttrain.train.sft import TrainConfig

    fake_cuda(1)
    assert TrainConfig(engine=EngineConfig("odc")).device_sharing
    assert not TrainConfig(engine=EngineConfig("odc-fsdp2")).device_sharing
    assert not TrainConfig(engine=EngineConfig("fsdp")).device_sharing
    check_run(TrainConfig(engine=EngineConfig("odc"), device="cuda"), world_size=2)
    for dp in ("fsdp", "odc-fsdp2"):
        with pytest.raises(ValueError, match="world_size=2 ranks on this host but it has 1 cuda device"):
            check_run(TrainConfig(engine=EngineConfig(dp), device="cuda"), world_size=2)


def test_adding_into_a_tensor_runs_where_it_lives():
    """``add_into`` (a deterministic ODC push into an owner's slot): on one device a plain add,
    with the dtype converted."""
    dst = torch.zeros(5)
    device.add_into(dst, torch.arange(5, dtype=torch.bfloat16))
    assert torch.equal(dst, torch.arange(5.0))
    assert device.visible_index("cpu") is None


def test_accelerator_ranks_are_spawned_and_get_the_launchers_device(monkeypatch):
    """A forked child cannot use CUDA once its parent touched it: accelerator ranks are spawned,
    and so are CPU ranks of a process that initialized CUDA (torch refuses autograd in a child
    forked after CUDA autograd ran). A rank's ``auto`` (started by code other than the launcher)
    follows its process group."""
    assert device.start_method("gloo") == "fork"
    assert device.start_method(device.backend("cuda")) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert device.start_method("gloo") == "spawn"
    monkeypatch.undo()
    assert device.rank_kind("cuda") == "cuda" and device.rank_kind("cpu") == "cpu"


def test_cpu_ranks_are_spawned_where_a_forked_child_could_not_run_autograd(monkeypatch):
    """On a machine with a GPU, a process that ran a backward has autograd's device threads, and a
    child forked after that cannot run autograd (seen on the GPU machine): the launcher asks a
    forked child to run a backward and spawns where it cannot, and remembers that."""
    monkeypatch.setattr(device, "_AUTOGRAD_FORK_BROKEN", False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # as if a GPU were there
    assert device.start_method("gloo") == "fork"  # a child's backward runs here
    real = torch.Tensor.backward

    def refused(self, *args, **kwargs):
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    monkeypatch.setattr(torch.Tensor, "backward", refused)  # what the child sees where torch refuses
    assert device.start_method("gloo") == "spawn"
    monkeypatch.setattr(torch.Tensor, "backward", real)
    assert device.start_method("gloo") == "spawn"  # remembered: the threads never stop
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert device.start_method("gloo") == "spawn"
    assert device.rank_kind("auto") == "cpu"  # no process group here, or a gloo one: the CPU


def test_cpu_has_no_memory_count_and_nothing_to_wait_for():
    cpu = torch.device("cpu")
    device.use(cpu)
    device.synchronize(cpu)
    device.reset_peak_memory(cpu)
    assert device.max_memory_allocated(cpu) is None


def test_a_run_resolves_over_what_its_trainer_and_engine_run_on(fake_cuda):
    from posttrain.train.rl import RLConfig
    from posttrain.train.sft import TrainConfig
    from posttrain.train.sft.pipeline import PipelineConfig

    fake_cuda(1)
    for dp in ("fsdp", "odc", "odc-fsdp2"):  # auto: every engine of every trainer runs on CUDA
        assert TrainConfig(engine=EngineConfig(dp)).device_kind == "cuda"
    assert RLConfig().device_kind == "cuda" and PipelineConfig().device_kind == "cuda"
    # ranks sharing a GPU: a pipeline alone (messages through host memory) or with flat ODC columns
    columns = {"dp_size": 2, "data": "chat.jsonl", "model_path": "model"}
    assert PipelineConfig().device_sharing and PipelineConfig(**columns).device_sharing
    assert PipelineConfig(engine=EngineConfig("fsdp")).device_sharing
    assert not PipelineConfig(**columns, engine=EngineConfig("fsdp"), balance="same_micro").device_sharing
    with pytest.raises(ValueError, match="device='gpu' is not one of auto, cpu, cuda"):
        TrainConfig(device="gpu")


def test_doctor_without_cuda_says_so_in_one_line_and_lists_its_checks(cli, monkeypatch):
    from posttrain.lab.doctor import CHECKS, find_tests

    monkeypatch.setattr(device, "_cuda_available", lambda: False)
    rc, out, err = cli("doctor")
    lines = out.strip().splitlines()
    assert rc == 0 and not err
    assert lines[0].startswith("posttrain doctor: no CUDA device here") and lines[1:] == [f"  - {c}" for c in CHECKS]
    assert find_tests() and find_tests().endswith("tests")  # this checkout's, which it would run
    rc, _, err = cli("doctor", "--copy-mib", "0")
    assert rc == 2 and "--copy-mib=0 must be at least 1" in err


@pytest.mark.cuda
def test_doctor_measures_copies_on_the_gpu():
    from posttrain.lab.doctor import copy_bandwidths

    got = copy_bandwidths(16, 3)
    assert set(got) == {"device-to-device", "host-to-device (pinned)", "device-to-host (pinned)"}
    assert min(got.values()) > 0


def test_a_cuda_run_starts_one_process_per_gpu_by_default(fake_cuda, monkeypatch):
    from posttrain.train.core import launch_world

    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    fake_cuda(4)
    assert launch_world(None, "cuda") == (4, True) and launch_world(None, "cpu") == (2, True)
    assert launch_world(3, "cuda") == (3, True)


def test_tf32_is_a_cuda_setting_refused_on_the_cpu_and_nothing_there():
    from posttrain.train.core import check_run
    from posttrain.train.sft import TrainConfig

    with pytest.raises(ValueError, match=r"`tf32` is a CUDA setting .* this run is on the CPU: leave it out"):
        check_run(TrainConfig(device="cpu", tf32=True))
    before = torch.backends.cuda.matmul.fp32_precision
    device.allow_tf32(torch.device("cpu"), True)  # nothing to set on the CPU
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_cudnn_attention_is_a_cuda_setting_refused_on_the_cpu_and_nothing_there():
    from posttrain.train.core import check_run
    from posttrain.train.rl import RLConfig
    from posttrain.train.sft import TrainConfig

    for cfg in (TrainConfig(device="cpu", cudnn_attention=True), RLConfig(device="cpu", cudnn_attention=True)):
        with pytest.raises(ValueError, match=r"`cudnn_attention` is a CUDA setting .* this run is on the CPU: leave it out"):
            check_run(cfg)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    device.allow_cudnn_attention(torch.device("cpu"), not before)  # nothing to set on the CPU
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.cuda
def test_packed_attention_on_cuda_keeps_off_cudnn_unless_allowed():
    """A packed bf16 microbatch of sequences of several lengths (several attention calls of new
    shapes, grouped-query): with cuDNN's attention not allowed (the trainers' default) no call
    runs it, and flash attention does; the flag is cleared and set again as asked."""
    from posttrain.models.split_attention import packed_attention

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    lengths = [700, 130, 129, 64, 3000, 31]
    q = torch.randn(1, 8, sum(lengths), 64, generator=g).to(dev, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, sum(lengths), 64, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(2))
    try:
        for allowed in (False, True):
            device.allow_cudnn_attention(dev, allowed)
            assert torch.backends.cuda.cudnn_sdp_enabled() == allowed
            with torch.profiler.profile() as prof:
                packed_attention(q, k, v, lengths).float().sum().backward()
                torch.cuda.synchronize()
            ops = {e.key for e in prof.key_averages()}
            if not allowed:
                assert not any("cudnn_attention" in op for op in ops), sorted(ops)
                assert any("flash_attention" in op for op in ops), sorted(ops)
    finally:
        device.allow_cudnn_attention(dev, True)  # (torch's default)


@pytest.mark.cuda
def test_tf32_on_cuda_sets_and_clears_the_matmul_and_conv_precision():
    """Through ``fp32_precision`` (the ``allow_tf32`` flags are the legacy API; torch refuses to
    read them once the two are mixed)."""
    dev = torch.device("cuda", 0)
    device.allow_tf32(dev, True)
    assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
    device.allow_tf32(dev, False)
    assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "ieee"


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_on_stream_enters_a_stream_twice_and_restores_the_previous_one(kind):
    """torch 2.11's ``torch.Stream`` context is not re-entrant on a GPU (one object entered again
    before it exits raises; its CPU stream does not, checked here on 2.11 too); ``on_stream``
    enters a fresh object for the same stream each time and restores the stream that was current."""
    dev = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    side = torch.Stream(dev)
    with device.on_stream(side), device.on_stream(side):
        if kind == "cuda":
            assert torch.accelerator.current_stream(dev) == side
    if kind == "cuda":
        assert torch.accelerator.current_stream(dev) != side


def test_a_recorder_resolves_device_spans_by_waiting_for_their_events(monkeypatch):
    """On an accelerator a span is two events; ``resolve`` times them, and an event the device has
    not reached yet cannot be timed (torch raises): it must wait for each end event first. Fake
    events here (the CPU has none) that raise like an unreached CUDA event until synchronized."""
    from posttrain.spans import Recorder

    class Event:
        clock = 0.0

        def __init__(self):
            Event.clock += 1.0
            self.t, self.done = Event.clock, False

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            if not end.done:
                raise RuntimeError("CUDA error: device not ready")
            return (end.t - self.t) * 1000.0  # ms

    rec = Recorder(0, torch.device("cuda", 0))
    monkeypatch.setattr(rec, "_event", Event)
    rec.clear()
    with rec.span("gather"):
        pass
    rec.resolve()
    assert [s.name for s in rec.spans] == ["gather"] and rec.total("gather") == pytest.approx(1.0)


def test_communication_is_timed_by_a_recorder_or_handed_host_times():
    """Engines time a gather or push through ``comm_span``: a Recorder times it itself (on a GPU
    with events on the stream, resolved after the step's synchronization; here host times), a
    plain hook gets ``(kind, start, end)``, ``None`` costs nothing. A prefetch is drawn on the comm
    lane but is not subtracted from compute (it runs beside it)."""
    from posttrain.spans import COMM_KINDS, Recorder, comm_span, lane_of

    rec = Recorder(3, torch.device("cpu"))
    assert rec.device is None  # the CPU: host times
    with comm_span(rec, "gather"):
        pass
    with comm_span(rec, "prefetch"):
        pass
    rec.resolve()  # (nothing pending on the CPU)
    assert [(s.rank, s.lane, s.name) for s in rec.spans] == [(3, "comm", "gather"), (3, "comm", "prefetch")]
    got = []
    with comm_span(lambda kind, start, end: got.append((kind, end >= start)), "reduce"):
        pass
    assert got == [("reduce", True)]
    with comm_span(None, "reduce"):
        pass
    assert "prefetch" not in COMM_KINDS and lane_of("prefetch") == "comm"
    rec.clear()
    assert rec.spans == []


@pytest.mark.cuda
def test_a_recorder_on_a_gpu_times_kernels_not_launches():
    """On CUDA a span lasts as long as its kernels run: a matmul loop the host only queues."""
    import time

    dev = torch.device("cuda", 0)
    from posttrain.spans import Recorder

    rec = Recorder(0, dev)
    a = torch.randn(4096, 4096, device=dev)
    a = a @ a / 4096  # (cuBLAS set up outside the span)
    torch.accelerator.synchronize(dev)
    rec.clear()
    t0 = time.perf_counter()
    with rec.span("microbatch"):
        for _ in range(20):
            a = a @ a / 4096
    launched = time.perf_counter() - t0
    torch.accelerator.synchronize(dev)
    rec.resolve()
    (span,) = rec.spans
    assert span.duration > launched and span.start >= t0 - 1.0


def test_pipeline_messages_travel_where_the_backend_carries_them():
    """A pipeline rank sends device tensors through NCCL where the group has it for that device,
    and through host memory where gloo alone serves it (ranks sharing a GPU)."""
    from posttrain.pipeline.runtime import backend_for

    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl" and backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("cpu:gloo,cuda:gloo", "cuda") == "gloo" and backend_for("gloo", "cuda") == "gloo"


def test_gpu_ranks_are_spawned_with_nccl_or_with_gloo_where_they_share_a_gpu(fake_cuda, monkeypatch):
    from posttrain.train.core import job_options

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fake_cuda(2)
    assert job_options("cpu", 2) == {"backend": "gloo", "start": None}  # (forked)
    assert job_options("cuda", 2) == {"backend": "cpu:gloo,cuda:nccl", "start": "spawn"}
    assert job_options("cuda", 4) == {"backend": "gloo", "start": "spawn"}  # a child forked after CUDA cannot use it
    t = torch.arange(3.0)
    assert device.staged(t, t.device) is t


def test_the_banner_says_where_the_ranks_are(fake_cuda, monkeypatch):
    from posttrain.train.core import placement

    fake_cuda(2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert placement("cpu", 2) == "2 CPU processes"
    assert placement("cuda", 2) == "2 processes, one cuda device each"
    assert placement("cuda", 4) == "4 processes sharing 2 cuda devices (gloo for every collective)"


def _grid_under_torchrun_sharing(rank, world_size):
    import os

    from posttrain.train.sft.pipeline.dp import PipelineGrid

    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: rank 1 names a GPU a one-GPU host lacks
    dev = device.rank_device("cuda", rank)
    device.use(dev)
    grid = PipelineGrid(world_size, 1, "cuda")
    return torch.accelerator.current_device_index(), grid.pp_rank


@pytest.mark.cuda
def test_a_pipeline_grid_under_torchrun_with_ranks_sharing_a_gpu_keeps_each_ranks_device():
    """A DeviceMesh sets the device from LOCAL_RANK unless the accelerator is initialized; under
    torchrun with more ranks than GPUs that index does not exist. ``use`` initializes the rank's
    device first, so the grid keeps it."""
    count = torch.accelerator.device_count()
    out = run_ranks(_grid_under_torchrun_sharing, count + 1, backend="gloo", start="spawn", timeout_s=120)
    assert [d for d, _ in out] == [r % count for r in range(count + 1)]


@pytest.mark.full
def test_the_gpu_run_is_planned_here(tmp_path):
    """scripts/gpu_plan.py (gpu-verify.sh --dry-run): the tests, their recorded seconds or a stated
    guess, the expected time on the workers and the bound at every test's timeout; a plan over the
    part's limit says so and exits 1. scripts/gpu_wheels.py --dry-run: what the GPU image lacks of
    posttrain's needs (taken from the lock's pins), nothing it has (torch, transformers)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    collected = tmp_path / "tests.txt"
    collected.write_text("tests/a.py::t1\ntests/a.py::t2\ntests/b.py::t3\n")
    durations = tmp_path / "d.txt"
    durations.write_text("# seconds\n100.0 tests/a.py::t1\n50.0 tests/a.py::t2\n")
    plan = [sys.executable, str(root / "scripts" / "gpu_plan.py"), str(collected), str(durations)]
    ok = subprocess.run([*plan, "2", "120", "460"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "3 tests; 2 with a recorded duration, 1 without (planned at 30 s each, a guess)" in ok.stdout
    assert "expected 100 s on 2 worker(s), at most 240 s" in ok.stdout  # 100 | 50+30
    over = subprocess.run([*plan, "1", "120", "60"], capture_output=True, text=True)
    assert over.returncode == 1 and "exceed the part's 60 s" in over.stderr
    wheels = subprocess.run([sys.executable, str(root / "scripts" / "gpu_wheels.py"), "--dry-run", "--with",
                             "trl==1.16.0"], capture_output=True, text=True)
    assert wheels.returncode == 0, wheels.stderr
    want = {line.split()[-1] for line in wheels.stdout.splitlines() if line.startswith("would download")}
    assert {"datasets==5.2.0", "math-verify==0.9.0", "trl==1.16.0"} <= want
    assert not any(w.split("==")[0] in ("torch", "transformers", "numpy", "peft") for w in want), want
