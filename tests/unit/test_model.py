"""The model's pieces against naive restatements: grouped GEMM, MoE block, MTP alignment, losses."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.args import ModelArgs
from model.fp8 import Fp8GemmOps
from model.dispatcher import LocalDispatcher
from model.layers import GroupEnds, GroupedLinear
from model.moe import MoE
from model.mtp import IGNORE_INDEX, shift_left
from model.recompute import Recompute
from model.router import sequence_balance_loss
from model.transformer import DeepSeekV3
from tests.unit.live_memory import LiveStorage

TINY = ModelArgs()


def batch(args, b=2, t=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (b, t + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def test_grouped_linear_matches_per_expert_loop_with_an_empty_expert():
    layer = GroupedLinear(4, 8, 6)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, requires_grad=True)
    y = layer(x, GroupEnds.of_counts(counts))
    grad = torch.randn_like(y)
    y.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.weight.detach().clone().requires_grad_()
    starts = [0, 3, 3, 8, 10]
    y_ref = torch.cat([F.linear(x_ref[starts[e]:starts[e + 1]], w_ref[e]) for e in range(4)])
    y_ref.backward(grad)
    assert torch.allclose(y, y_ref, atol=1e-6)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    assert torch.allclose(layer.weight.grad, w_ref.grad, atol=1e-6)
    assert layer.weight.grad[1].abs().sum() == 0


class CountingDispatcher(LocalDispatcher):
    def __init__(self):
        self.calls = []

    def dispatch(self, x, topk_idx, topk_weights, layout):
        self.calls.append("dispatch")
        return super().dispatch(x, topk_idx, topk_weights, layout)

    def combine(self, y, handle):
        self.calls.append("combine")
        return super().combine(y, handle)


def test_moe_block_equals_naive_per_token_sum_and_uses_its_dispatcher():
    args = ModelArgs(hidden_size=32, num_moe_experts=8, moe_ffn_hidden_size=16, moe_router_topk=3,
                     moe_router_num_groups=4, moe_router_group_topk=2)
    dispatcher = CountingDispatcher()
    moe = MoE(args, dispatcher).eval()
    moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    x = torch.randn(2, 5, 32)
    out = moe(x)
    assert dispatcher.calls == ["dispatch", "combine"]
    flat = x.reshape(-1, 32)
    routing = moe.gate(flat)
    gate_up, down = moe.experts.gate_up_proj.weight, moe.experts.down_proj.weight
    expected = []
    for t in range(flat.shape[0]):
        acc = moe.shared_experts(flat[t])
        for e, w in zip(routing.topk_idx[t].tolist(), routing.topk_weights[t]):
            g, u = (gate_up[e] @ flat[t]).chunk(2)
            acc = acc + w * (down[e] @ (F.silu(g) * u))
        expected.append(acc)
    assert torch.allclose(out.reshape(-1, 32), torch.stack(expected), atol=1e-5)


def test_forward_backward_reaches_every_parameter_and_bias_is_a_buffer():
    torch.manual_seed(0)
    model = DeepSeekV3(TINY).train()
    inputs, labels = batch(TINY)
    out = model(inputs, labels, aux_grad_scale=1.0)
    assert out.logits.shape == (2, 16, TINY.vocab_size)
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(
        (out.lm_loss + TINY.mtp_loss_scaling_factor * out.mtp_loss + out.aux_loss).item(), rel=1e-6)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []
    names = {n for n, _ in model.named_parameters()}
    assert not any("e_score_correction_bias" in n for n in names)
    assert sum("e_score_correction_bias" in k for k in model.state_dict()) == TINY.num_moe_layers + TINY.mtp_num_layers


def test_mtp_loss_alignment_matches_manual_computation():
    torch.manual_seed(1)
    model = DeepSeekV3(TINY).eval()
    inputs, labels = batch(TINY, seed=3)
    out = model(inputs, labels)
    cos, sin = model.rotary(inputs.shape[1])
    # depth 1 at position i sees token i+1 and must predict token i+2 = labels[i+1]
    next_tokens = torch.cat([inputs[:, 1:], torch.zeros_like(inputs[:, :1])], dim=1)
    h1 = model.mtp[0](out.hidden, model.embed_tokens(next_tokens), cos, sin)
    logits = model.lm_head(model.mtp[0].final_norm(h1))
    target = labels[:, 1:]
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, TINY.vocab_size), target.reshape(-1))
    assert out.mtp_loss.item() == pytest.approx(manual.item(), rel=1e-5)
    shifted = shift_left(labels, 2, IGNORE_INDEX)
    assert torch.equal(shifted[:, :-2], labels[:, 2:]) and (shifted[:, -2:] == IGNORE_INDEX).all()


def test_balance_loss_gradient_reaches_router_through_the_block_output():
    """loss.backward() with the injected balance-loss gradient == backward of lm + explicit aux."""
    torch.manual_seed(2)
    args = dataclasses.replace(TINY, moe_aux_loss_coeff=0.5, mtp_num_layers=0)
    model = DeepSeekV3(args).train()
    inputs, labels = batch(args, seed=5)
    model(inputs, labels, aux_grad_scale=1.0).loss.backward()
    injected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for block in model.moe_blocks():
        block.aux_loss_coeff = 0.0
    routings = []
    for router in model.routers():
        router.register_forward_hook(lambda m, a, out: routings.append(out))
    lm_loss = model(inputs, labels).loss
    aux = sum(sequence_balance_loss(r.scores, r.topk_idx, inputs.shape[0], 0.5) for r in routings)
    aux_only = torch.autograd.grad(aux, [r.weight for r in model.routers()], retain_graph=True)
    assert all(g.abs().sum() > 0 for g in aux_only)
    (lm_loss + aux).backward()
    for got, (name, param) in zip(injected, model.named_parameters()):
        assert torch.allclose(got, param.grad, atol=1e-6), name


def test_bf16_autocast_on_cpu_trains():
    torch.manual_seed(3)
    model = DeepSeekV3(TINY).train()
    inputs, labels = batch(TINY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(inputs, labels, aux_grad_scale=1.0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_causality():
    torch.manual_seed(4)
    model = DeepSeekV3(TINY).eval()
    inputs, _ = batch(TINY, b=1)
    changed = inputs.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab_size
    a, b = model(inputs).logits, model(changed).logits
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-6)


class SecondHalfDispatcher(LocalDispatcher):
    """Owns experts [E/2, E) as rank 1 of 2 would (only local_experts matters for init)."""

    def local_experts(self, num_experts):
        return range(num_experts // 2, num_experts)


def test_initialization_does_not_depend_on_the_expert_layout():
    from model.init import initialize_parameters
    full = DeepSeekV3(TINY)
    half = DeepSeekV3(TINY, dispatcher=SecondHalfDispatcher())
    initialize_parameters(full, 7, 0.02)
    initialize_parameters(half, 7, 0.02)
    full_state, half_state = full.state_dict(), half.state_dict()
    for name, tensor in half_state.items():
        if ".experts." in name:
            assert torch.equal(tensor, full_state[name][TINY.num_moe_experts // 2:]), name
        else:
            assert torch.equal(tensor, full_state[name]), name
    other = DeepSeekV3(TINY)
    initialize_parameters(other, 8, 0.02)
    assert not torch.equal(other.lm_head.weight, full.lm_head.weight)


@pytest.mark.parametrize("modules", [["full"], ["layernorm"], ["mla_up_proj"], ["moe_act"],
                                     ["layernorm", "mla_up_proj", "moe_act"]], ids="+".join)
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_recompute_gives_bit_identical_losses_and_gradients(modules, q_lora):
    """fp32: every recompute module gives the loss and every gradient of no recomputation bit for bit;
    selective modules never re-run the router (expert loads counted once), `full` replays it (twice)."""
    seed = 9
    print(f"seed {seed}")
    args = TINY if q_lora else dataclasses.replace(TINY, q_lora_rank=None)
    torch.manual_seed(seed)
    plain = DeepSeekV3(args).train()
    again = DeepSeekV3(dataclasses.replace(args, recompute_modules=modules)).train()
    again.load_state_dict(plain.state_dict())
    inputs, labels = batch(args, seed=seed + 2)
    out_plain, out_again = plain(inputs, labels, aux_grad_scale=1.0), again(inputs, labels, aux_grad_scale=1.0)
    out_plain.loss.backward()
    out_again.loss.backward()
    assert torch.equal(out_again.loss, out_plain.loss)
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        assert torch.equal(a.grad, b.grad), name
    replays = 2 if modules == ["full"] else 1
    for r_plain, r_again in zip(plain.routers(), again.routers()):
        assert torch.equal(r_again.expert_load, replays * r_plain.expert_load)


@pytest.mark.parametrize("mode", ["autocast", "bf16-parameters"])
def test_recompute_in_bf16_is_bit_identical(mode):
    """bf16 autocast: the backward rebuilds the regions in bf16 as the forward ran them (the backward
    itself runs outside autocast); bf16 parameters (train.precision=bf16): the rebuilt regions compute
    the same bf16 values. Either way the gradients equal no recomputation bit for bit."""
    seed = 10
    print(f"seed {seed}")
    torch.manual_seed(seed)
    plain = DeepSeekV3(TINY).train()
    again = DeepSeekV3(dataclasses.replace(TINY, recompute_modules=["layernorm", "mla_up_proj", "moe_act"])).train()
    again.load_state_dict(plain.state_dict())
    inputs, labels = batch(TINY, seed=seed + 2)
    for model in (plain, again):
        if mode == "bf16-parameters":
            model.to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            out = model(inputs, labels, aux_grad_scale=1.0)
        out.loss.backward()
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        assert (a.grad.dtype == torch.bfloat16) == (mode == "bf16-parameters") and torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("modules", [["layernorm"], ["layernorm", "mla_up_proj", "moe_act"]], ids="+".join)
def test_recompute_with_fp8_gemms_is_bit_identical(modules, monkeypatch):
    """FP8 GEMMs (train.precision=fp8): the FP8 copies the Linears keep of recomputed norms' outputs are
    rebuilt in backward from the norms' replay (model.recompute.Recompute.derived), the same E4M3
    values, as are the router's fp32 copy of its input and, under mla_up_proj, o_proj's copy of the
    attention core's output; so the gradients equal no recomputation bit for bit, and the copies are
    not kept: kept with them rebuilt is less, by exactly their bytes, than kept with them stored."""
    seed = 11
    print(f"seed {seed}")
    torch.manual_seed(seed)
    plain = DeepSeekV3(TINY, gemms=Fp8GemmOps()).train().to(torch.bfloat16)
    again = DeepSeekV3(dataclasses.replace(TINY, recompute_modules=modules), gemms=Fp8GemmOps()).train()
    again.to(torch.bfloat16).load_state_dict(plain.state_dict())
    inputs, labels = batch(TINY, seed=seed + 2)

    def kept_and_gradients(model: DeepSeekV3) -> tuple[int, list[torch.Tensor]]:
        model.zero_grad()
        with LiveStorage() as memory:
            out = model(inputs, labels, aux_grad_scale=1.0)
            kept = memory.live()
            out.loss.backward()
        return kept, [p.grad for p in model.parameters()]

    _, expected = kept_and_gradients(plain)
    kept, grads = kept_and_gradients(again)
    for (name, _), a, b in zip(plain.named_parameters(), expected, grads):
        assert torch.equal(a, b), name
    monkeypatch.setattr(Recompute, "derived", lambda self, fn, *inputs: fn(*inputs))
    kept_stored, grads_stored = kept_and_gradients(again)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_stored))
    copies = _rebuilt_copies(dataclasses.replace(TINY, recompute_modules=modules), tokens=inputs.numel())
    print(f"kept {kept} bytes, {kept_stored} with the copies stored; the copies: {copies}")
    assert kept_stored - kept == copies


@pytest.mark.parametrize("saves_output", [True, False], ids=["exp", "scale"])
def test_compact_saved_output_keeps_the_compact_tensor_in_place_of_the_output(saves_output):
    """Recompute.compact_saved_output (the attention core's output without v's padding): where the op saves
    its output (exp), its backward keeps the compact tensor the caller keeps anyway and rebuilds the
    output from it, so the padded output is freed and the gradient is bit for bit the same; where it
    saves none (a scale), nothing is replaced and nothing may be rebuilt from the compact tensor."""
    seed = 21
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(64, 32, generator=gen).requires_grad_(), torch.randn(64, 32, generator=gen)

    def op() -> torch.Tensor:  # [64, 64], the second half exactly zero, as the core's v padding
        padded = F.pad(x, (0, 32), value=float("-inf") if saves_output else 0.0)
        return torch.exp(padded) if saves_output else padded * 2.0

    def expand(small: torch.Tensor, out: torch.Tensor) -> None:
        out[:, :32].copy_(small)
        out[:, 32:].zero_()

    def run(modules: list[str]) -> tuple[int, torch.Tensor, bool]:
        recompute, x.grad = Recompute(modules), None
        with LiveStorage() as memory, recompute.active():
            y = recompute.compact_saved_output("mla_up_proj", op, lambda out: out[:, :32].clone(), expand)
            kept, compact = memory.live(), recompute._is_compact(y)
        y.backward(grad)
        return kept, x.grad.clone(), compact

    kept, expected, _ = run([])
    kept_compact, gradient, compact = run(["mla_up_proj"])
    assert torch.equal(gradient, expected) and compact == saves_output
    assert kept - kept_compact == (64 * 64 * 4 if saves_output else 0)  # the padded output, when saved


def _rebuilt_copies(args, tokens: int) -> int:
    """Bytes of the copies that `layernorm` (with `args.recompute_modules`) rebuilds instead of keeping:
    the 128x1 E4M3 copies (and their fp32 scales) that a layer's Linears keep of its norms' outputs
    (q_a and kv_a of the input norm's, q_b of the q norm's, kv_b of the kv norm's, and the dense FFN's
    or shared expert's gate and up of the post-attention norm's) and the router's fp32 copy of the
    post-attention norm's output (4 bytes per element); and with `mla_up_proj` o_proj's copy of the
    attention core's output; in every decoder layer and each MTP depth's (a MoE layer)."""
    tiles = -(-tokens // 128)
    copy = lambda width: width * (tokens + 4 * tiles)  # noqa: E731
    moe = [args.is_moe_layer(i) for i in range(args.num_layers)] + [True] * args.mtp_num_layers
    return sum(2 * copy(args.hidden_size) + copy(args.q_lora_rank) + copy(args.kv_lora_rank)
               + 2 * copy(args.hidden_size) * (args.moe_shared_expert_intermediate_size > 0 or not is_moe)
               + 4 * args.hidden_size * tokens * is_moe
               + copy(args.num_attention_heads * args.v_head_dim) * ("mla_up_proj" in args.recompute_modules)
               for is_moe in moe)


def test_a_training_forward_without_the_balance_loss_gradient_scale_fails_loudly():
    """Forgetting aux_grad_scale raises instead of giving the balance loss some default gradient;
    forwards without a balance-loss gradient (eval, no_grad, coefficient 0) need none."""
    torch.manual_seed(12)
    print("seed 12")
    model = DeepSeekV3(TINY).train()
    inputs, labels = batch(TINY, seed=13)
    with pytest.raises(ValueError, match="aux_grad_scale"):
        model(inputs, labels)
    with torch.no_grad():
        model(inputs, labels)
    model.eval()(inputs, labels)
    without = DeepSeekV3(dataclasses.replace(TINY, moe_aux_loss_coeff=0.0)).train()
    without(inputs, labels).loss.backward()


def test_the_balance_loss_gets_the_gradient_scale_of_its_forward():
    """backward of (loss * s) with aux_grad_scale=s is s times the gradient of loss with scale 1."""
    torch.manual_seed(14)
    print("seed 14")
    model = DeepSeekV3(dataclasses.replace(TINY, moe_aux_loss_coeff=0.5)).train()
    inputs, labels = batch(TINY, seed=15)
    model(inputs, labels, aux_grad_scale=1.0).loss.backward()
    unit = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(inputs, labels, aux_grad_scale=0.25).loss * 0.25).backward()
    for u, (name, param) in zip(unit, model.named_parameters()):
        torch.testing.assert_close(param.grad, 0.25 * u, rtol=1e-5, atol=1e-8, msg=name)
