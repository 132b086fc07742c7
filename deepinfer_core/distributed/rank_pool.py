"""Persistent rank processes: started once, each builds an object, then runs the driver's calls on it.

`RankPool(factory, world_size, distributed_backend)` starts one process per rank; each joins one
process group (with `timeout_s` on every collective), sets LOCAL_RANK as torchrun would, and builds
`factory(rank, world_size, *args)`. `pool.call(method, *args)` runs `getattr(obj, method)(*args)` on
every rank and returns the values in rank order. Failures never hang the driver:
- a rank that raises, or exits without reporting (killed, out of memory), stops every rank and the call
  raises `RankFailed` naming it (and the peers that lost it, with their tracebacks); the pool is then
  closed and later calls raise `RankFailed` at once;
- a rank waiting in a collective for a peer that hangs fails after `timeout_s` (the process group's
  timeout), which stops the run as above;
- ranks not built within `startup_timeout_s`, or a call given a limit and not answered within it plus a
  margin, stop every rank with `LaunchTimeout` naming the ranks that had not answered;
- an exception of a `recoverable` type (raised the same way on every rank before any collective, such as
  a rejected request) is re-raised in the driver from the lowest rank, and the pool stays usable.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .errors import LaunchTimeout, RankFailed
from .launch import _GRACE_S, _MARGIN_S, _POLL_S, _REPORT_S

__all__ = ["RankPool"]

_STARTUP = -1  # the call number of the build reports
_STOP_S = 5.0


class RankPool:
    def __init__(
        self,
        factory: Callable[..., Any],
        world_size: int,
        distributed_backend: str,
        *,
        args: tuple = (),
        timeout_s: float = 600.0,
        startup_timeout_s: float = 300.0,
        num_threads: int = 1,
        recoverable: tuple[type[BaseException], ...] = (),
        preload: tuple[str, ...] = (),
    ) -> None:
        """`preload`: modules the process server imports once, so each rank starts without importing them
        (it only applies if this program starts its first forkserver process here)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, found {world_size}")
        self.world_size = world_size
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "deepinfer_core.distributed", *preload])
        self._store = tempfile.TemporaryDirectory(prefix="deepinfer-ranks-")
        init = f"file://{Path(self._store.name) / 'rendezvous'}"
        self._commands = [context.Queue() for _ in range(world_size)]
        self._reports = context.Queue()
        self._procs = [
            context.Process(
                target=_serve_rank,
                args=(factory, rank, world_size, distributed_backend, init, timeout_s, num_threads, args,
                      recoverable, self._commands[rank], self._reports),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._closed: str | None = None
        self._calls = 0
        self._graceful = [True]
        self._finalizer = weakref.finalize(
            self, _stop, self._procs, [*self._commands, self._reports], self._store, self._graceful
        )
        self._collect(_STARTUP, startup_timeout_s, "be built")

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def call(self, method: str, *args: Any, limit_s: float | None = None) -> list[Any]:
        """`getattr(obj, method)(*args)` on every rank (collective); their values in rank order.

        `limit_s` None: no overall limit (long work is not a hang; an exited rank is noticed at once,
        and one stuck in a collective fails by the process group's timeout)."""
        if self._closed is not None:
            raise RankFailed(f"the rank processes were stopped ({self._closed}); build a new LLM")
        self._calls += 1
        for commands in self._commands:
            commands.put((self._calls, method, args))
        return self._collect(self._calls, None if limit_s is None else limit_s + _MARGIN_S, f"answer {method}()")

    def close(self, reason: str = "closed", *, graceful: bool = True) -> None:
        """Stop every rank: asked to leave the process group (graceful), else killed at once."""
        if self._closed is None:
            self._closed = reason
        self._graceful[0] = graceful
        self._finalizer()

    def _collect(self, call: int, limit_s: float | None, doing: str) -> list[Any]:
        values: dict[int, Any] = {}
        raised: dict[int, BaseException] = {}
        failures: dict[int, str] = {}
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while len(values) + len(raised) < self.world_size:
            self._receive(call, values, raised, failures, _POLL_S)
            self._notice_exits(call, values, raised, failures)
            if failures:
                grace = time.monotonic() + _GRACE_S
                while time.monotonic() < grace and len(values) + len(raised) + len(failures) < self.world_size:
                    self._receive(call, values, raised, failures, _POLL_S)
                    self._notice_exits(call, values, raised, failures)
                message = (f"{len(failures)} of {self.world_size} ranks failed; every rank was stopped.\n"
                           + "\n".join(failures[rank] for rank in sorted(failures)))
                self.close(f"rank {min(failures)} failed", graceful=False)
                raise RankFailed(message)
            if deadline is not None and time.monotonic() > deadline:
                pending = sorted(set(range(self.world_size)) - set(values) - set(raised))
                self.close(f"ranks {pending} timed out", graceful=False)
                raise LaunchTimeout(
                    f"ranks {pending} of {self.world_size} did not {doing} within {limit_s:.0f}s (a hang, or a "
                    "limit too short for the work: raise it); every rank was stopped"
                )
        if raised:
            raise raised[min(raised)]
        return [values[rank] for rank in range(self.world_size)]

    def _receive(self, call: int, values: dict, raised: dict, failures: dict, wait_s: float) -> None:
        try:
            rank, number, kind, payload = self._reports.get(timeout=wait_s)
        except queue.Empty:
            return
        if number != call:
            return  # a late answer to a call that already failed
        if kind == "done":
            values[rank] = payload
        elif kind == "raised":
            raised[rank] = payload
        else:
            failures[rank] = f"rank {rank} raised:\n{payload}"

    def _notice_exits(self, call: int, values: dict, raised: dict, failures: dict) -> None:
        for rank, proc in enumerate(self._procs):
            if rank in values or rank in raised or rank in failures or proc.exitcode is None:
                continue
            until = time.monotonic() + _REPORT_S
            while rank not in failures and rank not in values and time.monotonic() < until:
                self._receive(call, values, raised, failures, _POLL_S)
            if rank not in failures and rank not in values:
                failures[rank] = (
                    f"rank {rank} of {self.world_size} exited with code {proc.exitcode} without answering "
                    "(killed, out of memory, or os._exit)"
                )


def _serve_rank(
    factory: Callable[..., Any], rank: int, world_size: int, distributed_backend: str, init: str,
    timeout_s: float, num_threads: int, args: tuple, recoverable: tuple[type[BaseException], ...],
    commands: Any, reports: Any,
) -> None:
    torch.set_num_threads(num_threads)
    os.environ["LOCAL_RANK"] = str(rank)  # one host: the rank picks its device as under torchrun
    call = _STARTUP
    try:
        dist.init_process_group(
            distributed_backend, init_method=init, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            served = factory(rank, world_size, *args)
            reports.put((rank, call, "done", None))
            while (command := commands.get()) is not None:
                call, method, call_args = command
                try:
                    value = getattr(served, method)(*call_args)
                except recoverable as error:
                    reports.put((rank, call, "raised", error))
                    continue
                reports.put((rank, call, "done", value))
        finally:
            dist.destroy_process_group()
    except BaseException:
        reports.put((rank, call, "failed", traceback.format_exc()))
        raise SystemExit(1) from None


def _stop(procs: list[Any], queues: list[Any], store: tempfile.TemporaryDirectory, graceful: list[bool]) -> None:
    for proc, queue_ in zip(procs, queues):  # the command queues, one per rank
        if proc.is_alive():
            queue_.put(None)
    # Ranks stuck in a collective with a dead peer never read their queue: kill those at once.
    deadline = time.monotonic() + (_STOP_S if graceful[0] else 0.0)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    for queue_ in queues:
        queue_.close()
    store.cleanup()
