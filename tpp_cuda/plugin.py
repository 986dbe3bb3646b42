"""The CUDA backend as the runtime sees it: a tpp.runtime.registry.Backend for "cuda" devices.

Registered as "cuda" (setup.py's "tpp.backends" entry point). Specs compile through
tpp_cuda.runtime (CUDA C from tpp_cuda's generators, NVRTC through cupy, cached per spec and
device); memory is cupy's or torch's. Loop nests (`CudaNest`) are one kernel
(tpp_cuda.loopnest): its grid is the nest's parallel band; the levels outside the band are a
host loop of launches, one per iteration, with their values as arguments (that is the barrier
the CPU's threads meet at after each pass over the band).

Everything goes through module attributes of tpp_cuda.runtime (function, empty, to_device), so
the emulator tests can route them to the CPU.
"""
from __future__ import annotations

from tpp.core.errors import ArgumentError
from tpp.runtime.lru import LRU
from tpp.runtime.registry import Backend

from . import generators, runtime

_DUMPS = ("cuda", "ptx", "sass")


class CudaNest:
    """A loop nest compiled for one CUDA device (see the module docstring)."""

    def __init__(self, spec, device):
        from . import loopnest
        self.spec, self.device, self._gen = spec, device, loopnest
        self.function = runtime.function(spec, device.index)
        self._plans = LRU(64, "cuda_nest_launches")   # sizes -> (geometry, outer iterations)

    def run(self, addresses, sizes, *, threads=None, torch_stream: bool = False) -> None:
        sizes = tuple(sizes)
        plan = self._plans.get(sizes)
        if plan is None:        # Python work per new assignment of sizes, not per call
            env = dict(zip(self.spec.sizes, sizes))
            plan = self._plans[sizes] = (self._gen.launch(self.spec, env),
                                         self._gen.outer_iterations(self.spec, env))
        geometry, outers = plan
        head = list(addresses) + list(sizes)
        for outer in outers:
            self.function.launch(head + list(outer), torch_stream=torch_stream,
                                 geometry=geometry)

    def dump(self, what: str = "cuda") -> str:
        return self.function.dump(what)


class CudaBackend(Backend):
    name = "cuda"
    kinds = ("cuda",)
    dump_kinds = _DUMPS

    def available(self) -> bool:
        return runtime.available()

    def supports(self, spec) -> bool:
        return generators.supported(spec)

    def compile(self, spec, device):
        return runtime.function(spec, device.index)

    def compile_nest(self, spec, device) -> CudaNest:
        return CudaNest(spec, device)

    def empty(self, shape, dtype, device, like_torch: bool):
        return runtime.empty(shape, dtype, device.index, like_torch)

    def to_device(self, host, device, like_torch: bool):
        return runtime.to_device(host, device.index, like_torch)

    def dump(self, spec, what: str, isa: str | None = None) -> str:
        if what not in _DUMPS:
            raise ArgumentError(f"dump: what must be one of {', '.join(_DUMPS)} for CUDA code, "
                                f"got {what!r}")
        source = generators.source(spec)
        if what == "cuda":
            return source
        from . import nvcc
        return nvcc.disassemble(source, isa or "sm_90", what)

    def cache_key_parts(self) -> tuple:
        return ("cuda",)
