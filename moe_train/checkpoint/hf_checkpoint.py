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
import math
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (HuggingFaceStorageReader, HuggingFaceStorageWriter,
                                          QuantizedHuggingFaceStorageReader)
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

from model.args import ModelArgs
from model.hf_layout import HFCheckpointError, args_from_hf_config, hf_config_from_args, hf_items
from model.transformer import DeepSeekV3
from model.weights import publish_dir, shard_tensors, staging_dir
from moe_train.checkpoint.dcp import HF_CONFIG_FILE, CheckpointError, on_all_ranks, quiet_dcp
from parallel.mixed_precision import checkpoint_values, set_parameters
from parallel.sharded_state import model_state

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` holds the block scales of FP8 `<name>.weight`
SHARDED = "sharded"  # where the ranks' files go before consolidation
INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names -> bytes per element; those a weight may have are the floating ones
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
FP8_DTYPES = ("F8_E5M2", "F8_E4M3")  # only with a `_scale_inv` beside them
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
MAX_LISTED = 8  # mismatched tensors named in the one line


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
        config = json.loads(config_file.read_bytes())
        if not isinstance(config, dict):
            raise TypeError(f"a JSON {type(config).__name__}, not an object")
        args = args_from_hf_config(config)
        problems = args.validate()
    except FileNotFoundError as err:
        raise HFCheckpointError(f"{config_file}: not found") from err
    except OSError as err:
        raise HFCheckpointError(f"{config_file}: cannot be read ({err.strerror or err})") from err
    except HFCheckpointError as err:
        raise HFCheckpointError(f"{config_file}: {str(err).removeprefix(HF_CONFIG_FILE + ': ')}") from err
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:  # JSON, UTF-8, types
        raise HFCheckpointError(f"{config_file}: not a DeepSeek-V3 config ({type(err).__name__}: "
                                f"{one_line(err)})") from err
    if problems:
        raise HFCheckpointError(f"{config_file}: " + "; ".join(f"{k}: {m}" for k, m in problems))
    names = hf_tensors(path)
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


def one_line(error: BaseException) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def hf_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """HF name -> (safetensors dtype, shape) of every tensor in the folder's *.safetensors files, after checking
    each file's header against its size and the index (if any) against the files, so that reading them cannot
    fail; HFCheckpointError (one line naming the file) for the first damage found."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{path}: no *.safetensors files")
    tensors: dict[str, tuple[str, list[int]]] = {}
    holder: dict[str, str] = {}
    for file in files:
        try:
            entries = _safetensors_header(file)
        except OSError as err:
            raise HFCheckpointError(f"{file}: cannot be read ({err.strerror or err})") from err
        for name, entry in entries.items():
            if name in holder:
                raise HFCheckpointError(f"{file}: holds {name}, which {path / holder[name]} holds too")
            holder[name] = file.name
            tensors[name] = entry
    if (path / INDEX_FILE).exists():
        _check_index(path / INDEX_FILE, holder)
    return tensors


def _safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of one safetensors file, its header checked the way safetensors checks it on
    opening (the tensors tile the data exactly) plus each size against dtype x shape."""
    size = file.stat().st_size
    with open(file, "rb") as stream:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise HFCheckpointError(f"{file}: truncated or not a safetensors file ({size} bytes)")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(size - 8, MAX_HEADER_BYTES):
            raise HFCheckpointError(f"{file}: truncated or not a safetensors file (its header length, {header_bytes} "
                                    f"bytes, exceeds the {size - 8} bytes after it)")
        raw = stream.read(header_bytes)
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise HFCheckpointError(f"{file}: not a safetensors file (its header is not JSON: {one_line(err)})") from err
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{file}: not a safetensors file (its header is a JSON {type(header).__name__})")
    data_bytes = size - 8 - header_bytes
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise HFCheckpointError(f"{file}: not a safetensors file (its __metadata__ is not text -> text)")
            continue
        dtype, shape, offsets = (info.get(key) for key in ("dtype", "shape", "data_offsets")) \
            if isinstance(info, dict) else (None, None, None)
        if (dtype not in DTYPE_BYTES or not isinstance(shape, list) or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(type(n) is int and n >= 0 for n in shape + offsets)):
            raise HFCheckpointError(f"{file}: the header's entry for {name} is not a safetensors tensor: {info!r}")
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise HFCheckpointError(f"{file}: the header lies about {name}: {dtype} {shape} needs "
                                    f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes, its offsets span {end - begin}")
        entries[name] = (dtype, shape)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise HFCheckpointError(f"{file}: the header lies about {name}: it starts at byte {begin} of the data, "
                                    f"the previous tensor ends at {position}")
        position = end
    if position != data_bytes:
        state = "truncated" if position > data_bytes else "damaged"
        raise HFCheckpointError(f"{file}: {state}: its header describes {position} bytes of tensors, the file holds "
                                f"{data_bytes}")
    return entries


def _check_index(index: Path, holder: dict[str, str]) -> None:
    """The index's weight_map names, for every tensor, the file that holds it, and every tensor of those files."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except ValueError as err:
        raise HFCheckpointError(f"{index}: not JSON ({one_line(err)})") from err
    except (KeyError, TypeError) as err:
        raise HFCheckpointError(f"{index}: no weight_map object") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFCheckpointError(f"{index}: weight_map is not an object of tensor name -> file name")
    for name, file in sorted(weight_map.items()):
        if not (index.parent / file).is_file():
            raise HFCheckpointError(f"{index}: names {file} (for {name}), which is missing")
        if holder.get(name) != file:
            where = f"it is in {holder[name]}" if name in holder else "no file holds it"
            raise HFCheckpointError(f"{index}: puts {name} in {file}, but {where}")
    listed = set(weight_map.values())
    unlisted = sorted(name for name, file in holder.items() if file in listed and name not in weight_map)
    if unlisted:
        raise HFCheckpointError(f"{index}: does not list {unlisted[0]} of {holder[unlisted[0]]}"
                                + (f" (nor {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))


def _checked_reader(path: Path, wanted: dict[str, torch.Tensor], args: ModelArgs) -> HuggingFaceStorageReader:
    saved = hf_tensors(path)
    with torch.device("meta"):
        known = set(hf_items(model_state(DeepSeekV3(args)), args, mtp_copies=True))
    known |= {name + SCALE_SUFFIX for name in known if name.endswith(".weight")}
    problems = [f"missing: {name}" for name in wanted if name not in saved]
    problems += [f"mis-shaped: {name}: checkpoint {tuple(saved[name][1])} vs model {tuple(t.shape)}"
                 for name, t in wanted.items() if name in saved and saved[name][1] != list(t.shape)]
    problems += [f"not a float: {name}: {saved[name][0]}" for name in wanted if name in saved
                 and saved[name][0] not in FLOAT_DTYPES
                 and not (saved[name][0] in FP8_DTYPES and name + SCALE_SUFFIX in saved)]
    problems += [f"unexpected: {name}" for name in sorted(saved) if name not in known]
    if problems:
        shown = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more"
                                                    if len(problems) > MAX_LISTED else "")
        raise CheckpointError(f"{path}: HF checkpoint does not match the model: {shown}")
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
