"""BF16MomentAdamW against a hand-written float64 AdamW whose moments are rounded to bf16 after each
step, and the choice of AdamW from `optim.moment_dtype`.

The reference starts every step from the optimizer's own state (fp32 parameters and bf16 moments
read as float64), so a value that lands on a bf16 rounding tie in one step cannot make the two
runs part for the remaining steps; it keeps its own step counts (bias corrections) and its own
copy of the groups' lr, weight decay, betas and eps. The bounds, and why:
- moments: the reference's bf16 rounding (to nearest even, by hand from float64) bit for bit,
  except where the exact value lies within the fp32 arithmetic's error (2^-20 of the terms it adds,
  16 fp32 units in the last place) of a rounding midpoint; there the neighbour is accepted too.
- parameters: within 2^-21 of the parameter (the decay factor's and the result's fp32 roundings)
  plus 2^-16 of the Adam step's scale (the fp32 bias corrections, moments and division add up to
  some 40 fp32 units in the last place, 2^-18; the largest error seen was a seventh of the bound).
Rounding the moments before the update moves a step by up to 2^-8 of itself, dropping a bias
correction by a factor: far outside both.
"""
import math
import random

import pytest
import torch

from moe_train.config import OptimConfig
from moe_train.optim import build_optimizer
from parallel.data_parallel import build_buffers
from parallel.adamw import BF16_BETA_LIMIT, BF16MomentAdamW

BETAS, EPS = (0.9, 0.95), 1e-4  # eps near the gradients' scale, so its place in the formula shows
GROUPS = [{"shapes": [(7, 5), (16,)], "lr": 1e-2, "weight_decay": 0.1},
          {"shapes": [(11,)], "lr": 3e-3, "weight_decay": 0.0}]
SKIPPED, NO_FOUND_INF, ONE_GRAD_MISSING, STEPS = 3, 1, 5, 8


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 to the nearest bf16 value (8 significant bits), ties to even, without torch's cast."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 256) / 256, exponent.double())


def half_spacing(x: torch.Tensor) -> torch.Tensor:
    """Half the distance between consecutive bf16 values around |x| (0 for 0)."""
    _, exponent = torch.frexp(x)
    return torch.where(x == 0, 0.0, torch.ldexp(torch.ones_like(x), exponent.double() - 9))


def reference_step(p, m, v, g, count, lr, weight_decay):
    """torch.optim.AdamW's decoupled formula in float64; returns (parameter, unrounded moments)."""
    beta1, beta2 = BETAS
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    step = lr / (1 - beta1 ** count) * m / (v.sqrt() / math.sqrt(1 - beta2 ** count) + EPS)
    return p * (1 - lr * weight_decay) - step, m, v


def check_moment(ours: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> int:
    """Assert the bound on one moment; returns how many elements took the neighbour at a tie."""
    assert ours.dtype == torch.bfloat16
    ours = ours.double()
    rounded = round_bf16(exact)
    ok = (ours == rounded) | ((ours - exact).abs() <= half_spacing(exact) + 2 ** -20 * terms)
    assert ok.all(), (ours[~ok], exact[~ok])
    return int((ours != rounded).sum())


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(2**31)
    print(f"seed={value}")
    return value


def test_bf16_moments_follow_a_float64_adamw_with_rounded_moments(seed):
    gen = torch.Generator().manual_seed(seed)
    groups = [{"params": [torch.randn(s, generator=gen) for s in g["shapes"]], "lr": g["lr"],
               "weight_decay": g["weight_decay"]} for g in GROUPS]
    params = [(p, g) for g in groups for p in g["params"]]
    scales = {id(p): 10 ** (-3 * torch.rand((), generator=gen).item()) for p, _ in params}  # 1e-3 .. 1
    optimizer = BF16MomentAdamW(groups, betas=BETAS, eps=EPS)
    counts = {id(p): 0 for p, _ in params}
    ties = 0
    for k in range(STEPS):
        for p, _ in params:
            p.grad = torch.randn(p.shape, generator=gen) * scales[id(p)]
        if k == ONE_GRAD_MISSING:
            params[1][0].grad = None
        if k == SKIPPED:
            params[0][0].grad[0, 0], params[2][0].grad[3] = float("nan"), float("inf")
        optimizer.found_inf = None if k == NO_FOUND_INF else torch.tensor(float(k == SKIPPED))
        before = {id(p): (p.clone(), *(optimizer.state[p][key].clone() for key in ("exp_avg", "exp_avg_sq", "step")))
                  for p, _ in params}
        optimizer.step()
        for p, group in params:
            p0, m0, v0, step0 = before[id(p)]
            state = optimizer.state[p]
            if k == SKIPPED or p.grad is None:
                for now, then in ((p, p0), (state["exp_avg"], m0), (state["exp_avg_sq"], v0), (state["step"], step0)):
                    assert torch.equal(now, then)
                continue
            counts[id(p)] += 1
            g = p.grad.double()
            expected, m, v = reference_step(p0.double(), m0.double(), v0.double(), g, counts[id(p)],
                                            group["lr"], group["weight_decay"])
            ties += check_moment(state["exp_avg"], m, BETAS[0] * m0.double().abs() + (1 - BETAS[0]) * g.abs())
            ties += check_moment(state["exp_avg_sq"], v, BETAS[1] * v0.double() + (1 - BETAS[1]) * g * g)
            beta1, beta2 = BETAS
            adam_scale = (group["lr"] / (1 - beta1 ** counts[id(p)]) * (m0.double().abs() + g.abs())
                          / (v.sqrt() / math.sqrt(1 - beta2 ** counts[id(p)]) + EPS))
            error = (p.double() - expected).abs()
            bound = 2 ** -21 * expected.abs() + 2 ** -16 * adam_scale
            assert (error <= bound).all(), (k, (error / bound).max())
            assert state["step"].item() == counts[id(p)] and state["step"].dtype == torch.float32
    print(f"{ties} moment elements took the neighbour of a rounding tie")
    assert counts[id(params[1][0])] == STEPS - 2 and counts[id(params[0][0])] == STEPS - 1


def test_the_config_chooses_torchs_fused_adamw_or_bf16_moments():
    def optimizer(optim: OptimConfig) -> torch.optim.Optimizer:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
        return build_optimizer(model, build_buffers(model, None, torch.float32, shard=False), optim).inner

    fp32 = optimizer(OptimConfig())
    assert type(fp32) is torch.optim.AdamW and fp32.defaults["fused"]
    bf16 = optimizer(OptimConfig(moment_dtype="bf16", weight_decay=0.2, adam_beta2=0.9))
    assert type(bf16) is BF16MomentAdamW
    assert [g["weight_decay"] for g in bf16.param_groups] == [0.2, 0.0] and bf16.defaults["betas"] == (0.9, 0.9)
    assert {v.dtype for s in bf16.state.values() for k, v in s.items() if k != "step"} == {torch.bfloat16}


@pytest.mark.parametrize("beta2, decays", [(BF16_BETA_LIMIT, True), (0.997, False)])
def test_a_bf16_moment_decays_only_with_a_beta_up_to_the_limit(beta2, decays):
    """The config's refusal of larger betas (parallel.adamw): just above 1 = 2^0, where bf16's spacing is
    2^-7, a zero gradient must still lower the second moment."""
    param = torch.zeros(1)
    optimizer = BF16MomentAdamW([param], betas=(0.9, beta2), weight_decay=0.0)
    optimizer.state[param]["exp_avg_sq"].fill_(1 + 2 ** -7)
    param.grad = torch.zeros(1)
    optimizer.step()
    assert (optimizer.state[param]["exp_avg_sq"].item() < 1 + 2 ** -7) == decays
