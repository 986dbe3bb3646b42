"""The instruction set the CPU backend generates for.

AVX-512 (16 f32 lanes) is the primary path; hosts without it get AVX2 (8 lanes) from the same
generators. `TPP_CPU_ISA=avx2` forces the AVX2 variant on any host; `TPP_CPU_ISA=avx512`
generates AVX-512 code even where the host cannot run it (for inspecting assembly; calling such
a kernel there is refused with UnsupportedError instead of crashing).

Choosing a target needs no LLVM: the host's ISA and identity come from /proc/cpuinfo, so a
process that only loads cached kernels never imports llvmlite. LLVM's own view of the host (CPU
name and feature string) is read when code is generated (`llvm_cpu_and_features`).
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

from tpp.core.errors import UnsupportedError


@dataclass(frozen=True)
class Target:
    """What the generators may use, as capabilities: they branch on these fields, never on the
    ISA's name, so another vector ISA (NEON, SVE) is a new record and new generators, and a new
    unit (AMX) a new field and the generators that use it."""
    isa: str             # "avx512" or "avx2" (LLVM target selection, names, messages)
    lanes: int           # f32 lanes per vector register
    runnable: bool       # the host can execute this code
    host: str            # fingerprint of the CPU the code is tuned for (part of cache keys)
    cpu: str = "host"    # LLVM cpu name; "host": the host's, as LLVM detects it
    features: str = ""   # LLVM features, appended to the host's when cpu == "host"
    bf16_dot: bool = False   # a bf16 pair dot product into f32 (vdpbf16ps)
    vector_registers: int = 16   # architectural vector registers (register blocking)
    masked_lanes: bool = False   # per-lane predication of loads/stores at any element width
    amx: bool = False            # AMX tiles with bf16 dot products (tpp_cpu.amx, brgemm_amx)
    streaming_stores: bool = True    # non-temporal vector stores
    eager_prefetch: bool = False     # software prefetch of the next rows pays in light passes

    def key(self) -> str:
        return (f"{self.isa}|lanes={self.lanes}|cpu={self.cpu}|{self.features}|host={self.host}"
                + ("|amx" if self.amx else "") + ("|eager_prefetch" if self.eager_prefetch else ""))


@functools.lru_cache(maxsize=None)
def host_cpu() -> tuple:
    """(model name, frozenset of ISA flags) of the host, flags spelled without underscores
    ("avx512bf16"), from /proc/cpuinfo, or from LLVM where that file does not exist."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read(1 << 16)
    except OSError:
        from . import jit
        llvm = jit.llvm()
        flags = {k for k, v in llvm.get_host_cpu_features().items() if v}
        return llvm.get_host_cpu_name(), frozenset(flags)
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags":
            flags = {f.replace("_", "") for f in value.split()}
            break
    return model, frozenset(flags)


def host_features() -> dict:
    """LLVM's view of the host's features (imports LLVM)."""
    from . import jit
    return dict(jit.llvm().get_host_cpu_features())


def host_isa() -> str:
    flags = host_cpu()[1]
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    raise UnsupportedError("the CPU backend needs AVX2 with FMA or AVX-512; this host has neither")


@functools.lru_cache(maxsize=None)
def _fingerprint() -> str:
    model, flags = host_cpu()
    return hashlib.sha256((model + "|" + " ".join(sorted(flags))).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def make_target(isa: str) -> Target:
    """The Target for an ISA: the host's own CPU when it can run that ISA, else a generic one."""
    if isa not in ("avx512", "avx2"):
        raise UnsupportedError(f"TPP_CPU_ISA must be 'avx512', 'avx2' or 'auto', got {isa!r}")
    native = host_isa()
    flags = host_cpu()[1]
    if isa == native:
        if isa == "avx512":
            return Target(isa, 16, True, _fingerprint(), bf16_dot="avx512bf16" in flags,
                          **_AVX512, amx=_amx_usable(flags), eager_prefetch=_eager_prefetch())
        return Target(isa, 8, True, _fingerprint(), **_AVX2, eager_prefetch=_eager_prefetch())
    if isa == "avx2":   # an AVX-512 host generating AVX2 code
        return Target("avx2", 8, True, _fingerprint(), features="-avx512f", **_AVX2,
                      eager_prefetch=_eager_prefetch())
    # AVX-512 code for a host that cannot run it: Zen 4, the design's reference machine
    return Target("avx512", 16, False, "none", cpu="znver4", bf16_dot=True, **_AVX512)


@functools.lru_cache(maxsize=None)
def host_vendor() -> str:
    """The CPU's vendor string from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or ""
    where that file does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read(1 << 16)
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def _eager_prefetch() -> bool:
    """Whether the equations' rowwise passes prefetch the rows ahead even when they compute
    little (tpp_cpu.equation, Prefetch): on Intel's cores, as measured on a Sapphire Rapids
    (4096 x 1024 f32, one thread: LayerNorm forward 1.70 -> 1.39 ms, RMSNorm forward 1.47 ->
    1.36, softmax backward 2.35 -> 1.96); AMD's Zen cores lost 5-10 % with it."""
    return host_vendor() == "GenuineIntel"


def _amx_usable(flags) -> bool:
    """AMX where the CPU has tiles with bf16, TPP_CPU_AMX does not turn them off and Linux
    enabled the tile data state for this process (read once per process, as the ISA is)."""
    off = os.environ.get("TPP_CPU_AMX", "").strip().lower() in ("0", "off", "no", "false")
    return {"amxtile", "amxbf16"} <= flags and not off and _tiles_permitted()


_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158   # x86-64 Linux


@functools.lru_cache(maxsize=None)
def _tiles_permitted() -> bool:
    """Ask Linux (once per process) to enable the tile data state (tpp_cpu.amx); True when
    it did. Without it a tile instruction kills the process."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(_XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):   # no libc syscall (not Linux): no tiles
        return False


_AVX512 = {"vector_registers": 32, "masked_lanes": True}
_AVX2 = {"vector_registers": 16, "masked_lanes": False}


def current() -> Target:
    """The target selected by TPP_CPU_ISA (default: the best the host runs)."""
    isa = os.environ.get("TPP_CPU_ISA", "auto").strip().lower() or "auto"
    return make_target(host_isa() if isa == "auto" else isa)


_AMX_FEATURES = "+amx-tile,+amx-bf16"


def llvm_cpu_and_features(target: Target) -> tuple:
    """The (cpu, features) strings to give LLVM's target machine for this target; a target
    with amx gets the tile features whatever its CPU (code for inspection included)."""
    extra = ",".join(f for f in (target.features, _AMX_FEATURES if target.amx else "") if f)
    if target.cpu != "host":
        return target.cpu, extra
    from . import jit
    llvm = jit.llvm()
    features = llvm.get_host_cpu_features().flatten()
    if extra:
        features = f"{features},{extra}"
    return llvm.get_host_cpu_name(), features
