"""Trainers: they compose the library (engines, balancing, pipeline runtime, models, data) into
training runs; the lab and the command line use them, the library never does.

- :mod:`posttrain.train.dp`: data-parallel runs on any :mod:`posttrain.dp` engine (``posttrain train``);
- :mod:`posttrain.train.pipeline`: pipeline-parallel runs with offload (``posttrain pipeline``).
"""
