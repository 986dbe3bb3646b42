"""The CPU backend's runtime: spec -> generated IR -> machine code (disk-cached) -> address.

`compile(spec)` returns a CompiledKernel whose `address` is a C function
`void f(intptr_t operand0, ..., [int64 seed])` taking one pointer per operand of
`spec.operands()`, in order. `TPP_DUMP=dir` writes each generated kernel's IR (before and after
optimisation) and assembly to that directory when it is compiled.

A kernel is compiled to a relocatable object, linked into a shared library when the system
linker exists (`sharedlib`), stored in the disk cache and loaded with dlopen; a hit in a new
process needs neither LLVM nor the linker. Without a linker, or without a disk cache,
the object is loaded into LLVM's MCJIT engine instead. `compile_with_kernels` builds a loop
nest and the kernels it calls as one library and one cache entry (one link, one load).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from tpp.runtime import cache
from tpp.core.errors import ArgumentError, UnsupportedError

from . import jit, sharedlib
from .target import Target, current

# op kind -> the generator module (imported on first use)
_GENERATORS = {
    "map": "eltwise", "map_inv": "eltwise", "compare": "eltwise",
    "reduce": "reduce",
    "transpose": "transform", "vnni2": "transform", "vnni2_inv": "transform",
    "gather": "transform", "scatter": "transform",
    "brgemm": "brgemm",
    "loopnest": "loopnest",
    "equation": "equation",
}


# Kernels this process got so far: "built" (generated and compiled by LLVM) and "loaded" (a
# disk cache hit). tpp.cache_info() reports them; nothing resets them.
COUNTS = {"built": 0, "loaded": 0}


@dataclass(frozen=True)
class CompiledKernel:
    spec: object
    target: Target
    symbol: str
    address: int
    n_scalars: int      # int64 arguments after the pointers (spec.scalars)


@functools.lru_cache(maxsize=None)
def generator_version() -> str:
    """A hash of the sources that determine generated code (tpp/ and tpp_cpu/), as Triton does:
    any change to them changes every cache key, so a stale kernel is never served."""
    h = hashlib.sha256()
    for pkg in ("tpp", "tpp_cpu"):
        root = Path(__file__).resolve().parent.parent / pkg
        for path in sorted(root.rglob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(spec, target: Target) -> str:
    return f"{spec.key()}|gen={generator_version()}|llvm={llvm_build()}|{target.key()}"


@functools.lru_cache(maxsize=None)
def llvm_build() -> str:
    """Identifies the installed llvmlite (hence LLVM) without loading it: a hash of its
    version file, cheap where importing llvmlite.binding costs tens of milliseconds."""
    import importlib.util
    spec = importlib.util.find_spec("llvmlite")
    version_file = Path(spec.origin).parent / "_version.py"
    try:
        return hashlib.sha256(version_file.read_bytes()).hexdigest()[:12]
    except OSError:
        return jit.llvm_version()


def symbol_for(key: str) -> str:
    return "tpp_" + hashlib.sha256(key.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=None)
def _disk() -> cache.DiskCache:
    return cache.DiskCache(cache.default_directory())


def reset_disk_cache():
    """Forget the disk cache object (tests change TPP_CACHE_DIR between runs)."""
    _disk.cache_clear()


def generate_ir(spec, target: Target, symbol: str):
    module = importlib.import_module(f"tpp_cpu.{_GENERATORS[spec.kind]}")
    return module.generate(spec, target, symbol)


def compile(spec, target: Target | None = None) -> CompiledKernel:
    """The loaded kernel for spec, from the disk cache when a valid entry exists."""
    return compile_with_kernels(spec, (), target)[0]


def compile_with_kernels(spec, kernel_specs, target: Target | None = None) -> tuple:
    """(CompiledKernel of spec, (address of each kernel_specs' function, in order)), all from
    one link, one shared library, one disk cache entry and one load. A loop nest compiles
    with the kernels it calls this way: each of those functions is generated and optimised
    exactly as compile(kernel_spec) would, under a name private to the entry. Where no linker
    exists, an entry of several functions is loaded into MCJIT and not stored on disk.
    tpp.cache_info()'s counters count every function built or loaded."""
    target = current() if target is None else target
    if not target.runnable:
        raise UnsupportedError(f"this host cannot run {target.isa} code (TPP_CPU_ISA="
                               f"{os.environ.get('TPP_CPU_ISA')}); Kernel.dump() shows its code")
    kernel_specs = tuple(kernel_specs)
    key = cache_key(spec, target)
    if kernel_specs:
        key += "|with=" + ";".join(k.key() for k in kernel_specs)
    symbol = symbol_for(key)
    symbols = (symbol,) + tuple(f"{symbol}_k{i}" for i in range(len(kernel_specs)))
    disk = _disk()
    addresses = _load_cached(disk, key, symbols, target)
    if addresses is not None:
        COUNTS["loaded"] += len(symbols)
    else:
        objects = build_object(spec, target, symbol, tuple(zip(kernel_specs, symbols[1:])))
        COUNTS["built"] += len(symbols)
        library = sharedlib.link(objects) if disk.directory is not None else None
        if library is not None or len(objects) == 1:
            disk.store(key, library if library is not None else objects[0])
        if library is not None:
            try:
                addresses = sharedlib.load_all(library, symbols)
            except OSError:
                addresses = None
        if addresses is None:
            addresses = jit.load_all(objects, symbols, target)
    return CompiledKernel(spec, target, symbol, addresses[0], len(spec.scalars)), addresses[1:]


def _load_cached(disk, key, symbols, target):
    """The addresses of a verified cache entry's functions, or None (rebuild)."""
    payload = disk.load(key)
    if payload is None:
        return None
    if sharedlib.is_shared(payload):
        try:
            return sharedlib.load_all(payload, symbols)
        except OSError:
            return None
    if sharedlib.is_object(payload):
        return jit.load_all([payload], symbols, target)
    return None


# Families whose generators emit vector code unrolled and register-blocked already (BRGEMM),
# or only calls and address arithmetic (loop nests): LLVM's light pass list (jit.LIGHT) and
# code generation without loop strength reduction keep their inner loops (checked with
# dump("asm") and tpp-bench brgemm) at a fraction of the compile time. The other families get
# O3 with its vectorizers.
_LIGHT_FAMILIES = ("brgemm", "loopnest")
# Equations emit vector code unrolled as far as they want: O3 without LLVM's unroller, which
# would unroll a row's passes completely and then keep the row's loads in (spilled) registers
# from one pass to the next, and without the vectorizers.
_UNROLLED_FAMILIES = ("equation",)


def _optimize(spec, module_ir, target):
    """The optimised ModuleRef of spec's IR (an llvmlite.ir module)."""
    if spec.family in _LIGHT_FAMILIES:
        return jit.optimize(module_ir, target, passes=jit.LIGHT)
    if spec.family in _UNROLLED_FAMILIES:
        return jit.optimize(module_ir, target, vectorize=False)
    return jit.optimize(module_ir, target)


def _strength_reduce(spec) -> bool:
    return spec.family not in _LIGHT_FAMILIES


def _codegen(spec, mod, target, assembly=False):
    emit = jit.emit_assembly if assembly else jit.emit_object
    return emit(mod, target, strength_reduce=_strength_reduce(spec))


def build_object(spec, target: Target, symbol: str, kernels=()) -> list:
    """Object code of spec's function as `symbol` and of each kernel spec's of kernels, a
    sequence of (spec, symbol). Each function is generated and optimised on its own (its
    family's pass list); the optimised modules that share a code generation setting are then
    linked into one module and generated as one object (a loop nest and its BRGEMM kernels:
    one object), which saves code generation's fixed cost per module. Functions call each
    other only through addresses passed at run time, so linking changes no function's code."""
    groups: dict = {}
    for one, name in ((spec, symbol),) + tuple(kernels):
        module_ir = generate_ir(one, target, name)
        mod = _optimize(one, module_ir, target)
        dump_dir = os.environ.get("TPP_DUMP")
        if dump_dir:
            _dump(Path(dump_dir), name, one, str(module_ir), str(mod),
                  _codegen(one, mod, target, assembly=True))
        group = groups.setdefault(_strength_reduce(one), [])
        if group:
            try:
                group[0].link_in(mod)
                continue
            except RuntimeError:   # e.g. two definitions of one name: keep it apart
                pass
        group.append(mod)
    return [jit.emit_object(mod, target, strength_reduce=reduce)
            for reduce, mods in groups.items() for mod in mods]


def _dump(directory: Path, symbol, spec, raw_ir, opt_ir, asm):
    directory.mkdir(parents=True, exist_ok=True)
    header = f"; {spec.key()}\n"
    (directory / f"{symbol}.ll").write_text(header + raw_ir)
    (directory / f"{symbol}.opt.ll").write_text(header + opt_ir)
    (directory / f"{symbol}.s").write_text(header.replace(";", "#", 1) + asm)


def dump(spec, what: str = "asm", target: Target | None = None) -> str:
    """The generated code of spec as text: what = "ir" (as generated), "opt" (optimised IR) or
    "asm" (assembly). Works for any target, including one the host cannot run."""
    target = current() if target is None else target
    symbol = symbol_for(cache_key(spec, target))
    module_ir = generate_ir(spec, target, symbol)
    if what == "ir":
        return str(module_ir)
    mod = _optimize(spec, module_ir, target)
    if what == "opt":
        return str(mod)
    if what == "asm":
        return _codegen(spec, mod, target, assembly=True)
    raise ArgumentError(f"what must be 'ir', 'opt' or 'asm', got {what!r}")
