"""A reusable pool of gloo worker processes for distributed tests.

Usage (the session fixture `pools` is in tests/distributed/conftest.py):

    def all_reduce_rank(scale):              # module level, so workers can import it
        value = torch.tensor([dist.get_rank() * scale])
        dist.all_reduce(value)
        return value.item()

    def test_all_reduce(pools):
        assert pools.get(4).run(all_reduce_rank, 2.0) == [12.0] * 4   # one result per rank

Rules for tasks:
- A task is a module-level function and picklable arguments; every rank runs `fn(*args, **kwargs)`
  with the default gloo group already initialised, and returns a picklable result (tensors are
  fine). Compute references inside the task (or return data and compare in the test).
- One pool per world size per session: processes start once (forked from a server that has
  imported torch), initialise gloo once and run task after task, so tasks must leave no state
  behind. A task may create its own subgroups (`dist.new_group`, or
  `parallel.topology.build_topology`); it must destroy them before returning
  (`dist.destroy_process_group(group)`, `Topology.destroy_groups()`). Seed inside the task.
- Every collective has a timeout (the default group's `timeout_s`; give subgroups one too), so a
  rank waiting for a peer that never comes raises instead of hanging.
- An exception on any rank raises `WorkerError` naming the rank, with the worker's traceback
  (other ranks that do not answer within `grace_s` are usually stuck in a collective with the
  failed rank). After any failure, a task outliving `run(..., deadline_s=...)` or a dead worker,
  the pool is torn down (its gloo group may be broken) and the next `get` starts a fresh one.
- Workers use one torch thread each (the machine has few cores).
- At session end `PoolSet.close()` makes every worker destroy its process group and exit.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable


class WorkerError(RuntimeError):
    """A task failed on one or more ranks; the message holds each failing rank's traceback."""


def _worker_main(rank: int, world_size: int, store_path: str, timeout_s: float, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    conn.send(("ready", None))
    while (task := conn.recv()) is not None:
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    conn.close()


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class WorkerPool:
    """`world_size` processes with a gloo default group, running one task at a time."""

    def __init__(self, world_size: int, timeout_s: float = 60.0, grace_s: float = 2.0,
                 start_timeout_s: float = 120.0) -> None:
        self.world_size, self.timeout_s, self.grace_s = world_size, timeout_s, grace_s
        self.broken = False
        self._dir = tempfile.mkdtemp(prefix="gloo_pool_")
        ctx = _context()
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"pool{world_size}-rank{rank}", daemon=True,
                               args=(rank, world_size, os.path.join(self._dir, "store"), timeout_s, child))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(time.monotonic() + start_timeout_s, "start-up")

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; results in rank order."""
        if self.broken:
            raise RuntimeError("this pool was torn down after a failure; get a new one from PoolSet")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else self.timeout_s + 30)
        return self._collect(deadline, fn.__name__)

    def _collect(self, deadline: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        first_error_at = 0.0
        while pending:
            now = time.monotonic()
            limit = min(deadline, first_error_at + self.grace_s) if errors else deadline
            if now >= limit:
                break
            for conn in wait(list(pending.values()), timeout=limit - now):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", f"worker process died (exit code {self._procs[rank].exitcode})"
                if status == "error":
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = value
                else:
                    results[rank] = value
        if pending or errors:  # a failed task may leave the gloo group broken: the next get starts afresh
            self.close(force=True)
        if errors:
            report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
            unanswered = f"\nranks {sorted(pending)} did not answer (pool restarted)" if pending else ""
            raise WorkerError(f"{what} failed on rank(s) {sorted(errors)}{unanswered}\n{report}")
        if pending:
            raise WorkerError(f"{what}: ranks {sorted(pending)} did not finish before the deadline (pool restarted)")
        return [results[rank] for rank in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop the workers: politely (they destroy their process groups), or by killing them."""
        if not force and not self.broken:
            for conn in self._conns:
                conn.send(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self.broken = True
        shutil.rmtree(self._dir, ignore_errors=True)


class PoolSet:
    """One live pool per world size, restarted when a failure tore it down."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size, self.timeout_s)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()
        self._pools.clear()
