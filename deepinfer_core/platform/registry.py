"""Backend discovery (entry points of `deepinfer.backends`, through pluggy) and selection.

Every backend, the built-in `cpu` one included, arrives the same way: an entry point names a light
plugin module whose `deepinfer_backend` hook returns a `BackendRecord`. The backend class itself is
imported only when the backend is probed or selected.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import pluggy

from deepinfer_core import envs
from deepinfer_core.platform.errors import (
    BackendUnavailable,
    DuplicateBackend,
    InvalidBackendPlugin,
    UnknownBackend,
)
from deepinfer_core.platform.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, BackendRecord, BackendSpec
from deepinfer_core.platform.interfaces import Backend

__all__ = ["BackendRegistry", "BackendStatus", "FIRST_PARTY_INSTALL", "select_backend"]

logger = logging.getLogger(__name__)

FIRST_PARTY_INSTALL = {
    "nvidia": "DEEPINFER_ACCELERATOR=nvidia ./build.sh (installs the deepinfer[nvidia] extra from a DeepInfer checkout)",
    "ascend": "DEEPINFER_ACCELERATOR=ascend ./build.sh (installs the deepinfer[ascend] extra from a DeepInfer checkout)",
}
"""Backends DeepInfer ships outside the core, and the command that installs each."""

_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """Outcome of probing one installed backend: `reason` is None when it can run here."""

    record: BackendRecord
    backend: Backend | None
    reason: str | None

    @property
    def available(self) -> bool:
        return self.reason is None


class BackendRegistry:
    """The installed backends, by name. Build it with `from_entry_points()`."""

    def __init__(self) -> None:
        self._plugins = pluggy.PluginManager(PROJECT_NAME)
        self._plugins.add_hookspecs(BackendSpec)

    @classmethod
    def from_entry_points(cls) -> BackendRegistry:
        registry = cls()
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist.name if entry_point.dist else "an unknown distribution"
            label = f"{entry_point.name} = {entry_point.value} (from {dist})"
            try:
                module = entry_point.load()
            except Exception as exc:
                raise InvalidBackendPlugin(
                    f"the backend plugin {label} failed to import: {exc!r}. A plugin module must "
                    "import nothing heavy; fix or uninstall that distribution."
                ) from exc
            registry.register(module, label)
        return registry

    def register(self, plugin: ModuleType | object, label: str) -> None:
        """Add a plugin (a module or object with a `deepinfer_backend` hookimpl)."""
        try:
            self._plugins.register(plugin, name=label)
        except ValueError as exc:
            raise InvalidBackendPlugin(f"cannot register backend plugin {label}: {exc}") from exc

    def records(self) -> dict[str, BackendRecord]:
        """Every registered backend's record, by name. Two plugins with one name is an error."""
        found: dict[str, tuple[BackendRecord, str]] = {}
        for impl in self._plugins.hook.deepinfer_backend.get_hookimpls():
            record = impl.function()
            _validate(record, impl.plugin_name)
            if record.name in found:
                raise DuplicateBackend(
                    f"backend name {record.name!r} is registered twice: by {found[record.name][1]} "
                    f"and by {impl.plugin_name}. Uninstall one of the two distributions."
                )
            found[record.name] = (record, impl.plugin_name)
        return {name: record for name, (record, _) in sorted(found.items())}

    def create(self, name: str, device_index: int = 0) -> Backend:
        """Import and instantiate a backend without checking it; unknown names raise."""
        records = self.records()
        if name not in records:
            raise UnknownBackend(_unknown_message(name, records))
        return _instantiate(records[name], device_index)

    def probe(self, device_index: int = 0) -> list[BackendStatus]:
        """Instantiate and check every installed backend, highest priority first."""
        statuses = []
        for record in _by_priority(self.records().values()):
            try:
                backend = _instantiate(record, device_index)
            except BackendUnavailable as exc:
                statuses.append(BackendStatus(record, None, str(exc)))
                continue
            try:
                backend.check()
            except BackendUnavailable as exc:
                statuses.append(BackendStatus(record, backend, str(exc)))
                continue
            statuses.append(BackendStatus(record, backend, None))
        return statuses

    def select(self, name: str | None = None, device_index: int = 0) -> Backend:
        """The backend to run on: `name`, else DEEPINFER_ACCELERATOR, else `auto`.

        `auto` takes the available backend with the highest priority. A named backend that is not
        installed raises `UnknownBackend`; one that cannot run here raises `BackendUnavailable`
        with its `check()` reason. Nothing falls back to another backend than the one named.
        """
        requested = (name or envs.accelerator()).strip().lower()
        if requested == "auto":
            return self._select_auto(device_index)
        records = self.records()
        if requested not in records:
            raise UnknownBackend(_unknown_message(requested, records))
        backend = _instantiate(records[requested], device_index)
        try:
            backend.check()
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"backend {requested!r} is installed but cannot run here: {exc}") from exc
        return backend

    def _select_auto(self, device_index: int) -> Backend:
        statuses = self.probe(device_index)
        for status in statuses:
            if status.available and status.backend is not None:
                logger.info("DEEPINFER_ACCELERATOR=auto selected the %r backend", status.record.name)
                return status.backend
        reasons = "; ".join(f"{s.record.name}: {s.reason}" for s in statuses) or "none is installed"
        raise BackendUnavailable(f"no installed backend can run here ({reasons})")


def select_backend(name: str | None = None, device_index: int = 0) -> Backend:
    """Select from the installed backends; see `BackendRegistry.select`."""
    return BackendRegistry.from_entry_points().select(name, device_index)


def _by_priority(records: Iterable[BackendRecord]) -> list[BackendRecord]:
    return sorted(records, key=lambda record: (-record.priority, record.name))


def _validate(record: object, origin: str) -> None:
    if not isinstance(record, BackendRecord):
        raise InvalidBackendPlugin(
            f"the deepinfer_backend hook of {origin} returned {type(record).__name__}, "
            "expected a deepinfer_core.platform.BackendRecord"
        )
    if not _NAME.match(record.name):
        raise InvalidBackendPlugin(
            f"backend name {record.name!r} from {origin} must be lower case letters, digits, '-' "
            "or '_', starting with a letter"
        )
    module, _, attr = record.factory.partition(":")
    if not module or not attr:
        raise InvalidBackendPlugin(
            f"backend {record.name!r} from {origin} has factory {record.factory!r}, "
            "expected 'package.module:Attribute'"
        )


def _instantiate(record: BackendRecord, device_index: int) -> Backend:
    module_name, _, attr = record.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise BackendUnavailable(
            f"importing {record.factory} failed ({exc}); reinstall it: {record.install}"
        ) from exc
    except AttributeError as exc:
        raise InvalidBackendPlugin(f"backend {record.name!r}: {record.factory} does not exist") from exc
    backend = factory(device_index=device_index)
    if not isinstance(backend, Backend) or backend.name != record.name:
        raise InvalidBackendPlugin(
            f"backend {record.name!r}: {record.factory} built {backend!r}, expected a Backend "
            f"named {record.name!r}"
        )
    return backend


def _unknown_message(requested: str, records: dict[str, BackendRecord]) -> str:
    installed = ", ".join(records) or "none"
    if requested in FIRST_PARTY_INSTALL:
        return (
            f"the {requested!r} backend is not installed: run `{FIRST_PARTY_INSTALL[requested]}` "
            f"(or DEEPINFER_ACCELERATOR={requested} ./build.sh). Installed backends: {installed}."
        )
    missing = [f"{name} (`{cmd}`)" for name, cmd in FIRST_PARTY_INSTALL.items() if name not in records]
    hint = f" Not installed: {', '.join(missing)}." if missing else ""
    return (
        f"no backend named {requested!r}. Installed backends: {installed}.{hint} "
        "Set DEEPINFER_ACCELERATOR to an installed backend's name or to 'auto'."
    )
