"""The CUDA backend of TPP (first slice): CUDA C source generation for element-wise specs.

`tpp_cuda.eltwise.source(spec)` writes one `extern "C" __global__` kernel per spec;
`tpp_cuda.nvcc.compile_check` builds sources with nvcc. Nothing here launches kernels yet.
"""
