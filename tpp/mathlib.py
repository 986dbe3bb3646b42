"""The named transcendentals of the expression IR, each defined once.

Every entry states:
  - `exact`: its mathematical meaning as a float64 numpy function (what `tpp.reference` and the
    equations' reference compute; the error bound is measured against it),
  - `bound`: the largest relative error of the f32 code over all finite f32 inputs (away from
    a zero of the function, where the bound is absolute and stated in `note`), the same on
    every backend because every backend renders the same expansion,
  - `expand`: the expansion into the IR's elementary nodes (fma, select, bit operations), which
    the CPU (LLVM) and CUDA backends render node by node; None for a primitive that a backend
    renders natively (none today).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

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


@dataclass(frozen=True)
class Prim:
    name: str
    arity: int
    exact: Callable
    bound: float                 # max relative error of the f32 code (see the module doc)
    note: str = ""
    expand: Callable | None = None   # (args: Nodes) -> Node, filled by tpp.mathlib_expand


PRIMS: dict = {}


def _prim(name, exact, bound, note=""):
    PRIMS[name] = Prim(name, 1, _quiet(exact), bound, note)


_prim("exp", np.exp, 1e-6)
_prim("expm1", np.expm1, 1e-6)
_prim("log", np.log, 1e-6)
_prim("sigmoid", sigmoid_exact, 1e-6)
_prim("tanh", np.tanh, 1e-6)
_prim("erf", erf_exact, 1e-6)
_prim("erfc", erfc_exact, 1e-6)
_prim("gelu", gelu_exact, 1e-6, "relative error away from x = 0's neighbourhood is <= 1e-6")
_prim("gelu_grad", gelu_grad_exact, 1e-6, "relative also next to its zero at x = -0.7518")
_prim("gelu_tanh", gelu_tanh_exact, 1e-6)
_prim("gelu_tanh_grad", gelu_tanh_grad_exact, 1e-6)
