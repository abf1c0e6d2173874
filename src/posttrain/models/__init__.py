"""Small models for examples, tests and benchmarks."""

from .gpt import GPT, GPTConfig, token_loss_sum

__all__ = ["GPT", "GPTConfig", "token_loss_sum"]
