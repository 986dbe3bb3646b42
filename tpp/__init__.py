"""TPP for Python: tensor processing primitives, JIT-compiled for the CPU.

    import numpy as np, tpp
    gelu = tpp.unary("gelu", 64, 100)          # a spec, compiled on first call
    y = gelu(np.random.rand(64, 100).astype(np.float32))
    add = tpp.binary("add", 64, 100, bcast_in1="row")
    tpp.reference.run(gelu.spec, x)            # the numpy semantics of any spec
"""
from __future__ import annotations

import functools

from .core import reference
from .core.dtypes import BF16, F16, F32
from .core.errors import ArgumentError, CompileError, SpecError, TPPError, UnsupportedError
from .runtime.brgemm_kernel import BrgemmKernel
from .core.brgemm_spec import BrgemmSpec, make_brgemm
from .runtime.kernel import Kernel
from .runtime.equations import Equation, EquationKernel, EquationSpec
from .core.autodiff import grad
from .core.loop_spec import Loop
from .runtime.loops import LoopNest, size
from .core.optable import BINARY_OPS, UNARY_OPS
from .core.spec import BinarySpec, UnarySpec, make_binary, make_unary
from .runtime import registry
from .runtime.device import CPU, Device

__version__ = "0.1.0"

__all__ = ["unary", "binary", "brgemm", "kernel", "reference", "Kernel", "BrgemmKernel",
           "UnarySpec", "BinarySpec", "BrgemmSpec", "make_brgemm", "TPPError", "SpecError",
           "ArgumentError", "UnsupportedError", "CompileError",
           "UNARY_OPS", "BINARY_OPS", "F32", "BF16", "F16", "Loop", "LoopNest", "size",
           "equation", "Equation", "EquationKernel", "EquationSpec", "grad",
           "get_num_threads", "set_num_threads", "clear_caches", "cache_info", "Device",
           "registry", "has_dot_instruction", "has_matrix_unit"]


def get_num_threads() -> int:
    """Threads a parallel loop nest uses: set_num_threads(n), else TPP_NUM_THREADS, else
    OMP_NUM_THREADS, else every core this process may use."""
    return registry.for_device(CPU).num_threads()


def set_num_threads(n):
    """Use n threads in parallel loop nests (None: back to the environment variables)."""
    registry.for_device(CPU).set_num_threads(n)


def has_dot_instruction(dtype, device=CPU) -> bool:
    """Whether the code for `device` multiplies `dtype` pairs with a dot instruction of its
    own (bf16 on AVX-512 hosts with avx512_bf16): then a VNNI-packed B operand
    (brgemm(vnni_b=True)) runs at the dtype's own rate; elsewhere narrow inputs are widened
    to f32, and packing them into pairs only costs. An operator may choose its layouts by it.
    device: a Device, "kind[:index]" or a torch.device (default: this host's CPU, with the
    code TPP_CPU_ISA selects). An unknown dtype is a SpecError, a bad device an
    ArgumentError."""
    from .core import dtypes
    return dtypes.lookup(dtype).name in registry.for_device(Device.parse(device)).dot_dtypes()


def has_matrix_unit(dtype, device=CPU) -> bool:
    """Whether BRGEMMs of `dtype` with a row-major A and a VNNI-packed B run on a matrix unit
    of `device` (bf16 on hosts with AMX tiles). There a transposed A (trans_a) is turned into
    tile rows inside the kernel at every k step of every column block: an operator that
    reuses a transposed A across many products may transpose it once with the transpose TPP
    instead. Arguments as has_dot_instruction's."""
    from .core import dtypes
    return dtypes.lookup(dtype).name in registry.for_device(Device.parse(device)).matrix_dtypes()


@functools.lru_cache(maxsize=4096)
def kernel(spec) -> Kernel:
    """The Kernel of a spec; one per spec per process."""
    if spec.family == "equation":
        return EquationKernel(spec)
    return BrgemmKernel(spec) if spec.family == "brgemm" else Kernel(spec)


def equation(m, n) -> Equation:
    """A new equation over an (m, n) block; see the tpp.runtime.equations module docstring."""
    return Equation(m, n)


def unary(op, m, n, *, ldi=None, ldo=None, dtype_in="f32", dtype_out=None, dtype_comp="f32",
          bcast=None, **params) -> Kernel:
    """A unary primitive on an (m, n) block; see tpp.UNARY_OPS for ops and their parameters."""
    return kernel(make_unary(op, m, n, ldi=ldi, ldo=ldo, dtype_in=dtype_in, dtype_out=dtype_out,
                             dtype_comp=dtype_comp, bcast=bcast, **params))


def binary(op, m, n, *, ldi0=None, ldi1=None, ldo=None, dtype_in0="f32", dtype_in1=None,
           dtype_out=None, dtype_comp="f32", bcast_in0=None, bcast_in1=None, **unknown) -> Kernel:
    """A binary primitive on (m, n) blocks; see tpp.BINARY_OPS for ops. An unknown keyword is
    a SpecError."""
    return kernel(make_binary(op, m, n, ldi0=ldi0, ldi1=ldi1, ldo=ldo, dtype_in0=dtype_in0,
                              dtype_in1=dtype_in1, dtype_out=dtype_out, dtype_comp=dtype_comp,
                              bcast_in0=bcast_in0, bcast_in1=bcast_in1, **unknown))


def brgemm(m, n, k, *, lda=None, ldb=None, ldc=None, dtype_a="f32", dtype_b=None, dtype_c=None,
           dtype_comp="f32", beta=0, trans_a=False, trans_b=False, vnni_b=False, batch="stride",
           bias=None, activation=None, bitmask=False, **unknown) -> BrgemmKernel:
    """Batch-reduce GEMM: C = act(beta*C + sum_i A_i @ B_i + bias); see tpp.core.brgemm_spec. An
    unknown keyword is a SpecError."""
    return kernel(make_brgemm(m, n, k, lda=lda, ldb=ldb, ldc=ldc, dtype_a=dtype_a,
                              dtype_b=dtype_b, dtype_c=dtype_c, dtype_comp=dtype_comp, beta=beta,
                              trans_a=trans_a, trans_b=trans_b, vnni_b=vnni_b, batch=batch,
                              bias=bias, activation=activation, bitmask=bitmask, **unknown))


def clear_caches() -> None:
    """Empty every process-wide cache: the Kernel of each spec (tpp.kernel), the compiled
    row-stride variants of every kernel, compiled loop nests, ops.matmul's plans and nests,
    tpp_cuda's compiled functions, and whatever else registered with tpp.runtime.lru. Kernels and nests
    already in hand keep working (compiled code stays loaded for the life of the process);
    anything asked for again is rebuilt, from the disk cache when it has it. The disk cache
    itself and the counters of cache_info() are left alone."""
    from .runtime import lru
    kernel.cache_clear()
    lru.clear_all()


def cache_info() -> dict:
    """What this process holds and has done, as counts: "kernels" (specs with a Kernel in
    tpp.kernel's cache), "variants" (row-stride variants held by live kernels), "loop_nests",
    "matmul_plans", "cuda_functions" (entries of those caches), "compiled" (kernels generated
    and compiled by LLVM so far) and "disk_hits" (kernels loaded from the disk cache so far).
    The last two only grow."""
    from .runtime import lru
    info = dict.fromkeys(("variants", "loop_nests", "matmul_plans", "cuda_functions"), 0)
    info.update(lru.sizes())
    info.update(kernels=kernel.cache_info().currsize, **registry.for_device(CPU).counts())
    return info
