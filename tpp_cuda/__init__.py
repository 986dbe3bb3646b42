"""The CUDA backend of TPP: CUDA C generated from the same `tpp/core` specs, run through cupy.

Generators (each offers kernel_name / source / launch / supported for the specs it builds):
  eltwise     unary map / map_inv (incl. dropout), binary map / compare
  transform   reductions, transpose, vnni2 / vnni2_inv, gather / scatter rows
  brgemm      batch-reduce GEMM: tensor cores (mma.sync) for bf16/f16, SIMT FFMA for f32
  equation    equations, a warp per row
  loopnest    a loop nest as one kernel: the parallel band is the grid, each call a device
              function the block runs together (cooperative: the bodies both forms share)
`generators` picks the one for a spec; `runtime` compiles with NVRTC (cupy.RawModule), caches
and launches on the current stream; `nvcc` compile-checks and disassembles without a GPU.
`plugin` registers the backend with tpp.runtime.registry: the runtime routes a call here when
its data live on a CUDA device.
"""
