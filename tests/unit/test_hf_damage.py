"""Damaged Hugging Face folders, tried as a new user would, in every reader of HF folders: one line
naming the damaged file (or, for a tensor that does not fit the model, the folder and the tensor), exit 2.
The folder is the tiny model written by `save_hf_checkpoint` in several shards with an index."""
from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from moe_train.checkpoint.hf import main as hf_cli, save_hf_checkpoint
from moe_train.checkpoint.hf_checkpoint import INDEX_FILE
from moe_train.config import load_config
from moe_train.data.demo_corpus import build_demo_corpus
from moe_train.data.tokenizers import ByteTokenizer
from moe_train.generate.cli import main as generate_main
from moe_train.train import main as train_main
from tests.unit._tiny_checkpoint import TINY

SHARD = "model-00002-of-00005.safetensors"
OTHER = "model-00003-of-00005.safetensors"


def draw_seed(what: str) -> int:
    seed = random.randrange(2**31)
    print(f"{what}: seed {seed}")
    return seed


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """The tiny model as an HF folder of 5 shards and an index."""
    model = DeepSeekV3(load_config(TINY).model)
    initialize_parameters(model, draw_seed("tiny model"), 0.02)
    path = tmp_path_factory.mktemp("hf") / "hf"
    save_hf_checkpoint(model, path, max_shard_bytes=600_000)
    assert sorted(p.name for p in path.glob("*.safetensors"))[1] == SHARD and (path / OTHER).is_file()
    return path


def read_header(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_header(file: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def first_tensor(file: Path) -> str:
    return sorted(name for name in read_header(file)[0] if name != "__metadata__")[0]


def header_lie(key: str) -> Callable[[Path], tuple[Path, str]]:
    """A header entry that says something else than the data: its offsets, dtype or shape."""
    def damage(folder: Path) -> tuple[Path, str]:
        file = folder / SHARD
        header, data = read_header(file)
        entry = header[first_tensor(file)]
        if key == "data_offsets":
            entry[key] = [entry[key][0] + 4, entry[key][1] + 4]
        elif key == "dtype":
            entry[key] = "F16"
        else:
            entry[key] = [entry[key][0] + 1] + entry[key][1:]
        write_header(file, header, data)
        return file, "the header lies about"
    return damage


def rewrite_tensor(change: str) -> Callable[[Path], tuple[Path, str]]:
    """A well-formed shard whose tensor is gone, has another shape or is no float."""
    def damage(folder: Path) -> tuple[Path, str]:
        file = folder / SHARD
        tensors = load_file(str(file))
        name = sorted(tensors)[0]
        if change == "missing":
            del tensors[name]
            index = json.loads((folder / INDEX_FILE).read_text())
            del index["weight_map"][name]
            (folder / INDEX_FILE).write_text(json.dumps(index))
            expected = f"missing: {name}"
        elif change == "shape":
            tensors[name] = torch.zeros(3, 3)
            expected = f"mis-shaped: {name}"
        else:
            tensors[name] = tensors[name].view(torch.int32)
            expected = f"not a float: {name}: I32"
        save_file(tensors, str(file))
        return folder, expected
    return damage


def truncated(folder: Path) -> tuple[Path, str]:
    file = folder / SHARD
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])
    return file, "truncated"


def garbage(folder: Path) -> tuple[Path, str]:
    file = folder / SHARD
    generator = random.Random(draw_seed("garbage bytes"))
    file.write_bytes(bytes(generator.randrange(256) for _ in range(file.stat().st_size)))
    return file, "not a safetensors file"


def garbage_header(folder: Path) -> tuple[Path, str]:
    file = folder / SHARD
    raw = bytearray(file.read_bytes())
    raw[8:24] = b"\x00\xff" * 8
    file.write_bytes(bytes(raw))
    return file, "its header is not JSON"


def missing_shard(folder: Path) -> tuple[Path, str]:
    (folder / SHARD).unlink()
    return folder / INDEX_FILE, f"names {SHARD}"


def index_text(text: str, expected: str) -> Callable[[Path], tuple[Path, str]]:
    def damage(folder: Path) -> tuple[Path, str]:
        (folder / INDEX_FILE).write_text(text)
        return folder / INDEX_FILE, expected
    return damage


def wrong_shard(folder: Path) -> tuple[Path, str]:
    index = json.loads((folder / INDEX_FILE).read_text())
    name = first_tensor(folder / SHARD)
    index["weight_map"][name] = OTHER
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder / INDEX_FILE, f"puts {name} in {OTHER}, but it is in {SHARD}"


def config_text(text: str, expected: str) -> Callable[[Path], tuple[Path, str]]:
    def damage(folder: Path) -> tuple[Path, str]:
        (folder / "config.json").write_text(text)
        return folder / "config.json", expected
    return damage


def config_without(key: str) -> Callable[[Path], tuple[Path, str]]:
    def damage(folder: Path) -> tuple[Path, str]:
        config = json.loads((folder / "config.json").read_text())
        del config[key]
        (folder / "config.json").write_text(json.dumps(config))
        return folder / "config.json", f"KeyError: '{key}'"
    return damage


DAMAGES = {
    "truncated shard": truncated,
    "garbage shard": garbage,
    "garbage header": garbage_header,
    "header lies about offsets": header_lie("data_offsets"),
    "header lies about dtype": header_lie("dtype"),
    "header lies about shape": header_lie("shape"),
    "missing shard": missing_shard,
    "index not JSON": index_text('{"weight_map": {', "not JSON"),
    "index without weight_map": index_text('{"metadata": {}}', "no weight_map"),
    "index names the wrong shard": wrong_shard,
    "missing tensor": rewrite_tensor("missing"),
    "tensor of the wrong shape": rewrite_tensor("shape"),
    "tensor of the wrong dtype": rewrite_tensor("dtype"),
    "config.json not JSON": config_text('{"hidden_size": ', "not a DeepSeek-V3 config"),
    "config.json a list": config_text("[1, 2]", "a JSON list, not an object"),
    "config.json without a key": config_without("hidden_size"),
}


def damaged_copy(hf_folder: Path, tmp_path: Path, damage: str) -> tuple[Path, Path, str]:
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    named, expected = DAMAGES[damage](folder)
    return folder, named, expected


def assert_one_line(status: int, text: str, named: Path, expected: str) -> None:
    lines = text.strip().splitlines()
    assert status == 2 and len(lines) == 1, text
    assert str(named) in lines[0] and expected in lines[0], lines[0]


def test_the_intact_folder_imports(hf_folder, tmp_path):
    assert hf_cli(["import", str(hf_folder), str(tmp_path / "native")]) == 0


@pytest.mark.parametrize("damage", DAMAGES)
def test_import_names_the_damaged_file(hf_folder, tmp_path, capsys, damage):
    folder, named, expected = damaged_copy(hf_folder, tmp_path, damage)
    capsys.readouterr()  # the seed a damage drew
    status = hf_cli(["import", str(folder), str(tmp_path / "native")])
    assert_one_line(status, capsys.readouterr().out, named, expected)
    assert not (tmp_path / "native").exists()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The demo corpus, built before the runs so that its progress bar is not in their output."""
    path = tmp_path_factory.mktemp("corpus")
    build_demo_corpus(str(path), ByteTokenizer(), max_bytes=100_000)
    return path


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_names_the_damaged_file(hf_folder, cache_dir, tmp_path, capsys, damage):
    folder, named, expected = damaged_copy(hf_folder, tmp_path, damage)
    capsys.readouterr()  # the seed a damage drew
    status = train_main(["--config", str(TINY), "--set", f"checkpoint.resume={folder}", "--set",
                         "checkpoint.weights_only=true", "--set", f"logging.dir={tmp_path / 'run'}", "--set",
                         f"data.cache_dir={cache_dir}", "--set", "data.demo_max_bytes=100000", "--set",
                         "logging.tensorboard=false"])
    assert_one_line(status, capsys.readouterr().err, named, expected)


def test_export_and_generate_refuse_a_damaged_folder_in_one_line(hf_folder, tmp_path, capsys):
    """Neither reads an HF folder (export's input is a training checkpoint or a weight folder, generation's a
    training checkpoint); given one, damaged or not, each says so in one line."""
    folder, _, _ = damaged_copy(hf_folder, tmp_path, "truncated shard")
    capsys.readouterr()
    assert hf_cli(["export", str(folder), str(tmp_path / "out")]) == 2
    assert_one_line(2, capsys.readouterr().out, folder, "not a training checkpoint")
    status = generate_main(["--config", str(TINY), "--checkpoint", str(folder), "--prompt", "hi"])
    assert_one_line(status, capsys.readouterr().err, folder, "neither a checkpoint folder")
