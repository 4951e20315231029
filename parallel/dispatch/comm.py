"""The one collective the dispatchers use (an uneven all-to-all of rows), behind a small interface.

`ProcessGroupComm` runs it with torch.distributed on a process group, launched asynchronously and
completed through its `OverlapSwitch` (`parallel.dispatch.handles`: given the overlapped pair's switch,
the other chunk computes meanwhile); `parallel.dispatch.simulated`
runs it between threads of one process, so the same backend code can be driven for many ranks
without processes (the dispatch-volume benchmark does that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from parallel.dispatch.handles import CommHandle, OverlapSwitch, all_to_all_async

if TYPE_CHECKING:
    from parallel.topology import Topology


class Comm(Protocol):
    size: int
    rank: int

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows send[split p] go to peer p; returns the rows received, blocks ordered by source peer."""
        ...


class ProcessGroupComm:
    """`all_to_all_single` on a torch.distributed group (the group's timeout applies); its collectives
    complete through `switch` (None: one of its own, which only waits)."""

    def __init__(self, group: dist.ProcessGroup, switch: OverlapSwitch | None = None) -> None:
        self.group = group
        self.switch = switch if switch is not None else OverlapSwitch()
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        if self.size == 1:
            return send
        out, handle = self.all_to_all_async(send, send_splits, recv_splits)
        self.switch.complete(handle)
        return out

    def all_to_all_async(self, send: torch.Tensor, send_splits: list[int],
                         recv_splits: list[int]) -> tuple[torch.Tensor, CommHandle]:
        """Launch the all-to-all; the output is valid once the handle was waited on."""
        return all_to_all_async(self.group, send, send_splits, recv_splits, self.switch)


def exchange_counts(comm: Comm, counts: torch.Tensor) -> torch.Tensor:
    """counts [P, ...] (row p for peer p) -> [P, ...] (row p from peer p)."""
    ones = [1] * comm.size
    return comm.all_to_all(counts, ones, ones)


@dataclass
class EPComms:
    """The communicators of one expert-parallel group: the whole group and its two hops."""

    ep: Comm
    intra_node: Comm  # EP ranks of this node, comm rank = local rank
    rail: Comm  # same local rank on each node of the EP group, comm rank = node index

    @classmethod
    def from_topology(cls, topology: Topology, switch: OverlapSwitch | None = None) -> EPComms:
        """The topology's EP groups, all three completing through `switch`."""
        switch = switch if switch is not None else OverlapSwitch()
        return cls(ProcessGroupComm(topology.group("ep"), switch), ProcessGroupComm(topology.group("intra_node"), switch),
                   ProcessGroupComm(topology.group("rail"), switch))
