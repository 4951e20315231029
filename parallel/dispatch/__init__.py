"""Token dispatch/combine backends behind one DeepEP-shaped interface (see `model.dispatcher`).

`make_dispatcher(name, topology_or_comms, num_experts, fp8=...)` builds one of:
- `local`: one rank owns every expert, nothing moves (`model.dispatcher.LocalDispatcher`);
- `alltoall`: one flat `all_to_all_single` over the EP group;
- `hierarchical`: node-limited two hops (inter-node on the rail group, then intra-node fan-out);
- `native`: our `kernels_cuda` kernels (`parallel.dispatch.native`) through one per-process
  `kernels_cuda.Buffer`: the intranode kernels for an EP group inside one node, the two-hop kernels
  for one that spans nodes (the RDMA hop through NVSHMEM between machines, through CUDA IPC between
  simulated nodes of one machine; SM budget `comm_sms` either way). On `device="cpu"` the same
  kernels run on the CPU emulation, the buffers in shared memory between the processes of one
  machine. `DispatcherUnavailable` names the pure-torch alternative where they cannot run (see
  `native_unavailable`) or cannot serve this EP group;
- `deepep`: the same dispatcher over `deep_ep.Buffer` (`parallel.dispatch.deepep`) where the optional
  `deep_ep` package is installed (GPU only, nodes of 8 GPUs); `DispatcherUnavailable` naming the
  install otherwise.
Communicating backends count the bytes they send per link in `dispatcher.traffic`.
"""
from __future__ import annotations

from typing import NamedTuple

from model.dispatcher import Dispatcher, LocalDispatcher
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.base import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, ExchangeDispatcher, Traffic
from parallel.dispatch.comm import Comm, EPComms, ProcessGroupComm
from parallel.dispatch.deepep import deepep_unavailable, make_deepep_dispatcher
from parallel.dispatch.handles import OverlapSwitch
from parallel.dispatch.hierarchical import HierarchicalDispatcher
from kernels_cuda.config import Config, InternodeConfig
from parallel.dispatch.native import NativeDispatcher, process_group_buffer_factory
from parallel.topology import Topology, TopologyError, read_launch_env

BACKENDS = ("local", "alltoall", "hierarchical", "native", "deepep")


class DispatcherUnavailable(RuntimeError):
    """The selected backend exists by name but cannot run here."""


class LocalBackend(LocalDispatcher):
    """`LocalDispatcher` with the (always empty) traffic counters of the other backends."""

    def __init__(self) -> None:
        self.traffic = Traffic()


def job_on_one_machine() -> bool:
    """Whether the launcher put every rank of this job on this machine (then simulated nodes reach each
    other through CUDA IPC and the internode kernels need no NVSHMEM)."""
    try:
        launch = read_launch_env()
    except TopologyError:
        return False
    return launch.local_world_size >= launch.world_size


def native_unavailable(across_nodes: bool = False, device: str = "cuda") -> str | None:
    """Why the `native` kernels cannot run in this process on `device`, or None. CUDA: no kernels_cuda
    build, no CUDA device, or, for an EP group `across_nodes` of a job spanning machines, a build
    without the NVSHMEM back end (the extension's `with_nvshmem`). CPU: no build of the emulation, or a
    job spanning machines (its buffers are shared memory of one machine)."""
    import torch

    import kernels_cuda

    if device == "cpu":
        problem = kernels_cuda.build_problem("cpu")
        if problem is not None:
            return problem
        if not job_on_one_machine():
            return ("the CPU emulation's buffers are shared memory between the processes of one machine, but this "
                    "job spans machines (or was not started by torchrun/srun)")
        return None
    problem = kernels_cuda.build_problem("cuda")
    if problem is not None:
        return problem
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if across_nodes and not job_on_one_machine() and not getattr(kernels_cuda.require_built(), "with_nvshmem", False):
        return ("kernels_cuda was built without NVSHMEM, which the internode kernels need between machines "
                "(rebuild with MOE_TRAIN_NVSHMEM=1 where NVSHMEM is installed)")
    return None


class _EPGroup(NamedTuple):
    group: object  # torch.distributed process group
    size: int
    rank: int
    per_node: int
    switch: OverlapSwitch  # what its collectives complete through

    @property
    def spans_nodes(self) -> bool:
        return self.per_node != self.size


def _ep_group_of(topology_or_comms: Topology | EPComms | None, switch: OverlapSwitch) -> _EPGroup | None:
    """The EP group on torch.distributed, or None for other communicators (or none); a topology's
    completes through `switch`, communicators' through their own."""
    if isinstance(topology_or_comms, Topology):
        t = topology_or_comms
        return _EPGroup(t.group("ep"), t.ep, t.ep_rank, t.ep_ranks_per_node, switch)
    if isinstance(topology_or_comms, EPComms) and isinstance(topology_or_comms.ep, ProcessGroupComm):
        comms = topology_or_comms
        return _EPGroup(comms.ep.group, comms.ep.size, comms.ep.rank, comms.intra_node.size, comms.ep.switch)
    return None


def _alternatives(ep: _EPGroup | None) -> str:
    """The pure-torch backends to use instead of `native` for this EP group."""
    if ep is None:
        return "'hierarchical' (EP across nodes) or 'alltoall'"
    return "'hierarchical'" if ep.spans_nodes else "'alltoall' or 'hierarchical'"


def _make_native(topology_or_comms: Topology | EPComms | None, num_experts: int, fp8: bool,
                 comm_sms: int | None, device: str, switch: OverlapSwitch) -> NativeDispatcher:
    from kernels_cuda import constants

    ep_group = _ep_group_of(topology_or_comms, switch)
    problem = native_unavailable(across_nodes=ep_group is not None and ep_group.spans_nodes, device=device)
    if problem is not None:
        raise DispatcherUnavailable(f"dispatcher 'native' cannot run here: {problem}; use {_alternatives(ep_group)}")
    if ep_group is None:
        raise ValueError("dispatcher 'native' needs a topology or EP communicators on torch.distributed groups")
    group, ep, rank, per_node, switch = ep_group
    num_sms = {} if comm_sms is None else {"num_sms": comm_sms}
    if ep_group.spans_nodes:
        nodes = ep // per_node
        if nodes > constants.MAX_RDMA_PEERS or per_node > constants.MAX_NVL_PEERS:
            raise DispatcherUnavailable(
                f"dispatcher 'native': the internode kernels reach at most {constants.MAX_RDMA_PEERS} nodes of "
                f"{constants.MAX_NVL_PEERS} GPUs, not {nodes} x {per_node}; use 'hierarchical'")
        internode = InternodeConfig.for_nodes(nodes, **num_sms)
        factory = process_group_buffer_factory(group, per_node, internode, device)
        return NativeDispatcher(factory, num_experts, ep, rank, per_node, fp8, internode, switch=switch)
    if constants.DISPATCH_WARPS % ep or constants.COMBINE_WARPS % ep:
        raise DispatcherUnavailable(f"dispatcher 'native': the intranode kernels split their warps evenly over the "
                                    f"ranks, which {ep} ranks cannot do; use 'alltoall'")
    config = Config(**num_sms)
    return NativeDispatcher(process_group_buffer_factory(group, per_node, config, device), num_experts, ep, rank,
                            per_node, fp8, config, switch=switch)


def _make_deepep(topology_or_comms: Topology | EPComms | None, num_experts: int, fp8: bool, comm_sms: int | None,
                 device: str, switch: OverlapSwitch) -> NativeDispatcher:
    ep_group = _ep_group_of(topology_or_comms, switch)
    problem = deepep_unavailable(device, *((1, 1) if ep_group is None else (ep_group.size, ep_group.per_node)))
    if problem is None and ep_group is None:
        raise ValueError("dispatcher 'deepep' needs a topology or EP communicators on torch.distributed groups")
    if problem is not None:
        raise DispatcherUnavailable(f"dispatcher 'deepep' cannot run here: {problem}; or use 'native' or "
                                    f"{_alternatives(ep_group)}")
    return make_deepep_dispatcher(ep_group.group, num_experts, ep_group.size, ep_group.rank, ep_group.per_node, fp8,
                                  comm_sms, ep_group.switch)


def make_dispatcher(name: str, topology_or_comms: Topology | EPComms | None, num_experts: int,
                    *, fp8: bool = False, comm_sms: int | None = None, device: str = "cuda",
                    switch: OverlapSwitch | None = None) -> Dispatcher:
    """The backend `name` for this rank's EP group; `fp8` sends the dispatch payload as e4m3.

    `comm_sms` is the SM budget of the `native` kernels (2 per channel; default 20, DeepSeek-V3's
    figure), `device` where they run ('cuda', or 'cpu': the emulation); the other backends communicate
    through torch.distributed and ignore both.

    `topology_or_comms` is a built `Topology` (its ep, intra-node and rail groups are used) or
    `EPComms` (e.g. simulated ones); it may be None for `local`. The collectives of a backend built on a
    topology complete through `switch` (the overlapped pairs' `OverlapSwitch`; None: one that only
    waits); communicators bring their own.
    """
    switch = switch if switch is not None else OverlapSwitch()
    if name not in BACKENDS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "native":
        return _make_native(topology_or_comms, num_experts, fp8, comm_sms, device, switch)
    if name == "deepep":
        return _make_deepep(topology_or_comms, num_experts, fp8, comm_sms, device, switch)
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
    comms = (EPComms.from_topology(topology_or_comms, switch) if isinstance(topology_or_comms, Topology)
             else topology_or_comms)
    if name == "alltoall":
        return AllToAllDispatcher(comms.ep, num_experts, comms.intra_node.size, fp8)
    return HierarchicalDispatcher(comms.intra_node, comms.rail, num_experts, fp8)


__all__ = [
    "BACKENDS", "COMBINE", "DISPATCH", "INTER_NODE", "INTRA_NODE", "AllToAllDispatcher", "Comm",
    "DispatcherUnavailable", "EPComms", "ExchangeDispatcher", "HierarchicalDispatcher", "LocalBackend",
    "NativeDispatcher", "OverlapSwitch", "ProcessGroupComm", "Traffic", "deepep_unavailable", "make_dispatcher",
    "native_unavailable",
]
