"""Router invariants, the balance loss and the bias update, against independent restatements."""
import pytest
import torch

from model.args import ModelArgs
from model.router import Router, expert_bias_update, select_experts, sequence_balance_loss


def reference_selection(scores, bias, topk, groups, keep):
    """Per-token restatement of DeepSeek-V3's noaux_tc selection with plain Python lists."""
    selections = []
    for s_row, b_row in zip(scores.tolist(), bias.tolist()):
        biased = [s + b for s, b in zip(s_row, b_row)]
        per = len(biased) // groups
        group_score = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: group_score[g], reverse=True)[:keep]
        candidates = [e for e in range(len(biased)) if e // per in kept]
        selections.append(set(sorted(candidates, key=lambda e: biased[e], reverse=True)[:topk]))
    return selections


@pytest.mark.parametrize("experts,groups,keep,topk", [(16, 4, 2, 4), (32, 8, 4, 8), (8, 1, 1, 2)])
def test_selection_matches_reference_and_group_limit(experts, groups, keep, topk):
    gen = torch.Generator().manual_seed(experts + topk)
    scores = torch.rand(200, experts, generator=gen)
    bias = (torch.rand(experts, generator=gen) - 0.5) * 0.4
    idx = select_experts(scores, bias, topk, groups, keep)
    expected = reference_selection(scores, bias.expand(200, -1), topk, groups, keep)
    assert [set(row) for row in idx.tolist()] == expected
    per = experts // groups
    assert all(len({e // per for e in row}) <= keep for row in idx.tolist())


def test_masked_groups_use_minus_infinity_not_zero():
    # Biased scores are all negative; a 0.0 fill would let dropped-group experts win the top-k.
    scores = torch.full((1, 8), 0.1)
    scores[0, :2] = 0.3  # group 0 (experts 0-3) is the only one kept with keep=1
    bias = torch.full((8,), -1.0)
    idx = select_experts(scores, bias, topk=4, num_groups=2, group_topk=1)
    assert set(idx[0].tolist()) == {0, 1, 2, 3}


def test_router_weights_come_from_unbiased_scores_and_sum_to_scaling():
    args = ModelArgs(hidden_size=32, num_moe_experts=16, moe_router_topk=4, moe_router_num_groups=4,
                     moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
    router = Router(args)
    router.e_score_correction_bias.uniform_(-0.3, 0.3)
    x = torch.randn(64, 32)
    out = router(x)
    assert torch.allclose(out.topk_weights.sum(-1), torch.full((64,), 2.5), atol=1e-5)
    scores = torch.sigmoid(x @ router.weight.t())
    picked = scores.gather(1, out.topk_idx)
    assert torch.allclose(out.topk_weights, 2.5 * picked / picked.sum(-1, keepdim=True), atol=1e-6)
    # the bias changes the selection for some tokens (otherwise the test would not exercise it)
    unbiased = select_experts(scores, None, 4, 4, 2)
    assert any(set(a) != set(b) for a, b in zip(out.topk_idx.tolist(), unbiased.tolist()))


def test_router_counts_expert_load_in_training_only():
    args = ModelArgs(hidden_size=16)
    router = Router(args)
    x = torch.randn(10, 16)
    router.eval()
    router(x)
    assert router.expert_load.sum() == 0
    router.train()
    out = router(x)
    expected = torch.bincount(out.topk_idx.flatten(), minlength=args.num_moe_experts).float()
    assert torch.equal(router.expert_load, expected)
    assert "e_score_correction_bias" in router.state_dict()
    assert "expert_load" not in router.state_dict()
    assert all(p is not router.e_score_correction_bias for p in router.parameters())


def test_bias_update_signs():
    load = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6
    delta = expert_bias_update(load, 0.01)
    assert delta.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    router = Router(ModelArgs(hidden_size=8, num_moe_experts=4, moe_router_num_groups=1, moe_router_topk=2))
    router.apply_bias_update(load, 0.5)
    assert router.e_score_correction_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_balance_loss_hand_computed():
    # 2 sequences of 2 tokens, 4 experts, top-1.
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5], [0.2, 0.8, 0.4, 0.6],
                           [0.3, 0.3, 0.3, 0.1], [0.7, 0.2, 0.2, 0.9]])
    idx = torch.tensor([[0], [1], [0], [3]])
    alpha = 0.1
    total = 0.0
    for seq in range(2):
        rows = scores[2 * seq:2 * seq + 2]
        norm = rows / rows.sum(-1, keepdim=True)
        for i in range(4):
            hits = sum(1 for t in range(2) if i in idx[2 * seq + t].tolist())
            f_i = 4 / (1 * 2) * hits
            p_i = norm[:, i].mean().item()
            total += f_i * p_i
    expected = alpha * total / 2
    assert sequence_balance_loss(scores, idx, num_sequences=2, coeff=alpha).item() == pytest.approx(expected)


def test_balance_loss_gradient_only_through_scores():
    scores = torch.rand(6, 8, requires_grad=True)
    idx = select_experts(scores, None, 2, 1, 1)
    loss = sequence_balance_loss(scores, idx, 3, 1.0)
    loss.backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0
    # uniform routing and uniform scores give the minimum value alpha * 1 for any top-k
    uniform = torch.full((4, 4), 0.5)
    each_once = torch.arange(4)[:, None]
    assert sequence_balance_loss(uniform, each_once, 1, 1.0).item() == pytest.approx(1.0)
