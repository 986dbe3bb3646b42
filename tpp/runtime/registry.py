"""Backends as plugins: the `Backend` interface, and the registry that finds one per device.

A backend turns specs (tpp.core) into code for the devices of one kind and owns the memory of
those devices. The runtime never imports a backend: it asks this registry for the backend that
owns the `Device` where a call's data lives (`for_device`) or for one by name (`get`).

Backends are registered by name, three ways, first match wins:
  1. `register(backend)` at run time (tests, an application's own backend);
  2. the entry points of group "tpp.backends" (`name = package.module:factory`, where
     factory() returns the Backend): how an installed package adds one, e.g. in setup.py
     `entry_points={"tpp.backends": ["neon = tpp_neon.plugin:NeonBackend"]}`;
  3. this package's own two, by module path, for a source tree that was not pip-installed
     (tpp.runtime.registry.BUILTIN).
Entry points are read once, on the first lookup that needs them; a backend's module is
imported only when that backend is first asked for.

The compiled object a backend returns has one shape on every backend (`Compiled`): `launch`
runs it on 64-bit argument words (device addresses, then the spec's scalars), `dump` shows the
generated code, `key_parts` says what besides the spec makes its cache key.
"""
from __future__ import annotations

import importlib
import threading
from importlib import metadata

from ..core.errors import UnsupportedError
from .device import Device

ENTRY_POINT_GROUP = "tpp.backends"
BUILTIN = {"cpu": "tpp_cpu.plugin:CpuBackend", "cuda": "tpp_cuda.plugin:CudaBackend"}


class Compiled:
    """One spec compiled for one device (what Backend.compile returns)."""

    spec: object
    device: Device
    key_parts: tuple = ()     # what besides the spec keys this code (ISA, LLVM, arch, ...)

    def launch(self, args, *, torch_stream: bool = False) -> None:
        """Run on `args`: one 64-bit word per operand (its address) in spec.operands() order
        (a BRGEMM: the words of tpp.core.brgemm_spec's raw signature), then the spec's
        scalars. Device backends queue the work on the current stream (torch's when
        torch_stream) and return at once."""
        raise NotImplementedError

    def dump(self, what: str) -> str:
        raise NotImplementedError


class Backend:
    """The interface of a backend (subclass it; see the module docstring).

    name         the registry name ("cpu", "cuda", ...)
    kinds        the Device kinds whose memory it owns
    dump_kinds   the `what` values its dump() understands ("asm", "ptx", ...)
    """

    name: str = ""
    kinds: tuple = ()
    dump_kinds: tuple = ()

    def available(self) -> bool:
        """Whether it can run code here (a GPU backend without a GPU: False)."""
        return True

    def supports(self, spec) -> bool:
        """Whether compile(spec, ...) can succeed (the rest raise UnsupportedError)."""
        return True

    def compile(self, spec, device: Device) -> Compiled:
        raise UnsupportedError(f"the {self.name} backend compiles no {spec.family} specs")

    def compile_nest(self, spec, device: Device):
        """A LoopNestSpec compiled for `device`: an object with
        run(addresses, sizes, *, threads=None, torch_stream=False), addresses one per tensor
        of spec.tensors (already validated), sizes one int per spec.sizes."""
        raise UnsupportedError(f"the {self.name} backend does not run loop nests")

    def empty(self, shape: tuple, dtype, device: Device, like_torch: bool):
        """An uninitialised array of a tpp.core.dtypes.DType on `device` (a torch tensor when
        like_torch)."""
        raise UnsupportedError(f"the {self.name} backend allocates no memory")

    def to_device(self, host, device: Device, like_torch: bool):
        """A copy of a host numpy array on `device`."""
        raise UnsupportedError(f"the {self.name} backend copies no memory")

    def dump(self, spec, what: str, isa: str | None = None) -> str:
        raise UnsupportedError(f"the {self.name} backend has no dumps")

    def dot_dtypes(self) -> frozenset:
        """Names of the input dtypes whose BRGEMM products this backend's code computes with
        a dot instruction of their own (pairs of products summed into f32, e.g. bf16 with
        avx512_bf16): only for those does a VNNI-packed B pay for its packing. Products of
        other narrow dtypes are widened to f32 and run at the f32 rate either way."""
        return frozenset()

    def matrix_dtypes(self) -> frozenset:
        """Names of the input dtypes whose BRGEMMs with a row-major A and VNNI-packed B run on
        a matrix unit (AMX tiles); a transposed A costs a transposition inside the kernel
        there, which an operator may do once itself. A subset of dot_dtypes()."""
        return frozenset()

    def cache_key_parts(self) -> tuple:
        """What besides a spec decides the code this backend makes (generator version,
        compiler, target): part of its cache keys."""
        return (self.name,)

    def __repr__(self):
        return f"<tpp backend {self.name!r} for {', '.join(self.kinds)}>"


_LOCK = threading.RLock()
_BACKENDS: dict = {}        # name -> Backend (instantiated)
_FACTORIES: dict = {}       # name -> "module:attr" or a callable, not yet instantiated
_read_entry_points = False


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend instance under backend.name; an existing name needs replace=True."""
    if not isinstance(backend, Backend) or not backend.name:
        raise TypeError("register() takes a Backend instance with a name")
    with _LOCK:
        if backend.name in _BACKENDS and not replace:
            raise ValueError(f"a backend named {backend.name!r} is already registered "
                             f"(pass replace=True to swap it)")
        _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Forget a backend (registered or loaded); the next lookup may load it again from its
    entry point."""
    with _LOCK:
        _BACKENDS.pop(name, None)


def _entry_points() -> None:
    global _read_entry_points
    if _read_entry_points:
        return
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _FACTORIES.setdefault(ep.name, ep.load if hasattr(ep, "load") else ep)
    for name, path in BUILTIN.items():
        _FACTORIES.setdefault(name, path)
    _read_entry_points = True


def _instantiate(name: str) -> Backend | None:
    factory = _FACTORIES.get(name)
    if factory is None:
        return None
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        obj = getattr(importlib.import_module(module), attr)
    else:
        obj = factory()          # an entry point's load()
    backend = obj() if isinstance(obj, type) or not isinstance(obj, Backend) else obj
    if not isinstance(backend, Backend):
        raise UnsupportedError(f"the {ENTRY_POINT_GROUP} entry point {name!r} gave "
                               f"{type(backend).__name__}, not a tpp Backend")
    _BACKENDS.setdefault(name, backend)
    return _BACKENDS[name]


def get(name: str) -> Backend:
    """The backend registered as `name` (loaded from its entry point on first use)."""
    backend = _BACKENDS.get(name)
    if backend is not None:
        return backend
    with _LOCK:
        _entry_points()
        backend = _BACKENDS.get(name) or _instantiate(name)
    if backend is None:
        raise UnsupportedError(f"no backend named {name!r} (known: {', '.join(names())})")
    return backend


def names() -> tuple:
    """The names of every backend registered or offered by an entry point."""
    with _LOCK:
        _entry_points()
        return tuple(sorted(set(_BACKENDS) | set(_FACTORIES)))


def for_device(device: Device) -> Backend:
    """The backend owning `device`'s kind: a registered one first, else the first (by name)
    entry point whose backend claims it."""
    for backend in tuple(_BACKENDS.values()):
        if device.kind in backend.kinds:
            return backend
    with _LOCK:
        _entry_points()
        preferred = [n for n in _FACTORIES if n == device.kind]
        for name in preferred + sorted(set(_FACTORIES) - set(preferred)):
            if name in _BACKENDS:
                continue
            backend = _instantiate(name)
            if backend is not None and device.kind in backend.kinds:
                return backend
    raise UnsupportedError(f"data on {device}: no backend runs on {device.kind!r} devices "
                           f"(backends: {', '.join(names())})")
