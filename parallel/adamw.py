"""The AdamW of a run (`make_adamw`, from `optim.moment_dtype`), and AdamW with its moments stored in bf16.

fp32 moments are torch's fused AdamW, unchanged. bf16 moments (DeepSeek-V3 §3.3.3; Megatron's
`--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`) are
`BF16MomentAdamW`, which owns their update math: it steps fp32 tensors (the master weights) from
their `.grad`, so the trainer's parameters or a later layer's fp32 main parameters can feed it. Both
take the trainer's skipped-step flag as `found_inf` (GradScaler's protocol) and keep their step
counts on the parameters' device, so a step reads nothing back to the host.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# A bf16 moment holds 8 significant bits: a value in [2^e, 2^(e+1)) is rounded to a multiple of
# 2^(e-7). Multiplying it by beta lowers it by (1 - beta) * value, which is at least half that
# spacing, and so survives the rounding, for every value only while 1 - beta >= 2^-8; with a larger
# beta the decay of some values rounds away and they can never shrink.
BF16_BETA_LIMIT = 1 - 2 ** -8


def make_adamw(param_groups: list[dict], moment_dtype: str, **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW over `param_groups` (lr, betas, eps in kwargs; weight decay per group) for `moment_dtype`."""
    if moment_dtype == "bf16":
        return BF16MomentAdamW(param_groups, **kwargs)
    return torch.optim.AdamW(param_groups, fused=True, **kwargs)


class BF16MomentAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's decoupled update with `exp_avg` and `exp_avg_sq` stored in bf16.

    Per tensor and step: the moments are upcast to fp32 and updated with the gradient, the fp32
    parameter gets AdamW's update from those fp32 moments (weight decay `lr * weight_decay`, bias
    corrections of the tensor's own step count, per-group lr, betas and eps), and the moments are
    stored back rounded to bf16. One tensor at a time, so the fp32 copies never exist for more than
    one tensor (the saving is the point). The state is created here, zero, so a checkpoint loads
    into it in place (parallel.sharded_state).

    Rounding is to nearest even, not stochastic: it is deterministic, so a resumed run and every
    ZeRO-1 layout give the same moments bit for bit (a stochastic stream would need random bits
    per element that do not depend on which rank owns the tensor, checkpointed with it). Its error
    stays bounded because a moment decays: each rounding is at most 2^-8 of the value, and older
    ones shrink by beta per step. What stochastic rounding would rescue is a beta above
    `BF16_BETA_LIMIT`, whose decay rounds away; the config refuses those with bf16 moments.

    `found_inf`: a 0-d tensor, 1.0 to skip the step on the device (parameters, moments and step
    counts keep their values bit for bit), as torch's fused AdamW does.
    """

    def __init__(self, params: Iterable[torch.Tensor] | list[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.found_inf: torch.Tensor | None = None
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32, device=param.device),
                    "exp_avg": torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format),
                }

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        skip = None if self.found_inf is None else self.found_inf.bool()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, param.grad, self.state[param], group, skip)

    @staticmethod
    def _update(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: dict,
                skip: torch.Tensor | None) -> None:
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step = state["step"] + 1
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.sqrt().div_((1 - beta2 ** step).sqrt()).add_(eps)
        updated = param.mul(1 - lr * weight_decay).sub_((exp_avg / denom).mul_(lr / (1 - beta1 ** step)))
        for target, value in ((param, updated), (state["step"], step), (state["exp_avg"], exp_avg),
                              (state["exp_avg_sq"], exp_avg_sq)):
            target.copy_(value if skip is None else torch.where(skip, target, value))  # a bf16 target rounds
