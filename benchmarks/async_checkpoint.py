"""Step-time stall of a checkpoint save, synchronous vs `checkpoint.async_save`, in one run.

A trainer on the tiny config widened to about 130 M parameters (mostly routed experts, so a step stays
short while a checkpoint is about 1.5 GB: weights and both Adam moments, fp32) trains with each setting.
The stall of a save is the time of the steps from the one that saves until the save is published, the
save call included, minus as many steps without a save (the median of steps without one): for a
synchronous save the write itself; for a background save the host copy, the small files and what the
writing thread takes from training (on this machine it shares the CPU cores with it).

    python -m benchmarks.async_checkpoint [--experts 32] [--layers 6] [--repeats 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moe_train.config import load_config
from moe_train.train import Trainer, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def timed_step(trainer: Trainer) -> float:
    start = time.perf_counter()
    read_metrics([trainer.train_step()])
    return time.perf_counter() - start


def save_stall(trainer: Trainer) -> tuple[float, int]:
    """(seconds of stall, steps until published) of one save made after a step."""
    baseline = statistics.median(timed_step(trainer) for _ in range(5))
    start = time.perf_counter()
    read_metrics([trainer.train_step()])
    trainer.save()
    steps = 1
    if trainer.background_saves is not None:
        while trainer.background_saves.poll() is None:  # as the training loop does at each step boundary
            read_metrics([trainer.train_step()])
            steps += 1
    return time.perf_counter() - start - steps * baseline, steps


def measure(async_save: bool, args: argparse.Namespace, folder: Path) -> tuple[list[float], int, float]:
    config = load_config(ROOT / "moe_train/configs/tiny.yaml", [
        f"logging.dir={folder / str(async_save)}", "logging.tensorboard=false", "checkpoint.resume=none",
        f"model.num_layers={args.layers}", "model.hidden_size=512", "model.ffn_hidden_size=1024",
        f"model.num_moe_experts={args.experts}", "model.moe_ffn_hidden_size=512",
        "model.moe_shared_expert_intermediate_size=512", "model.num_attention_heads=8", "model.q_lora_rank=128",
        "model.kv_lora_rank=64", "model.qk_head_dim=32", "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32",
        "train.global_batch_size=4", "train.micro_batch_size=4", "train.steps=1000", "train.threads=2",
        "data.demo_max_bytes=400000", f"checkpoint.async_save={str(async_save).lower()}", "checkpoint.keep=1"])
    start = time.perf_counter()
    trainer = Trainer(config)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    print(f"async_save={async_save}: {parameters / 1e6:.0f} M parameters, built in {time.perf_counter() - start:.1f} s; "
          f"first steps {', '.join(f'{timed_step(trainer):.2f} s' for _ in range(2))}", flush=True)
    trainer.save(wait=True)  # first-save costs (folders, DCP planning) left out
    stalls, steps = [], 0
    for _ in range(args.repeats):
        stall, steps = save_stall(trainer)
        stalls.append(stall)
    if trainer.background_saves is not None:
        trainer.background_saves.close()
    return stalls, steps, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync, _, parameters = measure(False, args, Path(tmp))
        background, steps, _ = measure(True, args, Path(tmp))
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*.distcp")) / 2
    print(f"{parameters / 1e6:.0f} M parameters, checkpoint {size / 2**30:.2f} GiB")
    print(f"sync save stall:  {', '.join(f'{s:.2f} s' for s in sync)}")
    print(f"async save stall: {', '.join(f'{s:.2f} s' for s in background)} (published after {steps} steps)")
    print(f"async / sync stall: {statistics.median(background) / statistics.median(sync):.2f}")


if __name__ == "__main__":
    main()
