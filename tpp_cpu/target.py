"""The instruction set the CPU backend generates for.

The host is read from LLVM (`get_host_cpu_name`, `get_host_cpu_features`). AVX-512 (16 f32
lanes) is the primary path; hosts without it get AVX2 (8 lanes) from the same generators.
`TPP_CPU_ISA=avx2` forces the AVX2 variant on any host; `TPP_CPU_ISA=avx512` generates AVX-512
code even where the host cannot run it (for inspecting assembly; calling such a kernel on such a
host is refused with UnsupportedError instead of crashing).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from tpp.errors import UnsupportedError


@dataclass(frozen=True)
class Target:
    isa: str           # "avx512" or "avx2"
    cpu: str           # LLVM cpu name
    features: str      # LLVM feature string
    lanes: int         # f32 lanes per vector register
    bf16_dot: bool     # vdpbf16ps available
    runnable: bool     # the host can execute this code

    def key(self) -> str:
        return f"{self.isa}|{self.cpu}|{self.features}"


def _llvm():
    from . import jit
    return jit.llvm()


@functools.lru_cache(maxsize=None)
def host_features() -> dict:
    return dict(_llvm().get_host_cpu_features())


def host_isa() -> str:
    feats = host_features()
    if feats.get("avx512f") and feats.get("avx512bw") and feats.get("avx512vl"):
        return "avx512"
    if feats.get("avx2") and feats.get("fma"):
        return "avx2"
    raise UnsupportedError("the CPU backend needs AVX2 with FMA or AVX-512; this host has neither")


@functools.lru_cache(maxsize=None)
def make_target(isa: str) -> Target:
    """The Target for an ISA: the host's own CPU when it has that ISA, else a generic one."""
    llvm = _llvm()
    if isa not in ("avx512", "avx2"):
        raise UnsupportedError(f"TPP_CPU_ISA must be 'avx512', 'avx2' or 'auto', got {isa!r}")
    native = host_isa()
    runnable = isa == native or (isa == "avx2" and native == "avx512")
    feats = host_features()
    if isa == native:
        cpu = llvm.get_host_cpu_name()
        features = llvm.get_host_cpu_features().flatten()
    elif isa == "avx2":
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten() + ",-avx512f"
        feats = {"avx2": True}
    else:  # AVX-512 code for a host that cannot run it: Zen 4, the design's reference machine
        cpu, features = "znver4", ""
        feats = {"avx512f": True, "avx512bf16": True}
    lanes = 16 if isa == "avx512" else 8
    return Target(isa, cpu, features, lanes, bool(feats.get("avx512bf16")), runnable)


def current() -> Target:
    """The target selected by TPP_CPU_ISA (default: the best the host runs)."""
    isa = os.environ.get("TPP_CPU_ISA", "auto").strip().lower() or "auto"
    return make_target(host_isa() if isa == "auto" else isa)
