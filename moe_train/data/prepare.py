"""Text in, Megatron indexed dataset out: the logic behind ``scripts/prepare_data.py``.

Every document is followed by the tokenizer's EOD. Nothing appears under the output prefix
until the whole dataset is written (see ``IndexedDatasetWriter``); a BPE trained here is saved
as ``<prefix>.tokenizer.json``, published just before the dataset, with any old ``.idx``
removed first so an old dataset is never paired with a new tokenizer.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from moe_train.data import bpe
from moe_train.data.errors import DataError
from moe_train.data.indexed_dataset import IndexedDatasetWriter, idx_path, token_dtype
from moe_train.data.inputs import expand_inputs, iter_documents
from moe_train.data.progress import Progress
from moe_train.launch.exit_codes import EXIT_BAD_INPUT
from moe_train.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer

_BATCH_DOCS = 256
_BATCH_BYTES = 8 << 20


@dataclass
class PrepareResult:
    prefix: str
    tokenizer: str
    documents: int
    tokens: int


def tokenizer_path_for(prefix: str) -> str:
    return prefix + ".tokenizer.json"


def write_dataset(
    documents: Iterable[tuple[str, int]],
    tokenizer: Tokenizer,
    prefix: str,
    progress: Progress,
    tokenizer_tmp: str | None = None,
) -> None:
    """Tokenize ``(text, nbytes)`` pairs in batches and publish the dataset at ``prefix``.

    ``tokenizer_tmp``, if given, is renamed to ``<prefix>.tokenizer.json`` just before the
    dataset is published.
    """
    with IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size)) as writer:
        batch: list[str] = []
        batch_bytes = 0
        for text, nbytes in documents:
            batch.append(text)
            batch_bytes += nbytes
            if len(batch) >= _BATCH_DOCS or batch_bytes >= _BATCH_BYTES:
                _write_batch(writer, tokenizer, batch, batch_bytes, progress)
                batch, batch_bytes = [], 0
        if batch:
            _write_batch(writer, tokenizer, batch, batch_bytes, progress)
        if writer.num_documents == 0:
            raise DataError(f"{prefix}: the inputs contain no non-empty documents")
        if tokenizer_tmp is not None:
            if os.path.exists(idx_path(prefix)):
                os.remove(idx_path(prefix))
            os.replace(tokenizer_tmp, tokenizer_path_for(prefix))


def _write_batch(
    writer: IndexedDatasetWriter, tokenizer: Tokenizer, texts: list[str], nbytes: int, progress: Progress
) -> None:
    tokens = 0
    for ids in tokenizer.encode_batch(texts):
        doc = np.empty(len(ids) + 1, dtype=np.int64)
        doc[:-1] = ids
        doc[-1] = tokenizer.eod_id
        writer.add_document(doc)
        tokens += doc.size
    progress.update(len(texts), tokens, nbytes)


def prepare_dataset(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: str = "byte",
    train_bpe_vocab: int | None = None,
    glob: str = "*",
    json_key: str = "text",
    show_progress: bool = True,
) -> PrepareResult:
    """Build ``<output_prefix>.bin/.idx`` from text files, folders and JSONL files."""
    prefix = os.fspath(output_prefix)
    if not os.path.basename(prefix):
        raise DataError(f"--output-prefix {prefix!r}: needs a file name, e.g. data/mycorpus for "
                        "data/mycorpus.bin and .idx")
    files = expand_inputs(inputs, glob)
    total_bytes = sum(f.stat().st_size for f in files)
    tmp_tok = None
    try:
        if train_bpe_vocab is not None:
            trained = bpe.train_bpe(
                (text for text, _ in iter_documents(files, json_key)), train_bpe_vocab, show_progress
            )
            tmp_tok = bpe.save_tokenizer_tmp(trained, tokenizer_path_for(prefix))
            tok: Tokenizer = HFTokenizer(tmp_tok)
        else:
            tok = load_tokenizer(tokenizer)
        progress = Progress(total_bytes, f"tokenizing into {prefix}", enabled=show_progress)
        try:
            write_dataset(iter_documents(files, json_key), tok, prefix, progress, tmp_tok)
        except OSError as exc:  # the inputs' read errors are DataErrors by now
            raise DataError(f"cannot write {prefix}.bin/.idx: {exc.strerror}"
                            + (f" ({exc.filename})" if exc.filename else "")) from None
        finally:
            progress.close()
    finally:
        if tmp_tok is not None and os.path.exists(tmp_tok):
            os.remove(tmp_tok)
    tok_name = tokenizer_path_for(prefix) if tmp_tok is not None else tok.name
    if show_progress:
        print(progress.summary(), file=sys.stderr)
    return PrepareResult(prefix, tok_name, progress.docs, progress.tokens)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tokenize text files, folders and JSONL into a Megatron indexed dataset (.bin/.idx), "
        "with an EOD token after every document."
    )
    p.add_argument("inputs", nargs="+", help="text files (one document each), folders, or .jsonl files")
    p.add_argument("--output-prefix", "-o", required=True, help="writes PREFIX.bin and PREFIX.idx")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="byte", help='"byte" (built in) or a tokenizer.json path')
    tok.add_argument(
        "--train-bpe", type=int, metavar="VOCAB_SIZE",
        help="train a byte-level BPE of this vocab size on the inputs; saved as PREFIX.tokenizer.json",
    )
    p.add_argument("--glob", default="*", help="file name pattern inside folders (recursive), e.g. '*.txt'")
    p.add_argument("--json-key", default="text", help="field holding the document text in JSONL lines")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = prepare_dataset(
            args.inputs, args.output_prefix, args.tokenizer, args.train_bpe, args.glob, args.json_key,
            show_progress=not args.quiet,
        )
    except DataError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # one not tied to a single input or the output, e.g. an unreadable folder
        print(f"prepare_data: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"wrote {result.prefix}.bin/.idx: {result.documents} documents, {result.tokens} tokens; "
        f"tokenizer {result.tokenizer}"
    )
    return 0
