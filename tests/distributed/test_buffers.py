"""Per-process `kernels_cuda.Buffer`s on the CPU emulation: one rank per gloo worker, each rank's regions
in shared memory mapped by its peers (handles exchanged over gloo), against the pure-torch reference of
all ranks; bad input refused before any kernel runs; a rank killed mid-dispatch makes the survivors
fail by their kernels' timeouts, naming the wait, and leaves no shared memory behind; the `deepep`
dispatcher's wiring over kernels_cuda.deep_ep (DeepEP's API over our buffer); the low-latency
ops of `Buffer(..., low_latency_mode=True)` between processes against the reference over gloo."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kernels_cuda import Schedule
from tests.kernels.buffer_checks import HIDDEN, TOKENS, check_buffer, make_buffer, rank_inputs

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_CYCLES = 60_000_000_000  # 30 s of wall clock: processes time-slice 2 cores
LAYOUTS = [(2, 2), (4, 4), (2, 1), (4, 2)]
LAYOUT_IDS = ["intranode-2", "intranode-4", "internode-2x1", "internode-2x2"]


def checked_rank(gpus_per_node: int, seed: int, policy: str) -> str:
    schedule = Schedule(policy=policy, seed=seed * 16 + dist.get_rank())  # each rank its own interleavings
    print(f"rank {dist.get_rank()}: inputs seed {seed}, schedule {schedule}")
    return check_buffer(gpus_per_node, "cpu", seed, TIMEOUT_CYCLES, schedule)


@pytest.mark.parametrize("policy, seed", [("pct", 31), ("random", 32)])
@pytest.mark.parametrize("world, gpus_per_node", LAYOUTS, ids=LAYOUT_IDS)
def test_per_process_buffers_match_the_reference(pools, kernels_cpu, world, gpus_per_node, policy, seed):
    results = pools.get(world).run(checked_rank, gpus_per_node, seed, policy, deadline_s=120)
    assert results == [f"OK rank {r}" for r in range(world)]


def bad_inputs_then_a_good_dispatch(gpus_per_node: int) -> list[str]:
    """Every rank makes bad calls (each refused before a kernel runs, so no peer waits for it), then
    one good dispatch must still work on every rank."""
    world = dist.get_world_size()
    x, topk, w, experts = rank_inputs(41, "cpu")
    buffer = make_buffer(world, gpus_per_node, "cpu", TIMEOUT_CYCLES)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    messages = []
    bad_calls = [
        lambda: buffer.get_dispatch_layout(topk.int(), experts),
        lambda: buffer.dispatch(x[:, :100], topk_idx=topk, topk_weights=w, **layout),  # 200-byte rows
        lambda: buffer.dispatch(x, topk_idx=topk[:-1], topk_weights=w[:-1], **layout),
        lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=w, **{**layout, "is_token_in_rank": None}),
        lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=w, allocate_on_comm_stream=True, **layout),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError) as caught:
            call()
        messages.append(str(caught.value))
    recv = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    with pytest.raises(ValueError, match="rows the dispatch received"):
        buffer.combine(recv[0][1:], recv[4])
    buffer.combine(recv[0], recv[4], topk_weights=recv[2])
    buffer.destroy()
    return messages


@pytest.mark.parametrize("world, gpus_per_node", [(2, 2), (4, 2)], ids=["intranode-2", "internode-2x2"])
def test_bad_input_is_refused_before_any_kernel_runs(pools, kernels_cpu, world, gpus_per_node):
    messages = pools.get(world).run(bad_inputs_then_a_good_dispatch, gpus_per_node, deadline_s=120)[0]
    assert "topk_idx must be int64" in messages[0]
    assert "multiple of 16 bytes" in messages[1]
    assert "topk_idx must be [num_tokens, num_topk]" in messages[2]
    assert "needs is_token_in_rank" in messages[3]
    assert "allocate_on_comm_stream=True needs previous_event" in messages[4]


def _our_shared_memory() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


@pytest.mark.parametrize("world, gpus_per_node", [(2, 2), (4, 2)], ids=["intranode-2", "internode-2x2"])
def test_a_rank_killed_mid_dispatch_fails_its_peers_by_timeout(kernels_cpu, tmp_path, world, gpus_per_node):
    timeout_cycles = 4_000_000_000  # 2 s of wall clock
    before = _our_shared_memory()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    logs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.buffer_fault_worker", str(r), str(world),
                               str(gpus_per_node), str(tmp_path / "rendezvous"), str(timeout_cycles)], cwd=ROOT,
                              env=env, stdout=out.open("w"), stderr=err.open("w")) for r, (out, err) in enumerate(logs)]
    try:
        deadline = time.monotonic() + 90
        while not all("looping" in out.read_text() for out, _ in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                "\n".join(err.read_text()[-2000:] for _, err in logs)
            time.sleep(0.1)
        time.sleep(1.0)  # every rank is deep in its dispatch/combine loop
        victim = world - 1
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for proc in procs[:victim]:
            proc.wait(timeout=60)
        waited = time.monotonic() - killed_at
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    print(f"survivors exited {waited:.1f} s after the kill")
    for rank in range(victim):
        err = logs[rank][1].read_text()
        assert procs[rank].returncode == 1, f"rank {rank} (rc {procs[rank].returncode}):\n{err[-3000:]}"
        # The error names the waiting role, its rank, the peer and the ring counters it waited on.
        assert re.search(rf"device timeout: role \w+ of rank {rank}( \(channel \d+\))? waited for peer \d+: "
                         r"head=-?\d+ tail=-?\d+", err), err[-3000:]
    assert waited < 30
    assert _our_shared_memory() == before


def deepep_against_alltoall(seed: int) -> dict:
    """The `deepep` dispatcher over kernels_cuda.deep_ep (DeepEP's API: tuple handles, its sizing and SM
    setting) and the `alltoall` backend on the same bfloat16 inputs: outputs, both gradients, traffic."""
    from parallel.dispatch import AllToAllDispatcher
    from parallel.dispatch.comm import ProcessGroupComm
    from parallel.dispatch.deepep import make_deepep_dispatcher
    from tests.kernels.deep_ep_alias import deep_ep_installed

    rank, world = dist.get_rank(), dist.get_world_size()
    experts, k = 4 * world, 3
    print(f"rank {rank}: seed {seed}")
    with deep_ep_installed(8) as deep_ep:
        made = []
        init = deep_ep.Buffer.__init__

        def recording_init(buffer, group, num_nvl_bytes=0, num_rdma_bytes=0, *args, **kwargs):
            made.append((num_nvl_bytes, num_rdma_bytes))
            init(buffer, group, num_nvl_bytes, num_rdma_bytes, *args, **kwargs)

        deep_ep.Buffer.__init__ = recording_init
        try:
            deepep = make_deepep_dispatcher(dist.group.WORLD, experts, world, rank, world, False, comm_sms=4)
            alltoall = AllToAllDispatcher(ProcessGroupComm(dist.group.WORLD), experts, world, False)
            out = {}
            for name, d in (("deepep", deepep), ("alltoall", alltoall)):
                g = torch.Generator().manual_seed(seed * 100 + rank)
                x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16().requires_grad_()
                w = torch.rand(TOKENS, k, generator=g).requires_grad_()
                idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(TOKENS)])
                idx[torch.rand(TOKENS, k, generator=g) < 0.2] = -1
                recv_x, recv_idx, recv_w, counts, handle = d.dispatch(x, idx, w, d.layout(idx, experts))
                scale = (recv_w * (recv_idx + 2)).sum(1, keepdim=True).to(recv_x.dtype)
                y = d.combine(recv_x * scale, handle)
                (y.float() * torch.arange(HIDDEN).float()).sum().backward()
                out[name] = [recv_x.detach(), recv_idx, recv_w.detach(), counts, y.detach(), x.grad, w.grad,
                             dict(d.traffic.bytes)]
            out["made"], out["num_sms"] = made, deep_ep.Buffer.num_sms
        finally:
            deep_ep.Buffer.__init__ = init
    return out


def test_deepep_dispatcher_drives_kernels_cuda_deep_ep(pools, kernels_cpu):
    results = pools.get(4).run(deepep_against_alltoall, 51, deadline_s=120)
    names = ["recv_x", "recv_idx", "recv_w", "counts", "combined", "x.grad", "w.grad", "traffic"]
    for rank, result in enumerate(results):
        for name, got, want in zip(names, result["deepep"], result["alltoall"]):
            if isinstance(got, (dict, list)):
                assert got == want, (rank, name)
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=f"rank {rank} {name}")
        assert result["num_sms"] == 4 and len(result["made"]) == 1 and result["made"][0][1] == 0  # one buffer, no RDMA


def low_latency_rank(world: int, gpus_per_node: int, seed: int) -> bool:
    """This rank's low-latency ops over its per-process buffer equal the reference's over gloo: FP8
    (UE8M0) dispatch and its combine, then a hooked bf16 dispatch and a zero-copy combine."""
    from kernels_cuda import Buffer
    from parallel.dispatch.comm import ProcessGroupComm
    from parallel.dispatch.low_latency import LowLatencyExchange
    from tests.kernels.test_low_latency import (E_PER_RANK, FP8_MODES, H, T_MAX, assert_same, expert_outputs,
                                                inputs_for)

    rank, E = dist.get_rank(), E_PER_RANK * world
    schedule = Schedule(policy="random", seed=seed * 16 + rank)
    print(f"rank {rank}: inputs seed {seed}, schedule {schedule}")
    buffer = Buffer(dist.group.WORLD, 1 << 20, Buffer.get_low_latency_rdma_size_hint(T_MAX, H, world, E),
                    ranks_per_node=gpus_per_node, timeout_cycles=TIMEOUT_CYCLES, device="cpu", schedule=schedule,
                    low_latency_mode=True)
    with pytest.raises(ValueError, match="share memory between the processes of one machine"):
        Buffer(dist.group.WORLD, 1 << 20, 1 << 20, ranks_per_node=gpus_per_node, device="cpu", low_latency_mode=True,
               rdma_transport="nvshmem")  # peers on other machines: NVSHMEM, which the CPU emulation has not
    reference = LowLatencyExchange(ProcessGroupComm(dist.group.WORLD))
    for mode, hooked in (("ue8m0", False), ("bf16", True)):
        fp8 = FP8_MODES[mode]
        x, idx, w = inputs_for("random", world, seed + len(mode))[rank]
        want_stats, stats = torch.zeros(E_PER_RANK, dtype=torch.int32), torch.zeros(E_PER_RANK, dtype=torch.int32)
        want = reference.low_latency_dispatch(x, idx, T_MAX, E, want_stats, *fp8)
        got = buffer.low_latency_dispatch(x, idx, T_MAX, E, stats, *fp8, return_recv_hook=hooked)
        if hooked:
            got[4]()
        want_combined, _, _ = reference.low_latency_combine(expert_outputs(want[0], rank, fp8), idx, w, want[2])
        assert_same([got], [stats], [(want, want_stats, want_combined)], world)
        ys = expert_outputs(got[0], rank, fp8)
        if hooked:
            buffer.get_next_low_latency_combine_buffer(got[2]).copy_(ys)
        combined, _, _ = buffer.low_latency_combine(ys, idx, w, got[2], zero_copy=hooked)
        assert torch.equal(combined, want_combined), f"rank {rank}: {mode} combine differs from the reference"
    buffer.destroy()
    return True


@pytest.mark.parametrize("world, gpus_per_node", [(2, 2), (4, 2)], ids=["intranode-2", "internode-2x2"])
def test_low_latency_buffers_between_processes_match_the_reference(pools, kernels_cpu, world, gpus_per_node):
    assert pools.get(world).run(low_latency_rank, world, gpus_per_node, 61, deadline_s=120) == [True] * world

