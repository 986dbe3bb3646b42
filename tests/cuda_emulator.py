"""Run generated CUDA kernels on the CPU (test support: no GPU needed).

    mod = EmulatedModule({kernel_name: cuda_source, ...})
    mod.launch(kernel_name, launch, args)
    available() -> bool

`EmulatedModule` compiles all sources as ONE C++ translation unit with g++ (sources joined as
`tpp_cuda.nvcc` joins them, after `cuda_emulator.h`, which defines `TPP_CUDA_EMULATION` and the
CUDA built-ins), into a shared library cached on disk by content hash ($TPP_CUDA_EMU_CACHE,
else ~/.cache/tpp-cuda-emu). Every `__global__` function found in the sources gets a trampoline
`NAME__emu(args, geometry, mode)` that converts the 64-bit argument words to the kernel's
parameter types (deduced by the compiler from the kernel's own signature) and runs the grid.

`launch(name, launch, args)`: `launch` is a `tpp_cuda.launch.Launch` (grid, block, dynamic
shared bytes, at most 256 KiB); `args` are, in parameter order, numpy arrays (passed as the
address of their first element: the kernel reads and writes them in place, so pass the base of
a strided view) or Python ints (passed as 64-bit values: counts, strides, seeds, raw addresses).

Execution model (see cuda_emulator.h): blocks run one after another; a kernel whose source uses
cooperation (barriers, warp collectives, shared memory, the mma / ldmatrix wrappers) runs each
CUDA thread of a block as an OS thread, any other kernel runs its threads serially (fast).
`threaded=` on the module or on one launch overrides that choice. Dynamic shared memory
(declared `extern __shared__ [__align__(n)] unsigned char NAME[];`, a 256 KiB buffer) is filled
with 0xff bytes (NaN as f32, bf16 and f16) before each block unless poison_smem=False (then
zeros), so reading what no thread wrote shows up. Out-of-bounds accesses are not checked
(they may crash the process, as a misbehaving .so would); an unsupported collective (a partial
warp mask, a barrier in serial mode) aborts the process with a message on stderr. Launches
are serialised: the emulated grid's state (blockDim, shared memory) is global to the process.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from tpp.core.errors import CompileError

HEADER = Path(__file__).with_name("cuda_emulator.h")
FLAGS = ("-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", "-w")

_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_DYNAMIC_SMEM = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?unsigned\s+char\s+(\w+)\s*\[\s*\]\s*;")
_COOPERATION = re.compile(r"__syncthreads|__syncwarp|__shfl\w*_sync|__ballot_sync|__any_sync|"
                          r"__all_sync|__activemask|__shared__|tpp_mma_|tpp_ldmatrix")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_U64 = (1 << 64) - 1
SMEM_BYTES = 256 * 1024              # the emulator's dynamic shared memory (kDynamicSmemBytes)
_LAUNCH_LOCK = threading.Lock()      # the emulator's grid state is global: one launch at a time


def _cuda_include() -> str | None:
    """A directory holding the CUDA headers the emulator compiles against, or None."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        inc = Path(root) / "include"
        if all((inc / h).is_file() for h in ("cuda_bf16.h", "cuda_fp16.h", "vector_functions.h")):
            return str(inc)
    return None


def available() -> bool:
    """Whether g++ and the CUDA headers are here (tests skip otherwise)."""
    return shutil.which("g++") is not None and _cuda_include() is not None


def _cache_dir() -> Path:
    path = Path(os.environ.get("TPP_CUDA_EMU_CACHE") or Path.home() / ".cache" / "tpp-cuda-emu")
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"tpp-cuda-emu-{os.getuid()}"
        fallback.mkdir(exist_ok=True)
        return fallback


def kernels_in(source: str) -> list:
    """The names of the `__global__` functions a source defines, in order."""
    return _KERNEL.findall(_COMMENT.sub(" ", source))


def cooperates(source: str) -> bool:
    """Whether a source uses anything that needs its block's threads to run concurrently."""
    return _COOPERATION.search(_COMMENT.sub(" ", source)) is not None


def _host_source(source: str) -> str:
    """The source with its dynamic shared memory declaration turned into the emulator's buffer
    (an identical #define may repeat, so the declaration may appear in any scope, many times)."""
    return _DYNAMIC_SMEM.sub(lambda m: f"\n#define {m.group(1)} (tpp_emu::dynamic_smem)\n", source)


def _translation_unit(sources: dict, kernels: list) -> str:
    parts = [f'#include "{HEADER.name}"']
    parts += [f"// ---- {name}\n{_host_source(src)}" for name, src in sources.items()]
    parts.append("// ---- emulator entry points")
    for k in kernels:
        parts.append(f'extern "C" int {k}__emu(const unsigned long long* a, '
                     f'const unsigned long long* g, int mode) {{\n'
                     f'  return tpp_emu::launch<&{k}>(a, g, mode);\n}}\n'
                     f'extern "C" int {k}__arity() {{ return tpp_emu::arity(&{k}); }}')
    return "\n".join(parts) + "\n"


def _compile(text: str) -> Path:
    """The shared library of a translation unit, built once per content (a file lock keeps
    concurrent test workers from building the same library twice)."""
    exe = shutil.which("g++")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    flags = [*FLAGS, "-I", _cuda_include(), "-I", str(HEADER.parent)]
    digest = hashlib.sha256("\0".join([version, *flags, HEADER.read_text(), text]).encode())
    cache = _cache_dir()
    lib = cache / f"{digest.hexdigest()[:32]}.so"
    with open(cache / f"{lib.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = lib.with_suffix(f".tmp{os.getpid()}.so")
        proc = subprocess.run([exe, *flags, "-o", str(tmp), str(cpp)], capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            raise CompileError(f"g++ could not build the emulated kernels ({cpp}):\n"
                               f"{proc.stderr[-20000:]}")
        os.replace(tmp, lib)
    return lib


def _word(arg) -> int:
    """One kernel argument as the 64-bit word the trampoline receives."""
    if isinstance(arg, np.ndarray):
        return arg.__array_interface__["data"][0]
    if isinstance(arg, (int, np.integer)) and not isinstance(arg, bool):
        return int(arg) & _U64
    raise TypeError(f"an emulated kernel takes numpy arrays and ints, got {type(arg).__name__}")


class EmulatedModule:
    """Kernels compiled for the CPU emulator; see the module docstring."""

    def __init__(self, sources: dict, *, threaded: bool | None = None):
        found = {k: src for src in sources.values() for k in kernels_in(src)}
        missing = [name for name in sources if name not in found]
        if missing:
            raise ValueError(f"no __global__ function named {missing[0]!r} in its source")
        self._threaded = {k: cooperates(src) if threaded is None else threaded
                          for k, src in found.items()}
        self._lib = ctypes.CDLL(str(_compile(_translation_unit(sources, list(found)))))
        self._entries = {}

    @property
    def kernels(self) -> tuple:
        return tuple(self._threaded)

    def threaded(self, name: str) -> bool:
        """Whether `name` runs one OS thread per CUDA thread by default."""
        return self._threaded[name]

    def _entry(self, name: str):
        if name not in self._entries:
            if name not in self._threaded:
                raise KeyError(f"no kernel {name!r} in this module")
            fn = getattr(self._lib, f"{name}__emu")
            fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)] * 2 + [ctypes.c_int]
            fn.restype = ctypes.c_int
            self._entries[name] = (fn, getattr(self._lib, f"{name}__arity")())
        return self._entries[name]

    def launch(self, name: str, launch, args, *, threaded: bool | None = None,
               poison_smem: bool = True) -> None:
        """Run kernel `name` over the grid of `launch` with `args` (see the module docstring)."""
        fn, arity = self._entry(name)
        if len(args) != arity:
            raise TypeError(f"{name} takes {arity} arguments, got {len(args)}")
        words = (ctypes.c_ulonglong * max(1, arity))(*[_word(a) for a in args])
        geometry = (ctypes.c_ulonglong * 7)(*launch.grid, *launch.block, launch.shared_bytes)
        if launch.shared_bytes > SMEM_BYTES:
            raise ValueError(f"{name}: {launch.shared_bytes} bytes of dynamic shared memory, "
                             f"the emulator has {SMEM_BYTES}")
        threaded = self._threaded[name] if threaded is None else threaded
        with _LAUNCH_LOCK:
            rc = fn(words, geometry, int(threaded) | (2 if poison_smem else 0))
        if rc != 0:
            raise ValueError(f"{name}: the emulator cannot run {launch} (see stderr)")
