"""bf16 where it belongs: with `train.precision=bf16`'s bf16 parameters every weight GEMM has bf16
operands (dense, routed experts, attention, head, MTP), in forward, backward and the split backward's
deferred W; only the router logits stay fp32, and weight gradients land in the fp32 `main_grad`s.

The GEMMs are recorded by `benchmarks.gemm_precision.GemmCensus` (a TorchDispatchMode), whose
FLOP count is first checked against the closed-form count of `model/flops.py`.
"""
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gemm_precision import census_step
from model.flops import training_flops_per_token
from model.layers import GroupEnds, GroupedLinear, RMSNorm
from model.router import Router
from model.transformer import DeepSeekV3
from moe_train.config import load_config
from parallel.data_parallel import build_buffers
from parallel.pipeline.ir import ActionKind
from parallel.pipeline.wgrad import SplitGemmOps, WeightGradStore

# The demo model (16 experts, top-4, 6 MoE blocks with MTP's) on its training micro-batch, 4 x 256.
DEMO_CONFIG = load_config("moe_train/configs/demo.yaml")
DEMO = DEMO_CONFIG.model
BATCH, SEQ = DEMO_CONFIG.train.micro_batch_size, DEMO_CONFIG.train.seq_length
MIN_BF16_SHARE = 0.95
README_BF16_SHARE = 0.996  # the README's performance section


def draw_ids(seed: int, vocab: int, batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    print(f"seed {seed}")
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


@pytest.fixture(scope="module")
def demo_model():
    seed = 21
    print(f"model seed {seed}")
    torch.manual_seed(seed)
    return DeepSeekV3(DEMO).train()


@pytest.fixture(scope="module")
def split_demo_model(demo_model):
    """demo_model's weights, its GEMMs split (B, then W) as a pipeline builds them."""
    model = DeepSeekV3(DEMO, gemms=SplitGemmOps(WeightGradStore())).train()
    model.load_state_dict(demo_model.state_dict())
    return model


@pytest.fixture(scope="module")
def bf16_demo_model(demo_model):
    """demo_model's weights as bf16 parameters with fp32 main grads (what train.precision=bf16 trains)."""
    model = DeepSeekV3(DEMO).train()
    model.load_state_dict(demo_model.state_dict())
    build_buffers(model, None, torch.bfloat16, shard=False)
    return model


@pytest.fixture(scope="module")
def bf16_split_demo_model(split_demo_model):
    model = DeepSeekV3(DEMO, gemms=SplitGemmOps(WeightGradStore())).train()
    model.load_state_dict(split_demo_model.state_dict())
    build_buffers(model, None, torch.bfloat16, shard=False)
    return model


def test_census_counts_every_gemm_flop_of_a_step(demo_model):
    """fp32 step: the census' FLOPs equal model/flops.py's training FLOPs (full attention) plus what
    the kernels add, minus the norms that flops.py counts as parameters: exactly."""
    census = census_step(demo_model, *draw_ids(1, DEMO.vocab_size))
    a = DEMO
    attention_layers = a.num_layers + a.mtp_num_layers
    # v is zero-padded to the qk head dim (3 passes); the flash backward recomputes q k^T (once).
    kernel_extra = attention_layers * a.num_attention_heads * SEQ * (
        6 * (a.qk_full_head_dim - a.v_head_dim) + 2 * a.qk_full_head_dim)
    norms = sum(m.weight.numel() for m in demo_model.modules() if isinstance(m, RMSNorm))
    expected = BATCH * SEQ * (training_flops_per_token(a, SEQ, with_mtp=True, causal=False) + kernel_extra - 6 * norms)
    assert census.flops() == expected
    assert census.share(torch.float32) == 1.0
    assert {c.phase for c in census.calls} == {"forward", "backward"}


@pytest.mark.parametrize("split", [False, True], ids=["autograd", "split-B-W"])
def test_bf16_step_runs_its_weight_gemms_in_bf16(request, split):
    demo_model = request.getfixturevalue("bf16_split_demo_model" if split else "bf16_demo_model")
    census = census_step(demo_model, *draw_ids(2, DEMO.vocab_size))
    routers = {name for name, m in demo_model.named_modules() if isinstance(m, Router)}
    fp32_outside_routers = {key: flops for key, flops in census.other_than(torch.bfloat16).items()
                            if key[0] not in routers}
    assert not fp32_outside_routers, f"GEMMs not in bf16 (module, kernel): FLOPs {fp32_outside_routers}"
    share = census.share(torch.bfloat16)
    print(f"bf16 share of GEMM FLOPs ({'split' if split else 'autograd'}): {share:.2%}")
    assert share >= MIN_BF16_SHARE
    # The router logits stay fp32: forward, input grad and weight grad of every router, 2 T d E FLOPs each.
    router_calls = [c for c in census.calls if c.module in routers]
    assert {c.dtypes for c in router_calls} == {(torch.float32, torch.float32)}
    assert len(router_calls) == 3 * len(routers)
    router_flops = len(routers) * 3 * 2 * BATCH * SEQ * DEMO.hidden_size * DEMO.num_moe_experts
    assert census.flops() - census.flops(torch.bfloat16) == router_flops
    assert share == pytest.approx(README_BF16_SHARE, abs=5e-4)
    # The routed experts' grouped GEMMs ran in every phase: forward, input grad, weight grad (W if split).
    expert_phases = {c.phase for c in census.calls if c.kernel == "_grouped_mm"}
    assert expert_phases == ({"forward", "backward", "W"} if split else {"forward", "backward"})
    # bf16 parameters, their gradients in the fp32 main grads (`.grad` freed).
    for name, param in demo_model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.main_grad.dtype == torch.float32 and param.grad is None, name


class InputDtypes(TorchDispatchMode):
    """The dtypes of the first argument of each call of `ops`."""

    def __init__(self, ops) -> None:
        super().__init__()
        self.ops, self.seen = ops, defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops:
            self.seen[func.overloadpacket.__name__].add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_bf16_step_keeps_norm_statistics_and_losses_in_fp32(bf16_demo_model):
    aten = torch.ops.aten
    ids, labels = draw_ids(3, DEMO.vocab_size, batch=1)
    with InputDtypes({aten.rsqrt, aten._log_softmax, aten.nll_loss_forward, aten.sigmoid}) as mode:
        out = bf16_demo_model(ids, labels, aux_grad_scale=1.0)
        out.loss.backward()
    # RMSNorm's 1/rms, the cross-entropies (head and MTP) and the router's sigmoid scores.
    assert mode.seen == {"rsqrt": {torch.float32}, "_log_softmax": {torch.float32},
                         "nll_loss_forward": {torch.float32}, "sigmoid": {torch.float32}}
    assert out.loss.dtype == out.lm_loss.dtype == out.aux_loss.dtype == torch.float32


def grouped_forward_backward(layer: GroupedLinear, x: torch.Tensor, groups: GroupEnds,
                             grad_out: torch.Tensor, split: bool) -> torch.Tensor:
    """Forward (bf16 weight) and backward; split: a B scope, then its W."""
    if not split:
        y = layer(x, groups)
        y.backward(grad_out)
        return y
    store = WeightGradStore()
    layer.gemms = SplitGemmOps(store)
    y = layer(x, groups)
    with store.scope(0, 0, ActionKind.B):
        y.backward(grad_out)
    assert not layer.weight.main_grad.any()
    store.run_w(0, 0)
    return y


@pytest.mark.parametrize("split", [False, True], ids=["autograd", "split-B-W"])
def test_bf16_grouped_linear_equals_exact_math_on_bf16_operands(split):
    """With a bf16 weight the grouped GEMM multiplies bf16-rounded x and W and rounds once to bf16:
    output, input grad and the (fp32 main) weight grad are within half a bf16 ulp (2^-8 relative) of
    fp64 math on the rounded operands. fp32 math on the unrounded operands is not."""
    seed = 5
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layer = GroupedLinear(4, 32, 24)
    weight = torch.randn(4, 24, 32, generator=gen)
    layer.weight.data = weight.clone()
    build_buffers(layer, None, torch.bfloat16, shard=False)
    offsets = torch.cumsum(torch.tensor([9, 0, 14, 9]), 0).to(torch.int32)
    x = torch.randn(32, 32, generator=gen, requires_grad=True)
    grad_out = torch.randn(32, 24, generator=gen)
    y = grouped_forward_backward(layer, x, GroupEnds(offsets), grad_out, split)
    w_grad = layer.weight.main_grad
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32 and w_grad.dtype == torch.float32

    ends = offsets.tolist()
    rows = [slice(start, end) for start, end in zip([0] + ends[:-1], ends)]

    def grouped_reference(x_ref, w_ref):
        return torch.cat([F.linear(x_ref[r], w_ref[g]) for g, r in enumerate(rows)])

    x64 = x.detach().bfloat16().double().requires_grad_()
    w64 = layer.weight.detach().bfloat16().double().requires_grad_()
    y64 = grouped_reference(x64, w64)
    y64.backward(grad_out.bfloat16().double())
    half_ulp = dict(rtol=2 ** -8 * 1.01, atol=1e-30)
    torch.testing.assert_close(y.double(), y64, **half_ulp)
    torch.testing.assert_close(x.grad.double(), x64.grad, **half_ulp)
    torch.testing.assert_close(w_grad.double(), w64.grad, **half_ulp)
    assert w_grad[1].abs().sum() == 0
    y32 = grouped_reference(x.detach(), weight)
    assert not torch.allclose(y32.double(), y64, **half_ulp)
