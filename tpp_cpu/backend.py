"""The CPU backend's runtime: spec -> generated IR -> machine code (disk-cached) -> address.

`compile(spec)` returns a CompiledKernel whose `address` is a C function
`void f(intptr_t operand0, ..., [int64 seed])` taking one pointer per operand of
`spec.operands()`, in order. `TPP_DUMP=dir` writes each generated kernel's IR (before and after
optimisation) and assembly to that directory when it is compiled.

A kernel is compiled to a relocatable object, linked into a shared library when the system
linker exists (`sharedlib`), stored in the disk cache and loaded with dlopen; a hit in a new
process needs neither LLVM nor the linker. Without a linker, or without a disk cache,
the object is loaded into LLVM's MCJIT engine instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from tpp import cache
from tpp.errors import ArgumentError, UnsupportedError

import importlib

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
        for path in sorted(root.glob("*.py")):
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
    target = current() if target is None else target
    if not target.runnable:
        raise UnsupportedError(f"this host cannot run {target.isa} code (TPP_CPU_ISA="
                               f"{os.environ.get('TPP_CPU_ISA')}); Kernel.dump() shows its code")
    key = cache_key(spec, target)
    symbol = symbol_for(key)
    disk = _disk()
    address = _load_cached(disk, key, symbol, target)
    if address is not None:
        COUNTS["loaded"] += 1
    else:
        obj = build_object(spec, target, symbol)
        COUNTS["built"] += 1
        library = sharedlib.link(obj) if disk.directory is not None else None
        disk.store(key, library if library is not None else obj)
        if library is not None:
            try:
                address = sharedlib.load(library, symbol)
            except OSError:
                address = None
        if address is None:
            address = jit.load(obj, symbol, target)
    return CompiledKernel(spec, target, symbol, address, len(spec.scalars))


def _load_cached(disk, key, symbol, target):
    """The address of a verified cache entry's kernel, or None (rebuild)."""
    payload = disk.load(key)
    if payload is None:
        return None
    if sharedlib.is_shared(payload):
        try:
            return sharedlib.load(payload, symbol)
        except OSError:
            return None
    if sharedlib.is_object(payload):
        return jit.load(payload, symbol, target)
    return None


def _optimize(spec, module_ir, target):
    """LLVM's optimiser; BRGEMM code is emitted vectorised and unrolled already, and a loop
    nest is only calls, so there LLVM's vectorizers and unroller would only cost compile time."""
    return jit.optimize(module_ir, target, vectorize=spec.family not in ("brgemm", "loopnest"))


def build_object(spec, target: Target, symbol: str) -> bytes:
    module_ir = generate_ir(spec, target, symbol)
    mod = _optimize(spec, module_ir, target)
    dump_dir = os.environ.get("TPP_DUMP")
    if dump_dir:
        _dump(Path(dump_dir), symbol, spec, str(module_ir), str(mod), jit.emit_assembly(mod, target))
    return jit.emit_object(mod, target)


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
        return jit.emit_assembly(mod, target)
    raise ArgumentError(f"what must be 'ir', 'opt' or 'asm', got {what!r}")
