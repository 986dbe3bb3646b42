#!/usr/bin/env python3
"""Derive every polynomial coefficient and root constant used by tpp/transcendentals.py.

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
tpp/mathlib_coeffs.py holds.  Reference values come from the float64 math library
(math.erfc/math.erf/np.expm1) and np.longdouble where cancellation would
otherwise spoil the reference (the gelu_tanh_grad root patch).

Rational fits (ratfit): Sanathanan-Koerner linearisation (minimise |P - f Q| / |f Q_prev|)
inside Lawson's iteratively reweighted least squares, on a 2000-point Chebyshev grid, first
with Q(0) = 1, then renormalised to a monic Q; the coefficients are then rounded to float32 one
at a time (P low to high, then Q) with the free ones re-fitted (warm-started) after each.

Fitted objects (names as in tpp/mathlib_coeffs.py)
---------------------------------------
EXP_C      expm1(s) ~ s + s^2 (c2 + c3 s + ... + c6 s^4),  |s| <= ln2/2 (+0.2 %),
           relative error of expm1 (which bounds the relative error of exp).
ERFC_Q     erfc(z) ~ t * exp(-z^2) * Q(t),  t = 1/(1 + P*z),  P = 0.375,
           0 <= z <= 10.4;  Q of degree 8, relative error of erfc.
GELU_E     e^(w/2) ~ E(w) (degree 6), |w| <= GELU_L (+0.2 %), the exp core of gelu and
           gelu_grad; w is the exactly reduced argument -a^2 - 2 k GELU_L, and E also absorbs the
           factor (1 - gamma), gamma = 1 - ln2/GELU_L (see below).  Relative error.
GELU_P/Q   R~(a) = Phi(-a) e^(a^2/2) e^(-gamma a^2/2) ~ P(a)/Q(a) (degrees 4/4, Q monic),
           0 <= a <= 14.7, relative error (a rational minimax fit, see ratfit).
GELU_GRAD_P/Q
           S~(a) = (R(a) - a/sqrt(2 pi)) e^(-gamma a^2/2) / (A0 - a) ~ P(a)/Q(a)
           (degrees 4/3, Q monic), 0 <= a <= 14.7, relative error;  A0 the root (a0 = -x0 of
           gelu').  For x = -a <= 0, gelu'(x) = Phi(-a) - a phi(a) = e^(-a^2/2) (A0 - a) S(a):
           factoring the root out makes the result relatively accurate next to it.
           GELU_L = round(ln2 * 2^16) / 2^16 is the reduction step of e^(-a^2/2) = 2^k e^(w/2):
           a 15-bit 2*GELU_L makes -2 k GELU_L exact for |k| <= 255, and the mismatch
           gamma = 1 - ln2/GELU_L (~ -2e-6) is folded exactly into E and into R~/S~:
           e^(-a^2/2) = 2^k e^(w (1 - gamma)/2) e^(-gamma a^2/2).
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


def _ratfit(a, y, n, m, fixed, Q0=None, outer=60, inner=3):
    """Relative minimax P_n/Q_m on the points a (f = y, never 0).  fixed: {('p'|'q', k): v},
    at least one entry (the normalisation).  Returns (err, P, Q) lowest order first, or
    (inf, None, None) if no iterate had a denominator free of sign changes."""
    pv = np.polynomial.polynomial.polyval
    sc = np.abs(a).max()
    s = a / sc
    names = [('p', k) for k in range(n + 1) if ('p', k) not in fixed] + \
            [('q', k) for k in range(m + 1) if ('q', k) not in fixed]
    cols = np.stack([(s ** k) if kind == 'p' else (-y * s ** k) for kind, k in names], 1)
    rhs = np.zeros_like(a)
    for (kind, k), v in fixed.items():
        rhs += (-(a ** k) * v) if kind == 'p' else (y * a ** k * v)
    w = np.full_like(a, 1.0 / a.size)
    Q = np.ones_like(a) if Q0 is None else np.abs(Q0)
    best = (np.inf, None, None)
    for _ in range(outer):
        ok = True
        for _ in range(inner):
            sw = np.sqrt(w) / (np.abs(y) * Q)
            c = np.linalg.lstsq(cols * sw[:, None], rhs * sw, rcond=None)[0]
            co = dict(fixed)
            for (kind, k), v in zip(names, c):
                co[(kind, k)] = v / sc ** k
            Pc = [co[('p', k)] for k in range(n + 1)]
            Qc = [co[('q', k)] for k in range(m + 1)]
            Qv = pv(a, Qc)
            ok = bool(np.all(Qv * np.sign(Qv[0]) > 0))
            if not ok:
                break
            Q = np.abs(Qv)
        if not ok:
            break
        e = np.abs(pv(a, Pc) / Qv - y) / np.abs(y)
        if e.max() < best[0]:
            best = (e.max(), Pc, Qc)
        w = w * e / e.max() + 1e-300
        w = w / w.sum()
    return best


def ratfit(f, lo, hi, n, m, grid=2000, constrain=None):
    """Relative minimax rational P_n/Q_m for f on [lo, hi] with float32 coefficients and a
    monic Q (q_m = 1).  constrain(P, Q) -> {('p'|'q', k): float32} fixes some coefficients
    (given the unconstrained fit) before the others are rounded.  Returns (minimax_err, P, Q)
    (lowest order first)."""
    pv = np.polynomial.polynomial.polyval
    a = (lo + hi) / 2 - (hi - lo) / 2 * np.cos(np.pi * (np.arange(grid) + 0.5) / grid)
    y = f(a)
    err0, P, Q = _ratfit(a, y, n, m, {('q', 0): 1.0})
    assert P is not None, "ratfit: no denominator without a zero on the interval"
    P = [v / Q[-1] for v in P]
    Q = [v / Q[-1] for v in Q]
    fixed = {('q', m): 1.0}
    if constrain is not None:
        fixed.update(constrain(P, Q))
        _, P, Q = _ratfit(a, y, n, m, fixed, Q0=pv(a, Q), outer=30)
    for key in [('p', k) for k in range(n + 1)] + [('q', k) for k in range(m)]:
        if key in fixed:
            continue
        _, P2, Q2 = _ratfit(a, y, n, m, fixed, Q0=pv(a, Q), outer=30)
        if P2 is not None:
            P, Q = P2, Q2
        fixed[key] = f32(P[key[1]] if key[0] == 'p' else Q[key[1]])
    return err0, [fixed[('p', k)] for k in range(n + 1)], [fixed[('q', k)] for k in range(m + 1)]


def report_rat(name, err0, P, Q, f, lo, hi):
    if not _VERBOSE:
        return
    pv = np.polynomial.polynomial.polyval
    xs = np.linspace(lo, hi, 100001)
    e1 = np.abs(pv(xs, P) / pv(xs, Q) / f(xs) - 1).max()
    print(f"{name}: minimax {err0:.3e}   f32 coeffs {e1:.3e}")


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
ZMAX = 10.4             # erfc clamp 10.3
GELU_AMAX = 14.7        # gelu/gelu_grad clamp |x| at 14.6
GELU_L = round(math.log(2.0) * 65536) / 65536     # exp reduction step (2*GELU_L has 15 bits)
GELU_GAMMA = 1.0 - math.log(2.0) / GELU_L
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

    # ---------------- gelu / gelu_grad: E(w), R~ = P/Q, S~ = P/Q ----------------
    a0 = gelu_grad_root()
    g = GELU_GAMMA
    LW = GELU_L * 1.002
    fE = lambda w: np.exp(w * (1 - g) / 2)
    err0, co = fit_f32(fE, lambda w: 1.0 / fE(w), -LW, LW, range(0, 7))
    report("GELU_E  (e^(w/2) rel, deg 6)", err0, co, fE, lambda w: 1.0 / fE(w), -LW, LW)
    out.append(("GELU_E", as_list(co)))

    def Rt(a):
        return 0.5 * np.array(erfc_v(a / SQRT2), dtype=np.float64) * np.exp(a * a * (1 - g) / 2)

    err0, P, Q = ratfit(Rt, 0.0, GELU_AMAX, 4, 4)
    report_rat("GELU_P/Q (Phi(-a) e^(a^2/2) rel, deg 4/4)", err0, P, Q, Rt, 0.0, GELU_AMAX)
    out.append(("GELU_P", P))
    out.append(("GELU_Q", Q))

    def St(a):
        r = 0.5 * np.array(erfc_v(a / SQRT2), dtype=np.float64) * np.exp(a * a / 2)
        return (r - a * INV_SQRT2PI) / (a0 - a) * np.exp(-g * a * a / 2)

    a0h, a0l = split(a0)

    def exact_half(P, Q):
        # gelu'(0) must round to exactly 0.5: at a = 0 the kernel computes
        # RN(RN(a0h * RN(p0 2^40 / q0)) * 2^-40); pick the float32 p0 nearest the fit with
        # RN(a0h * RN(p0 2^40 / q0)) == 2^39 (q0 rounded first).
        q0 = F32(Q[0])
        p0 = F32(P[0])
        best = None
        for d in range(-200, 201):
            c = F32(p0 + F32(d) * np.spacing(p0))
            rq = F32(F32(c * F32(2.0 ** 40)) / q0)
            if F32(F32(a0h) * rq) == F32(2.0 ** 39) and (best is None or abs(d) < abs(best[0])):
                best = (d, c)
        assert best is not None, "no float32 p0 makes gelu'(0) exact"
        return {('q', 0): float(q0), ('p', 0): float(best[1])}

    err0, P, Q = ratfit(St, 0.0, GELU_AMAX, 4, 3, constrain=exact_half)
    report_rat("GELU_GRAD_P/Q (gelu'/(A0 - a) rel, deg 4/3)", err0, P, Q, St, 0.0, GELU_AMAX)
    out.append(("GELU_GRAD_P", P))
    out.append(("GELU_GRAD_Q", Q))
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
