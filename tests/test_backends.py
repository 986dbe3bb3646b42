"""The layering and the backend registry: the core imports no runtime and no backend, the
runtime reaches backends only through the registry, and a backend registered at run time (or
offered by an entry point) gets the calls whose data live on its devices."""
import ast
from pathlib import Path

import numpy as np
import pytest

import tpp
from tpp.core.errors import ArgumentError, UnsupportedError
from tpp.runtime import registry
from tpp.runtime.device import CPU, Device

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set:
    """The absolute module names a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return found


def _files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _files("tpp"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_tpp_package_imports_no_backend(path):
    bad = {m for m in _imports(path) if m.split(".")[0] in ("tpp_cpu", "tpp_cuda", "ops")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _files("tpp/core"), ids=lambda p: p.name)
def test_the_core_imports_no_runtime(path):
    bad = {m for m in _imports(path) if m.startswith("tpp.runtime") or m == "tpp"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("backend,other", [("tpp_cpu", "tpp_cuda"), ("tpp_cuda", "tpp_cpu")])
def test_backends_do_not_import_each_other(backend, other):
    for path in _files(backend):
        assert not {m for m in _imports(path) if m.split(".")[0] == other}, path.name


def test_devices():
    assert Device("cuda", 1) == Device.parse("cuda:1") and str(Device("cuda", 1)) == "cuda:1"
    assert Device.parse("cpu") is not None and Device.parse("cpu").is_host and str(CPU) == "cpu"
    for bad in ("cuda:x", 3, ":1"):
        with pytest.raises(ArgumentError):
            Device.parse(bad)
    with pytest.raises(ArgumentError):
        Device("cuda", -1)
    torch = pytest.importorskip("torch")
    assert Device.parse(torch.device("cuda", 2)) == Device("cuda", 2)


def test_the_builtin_backends_come_from_the_registry():
    assert {"cpu", "cuda"} <= set(registry.names())
    assert registry.for_device(CPU).name == "cpu"
    assert registry.for_device(Device("cuda", 0)).name == "cuda"
    with pytest.raises(UnsupportedError, match="no backend runs on 'nowhere'"):
        registry.for_device(Device("nowhere"))
    with pytest.raises(UnsupportedError, match="no backend named"):
        registry.get("nowhere")


# ---------------------------------------------------------------- a dummy backend
class _Recorded(registry.Compiled):
    def __init__(self, backend, spec, device):
        self.backend, self.spec, self.device = backend, spec, device

    def launch(self, args, *, torch_stream=False):
        self.backend.launches.append((self.spec, self.device, tuple(args), torch_stream))

    def dump(self, what):
        return f"dummy code for {self.spec.key()}"


class _Nest:
    def __init__(self, backend, spec, device):
        self.backend, self.spec, self.device = backend, spec, device

    def run(self, addresses, sizes, *, threads=None, torch_stream=False):
        self.backend.launches.append((self.spec, self.device, tuple(addresses) + tuple(sizes),
                                      torch_stream))


class DummyBackend(registry.Backend):
    """Owns torch's "meta" device (tensors with shapes and no memory): it records what it is
    asked to run and runs nothing."""
    name = "dummy"
    kinds = ("meta",)
    dump_kinds = ("dummy",)

    def __init__(self):
        self.launches, self.compiled = [], []

    def compile(self, spec, device):
        self.compiled.append(spec)
        return _Recorded(self, spec, device)

    def compile_nest(self, spec, device):
        return _Nest(self, spec, device)

    def empty(self, shape, dtype, device, like_torch):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype.torch_name), device="meta")

    def dump(self, spec, what, isa=None):
        return f"dummy code for {spec.key()}"


@pytest.fixture
def dummy():
    torch = pytest.importorskip("torch")
    backend = registry.register(DummyBackend())
    yield backend, torch
    registry.unregister("dummy")


def test_a_registered_backend_gets_the_calls_on_its_devices(dummy):
    backend, torch = dummy
    relu = tpp.unary("relu", 4, 8)
    y = relu(torch.empty((4, 8), device="meta"))
    assert y.device.type == "meta" and y.shape == (4, 8)
    spec, device, args, torch_stream = backend.launches[-1]
    assert spec == relu.spec and device == Device("meta") and len(args) == 2 and torch_stream

    mm = tpp.brgemm(4, 6, 5)
    c = mm(torch.empty((3, 4, 5), device="meta"), torch.empty((3, 5, 6), device="meta"))
    assert c.device.type == "meta" and backend.launches[-1][0] == mm.spec
    assert backend.launches[-1][2][5] == 3            # count, in the raw signature's place

    assert relu.dump("dummy") == f"dummy code for {relu.spec.key()}"
    # host data still runs on the CPU
    np.testing.assert_array_equal(relu(np.full((4, 8), -1, np.float32)), 0)


def test_a_registered_backend_runs_loop_nests(dummy):
    backend, torch = dummy
    M = tpp.size("M")
    nest = tpp.LoopNest("A", a=M)
    x, y = nest.tensor("x", (M, 8)), nest.tensor("y", (M, 8))
    a, = nest.vars
    nest.call(tpp.unary("relu", 1, 8), x[a], y[a])
    compiled = nest.compile()
    compiled(torch.empty((5, 8), device="meta"), torch.empty((5, 8), device="meta"))
    spec, device, words, _ = backend.launches[-1]
    assert spec == compiled.spec and device == Device("meta") and words[-1] == 5
    with pytest.raises(ArgumentError, match="different devices"):
        compiled(torch.empty((5, 8), device="meta"), np.zeros((5, 8), np.float32))
    with pytest.raises(ArgumentError, match="conflicting sizes"):
        compiled(torch.empty((5, 8), device="meta"), torch.empty((4, 8), device="meta"))


def test_mixed_devices_are_refused_before_any_backend_runs(dummy):
    backend, torch = dummy
    with pytest.raises(ArgumentError, match="different devices"):
        tpp.binary("add", 4, 8)(torch.empty((4, 8), device="meta"), np.zeros((4, 8), np.float32))
    assert not backend.launches


def test_an_entry_point_adds_a_backend(monkeypatch):
    class FakeEntryPoint:
        name = "fromplugin"

        @staticmethod
        def load():
            class Plugin(DummyBackend):
                name, kinds = "fromplugin", ("plugindev",)
            return Plugin

    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == registry.ENTRY_POINT_GROUP
                        else [])
    monkeypatch.setattr(registry, "_read_entry_points", False)
    monkeypatch.setattr(registry, "_FACTORIES", {})
    try:
        assert "fromplugin" in registry.names()
        backend = registry.for_device(Device("plugindev", 3))
        assert backend.name == "fromplugin" and registry.get("fromplugin") is backend
        assert registry.get("cpu").name == "cpu"          # the built-ins are still found
    finally:
        registry.unregister("fromplugin")


def test_registering_a_taken_name_needs_replace():
    cpu = registry.get("cpu")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(cpu)
    assert registry.register(cpu, replace=True) is cpu
