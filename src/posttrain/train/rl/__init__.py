"""RL runs (``posttrain rl``): GRPO/RLOO rollouts with ``transformers`` ``generate`` and a policy
update on any :mod:`posttrain.dp` engine, balanced by :mod:`posttrain.balance`."""

from .config import RLConfig
from .launch import run_rl
from .loop import RL_SCALARS, Prompt, RLTrainer, load_prompts, prompt_limit, rl_worker, update_minibatch

__all__ = ["RL_SCALARS", "Prompt", "RLConfig", "RLTrainer", "load_prompts", "prompt_limit", "rl_worker", "run_rl",
           "update_minibatch"]
