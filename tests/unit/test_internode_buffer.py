"""kernels_cuda.InternodeBuffer without GPUs: the choice of RDMA transport, the errors that say how to get
a build that has NVSHMEM, and its size hints. (Running it needs a GPU: tests/gpu runs the IPC transport
as processes on one GPU; the NVSHMEM transport needs two or more GPU machines.)"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import kernels_cuda
from kernels_cuda import InternodeBuffer, InternodeConfig
from kernels_cuda.internode import _rdma_transport


def test_is_exported():
    assert "InternodeBuffer" in kernels_cuda.__all__ and kernels_cuda.InternodeBuffer is InternodeBuffer


@pytest.mark.skipif(kernels_cuda.is_built(), reason="the extension is built here")
def test_without_the_extension_it_says_not_built():
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="not built"):
        InternodeBuffer(None, 2, 1 << 20, 1 << 20)


@pytest.mark.parametrize("ext", [SimpleNamespace(with_nvshmem=False), SimpleNamespace()], ids=["flag", "older build"])
def test_an_extension_built_without_nvshmem_says_how_to_rebuild(monkeypatch, ext):
    monkeypatch.setattr(kernels_cuda, "require_built", lambda: ext)
    with pytest.raises(kernels_cuda.KernelsNotBuilt) as error:
        InternodeBuffer(None, 2, 1 << 20, 1 << 20, rdma_transport="nvshmem")
    message = str(error.value)
    for part in ("built without NVSHMEM", "MOE_TRAIN_NVSHMEM=1", "nvidia-nvshmem-cu13", "NVSHMEM_HOME", "rebuild",
                 "'hierarchical'"):
        assert part in message


def test_buffer_size_hints_are_the_configs():
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=8, rdma_chunk=2, rdma_capacity=12)
    default = InternodeConfig().buffer_size_hints(2, 4, 7168 * 2, 8)
    assert InternodeBuffer.get_buffer_size_hints(2, 4, 7168 * 2, 8) == default
    rdma, nvl = InternodeBuffer.get_buffer_size_hints(4, 2, 1024, 4, config)
    assert (rdma, nvl) == config.buffer_size_hints(4, 2, 1024, 4) and rdma > 0 and nvl > 0


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
    assert _rdma_transport("auto", None, SimpleNamespace(with_nvshmem=False)) == "ipc"
    _hosts(monkeypatch, [here, here, here + "-b", here + "-b"])
    assert _rdma_transport("auto", None, SimpleNamespace(with_nvshmem=True)) == "nvshmem"
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="built without NVSHMEM"):
        _rdma_transport("auto", None, SimpleNamespace(with_nvshmem=False))


def test_explicit_transports_and_a_bad_name():
    assert _rdma_transport("ipc", None, SimpleNamespace(with_nvshmem=False)) == "ipc"
    assert _rdma_transport("nvshmem", None, SimpleNamespace(with_nvshmem=True)) == "nvshmem"
    with pytest.raises(ValueError, match="rdma_transport must be one of auto, ipc, nvshmem, got 'rdma'"):
        _rdma_transport("rdma", None, SimpleNamespace(with_nvshmem=True))
