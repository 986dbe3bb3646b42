"""The CPU backend as the runtime sees it: a tpp.runtime.registry.Backend for host memory.

Registered as "cpu" (setup.py's "tpp.backends" entry point). Kernels compile through
tpp_cpu.backend (LLVM, disk cache) for the target TPP_CPU_ISA selects (tpp_cpu.target);
`CpuCompiled.address` is the C function's address, which the runtime's checked calls and raw
paths call through cffi; `launch(args)` calls it with 64-bit words like any backend's code.
Loop nests compile with the kernels they call into one library (`CpuNest`), and run on the
OpenMP runtime (tpp_cpu.threads).
"""
from __future__ import annotations

import numpy as np

from tpp.runtime.registry import Backend, Compiled
from tpp.runtime.arrays import ffi

from . import backend, loopnest, target, threads

_DUMPS = ("asm", "ir", "opt")
_ISAS = ("avx512", "avx2")


class CpuCompiled(Compiled):
    """One spec's C function, loaded: `address`, and launch() for any arity."""

    def __init__(self, compiled: backend.CompiledKernel, device):
        self.spec, self.device, self.address = compiled.spec, device, compiled.address
        self.key_parts = (compiled.target.key(), backend.generator_version(), backend.llvm_build())
        self._callers: dict = {}

    def launch(self, args, *, torch_stream: bool = False) -> None:
        fn = self._callers.get(len(args))
        if fn is None:
            signature = f"void(*)({', '.join(['intptr_t'] * len(args))})"
            fn = self._callers[len(args)] = ffi.cast(signature, self.address)
        fn(*args)

    def dump(self, what: str) -> str:
        return backend.dump(self.spec, what)


class CpuNest:
    """A loop nest and the kernels it calls, loaded. Its entry takes the address of an int64
    call table (tpp_cpu.loopnest.layout): `template` is that table with everything but the
    tensors, the thread count and the sizes filled in."""

    def __init__(self, spec):
        self.spec = spec
        self.slots = slots = loopnest.layout(spec)
        table = np.zeros(slots["size"], np.int64)
        entry, kernels = backend.compile_with_kernels(spec, spec.kernel_specs())
        table[slots["kernels"]:slots["kernels"] + len(kernels)] = kernels
        omp = threads.runtime()
        if omp is not None:
            table[slots["runtime"]:slots["runtime"] + len(omp)] = omp
        self.template = table
        self.parallel = omp is not None       # False: every call runs on one thread
        self.entry = ffi.cast("void(*)(void **)", entry.address)
        self.num_threads = threads.num_threads

    def table(self, addresses, sizes, threads=None) -> np.ndarray:
        """The call table of the entry for these tensor addresses, sizes and threads (None:
        tpp.get_num_threads(); one thread where libgomp is missing)."""
        table = self.template.copy()
        table[0] = (threads or self.num_threads()) if self.parallel else 1
        table[1:1 + len(addresses)] = addresses
        table[self.slots["sizes"]:] = sizes
        return table

    def run_table(self, table) -> None:
        self.entry(ffi.cast("void **", table.ctypes.data))

    def run(self, addresses, sizes, *, threads=None, torch_stream: bool = False) -> None:
        self.run_table(self.table(addresses, sizes, threads))

    def dump(self, what: str = "asm") -> str:
        return backend.dump(self.spec, what)


class CpuBackend(Backend):
    name = "cpu"
    kinds = ("cpu",)
    dump_kinds = _DUMPS

    def compile(self, spec, device=None) -> CpuCompiled:
        from tpp.runtime.device import CPU
        return CpuCompiled(backend.compile(spec), CPU if device is None else device)

    def compile_nest(self, spec, device=None) -> CpuNest:
        return CpuNest(spec)

    def empty(self, shape, dtype, device, like_torch: bool):
        if like_torch:
            import torch
            return torch.empty(shape, dtype=getattr(torch, dtype.torch_name))
        return np.empty(shape, dtype.numpy)

    def to_device(self, host, device, like_torch: bool):
        if like_torch:
            import torch
            return torch.from_numpy(np.ascontiguousarray(host))
        return host

    def dump(self, spec, what: str, isa: str | None = None) -> str:
        from tpp.core.errors import ArgumentError
        if what not in _DUMPS:
            raise ArgumentError(f"dump: what must be one of {', '.join(_DUMPS)} for CPU code, "
                                f"got {what!r}")
        if isa is not None and isa not in _ISAS:
            raise ArgumentError(f"dump: isa for CPU code must be one of {', '.join(_ISAS)} "
                                f"(or None for this host's), got {isa!r}")
        tgt = target.current() if isa is None else target.make_target(isa)
        return backend.dump(spec, what, tgt)

    def cache_key_parts(self) -> tuple:
        return ("cpu", target.current().key(), backend.generator_version(), backend.llvm_build())

    def dot_dtypes(self) -> frozenset:
        """{"bf16"} where the target has vdpbf16ps (avx512_bf16 and TPP_CPU_ISA not avx2)."""
        return frozenset({"bf16"}) if target.current().bf16_dot else frozenset()

    def matrix_dtypes(self) -> frozenset:
        """{"bf16"} where BRGEMMs run on AMX tiles (tpp_cpu.brgemm_amx): bf16 A not transposed,
        VNNI bf16 B."""
        return frozenset({"bf16"}) if target.current().amx else frozenset()

    # the CPU backend's own controls, reached by tpp.get_num_threads & co. through the registry
    def num_threads(self) -> int:
        return threads.num_threads()

    def set_num_threads(self, n) -> None:
        threads.set_num_threads(n)

    def counts(self) -> dict:
        """Kernels compiled by LLVM ("compiled") and loaded from the disk cache ("disk_hits")
        by this process so far."""
        return {"compiled": backend.COUNTS["built"], "disk_hits": backend.COUNTS["loaded"]}
