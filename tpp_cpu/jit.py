"""LLVM in one place: initialisation, optimisation, object emission, loading, dumping.

Kernels are compiled to relocatable object code (what the disk cache stores) and loaded into
one MCJIT engine per process; loading an object needs no optimisation, so a cached kernel is
ready in about a millisecond.
"""
from __future__ import annotations

import functools
import threading

from tpp.errors import CompileError

_LOCK = threading.RLock()


@functools.lru_cache(maxsize=None)
def llvm():
    """The initialised llvmlite.binding module (imported lazily: importing tpp stays cheap)."""
    import llvmlite.binding as binding
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    return binding


def llvm_version() -> str:
    return ".".join(map(str, llvm().llvm_version_info))


@functools.lru_cache(maxsize=None)
def target_machine(target):
    """Position-independent code, so an object can be linked into a shared library."""
    from .target import llvm_cpu_and_features
    cpu, features = llvm_cpu_and_features(target)
    return llvm().Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic", codemodel="default")


def optimize(module_ir, target, level: int = 3, vectorize: bool = True):
    """Parse, verify and optimise (O`level`) an llvmlite.ir module; returns a ModuleRef.
    vectorize=False skips LLVM's loop/SLP vectorizers and unroller, for generators that emit
    vector code already unrolled (they only cost compile time there)."""
    b = llvm()
    module_ir.triple = b.get_default_triple()
    tm = target_machine(target)
    module_ir.data_layout = str(tm.target_data)
    try:
        mod = b.parse_assembly(str(module_ir))
        mod.verify()
    except RuntimeError as exc:  # a generator bug, never a user error
        raise CompileError(f"generated IR does not verify: {exc}") from exc
    with _LOCK:
        tuning = b.create_pipeline_tuning_options(speed_level=level)
        if not vectorize:
            tuning.loop_vectorization = tuning.slp_vectorization = False
            tuning.loop_unrolling = tuning.loop_interleaving = False
        builder = b.create_pass_builder(tm, tuning)
        builder.getModulePassManager().run(mod, builder)
    return mod


def emit_object(mod, target) -> bytes:
    with _LOCK:
        return target_machine(target).emit_object(mod)


def emit_assembly(mod, target) -> str:
    with _LOCK:
        return target_machine(target).emit_assembly(mod)


class _Engine:
    """One MCJIT engine per target: object files are added to it and stay for the process."""

    def __init__(self, target):
        b = llvm()
        self._ee = b.create_mcjit_compiler(b.parse_assembly(""), target_machine(target))
        self._objects = []

    def load(self, obj: bytes, symbol: str) -> int:
        b = llvm()
        ref = b.ObjectFileRef.from_data(obj)
        self._objects.append(ref)
        self._ee.add_object_file(ref)
        self._ee.finalize_object()
        addr = self._ee.get_function_address(symbol)
        if not addr:
            raise CompileError(f"symbol {symbol} not found in the loaded object")
        return addr


@functools.lru_cache(maxsize=None)
def _engine(target) -> _Engine:
    return _Engine(target)


def load(obj: bytes, symbol: str, target) -> int:
    """Load object code and return the address of `symbol`."""
    with _LOCK:
        return _engine(target).load(obj, symbol)
