"""The runtime: binding arrays to compiled code, choosing the backend, caching.

Array binding and validation (arrays, device_arrays), the callables users hold (Kernel,
BrgemmKernel, EquationKernel, CompiledNest), the backend registry (registry: which backend
owns a Device, compile(spec, device)), and the caches (lru, the disk cache). The runtime
imports the core (tpp.core) and reaches backends only through the registry.
"""
