"""Validate a config for the launcher and print its processes per node (parallel.nproc_per_node).

`python -m moe_train.launch_info --config FILE [--set k=v ...]`; exit 2 with the problems listed.
"""
from __future__ import annotations

import sys

from moe_train.config import ConfigError, load_config
from moe_train.train import parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(config.parallel.nproc_per_node or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
