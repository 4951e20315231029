"""FP8 against bf16 training, DeepSeek-V3's validation of its FP8 recipe (§3.3: relative loss error
under 0.25%): the demo config trained `--steps` steps with `train.precision=fp8` and with `bf16` from
the same seed, data and initialisation; prints both curves every tenth step, then the relative error
of the final training loss (the mean of the last 10 steps) and of the validation loss after training.

    python -m benchmarks.fp8_loss_curves [--config moe_train/configs/demo.yaml] [--steps 400] [--runs-file F]

On a CPU the FP8 GEMMs are emulated (exact, slower: model.fp8); each half of the 400-step demo takes
the better part of an hour on 2 cores. `--runs-file` keeps each finished run in a JSON file, keyed by
precision, config, steps and overrides, and a later invocation trains only the runs it lacks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

from benchmarks.bf16_loss_curves import TrainingRun, train_run
from moe_train.config import load_config

PAPER_CRITERION = 0.0025  # relative loss error of FP8 against BF16 (DeepSeek-V3 §3.3)


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def kept_run(runs_file: str | None, config: str, precision: str, steps: int, overrides: list[str]) -> TrainingRun:
    """The run from `runs_file` when it holds one with these settings, else a new one (added to the file)."""
    key = json.dumps([precision, config, steps, overrides])
    kept = {}
    if runs_file and os.path.exists(runs_file):
        with open(runs_file) as f:
            kept = json.load(f)
    if key in kept:
        print(f"{precision}: the run kept in {runs_file}")
        return TrainingRun(**kept[key])
    run = train_run(config, precision, steps, overrides, validate=True)
    if runs_file:
        kept[key] = dataclasses.asdict(run)
        with open(f"{runs_file}.tmp", "w") as f:
            json.dump(kept, f)
        os.replace(f"{runs_file}.tmp", runs_file)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe_train/configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--runs-file", help="JSON file keeping finished runs; runs it holds are not trained again")
    opts = parser.parse_args()
    runs = {p: kept_run(opts.runs_file, opts.config, p, opts.steps, opts.overrides) for p in ("bf16", "fp8")}
    seed = load_config(opts.config, opts.overrides).train.seed
    print(f"config {opts.config}, {opts.steps} steps, seed {seed}")
    for step in sorted({0, *range(9, opts.steps, 10), opts.steps - 1}):
        print(f"step {step + 1:4d}  bf16 {runs['bf16'].losses[step]:.4f}  fp8 {runs['fp8'].losses[step]:.4f}")
    final = {p: statistics.fmean(run.losses[-10:]) for p, run in runs.items()}
    train_error = relative_error(final["fp8"], final["bf16"])
    valid_error = relative_error(runs["fp8"].valid_loss, runs["bf16"].valid_loss)
    print(f"final training loss (mean of the last 10 steps): bf16 {final['bf16']:.4f}, fp8 {final['fp8']:.4f}, "
          f"relative error {100 * train_error:.3f}%")
    print(f"validation loss: bf16 {runs['bf16'].valid_loss:.4f}, fp8 {runs['fp8'].valid_loss:.4f}, "
          f"relative error {100 * valid_error:.3f}%")
    print(f"the paper's criterion, under {100 * PAPER_CRITERION:.2f}%: "
          f"{'met' if max(train_error, valid_error) < PAPER_CRITERION else 'missed'}")


if __name__ == "__main__":
    main()
