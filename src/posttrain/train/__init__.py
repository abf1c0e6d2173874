"""Trainers: they compose the library (engines, balancing, pipeline runtime, models, data) into
training runs; the lab and the command line use them, the library never does. Named by what
they train:

- :mod:`posttrain.train.core`: what every trainer shares (the run's configuration with its
  engine and optimizer sections, the step skeleton :class:`~posttrain.train.core.Trainer`,
  checkpoints, metrics, launch);
- :mod:`posttrain.train.sft`: supervised fine-tuning on any :mod:`posttrain.dp` engine
  (``posttrain train``), and :mod:`posttrain.train.sft.pipeline`: the same with pipeline
  parallelism and activation offload, optionally x data parallelism (``posttrain pipeline``);
- :mod:`posttrain.train.rl`: GRPO/RLOO, the update on any engine (``posttrain rl``).
"""
