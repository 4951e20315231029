"""FP8 against bf16 training, DeepSeek-V3's validation of its FP8 recipe (§3.3: relative loss error
under 0.25%): the demo config trained `--steps` steps with `train.precision=fp8` and with `bf16` from
the same seed, data and initialisation; prints both curves every tenth step, then the relative error
of the final training loss (the mean of the last 10 steps) and of the validation loss after training.

    python -m benchmarks.fp8_loss_curves [--config moe_train/configs/demo.yaml] [--steps 400] [--runs-file F]
        [--bf16-gemms GROUP]... [--bf16-swiglu-input]

Ablations of the fp8 run, to see how much of the gap a part of the recipe makes: `--bf16-gemms` keeps
one group of FP8_MODULE_GROUPS on bf16 GEMMs (it may be given more than once); `--bf16-swiglu-input`
keeps the MoE's SwiGLU input (routed and shared experts) in bf16 and their SwiGLU output saved, as bf16
training does, instead of the FP8 cache and recompute of §3.3.3 (their GEMMs stay FP8).

On a CPU the FP8 GEMMs are emulated (exact, slower: model.fp8); each half of the 400-step demo takes
the better part of an hour on 2 cores. `--runs-file` keeps each finished run in a JSON file, keyed by
precision, config, steps and overrides, and a later invocation trains only the runs it lacks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.bf16_loss_curves import TrainingRun, train_run
from benchmarks.training_options import training_parser
from model.fp8 import Fp8Tensor
from model.layers import GemmOps, GroupEnds
from model.recompute import Recompute
from moe_train.config import load_config
from moe_train.train import Trainer

PAPER_CRITERION = 0.0025  # relative loss error of FP8 against BF16 (DeepSeek-V3 §3.3)
FP8_MODULE_GROUPS = {  # the modules whose GEMMs train.precision=fp8 runs in FP8, by what they are
    "attention projections": r"(.+\.)?self_attn\.\w+_proj(_with_mqa)?",
    "routed experts": r".+\.mlp\.experts\.(gate_up|down)_proj",
    "shared experts": r".+\.mlp\.shared_experts\.(gate|up|down)_proj",
    "dense MLP": r"layers\.\d+\.mlp\.(gate|up|down)_proj",
    "MTP projection": r"mtp\.\d+\.eh_proj",
}


def use_bf16_gemms(model: nn.Module, pattern: str, gemms: dict[str, GemmOps] | None = None) -> dict[str, GemmOps]:
    """Plain bf16 GEMMs (`GemmOps`) for the modules whose names match `pattern` in full (never the model's
    own or its output head's); with `gemms`, those modules' GEMMs from it instead (a former return
    value: what they had). Returns the GEMMs the changed modules had."""
    former = {}
    for name, module in model.named_modules():
        if name not in ("", "lm_head") and hasattr(module, "gemms") and re.fullmatch(pattern, name):
            former[name] = module.gemms
            module.gemms = GemmOps() if gemms is None else gemms[name]
    return former


class Bf16SwigluInput(GemmOps):
    """`fp8`'s GEMMs, with the SwiGLU input of `grouped_activated` and `linear_activated` kept as bf16
    training keeps it (GemmOps': the activation saved, or rebuilt under `moe_act`) instead of
    model.fp8's FP8 cache."""

    def __init__(self, fp8: GemmOps) -> None:
        self.fp8 = fp8

    def linear(self, x: torch.Tensor, weight: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        return self.fp8.linear(x, weight, recompute)

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        return self.fp8.grouped(x, weight, groups, x_fp8)


@dataclass(frozen=True)
class Ablation:
    """What the fp8 run keeps as bf16 training has it (none of it: the recipe)."""

    bf16_groups: tuple[str, ...] = ()  # FP8_MODULE_GROUPS on bf16 GEMMs
    bf16_swiglu_input: bool = False  # the MoE's SwiGLU input (routed and shared experts) not cached in FP8

    def apply(self, trainer: Trainer) -> None:
        if self.bf16_groups:
            use_bf16_gemms(trainer.model, "|".join(f"({FP8_MODULE_GROUPS[group]})" for group in self.bf16_groups))
        if self.bf16_swiglu_input:
            for name, module in trainer.model.named_modules():
                if re.fullmatch(r".+\.mlp\.(experts|shared_experts)\.down_proj", name):
                    module.gemms = Bf16SwigluInput(module.gemms)


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def kept_run(runs_file: str | None, config: str, precision: str, steps: int, overrides: list[str],
             ablation: Ablation = Ablation()) -> TrainingRun:
    """The run from `runs_file` when it holds one with these settings, else a new one (added to the file)."""
    ablated = ablation != Ablation()
    key = json.dumps([precision, config, steps, overrides, *([dataclasses.asdict(ablation)] if ablated else [])])
    kept = {}
    if runs_file and os.path.exists(runs_file):
        with open(runs_file) as f:
            kept = json.load(f)
    if key in kept:
        print(f"{precision}: the run kept in {runs_file}")
        return TrainingRun(**kept[key])
    run = train_run(config, precision, steps, overrides, validate=True, prepare=ablation.apply if ablated else None)
    if runs_file:
        kept[key] = dataclasses.asdict(run)
        with open(f"{runs_file}.tmp", "w") as f:
            json.dump(kept, f)
        os.replace(f"{runs_file}.tmp", runs_file)
    return run


def main() -> None:
    parser = training_parser(__doc__.splitlines()[0], steps=400)
    parser.add_argument("--runs-file", help="JSON file keeping finished runs; runs it holds are not trained again")
    parser.add_argument("--bf16-gemms", action="append", default=[], choices=sorted(FP8_MODULE_GROUPS),
                        metavar="GROUP", help=f"keep these modules on bf16 GEMMs in the fp8 run: {', '.join(FP8_MODULE_GROUPS)}")
    parser.add_argument("--bf16-swiglu-input", action="store_true",
                        help="keep the MoE's SwiGLU input in bf16 in the fp8 run (no FP8 cache)")
    opts = parser.parse_args()
    ablation = Ablation(tuple(sorted(set(opts.bf16_gemms))), opts.bf16_swiglu_input)
    runs = {"bf16": kept_run(opts.runs_file, opts.config, "bf16", opts.steps, opts.overrides),
            "fp8": kept_run(opts.runs_file, opts.config, "fp8", opts.steps, opts.overrides, ablation)}
    seed = load_config(opts.config, opts.overrides).train.seed
    kept_bf16 = [f"{', '.join(ablation.bf16_groups)} on bf16 GEMMs"] if ablation.bf16_groups else []
    kept_bf16 += ["the MoE's SwiGLU input in bf16"] if ablation.bf16_swiglu_input else []
    print(f"config {opts.config}, {opts.steps} steps, seed {seed}"
          + (f"; the fp8 run keeps {' and '.join(kept_bf16)}" if kept_bf16 else ""))
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
