"""Export to a complete Hugging Face folder: weights in DeepSeek-V3's layout (MTP as layers num_layers + k),
config.json with the tokenizer's EOD as BOS/EOS, tokenizer files and generation_config.json.

The source is a training checkpoint (a checkpoint root: its latest iteration; or an `iter_*` folder)
or a native weight folder (`model.weights`). From a training checkpoint every rank of the job reads
only its share of the tensors (round robin over the checkpoint's tensor names) and writes it, so no
process holds the whole model; on one process that share is everything. With `ema` the parameters
are the checkpoint's EMA (`moe_train.ema`) and the buffers (router correction biases) the saved ones.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from model.args import ModelArgs
from model.hf_layout import hf_config_from_args, hf_items
from model.weights import ARGS_FILE, load_weights
from moe_train.checkpoint.dcp import (LATEST_FILE, METADATA_FILE, CheckpointError, NamingReader, holds_ema,
                                      on_all_ranks, quiet_dcp, read_metadata, resolve_resume)
from moe_train.config import load_config
from moe_train.checkpoint.hf_checkpoint import hf_file_layout, write_hf_folder
from moe_train.checkpoint.hf_tokenizer import tokenizer_files
from parallel.sharded_state import model_state

MAX_SHARD_BYTES = 5 * 2**30


def export(src: Path, hf_dir: Path, dtype: torch.dtype | None = None, tokenizer: str | None = None,
           process_group: dist.ProcessGroup | None = None, ema: bool = False) -> None:
    """Export `src` to `hf_dir` (with `ema`: the EMA of the parameters); every rank calls it. `tokenizer`
    defaults to the checkpoint's data.tokenizer ("byte" for a native weight folder)."""
    if (src / ARGS_FILE).is_file():
        if ema:
            raise CheckpointError(f"{src}: a native weight folder holds no EMA; --ema needs a training checkpoint")
        model = load_weights(src)
        state = model_state(model)
        write_export(state, meta_copy(state), model.args, hf_dir, dtype, tokenizer or "byte", process_group)
        return
    if not any((src / name).is_file() for name in (METADATA_FILE, LATEST_FILE)):
        raise CheckpointError(f"{src}: not a training checkpoint (no {METADATA_FILE} or {LATEST_FILE}) nor a "
                              f"native weight folder (no {ARGS_FILE})")
    folder = resolve_resume(str(src), src)
    config = load_config(folder / "config.yaml", [])
    mine, full = rank_share(folder, process_group, ema)
    write_export(mine, full, config.model, hf_dir, dtype, tokenizer or config.data.tokenizer, process_group)


def rank_share(folder: Path, process_group: dist.ProcessGroup | None,
               ema: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's model tensors of a training checkpoint, read from it (with `ema`: each parameter's EMA
    in place of its value), and all of them on the meta device."""
    metadata = read_metadata(folder)
    if ema and not holds_ema(metadata):
        raise CheckpointError(f"{folder} holds no EMA (trained without optim.ema_decay); export it without --ema")
    saved = {name: item for name, item in metadata.state_dict_metadata.items()
             if isinstance(item, TensorStorageMetadata)}
    names = sorted(name.removeprefix("model.") for name in saved if name.startswith("model."))
    prefix = {n: "ema" if ema and f"ema.{n}" in saved else "model" for n in names}
    item = {n: saved[f"{prefix[n]}.{n}"] for n in names}
    rank, world = 0, 1
    if dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    mine = {n: torch.empty(item[n].size, dtype=item[n].properties.dtype) for n in names[rank::world]}
    request: dict[str, dict[str, torch.Tensor]] = {}
    for n, tensor in mine.items():
        request.setdefault(prefix[n], {})[n] = tensor
    on_all_ranks(lambda: quiet_dcp(dcp.load, request, storage_reader=NamingReader(folder),
                                   process_group=process_group), process_group, f"reading {folder}")
    full = {n: torch.empty(item[n].size, dtype=item[n].properties.dtype, device="meta") for n in names}
    return mine, full


def meta_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.empty_like(t, device="meta") for name, t in state.items()}


def write_export(state: dict[str, torch.Tensor], full: dict[str, torch.Tensor], args: ModelArgs, path: Path,
                 dtype: torch.dtype | None, tokenizer: str, process_group: dist.ProcessGroup | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write this rank's `state` (keyed as `model_state`) into the HF folder of the model whose tensors
    are `full` (the meta device will do)."""
    files, eod = tokenizer_files(tokenizer, args.vocab_size, args.max_position_embeddings)
    dtype = dtype or next(iter(full.values())).dtype
    items = {name: t.to(dtype) for name, t in hf_items(state, args, mtp_copies=True).items()}
    layout = hf_file_layout({n: t.to(dtype) for n, t in hf_items(full, args, mtp_copies=True).items()},
                            max_shard_bytes)
    config = json.dumps(hf_config_from_args(args, dtype, eod), indent=2)
    write_hf_folder(items, layout, path, {"config.json": config, **files}, process_group)
