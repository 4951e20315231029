"""bf16 against fp32 AdamW moments: the loss curves of one run (same seed, data and initialisation)
trained with `optim.moment_dtype=bf16` and with `fp32`, and how far apart they are.

    python -m benchmarks.bf16_moments_curves [--config moe_train/configs/demo.yaml] [--steps 100]
"""
from __future__ import annotations

from benchmarks.bf16_loss_curves import loss_curve, print_curves
from benchmarks.training_options import training_parser
from moe_train.config import load_config

MOMENT_DTYPES = ("fp32", "bf16")


def moment_curves(config_path: str, steps: int, overrides: list[str]) -> dict[str, list[float]]:
    """The loss curve of each moment dtype, in the config's `train.precision`."""
    precision = load_config(config_path, overrides).train.precision
    return {dtype: loss_curve(config_path, precision, steps, [*overrides, f"optim.moment_dtype={dtype}"])
            for dtype in MOMENT_DTYPES}


def main() -> None:
    opts = training_parser(__doc__.splitlines()[0], steps=100).parse_args()
    curves = moment_curves(opts.config, opts.steps, opts.overrides)
    config = load_config(opts.config, opts.overrides)
    print(f"config {opts.config}, {opts.steps} steps, seed {config.train.seed}, precision {config.train.precision}")
    print_curves(curves, " moments")

if __name__ == "__main__":
    main()
