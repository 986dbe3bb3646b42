"""The named transcendentals of the expression IR, each defined once.

Every entry states:
  - `exact`: its mathematical meaning as a float64 numpy function (what `tpp.core.reference` and the
    equations' reference compute; the error bound is measured against it),
  - `bound`: the largest relative error of the f32 code over all finite f32 inputs whose
    result is a normal f32 (BOUNDS below; every one is <= 1e-6), the same on every backend
    because every backend renders the same expansion,
  - `expand`: the expansion into the IR's elementary nodes (fma, select, bit operations), which
    the CPU (LLVM) and CUDA backends render node by node (`tpp.core.transcendentals`, which states
    each method).

The bounds were measured on the f32 code against `exact` (see BOUNDS); tests/test_vecmath.py
and tests/test_opdefs.py check them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import transcendentals as _T

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erfc_scalar = np.frompyfunc(math.erfc, 1, 1)
_erf_scalar = np.frompyfunc(math.erf, 1, 1)


def _quiet(fn):
    def wrapped(*args):
        with np.errstate(all="ignore"):
            return fn(*(np.asarray(a, np.float64) for a in args))
    return wrapped


def erfc_exact(x):
    return _erfc_scalar(np.asarray(x, np.float64)).astype(np.float64)


def erf_exact(x):
    return _erf_scalar(np.asarray(x, np.float64)).astype(np.float64)


def sigmoid_exact(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _phi_cdf(x):
    return 0.5 * erfc_exact(-x * _SQRT_HALF)


def gelu_exact(x):
    return np.where(x == -np.inf, -0.0, x * _phi_cdf(x))


def gelu_grad_exact(x):
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return _phi_cdf(x) + np.where(np.isinf(x), 0.0, x * pdf)


def gelu_tanh_exact(x):
    # 0.5*x*(1 + tanh(u)) = x*sigmoid(2u), free of cancellation for negative x
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    return np.where(x == -np.inf, -0.0, x * sigmoid_exact(2.0 * u))


def gelu_tanh_grad_exact(x):
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    s = sigmoid_exact(2.0 * u)
    e = np.exp(-2.0 * np.abs(u))
    ds = e / (1.0 + e) ** 2          # s*(1-s) without cancellation
    return s + np.where(np.isinf(x), 0.0, 2.0 * x * ds * du)


# The measured max relative error of each expansion where the true result is a normal f32
# (where it is subnormal, the absolute error is <= 4 * 2^-149, except that exp_nonpos, sigmoid,
# the gelus and their gradients give a zero below their `flush_below`: tpp.core.transcendentals), rounded
# up: the larger of
# tools/measure_transcendentals.py (4e6 random bit patterns and grid points; log: every
# positive f32; exp_nonpos: every f32 in [-104, 44]) and tests/test_vecmath.py's sweeps
# (gelu / gelu_grad: every f32 with |x| < 15.5), over each prim's `domain` (exp_nonpos:
# x <= 44). Measured: exp 2.4e-7, exp_nonpos 3.9e-7,
# expm1 3.8e-7, log 8.0e-8, sigmoid 2.3e-7, tanh 2.4e-7, erf 3.0e-7, erfc 4.8e-7, gelu 5.2e-7,
# gelu_grad 5.3e-7, gelu_tanh 2.4e-7, gelu_tanh_grad 4.4e-7.
BOUNDS = {
    "exp": 2.5e-7, "exp_nonpos": 4e-7, "expm1": 4e-7, "log": 1e-7, "sigmoid": 2.5e-7,
    "tanh": 2.5e-7, "erf": 3.2e-7, "erfc": 5e-7, "gelu": 5.5e-7, "gelu_grad": 5.5e-7,
    "gelu_tanh": 2.5e-7, "gelu_tanh_grad": 4.6e-7,
}


@dataclass(frozen=True)
class Prim:
    name: str
    arity: int
    exact: Callable
    bound: float                 # max relative error of the f32 code (see the module doc)
    note: str = ""
    expand: Callable | None = None   # (args: Nodes) -> Node (tpp.core.transcendentals)
    domain: tuple = (-math.inf, math.inf)   # the inputs the expansion is defined (bound) on
    # x below this (where |exact| < 2^-126) gives a zero of the exact result's sign instead
    # of a subnormal (None: never)
    flush_below: float | None = None


PRIMS: dict = {}


def _prim(name, exact, bound, note="", domain=(-math.inf, math.inf), flush_below=None):
    PRIMS[name] = Prim(name, 1, _quiet(exact), bound, note, getattr(_T, name), domain,
                       flush_below)


_prim("exp", np.exp, BOUNDS["exp"])
_prim("exp_nonpos", np.exp, BOUNDS["exp_nonpos"],
      "e^x for x <= 0 (softmax, attention); accurate up to x = 44, unspecified above; "
      "0 below -87.3365 (subnormal there)",
      domain=(-math.inf, _T.EXP_NONPOS_MAX), flush_below=_T.EXP_NONPOS_DEAD)
_prim("expm1", np.expm1, BOUNDS["expm1"])
_prim("log", np.log, BOUNDS["log"])
_prim("sigmoid", sigmoid_exact, BOUNDS["sigmoid"], "0 below -87.3365 (subnormal there)",
      flush_below=_T.EXP_NONPOS_DEAD)
_prim("tanh", np.tanh, BOUNDS["tanh"])
_prim("erf", erf_exact, BOUNDS["erf"])
_prim("erfc", erfc_exact, BOUNDS["erfc"])
_prim("gelu", gelu_exact, BOUNDS["gelu"], "relative also next to x = 0 (gelu(x) ~ x/2); "
      "-0.0 below -13.1462 (subnormal there)", flush_below=_T.GELU_DEAD)
_prim("gelu_grad", gelu_grad_exact, BOUNDS["gelu_grad"],
      "relative also next to its zero at x = -0.7518; -0.0 below -13.3419 (subnormal there)",
      flush_below=_T.GELU_GRAD_DEAD)
_prim("gelu_tanh", gelu_tanh_exact, BOUNDS["gelu_tanh"],
      "-0.0 below -10.1006 (subnormal there)", flush_below=_T.GELU_TANH_DEAD)
_prim("gelu_tanh_grad", gelu_tanh_grad_exact, BOUNDS["gelu_tanh_grad"],
      "relative also next to its zero at x = -0.7525; -0.0 below -10.235 (subnormal there)",
      flush_below=_T.GELU_TANH_GRAD_DEAD)
