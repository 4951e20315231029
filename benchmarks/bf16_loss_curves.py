"""bf16 against fp32 training: the loss curves of one run (same seed, data and initialisation)
trained with `train.precision=bf16` and with `fp32`, and how far apart they are.

    python -m benchmarks.bf16_loss_curves [--config moe_train/configs/demo.yaml] [--steps 100] [--nudge]
                                          [--seeds S ...]

`--nudge` also trains bf16 with one weight element moved by one bf16 ulp before the first step
(`nudge_one_weight`) and prints how far that curve is from the bf16 one: what one rounding alone does
along a trajectory, the noise floor of any comparison of two loss curves step by step. `--seeds`
compares the two precisions once per `train.seed` (initialisation and data order) and then over all:
a step-by-step max is set by the one step where two trajectories part most, which differs from seed
to seed far more than the mean does.
"""
from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.training_options import training_parser
from moe_train.config import load_config
from moe_train.train import Trainer


@dataclass(frozen=True)
class TrainingRun:
    losses: list[float]  # the training loss of each step
    valid_loss: float | None  # the validation loss after the last step, when asked for


def train_run(config_path: str, precision: str, steps: int, overrides: list[str], validate: bool = False,
              prepare: Callable[[Trainer], None] | None = None) -> TrainingRun:
    """`steps` steps of the config in `precision` (the learning-rate schedule spans them); `prepare`
    changes the trainer before the first step (benchmarks.fp8_loss_curves' bf16 GEMM modules)."""
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(config_path, [f"train.precision={precision}", f"train.steps={steps}",
                                           f"logging.dir={run_dir}", "logging.tensorboard=false",
                                           "checkpoint.resume=none", *overrides])
        trainer = Trainer(config)
        if prepare is not None:
            prepare(trainer)
        trainer.model.train()
        try:
            losses = [float(trainer.train_step()["loss"]) for _ in range(steps)]
            return TrainingRun(losses, trainer.evaluate() if validate else None)
        finally:
            trainer.logger.close()


def nudge_one_weight(trainer: Trainer) -> None:
    """The first element of the first o_proj weight moved up by one ulp of the parameter's dtype (its
    fp32 main value set to the same number, so the optimizer steps from it)."""
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if n.endswith("o_proj.weight"))
    with torch.no_grad():
        flat = param.view(-1)
        _, exponent = torch.frexp(flat[0].float())
        flat[0] += torch.finfo(param.dtype).eps * 2.0 ** (exponent.item() - 1)  # exact: one ulp up
        piece = getattr(param, "main_piece", None)
        if piece is not None and piece.start == 0 and piece.main.data_ptr() != flat.data_ptr():
            piece.main[0] = flat[0]
        print(f"nudged {name}[0] by one {param.dtype} ulp to {flat[0].item()!r}")


def loss_curve(config_path: str, precision: str, steps: int, overrides: list[str]) -> list[float]:
    """The training loss of each of `steps` steps."""
    return train_run(config_path, precision, steps, overrides).losses


def curve_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Max and mean over steps of |a - b|."""
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(gaps), statistics.fmean(gaps)


def main(argv: list[str] | None = None) -> None:
    parser = training_parser(__doc__.splitlines()[0], steps=100)
    parser.add_argument("--nudge", action="store_true", help="also bf16 with one weight moved by one ulp")
    parser.add_argument("--seeds", type=int, nargs="+", help="train.seed of each comparison (default: the config's)")
    opts = parser.parse_args(argv)
    seeds = opts.seeds or [load_config(opts.config, opts.overrides).train.seed]
    differences = []
    for seed in seeds:
        overrides = [*opts.overrides, f"train.seed={seed}"]
        curves = {p: loss_curve(opts.config, p, opts.steps, overrides) for p in ("fp32", "bf16")}
        print(f"config {opts.config}, {opts.steps} steps, seed {seed}")
        print_curves(curves, "")
        differences.append(curve_difference(curves["bf16"], curves["fp32"]))
        if opts.nudge:
            nudged = train_run(opts.config, "bf16", opts.steps, overrides, prepare=nudge_one_weight).losses
            worst, mean = curve_difference(nudged, curves["bf16"])
            print(f"|bf16 nudged by one ulp - bf16| loss over {opts.steps} steps: max {worst:.4f}, mean {mean:.4f}")
    if len(seeds) > 1:
        print(f"|bf16 - fp32| over seeds {' '.join(map(str, seeds))}: max per seed "
              f"{' '.join(f'{worst:.4f}' for worst, _ in differences)}; mean per seed "
              f"{' '.join(f'{mean:.4f}' for _, mean in differences)}")


def print_curves(curves: dict[str, list[float]], what: str) -> None:
    """Every tenth step of the fp32 and bf16 curves, then how far apart they are; `what` names what
    is fp32 or bf16 (' moments'; '' for the compute precision)."""
    steps = len(curves["fp32"])
    for step in sorted({0, *range(9, steps, 10), steps - 1}):
        print(f"step {step + 1:4d}  fp32{what} {curves['fp32'][step]:.4f}  bf16{what} {curves['bf16'][step]:.4f}")
    worst, mean = curve_difference(curves["bf16"], curves["fp32"])
    print(f"|bf16 - fp32{what}| loss over {steps} steps: max {worst:.4f}, mean {mean:.4f}")


if __name__ == "__main__":
    main()
