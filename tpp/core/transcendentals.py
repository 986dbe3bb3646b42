"""The expansions of the named transcendentals (`tpp.core.mathlib`) into the expression IR's
elementary nodes: branch-free f32 code (fma, select, bit operations) that every backend renders
node by node, so the CPU (LLVM) and CUDA backends compute the same bits.

Contract: each public function takes an f32 `tpp.core.expr.Node` x and returns the Node of f(x);
`tpp.core.mathlib` registers them as the `expand` of its PRIMS entries (the measured error bound of
each is stated there). Every function propagates NaN and handles +-inf, +-0 and subnormal
inputs (see "Special values").

    exp(x)             e^x
    exp_nonpos(x)      e^x for x <= 0 (softmax, attention: z - rowmax), cheaper than exp
    expm1(x)           e^x - 1 (relatively accurate near 0)
    log(x)             natural logarithm
    sigmoid(x)         1 / (1 + e^-x)
    tanh(x)            tanh x
    erf(x)             erf x
    erfc(x)            1 - erf x (relatively accurate in the tail)
    gelu(x)            x * Phi(x) = 0.5 x erfc(-x / sqrt 2)      (exact erf form)
    gelu_grad(x)       Phi(x) + x phi(x)
    gelu_tanh(x)       0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    gelu_tanh_grad(x)  exact derivative of gelu_tanh

Method
------
* exp core.  n = round(y log2 e) by the 1.5*2^23 "shifter" trick
  (t = fma(y, log2e, SH); n = t - SH), Cody-Waite reduction r = y - n ln2 with
  ln2 = LN2_HI + LN2_LO (the FMA makes y - n*LN2_HI exact), then
  e^r = 1 + r(1 + r(c2 + ... + c6 r^4)) (6 FMAs, |r| <= ln2/2).  2^n is made by
  integer bit tricks: the shifter carries the exponent bias, so
  2^n = bitcast(bits(t) << 23) (one shift).
  - exp(x): full range by squaring: e^x = (q * 2^m)^2 with m = round(x log2e / 2)
    and q = e^(r/2); both factors are normal for x in [-104, 89], the final
    square rounds once, so overflow gives +inf and underflow goes gracefully
    through the subnormals to 0.
  - exp_nonpos(x): e^x for x <= 0 (and accurate up to x = 44; larger x: unspecified), in
    the fewest operations: x below EXP_NONPOS_DEAD (-inf included), whose e^x would be
    subnormal, is computed as e^0 and its result replaced by 0 (NaN kept);
    t = fma(xc, log2e, SH + 191), n = t - (SH + 191), ONE Cody-Waite FMA
    r = fma(n, -ln2_f32, xc) (f32(ln2) is within 1.9e-9 of ln2, so the reduction error is
    <= 150 * 1.9e-9 ~ 2.9e-7 relative), P(r) ~ e^r of degree 5 (5 FMAs, P(0) = 1 exactly)
    with its coefficients pre-scaled by 2^-64 (exact), and one final multiplication by
    2^(n+64) = bits(t) << 23. 11 vector ops on AVX-512, 13 on AVX2 (x86 loop body).
  - the tail functions (sigmoid, erfc, ...) only need e^y for y <= 0;
    they keep E = e^y * 2^64 (always normal, one extra offset of 64 in the
    shifter) and fold the 2^-64 into the other factor, so the single final
    multiplication is the only rounding into the subnormal range.
* expm1: x p(x) (Taylor, degree 9) for |x| < 0.5, else exp(x) - 1 (no cancellation beyond a
  factor 2.6 there).
* log: x = 2^e m with m in [sqrt(1/2), sqrt(2)) by integer operations on the bits (subnormal x
  first scaled by 2^23), f = m - 1 exact (Sterbenz), log(1 + f) = f - f^2/2 + f^3 P(f) with
  P of degree 8 (Cephes' logf coefficients, S. L. Moshier), e ln2 added in two parts
  (ln2_hi = 0.693359375 has 9 bits, so e ln2_hi is exact) last, so log is relatively accurate
  next to its zero at x = 1. The exponent e becomes a float through the shifter
  (fbits(0x4B400000 + e) - 1.5*2^23). Specials by one final select.
* sigmoid: e = exp(-|x|); 1/(1+e) for x >= 0, e/(1+e) for x < 0 (never
  overflows; relative accurate down to x ~ -87.3, 0 below: see sigmoid).
* tanh: tanh|x| = em1 / (em1 + 2), em1 = expm1(2|x|) = 2^n * pm1 + (2^n - 1)
  with pm1 = e^r - 1 from the same polynomial without its constant term, so it
  is relatively accurate near 0 without a second branch; sign restored by or.
* erfc(z) = t * exp(-z^2) * Q(t), t = 1/(1 + 0.375 z), Q of degree 8 (0<=z<=10.4).
  -z^2 = -(h + l) exactly (h = z*z, l = fma(z, z, -h)) and l is folded into the
  reduced argument of ONE exp, whose Cody-Waite reduction is exact, so the tail
  is relatively accurate down to the subnormals.
* erf: x * S(x^2) (degree 4) for |x| < 0.6, else sign(x) (1 - erfc|x|).
* gelu / gelu_grad share one core for a = min(|x|, 14.6) (~26 vector ops and one
  division, branch-free):
  - e^(-a^2/2) = 2^k e^(w/2): k = round(-a^2 / (2L)) by the shifter
    (t = fma(a*a, -1/(2L), SH)), w = -a^2 - 2kL in ONE rounding as
    fma(a, -a, c2) with c2 = fma(t, -2L, 2L*SH) = -2kL exact.  The step
    L = round(ln2 2^16)/2^16 makes 2L a 15-bit constant (exact products for
    |k| <= 255); the mismatch gamma = 1 - ln2/L ~ -2e-6 is folded exactly into
    the polynomials: e^(-a^2/2) = 2^k e^(w(1-gamma)/2) e^(-gamma a^2/2).
    No Cody-Waite low part, no h + l split.  e^(w/2) ~ E(w), degree 6 (Horner).
  - Phi(-a) e^(a^2/2) (the Mills ratio over sqrt(2 pi)) is a rational P/Q of
    degrees 4/4 (Q monic, all coefficients positive: no cancellation) on
    [0, 14.7], one division.
  - 2^k is applied by an integer add to the exponent of P/Q (P carries 2^40,
    E carries 2^-40, so 2^k P/Q is normal for every k >= -154).
  - gelu: x<0: -a Phi(-a); x>=0: x - a Phi(-a); both as ONE final
    fma(a 2^k P/Q, -E, base) with base = x or -0.0 (no cancellation for x<0).
  - Results that would be subnormal (x < GELU_DEAD for gelu, x < GELU_GRAD_DEAD for
    gelu_grad, likewise for gelu_tanh and its gradient: |result| < 2^-126) are -0.0, and
    gelu_tanh's intermediate e = e^-|v| is never formed as a subnormal (|x| > 10): the final product is zeroed there (-0.0)
    instead of rounded into the subnormals, which takes a microcode assist on Intel cores
    for the whole vector (a gelu over N(0, 10) data ran 4.7x slower: ~9% of lanes hit).
  - gelu_grad: Phi(x) + x phi(x) = e^(-a^2/2) (A0 - a) S(a) for x = -a <= 0
    and 1 - (the same) for x > 0, S = P/Q of degrees 4/3 fitted with the root
    A0 = 0.7517915... factored out ((A0 - a) formed as (A0_hi - a) + A0_lo), so
    the result is relatively accurate next to the zero of gelu' at x0 = -A0;
    the sign of (A0 - a) is flipped for x >= 0 and the final
    fma(., E, -0 or 1) gives H or 1 - H.  P(0) is chosen so that
    gelu_grad(+-0) = 0.5 exactly.
* gelu_tanh = x * sigmoid(v), v = x (c1 + c3 x^2) (c1 = 2 sqrt(2/pi),
  c3 = 0.044715 c1).  For x << 0 the result is ~x e^v with |v| up to ~112, so
  v is formed in double-float32 (exact products by FMA, Fast2Sum with a c1
  constant that is a multiple of 2^-19) and its low part folded into the exp
  reduction, like erfc.
* gelu_tanh_grad = (1 + e(1 + x v'))/(1+e)^2 (x >= 0) or
  e (1 + e + x v')/(1+e)^2 (x < 0), e = exp(-|v|), with the same
  double-float v; within 0.06 of its zero x0 = -0.7524614... it uses
  (x - X0) * H(x - X0) (degree 4) instead, X0 as a float pair.

All fitted coefficients come from tools/fit_vecmath.py (kept in `tpp.core.mathlib_coeffs`; weighted
Remez on Chebyshev-distributed points with relative weighting, float32 rounding with re-fit;
the rationals GELU_P/Q, GELU_GRAD_P/Q by a relative rational minimax fit).

Rules
-----
* No fast-math anywhere: the compensated arithmetic relies on IEEE rounding (renderers must
  not contract a*b + c into an fma or reassociate).
* Clamps are written as ``select(x > hi, hi, x)`` / ``select(x < lo, lo, x)``, which keep NaN
  (the IR's min / max would too, but cost more on x86).  Every function propagates NaN.
* Sign tests are ``bits(x) < 0`` (a sign-bit blend), so -0.0 takes the negative branch where
  that matters (tanh(-0) = erf(-0) = gelu(-0) = -0).
* Constants are float32-exact; powers of two are used to rescale polynomials.
* A power of two applied by an integer add to the exponent field (gelu's 2^k) is only used
  where the scaled value provably stays normal; the rounding into the subnormals is always one
  floating-point operation.

Special values: exp(+inf)=inf, exp(-inf)=0, exp(x>88.7228)=inf; expm1(-inf)=-1;
exp_nonpos(-inf)=0, exp_nonpos(+-0)=1, exp_nonpos(x < -87.3365)=0;
log(0)=-inf, log(x<0)=nan, log(inf)=inf;
tanh(+-inf)=+-1; sigmoid(+inf)=1, sigmoid(-inf)=0; erf(+-inf)=+-1,
erfc(+inf)=0, erfc(-inf)=2; gelu(+inf)=inf, gelu(-inf)=-0.0;
gelu_grad(+inf)=1, gelu_grad(-inf)=-0.0; gelu_tanh(+inf)=inf,
gelu_tanh(-inf)=-0.0; gelu_tanh_grad(+inf)=1, gelu_tanh_grad(-inf)=-0.0;
NaN in -> NaN out everywhere.

Cost (AVX2, <8 x float>, loop body of an elementwise kernel): exp 15 vector ops, exp_nonpos 13
(11 with AVX-512's masks; tests/test_transcendentals_nonpos.py counts it), sigmoid 18,
tanh 19, erf 40, erfc 31, gelu 26, gelu_grad 31, gelu_tanh 37, gelu_tanh_grad 55, each with at
most one division (tests/test_vecmath.py counts them).
"""
from __future__ import annotations

import math

from . import expr as X
from .expr import bits, const, fbits, fma, iadd, iand, inot, ior, islt, ixor, select, shl
from .mathlib_coeffs import (
    ERF_S,
    ERF_THR,
    ERFC_P,
    ERFC_Q,
    EXP_C,
    EXP_NONPOS_P,
    GELU_E,
    GELU_GRAD_P,
    GELU_GRAD_Q,
    GELU_GRAD_ROOT,
    GELU_P,
    GELU_Q,
    TGRAD_DELTA,
    TGRAD_H,
    TGRAD_ROOT,
)

__all__ = ["exp", "exp_nonpos", "expm1", "log", "sigmoid", "tanh", "erf", "erfc", "gelu",
           "gelu_grad", "gelu_tanh", "gelu_tanh_grad"]

_f32 = X.f32


def _split(v):
    hi = _f32(v)
    return hi, _f32(v - hi)


# ---------------------------------------------------------------- derived constants (f32-exact)
_LOG2E = _f32(1.0 / math.log(2.0))
_LN2_HI, _LN2_LO = _split(math.log(2.0))
_SH = 12582912.0                 # 1.5 * 2^23: t = y + SH rounds y to an integer
_SH_BIAS = _SH + 127.0           # bits(t) << 23 == 2^n
_SH_BIAS64 = _SH + 127.0 + 64.0  # bits(t) << 23 == 2^(n + 64)
_TWO_M64 = 2.0 ** -64
_SIGN = -0x80000000              # the f32 sign bit as an i32
# gelu / gelu_grad exp reduction: k = round(-a^2 / (2 GELU_L)) by the shifter, and
# -2 k GELU_L = fma(t, -2 GELU_L, 2 GELU_L SH) exactly (2 GELU_L has 15 significant bits,
# |k| <= 154); bits(t) << 23 == k << 23 (SH's low 9 bits are 0).
GELU_L = 45426.0 / 65536.0              # round(ln2 * 2^16) / 2^16
_GELU_K2 = 2.0 * GELU_L * _SH           # exact
_GELU_S = 2.0 ** 40                     # P/Q scaled by 2^40, E by 2^-40: 2^k P/Q stays normal
# gelu_tanh: v = x (C1 + C3 x^2); C1_HI is a multiple of 2^-19 so that
# Fast2Sum(C1_HI, P) is exact for 0 <= P < 16.
_C1 = 2.0 * math.sqrt(2.0 / math.pi)
_C1_HI = round(_C1 * 2.0 ** 19) / 2.0 ** 19
_C1_LO = _f32(_C1 - _C1_HI)
_C3_HI, _C3_LO = _split(_C1 * 0.044715)
_C3X3 = _f32(3.0 * _C1 * 0.044715)
# log: Cephes logf's polynomial, log(1+f) = f - f^2/2 + f^3 P(f), highest order first
_LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
          1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
          3.3333331174e-1)
_LOG_LN2_HI = 0.693359375               # 355/512: e * LN2_HI is exact for |e| < 2^15
_LOG_LN2_LO = -2.12194440e-4
_SQRT_HALF_BITS = 0x3F3504F3            # bits of sqrt(1/2) (rounded down)
_SH_BITS = 0x4B400000                   # bits(1.5 * 2^23): fbits(_SH_BITS + e) = SH + e
_TINY = 2.0 ** -126                     # the smallest normal f32

# clamps
_EXP_HI = 89.0        # e^89 overflows; (q 2^64)^2 stays finite before rounding
_EXP_LO = -104.0      # e^-104 < 2^-150: rounds to 0
_ERFC_ZMAX = 10.3     # erfc(10.3) < 2^-150
_ERF_AMAX = 5.0       # erfc(5) ~ 1.5e-12 < 2^-25: 1 - erfc rounds to 1 from |x| ~ 3.9 on
_GELU_AMAX = 14.6     # gelu / gelu_grad underflow below -14.6, Phi(-14.6) < 2^-150
# below these the exact gelu / gelu' is under 2^-126 in magnitude (and above them at least
# that; float32 thresholds, found by bisection on the double-precision formulas)
GELU_DEAD = -13.146245956420898
GELU_GRAD_DEAD = -13.34188175201416
GELU_TANH_DEAD = -10.10063648223877
GELU_TANH_GRAD_DEAD = -10.234999656677246
_TANH_AMAX = 10.0     # tanh(10) rounds to 1
_GTANH_AMAX = 11.0    # gelu_tanh(-11), gelu_tanh_grad(-11) underflow


# ---------------------------------------------------------------- helpers
def _minp(x, hi):
    """min(x, hi) that keeps a NaN x."""
    hi = const(hi)
    return select(x > hi, hi, x)


def _maxp(x, lo):
    """max(x, lo) that keeps a NaN x."""
    lo = const(lo)
    return select(x < lo, lo, x)


def _signbit(x):
    """x's sign bit is set (x < 0, -0.0, a negative NaN)."""
    return islt(bits(x), 0)


def _pow2_from_shifter(t):
    """2^(the bits of t above the shifter), t = y + SH_BIAS[64]."""
    return fbits(shl(bits(t), 23))


def _with_sign_of(q, x):
    """q with x's sign bit or-ed in (q >= 0)."""
    return fbits(ior(bits(q), iand(bits(x), _SIGN)))


def _horner(x, coeffs, scale=1.0):
    """sum_k coeffs[k] * scale^k * x^k by FMA Horner (scale a power of 2)."""
    n = len(coeffs) - 1
    acc = const(coeffs[n] * scale ** n)
    for k in range(n - 1, -1, -1):
        acc = fma(acc, x, const(coeffs[k] * scale ** k))
    return acc


def _horner_monic(x, coeffs):
    """Horner for a polynomial whose top coefficient is 1: the first step is an add."""
    n = len(coeffs) - 1
    assert coeffs[n] == 1.0 and n >= 1
    acc = x + const(coeffs[n - 1])
    for k in range(n - 2, -1, -1):
        acc = fma(acc, x, const(coeffs[k]))
    return acc


def _exp_poly(r, scale=1.0):
    """e^(scale*r) ~ 1 + s + c2 s^2 + ... + c6 s^6, s = scale*r  (6 FMAs)."""
    return _horner(r, (1.0, 1.0) + EXP_C, scale)


# ---------------------------------------------------------------- exp, expm1, log
def exp(x):
    """e^x (full range, subnormal results, inf / NaN)."""
    xc = _maxp(_minp(x, _EXP_HI), _EXP_LO)
    # m = round(x log2e / 2); q = e^((x - 2 m ln2)/2); e^x = (q 2^m)^2
    t = fma(xc, const(_LOG2E * 0.5), const(_SH_BIAS))
    m = t - const(_SH_BIAS)
    r = fma(m, const(-2.0 * _LN2_HI), xc)        # exact
    r = fma(m, const(-2.0 * _LN2_LO), r)
    q = _exp_poly(r, 0.5)
    y = q * _pow2_from_shifter(t)
    return y * y


EXP_NONPOS_MAX = 44.0   # exp_nonpos is e^x for x <= 44 (n + 64 <= 127); intended for x <= 0
EXP_NONPOS_DEAD = -87.33654022216797   # the least f32 x with e^x >= 2^-126; below it, 0


def exp_nonpos(x):
    """e^x for x <= 0: the exp of softmax and attention (z - rowmax <= 0, -inf when masked).

    Contract: x <= 0, -inf (-> exactly 0) or NaN (-> NaN); e^x is also accurate for
    0 < x <= 44 (EXP_NONPOS_MAX), so an argument that is <= 0 only up to rounding (a few
    ulps above 0) is harmless; for x > 44 the value is unspecified (it may be anything,
    +-inf included). Results that would be subnormal (x < EXP_NONPOS_DEAD = -87.3365: e^x
    below 2^-126) are 0: a sum of exponentials that includes e^0 = 1 cannot see them.

    Such x (and -inf: a masked score) is computed as e^0 and its result replaced by 0, rather
    than clamped and multiplied down to a subnormal or 0: a multiply that underflows takes a
    microcode assist on Intel cores (~100+ cycles) for the whole vector, and a mask of -inf
    keys sent every vector of a masked block through one (ops.attention with a key-padding
    mask, B32 H12 S128 D32 bf16, 2 threads, Sapphire Rapids: 8.8 -> 3.9 ms, f32 7.9 -> 4.1;
    unmasked 3.6-4.0); so did softmax rows whose logits spread over more than 87."""
    dead = x < const(EXP_NONPOS_DEAD)               # -inf and every subnormal result
    xc = select(dead, const(0.0), x)                # computed as e^0: no underflow (docstring)
    t = fma(xc, const(_LOG2E), const(_SH_BIAS64))   # SH + 127 + 64 + n
    n = t - const(_SH_BIAS64)
    r = fma(n, const(-_LN2_HI), xc)                 # one Cody-Waite step (see Method)
    p = _horner(r, [c * _TWO_M64 for c in EXP_NONPOS_P])   # e^r 2^-64, always normal
    return select(dead, const(0.0), p * _pow2_from_shifter(t))   # e^r 2^n: the only rounding


def _exp_nonpos_scaled(y):
    """E = e^y * 2^64 for y in [-104, 0] (NaN passes); E is always normal."""
    t = fma(y, const(_LOG2E), const(_SH_BIAS64))
    n = t - const(_SH_BIAS64)
    r = fma(n, const(-_LN2_HI), y)                # exact
    r = fma(n, const(-_LN2_LO), r)
    return _exp_poly(r) * _pow2_from_shifter(t)


def _exp_neg_sq_scaled(a):
    """E = e^(-a^2) * 2^64 for a >= 0 (clamped), with a^2 = h + l split exactly and l folded
    into the (exact) reduction."""
    h = a * a
    lo = fma(a, a, -h)
    t = fma(h, const(-_LOG2E), const(_SH_BIAS64))
    n = t - const(_SH_BIAS64)
    r = fma(n, const(-_LN2_HI), -h)               # exact
    c = fma(n, const(_LN2_LO), lo)
    r = r - c
    return _exp_poly(r) * _pow2_from_shifter(t)


def expm1(x):
    """e^x - 1 without cancellation near 0: x p(x) (Taylor, degree 9) for |x| < 0.5, else
    exp(x) - 1."""
    poly = const(1.0 / math.factorial(9))
    for k in range(8, 0, -1):
        poly = fma(poly, x, const(1.0 / math.factorial(k)))
    small = poly * x
    big = exp(x) - 1.0
    return select(X.fabs(x) < 0.5, small, big)


def log(x):
    """The natural logarithm (see the module docstring's Method); log(+-0) = -inf,
    log(x < 0) = nan, log(inf) = inf, NaN propagates."""
    sub = x < _TINY                                   # also 0, negatives (fixed at the end)
    xs = select(sub, x * 2.0 ** 23, x)
    ix = iadd(bits(xs), 0x3F800000 - _SQRT_HALF_BITS)  # m's exponent moves into [-1/2, 1/2)
    top = X.lshr(ix, 23)                               # e + 127
    m = fbits(iadd(iand(ix, 0x007FFFFF), _SQRT_HALF_BITS))
    e = fbits(iadd(top, _SH_BITS - 127)) - _SH         # e as a float, exact
    e = e - select(sub, const(23.0), const(0.0))
    f = m - 1.0                                        # exact: m in [sqrt(1/2), sqrt(2))
    z = f * f
    y = (f * z) * _horner(f, _LOG_P[::-1])
    y = fma(e, const(_LOG_LN2_LO), y)
    y = fma(z, const(-0.5), y)
    r = fma(e, const(_LOG_LN2_HI), f + y)
    inf = const(math.inf)
    special = select(X.compare("eq", x, 0.0), -inf,
                     select(x < 0.0, const(math.nan), x))
    return select(X.and_(x > 0.0, x < inf), r, special)


# ---------------------------------------------------------------- sigmoid, tanh
def sigmoid(x):
    """1/(1+e^-x), computed from e^-|x| (never overflows). e^-|x| is taken at |x| <= 87.34
    at most (EXP_NONPOS_DEAD), so it is never rounded into the subnormals (a microcode
    assist for the whole vector on Intel cores; 1 + e cannot see the difference), and x
    below -87.34, whose sigmoid would be subnormal, gives 0."""
    na = -X.fabs(x)
    E = _exp_nonpos_scaled(_maxp(na, EXP_NONPOS_DEAD))
    e = E * const(_TWO_M64)
    num = select(_signbit(x), e, const(1.0))
    return select(x < EXP_NONPOS_DEAD, const(0.0), num / (e + 1.0))


def tanh(x):
    """tanh x = sign(x) em1/(em1 + 2), em1 = expm1(2|x|)."""
    a = _minp(X.fabs(x), _TANH_AMAX)
    t = fma(a, const(2.0 * _LOG2E), const(_SH_BIAS))
    n = t - const(_SH_BIAS)
    rh = fma(n, const(-0.5 * _LN2_HI), a)          # exact; r = 2 rh
    rh = fma(n, const(-0.5 * _LN2_LO), rh)
    # pm1 = e^(2 rh) - 1 = rh (2 + rh (4 c2 + ...))
    pm1 = _horner(rh, [2.0 ** (k + 1) * c for k, c in enumerate((1.0,) + EXP_C)]) * rh
    s = _pow2_from_shifter(t)
    em1 = fma(s, pm1, s - 1.0)
    q = em1 / (em1 + 2.0)
    return _with_sign_of(q, x)


# ---------------------------------------------------------------- erf, erfc
def _erfc_pos(a):
    """erfc(a) for a = |x| clamped to [0, 10.3] (NaN passes)."""
    E = _exp_neg_sq_scaled(a)
    t = const(1.0) / fma(a, const(ERFC_P), const(1.0))
    G = t * _horner(t, [q * _TWO_M64 for q in ERFC_Q])
    return E * G


def erfc(x):
    """1 - erf x, relatively accurate for large x (down to the subnormals)."""
    a = _minp(X.fabs(x), _ERFC_ZMAX)
    ec = _erfc_pos(a)
    return select(_signbit(x), const(2.0) - ec, ec)


def erf(x):
    """erf x: x S(x^2) for |x| < 0.6, else sign(x) (1 - erfc|x|). |x| is clamped at
    _ERF_AMAX, past which 1 - erfc|x| rounds to 1 anyway: erfc|x| itself would be rounded
    into the subnormals from |x| ~ 9.2 on (a microcode assist on Intel cores)."""
    ax = X.fabs(x)
    a = _minp(ax, _ERF_AMAX)
    big = _with_sign_of(const(1.0) - _erfc_pos(a), x)
    small = x * _horner(x * x, ERF_S)
    return select(ax < ERF_THR, small, big)


# ---------------------------------------------------------------- gelu (erf form)
def _gelu_core(x, P, Q):
    """Shared part of gelu / gelu_grad for a = min(|x|, 14.6): returns (ac, E, Rk) with
    e^(-a^2/2) P(a)/Q(a) = Rk * E (up to rounding), where Rk = 2^(k+40) P(a)/Q(a) (built by
    an integer add to the exponent; always normal) and E = 2^-40 e^(w/2) (normal),
    w = -a^2 - 2 k GELU_L computed exactly."""
    ac = _minp(X.fabs(x), _GELU_AMAX)
    s = ac * ac
    t = fma(s, const(-0.5 / GELU_L), const(_SH))        # SH + k, k = round(-a^2 / (2L))
    c2 = fma(t, const(-2.0 * GELU_L), const(_GELU_K2))  # -2 k L, exact
    w = fma(ac, -ac, c2)                                # -a^2 - 2 k L, one rounding
    E = _horner(w, [c / _GELU_S for c in GELU_E])
    rq = _horner(ac, [c * _GELU_S for c in P]) / _horner_monic(ac, Q)
    Rk = fbits(iadd(bits(rq), shl(bits(t), 23)))        # rq * 2^k
    return ac, E, Rk


def gelu(x):
    """x Phi(x) with Phi the standard normal cdf (exact erf GELU).

    x < 0: -a Phi(-a); x >= 0: x - a Phi(-a); with a Phi(-a) = (a Rk) E folded into one
    final fma, which is also the only rounding into the subnormal range."""
    ac, E, Rk = _gelu_core(x, GELU_P, GELU_Q)
    m = select(x < GELU_DEAD, const(0.0), ac * Rk)      # -0.0 where subnormal (docstring)
    base = select(_signbit(x), const(-0.0), x)
    return fma(m, -E, base)


def gelu_grad(x):
    """d/dx gelu = Phi(x) + x phi(x) (relatively accurate at its zero too).

    x = -a <= 0: e^(-a^2/2) (A0 - a) S(a);  x > 0: 1 - (the same)."""
    ac, E, Rk = _gelu_core(x, GELU_GRAD_P, GELU_GRAD_Q)
    d = (const(GELU_GRAD_ROOT[0]) - ac) + const(GELU_GRAD_ROOT[1])
    # negate d where x >= 0 (sign bit of x clear): d ^ (~x & 0x80000000)
    flip = iand(inot(bits(x)), _SIGN)
    ds = fbits(ixor(bits(d), flip))
    m = select(x < GELU_GRAD_DEAD, const(-0.0), ds * Rk)   # -0.0 where subnormal
    base = select(_signbit(x), const(-0.0), const(1.0))
    return fma(m, E, base)


# ---------------------------------------------------------------- gelu (tanh form)
def _gtanh_core(ac):
    """For ac = |x| clamped to [0, 11]: returns (E, wh) with E = exp(-ac (C1 + C3 ac^2)) 2^64,
    the exponent formed in double-float32, and wh = ac^2 rounded."""
    wh = ac * ac
    wl = fma(ac, ac, -wh)
    ph = const(_C3_HI) * wh
    pl = fma(const(_C3_HI), wh, -ph)
    gh = const(_C1_HI) + ph                         # Fast2Sum (C1_HI multiple of 2^-19)
    e1 = ph - (gh - const(_C1_HI))
    gl = fma(const(_C3_HI), wl, pl)
    gl = fma(const(_C3_LO), wh, gl)
    gl = gl + e1
    gl = gl + const(_C1_LO)
    # y = -ac (gh + gl)
    vh = ac * gh
    t = fma(vh, const(-_LOG2E), const(_SH_BIAS64))
    n = t - const(_SH_BIAS64)
    verr = fma(ac, gh, -vh)
    r = fma(n, const(-_LN2_HI), -vh)                # exact
    c = fma(ac, gl, verr)
    c = fma(n, const(_LN2_LO), c)
    r = r - c
    E = _exp_poly(r) * _pow2_from_shifter(t)
    return E, wh


def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) = x sigmoid(v)."""
    ac = _minp(X.fabs(x), _GTANH_AMAX)
    xm = _maxp(x, -_GTANH_AMAX)
    E, _ = _gtanh_core(ac)
    neg = _signbit(x)
    num = select(neg, xm * E, x)
    q = num / fma(E, const(_TWO_M64), const(1.0))   # 1 + e, e = E 2^-64 never rounded alone
    scale = select(neg, const(_TWO_M64), const(1.0))
    return q * select(x < GELU_TANH_DEAD, const(0.0), scale)   # -0.0 where subnormal


def gelu_tanh_grad(x):
    """The exact derivative of gelu_tanh."""
    ac = _minp(X.fabs(x), _GTANH_AMAX)
    xc = _maxp(_minp(x, _GTANH_AMAX), -_GTANH_AMAX)
    E, wh = _gtanh_core(ac)
    # e = E 2^-64 kept >= 2^-120 (normal; |x| > ~9.7 only, where 1 + e and s2 + e do not
    # see the difference)
    e = _maxp(E, 2.0 ** -56) * const(_TWO_M64)
    ope = e + 1.0
    # s2 = 1 + x v'(x) = 1 + C1 x + 3 C3 x^3
    s1 = fma(const(_C1_HI), xc, const(1.0))
    s1 = fma(const(_C1_LO), xc, s1)
    s2 = fma(const(_C3X3), xc * wh, s1)
    neg = _signbit(x)
    num = select(neg, E * (s2 + e), fma(e, s2, const(1.0)))
    q = num / (ope * ope)
    scale = select(neg, const(_TWO_M64), const(1.0))
    res = q * select(x < GELU_TANH_GRAD_DEAD, const(0.0), scale)   # -0.0 where subnormal
    # relative accuracy next to the zero X0: (x - X0) H(x - X0)
    d = (x - const(TGRAD_ROOT[0])) - const(TGRAD_ROOT[1])
    patch = d * _horner(d, TGRAD_H)
    return select(X.fabs(d) < TGRAD_DELTA, patch, res)
