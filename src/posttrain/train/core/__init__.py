"""What every trainer shares: the configuration every run has (:mod:`.config`)."""

from .config import OptimConfig, RunConfig, config_from_dict, config_value

__all__ = ["OptimConfig", "RunConfig", "config_from_dict", "config_value"]
