"""Training data: embedded synthetic sequences with named length profiles, record formats (chat,
prompt/completion, text, pre-tokenized) with loss masks, and a tokenized, cached, memory-mapped
dataset."""

from __future__ import annotations

from .dataset import TokenizedDataset, load_tokenized, tokenizer_fingerprint
from .formats import FORMATS, IGNORE_INDEX, Encoded, encode_record, record_format
from .synthetic import PROFILES, PUBLISHED_SHAPES, profile_lengths, synthetic_sequences

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "PROFILES",
    "PUBLISHED_SHAPES",
    "Encoded",
    "TokenizedDataset",
    "encode_record",
    "load_tokenized",
    "profile_lengths",
    "record_format",
    "synthetic_sequences",
    "tokenizer_fingerprint",
]
