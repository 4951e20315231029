"""The byte tokenizer and loading a Hugging Face tokenizer.json by path."""
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from moe_train.data import ByteTokenizer, DataError, HFTokenizer, load_tokenizer


def random_text(n):
    r = random.SystemRandom()
    alphabet = "abcdefghij klmnop\nQRSTé→😀"
    return "".join(r.choice(alphabet) for _ in range(n))


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    text = random_text(200)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert max(ids) < 256 and tok.eod_id == 256 and tok.vocab_size == 257
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod_id] + ids) == text + "<|endoftext|>" + text
    assert tok.encode_batch([text, ""]) == [ids, []]
    with pytest.raises(DataError):
        tok.decode([300])


def write_word_level(path, words, eod="<|endoftext|>"):
    vocab = {w: i for i, w in enumerate(["[UNK]", *words, eod])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return vocab


def test_tokenizer_json_by_path(tmp_path):
    words = sorted({w for w in random_text(400).split() if w})
    vocab = write_word_level(tmp_path / "tokenizer.json", words)
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(vocab)
    assert tok.eod_id == vocab["<|endoftext|>"]
    sample = random.SystemRandom().sample(words, min(5, len(words)))
    assert tok.encode(" ".join(sample)) == [vocab[w] for w in sample]
    assert tok.encode_batch([sample[0]]) == [[vocab[sample[0]]]]
    fp = tok.fingerprint()
    write_word_level(tmp_path / "tokenizer.json", words + ["zzz-extra"])
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).fingerprint() != fp


def test_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(str(bad))
    write_word_level(tmp_path / "noeod.json", ["a", "b"], eod="[SEP]")
    with pytest.raises(DataError, match="noeod.json.*end-of-document"):
        load_tokenizer(str(tmp_path / "noeod.json"))
    assert load_tokenizer(str(tmp_path / "noeod.json"), eod_token="[SEP]").eod_id == 3
