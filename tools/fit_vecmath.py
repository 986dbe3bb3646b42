#!/usr/bin/env python3
"""Derive every polynomial coefficient and root constant used by tpp_cpu/vecmath.py.

Run:  python tools/fit_vecmath.py            (numpy only, ~10 s)

Method
------
Each approximation is a weighted minimax fit (discrete Remez exchange on a
20001-point Chebyshev-distributed grid, float64) with *relative* weighting, i.e.
we minimise max |p(x) - f(x)| / |f(x)| (or the relative error of the final
quantity the polynomial feeds).  The coefficients are then rounded to float32
one at a time, lowest order first; after each rounding the remaining free
coefficients are re-fitted (Remez again) with the rounded ones held fixed.  The
script prints

  * the float64 minimax error,
  * the error with the float32 coefficients evaluated exactly (float64),
  * the error of a float32 Horner/FMA evaluation simulated in numpy,

and finally the Python source of the coefficient tables, which is what
vecmath.py hard-codes.  Reference values come from the float64 math library
(math.erfc/math.erf/np.expm1) and np.longdouble where cancellation would
otherwise spoil the reference (the gelu_tanh_grad root patch).

Fitted objects (names as in vecmath.py)
---------------------------------------
EXP_C      expm1(s) ~ s + s^2 (c2 + c3 s + ... + c6 s^4),  |s| <= ln2/2 (+0.2 %),
           relative error of expm1 (which bounds the relative error of exp).
ERFC_Q     erfc(z) ~ t * exp(-z^2) * Q(t),  t = 1/(1 + P*z),  P = 0.375,
           0 <= z <= 10.4;  Q of degree 8, relative error of erfc.
GELU_K     for x = -a <= 0:  Phi(x) + x*phi(x) = exp(-a^2/2) * (A0 - a) * K(t),
           t = 1/(1 + (P/sqrt2)*a),  0 <= a <= 14.7 ;  A0 the root (a0 = -x0 of gelu').
           Factoring the root out makes the result relatively accurate near it.
ERF_S      erf(x) ~ x * S(x^2),  |x| <= 0.6, degree 4 in x^2.
TGRAD_H    gelu_tanh_grad(x) ~ (x - X0) * H(x - X0) for |x - X0| <= 0.06, X0 the
           root of gelu_tanh_grad; degree 4.
"""
import math

import numpy as np

F32 = np.float32
erfc_v = np.frompyfunc(math.erfc, 1, 1)
erf_v = np.frompyfunc(math.erf, 1, 1)


def f32(x):
    return float(F32(x))


# --------------------------------------------------------------------------
# discrete Remez exchange for  min max |w(x) * (sum_k c_k x^k - f(x))|
# --------------------------------------------------------------------------
def remez(f, w, lo, hi, powers, grid=20001, iters=80):
    pw = list(powers)
    m = len(pw)
    xs = (lo + hi) / 2 - (hi - lo) / 2 * np.cos(np.pi * np.arange(grid) / (grid - 1))
    fx, wx = f(xs), w(xs)
    B = np.stack([xs ** k for k in pw], 1)
    nodes = (lo + hi) / 2 - (hi - lo) / 2 * np.cos(np.pi * np.arange(m + 1) / m)
    idx = np.unique(np.searchsorted(xs, nodes).clip(0, grid - 1))
    best = None
    for _ in range(iters):
        if len(idx) != m + 1:
            break
        A = np.zeros((m + 1, m + 1))
        A[:, :m] = B[idx]
        A[:, m] = (-1.0) ** np.arange(m + 1) / wx[idx]
        c = np.linalg.solve(A, fx[idx])[:m]
        err = wx * (B @ c - fx)
        M = np.abs(err).max()
        if best is None or M < best[0]:
            best = (M, c)
        s = np.sign(err)
        s[s == 0] = 1
        segs = np.split(np.arange(grid), np.flatnonzero(np.diff(s)) + 1)
        ext = np.array([seg[np.argmax(np.abs(err[seg]))] for seg in segs])
        while len(ext) > m + 1:  # drop the smaller end extremum
            ext = ext[1:] if abs(err[ext[0]]) < abs(err[ext[-1]]) else ext[:-1]
        if len(ext) < m + 1:
            break
        done = np.abs(err[ext]).min() > (1 - 1e-9) * M
        idx = ext
        if done:
            break
    return best


def fit_f32(f, w, lo, hi, powers, fixed=None):
    """Remez fit, then round coefficients to float32 lowest order first,
    re-fitting the remaining ones each time.  Returns (minimax_err, {power: f32})."""
    fixed = dict(fixed or {})
    free = [k for k in powers if k not in fixed]

    def resid(x):
        return f(x) - sum(c * x ** k for k, c in fixed.items())

    err0, _ = remez(resid, w, lo, hi, free)
    while free:
        _, c = remez(resid, w, lo, hi, free)
        fixed[free[0]] = f32(c[0])
        free = free[1:]
    return err0, dict(sorted(fixed.items()))


def fma32(a, b, c):
    # a*b is exact in float64 for float32 a, b; one (double) rounding of the sum.
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def horner32(x, coeffs):
    """float32 FMA Horner, coeffs lowest order first."""
    x = x.astype(F32)
    acc = np.full_like(x, F32(coeffs[-1]))
    for c in coeffs[-2::-1]:
        acc = fma32(acc, x, np.full_like(x, F32(c)))
    return acc


def as_list(d):
    n = max(d)
    return [d.get(k, 0.0) for k in range(n + 1)]


_VERBOSE = True


def report(name, err0, coeffs, f, w, lo, hi, sim=None):
    if not _VERBOSE:
        return
    xs = np.linspace(lo, hi, 400001)
    c = as_list(coeffs)
    e1 = np.abs(w(xs) * (np.polynomial.polynomial.polyval(xs, c) - f(xs))).max()
    print(f"{name}: minimax {err0:.3e}   f32 coeffs {e1:.3e}", end="")
    if sim is not None:
        print(f"   f32 evaluation {sim:.3e}", end="")
    print()


# --------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------
P_ERFC = 0.375          # t = 1/(1 + P z); exactly representable
ERF_THR = 0.6           # erf: x S(x^2) below, 1 - erfc above
TGRAD_DELTA = 0.06      # half-width of the gelu_tanh_grad root patch
ZMAX = 10.4             # erfc clamp 10.3, gelu/gelu_grad clamp 14.6/sqrt2 = 10.32
SQRT2 = math.sqrt(2.0)
INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def erfcx(z):
    return np.array(erfc_v(z), dtype=np.float64) * np.exp(z * z)


def mills(a):
    """R(a) = Phi(-a)/phi(a)."""
    return math.sqrt(math.pi / 2) * erfcx(a / SQRT2)


def gelu_grad_root():
    a = 0.75
    for _ in range(60):
        r = mills(np.array([a]))[0]
        g = r - a
        gp = (a * r - 1.0) - 1.0   # R'(a) = a R(a) - 1
        a -= g / gp
    return a


def tanh_grad_ld(x):
    """gelu_tanh_grad in long double."""
    x = np.asarray(x, dtype=np.longdouble)
    k0 = np.sqrt(np.longdouble(2) / np.longdouble(np.pi))
    k1 = np.longdouble("0.044715")
    u = k0 * (x + k1 * x ** 3)
    th = np.tanh(u)
    du = k0 * (1 + 3 * k1 * x * x)
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * du


def tanh_grad_root():
    x = np.longdouble(-0.75)
    h = np.longdouble(1e-7)
    for _ in range(60):
        f = tanh_grad_ld(x)
        fp = (tanh_grad_ld(x + h) - tanh_grad_ld(x - h)) / (2 * h)
        x = x - f / fp
    return x


def split(x):
    """float64 x -> (hi, lo) float32 pair with hi + lo = x to ~2^-48 relative."""
    hi = f32(x)
    return hi, f32(x - hi)


def fit_all(verbose=True):
    """Run every fit; returns [(table name, tuple of float32 values)]."""
    global _VERBOSE
    _VERBOSE = verbose
    out = []

    # ---------------- exp ----------------
    L = math.log(2) / 2 * 1.002
    f = lambda s: np.expm1(s)
    w = lambda s: 1.0 / np.abs(np.where(s == 0, 1e-300, np.expm1(s)))
    err0, co = fit_f32(f, w, -L, L, range(0, 7), fixed={0: 0.0, 1: 1.0})
    s = np.linspace(-L, L, 200001).astype(F32)
    inner = horner32(s, as_list(co)[2:])           # c2 + c3 s + ...
    inner = fma32(inner, s, np.full_like(s, F32(1)))   # 1 + s*(...)
    e = fma32(inner, s, np.full_like(s, F32(1)))       # exp(s) = 1 + s*(...)
    sim = np.abs(e.astype(np.float64) / np.exp(s.astype(np.float64)) - 1).max()
    report("EXP_C   (expm1 rel, deg 6)", err0, co, f, w, -L, L, sim)
    out.append(("EXP_C", [co[k] for k in range(2, 7)]))

    # ---------------- erfc Q(t) ----------------
    P = P_ERFC
    tlo = 1.0 / (1.0 + P * ZMAX)
    Qf = lambda t: erfcx((1 - t) / (P * t)) / t
    err0, co = fit_f32(Qf, lambda t: 1.0 / Qf(t), tlo, 1.0, range(0, 9))
    z = np.linspace(0, ZMAX, 200001)
    z32 = z.astype(F32)
    t32 = (F32(1) / fma32(np.full_like(z32, F32(P)), z32, np.full_like(z32, F32(1)))).astype(F32)
    z = z.astype(F32).astype(np.float64)
    g = (horner32(t32, as_list(co)) * t32).astype(np.float64)
    sim = np.abs(g / (erfcx(z)) - 1).max()
    report("ERFC_Q  (erfc rel, deg 8)", err0, co, Qf, lambda t: 1.0 / Qf(t), tlo, 1.0, sim)
    out.append(("ERFC_Q", as_list(co)))

    # ---------------- gelu_grad K(t) ----------------
    a0 = gelu_grad_root()
    q = P / SQRT2
    AMAX = 14.7
    tlo = 1.0 / (1.0 + q * AMAX)

    def Kf(t):
        a = (1 - t) / (q * t)
        return (mills(a) - a) * INV_SQRT2PI / (a0 - a)

    err0, co = fit_f32(Kf, lambda t: 1.0 / np.abs(Kf(t)), tlo, 1.0, range(0, 9))
    report("GELU_K  (gelu' rel, deg 8)", err0, co, Kf, lambda t: 1.0 / np.abs(Kf(t)), tlo, 1.0)
    out.append(("GELU_K", as_list(co)))
    a0h, a0l = split(a0)
    out.append(("GELU_GRAD_ROOT", [a0h, a0l]))        # A0 = -x0 (hi, lo)
    if verbose:
        print(f"  root of gelu': x0 = {float(-a0)!r}")

    # ---------------- erf small S(u) ----------------
    THR = ERF_THR
    Sf = lambda u: np.array(erf_v(np.sqrt(u)), float) / np.sqrt(u)
    err0, co = fit_f32(Sf, lambda u: 1.0 / Sf(u), 1e-14, THR * THR, range(0, 5))
    x = np.linspace(1e-6, THR, 200001).astype(F32)
    u = (x * x).astype(F32)
    y = (horner32(u, as_list(co)) * x).astype(np.float64)
    sim = np.abs(y / np.array(erf_v(x.astype(np.float64)), float) - 1).max()
    report("ERF_S   (erf rel, deg 4 in x^2)", err0, co, Sf, lambda u: 1.0 / Sf(u), 1e-14, THR * THR, sim)
    out.append(("ERF_S", as_list(co)))

    # ---------------- gelu_tanh_grad root patch ----------------
    x0 = tanh_grad_root()
    DELTA = TGRAD_DELTA
    Hf = lambda d: np.asarray(tanh_grad_ld(x0 + np.asarray(d, np.longdouble)) / np.asarray(d, np.longdouble),
                              dtype=np.float64)
    # avoid d == 0 exactly on the grid
    err0, co = fit_f32(Hf, lambda d: 1.0 / np.abs(Hf(d)), -DELTA * 1.0001, DELTA, range(0, 5))
    report("TGRAD_H (patch rel, deg 4)", err0, co, Hf, lambda d: 1.0 / np.abs(Hf(d)), -DELTA * 1.0001, DELTA)
    x0h = f32(x0)
    x0l = f32(x0 - np.longdouble(x0h))
    out.append(("TGRAD_H", as_list(co)))
    out.append(("TGRAD_ROOT", [x0h, x0l]))            # X0 (hi, lo)
    if verbose:
        print(f"  root of gelu_tanh': x0 = {float(x0)!r}")
    return [(name, tuple(vals)) for name, vals in out]


def main():
    out = fit_all()
    print("\n# ---- coefficient tables (float32 values, lowest order first) ----")
    for name, vals in out:
        print(f"{name} = (")
        for v in vals:
            print(f"    {v!r},")
        print(")")


if __name__ == "__main__":
    main()
