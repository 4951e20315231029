"""Validate a config for the launcher and print the processes per node to start.

`python -m moe_train.preflight.launch_info --config FILE [--set k=v ...] [--nodes N] [--nproc-per-node P] [--log-dir]`
checks the config, the process layout for N nodes x P processes (P defaults to
parallel.nproc_per_node, else 1), the pipeline schedule and stage cut the trainer would build, and
what this machine refuses (device, dispatcher, wandb, memory for P processes: the trainer's own
`refuse_at_start_up`), before anything starts; exit 2 with the problems listed, once.
With --log-dir a second line gives the resolved logging.dir (the launcher's per-job logs go below it).
"""
from __future__ import annotations

import argparse
import sys

from moe_train.config import Config, ConfigError, load_config
from moe_train.preflight.layout import layout_errors


def pipeline_errors(config: Config, nodes: int, nproc: int) -> list[tuple[str, str]]:
    """With pp > 1: the problems of the schedules (every step's, under a batch ramp) and stage cut the
    trainer would build on this layout."""
    from moe_train.preflight.pipeline import check_pipeline  # (torch and the model: only when there is a pipeline)

    if config.parallel.pp == 1:
        return []
    try:
        check_pipeline(config, nodes * nproc // config.parallel.pp)
    except ConfigError as err:
        return err.problems
    return []


def machine_errors(config: Config, nodes: int, nproc: int) -> list[tuple[str, str]]:
    """What this machine refuses of `config` run as rank 0 of nodes x nproc processes (the nodes of a
    job are alike): the trainer's start-up refusals, checked with the layout but no process group."""
    from moe_train.preflight.start_up import refuse_at_start_up  # (torch: only when there is a layout to check)
    from parallel.topology import Topology

    p = config.parallel
    topology = Topology(rank=0, world_size=nodes * nproc, pp=p.pp, ep=p.ep, gpus_per_node=p.gpus_per_node or nproc)
    try:
        refuse_at_start_up(config, topology, nproc)
    except ConfigError as err:
        return err.problems
    return []


def positive_count(name: str, text: str) -> int:
    """`text` as a count >= 1, else a ConfigError naming `name` (an environment variable of the launcher)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError([(name, f"must be a whole number >= 1, got {text!r}")])
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.preflight.launch_info", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nodes", default="1")
    parser.add_argument("--nproc-per-node", default=None)
    parser.add_argument("--log-dir", action="store_true", help="also print logging.dir on a second line")
    args, unknown = parser.parse_known_args(argv)
    try:
        if unknown:
            raise ConfigError([("arguments", f"unknown {' '.join(map(repr, unknown))}: the launcher takes [CONFIG] "
                                             "[--set section.key=value ...] [--print-config] [--help]")])
        nodes = positive_count("the node count (SLURM_NNODES)", args.nodes)
        explicit = None if args.nproc_per_node is None else positive_count("NPROC_PER_NODE", args.nproc_per_node)
        config = load_config(args.config, args.overrides)
        nproc = explicit or config.parallel.nproc_per_node or 1
        if nproc * nodes > 1 or config.parallel.ep > 1 or config.parallel.pp > 1:
            problems = (layout_errors(config, nodes, nproc) or pipeline_errors(config, nodes, nproc)
                        or machine_errors(config, nodes, nproc))
            if problems:
                raise ConfigError(problems, f"{nodes} node(s) x {nproc} process(es)")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(nproc)
    if args.log_dir:
        print(config.logging.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
