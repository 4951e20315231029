"""Native weight folders (`model_args.json` + safetensors with our tensor names), written atomically."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.args import ModelArgs
from model.transformer import DeepSeekV3

ARGS_FILE = "model_args.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_tensors(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_shard_bytes` each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def staging_dir(path: Path) -> Path:
    """A fresh hidden sibling of `path` to write a folder into before `publish_dir` renames it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, path: Path) -> None:
    """Flush every file of `tmp`, then rename it to `path` (replacing an older one): a crash never
    leaves a half-written folder under the final name."""
    for file in tmp.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(tmp)
    old = path.parent / f".{path.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_safetensors_dir(tensors: dict[str, torch.Tensor], path: Path, text_files: dict[str, str],
                         max_shard_bytes: int = 5 * 2**30) -> None:
    """Write tensors (sharded, with an index when more than one shard) and text files to `path`, atomically."""
    path = Path(path)
    tmp = staging_dir(path)
    shards = shard_tensors(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        text_files = {**text_files, "model.safetensors.index.json": json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)}
    for name, text in text_files.items():
        (tmp / name).write_text(text)
    publish_dir(tmp, path)


def save_weights(model: DeepSeekV3, path: str | Path) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_safetensors_dir(state, Path(path), {ARGS_FILE: json.dumps(dataclasses.asdict(model.args), indent=2)})


def load_weights(path: str | Path) -> DeepSeekV3:
    """A full model from a native weight folder; missing or mis-shaped tensors are all listed."""
    path = Path(path)
    args_file = path / ARGS_FILE
    if not args_file.is_file():
        raise FileNotFoundError(f"{args_file}: not found (not a native weight folder)")
    model = DeepSeekV3(ModelArgs(**json.loads(args_file.read_text())))
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            state.update({key: handle.get_tensor(key) for key in handle.keys()})
    load_state_dict_checked(model, state, str(path))
    return model


def load_state_dict_checked(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """`load_state_dict` that reports every missing, unexpected and mis-shaped tensor at once."""
    expected = model.state_dict()
    problems = [f"missing: {k}" for k in expected if k not in state]
    problems += [f"unexpected: {k}" for k in state if k not in expected]
    problems += [f"mis-shaped: {k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                 for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if problems:
        raise ValueError(f"{source} does not match the model:\n  " + "\n  ".join(problems))
    model.load_state_dict(state)
