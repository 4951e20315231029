"""Token dispatch/combine backends behind one DeepEP-shaped interface (see `model.dispatcher`).

`make_dispatcher(name, topology_or_comms, num_experts, fp8=...)` builds one of:
- `local`: one rank owns every expert, nothing moves (`model.dispatcher.LocalDispatcher`);
- `alltoall`: one flat `all_to_all_single` over the EP group;
- `hierarchical`: node-limited two hops (inter-node on the rail group, then intra-node fan-out);
- `native`: our `kernels_cuda` buffer (`parallel.dispatch.native`); a clear error where it is not
  built, or for an EP group that spans nodes (the internode kernels have no host runtime yet);
- `deepep` (the `deep_ep` package): a clear error until wired.
Communicating backends count the bytes they send per link in `dispatcher.traffic`.
"""
from __future__ import annotations

import importlib.util

from model.dispatcher import Dispatcher, LocalDispatcher
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.base import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, ExchangeDispatcher, Traffic
from parallel.dispatch.comm import Comm, EPComms, ProcessGroupComm
from parallel.dispatch.hierarchical import HierarchicalDispatcher
from kernels_cuda.config import Config
from parallel.dispatch.native import NativeDispatcher, process_group_buffer_factory
from parallel.topology import Topology

BACKENDS = ("local", "alltoall", "hierarchical", "native", "deepep")


class DispatcherUnavailable(RuntimeError):
    """The selected backend exists by name but cannot run here."""


class LocalBackend(LocalDispatcher):
    """`LocalDispatcher` with the (always empty) traffic counters of the other backends."""

    def __init__(self) -> None:
        self.traffic = Traffic()


def _make_native(topology_or_comms: Topology | EPComms | None, num_experts: int, fp8: bool,
                 comm_sms: int | None) -> NativeDispatcher:
    import torch

    import kernels_cuda
    from kernels_cuda import constants

    if not kernels_cuda.is_built():
        raise DispatcherUnavailable(f"dispatcher 'native': kernels_cuda is not built here: {kernels_cuda.build_status()}; "
                                    "use 'hierarchical' or 'alltoall'")
    if not torch.cuda.is_available():
        raise DispatcherUnavailable("dispatcher 'native' needs a CUDA device; use 'hierarchical' or 'alltoall'")
    if isinstance(topology_or_comms, Topology):
        group, ep, rank, per_node = (topology_or_comms.ep_group, topology_or_comms.ep, topology_or_comms.ep_rank,
                                     topology_or_comms.ep_ranks_per_node)
    elif isinstance(topology_or_comms, EPComms) and isinstance(topology_or_comms.ep, ProcessGroupComm):
        comms = topology_or_comms
        group, ep, rank, per_node = comms.ep.group, comms.ep.size, comms.ep.rank, comms.intra_node.size
    else:
        raise ValueError("dispatcher 'native' needs a topology or EP communicators on torch.distributed groups")
    if per_node != ep:
        raise DispatcherUnavailable(f"dispatcher 'native': the EP group spans {ep // per_node} nodes, and the "
                                    "internode kernels have no host runtime yet; use 'hierarchical'")
    if constants.DISPATCH_WARPS % ep or constants.COMBINE_WARPS % ep:
        raise DispatcherUnavailable(f"dispatcher 'native': the intranode kernels split their warps evenly over the "
                                    f"ranks, which {ep} ranks cannot do; use 'alltoall'")
    config = Config() if comm_sms is None else Config(num_sms=comm_sms)
    return NativeDispatcher(process_group_buffer_factory(group, config), num_experts, ep, rank, per_node, fp8, config)


def _check_deepep() -> None:
    if importlib.util.find_spec("deep_ep") is None:
        raise DispatcherUnavailable("dispatcher 'deepep': deep_ep is not installed; use 'hierarchical' or 'alltoall'")
    raise DispatcherUnavailable("dispatcher 'deepep': deep_ep is installed but has no backend here yet")


def make_dispatcher(name: str, topology_or_comms: Topology | EPComms | None, num_experts: int,
                    *, fp8: bool = False, comm_sms: int | None = None) -> Dispatcher:
    """The backend `name` for this rank's EP group; `fp8` sends the dispatch payload as e4m3.

    `comm_sms` is the SM budget of the `native` kernels (2 per channel; default 20, DeepSeek-V3's
    figure); the other backends communicate through torch.distributed and ignore it.

    `topology_or_comms` is a built `Topology` (its ep, intra-node and rail groups are used) or
    `EPComms` (e.g. simulated ones); it may be None for `local`.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "native":
        return _make_native(topology_or_comms, num_experts, fp8, comm_sms)
    if name == "deepep":
        _check_deepep()
    if name == "local":
        ep = 1 if topology_or_comms is None else (
            topology_or_comms.ep if isinstance(topology_or_comms, Topology) else topology_or_comms.ep.size)
        if ep != 1:
            raise ValueError(f"dispatcher 'local' keeps every expert on one rank, but ep={ep}")
        if fp8:
            raise ValueError("dispatcher 'local' moves no tokens, so it has no FP8 payload")
        return LocalBackend()
    if topology_or_comms is None:
        raise ValueError(f"dispatcher {name!r} needs a topology or EP communicators")
    comms = EPComms.from_topology(topology_or_comms) if isinstance(topology_or_comms, Topology) else topology_or_comms
    if name == "alltoall":
        return AllToAllDispatcher(comms.ep, num_experts, comms.intra_node.size, fp8)
    return HierarchicalDispatcher(comms.intra_node, comms.rail, num_experts, fp8)


__all__ = [
    "BACKENDS", "COMBINE", "DISPATCH", "INTER_NODE", "INTRA_NODE", "AllToAllDispatcher", "Comm",
    "DispatcherUnavailable", "EPComms", "ExchangeDispatcher", "HierarchicalDispatcher", "LocalBackend", "NativeDispatcher",
    "ProcessGroupComm", "Traffic", "make_dispatcher",
]
