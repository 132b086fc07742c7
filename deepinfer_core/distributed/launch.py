"""Start a multi-process run: one process per rank, spawned here or by `torchrun`, with time limits.

`spawn(fn, world_size, backend)` starts `world_size` processes that each join one process group and
call `fn(rank, world_size, *args)`; it returns every rank's return value in rank order. Failures never
hang the caller:
- a rank that raises, or exits without reporting (killed, out of memory, `os._exit`), stops the whole
  run with `RankFailed`, which names every failed rank (the one that died first as well as the peers
  that lost it) and carries their tracebacks;
- ranks that have not all joined the process group within `startup_timeout_s`, or have not finished
  `timeout_s` (plus a few seconds) after joining, are killed and `LaunchTimeout` names them;
- the process group's own timeout (`timeout_s`) makes a rank waiting in a collective on a dead peer
  fail instead of waiting forever, also when no `spawn` supervises it (torchrun).

Under `torchrun`, call `init_from_env(backend)` in each process instead (it reads torchrun's
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT through torch's `env://` initialisation).
"""

from __future__ import annotations

import atexit
import multiprocessing
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.platform.interfaces import Backend

from .errors import LaunchTimeout, RankFailed

__all__ = ["init_from_env", "spawn"]

_POLL_S = 0.05
# A rank's last report can still be in the queue when its exit is seen.
_REPORT_S = 1.0
# A dead rank makes its peers fail in their next collective: collect those too, briefly, so the
# error names the rank that failed first and not only the peers that lost it.
_GRACE_S = 2.0
# The supervisor waits this much past `timeout_s`, so a rank stuck in a collective fails by the process
# group's own timeout first and reports where it was.
_MARGIN_S = 5.0


def init_from_env(backend: Backend, *, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes; returns (rank, world_size)."""
    dist.init_process_group(
        backend.distributed_backend, init_method="env://", timeout=timedelta(seconds=timeout_s)
    )
    # Leave the group before the interpreter tears down: a group destroyed during teardown can abort
    # the process ("terminate called without an active exception") after a successful run.
    atexit.register(_leave_group)
    return dist.get_rank(), dist.get_world_size()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    backend: Backend,
    *,
    args: tuple = (),
    timeout_s: float = 60.0,
    startup_timeout_s: float = 180.0,
    num_threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; see the module docstring.

    `fn` and `args` must be picklable (a module-level function); `num_threads` caps each process's
    intra-op threads so ranks sharing a host do not oversubscribe its cores.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, found {world_size}")
    # NOTE: forkserver, not fork: ranks must not inherit an initialised device runtime. The server
    # imports torch once, so later runs start their ranks in well under a second.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "deepinfer_core.distributed"])
    reports = context.Queue()
    with tempfile.TemporaryDirectory(prefix="deepinfer-dist-") as store:
        init = f"file://{Path(store) / 'rendezvous'}"
        procs = [
            context.Process(
                target=_run_rank,
                args=(fn, rank, world_size, backend, init, timeout_s, num_threads, args, reports),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _Supervisor(procs, reports).wait(startup_timeout_s, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()


def _run_rank(
    fn: Callable[..., Any], rank: int, world_size: int, backend: Backend, init: str,
    timeout_s: float, num_threads: int, args: tuple, reports: Any,
) -> None:
    torch.set_num_threads(num_threads)
    try:
        dist.init_process_group(
            backend.distributed_backend, init_method=init, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        reports.put((rank, "ready", None))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        reports.put((rank, "failed", traceback.format_exc()))
        raise SystemExit(1) from None
    reports.put((rank, "done", value))


@dataclass(slots=True)
class _Supervisor:
    procs: list[Any]
    reports: Any
    ready: set[int] = field(default_factory=set)
    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def wait(self, startup_timeout_s: float, timeout_s: float) -> list[Any]:
        world = len(self.procs)
        deadline, started = time.monotonic() + startup_timeout_s, False
        while len(self.values) < world:
            self._poll(_POLL_S)
            if self.failures:
                grace = time.monotonic() + _GRACE_S
                while time.monotonic() < grace and len(self.values) + len(self.failures) < world:
                    self._poll(_POLL_S)
                raise RankFailed(
                    f"{len(self.failures)} of {world} ranks failed; every rank was stopped.\n"
                    + "\n".join(self.failures[rank] for rank in sorted(self.failures))
                )
            if not started and len(self.ready) == world:
                deadline, started = time.monotonic() + timeout_s + _MARGIN_S, True
            if time.monotonic() > deadline:
                raise LaunchTimeout(self._timeout_message(startup_timeout_s, timeout_s, started))
        return [self.values[rank] for rank in range(world)]

    def _poll(self, wait_s: float) -> None:
        self._receive(wait_s)
        for rank, proc in enumerate(self.procs):
            if self._reported(rank) or proc.exitcode is None:
                continue
            until = time.monotonic() + _REPORT_S
            while not self._reported(rank) and time.monotonic() < until:
                self._receive(_POLL_S)
            if not self._reported(rank):
                self.failures[rank] = (
                    f"rank {rank} of {len(self.procs)} exited with code {proc.exitcode} without reporting "
                    "a result (killed, out of memory, or os._exit)"
                )

    def _reported(self, rank: int) -> bool:
        return rank in self.values or rank in self.failures

    def _receive(self, wait_s: float) -> None:
        try:
            rank, kind, payload = self.reports.get(timeout=wait_s)
        except queue.Empty:
            return
        if kind == "ready":
            self.ready.add(rank)
        elif kind == "done":
            self.values[rank] = payload
        else:
            self.failures[rank] = f"rank {rank} raised:\n{payload}"

    def _timeout_message(self, startup_timeout_s: float, timeout_s: float, started: bool) -> str:
        world = len(self.procs)
        if not started:
            missing = sorted(set(range(world)) - self.ready)
            return (
                f"ranks {missing} of {world} had not joined the process group after {startup_timeout_s:.0f}s "
                "(a slow start, or a rendezvous that cannot complete); every rank was stopped"
            )
        pending = sorted(set(range(world)) - set(self.values))
        return (
            f"ranks {pending} of {world} had not finished within timeout_s={timeout_s:.0f}s of joining (a hang "
            "outside collectives, or a limit too short for the work); every rank was stopped"
        )
