"""Which CUDA generator module builds a spec, and the generator contract through it.

Every generator module (eltwise, transform, brgemm, equation) offers `kernel_name(spec)`, `source(spec)`,
`launch(spec) -> Launch`, `supported(spec)` and `block_function(spec, threads)` (the spec's
block-cooperative device function, tpp_cuda.cooperative); `module_for(spec)` picks the one for a
spec and the functions below delegate to it, so callers (the runtime, the tests) need not know
which. Loop nests (family "loopnest") go to tpp_cuda.loopnest, whose `launch(spec, sizes)`
takes the call's sizes: `launch(spec)` below gives a nest's geometry only when it has none.
"""
from __future__ import annotations

import importlib
import importlib.util

from tpp.core.errors import UnsupportedError

from . import eltwise, transform


def _brgemm():
    """tpp_cuda.brgemm, imported on first use (None while it does not exist)."""
    if importlib.util.find_spec(f"{__package__}.brgemm") is None:
        return None
    return importlib.import_module(f"{__package__}.brgemm")


def module_for(spec):
    """The generator module that builds `spec`; UnsupportedError when none does."""
    if spec.family == "equation":
        from . import equation
        return equation
    if spec.family == "loopnest":
        from . import loopnest
        return loopnest
    if spec.family == "brgemm":
        module = _brgemm()
        if module is None:
            raise UnsupportedError("brgemm specs are not yet in the CUDA backend")
        return module
    for module in (eltwise, transform):
        if module.supported(spec):
            return module
    raise UnsupportedError(f"{spec.family} op {getattr(spec, 'op', '?')!r} is not yet in the "
                           f"CUDA backend")


def supported(spec) -> bool:
    try:
        module = module_for(spec)
    except UnsupportedError:
        return False
    return module.supported(spec)


def kernel_name(spec) -> str:
    return module_for(spec).kernel_name(spec)


def source(spec) -> str:
    return module_for(spec).source(spec)


def launch(spec):
    return module_for(spec).launch(spec)
