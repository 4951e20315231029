"""`python -m moe_train.plan`: layout checks, per-rank parameters and memory, traffic formula."""
from pathlib import Path

import pytest
import torch

from benchmarks.dispatch_volume import simulated_traffic
from model.args import ModelArgs
from model.block import DecoderLayer
from model.flops import count_parameters
from model.rope import RotaryEmbedding
from moe_train import plan
from moe_train.config import load_config
from moe_train.plan_stages import embedding_parameters, layer_activation_elements
from moe_train.plan_traffic import dispatch_record_bytes, expected_routing, payload_bytes
from parallel.dispatch import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE
from parallel.pipeline.builders import build
from parallel.pipeline.timeline import simulate

CONFIGS = Path(__file__).resolve().parents[2] / "moe_train" / "configs"
DSV3 = str(CONFIGS / "dsv3_671b.yaml")
TINY = str(CONFIGS / "tiny.yaml")


def test_dsv3_fits_256_nodes_of_8_x_80_gib_with_recomputation(capsys):
    code = plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8", "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "every decoder layer recomputed in backward" in out
    assert "pp 16 x dp 128; ep 64 (8 node(s) per EP group), expert-dp 2" in out
    assert "schedule: dualpipe, 16 stages on 16 ranks" in out
    assert "fits: at most" in out


def test_dsv3_without_recomputation_fails_on_activations(capsys):
    code = plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8", "--gpu-memory-gib", "80",
                      "--set", "model.recompute_granularity=null"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--gpu-memory-gib: pp rank(s) 0,15 need" in err and "largest part: activations" in err


@pytest.mark.parametrize("nodes, gpus, key", [(3, 8, "parallel.pp"), (256, 4, "parallel.gpus_per_node")])
def test_impossible_layout_names_the_key(capsys, nodes, gpus, key):
    code = plan.main(["--config", DSV3, "--nodes", str(nodes), "--gpus-per-node", str(gpus)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert f"{key}:" in captured.err


def test_schedule_requirements_are_checked(capsys):
    code = plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8",
                      "--set", "train.global_batch_size=1536"])
    err = capsys.readouterr().err
    assert code == 2 and "parallel.schedule: dualpipe over pp=16 with 12 micro-batches" in err


def test_too_small_gpu_memory_fails(capsys):
    args = ["--config", TINY, "--nodes", "1", "--gpus-per-node", "1"]
    assert plan.main(args + ["--gpu-memory-gib", "8"]) == 0
    assert plan.main(args + ["--gpu-memory-gib", "0.01", "--reserve-gib", "0"]) == 2
    assert "--gpu-memory-gib: pp rank(s) 0 need" in capsys.readouterr().err


def test_rank_parameters_sum_to_the_model_total():
    config = load_config(TINY, ["parallel.pp=4", "parallel.ep=2"])
    result = plan.make_plan(config, nodes=2, gpus_per_node=4)
    total = count_parameters(config.model).total_with_mtp
    embedding_copy = embedding_parameters(config.model)  # the last stage's copy for MTP
    assert sum(r.dense_params + r.expert_params * 2 for r in result.ranks) - embedding_copy == total
    assert sum(s.dense_params + s.expert_params for s in result.stages) == total


def test_dualpipe_ranks_hold_two_mirrored_stages_of_dsv3():
    config = load_config(DSV3)
    result = plan.make_plan(config, nodes=256, gpus_per_node=8)
    assert [r.stages for r in result.ranks[:2]] == [(0, 15), (1, 14)]
    total = count_parameters(config.model).total_with_mtp
    assert sum(r.dense_params + r.expert_params * 64 for r in result.ranks) == 2 * total
    assert [len(s.layers) for s in result.stages] == [4] * 15 + [1]


def test_weighted_memory_walk_matches_the_simulator():
    schedule = build("dualpipe", 4, 10)
    timeline = simulate(schedule)
    unit = {stage: (3.0, 0.0) for stage in range(schedule.num_stages)}
    peaks = [plan._peak_activation_bytes(program, unit, 0.0) for program in schedule.programs]
    assert peaks == [3.0 * p for p in timeline.peak_activations]


@pytest.mark.parametrize("moe", [False, True])
def test_activation_estimate_matches_saved_tensors(moe):
    """The per-token formula equals what autograd saves for one fp32 layer (parameters excluded)."""
    args = ModelArgs(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
                     qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, num_moe_experts=16,
                     moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64, moe_router_topk=4,
                     moe_router_num_groups=4, moe_router_group_topk=2)
    torch.manual_seed(0)
    layer, tokens = DecoderLayer(args, moe=moe), 128
    h = torch.randn(1, tokens, args.hidden_size, requires_grad=True)
    cos, sin = RotaryEmbedding(args)(tokens, h.device)
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {h.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(h, cos, sin)
    measured = sum(saved.values()) / 4 / tokens
    assert measured == pytest.approx(layer_activation_elements(args, moe), rel=0.01)


def test_traffic_formula_matches_the_measured_backends():
    """Against the real hierarchical backend's byte counters on the 64-rank DeepSeek-V3 group."""
    args = load_config(DSV3).model
    routing = expected_routing(args, ep=64, gpus_per_node=8)
    tokens = 64 * 16
    for fp8 in (False, True):
        measured, _ = simulated_traffic("hierarchical", 16, fp8, seed=0)
        record = dispatch_record_bytes(args, fp8)
        assert measured[DISPATCH, INTER_NODE] / tokens == pytest.approx(routing.remote_nodes * record, rel=0.05)
        assert measured[DISPATCH, INTRA_NODE] / tokens == pytest.approx(routing.intra_rows * record, rel=0.05)
    bf16 = payload_bytes(args.hidden_size, fp8=False)
    assert measured[COMBINE, INTER_NODE] / tokens == pytest.approx(routing.remote_nodes * bf16, rel=0.05)
    assert measured[COMBINE, INTRA_NODE] / tokens == pytest.approx(routing.intra_rows * bf16, rel=0.05)
