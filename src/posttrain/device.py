"""Where a run's tensors live: the one module that knows about devices.

[Note: devices]
A run names its device as ``auto``, ``cpu`` or ``cuda`` (``RunConfig.device``). :func:`resolve`
turns that into a device kind before any process starts (``auto``: CUDA when torch can use it),
refusing ``cuda`` in one line on a machine without it; the ranks get the resolved kind
(:func:`rank_kind`) and are spawned rather than forked on an accelerator (:func:`start_method`).
Each rank then uses
:func:`rank_device`: the CPU, or the accelerator ``LOCAL_RANK`` (or the rank) modulo the devices
on its host, made current with :func:`use`. Process groups are :func:`backend`: gloo on the CPU,
and for an accelerator ``cpu:gloo,cuda:nccl`` (objects, token counts and ODC's control plane stay
on gloo; collectives of device tensors go to NCCL, one rank per GPU).

Everything device-specific goes through here and the generic ``torch.accelerator`` API, so the
CPU suite runs the same code as a GPU: callers ask for "the device" and for a synchronization or
a memory figure, never for ``torch.cuda`` by name.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = ["DEVICES", "add_into", "allow_cudnn_attention", "allow_tf32", "backend", "check_world", "cuda_available",
           "current", "describe", "device_count", "local_rank", "matmul_tflops", "max_memory_allocated", "on_stream",
           "physical_id", "rank_device", "rank_kind", "reset_peak_memory", "resolve", "shares_devices", "staged",
           "start_method", "synchronize", "use", "visible_index"]

#: What ``device`` may be: ``auto`` (CUDA when torch can use it, else the CPU), ``cpu`` or ``cuda``.
DEVICES = ("auto", "cpu", "cuda")


def _cuda_available() -> bool:
    # torch.cuda.is_available() initializes the driver, and a process forked after it cannot use
    # CUDA; device_count() asks NVML and leaves this process fork-safe (where NVML answers).
    return torch.cuda.device_count() > 0


def cuda_available() -> bool:
    """Whether torch can use a CUDA device here."""
    return _cuda_available()


def describe(kind: str = "cuda") -> dict[str, str]:
    """The first device of ``kind``: model, memory, count and capability (for reports)."""
    props = torch.cuda.get_device_properties(0) if kind == "cuda" else None
    if props is None:
        return {"device": kind}
    return {"GPU": f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {device_count(kind)} device(s)",
            "compute capability": f"{props.major}.{props.minor}"}


def resolve(device: str = "auto", supported: tuple[str, ...] = ("cpu", "cuda"), what: str = "this run") -> str:
    """The device kind a run of ``device`` uses: ``"cpu"`` or ``"cuda"``; ``auto`` takes CUDA
    where torch can use it and ``supported`` (what the trainer and engine run on) includes it.

    Raises:
        ValueError: an unknown name, a kind ``what`` does not support, or ``cuda`` where torch
            can use no CUDA device (one line saying what this torch build has).
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if "cuda" in supported and _cuda_available() else "cpu"
    if device not in supported:
        raise ValueError(f"device={device!r}: {what} runs on {' and '.join(supported)} only so far")
    if device == "cuda" and not _cuda_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device='cuda' but torch {torch.__version__} ({build}) sees no CUDA device here; "
                         "use `device` cpu (or auto)")
    return device


def backend(kind: str, *, shared: bool = False) -> str:
    """The ``torch.distributed`` backend of a run on ``kind``: ``gloo`` on the CPU; on an
    accelerator, gloo for CPU tensors and the accelerator's own backend for its tensors; gloo for
    both where ranks share a device (``shared``, :func:`shares_devices`: NCCL refuses two ranks of
    one communicator on one GPU, and gloo's all-reduce and broadcast take CUDA tensors)."""
    if kind == "cpu" or shared:
        return "gloo"
    return f"cpu:gloo,{kind}:{dist.Backend.default_device_backend_map[kind]}"


def shares_devices(kind: str, local_world_size: int) -> bool:
    """Whether ``local_world_size`` ranks on this host put more than one rank on a ``kind`` device
    (never on the CPU)."""
    return kind != "cpu" and local_world_size > device_count(kind)


def device_count(kind: str) -> int:
    """Devices of ``kind`` on this host (the CPU counts as one)."""
    return 1 if kind == "cpu" else torch.accelerator.device_count()


def check_world(kind: str, world_size: int, *, local_world_size: int | None = None,
                shared_ok: bool = False) -> None:
    """Refuse, before any process starts, more ranks on this host than ``kind`` has devices
    (NCCL runs one rank per GPU: two ranks on one device are refused by its communicator), unless
    ``shared_ok``: the run's data path needs no NCCL (ODC's engines: their gathers and adds go
    through the device transport), so its ranks may share GPUs over gloo (:func:`backend`).

    Args:
        local_world_size: ranks on this host (default: ``world_size``, the fork launcher's).
    """
    local = world_size if local_world_size is None else local_world_size
    if shares_devices(kind, local) and not shared_ok:
        raise ValueError(f"world_size={local} ranks on this host but it has {device_count(kind)} {kind} device(s); "
                         f"NCCL runs one rank per device: lower `world_size`, use flat ODC (`dp` odc, whose ranks "
                         f"may share a GPU) or `device` cpu")


def visible_index(pid: str) -> int | None:
    """This process's index of the device :func:`physical_id` names ``pid`` (another process may
    number it differently, e.g. under its own ``CUDA_VISIBLE_DEVICES``); ``None`` where this process
    does not see it."""
    kind = pid.split(":", 1)[0]
    if kind == "cpu":
        return None
    return next((i for i in range(device_count(kind)) if physical_id(torch.device(kind, i)) == pid), None)


def staged(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``src`` on ``device``: itself there, else a copy (device to device, stream-ordered)."""
    return src if src.device == device else src.to(device, non_blocking=True)


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` run where ``dst`` lives: ``src`` from another device is first copied there
    (a peer GPU's memory mapped into this process is written by a kernel on that GPU, which needs
    no peer access). ``src`` is converted to ``dst``'s dtype by the add."""
    dst.add_(staged(src, dst.device))


def start_method(backend_name: str) -> str:
    """How the launcher starts ranks for ``backend_name``: ``fork`` on the CPU (no child
    re-imports torch), ``spawn`` where ranks use an accelerator (a forked child cannot use CUDA
    once its parent has touched it, which a launcher cannot rule out), and ``spawn`` for CPU ranks
    too where a forked child could not run autograd (:func:`autograd_survives_fork`)."""
    if backend_name != "gloo" or torch.cuda.is_initialized():
        return "spawn"
    return "fork" if autograd_survives_fork() else "spawn"


_AUTOGRAD_FORK_BROKEN = False


def autograd_survives_fork() -> bool:
    """Whether a child forked from this process now can run a backward. On a machine with a GPU,
    autograd starts a thread per device at this process's first backward (a CPU one too), and torch
    then refuses autograd in any child forked later ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing": seen on the GPU machine, a CPU run launched after
    a test had run a backward in the same process). Torch does not say whether those threads have
    started, so where a GPU is present this forks a child that runs a one-element backward and
    exits, and asks its exit status (once broken, it stays broken: remembered). Without a GPU
    there are no device threads: no child."""
    global _AUTOGRAD_FORK_BROKEN
    if _AUTOGRAD_FORK_BROKEN:
        return False
    if not torch.cuda.device_count():  # (NVML where it can: does not initialize CUDA)
        return True
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 if a backward runs
        code = 1
        try:
            x = torch.ones(1, requires_grad=True)
            (x * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        _AUTOGRAD_FORK_BROKEN = True
    return not _AUTOGRAD_FORK_BROKEN


def rank_kind(device: str) -> str:
    """In a rank: the device kind of its run, ``device`` as the launcher resolved it; ``auto``
    (a rank started by other code) follows the process group: CUDA only where it has a CUDA
    backend."""
    if device != "auto":
        return device
    return "cuda" if dist.is_initialized() and "cuda" in str(dist.get_backend()) else "cpu"


def local_rank(rank: int) -> int:
    """This process's rank on its host: ``LOCAL_RANK`` under torchrun, else ``rank`` (the fork
    launcher starts every rank on this host)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def rank_device(kind: str, rank: int) -> torch.device:
    """The device rank ``rank`` uses: the CPU, or accelerator :func:`local_rank` modulo the
    host's devices."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, local_rank(rank) % device_count(kind))


def use(device: torch.device) -> None:
    """Make ``device`` this process's current one, initialized (before its process group and any
    device mesh start: NCCL binds to the current device). Nothing on the CPU."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
        # and initialized: a DeviceMesh built on an uninitialized accelerator sets the device itself,
        # from LOCAL_RANK where a launcher set it, which names no device where ranks share a GPU
        torch.empty(0, device=device)


def physical_id(device: torch.device) -> str:
    """What names ``device`` across processes (whatever each one's visible-device numbering): the
    GPU's UUID; ``"cpu"`` for the CPU."""
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{torch.cuda.get_device_properties(device).uuid}"


def current(device: torch.device):
    """A context in which ``device`` is the current device (kernels launched by code that does not
    take a device, such as Triton's, run there); nothing on the CPU."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, *, n: int | None = None,
                  repeats: int = 5) -> float:
    """TFLOP/s of an ``n`` x ``n`` matrix product in ``dtype`` on ``device`` (the median of
    ``repeats`` after a warm-up): the peak a model-FLOPs utilization divides by when none is given.
    ``n`` defaults to 512 on the CPU and 4096 on an accelerator."""
    import statistics
    import time

    n = n or (512 if device.type == "cpu" else 4096)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def allow_tf32(device: torch.device, allowed: bool) -> None:
    """Let fp32 matrix products and cuDNN convolutions on ``device`` use TF32 (``allowed``), or
    keep them in full fp32 (``ieee``). Nothing on the CPU, where TF32 does not exist. Set through
    ``fp32_precision`` (torch 2.11-2.15 all have it; the ``allow_tf32`` flags it replaces warn that
    they will go)."""
    if device.type != "cuda":
        return
    precision = "tf32" if allowed else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def allow_cudnn_attention(device: torch.device, allowed: bool) -> None:
    """Whether ``scaled_dot_product_attention`` on ``device`` may pick cuDNN's attention kernel
    (``allowed``) or keeps to flash attention, the memory-efficient kernel and the math fallback.
    Nothing on the CPU. posttrain's trainers leave it off: cuDNN builds an execution graph for each
    new shape of the inputs, about 3 ms of host time a call, and packed microbatches of varying
    lengths give new shapes at nearly every call (one H100, torch 2.11: 62% of a 1.1B Llama's SFT
    step, docs/results.md)."""
    if device.type != "cuda":
        return
    torch.backends.cuda.enable_cudnn_sdp(allowed)


@contextlib.contextmanager
def on_stream(stream: torch.Stream):
    """Make ``stream`` its device's current stream inside the block and the previous one current
    again after it. A fresh ``torch.Stream`` object for the same stream is entered each time: in
    torch 2.11 one object's context is not re-entrant (entered again before it exits, even through
    other code, it raises "Stream's context should not be initialized")."""
    with torch.Stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type):
        yield


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel on ``device`` (nothing on the CPU, where work is synchronous)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def max_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes allocated on ``device`` since the last :func:`reset_peak_memory`; ``None`` on
    the CPU, which keeps no such count."""
    if device.type == "cpu":
        return None
    return torch.accelerator.max_memory_allocated(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`max_memory_allocated` over (nothing on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
