"""The pluggy hook every backend plugin implements, and the record it returns.

A backend plugin is a module named by an entry point in the `deepinfer.backends` group. The module
stays light: it imports nothing of the vendor stack and only says where the backend class lives::

    # my_backend/plugin.py, registered in pyproject.toml as
    # [project.entry-points."deepinfer.backends"]
    # mine = "my_backend.plugin"
    from deepinfer_core.platform import BackendRecord, hookimpl

    @hookimpl
    def deepinfer_backend() -> BackendRecord:
        return BackendRecord(name="mine", factory="my_backend.backend:MyBackend", priority=50,
                             install="pip install my-backend")
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

__all__ = ["BackendRecord", "BackendSpec", "ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True, slots=True)
class BackendRecord:
    """What a plugin tells the registry about its backend, without importing it.

    name: the value of DEEPINFER_ACCELERATOR that selects it (lower case, unique).
    factory: "package.module:Attr", a `Backend` subclass (or a callable taking `device_index` and
        returning a `Backend`); imported only when the backend is probed or selected.
    priority: rank among available backends for `auto` (the built-in cpu backend has 0).
    install: the command that installs this backend, quoted in error messages.
    """

    name: str
    factory: str
    priority: int
    install: str


class BackendSpec:
    """Hook specifications of the `deepinfer.backends` plugins."""

    @hookspec
    def deepinfer_backend(self) -> BackendRecord:
        """Return the record of the one backend this plugin provides."""
