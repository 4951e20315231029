"""Data: tokenizers, Megatron-compatible indexed datasets, packing and the resumable sampler.

Typical use by the trainer::

    tok = load_tokenizer(cfg.data.tokenizer)                  # "byte" or a tokenizer.json
    path = cfg.data.path or [build_demo_corpus(cache_dir, tok)]  # a prefix, or a blend "W1 P1 W2 P2 ..."
    train, valid = build_datasets(path, seq_length, seed, valid_fraction, eod_id=tok.eod_id)
    for part in train.parts:
        check_vocab(part.dataset, model_vocab_size)
    sampler = BatchSampler(train, global_batch_size, micro_batch_size, dp_size, dp_rank)
    micro_batches = sampler.next_batch()                      # this rank's rows for the step

Names are imported on first use, so ``scripts/prepare_data.py`` starts without loading torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchSampler": "sampler",
    "BlendedSamples": "blend",
    "ByteTokenizer": "tokenizers",
    "DataError": "errors",
    "HFTokenizer": "tokenizers",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset",
    "PackedSamples": "packing",
    "SampleStream": "packing",
    "Tokenizer": "tokenizers",
    "build_datasets": "datasets",
    "describe_draws": "datasets",
    "build_demo_corpus": "demo_corpus",
    "check_vocab": "indexed_dataset",
    "load_tokenizer": "tokenizers",
    "microbatch_start": "sampler",
    "parse_blend": "blend",
    "split_documents": "sampler",
    "token_dtype": "indexed_dataset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
