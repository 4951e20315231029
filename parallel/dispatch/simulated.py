"""The ranks of one EP group as threads of one process, exchanging rows in memory.

Runs the real backends (planning, packing, reordering, byte counters) for many ranks without
processes or sockets; only the transport is simulated. Used where more ranks are needed than
processes can be afforded, e.g. the 64-rank dispatch-volume benchmark.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from parallel.dispatch.comm import EPComms


class _Exchange:
    """Mailbox and barrier shared by the members of one simulated group."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.outbox: list[tuple[torch.Tensor, ...]] = [()] * size


class ThreadComm:
    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self.exchange, self.rank, self.size = exchange, rank, exchange.size

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        box = self.exchange
        box.outbox[self.rank] = send.split(send_splits)
        box.barrier.wait()
        out = torch.cat([box.outbox[source][self.rank] for source in range(self.size)])
        box.barrier.wait()  # nobody overwrites its outbox before every peer has read it
        if out.shape[0] != sum(recv_splits):
            raise RuntimeError(f"rank {self.rank} expected {sum(recv_splits)} rows, received {out.shape[0]}")
        return out


class SimulatedEPGroup:
    """`EPComms` for each of `ep` ranks laid out as nodes of `ranks_per_node`."""

    def __init__(self, ep: int, ranks_per_node: int, timeout_s: float = 120.0) -> None:
        per_node = min(ep, ranks_per_node)
        nodes = ep // per_node
        flat = _Exchange(ep, timeout_s)
        intra = [_Exchange(per_node, timeout_s) for _ in range(nodes)]
        rail = [_Exchange(nodes, timeout_s) for _ in range(per_node)]
        self._exchanges = [flat, *intra, *rail]
        self.comms = [EPComms(ThreadComm(flat, r), ThreadComm(intra[r // per_node], r % per_node),
                              ThreadComm(rail[r % per_node], r // per_node)) for r in range(ep)]

    def run(self, fn: Callable[[int, EPComms], Any]) -> list[Any]:
        """fn(rank, comms) on one thread per rank; results by rank, or the first error re-raised."""
        results: list[Any] = [None] * len(self.comms)
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.comms[rank])
            except BaseException as err:  # noqa: BLE001 - re-raised below with the rank
                errors.append((rank, err))
                for exchange in self._exchanges:
                    exchange.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(len(self.comms))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            rank, err = min(errors, key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
            raise RuntimeError(f"simulated rank {rank} failed: {err!r}") from err
        return results
