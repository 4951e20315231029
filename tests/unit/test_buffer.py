"""kernels_cuda.Buffer without processes: the choice of RDMA transport, the errors that say how to get a
build that has NVSHMEM, its size hints and its argument checks. (Per-process buffers run in
tests/distributed/test_buffers.py on the CPU emulation and in tests/gpu on a GPU; the NVSHMEM transport
needs two or more GPU machines.)"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import kernels_cuda
from kernels_cuda import Buffer, Config, InternodeConfig
from kernels_cuda.internode import check_rdma_transport


def test_one_buffer_is_exported():
    assert "Buffer" in kernels_cuda.__all__ and "InternodeBuffer" not in kernels_cuda.__all__


@pytest.mark.parametrize("ext", [SimpleNamespace(with_nvshmem=False), SimpleNamespace()], ids=["flag", "older build"])
def test_an_extension_built_without_nvshmem_says_how_to_rebuild(ext):
    with pytest.raises(kernels_cuda.KernelsNotBuilt) as error:
        check_rdma_transport("nvshmem", None, ext, "cuda")
    message = str(error.value)
    for part in ("built without NVSHMEM", "MOE_TRAIN_NVSHMEM=1", "nvidia-nvshmem-cu13", "NVSHMEM_HOME", "rebuild",
                 "'hierarchical'"):
        assert part in message


def test_buffer_size_hints_are_the_configs():
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=8, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = InternodeConfig.for_nodes(2).buffer_size_hints(2, 4, 7168 * 2, 8)
    assert Buffer.get_buffer_size_hints(2, 4, 7168 * 2, 8) == (nvl, rdma)
    rdma, nvl = config.buffer_size_hints(4, 2, 1024, 4)
    assert Buffer.get_buffer_size_hints(4, 2, 1024, 4, config) == (nvl, rdma) and rdma > 0 and nvl > 0
    intranode = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
    assert Buffer.get_buffer_size_hints(1, 8, 1024, 4, intranode) == (intranode.buffer_size_hint(8, 1024, 4), 0)


def _hosts(monkeypatch, names: list[str]) -> None:
    """The group's host names as all_gather_object would return them (this rank's first)."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(names))

    def gather(out, obj, group=None):
        assert obj == socket.gethostname()
        out[:] = names

    monkeypatch.setattr(dist, "all_gather_object", gather)


def test_auto_takes_ipc_on_one_machine_and_nvshmem_across_machines(monkeypatch):
    here = socket.gethostname()
    _hosts(monkeypatch, [here] * 4)
    assert check_rdma_transport("auto", None, SimpleNamespace(with_nvshmem=False), "cuda") == "ipc"
    assert check_rdma_transport("auto", None, SimpleNamespace(), "cpu") == "ipc"
    _hosts(monkeypatch, [here, here, here + "-b", here + "-b"])
    assert check_rdma_transport("auto", None, SimpleNamespace(with_nvshmem=True), "cuda") == "nvshmem"
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="built without NVSHMEM"):
        check_rdma_transport("auto", None, SimpleNamespace(with_nvshmem=False), "cuda")
    with pytest.raises(ValueError, match="share memory between the processes of one machine"):
        check_rdma_transport("auto", None, SimpleNamespace(), "cpu")


def test_explicit_transports_and_a_bad_name():
    assert check_rdma_transport("ipc", None, SimpleNamespace(with_nvshmem=False), "cuda") == "ipc"
    assert check_rdma_transport("nvshmem", None, SimpleNamespace(with_nvshmem=True), "cuda") == "nvshmem"
    with pytest.raises(ValueError, match="rdma_transport must be one of auto, ipc, nvshmem, got 'rdma'"):
        check_rdma_transport("rdma", None, SimpleNamespace(with_nvshmem=True), "cuda")


def test_ranks_per_machine_come_from_host_names(monkeypatch):
    from kernels_cuda.buffer import ranks_on_this_machine

    here = socket.gethostname()
    _hosts(monkeypatch, [here] * 4)
    assert ranks_on_this_machine(None) == 4
    _hosts(monkeypatch, [here, here, "b", "b"])
    assert ranks_on_this_machine(None) == 2
    _hosts(monkeypatch, [here, "b", here, "b"])
    with pytest.raises(ValueError, match="must be consecutive"):
        ranks_on_this_machine(None)
