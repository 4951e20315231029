"""Where FP8 training departs from bf16: one global batch's loss and gradients with FP8 GEMMs and with
bf16 GEMMs, both against fp32, at the same weights.

The demo's FP8 run ends 0.5% above bf16 (benchmarks/fp8_loss_curves.py). This separates what the FP8
GEMMs do to one step from what the trajectory makes of it: the config's model is trained
`--warm-steps` steps of its schedule with bf16 GEMMs (train.precision=fp8's bf16 parameters, every
GEMM in bf16), then the next global batch's forward and backward run once with bf16 GEMMs, once with
FP8 GEMMs (model.fp8) on those weights, and once in fp32 on the same values. Per group of parameters it prints
the relative error of the gradient against fp32, |g - g32| / |g32|, and its component along the fp32
gradient, <g - g32, g32> / |g32|^2 (a systematic scaling of the gradient; zero for noise
uncorrelated with it), for bf16 and FP8 GEMMs side by side.

    python -m benchmarks.fp8_gradient_error [--config moe_train/configs/demo.yaml] [--warm-steps 150]
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass

import torch

from benchmarks.fp8_loss_curves import FP8_MODULE_GROUPS, use_bf16_gemms
from benchmarks.training_options import training_parser
from moe_train.config import load_config
from moe_train.train import Trainer
from parallel.mixed_precision import current_grad, release_grads

OTHER = "norms, router, embedding"  # the parameters no FP8 GEMM computes with (and the head's)


def parameter_group(name: str) -> str:
    """The FP8_MODULE_GROUPS entry whose modules hold parameter `name`, else OTHER."""
    module = name.rsplit(".", 1)[0]
    return next((group for group, pattern in FP8_MODULE_GROUPS.items() if re.fullmatch(pattern, module)), OTHER)


@dataclass
class GradientError:
    """Sums over a group's parameters: |g - g32|^2, <g - g32, g32> and |g32|^2."""

    error: float = 0.0
    along: float = 0.0
    reference: float = 0.0

    def add(self, grad: torch.Tensor, reference: torch.Tensor) -> None:
        difference = grad.double() - reference.double()
        self.error += float(difference.pow(2).sum())
        self.along += float((difference * reference).sum())
        self.reference += float(reference.double().pow(2).sum())

    def relative(self) -> float:
        return (self.error / self.reference) ** 0.5

    def projection(self) -> float:
        return self.along / self.reference


def _losses(trainer: Trainer, batch: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """The batch's loss and every parameter's gradient (fp32 copies), the gradient buffers reset after."""
    losses = trainer.compute_gradients(batch)
    grads = {name: current_grad(p).detach().float().clone() for name, p in trainer.model.named_parameters()}
    release_grads(trainer.model.parameters())
    return float(losses["loss"]), grads


def gradient_errors(config_path: str, warm_steps: int, overrides: list[str]) -> None:
    """Print the loss and the per-group gradient errors of bf16 and FP8 GEMMs against fp32 (module docstring)."""
    with tempfile.TemporaryDirectory() as run_dir:
        common = ["logging.tensorboard=false", "checkpoint.resume=none", *overrides]  # the config's own schedule
        low = Trainer(load_config(config_path, ["train.precision=fp8", f"logging.dir={run_dir}/fp8", *common]))
        exact = Trainer(load_config(config_path, ["train.precision=fp32", f"logging.dir={run_dir}/fp32", *common]))
        try:
            fp8_gemms = use_bf16_gemms(low.model, ".*")
            low.model.train()
            for _ in range(warm_steps):
                low.train_step()
            batch = low.sampler.next_batch()
            loss, grads = {}, {}
            loss["bf16"], grads["bf16"] = _losses(low, batch)
            use_bf16_gemms(low.model, ".*", fp8_gemms)
            loss["fp8"], grads["fp8"] = _losses(low, batch)
            with torch.no_grad():
                for (name, value), (same, low_value) in zip(exact.model.state_dict().items(),
                                                            low.model.state_dict().items(), strict=True):
                    assert name == same, (name, same)
                    value.copy_(low_value)
            exact.model.train()
            loss["fp32"], grads["fp32"] = _losses(exact, batch)
        finally:
            low.logger.close()
            exact.logger.close()
    print(f"config {config_path}, after {warm_steps} steps with bf16 GEMMs; the next global batch at those weights:")
    print("loss: " + ", ".join(f"{gemms} {value:.5f}" for gemms, value in loss.items())
          + f"; FP8 against bf16 {100 * (loss['fp8'] - loss['bf16']) / loss['bf16']:+.3f}%")
    groups = {gemms: {} for gemms in ("bf16", "fp8")}
    for name, reference in grads["fp32"].items():
        for gemms, errors in groups.items():
            errors.setdefault(parameter_group(name), GradientError()).add(grads[gemms][name], reference)
    print(f"{'parameters':28s} {'|g-g32|/|g32|: bf16':>21s} {'fp8':>7s}   {'along g32: bf16':>16s} {'fp8':>8s}")
    for group in groups["fp8"]:
        b, f = groups["bf16"][group], groups["fp8"][group]
        print(f"{group:28s} {b.relative():21.4f} {f.relative():7.4f}   {b.projection():+16.4f} {f.projection():+8.4f}")


def main() -> None:
    opts = training_parser(__doc__.splitlines()[0], steps=150, steps_flag="--warm-steps").parse_args()
    gradient_errors(opts.config, opts.warm_steps, opts.overrides)


if __name__ == "__main__":
    main()
