"""Training a byte-level BPE tokenizer with Hugging Face ``tokenizers``."""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.atomic import temp_path_for
from moe_train.data.errors import DataError
from moe_train.data.tokenizers import EOD_TEXT

MIN_VOCAB_SIZE = 257  # the 256 bytes of the byte-level alphabet, and EOD


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE (all 256 bytes in its alphabet, so any text encodes) with ``EOD_TEXT`` as
    its only special token; ``vocab_size`` counts both."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--train-bpe {vocab_size}: the vocab size must be at least {MIN_VOCAB_SIZE} (bytes + EOD)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TEXT],
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer_tmp(tok: Tokenizer, final_path: str) -> str:
    """Save beside ``final_path`` under a temporary name, for the caller to rename into place."""
    tmp = temp_path_for(final_path)
    try:
        tok.save(tmp)
    except Exception as exc:  # the Rust side raises a bare Exception, e.g. "Read-only file system (os error 30)"
        raise DataError(f"cannot write {final_path}: {exc}") from None
    return tmp
