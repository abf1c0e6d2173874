"""posttrain: fast LLM post-training when sequence lengths vary and activations do not fit.

Subpackages: :mod:`posttrain.odc` (sharded data parallel with one-sided communication).
"""

__version__ = "0.1.0"
