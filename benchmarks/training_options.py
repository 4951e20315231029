"""The command line shared by the benchmarks that train a config: which config, how many steps and
`--set SECTION.KEY=VALUE` overrides."""
from __future__ import annotations

import argparse

DEMO_CONFIG = "moe_train/configs/demo.yaml"


def training_parser(description: str, steps: int, steps_flag: str = "--steps") -> argparse.ArgumentParser:
    """A parser with `--config` (default the demo), `steps_flag` (default `steps`) and `--set`, into
    `overrides`; the benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=DEMO_CONFIG)
    parser.add_argument(steps_flag, type=int, default=steps)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser
