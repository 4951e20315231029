"""scripts/prepare_data.py refuses bad arguments, inputs and outputs with exit 2 and one line naming
the file or argument, and writes nothing (table-driven; in process, plus the script itself once).

A full disk and a read-only output folder are real tmpfs mounts (tests/unit/_mounts.py). An
unreadable input: permission bits where the test does not run as root, else (root reads any file)
a PermissionError from the read itself, a test double at the OS boundary."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from moe_train.data.prepare import EXIT_BAD_INPUT, main
from tests.unit._mounts import make_read_only, tmpfs

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"


def make_unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.chmod(0)
    if os.geteuid() == 0:
        read_bytes = pathlib.Path.read_bytes

        def refuse(self: Path) -> bytes:
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return read_bytes(self)

        monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)


def missing_input(tmp: Path, _mp) -> tuple[list[str], str]:
    return [str(tmp / "nothing-here")], f"input not found: {tmp / 'nothing-here'}"


def unreadable_input(tmp: Path, mp) -> tuple[list[str], str]:
    make_unreadable(tmp / "a.txt", mp)
    return [str(tmp / "a.txt")], f"cannot read {tmp / 'a.txt'}: Permission denied"


def not_utf8(tmp: Path, _mp) -> tuple[list[str], str]:
    (tmp / "bin.txt").write_bytes(b"\xff\xfe")
    return [str(tmp / "bin.txt")], f"{tmp / 'bin.txt'}: not UTF-8 text"


def empty_corpus(tmp: Path, _mp) -> tuple[list[str], str]:
    (tmp / "empty.txt").write_text("")
    return [str(tmp / "empty.txt")], "the inputs contain no non-empty documents"


def folder_without_matches(tmp: Path, _mp) -> tuple[list[str], str]:
    return [str(tmp), "--glob", "*.md"], f"{tmp}: no files matching '*.md'"


def missing_tokenizer(tmp: Path, _mp) -> tuple[list[str], str]:
    return [str(tmp / "a.txt"), "--tokenizer", str(tmp / "tok.json")], f"tokenizer file not found: {tmp / 'tok.json'}"


def malformed_tokenizer(tmp: Path, _mp) -> tuple[list[str], str]:
    (tmp / "tok.json").write_text("not json")
    return [str(tmp / "a.txt"), "--tokenizer", str(tmp / "tok.json")], f"cannot load tokenizer {tmp / 'tok.json'}"


def small_bpe_vocab(tmp: Path, _mp) -> tuple[list[str], str]:
    return [str(tmp / "a.txt"), "--train-bpe", "10"], "--train-bpe 10: the vocab size must be at least 257"


def missing_json_field(tmp: Path, _mp) -> tuple[list[str], str]:
    (tmp / "docs.jsonl").write_text('{"body": "x"}\n')
    return [str(tmp / "docs.jsonl")], f"{tmp / 'docs.jsonl'}:1: no 'text' field"


CASES: dict[str, Callable] = {f.__name__: f for f in (
    missing_input, unreadable_input, not_utf8, empty_corpus, folder_without_matches, missing_tokenizer,
    malformed_tokenizer, small_bpe_vocab, missing_json_field)}


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The one error line of a run that must exit 2."""
    capsys.readouterr()
    assert main([*argv, "--quiet"]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith("prepare_data: error: ") and not out, (out, err)
    return line


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line_naming_it(tmp_path, capsys, monkeypatch, case):
    (tmp_path / "a.txt").write_text("hello world")
    inputs, named = CASES[case](tmp_path, monkeypatch)
    out = tmp_path / "out"
    assert named in refused([*inputs, "-o", str(out / "ds")], capsys)
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.parametrize("prefix", ["", "data/"])
def test_an_output_prefix_without_a_file_name_exits_2(tmp_path, capsys, prefix):
    (tmp_path / "a.txt").write_text("hello world")
    assert f"--output-prefix {prefix!r}: needs a file name" in refused([str(tmp_path / "a.txt"), "-o", prefix], capsys)


def test_an_output_under_a_file_exits_2_naming_it(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world")
    line = refused([str(tmp_path / "a.txt"), "-o", str(tmp_path / "a.txt" / "ds")], capsys)
    assert f"cannot write {tmp_path / 'a.txt' / 'ds'}.bin/.idx: " in line, line


@pytest.mark.parametrize("bpe", [False, True], ids=["byte", "train-bpe"])
def test_a_read_only_output_folder_exits_2_naming_it(tmp_path, capsys, bpe):
    (tmp_path / "a.txt").write_text("hello world")
    with tmpfs(tmp_path / "out", "1m") as out:
        make_read_only(out)
        line = refused([str(tmp_path / "a.txt"), "-o", str(out / "ds"), *(["--train-bpe", "300"] * bpe)], capsys)
        written = f"{out / 'ds'}.tokenizer.json" if bpe else f"{out / 'ds'}.bin/.idx"
        assert f"cannot write {written}: Read-only file system" in line, line


def test_a_full_disk_exits_2_naming_the_dataset_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "big.txt").write_text("lorem ipsum " * 20_000)  # 240 kB of tokens, stored as 480 kB
    with tmpfs(tmp_path / "out", "64k") as out:
        line = refused([str(tmp_path / "big.txt"), "-o", str(out / "ds")], capsys)
        assert line == f"prepare_data: error: cannot write {out / 'ds'}.bin/.idx: No space left on device", line
        assert os.listdir(out) == []


def test_the_script_exits_2(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nothing"), "-o", str(tmp_path / "ds")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"prepare_data: error: input not found: {tmp_path / 'nothing'}\n"
