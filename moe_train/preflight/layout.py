"""The config against a process layout: parallel.topology's rules and the batch split over dp."""
from __future__ import annotations

from moe_train.config import Config
from parallel.topology import layout_problems


def batch_problems(config: Config, world: int) -> list[tuple[str, str]]:
    """The global batch, and the batch ramp's start and increment (so every step of the ramp), against
    micro-batches over dp = `world` / pp."""
    p, t = config.parallel, config.train
    dp = world // p.pp
    split = f"train.micro_batch_size={t.micro_batch_size} x dp={dp} ({world} processes / pp {p.pp})"
    if t.global_batch_size % (t.micro_batch_size * dp):
        return [("train.global_batch_size", f"{t.global_batch_size} is not a multiple of {split}")]
    if t.rampup_batch_size is not None:
        start, increment, _ = t.rampup_batch_size
        for name, value in (("start", start), ("increment", increment)):
            if value % (t.micro_batch_size * dp):
                return [("train.rampup_batch_size", f"{name} {value} is not a multiple of {split}: every step's "
                                                    "batch must split into whole micro-batches on every rank")]
    return []


def layout_errors(config: Config, nodes: int, nproc: int) -> list[tuple[str, str]]:
    """Problems of running `config` on nodes x nproc processes (gpus_per_node defaults to nproc)."""
    p = config.parallel
    world = nodes * nproc
    return (layout_problems(world, p.pp, p.ep, p.gpus_per_node or nproc, config.model.num_moe_experts)
            or batch_problems(config, world))
