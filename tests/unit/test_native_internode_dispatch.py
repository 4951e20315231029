"""The `native` dispatcher over the internode (two-hop) kernels on the CPU emulation
(`kernels_cuda.EmulatedInternodeGroup` behind `kernels_cuda.rank_views`, one thread per rank), compared
with the `hierarchical` backend: outputs, autograd (both gradients), cached reuse, per-hop byte
counters, buffer sizing; then the errors of `make_dispatcher` and of the start-up where `native`
cannot run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels_cuda
from kernels_cuda import constants
from kernels_cuda.config import InternodeConfig
from kernels_cuda.rank_views import rank_views
from moe_train.config import ConfigError, load_config
from moe_train.preflight.start_up import choose_dispatcher
from moe_train.train import EXIT_BAD_INPUT, main
from parallel import dispatch as pd
from parallel.dispatch import DispatcherUnavailable, EPComms, HierarchicalDispatcher, NativeDispatcher, make_dispatcher
from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.handles import OverlapSwitch
from parallel.dispatch.layout import compute_layout
from parallel.dispatch.native import BufferSizes
from parallel.dispatch.simulated import SimulatedEPGroup
from tests.unit.emulated_kernels import internode_group

N, H, K = 10, 128, 3
TINY = "moe_train/configs/tiny.yaml"
TIMEOUT_S = 30  # every collective of a simulated rank; a hang fails the test instead of blocking it


def _inputs(rank: int, num_experts: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = torch.rand(N, K, generator=g).requires_grad_()
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(N)])
    idx[torch.rand(N, K, generator=g) < 0.2] = -1
    idx[3] = -1  # a token with no expert at all
    return x, w, idx


def _step(d, rank: int, num_experts: int, dtype: torch.dtype = torch.float32):
    """One MoE-like forward/backward through dispatcher `d`; everything a test compares."""
    x, w, idx = _inputs(rank, num_experts, dtype)
    recv_x, recv_idx, recv_w, counts, handle = d.dispatch(x, idx, w, d.layout(idx, num_experts))
    scale = (recv_w * (recv_idx + 2)).sum(1, keepdim=True).to(recv_x.dtype)  # uses ids and weights
    out = d.combine(recv_x * scale, handle)
    (out.float() * torch.arange(H).float()).sum().backward()
    return [recv_x.detach(), recv_idx, recv_w.detach(), counts, out.detach(), x.grad, w.grad,
            dict(d.traffic.rows), dict(d.traffic.bytes)]


def _native_views(nodes: int, gpus: int):
    group = internode_group(nodes, gpus, H * 4, K)
    return group, rank_views(group, nodes * gpus, timeout_s=TIMEOUT_S)


def _run(nodes: int, gpus: int, body):
    return SimulatedEPGroup(nodes * gpus, gpus, timeout_s=TIMEOUT_S).run(body)


def _run_native(nodes: int, gpus: int, fp8: bool = False, dtype: torch.dtype = torch.float32):
    R, E = nodes * gpus, 2 * nodes * gpus
    group, views = _native_views(nodes, gpus)
    made: list[list[BufferSizes]] = [[] for _ in range(R)]

    def body(rank, _comms):
        def factory(sizes):
            made[rank].append(sizes)
            return views[rank]

        return _step(NativeDispatcher(factory, E, R, rank, gpus, fp8, InternodeConfig()), rank, E, dtype)

    return _run(nodes, gpus, body), group, made


def _run_hierarchical(nodes: int, gpus: int, fp8: bool = False, dtype: torch.dtype = torch.float32):
    E = 2 * nodes * gpus
    return _run(nodes, gpus, lambda rank, comms: _step(
        HierarchicalDispatcher(comms.intra_node, comms.rail, E, fp8), rank, E, dtype))


@pytest.mark.parametrize("nodes,gpus,fp8,dtype", [
    (2, 2, False, torch.float32), (2, 2, True, torch.float32), (2, 2, False, torch.bfloat16),
    (4, 1, False, torch.float32), (2, 4, False, torch.float32),
], ids=["2x2", "2x2-fp8", "2x2-bf16", "4x1", "2x4"])
def test_native_internode_matches_hierarchical(nodes, gpus, fp8, dtype):
    native, group, made = _run_native(nodes, gpus, fp8, dtype)
    reference = _run_hierarchical(nodes, gpus, fp8, dtype)
    names = ["recv_x", "recv_idx", "recv_w", "counts", "combined", "x.grad", "w.grad", "rows", "bytes"]
    exact = {"recv_x", "recv_idx", "recv_w"}
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # sums in another order, rounded to the payload dtype
    for rank, (got, want) in enumerate(zip(native, reference)):
        for name, a, b in zip(names, got, want):
            if isinstance(a, dict):
                assert a == b, f"rank {rank}: traffic {name}"
            elif isinstance(a, list):  # the received slots per expert, a host list
                assert a == b, f"rank {rank}: {name}"
            elif name in exact:
                assert torch.equal(a, b), f"rank {rank}: {name}"
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance,
                                           msg=f"rank {rank}: {name}")
    # forward: dispatch + combine; backward: combine's backward reuses the handle (cached dispatch),
    # dispatch's backward is a combine carrying the weights; the layout is pure torch before the buffer
    assert group.calls == ["dispatch", "combine", "cached_dispatch", "combine"]
    rdma, nvl = InternodeConfig().buffer_size_hints(nodes, gpus, H * max(dtype.itemsize, 2), K)
    assert made == [[BufferSizes(nvl, rdma)]] * (nodes * gpus)  # one buffer per rank, reused by every call


def test_dispatch_counts_one_record_per_node_then_the_forwarders_copies():
    """The counters against an oracle built from every rank's routing, not from another backend."""
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 2 * nodes * gpus
    _, views = _native_views(nodes, gpus)

    def body(rank, _comms):
        d = NativeDispatcher(lambda _sizes: views[rank], E, R, rank, gpus, config=InternodeConfig())
        x, w, idx = _inputs(rank, E)
        with torch.no_grad():
            d.dispatch(x, idx, w, d.layout(idx, E))
        return dict(d.traffic.rows)

    rows = _run(nodes, gpus, body)
    in_rank = [compute_layout(_inputs(r, E)[2], E, R, gpus).is_token_in_rank.view(N, nodes, gpus) for r in range(R)]
    for rank in range(R):
        node, gpu = divmod(rank, gpus)
        other_nodes = [m for m in range(nodes) if m != node]
        inter = int(in_rank[rank].any(-1)[:, other_nodes].sum())
        # as forwarder of rail `gpu` on `node`: the tokens of ranks (m, gpu) bound for the other GPUs here
        other_gpus = [j for j in range(gpus) if j != gpu]
        intra = sum(int(in_rank[m * gpus + gpu][:, node, other_gpus].sum()) for m in range(nodes))
        assert rows[rank] == {(pd.DISPATCH, pd.INTER_NODE): inter, (pd.DISPATCH, pd.INTRA_NODE): intra}
        assert inter < int(in_rank[rank][:, other_nodes].sum())  # fewer records than (token, rank) pairs


def test_dispatch_hands_the_buffer_the_tokens_per_node():
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 2 * nodes * gpus
    _, views = _native_views(nodes, gpus)
    seen: list = [None] * R

    class Recording:
        def __init__(self, view):
            self.view = view

        def get_dispatch_layout(self, *args, **kwargs):
            return self.view.get_dispatch_layout(*args, **kwargs)

        def dispatch(self, x, **kwargs):
            seen[self.view.rank] = kwargs
            return self.view.dispatch(x, **kwargs)

    def body(rank, _comms):
        d = NativeDispatcher(lambda _sizes: Recording(views[rank]), E, R, rank, gpus, config=InternodeConfig())
        x, w, idx = _inputs(rank, E)
        with torch.no_grad():
            d.dispatch(x, idx, w, d.layout(idx, E))
        return compute_layout(idx, E, R, gpus)

    layouts = _run(nodes, gpus, body)
    for kwargs, want in zip(seen, layouts):
        assert kwargs["num_tokens_per_rdma_rank"].dtype == torch.int32
        assert torch.equal(kwargs["num_tokens_per_rdma_rank"].long(), want.num_tokens_per_node)
        assert torch.equal(kwargs["num_tokens_per_rank"].long(), want.num_tokens_per_rank)


def test_buffer_is_recreated_for_wider_rows_and_layout_comes_from_it():
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 2 * nodes * gpus
    group, views = _native_views(nodes, gpus)
    sizes: list[list[BufferSizes]] = [[] for _ in range(R)]

    def body(rank, _comms):
        def factory(needed):
            sizes[rank].append(needed)
            return views[rank]

        d = NativeDispatcher(factory, E, R, rank, gpus, config=InternodeConfig(num_sms=8))
        x, w, idx = _inputs(rank, E, torch.bfloat16)
        with torch.no_grad():
            recv_x, _, _, _, handle = d.dispatch(x, idx, w, d.layout(idx, E))
            out = d.combine(recv_x.float(), handle)  # float32 rows: a larger buffer, the same handle
        layout = d.layout(idx, E)  # from the buffer now
        want = compute_layout(idx, E, R, gpus)
        for field in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "num_tokens_per_node"):
            assert torch.equal(getattr(layout, field), getattr(want, field)), field
        return out

    outs = _run(nodes, gpus, body)
    config = InternodeConfig(num_sms=8)
    (rdma2, nvl2), (rdma4, nvl4) = (config.buffer_size_hints(nodes, gpus, H * b, K) for b in (2, 4))
    assert sizes == [[BufferSizes(nvl2, rdma2), BufferSizes(nvl4, rdma4)]] * R
    assert group.calls[-R:] == ["layout"] * R
    for rank in range(R):
        x, _, idx = _inputs(rank, E, torch.bfloat16)
        in_rank = compute_layout(idx, E, R, gpus).is_token_in_rank
        torch.testing.assert_close(outs[rank], x.detach().float() * in_rank.sum(1, keepdim=True))


def _group_comms(ep: int, per_node: int, rank: int = 0) -> EPComms:
    def comm(size, r):
        c = ProcessGroupComm.__new__(ProcessGroupComm)
        c.group, c.size, c.rank, c.switch = f"group{size}", size, r, OverlapSwitch()
        return c

    return EPComms(comm(ep, rank), comm(per_node, rank % per_node), comm(ep // per_node, rank // per_node))


def _pretend_built(monkeypatch, with_nvshmem: bool, one_machine: bool = False) -> None:
    """As on a GPU machine with the CUDA build (and NVSHMEM or not)."""
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None)
    monkeypatch.setattr(kernels_cuda, "require_built", lambda: SimpleNamespace(with_nvshmem=with_nvshmem))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pd, "job_on_one_machine", lambda: one_machine)


@pytest.fixture
def native_can_run(monkeypatch):
    _pretend_built(monkeypatch, with_nvshmem=True)


def test_make_dispatcher_builds_internode_buffers_with_the_sm_budget(native_can_run, monkeypatch):
    created = []

    class FakeBuffer:
        def __init__(self, group, num_nvl_bytes, num_rdma_bytes=0, *, ranks_per_node=None, config=None, device=None):
            created.append((group, num_nvl_bytes, num_rdma_bytes, ranks_per_node, config, device))

    monkeypatch.setattr(kernels_cuda, "Buffer", FakeBuffer)
    d = make_dispatcher("native", _group_comms(8, 4, rank=5), 16, fp8=True, comm_sms=8)
    assert isinstance(d, NativeDispatcher) and d.internode
    assert (d.num_ranks, d.rank, d.ranks_per_node, d.fp8, d.config) == (8, 5, 4, True, InternodeConfig(num_sms=8))
    x = torch.randn(N, H, dtype=torch.bfloat16)
    d.buffer_for(x, K)
    rdma, nvl = InternodeConfig(num_sms=8).buffer_size_hints(2, 4, H * 2, K)
    assert created == [("group8", nvl, rdma, 4, InternodeConfig(num_sms=8), "cuda")]
    d.buffer_for(x, K)
    assert len(created) == 1


def test_make_dispatcher_needs_nvshmem_across_machines_only(monkeypatch):
    _pretend_built(monkeypatch, with_nvshmem=False)
    with pytest.raises(DispatcherUnavailable, match="without NVSHMEM.*between machines.*use 'hierarchical'$"):
        make_dispatcher("native", _group_comms(4, 2), 8)
    assert not make_dispatcher("native", _group_comms(4, 4), 8).internode
    _pretend_built(monkeypatch, with_nvshmem=False, one_machine=True)  # simulated nodes: CUDA IPC for both hops
    assert make_dispatcher("native", _group_comms(4, 2), 8).internode


@pytest.mark.parametrize("env,one_machine", [
    ({}, True),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, True),
    ({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, False),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "h"}, False),
    ({"RANK": "x", "WORLD_SIZE": "16"}, False),  # unreadable: assume machines differ
])
def test_job_on_one_machine_reads_the_launcher(monkeypatch, env, one_machine):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                "SLURM_TASKS_PER_NODE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert pd.job_on_one_machine() is one_machine


def test_make_dispatcher_refuses_what_the_internode_kernels_cannot_reach(native_can_run):
    gpus = constants.MAX_NVL_PEERS * 2
    with pytest.raises(DispatcherUnavailable, match=f"2 x {gpus}; use 'hierarchical'"):
        make_dispatcher("native", _group_comms(2 * gpus, gpus), 2 * gpus)


def _not_built(monkeypatch) -> None:
    monkeypatch.setattr(kernels_cuda, "build_problem",
                        lambda device: f"kernels_cuda for {device} is not built (test); build it with <command>")


def test_make_dispatcher_without_the_kernels_points_to_hierarchical(monkeypatch):
    _not_built(monkeypatch)
    for device in ("cuda", "cpu"):
        with pytest.raises(DispatcherUnavailable, match=f"for {device} is not built.*<command>.*use 'hierarchical'$"):
            make_dispatcher("native", _group_comms(4, 2), 8, device=device)  # across nodes: hierarchical only
        with pytest.raises(DispatcherUnavailable, match="use 'alltoall' or 'hierarchical'$"):
            make_dispatcher("native", _group_comms(4, 4), 8, device=device)
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DispatcherUnavailable, match="no CUDA device.*'hierarchical'"):
        make_dispatcher("native", _group_comms(4, 2), 8)


def test_on_the_cpu_native_needs_every_rank_on_this_machine(monkeypatch):
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None)
    monkeypatch.setattr(pd, "job_on_one_machine", lambda: False)
    with pytest.raises(DispatcherUnavailable, match="shared memory between the processes of one machine"):
        make_dispatcher("native", _group_comms(4, 2), 8, device="cpu")
    monkeypatch.setattr(pd, "job_on_one_machine", lambda: True)
    assert make_dispatcher("native", _group_comms(4, 2), 8, device="cpu").internode


def test_config_accepts_native_on_every_device():
    for device in ("cpu", "cuda", "auto"):
        assert load_config(TINY, ["parallel.dispatcher=native", f"train.device={device}"]).parallel.dispatcher == "native"


def _topology(ep: int, ep_nodes: int) -> SimpleNamespace:
    return SimpleNamespace(ep=ep, ep_nodes=ep_nodes)


def test_start_up_refuses_native_where_it_cannot_run(monkeypatch):
    _not_built(monkeypatch)
    config = load_config(TINY, ["parallel.dispatcher=native", "train.device=cpu"])
    for topology in (None, _topology(4, 2), _topology(4, 1)):
        with pytest.raises(ConfigError) as err:
            choose_dispatcher(config, topology)
        (key, message), = err.value.problems
        assert key == "parallel.dispatcher" and "for cpu is not built" in message and "<command>" in message
        assert "'hierarchical' for an EP group across nodes" in message


def test_start_up_on_the_cpu_needs_only_the_emulation_build(monkeypatch):
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None if device == "cpu" else "no CUDA build")
    monkeypatch.setattr(pd, "job_on_one_machine", lambda: True)
    config = load_config(TINY, ["parallel.dispatcher=native", "train.device=cpu"])
    assert choose_dispatcher(config, _topology(4, 2)) == "native"


def start_up_error(dispatcher: str, monkeypatch, tmp_path, capsys) -> str:
    """The one line a single-process training run with `dispatcher` prints when it refuses at start-up
    (exit 2, nothing created)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    code = main(["--config", TINY, "--set", f"parallel.dispatcher={dispatcher}", "--set",
                 f"logging.dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
    return err


def test_training_with_native_where_it_cannot_run_stops_before_any_work(monkeypatch, tmp_path, capsys):
    _not_built(monkeypatch)
    err = start_up_error("native", monkeypatch, tmp_path, capsys)
    assert err.startswith("error: parallel.dispatcher: 'native' cannot run here") and "'hierarchical'" in err
    assert "<command>" in err


def test_start_up_accepts_native_where_it_can_run(native_can_run):
    config = load_config(TINY, ["parallel.dispatcher=native", "train.device=cuda"])
    assert choose_dispatcher(config, _topology(4, 2)) == "native"


def test_start_up_refuses_native_across_nodes_without_nvshmem(monkeypatch):
    _pretend_built(monkeypatch, with_nvshmem=False)
    config = load_config(TINY, ["parallel.dispatcher=native", "train.device=cuda"])
    assert choose_dispatcher(config, _topology(4, 1)) == "native"  # inside one node NVSHMEM is not needed
    with pytest.raises(ConfigError) as err:
        choose_dispatcher(config, _topology(4, 2))
    (key, message), = err.value.problems
    assert key == "parallel.dispatcher" and "without NVSHMEM" in message and "'hierarchical'" in message


@pytest.mark.parametrize("built", [False, True])
def test_auto_never_picks_native(monkeypatch, built):
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None if built else "not built")
    config = load_config(TINY)
    assert config.parallel.dispatcher == "auto"
    assert choose_dispatcher(config, None) == "local"
    assert choose_dispatcher(config, _topology(1, 1)) == "local"
    assert choose_dispatcher(config, _topology(4, 2)) == "hierarchical"
    assert choose_dispatcher(config, _topology(4, 1)) == "alltoall"


def test_a_too_small_buffer_is_destroyed_collectively_before_its_successor_is_made():
    events = []

    class RecordingBuffer:
        def __init__(self, sizes):
            self.id = len([e for e in events if e[0] == "make"]) + 1
            events.append(("make", self.id, sizes))

        def destroy(self):
            events.append(("destroy", self.id))

    d = NativeDispatcher(RecordingBuffer, 16, 4, 0, 2, config=InternodeConfig(num_sms=4))
    d.buffer_for(torch.randn(N, H, dtype=torch.bfloat16), K)
    d.buffer_for(torch.randn(N, H, dtype=torch.bfloat16), K)  # fits: kept
    d.buffer_for(torch.randn(N, H), K)  # float32 rows need more
    assert [e[:2] for e in events] == [("make", 1), ("destroy", 1), ("make", 2)]
    assert events[0][2].rdma_bytes < events[2][2].rdma_bytes


@pytest.mark.parametrize("nodes", range(2, constants.MAX_RDMA_PEERS + 1))
def test_the_internode_config_for_any_node_count_is_valid(nodes):
    config = InternodeConfig.for_nodes(nodes, num_sms=24)
    assert config.validate(nodes, 8, 7168 * 2, 8, 8) is None, config
    assert config.nvl_capacity <= InternodeConfig().nvl_capacity and config.num_sms == 24
    if InternodeConfig().nvl_capacity % nodes == 0:
        assert config == InternodeConfig(num_sms=24)


def test_make_dispatcher_gives_five_nodes_a_valid_config(native_can_run):
    d = make_dispatcher("native", _group_comms(10, 2), 20, comm_sms=8)
    assert d.config.validate(5, 2, H * 2, K, 2) is None and d.config.nvl_capacity == 285
