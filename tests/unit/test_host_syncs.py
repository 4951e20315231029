"""The host-sync budget on CPU: the counter itself, the sync-free helpers against plain references,
one MoE layer's forward+backward per dispatcher, and a single-process training step.

The EP 2 x PP 2 training step is pinned in tests/distributed/test_host_syncs.py; the training loop's
one read per step, of the stop vote (moe_train.launch.stop), in tests/unit/test_stop.py.
"""
from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.dispatcher import LocalDispatcher, count_per_expert
from model.layers import _grouped_mm_reference, grouped_weight_grad
from model.moe import MoE
from moe_train.config import load_config
from tests.host_syncs import HostSyncCounter
from moe_train.train import Trainer, read_metrics
from parallel.dispatch import make_dispatcher
from parallel.dispatch.native import NativeDispatcher
from parallel.dispatch.simulated import SimulatedEPGroup
from kernels_cuda.rank_views import rank_views
from tests.unit.emulated_kernels import intranode_group

ROOT = Path(__file__).resolve().parents[2]
ARGS = ModelArgs(hidden_size=32, num_moe_experts=8, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                 moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2)
EP, PER_NODE = 4, 2


def _seeded(seed: int) -> torch.Generator:
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def test_counter_sees_each_kind_of_host_read_and_not_the_sync_free_forms():
    g = _seeded(11)
    x = torch.randn(6, generator=g)
    ids = torch.randint(0, 4, (6,), generator=g)
    total = int(ids.sum())
    with HostSyncCounter() as counter:
        x[0].item(), x.tolist(), x.cpu(), bool(x[0]), int(ids[0]), float(x[0]), range(ids[1])
        x[x > 0], x.nonzero(), torch.bincount(ids), torch.repeat_interleave(ids), ids.unique()
        x[x > 0] = 0.0
    kinds = [s.kind for s in counter.syncs]
    assert kinds == ["item", "tolist", "cpu", "bool", "int", "float", "index", "boolean mask", "nonzero",
                     "bincount", "repeat_interleave", "unique", "boolean mask"]
    assert {s.where.rsplit(":", 1)[0] for s in counter.syncs} == {"tests/unit/test_host_syncs.py"}
    with HostSyncCounter() as counter:
        torch.nonzero_static(x > 0, size=2), torch.repeat_interleave(ids, output_size=total)
        x.masked_fill(x > 0, 0.0), x.index_select(0, ids), torch.argsort(ids, stable=True)
        count_per_expert(ids, 4)
    assert counter.syncs == []


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad.tolist(), bool(grad[0]), grad.sum().item()
        return grad * 2


def test_counter_sees_host_reads_in_a_custom_functions_backward():
    """The autograd engine runs a custom Function's backward without the torch-function modes of the
    thread that called backward(); the counter still sees its reads, each once."""
    x = torch.randn(4, generator=_seeded(13), requires_grad=True)
    with HostSyncCounter() as counter:
        _ReadsInBackward.apply(x).sum().backward()
    assert [s.kind for s in counter.syncs] == ["tolist", "bool", "item"]
    with HostSyncCounter() as counter:
        _ReadsInBackward.apply(x).sum()
    assert counter.syncs == []


def test_count_per_expert_equals_bincount_and_skips_minus_one():
    g = _seeded(12)
    ids = torch.randint(-1, 8, (50, 3), generator=g)
    want = torch.bincount(ids[ids >= 0], minlength=8)
    assert torch.equal(count_per_expert(ids, 8), want)
    assert torch.equal(count_per_expert(ids.int(), 8), want)


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 0, 0]], ids=["one-empty-group", "no-rows"])
def test_grouped_mm_fallbacks_equal_per_group_matmuls_without_host_syncs(sizes):
    g = _seeded(13)
    rows, k, n = sum(sizes), 16, 8
    x, grad_out = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    weight_t = torch.randn(len(sizes), k, n, generator=g)
    offsets = torch.tensor(sizes).cumsum(0).int()
    with HostSyncCounter() as counter:
        out = _grouped_mm_reference(x, weight_t, offsets)
        grad_w = grouped_weight_grad(grad_out, x, offsets)
    assert counter.syncs == []
    starts = [0, *offsets.tolist()[:-1]]
    want = [x[s:s + m] @ weight_t[i] for i, (s, m) in enumerate(zip(starts, sizes))]
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-6, atol=1e-6)
    want_w = torch.stack([grad_out[s:s + m].t() @ x[s:s + m] for s, m in zip(starts, sizes)])
    torch.testing.assert_close(grad_w, want_w, rtol=1e-6, atol=1e-6)


def _moe_layer_syncs(rank: int, dispatcher) -> list:
    """One MoE layer's training forward and backward on fresh random tokens; the syncs of the model and
    parallel code (the emulated kernels and the simulated network are not counted: on a GPU they are kernels)."""
    torch.manual_seed(100 + rank)
    moe = MoE(ARGS, dispatcher).train()
    g = _seeded(200 + rank)
    x = torch.randn(2, 8, ARGS.hidden_size, generator=g, requires_grad=True)
    grad = torch.randn(2, 8, ARGS.hidden_size, generator=g)
    with HostSyncCounter() as counter:
        moe(x, aux_grad_scale=1.0).backward(grad)
    assert x.grad is not None and moe.experts.gate_up_proj.weight.grad is not None
    return [s for s in counter.syncs if s.where.startswith(("model/", "parallel/"))]


def test_moe_layer_syncs_only_for_the_split_sizes_of_each_all_to_all():
    assert _moe_layer_syncs(0, LocalDispatcher()) == []
    for name, hops in (("alltoall", 1), ("hierarchical", 2)):
        results = SimulatedEPGroup(EP, PER_NODE).run(
            lambda rank, comms: _moe_layer_syncs(rank, make_dispatcher(name, comms, ARGS.num_moe_experts)))
        for rank, syncs in enumerate(results):
            assert [(s.kind, s.where.split(":")[0]) for s in syncs] == [("tolist", "parallel/dispatch/base.py")] * hops, (
                name, rank, syncs)
    views = rank_views(intranode_group(EP, ARGS.hidden_size * 4, ARGS.moe_router_topk), EP, timeout_s=30)
    results = SimulatedEPGroup(EP, PER_NODE).run(lambda rank, _comms: _moe_layer_syncs(
        rank, NativeDispatcher(lambda _sizes: views[rank], ARGS.num_moe_experts, EP, rank, PER_NODE)))
    assert results == [[]] * EP  # the kernels' own host wait for the receive counts is the one left


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_single_process_step_syncs_only_to_read_its_metrics(tmp_path, moment_dtype):
    """With the EMA of the parameters on: its copy to the host (pinned and non_blocking on CUDA) and its
    background update add none; with either AdamW."""
    config = load_config(ROOT / "moe_train/configs/tiny.yaml", [
        f"data.cache_dir={tmp_path / 'cache'}", "data.demo_max_bytes=300000", f"logging.dir={tmp_path / 'run'}",
        "logging.tensorboard=false", "checkpoint.resume=none", "optim.ema_decay=0.9",
        f"optim.moment_dtype={moment_dtype}"])
    trainer = Trainer(config)
    with HostSyncCounter() as counter:
        steps = [trainer.train_step() for _ in range(3)]
    assert counter.syncs == [], counter.report()
    with HostSyncCounter() as counter:
        records = read_metrics(steps)
    assert [s.kind for s in counter.syncs] == ["tolist"]
    assert [r["step"] for r in records] == [1, 2, 3] and all(isinstance(r["grad_norm"], float) for r in records)


def test_worst_case_receive_buffer_of_the_671b_recipe_is_3_5_gib_per_moe_layer():
    """The README's reason for not using num_worst_tokens: every token of every EP rank, in BF16."""
    config = load_config(ROOT / "moe_train/configs/dsv3_671b.yaml")
    rows = config.train.micro_batch_size * config.train.seq_length * config.parallel.ep
    assert rows == 4096 * 64
    assert rows * config.model.hidden_size * 2 / 2**30 == pytest.approx(3.5)
