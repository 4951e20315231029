"""Split backward (B now, W later) against plain autograd on the tiny model cut into two stages."""
import copy

import pytest
import torch

from model.args import ModelArgs
from model.layers import GemmOps, GroupedLinear, Linear
from model.transformer import DeepSeekV3, ModelPart
from parallel.pipeline.ir import ActionKind, ScheduleError
from parallel.mixed_precision import zero_grad_buffers
from parallel.pipeline.wgrad import SplitGemmOps, WeightGradStore

TINY = ModelArgs()
CUT = 2  # stage 0: embedding + layers[:CUT]; stage 1: the other layers, norm, head, MTP, loss
FIRST = ModelPart(tuple(range(CUT)), embedding=True, head=False)
SECOND = ModelPart(tuple(range(CUT, TINY.num_layers)), embedding=False, head=True)
MICROBATCHES = 3
SCALE = 1.0 / MICROBATCHES
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=4e-5)}


@pytest.fixture(scope="module")
def plain_models():
    """The reference: plain autograd GEMMs, fp32 and fp64 with the same weights."""
    torch.manual_seed(0)
    model = DeepSeekV3(TINY).train()
    return {torch.float32: model, torch.float64: copy.deepcopy(model).double()}


def split_model(plain: DeepSeekV3, store: WeightGradStore) -> DeepSeekV3:
    """`plain`'s weights, its weight GEMMs split for `store`."""
    model = DeepSeekV3(TINY, gemms=SplitGemmOps(store)).train().to(next(plain.parameters()).dtype)
    model.load_state_dict(plain.state_dict())
    return model


def micro_batches(seed, b=2, t=16):
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (MICROBATCHES, b, t + 1), generator=gen)
    return [(rows[:, :-1], rows[:, 1:]) for rows in ids]


def stage0(model, ids):
    return model(ids, part=FIRST, aux_grad_scale=SCALE).hidden


def stage1(model, hidden, ids, labels):
    """The scaled micro-batch loss (balance-loss gradients are injected by the MoE blocks)."""
    return model(ids, labels, hidden=hidden, part=SECOND, aux_grad_scale=SCALE).prediction_loss / MICROBATCHES


def split_weights(model):
    return {m.weight for m in model.modules() if isinstance(m, (Linear, GroupedLinear))}


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reference(model, batches):
    """Per micro-batch: plain autograd parameter grads of the whole model, and the stage-1 input grad."""
    params, inputs = [], []
    for ids, labels in batches:
        model.zero_grad(set_to_none=True)
        (model(ids, labels, aux_grad_scale=SCALE).loss / MICROBATCHES).backward()
        params.append(grads(model))
        hidden = stage0(model, ids).detach().requires_grad_()
        inputs.append(torch.autograd.grad(stage1(model, hidden, ids, labels), hidden)[0])
    return params, inputs


def total(per_microbatch, upto=MICROBATCHES):
    return {name: sum(g[name] for g in per_microbatch[:upto]) for name in per_microbatch[0]}


def assert_grads(model, expected, tol, names=None):
    for name, param in model.named_parameters():
        if names is None or name in names:
            torch.testing.assert_close(param.grad, expected[name], **tol, msg=name)


def forward_and_b(model, store, batches, mode):
    """F then B of every micro-batch (stage 1 before stage 0); returns the stage-1 input grads."""
    input_grads = []
    for mb, (ids, labels) in enumerate(batches):
        out0 = stage0(model, ids)
        in1 = out0.detach().requires_grad_()
        loss = stage1(model, in1, ids, labels)
        with store.scope(1, mb, mode):
            loss.backward()
        with store.scope(0, mb, mode):
            out0.backward(in1.grad)
        input_grads.append(in1.grad)
    return input_grads


W_ORDERS = {
    "fifo": [(stage, mb) for mb in range(MICROBATCHES) for stage in (1, 0)],
    "stage0-first-reversed": [(stage, mb) for stage in (0, 1) for mb in reversed(range(MICROBATCHES))],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("order", W_ORDERS)
def test_b_then_w_in_any_order_matches_autograd(plain_models, dtype, order):
    plain, tol = plain_models[dtype], TOLERANCES[dtype]
    batches = micro_batches(seed=10)
    ref_params, ref_inputs = reference(plain, batches)
    expected = total(ref_params)
    store = WeightGradStore()
    model = split_model(plain, store)
    zero_grad_buffers(model.parameters())
    input_grads = forward_and_b(model, store, batches, ActionKind.B)
    for got, want in zip(input_grads, ref_inputs):
        torch.testing.assert_close(got, want, **tol)
    deferred = split_weights(model)
    # Norms, embedding and router (with its injected balance-loss gradient) are done after B.
    assert_grads(model, expected, tol, {n for n, p in model.named_parameters() if p not in deferred})
    assert all(p.grad.abs().sum() == 0 for p in deferred)
    assert sorted(store.pending()) == sorted(W_ORDERS["fifo"])
    for stage, mb in W_ORDERS[order]:
        store.run_w(stage, mb)
    store.assert_empty()
    assert_grads(model, expected, tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_bw_mode_computes_weight_grads_at_once(plain_models, dtype):
    plain, tol = plain_models[dtype], TOLERANCES[dtype]
    batches = micro_batches(seed=20)
    ref_params, ref_inputs = reference(plain, batches)
    store = WeightGradStore()
    model = split_model(plain, store)
    zero_grad_buffers(model.parameters())
    input_grads = forward_and_b(model, store, batches, "BW")
    assert store.is_empty()
    for got, want in zip(input_grads, ref_inputs):
        torch.testing.assert_close(got, want, **tol)
    assert_grads(model, total(ref_params), tol)


def test_grads_accumulate_per_microbatch_and_reset_zeroes_the_same_buffers(plain_models):
    plain, tol = plain_models[torch.float64], TOLERANCES[torch.float64]
    batches = micro_batches(seed=30)
    ref_params, _ = reference(plain, batches)
    store = WeightGradStore()
    model = split_model(plain, store)
    zero_grad_buffers(model.parameters())
    buffers = {name: p.grad for name, p in model.named_parameters()}
    forward_and_b(model, store, batches, ActionKind.B)
    deferred = {n for n, p in model.named_parameters() if p in split_weights(model)}
    for mb in range(MICROBATCHES):
        store.run_w(1, mb)
        store.run_w(0, mb)
        assert_grads(model, total(ref_params, upto=mb + 1), tol, deferred)
    zero_grad_buffers(model.parameters())
    for name, param in model.named_parameters():
        assert param.grad is buffers[name], name
        assert param.grad.abs().sum() == 0, name


def test_bf16_autocast_split_grads_match_autocast_autograd(plain_models):
    """Same bf16 GEMMs; only lm_head (head + MTP) differs: its two uses are summed in fp32, not bf16."""
    plain = plain_models[torch.float32]
    ids, labels = micro_batches(seed=40)[0]
    plain.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(ids, labels, aux_grad_scale=SCALE).loss.backward()
    expected = grads(plain)
    store = WeightGradStore()
    model = split_model(plain, store)
    zero_grad_buffers(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels, aux_grad_scale=SCALE).loss
    with store.scope(0, 0, ActionKind.B):
        loss.backward()
    store.run_w(0, 0)
    assert_grads(model, expected, dict(rtol=1.6e-2, atol=1e-3))


@pytest.mark.parametrize("skipped", [[3], list(range(TINY.num_moe_experts))], ids=["one-expert", "all-experts"])
def test_experts_without_tokens_get_zero_gradients(plain_models, skipped):
    experts = copy.deepcopy(plain_models[torch.float32].layers[str(CUT)].mlp.experts)
    seed = 50 + len(skipped)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    tokens, topk = 12, TINY.moe_router_topk
    allowed = torch.tensor([e for e in range(TINY.num_moe_experts) if e not in skipped] or [-1])
    idx = allowed[torch.randint(0, len(allowed), (tokens, topk), generator=gen)]
    x = torch.randn(tokens, TINY.hidden_size, generator=gen).requires_grad_()
    weights, grad_out = torch.rand(tokens, topk, generator=gen), torch.randn(tokens, TINY.hidden_size, generator=gen)
    slots = [int((idx == e).sum()) for e in range(experts.num_local_experts)]  # the slots per expert
    experts(x, idx, weights, slots).backward(grad_out)
    expected = {name: p.grad.clone() for name, p in experts.named_parameters()}
    expected_x = x.grad.clone()
    experts.zero_grad(set_to_none=True)
    x.grad = None
    store = WeightGradStore()
    for layer in (experts.gate_up_proj, experts.down_proj):
        layer.gemms = SplitGemmOps(store)
    with store.scope(0, 0, ActionKind.B):
        experts(x, idx, weights, slots).backward(grad_out)
    assert all(p.grad is None for p in experts.parameters())
    store.run_w(0, 0)
    torch.testing.assert_close(x.grad, expected_x)
    for name, param in experts.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        assert param.grad[skipped].abs().sum() == 0, name


def test_store_runs_a_unit_in_fifo_order_and_checks_the_step_end():
    store, log = WeightGradStore(), []
    with store.scope(2, 5, "B") as scope:
        assert store.current == scope and scope.mode is ActionKind.B
        store.put(lambda: log.append("first"))
        store.put(lambda: log.append("second"))
        with pytest.raises(RuntimeError, match="still running"):
            with store.scope(1, 5, "B"):
                pass
    assert store.current is None and log == []
    with pytest.raises(ScheduleError, match="W2.5"):
        store.assert_empty()
    with pytest.raises(ScheduleError, match="W2.4"):
        store.run_w(2, 4)
    store.run_w(2, 5)
    assert log == ["first", "second"] and store.is_empty()
    store.assert_empty()
    with store.scope(0, 0, ActionKind.BW):
        store.put(lambda: log.append("now"))
    store.put(lambda: log.append("no scope"))
    assert log[2:] == ["now", "no scope"] and store.is_empty()
    with pytest.raises(ValueError):
        with store.scope(0, 0, ActionKind.W):
            pass


def test_a_model_computes_its_gemms_with_the_ops_it_was_built_with():
    """No global switch: a split model's GEMMs queue W work, a plain model's next to it do not."""
    store = WeightGradStore()
    split, plain = DeepSeekV3(TINY, gemms=SplitGemmOps(store)), DeepSeekV3(TINY)
    gemm_modules = [m for m in split.modules() if isinstance(m, (Linear, GroupedLinear))]
    assert gemm_modules and all(m.gemms is split.gemms for m in gemm_modules)
    assert all(type(m.gemms) is GemmOps for m in plain.modules() if isinstance(m, (Linear, GroupedLinear)))
    ids = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(60))
    print("seed 60")
    for model in (split, plain):
        with store.scope(0, 0, ActionKind.B):
            model(ids, ids, aux_grad_scale=1.0).loss.backward()
    assert store.pending() == [(0, 0)]
    work = store.pop(0, 0)
    assert len(work) == len(gemm_modules) + len(split.mtp)  # lm_head runs once more per MTP depth
    assert all(p.grad is not None for n, p in plain.named_parameters())
    assert split.lm_head.weight.grad is None
