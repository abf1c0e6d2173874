"""posttrain: fast LLM post-training (SFT and RL) when sequence lengths vary wildly and
activations do not fit in device memory.

The library, by capability:

- :mod:`posttrain.odc`: ODC, sharded data parallelism whose per-layer collectives are one-sided
  gathers and scatter-accumulates; ranks synchronize once per minibatch;
- :mod:`posttrain.dp`: data-parallel engines (FSDP2, flat ODC, ODC on FSDP2) behind one interface;
- :mod:`posttrain.balance`: cost models, minibatch-level balancing, packing;
- :mod:`posttrain.pipeline`: pipeline schedules as data, activation offload (PipeOffload), runtime;
- :mod:`posttrain.sim`: a discrete-event simulator and planner at cluster scale;
- :mod:`posttrain.models`, :mod:`posttrain.data`, :mod:`posttrain.rl`: Hugging Face models in and
  out, data formats with loss masks, RL advantages, losses and rollouts.

Built on it: :mod:`posttrain.train` (the trainers), ``posttrain.lab`` (benchmarks, demo,
calibration) and :mod:`posttrain.cli` (the ``posttrain`` command).
"""

__version__ = "0.1.0"
