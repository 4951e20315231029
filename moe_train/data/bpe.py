"""Training a byte-level BPE tokenizer with Hugging Face ``tokenizers``."""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.data.atomic import temp_path_for
from moe_train.data.tokenizers import EOD_TEXT


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE (all 256 bytes in its alphabet, so any text encodes) with ``EOD_TEXT`` as
    its only special token; ``vocab_size`` counts both."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"BPE vocab size must be at least {len(alphabet) + 1} (bytes + EOD), got {vocab_size}")
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
    tok.save(tmp)
    return tmp
