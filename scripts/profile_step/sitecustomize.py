"""Profile one optimizer step of any torch program, spawned ranks included, without touching it.

    PROFILE_STEP_OUT=/tmp/prof.txt PYTHONPATH=scripts/profile_step:src python -m posttrain train ...

Python imports ``sitecustomize`` at start-up, in every process (ranks started with ``spawn``
too). With ``PROFILE_STEP_OUT`` set, a global optimizer hook starts torch's profiler after
optimizer step ``PROFILE_STEP`` (default 2) and stops it after the next one: the profile holds
one whole step (data, forward, backward, clipping, the optimizer). The operators by self device
time and by self CPU time go to ``PROFILE_STEP_OUT`` (rank suffixed beyond rank 0)."""

import os

if os.environ.get("PROFILE_STEP_OUT"):
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _state = {"n": 0, "prof": None, "t": 0.0}
    _target = int(os.environ.get("PROFILE_STEP", "2"))

    def _sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _hook(optimizer, args, kwargs):
        _state["n"] += 1
        if _state["n"] == _target:
            _sync()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            _state["prof"] = torch.profiler.profile(activities=acts)
            _state["prof"].__enter__()
            _state["t"] = time.perf_counter()
        elif _state["n"] == _target + 1 and _state["prof"] is not None:
            _sync()
            wall = time.perf_counter() - _state["t"]
            prof, _state["prof"] = _state["prof"], None
            prof.__exit__(None, None, None)
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            rank = str(dist.get_rank()) if initialized else os.environ.get("RANK", "0")
            out = os.environ["PROFILE_STEP_OUT"] + ("" if rank == "0" else f".rank{rank}")
            avg = prof.key_averages()
            with open(out, "w") as f:
                f.write(f"one optimizer step (after step {_target}), {wall:.3f} s by stopwatch under the profiler\n\n")
                if any(getattr(e, "self_device_time_total", 0) for e in avg):
                    f.write("by self device time\n")
                    f.write(avg.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70) + "\n\n")
                f.write("by self CPU time\n")
                f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")

    register_optimizer_step_post_hook(_hook)
