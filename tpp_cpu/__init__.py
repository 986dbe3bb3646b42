"""The CPU backend: LLVM IR generators (llvmlite) for AVX-512 and AVX2, JIT and kernel cache."""
