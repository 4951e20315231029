"""Step-time stall of a checkpoint save, synchronous vs `checkpoint.async_save`, in one run.

A trainer on the tiny config widened to about 58 M parameters (mostly routed experts, so a step stays
short while a checkpoint is about 0.65 GiB: weights and both Adam moments, fp32) saves synchronously and
in the background alternately (its `background_saves` set or not), so that drifting step times on a shared
machine reach both.
The stall of a save is the time of the steps from the one that saves until the save is published, the
save call included, minus as many steps without a save (the median of steps without one): for a
synchronous save the write itself; for a background save the host copy, the small files and what the
writing thread takes from training (on this machine it shares the CPU cores with it).

    python -m benchmarks.async_checkpoint [--experts 16] [--layers 4] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moe_train.checkpoint.dcp import BackgroundSaves
from moe_train.config import load_config
from moe_train.train import Trainer, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def timed_step(trainer: Trainer) -> float:
    start = time.perf_counter()
    read_metrics([trainer.train_step()])
    return time.perf_counter() - start


def save_stall(trainer: Trainer, saves: BackgroundSaves | None) -> tuple[float, int]:
    """(seconds of stall, steps until published) of one save made after a step, in the background with `saves`."""
    trainer.background_saves = saves
    baseline = statistics.median(timed_step(trainer) for _ in range(3))
    start = time.perf_counter()
    read_metrics([trainer.train_step()])
    trainer.save()
    steps = 1
    if saves is not None:
        while saves.poll() is None:  # as the training loop does at each step boundary
            read_metrics([trainer.train_step()])
            steps += 1
    return time.perf_counter() - start - steps * baseline, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(ROOT / "moe_train/configs/tiny.yaml", [
            f"logging.dir={tmp}", "logging.tensorboard=false", "checkpoint.resume=none",
            f"model.num_layers={args.layers}", "model.hidden_size=512", "model.ffn_hidden_size=1024",
            f"model.num_moe_experts={args.experts}", "model.moe_ffn_hidden_size=512",
            "model.moe_shared_expert_intermediate_size=512", "model.num_attention_heads=8", "model.q_lora_rank=128",
            "model.kv_lora_rank=64", "model.qk_head_dim=32", "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32",
            "train.global_batch_size=4", "train.micro_batch_size=4", "train.steps=1000", "train.threads=2",
            "data.demo_max_bytes=400000", "checkpoint.async_save=true", "checkpoint.keep=1"])
        trainer = Trainer(config)
        saves = trainer.background_saves
        parameters = sum(p.numel() for p in trainer.model.parameters())
        trainer.save(wait=True)  # first-save costs (folders, DCP planning) left out
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.repeats):  # alternately, so that drifting step times reach both
            stalls["sync"].append(save_stall(trainer, None)[0])
            stall, steps = save_stall(trainer, saves)
            stalls["async"].append(stall)
            print(f"sync {stalls['sync'][-1]:.2f} s, async {stall:.2f} s (published after {steps} steps)", flush=True)
        saves.close()
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*.distcp"))
    print(f"{parameters / 1e6:.0f} M parameters, checkpoint {size / 2**30:.2f} GiB")
    print(f"save stall, median of {args.repeats}: sync {statistics.median(stalls['sync']):.2f} s, "
          f"async {statistics.median(stalls['async']):.2f} s")
    print(f"async / sync stall: {statistics.median(stalls['async']) / statistics.median(stalls['sync']):.2f}")


if __name__ == "__main__":
    main()
