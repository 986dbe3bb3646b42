"""A CUDA device without a GPU, for tests: the CUDA backend routed to the CPU emulator.

    from cuda_device_harness import HostDevice, emulated_cuda   # noqa: F401 (the fixture)

    def test_something(emulated_cuda):
        y = ops.matmul(HostDevice(a), HostDevice(b))    # runs the generated CUDA code
        assert isinstance(y, HostDevice)                  # what the "backend" allocated
        emulated_cuda.launched                            # the specs launched, in order

The "device" is host memory: `HostDevice` exposes `__cuda_array_interface__` over a numpy
buffer (its `.host`), so the runtime sees device data (tpp.runtime.device_arrays.CudaView on
cuda:0) while every address a kernel receives is a host address the emulator can use.
`CaiOnly` is the same with nothing else (no shape, dtype or reshape): a producer the library
knows only through the interface.

The fixture `emulated_cuda` replaces what tpp_cuda.runtime offers the CUDA backend
(tpp_cuda.plugin): `function(spec, device)` compiles the spec's CUDA source
(tpp_cuda.generators.source: the generator modules, and tpp_cuda.loopnest for loop nests) with
g++ against tests/cuda_emulator.h, one `EmulatedModule` per distinct source, cached for the
process; its `launch(args, torch_stream=False, geometry=None)` is CudaFunction.launch's
(geometry: the runtime's, for loop nests; else the generator's). `empty` gives a HostDevice
filled with NaN (0xff bytes for integers), so an element no kernel wrote shows up; `to_device`
a HostDevice copy; `tpp.runtime.arrays.to_host` reads a HostDevice's buffer. Torch CUDA
tensors cannot be made without a GPU: like_torch allocations are HostDevice arrays too.
The runtime's device caches (the LRUs named "device_*": the device code each compiled nest
keeps, the operators' device constants) are emptied before and after each test, so no test
sees code or memory another test's routing made.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

import tpp
from tpp.runtime import arrays, lru
from tpp.runtime.device_arrays import CudaView
from tpp_cuda import generators, runtime

from cuda_emulator import EmulatedModule, available

__all__ = ["HostDevice", "CaiOnly", "emulated_cuda", "available", "host_of"]


class CaiOnly:
    """Device data known only through `__cuda_array_interface__` (over `host`'s buffer)."""

    def __init__(self, host: np.ndarray):
        self.host = host
        base = host.__array_interface__
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": base["typestr"],
                                         "data": (host.ctypes.data, not host.flags.writeable),
                                         "version": 3, "strides": host.strides}


class HostDevice(CaiOnly):
    """A cupy-like 'device' array over host memory: shape, dtype, ndim, indexing, reshape and
    .T give HostDevice views of the same buffer (reshape copies where numpy's does)."""

    def __init__(self, host: np.ndarray):
        super().__init__(host)
        self.dtype, self.shape, self.ndim = host.dtype, host.shape, host.ndim

    def __getitem__(self, index):
        return HostDevice(self.host[index])

    def reshape(self, *shape):
        return HostDevice(self.host.reshape(*shape))

    @property
    def T(self):
        return HostDevice(self.host.T)

    def __repr__(self):
        return f"<HostDevice {self.shape} {self.dtype}>"


def host_of(x) -> np.ndarray:
    """The numpy buffer behind a HostDevice / CaiOnly (x itself for anything else)."""
    return x.host if isinstance(x, CaiOnly) else x


_MODULES: dict = {}             # CUDA source -> EmulatedModule (compiled once per process)
_LOCK = threading.Lock()


def _module(source: str, name: str) -> EmulatedModule:
    with _LOCK:
        module = _MODULES.get(source)
        if module is None:
            module = _MODULES[source] = EmulatedModule({name: source})
        return module


class EmulatedFunction:
    """tpp_cuda.runtime.CudaFunction's interface, run by the emulator."""

    def __init__(self, spec, launched: list):
        self.spec, self.launched = spec, launched
        self.name = generators.kernel_name(spec)
        self.source = generators.source(spec)
        self.module = _module(self.source, self.name)
        self.geometry = None if spec.family == "loopnest" else generators.launch(spec)

    def launch(self, args, torch_stream: bool = False, geometry=None):
        self.launched.append(self.spec)
        self.module.launch(self.name, geometry or self.geometry, [int(a) for a in args])


def _poisoned(shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    if out.dtype.kind == "f" or dtype in (tpp.core.dtypes.BF16.numpy,):
        out[...] = np.nan
    else:
        out.view(np.uint8)[...] = 0xFF
    return out


@dataclass
class Emulated:
    """What the fixture gives a test: the specs whose kernels were launched, in order, and
    the (spec, device) pairs the backend was asked to compile."""
    launched: list = field(default_factory=list)
    compiled: list = field(default_factory=list)


@pytest.fixture
def emulated_cuda(monkeypatch):
    """Route tpp_cuda.runtime (compile, allocate, copy) and arrays.to_host to the emulator."""
    state = Emulated()

    def function(spec, device):
        state.compiled.append((spec, device))
        return EmulatedFunction(spec, state.launched)

    monkeypatch.setattr(runtime, "function", function)
    monkeypatch.setattr(runtime, "empty", lambda shape, dtype, device, like_torch:
                        HostDevice(_poisoned(shape, dtype.numpy)))
    monkeypatch.setattr(runtime, "to_device", lambda host, device, like_torch:
                        HostDevice(np.array(host, copy=True, order="C")))
    host_copy = arrays.to_host
    monkeypatch.setattr(arrays, "to_host", lambda a: host_of(a.obj) if isinstance(a, CudaView)
                        else host_copy(a))
    _clear_device_caches()
    yield state
    _clear_device_caches()


def _clear_device_caches():
    for cache in lru._live():
        if cache.name.startswith("device_") or cache.name == "cuda_functions":
            cache.clear()


@functools.lru_cache(maxsize=1)
def fake_cuda_class():
    """FakeCuda(shape, dtype=torch.float32, requires_grad=False): a torch tensor that says it
    is on cuda:0 (metadata only: no storage, no GPU needed), to check that torch CUDA tensors
    reach the CUDA path; detach/alias/view/reshape give FakeCuda tensors of the new shape,
    anything else raises (it would need a GPU). Needs torch."""
    import torch

    class FakeCuda(torch.Tensor):
        __module__ = "torch._fake_cuda"     # so the runtime sees a torch tensor

        @staticmethod
        def __new__(cls, shape, dtype=torch.float32, requires_grad=False):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cuda",
                                                       requires_grad=requires_grad)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return FakeCuda(args[0].shape, args[0].dtype)
            if func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                        torch.ops.aten.reshape.default):
                shape = [int(d) for d in args[1]]
                if -1 in shape:
                    known = int(np.prod([d for d in shape if d != -1]))
                    shape = [args[0].numel() // known if d == -1 else d for d in shape]
                return FakeCuda(torch.Size(shape), args[0].dtype)
            raise RuntimeError(f"FakeCuda: {func} needs a GPU")

    return FakeCuda


def skip_if_gpu():
    """Skip a test of what happens without a GPU when one is usable here (then
    tests/test_cuda_runtime.py runs the real thing)."""
    if runtime.available():
        pytest.skip("a GPU is visible: tests/test_cuda_runtime.py runs the real thing")
