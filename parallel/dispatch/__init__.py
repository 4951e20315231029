"""Token dispatch/combine backends behind one DeepEP-shaped interface (see `model.dispatcher`).

`make_dispatcher(name, topology_or_comms, num_experts, fp8=...)` builds one of:
- `local`: one rank owns every expert, nothing moves (`model.dispatcher.LocalDispatcher`);
- `alltoall`: one flat `all_to_all_single` over the EP group;
- `hierarchical`: node-limited two hops (inter-node on the rail group, then intra-node fan-out);
- `native` (our `kernels_cuda`) and `deepep` (the `deep_ep` package): clear errors until built.
Communicating backends count the bytes they send per link in `dispatcher.traffic`.
"""
from __future__ import annotations

import importlib.util

from model.dispatcher import Dispatcher, LocalDispatcher
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.base import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, ExchangeDispatcher, Traffic
from parallel.dispatch.comm import Comm, EPComms, ProcessGroupComm
from parallel.dispatch.hierarchical import HierarchicalDispatcher
from parallel.topology import Topology

BACKENDS = ("local", "alltoall", "hierarchical", "native", "deepep")


class DispatcherUnavailable(RuntimeError):
    """The selected backend exists by name but cannot run here."""


class LocalBackend(LocalDispatcher):
    """`LocalDispatcher` with the (always empty) traffic counters of the other backends."""

    def __init__(self) -> None:
        self.traffic = Traffic()


def _check_native() -> None:
    import kernels_cuda

    if not kernels_cuda.is_built():
        raise DispatcherUnavailable(f"dispatcher 'native': kernels_cuda is not built here: {kernels_cuda.build_status()}; "
                                    "use 'hierarchical' or 'alltoall'")
    raise DispatcherUnavailable("dispatcher 'native': kernels_cuda is built but not wired into parallel.dispatch yet")


def _check_deepep() -> None:
    if importlib.util.find_spec("deep_ep") is None:
        raise DispatcherUnavailable("dispatcher 'deepep': deep_ep is not installed; use 'hierarchical' or 'alltoall'")
    raise DispatcherUnavailable("dispatcher 'deepep': deep_ep is installed but has no backend here yet")


def make_dispatcher(name: str, topology_or_comms: Topology | EPComms | None, num_experts: int,
                    *, fp8: bool = False) -> Dispatcher:
    """The backend `name` for this rank's EP group; `fp8` sends the dispatch payload as e4m3.

    `topology_or_comms` is a built `Topology` (its ep, intra-node and rail groups are used) or
    `EPComms` (e.g. simulated ones); it may be None for `local`.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "native":
        _check_native()
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
    "DispatcherUnavailable", "EPComms", "ExchangeDispatcher", "HierarchicalDispatcher", "LocalBackend",
    "ProcessGroupComm", "Traffic", "make_dispatcher",
]
