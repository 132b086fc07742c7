"""Backend discovery and selection: entry points, priorities, names, and the errors users see."""

from __future__ import annotations

import sys
import types

import pytest

from deepinfer_core.platform import BackendRecord, BackendUnavailable, UnknownBackend, hookimpl
from deepinfer_core.platform.errors import DuplicateBackend, InvalidBackendPlugin
from deepinfer_core.platform.registry import BackendRegistry, select_backend
from deepinfer_core.reference.backend import CpuBackend


class FastBackend(CpuBackend):
    name = "fast"
    priority = 50


class BrokenBackend(CpuBackend):
    name = "broken"
    priority = 100

    def check(self) -> None:
        raise BackendUnavailable("the broken device is unplugged")


@pytest.fixture
def fake_backends(monkeypatch):
    module = types.ModuleType("fake_backends")
    module.FastBackend = FastBackend
    module.BrokenBackend = BrokenBackend
    monkeypatch.setitem(sys.modules, "fake_backends", module)


def _plugin(name: str, factory: str, priority: int) -> object:
    @hookimpl
    def deepinfer_backend() -> BackendRecord:
        return BackendRecord(name=name, factory=factory, priority=priority, install=f"pip install {name}")

    return types.SimpleNamespace(deepinfer_backend=deepinfer_backend)


def _registry(*plugins: tuple[str, str, int]) -> BackendRegistry:
    registry = BackendRegistry()
    registry.register(_plugin("cpu", "deepinfer_core.reference.backend:CpuBackend", 0), "cpu-plugin")
    for name, factory, priority in plugins:
        registry.register(_plugin(name, factory, priority), f"{name}-plugin")
    return registry


def test_cpu_backend_arrives_through_the_entry_point_group():
    record = BackendRegistry.from_entry_points().records()["cpu"]
    assert record.factory == "deepinfer_core.reference.backend:CpuBackend"
    assert record.priority == 0


def test_environment_variable_selects_the_backend(monkeypatch, fake_backends):
    registry = _registry(("fast", "fake_backends:FastBackend", 50))
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", " CPU ")
    assert registry.select().name == "cpu"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "fast")
    assert registry.select().name == "fast"


def test_explicit_name_wins_over_the_environment(monkeypatch, fake_backends):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "fast")
    registry = _registry(("fast", "fake_backends:FastBackend", 50))
    assert registry.select("cpu").name == "cpu"


@pytest.mark.parametrize("value", [None, "", "auto", "AUTO"])
def test_auto_takes_the_highest_priority_available_backend(monkeypatch, fake_backends, value):
    if value is None:
        monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_ACCELERATOR", value)
    registry = _registry(
        ("fast", "fake_backends:FastBackend", 50), ("broken", "fake_backends:BrokenBackend", 100)
    )
    assert registry.select().name == "fast"


def test_named_unavailable_backend_raises_its_reason_instead_of_falling_back(fake_backends):
    registry = _registry(("broken", "fake_backends:BrokenBackend", 100))
    with pytest.raises(BackendUnavailable, match="'broken'.*the broken device is unplugged"):
        registry.select("broken")


def test_unknown_name_lists_installed_backends_and_missing_extras():
    with pytest.raises(UnknownBackend) as info:
        _registry().select("nope")
    message = str(info.value)
    assert "'nope'" in message and "Installed backends: cpu" in message
    assert "deepinfer[nvidia]" in message and "deepinfer[ascend]" in message and "./build.sh" in message


@pytest.mark.parametrize("name", ["nvidia", "ascend"])
def test_known_backend_that_is_not_installed_names_its_extra(name):
    with pytest.raises(UnknownBackend, match=rf"'{name}' backend is not installed.*deepinfer\[{name}\]"):
        _registry().select(name)


def test_duplicate_names_are_a_loud_error(fake_backends):
    registry = _registry(("fast", "fake_backends:FastBackend", 50))
    registry.register(_plugin("fast", "fake_backends:FastBackend", 10), "second-fast-plugin")
    with pytest.raises(DuplicateBackend, match="'fast' is registered twice.*fast-plugin.*second-fast-plugin"):
        registry.records()


def test_malformed_records_are_rejected():
    registry = BackendRegistry()
    registry.register(types.SimpleNamespace(deepinfer_backend=hookimpl(lambda: {"name": "x"})), "dict-plugin")
    with pytest.raises(InvalidBackendPlugin, match="returned dict"):
        registry.records()

    registry = BackendRegistry()
    registry.register(_plugin("bad", "no_colon_here", 1), "bad-plugin")
    with pytest.raises(InvalidBackendPlugin, match="expected 'package.module:Attribute'"):
        registry.records()

    registry = BackendRegistry()
    registry.register(_plugin("Bad Name", "a:b", 1), "bad-name-plugin")
    with pytest.raises(InvalidBackendPlugin, match="lower case"):
        registry.records()


def test_factory_must_build_a_backend_of_the_registered_name(fake_backends):
    registry = _registry(("impostor", "fake_backends:FastBackend", 5))
    with pytest.raises(InvalidBackendPlugin, match="expected a Backend named 'impostor'"):
        registry.select("impostor")


def test_factory_that_cannot_be_imported_is_unavailable_with_the_install_command():
    registry = _registry(("ghost", "no_such_module_anywhere:Backend", 5))
    with pytest.raises(BackendUnavailable, match="pip install ghost"):
        registry.select("ghost")


def test_probe_reports_every_backend_highest_priority_first(fake_backends):
    registry = _registry(
        ("fast", "fake_backends:FastBackend", 50), ("broken", "fake_backends:BrokenBackend", 100)
    )
    statuses = registry.probe()
    assert [s.record.name for s in statuses] == ["broken", "fast", "cpu"]
    assert [s.available for s in statuses] == [False, True, True]
    assert statuses[0].reason == "the broken device is unplugged"


def test_select_backend_reads_installed_plugins(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    backend = select_backend()
    assert isinstance(backend, CpuBackend)
