"""Hugging Face DeepSeek-V3 interop on the command line, and for a model in memory.

`python -m moe_train.checkpoint.hf import HF_DIR OUT_DIR`: an HF folder (config.json + safetensors,
FP8 block-scaled weights dequantized) -> a native weight folder (`model.weights`).
`python -m moe_train.checkpoint.hf export SRC HF_DIR`: a training checkpoint (root or `iter_*`
folder) or a native weight folder -> a complete HF folder (`moe_train.checkpoint.hf_export`;
`--ema`: the checkpoint's EMA of the parameters); under torchrun every rank reads and writes its
share. The layout is in `model.hf_layout`; reading and writing go through
torch.distributed.checkpoint (`moe_train.checkpoint.hf_checkpoint`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from model.hf_layout import HFCheckpointError
from model.transformer import DeepSeekV3
from model.weights import save_weights
from moe_train.checkpoint.dcp import CheckpointError
from moe_train.config import ConfigError
from moe_train.data import DataError
from moe_train.checkpoint.hf_checkpoint import load_hf_weights, read_hf_args
from moe_train.checkpoint.hf_export import MAX_SHARD_BYTES, export, meta_copy, write_export
from parallel.sharded_state import model_state

__all__ = ["HFCheckpointError", "load_hf_checkpoint", "save_hf_checkpoint", "main"]


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> DeepSeekV3:
    """Our model from an HF DeepSeek-V3 folder, with the MTP layers its weights hold."""
    path = Path(path)
    model = DeepSeekV3(read_hf_args(path))
    load_hf_weights(path, model)
    return model.to(dtype) if dtype != torch.float32 else model


def save_hf_checkpoint(model: DeepSeekV3, path: str | Path, dtype: torch.dtype | None = None,
                       tokenizer: str = "byte", max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """A complete HF folder of `model` (one process), written atomically."""
    state = {name: t.detach().cpu() for name, t in model_state(model).items()}
    write_export(state, meta_copy(state), model.args, Path(path), dtype, tokenizer, max_shard_bytes=max_shard_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.checkpoint.hf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF DeepSeek-V3 folder -> native weight folder")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    exp = sub.add_parser("export", help="training checkpoint or native weight folder -> HF DeepSeek-V3 folder")
    exp.add_argument("src", help="a checkpoint root (its latest iteration), an iter_* folder or a native weight folder")
    exp.add_argument("hf_dir")
    exp.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    exp.add_argument("--tokenizer", default=None, help='"byte" or a tokenizer.json (default: the checkpoint\'s '
                                                       'data.tokenizer; byte for a weight folder)')
    exp.add_argument("--ema", action="store_true", help="write the checkpoint's EMA of the parameters "
                                                        "(optim.ema_decay) instead of their values")
    opts = parser.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if distributed:
        dist.init_process_group("gloo")
    try:
        if opts.command == "import":
            save_weights(load_hf_checkpoint(opts.hf_dir), opts.out_dir)
            print(f"imported {opts.hf_dir} -> {opts.out_dir}")
        else:
            dtype = getattr(torch, opts.dtype) if opts.dtype else None
            export(Path(opts.src), Path(opts.hf_dir), dtype, opts.tokenizer, ema=opts.ema)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"exported {opts.src} -> {opts.hf_dir}")
    except (HFCheckpointError, CheckpointError, ConfigError, DataError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}")
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
