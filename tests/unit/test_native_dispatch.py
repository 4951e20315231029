"""The `native` dispatcher over the intranode kernels on the CPU emulation (`kernels_cuda.EmulatedGroup`
behind `kernels_cuda.rank_views`, one thread per rank), compared with the `alltoall` backend: outputs,
autograd (both gradients), handle reuse, byte counters, errors."""
from __future__ import annotations

import pytest
import torch

import kernels_cuda
from kernels_cuda import Config
from kernels_cuda.rank_views import rank_views
from parallel import dispatch as pd
from parallel.dispatch import AllToAllDispatcher, DispatcherUnavailable, EPComms, NativeDispatcher, make_dispatcher
from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.handles import OverlapSwitch
from parallel.dispatch.layout import compute_layout
from parallel.dispatch.native import BufferSizes
from parallel.dispatch.simulated import SimulatedEPGroup
from tests.unit.emulated_kernels import RecordingGroup, intranode_group

R, PER_NODE, E, N, H, K = 4, 2, 8, 12, 128, 3


def _inputs(rank: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = torch.rand(N, K, generator=g).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    idx[torch.rand(N, K, generator=g) < 0.2] = -1
    idx[3] = -1  # a token with no expert at all
    return x, w, idx


def _step(d, rank: int, dtype: torch.dtype = torch.float32):
    """One MoE-like forward/backward through dispatcher `d`; everything a test compares."""
    x, w, idx = _inputs(rank, dtype)
    layout = d.layout(idx, E)
    recv_x, recv_idx, recv_w, counts, handle = d.dispatch(x, idx, w, layout)
    scale = (recv_w * (recv_idx + 2)).sum(1, keepdim=True).to(recv_x.dtype)  # uses ids and weights
    out = d.combine(recv_x * scale, handle)
    (out.float() * torch.arange(H).float()).sum().backward()
    return [recv_x.detach(), recv_idx, recv_w.detach(), counts, out.detach(), x.grad, w.grad,
            dict(d.traffic.rows), dict(d.traffic.bytes)]


def _run_native(fp8: bool = False, dtype: torch.dtype = torch.float32, config: Config | None = None):
    fake = intranode_group(R, H * 4, K)
    views = rank_views(fake, R, timeout_s=30)
    made: list[BufferSizes] = []

    def factory_for(rank):
        def factory(sizes):
            made.append(sizes)
            return views[rank]
        return factory

    def body(rank, _comms):
        return _step(NativeDispatcher(factory_for(rank), E, R, rank, PER_NODE, fp8, config), rank, dtype)

    return SimulatedEPGroup(R, PER_NODE).run(body), fake, made


def _run_alltoall(fp8: bool = False, dtype: torch.dtype = torch.float32):
    return SimulatedEPGroup(R, PER_NODE).run(
        lambda rank, comms: _step(AllToAllDispatcher(comms.ep, E, PER_NODE, fp8), rank, dtype))


@pytest.mark.parametrize("fp8", [False, True])
def test_native_matches_alltoall_forward_backward_and_counters(fp8):
    native, fake, _ = _run_native(fp8)
    reference = _run_alltoall(fp8)
    names = ["recv_x", "recv_idx", "recv_w", "counts", "combined", "x.grad", "w.grad", "rows", "bytes"]
    for rank, (got, want) in enumerate(zip(native, reference)):
        for name, a, b in zip(names, got, want):
            if isinstance(a, dict):
                assert a == b, f"rank {rank}: traffic {name}"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
    # forward: layout (pure torch before the first dispatch) + dispatch + combine; backward: the
    # combine's backward is a cached dispatch, the dispatch's backward a combine carrying weights
    assert fake.calls == ["dispatch", "combine", "cached_dispatch", "combine"]


def test_counters_split_links_and_directions():
    native, _, _ = _run_native()
    rows, nbytes = native[0][7], native[0][8]
    assert set(rows) == {(pd.DISPATCH, pd.INTRA_NODE), (pd.DISPATCH, pd.INTER_NODE),
                         (pd.COMBINE, pd.INTRA_NODE), (pd.COMBINE, pd.INTER_NODE)}
    # dispatch rows travel twice (forward dispatch, combine backward), combine rows twice as well
    x_row, record = H * 4, H * 4 + K * 4 + K * 4
    grad_record = H * 4 + K * 4
    for link in (pd.INTRA_NODE, pd.INTER_NODE):
        d_rows, c_rows = rows[pd.DISPATCH, link], rows[pd.COMBINE, link]
        assert d_rows % 2 == 0 and c_rows % 2 == 0
        assert nbytes[pd.DISPATCH, link] == d_rows // 2 * (record + x_row)
        assert nbytes[pd.COMBINE, link] == c_rows // 2 * (x_row + grad_record)


def test_bfloat16_payload_and_buffer_grows_for_wider_rows():
    fake = intranode_group(R, H * 4, K)
    views = rank_views(fake, R, timeout_s=30)
    sizes: list[list[BufferSizes]] = [[] for _ in range(R)]

    def body(rank, _comms):
        def factory(needed):
            sizes[rank].append(needed)
            return views[rank]

        d = NativeDispatcher(factory, E, R, rank, PER_NODE)
        x, w, idx = _inputs(rank, torch.bfloat16)
        recv_x, _, _, _, handle = d.dispatch(x, idx, w, d.layout(idx, E))
        assert recv_x.dtype == torch.bfloat16
        out = d.combine(recv_x.float(), handle)  # float32 rows need a larger buffer; the handle still serves
        assert out.dtype == torch.float32
        d.layout(idx, E)  # now the buffer's layout is used
        return out

    outs = SimulatedEPGroup(R, PER_NODE).run(body)
    config = Config()
    for rank in range(R):
        assert sizes[rank] == [BufferSizes(config.buffer_size_hint(R, H * 2, K)),
                               BufferSizes(config.buffer_size_hint(R, H * 4, K))]
    assert fake.calls[-R:] == ["layout"] * R
    x0 = _inputs(0, torch.bfloat16)[0].detach().float()
    in_rank = compute_layout(_inputs(0)[2], E, R, R).is_token_in_rank
    torch.testing.assert_close(outs[0], x0 * in_rank.sum(1, keepdim=True))  # each rank sends the row back


def test_layout_matches_the_torch_layout_before_and_after_the_first_dispatch():
    fake = intranode_group(R, H * 4, K)
    views = rank_views(fake, R, timeout_s=30)

    def body(rank, _comms):
        d = NativeDispatcher(lambda _sizes: views[rank], E, R, rank, PER_NODE)
        x, w, idx = _inputs(rank)
        before = d.layout(idx, E)
        d.dispatch(x, idx, w, before)
        after = d.layout(idx, E)
        want = compute_layout(idx, E, R, PER_NODE)
        for lay in (before, after):
            assert torch.equal(lay.num_tokens_per_rank, want.num_tokens_per_rank)
            assert torch.equal(lay.num_tokens_per_expert, want.num_tokens_per_expert)
            assert torch.equal(lay.is_token_in_rank, want.is_token_in_rank)
            assert torch.equal(lay.num_tokens_per_node, want.num_tokens_per_node)
        return True

    assert all(SimulatedEPGroup(R, PER_NODE).run(body))


def test_errors_are_clear():
    d = NativeDispatcher(lambda _sizes: None, E, R, 0, PER_NODE)
    x, w, idx = _inputs(0)
    layout = compute_layout(idx, E, R, PER_NODE)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        d.dispatch(x.detach().half(), idx, w, layout)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        d.dispatch(x.detach()[:, :3], idx, w, layout)
    with pytest.raises(ValueError, match="one row per token"):
        d.dispatch(x[:5], idx, w, layout)
    with pytest.raises(TypeError, match="its own dispatch handle"):
        d.combine(x, object())
    with pytest.raises(ValueError, match="built for 8 experts"):
        d.layout(idx, 16)
    with pytest.raises(ValueError, match="cannot be split"):
        NativeDispatcher(lambda _sizes: None, 6, R, 0, PER_NODE)
    assert d.local_experts(E) == range(0, 2)


def test_a_failing_collective_reaches_every_rank():
    class Broken(RecordingGroup):
        def dispatch(self, *args, **kwargs):
            raise RuntimeError("kernels_cuda: invalid config")

    views = rank_views(Broken(intranode_group(R, H * 4, K).group), R, timeout_s=30)

    def body(rank, _comms):
        d = NativeDispatcher(lambda _sizes: views[rank], E, R, rank, PER_NODE)
        x, w, idx = _inputs(rank)
        with pytest.raises(RuntimeError, match="invalid config"):
            d.dispatch(x, idx, w, d.layout(idx, E))
        return True

    assert all(SimulatedEPGroup(R, PER_NODE).run(body))


@pytest.mark.skipif(kernels_cuda.is_built(), reason="the extension is built here")
def test_make_dispatcher_native_without_the_extension_points_elsewhere():
    comms = SimulatedEPGroup(2, 2).comms[0]
    with pytest.raises(DispatcherUnavailable, match="not built.*hierarchical"):
        make_dispatcher("native", comms, E)


def _fake_group_comms(ep: int, per_node: int) -> EPComms:
    def comm(size, rank):
        c = ProcessGroupComm.__new__(ProcessGroupComm)
        c.group, c.size, c.rank, c.switch = object(), size, rank, OverlapSwitch()
        return c

    return EPComms(comm(ep, 0), comm(per_node, 0), comm(ep // per_node, 0))


def test_make_dispatcher_native_selection(monkeypatch):
    monkeypatch.setattr(kernels_cuda, "build_problem", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    d = make_dispatcher("native", _fake_group_comms(4, 4), E, fp8=True)
    assert isinstance(d, NativeDispatcher) and (d.num_ranks, d.rank, d.fp8) == (4, 0, True)
    with pytest.raises(DispatcherUnavailable, match="5 ranks"):
        make_dispatcher("native", _fake_group_comms(5, 5), 10)
    with pytest.raises(ValueError, match="torch.distributed"):
        make_dispatcher("native", SimulatedEPGroup(2, 2).comms[0], E)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DispatcherUnavailable, match="CUDA device"):
        make_dispatcher("native", _fake_group_comms(4, 4), E)

