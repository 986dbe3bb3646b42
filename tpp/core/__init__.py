"""The virtual ISA: what a TPP means, independent of any machine.

Errors, dtypes, the op table (each element-wise op defined once in the expression IR,
tpp.core.expr), the frozen specs of primitives, BRGEMMs, equations and loop nests, and the
numpy reference semantics of all of them. Nothing here imports the runtime (tpp.runtime) or a
backend (tpp_cpu, tpp_cuda): a backend reads these specs and nothing else.
"""
