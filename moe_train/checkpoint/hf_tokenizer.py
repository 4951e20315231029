"""The tokenizer files of a Hugging Face export: tokenizer.json, tokenizer_config.json, generation_config.json.

The byte tokenizer is written with the `tokenizers` library: a byte-level BPE without merges whose
256 tokens are the bytes (id = byte value, in GPT-2's byte-to-character alphabet) plus the EOD
token as special id 256, so `AutoTokenizer` encodes text to our ids. A `tokenizer.json` is copied.
EOD is both BOS and EOS: our documents are only separated by it.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from moe_train.data.tokenizers import EOD_TEXT, ByteTokenizer, HFTokenizer, load_tokenizer


def _byte_alphabet() -> list[str]:
    """GPT-2's printable character for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_alphabet())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOD_TEXT, special=True)])
    if tokenizer.token_to_id(EOD_TEXT) != ByteTokenizer.eod_id:
        raise AssertionError(f"{EOD_TEXT} got id {tokenizer.token_to_id(EOD_TEXT)}, not {ByteTokenizer.eod_id}")
    return tokenizer.to_str()


def tokenizer_files(spec: str, model_vocab_size: int, max_length: int) -> tuple[dict[str, str], int]:
    """The text files for tokenizer `spec` ("byte" or a tokenizer.json path) and its EOD id; a DataError
    when it cannot be read, a ValueError when its ids do not fit the model's vocabulary."""
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"tokenizer {spec}: {tokenizer.vocab_size} ids do not fit model.vocab_size={model_vocab_size}")
    byte = not isinstance(tokenizer, HFTokenizer)
    if byte:
        text, eod_token = byte_tokenizer_json(), EOD_TEXT
    else:
        text = Path(tokenizer.path).read_text()
        eod_token = Tokenizer.from_str(text).id_to_token(tokenizer.eod_id)
    eod = tokenizer.eod_id
    # split_special_tokens: ours reads "<|endoftext|>" inside a text as its bytes; a tokenizer.json matches it
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod_token, "eos_token": eod_token,
              "add_bos_token": False, "add_eos_token": False, "model_max_length": max_length,
              "split_special_tokens": byte}
    generation = {"bos_token_id": eod, "eos_token_id": eod, "do_sample": False}
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(generation, indent=2)}, eod
