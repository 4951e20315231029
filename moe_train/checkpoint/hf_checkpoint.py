"""Hugging Face DeepSeek-V3 folders read and written through torch.distributed.checkpoint's HF storage.

Reading: every rank asks DCP's `HuggingFaceStorageReader` for the HF names of the tensors it holds
(its pipeline stages, its experts), as views of its live tensors, so each rank reads only those
from the safetensors files; FP8 block-scaled weights (`weight_scale_inv`) go through
`QuantizedHuggingFaceStorageReader`, which dequantizes block by block while reading.
Writing: `HuggingFaceStorageWriter`; under several processes each rank writes its shard files and
every rank then consolidates some of the final files (`consolidate_safetensors_files_on_every_rank`).
The folder is written under a hidden name and renamed into place when complete.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (HuggingFaceStorageReader, HuggingFaceStorageWriter,
                                          QuantizedHuggingFaceStorageReader)
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.checkpoint.metadata import Metadata

from model.args import ModelArgs
from model.hf_layout import HFCheckpointError, args_from_hf_config, hf_config_from_args, hf_items
from model.transformer import DeepSeekV3
from model.weights import publish_dir, shard_tensors, staging_dir
from moe_train.checkpoint.dcp import HF_CONFIG_FILE, CheckpointError, on_all_ranks, quiet_dcp
from parallel.mixed_precision import checkpoint_values, set_parameters
from parallel.sharded_state import model_state

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` holds the block scales of FP8 `<name>.weight`
SHARDED = "sharded"  # where the ranks' files go before consolidation


class _QuantizedReader(QuantizedHuggingFaceStorageReader):
    """torch's reader, also for a folder without `model.safetensors.index.json` (one file): the weight
    map it needs is then taken from the files' headers."""

    def _load_quantization_metadata(self) -> None:
        if (Path(self.path) / "model.safetensors.index.json").is_file():
            super()._load_quantization_metadata()
            return
        metadata = HuggingFaceStorageReader(self.path).read_metadata()
        self._build_weight_scale_mapping({index.fqn: Path(info.relative_path).name
                                          for index, info in metadata.storage_data.items()})


def read_hf_args(path: Path) -> ModelArgs:
    """ModelArgs of an HF folder: its config.json, with `mtp_num_layers` the MTP layers its weights hold
    (transformers saves none)."""
    config_file = path / HF_CONFIG_FILE
    try:
        args = args_from_hf_config(json.loads(config_file.read_text()))
    except FileNotFoundError as err:
        raise HFCheckpointError(f"{config_file}: not found") from err
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFCheckpointError(f"{config_file}: not a DeepSeek-V3 config ({type(err).__name__}: {err})") from err
    problems = args.validate()
    if problems:
        raise HFCheckpointError(f"{config_file}: " + "; ".join(f"{k}: {m}" for k, m in problems))
    names = _read_metadata(path).state_dict_metadata
    present = 0
    while present < args.mtp_num_layers and f"model.layers.{args.num_layers + present}.eh_proj.weight" in names:
        present += 1
    return dataclasses.replace(args, mtp_num_layers=present)


def config_mismatches(ours: ModelArgs, hf: ModelArgs) -> list[tuple[str, object, object]]:
    """(key, ours, HF) for every model key the HF config determines and `ours` sets differently.

    What the HF format expresses is found by a round trip through it, so keys it cannot hold
    (loss coefficients, bias update rate, ...) never differ."""
    projected = args_from_hf_config(hf_config_from_args(ours))
    projected = dataclasses.replace(projected, mtp_num_layers=ours.mtp_num_layers)
    return [(f.name, getattr(ours, f.name), getattr(hf, f.name)) for f in dataclasses.fields(ModelArgs)
            if getattr(projected, f.name) != getattr(hf, f.name)]


def check_model_section(ours: ModelArgs, path: Path) -> None:
    """CheckpointError (one line) naming every model key that differs from the HF folder's config."""
    try:
        hf = read_hf_args(path)
    except HFCheckpointError as err:
        raise CheckpointError(f"checkpoint.resume: {err}") from err
    differ = config_mismatches(ours, hf)
    if differ:
        keys = ", ".join(f"model.{k}: config {a!r}, HF {b!r}" for k, a, b in differ)
        adopt = " ".join(f"--set model.{k}={b}" for k, _, b in differ)
        raise CheckpointError(f"checkpoint.resume: the model section does not match {path / HF_CONFIG_FILE} "
                              f"({keys}); to adopt the HF config: {adopt}")


def load_hf_weights(path: Path, model: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Fill `model` (a DeepSeekV3, whole or built for pipeline stages, possibly expert-sharded) from an HF folder in
    place; each rank reads only its tensors. Missing, mis-shaped and unknown tensors are all listed
    (CheckpointError) before any tensor is overwritten."""
    values = checkpoint_values(model, loading=True)  # a bf16 model's parameters are filled in fp32
    wanted = hf_items(model_state(model, values), model.args, mtp_copies=False)
    what = f"loading {path}"
    reader = on_all_ranks(lambda: _checked_reader(path, wanted, model.args), process_group, what)
    on_all_ranks(lambda: quiet_dcp(dcp.load, wanted, storage_reader=reader, process_group=process_group),
                 process_group, what)
    set_parameters(model, values)


def _read_metadata(path: Path) -> Metadata:
    if not any(path.glob("*.safetensors")):
        raise HFCheckpointError(f"{path}: no *.safetensors files")
    return HuggingFaceStorageReader(str(path)).read_metadata()


def _checked_reader(path: Path, wanted: dict[str, torch.Tensor], args: ModelArgs) -> HuggingFaceStorageReader:
    saved = {name: list(item.size) for name, item in _read_metadata(path).state_dict_metadata.items()}
    with torch.device("meta"):
        known = set(hf_items(model_state(DeepSeekV3(args)), args, mtp_copies=True))
    known |= {name + SCALE_SUFFIX for name in known if name.endswith(".weight")}
    problems = [f"missing: {name}" for name in wanted if name not in saved]
    problems += [f"mis-shaped: {name}: checkpoint {tuple(saved[name])} vs model {tuple(t.shape)}"
                 for name, t in wanted.items() if name in saved and saved[name] != list(t.shape)]
    problems += [f"unexpected: {name}" for name in sorted(saved) if name not in known]
    if problems:
        raise CheckpointError(f"{path}: HF checkpoint does not match the model:\n  " + "\n  ".join(problems))
    if any(name.endswith(SCALE_SUFFIX) for name in saved):
        return _QuantizedReader(str(path))
    return HuggingFaceStorageReader(str(path))


def hf_file_layout(items: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, int]:
    """HF name -> index (from 1) of the safetensors file it goes to; `items` may be on the meta device."""
    return {name: i for i, shard in enumerate(shard_tensors(items, max_shard_bytes), start=1) for name in shard}


def write_hf_folder(items: dict[str, torch.Tensor], layout: dict[str, int], path: Path, text_files: dict[str, str],
                    process_group: dist.ProcessGroup | None = None) -> None:
    """Write this rank's `items` (HF names) into the files `layout` assigns them, plus `text_files`;
    every rank calls it. The folder appears under `path` only when complete."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    coordinator = not distributed or dist.get_rank(process_group) == 0
    what = f"writing {path}"
    tmp = on_all_ranks(lambda: staging_dir(path) if coordinator else None, process_group, what)
    if distributed:
        holder = [tmp]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(process_group or dist.group.WORLD, 0),
                                   group=process_group)
        tmp = holder[0]
    files = tmp / SHARDED if distributed else tmp
    writer = HuggingFaceStorageWriter(str(files), fqn_to_index_mapping=layout, save_distributed=distributed)
    on_all_ranks(lambda: quiet_dcp(dcp.save, items, storage_writer=writer, process_group=process_group),
                 process_group, what)
    if distributed:
        on_all_ranks(lambda: consolidate_safetensors_files_on_every_rank(str(files), str(tmp), layout,
                                                                         process_group=process_group),
                     process_group, what)

    def finish() -> None:
        if not coordinator:
            return
        shutil.rmtree(tmp / SHARDED, ignore_errors=True)
        for name, text in text_files.items():
            (tmp / name).write_text(text)
        publish_dir(tmp, path)

    on_all_ranks(finish, process_group, what)
