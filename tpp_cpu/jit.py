"""LLVM in one place: initialisation, optimisation, object emission, loading, dumping.

Kernels are compiled to relocatable object code (what the disk cache stores, linked into a
shared library: tpp_cpu.sharedlib) or loaded into one MCJIT engine per process; loading an
object needs no optimisation, so a cached kernel is ready in about a millisecond.
"""
from __future__ import annotations

import functools
import threading

from tpp.core.errors import CompileError

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


# The passes for code a generator emits vectorised, unrolled and register-blocked already
# (BRGEMM, loop nests): SROA, instcombine and CFG simplification clean up the generator's
# address arithmetic and loop rotation gives its loops a bottom test; O3's other ~50 passes
# leave the inner loops as they are (the same FMA, broadcast and load sequence) and cost
# several times as much (a 64x64x768 f32 BRGEMM: 45 -> 6 ms, the same GFLOP/s within 1%).
# Code generation (the target machine's O3) still schedules and allocates registers.
LIGHT = ("sroa", "instruction_combine", "simplify_cfg", "loop_rotate")


def ir_text(module_ir, target) -> str:
    """The textual IR of an llvmlite.ir module, for this target's triple and data layout."""
    module_ir.triple, module_ir.data_layout = _triple_and_layout(target)
    return str(module_ir)


@functools.lru_cache(maxsize=None)
def _triple_and_layout(target) -> tuple:
    return llvm().get_default_triple(), str(target_machine(target).target_data)


def optimize(module_ir, target, level: int = 3, vectorize: bool = True, passes=None):
    """Parse, verify and optimise an llvmlite.ir module (or its `ir_text`); returns a
    ModuleRef. The pipeline is O`level`; vectorize=False skips LLVM's loop/SLP vectorizers and
    unroller, for generators that emit vector code already unrolled (they only cost compile
    time there). passes (a sequence of names such as LIGHT, each an llvmlite
    `add_<name>_pass`) runs exactly those module passes instead."""
    b = llvm()
    text = module_ir if isinstance(module_ir, str) else ir_text(module_ir, target)
    try:
        mod = b.parse_assembly(text)
        mod.verify()
    except RuntimeError as exc:  # a generator bug, never a user error
        raise CompileError(f"generated IR does not verify: {exc}") from exc
    with _LOCK:
        tuning = b.create_pipeline_tuning_options(speed_level=level)
        if not vectorize:
            tuning.loop_vectorization = tuning.slp_vectorization = False
            tuning.loop_unrolling = tuning.loop_interleaving = False
        builder = b.create_pass_builder(target_machine(target), tuning)
        if passes is None:
            manager = builder.getModulePassManager()
        else:
            manager = b.create_new_module_pass_manager()
            for name in passes:
                getattr(manager, f"add_{name}_pass")()
        manager.run(mod, builder)
    return mod


def emit_object(mod, target, strength_reduce: bool = True) -> bytes:
    """Object code of an optimised module. strength_reduce=False skips code generation's loop
    strength reduction, about half its time on a generator's fully unrolled BRGEMM tiles
    (whose addresses are already base + constant offset: 34 -> 18 ms for 64x64x768 f32, the
    same GFLOP/s within 1% on every BRGEMM shape of tpp-bench brgemm)."""
    with _LOCK, _strength_reduction(strength_reduce):
        return target_machine(target).emit_object(mod)


def emit_assembly(mod, target, strength_reduce: bool = True) -> str:
    with _LOCK, _strength_reduction(strength_reduce):
        return target_machine(target).emit_assembly(mod)


class _strength_reduction:
    """LLVM's -disable-lsr set for one code generation under _LOCK, then restored. The option
    is process-wide: another llvmlite user generating code on another thread in that window
    would skip the pass too, which changes its code's speed, never its correctness."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            llvm().set_option("tpp", "-disable-lsr=1")

    def __exit__(self, *exc):
        if not self.enabled:
            llvm().set_option("tpp", "-disable-lsr=0")


class _Engine:
    """One MCJIT engine per target: object files are added to it and stay for the process."""

    def __init__(self, target):
        b = llvm()
        self._ee = b.create_mcjit_compiler(b.parse_assembly(""), target_machine(target))
        self._objects = []

    def load(self, objects, symbols) -> tuple:
        b = llvm()
        for obj in objects:
            ref = b.ObjectFileRef.from_data(obj)
            self._objects.append(ref)
            self._ee.add_object_file(ref)
        self._ee.finalize_object()
        addresses = tuple(self._ee.get_function_address(symbol) for symbol in symbols)
        for symbol, addr in zip(symbols, addresses):
            if not addr:
                raise CompileError(f"symbol {symbol} not found in the loaded object")
        return addresses


@functools.lru_cache(maxsize=None)
def _engine(target) -> _Engine:
    return _Engine(target)


def load(obj: bytes, symbol: str, target) -> int:
    """Load object code and return the address of `symbol`."""
    return load_all([obj], (symbol,), target)[0]


def load_all(objects, symbols, target) -> tuple:
    """Load object files (linked with each other and with everything loaded before) and
    return the address of each of `symbols`."""
    with _LOCK:
        return _engine(target).load(list(objects), tuple(symbols))
