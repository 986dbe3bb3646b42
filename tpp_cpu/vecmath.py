"""Vector float32 math emitted as straight-line LLVM IR (llvmlite.ir).

Every public function has the signature ``f(builder, x) -> value`` where ``x``
is an ``llvmlite.ir.Value`` of type ``<W x float>`` (any W >= 1; a plain
``float`` also works) and the result has the same type; results are bitwise
identical for every W.  The IR is
branch-free and calls only LLVM intrinsics (``llvm.fma.*``, ``llvm.fabs.*``),
declared on ``builder.module`` (an existing declaration is reused).  Nothing is
target specific: the same IR serves <8 x float> (AVX2), <16 x float> (AVX-512)
and narrow tail vectors.

Public functions
----------------
exp(b, x)             e^x
sigmoid(b, x)         1 / (1 + e^-x)
tanh(b, x)            tanh x
erf(b, x)             erf x
erfc(b, x)            1 - erf x (relatively accurate in the tail)
gelu(b, x)            x * Phi(x) = 0.5 x erfc(-x / sqrt 2)      (exact erf form)
gelu_grad(b, x)       Phi(x) + x phi(x)
gelu_tanh(b, x)       0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
gelu_tanh_grad(b, x)  exact derivative of gelu_tanh

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
  - the tail functions (sigmoid, erfc, ...) only need e^y for y <= 0;
    they keep E = e^y * 2^64 (always normal, one extra offset of 64 in the
    shifter) and fold the 2^-64 into the other factor, so the single final
    multiplication is the only rounding into the subnormal range.
* sigmoid: e = exp(-|x|); 1/(1+e) for x >= 0, e/(1+e) for x < 0 (never
  overflows; relative accurate down to x ~ -87.3 and graceful below).
* tanh: tanh|x| = em1 / (em1 + 2), em1 = expm1(2|x|) = 2^n * pm1 + (2^n - 1)
  with pm1 = e^r - 1 from the same polynomial without its constant term, so it
  is relatively accurate near 0 without a second branch; sign restored by or.
* erfc(z) = t * exp(-z^2) * Q(t), t = 1/(1 + 0.375 z), Q of degree 8 (0<=z<=10.4).
  -z^2 = -(h + l) exactly (h = z*z, l = fma(z, z, -h)) and l is folded into the
  reduced argument of ONE exp, whose Cody-Waite reduction is exact, so the tail
  is relatively accurate down to the subnormals.
* erf: x * S(x^2) (degree 4) for |x| < 0.6, else sign(x) (1 - erfc|x|).
* gelu / gelu_grad share one core for a = min(|x|, 14.6) (~26 vector ops and one
  division, branch-free; see the cost note at the end):
  - e^(-a^2/2) = 2^k e^(w/2): k = round(-a^2 / (2L)) by the shifter
    (t = fma(a*a, -1/(2L), SH)), w = -a^2 - 2kL in ONE rounding as
    fma(a, -a, c2) with c2 = fma(t, -2L, 2L*SH) = -2kL exact.  The step
    L = round(ln2 2^16)/2^16 makes 2L a 15-bit constant (exact products for
    |k| <= 255); the mismatch gamma = 1 - ln2/L ~ -2e-6 is folded exactly into
    the polynomials: e^(-a^2/2) = 2^k e^(w(1-gamma)/2) e^(-gamma a^2/2).
    No Cody-Waite low part, no h + l split.  e^(w/2) ~ E(w), degree 6 (Horner).
  - Phi(-a) e^(a^2/2) (the Mills ratio over sqrt(2 pi)) is a rational P/Q of
    degrees 4/4 (Q monic, all coefficients positive: no cancellation) on
    [0, 14.7], one vdivps.
  - 2^k is applied by an integer add to the exponent of P/Q (P carries 2^40,
    E carries 2^-40, so 2^k P/Q is normal for every k >= -154).
  - gelu: x<0: -a Phi(-a); x>=0: x - a Phi(-a); both as ONE final
    fma(a 2^k P/Q, -E, base) with base = x or -0.0, which is also the only
    rounding into the subnormal range (no cancellation for x<0).
  - gelu_grad: Phi(x) + x phi(x) = e^(-a^2/2) (A0 - a) S(a) for x = -a <= 0
    and 1 - (the same) for x > 0, S = P/Q of degrees 4/3 fitted with the root
    A0 = 0.7517915... factored out ((A0 - a) formed as (A0_hi - a) + A0_lo), so
    the result is relatively accurate next to the zero of gelu' at x0 = -A0;
    the sign of (A0 - a) is flipped for x >= 0 and the final
    fma(., E, 0 or 1) gives H or 1 - H.  P(0) is chosen so that
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

All polynomial coefficients come from tools/fit_vecmath.py (weighted Remez on
Chebyshev-distributed points with relative weighting, float32 rounding with
re-fit; the rationals GELU_P/Q, GELU_GRAD_P/Q by a relative rational minimax
fit, Sanathanan-Koerner inside Lawson reweighting, with the same rounding and
re-fit), which also prints the fit errors.

Rules
-----
* No branches, no calls except LLVM intrinsics, no fast-math flags (the
  compensated arithmetic relies on IEEE rounding; do not add 'contract' or
  'reassoc').
* Clamps are written as ``select(x > hi, hi, x)`` / ``select(x < lo, lo, x)``,
  which keep NaN (x86: one vminps/vmaxps with NaN passed through); LLVM's
  minnum/maxnum would drop it.  Every function propagates NaN.
* Sign tests are ``bitcast(x) < 0`` (a sign-bit blend), so -0.0 takes the
  negative branch where that matters (tanh(-0) = erf(-0) = gelu(-0) = -0).
* Constants are float32-exact; powers of two are used to rescale polynomials.
* A power of two applied by an integer add to the exponent field (gelu's 2^k)
  is only used where the scaled value provably stays normal; the rounding into
  the subnormals is always one floating-point operation.

Special values: exp(+inf)=inf, exp(-inf)=0, exp(x>88.7228)=inf;
tanh(+-inf)=+-1; sigmoid(+inf)=1, sigmoid(-inf)=0; erf(+-inf)=+-1,
erfc(+inf)=0, erfc(-inf)=2; gelu(+inf)=inf, gelu(-inf)=-0.0;
gelu_grad(+inf)=1, gelu_grad(-inf)=-0.0; gelu_tanh(+inf)=inf,
gelu_tanh(-inf)=-0.0; gelu_tanh_grad(+inf)=1, gelu_tanh_grad(-inf)=-0.0;
NaN in -> NaN out everywhere.

Measured accuracy (tests/test_vecmath.py: random bit patterns over every
exponent, dense grids around every branch point, thresholds and specials;
float64 / long double references rounded to float32; max relative error where
the true result is a normal float32; absolute error <= 4 * 2^-149 where it is
subnormal):
    function          max rel err   max abs err (subnormal results)
    exp               2.4e-7        1.0 * 2^-149
    sigmoid           2.3e-7        0.9 * 2^-149
    tanh              2.4e-7        (none)
    erf               3.0e-7        0.9 * 2^-149
    erfc              4.8e-7        2.3 * 2^-149
    gelu              5.2e-7        3.1 * 2^-149   (exhaustive, see below)
    gelu_grad         5.3e-7        3.2 * 2^-149   (exhaustive, see below)
    gelu_tanh         2.4e-7        1.2 * 2^-149
    gelu_tanh_grad    4.4e-7        1.8 * 2^-149
(the tests also sweep 8e6 extra points per function; the largest errors sit at
moderate |x|, e.g. erfc near |x| ~ 0.5-1.3 where Q's float32 evaluation
(t rounding + Horner) costs ~3e-7.  gelu / gelu_grad were checked on every
float32 with |x| < 15.5 (beyond, the clamped results are exactly x / -0 and
1 / -0); on the test inputs they show 4.6e-7 / 1.6 and 4.4e-7 / 2.3.  Their
error is the float32 evaluation of P/Q (~3e-7) + the fits (1e-7 + 5e-9); the
subnormal tolerance 4 * 2^-149 is a relative 4.8e-7 at the top of the
subnormal range, so the margin there is ~20 %; tests/test_vecmath.py checks
every float of [-14.7, -12] for both.)  gelu_grad and gelu_tanh_grad stay relatively accurate right next to
their zeros (x0 = -0.75179 / -0.75246).

Instruction counts per <8 x float> vector on znver3 (AVX2+FMA, llc -O3, loop
body of an elementwise kernel, excluding the load, the store and the loop
control; all ymm, no calls, no scalar code):
    function          arith  reg-copies  constant reloads  (vdivps)
    exp                 15       2            0              0
    sigmoid             18       2            0              1
    tanh                19       2            1              1
    erf                 40       2            4              1
    erfc                31       1            4              1
    gelu                26       1            4              1
    gelu_grad           31       0            5              1
    gelu_tanh           37       3            3              1
    gelu_tanh_grad      55       3            4              1
("reg-copies" are vmovaps before destructive FMAs; "constant reloads" are
stack reloads once the 16 ymm registers run out.)  On this 2-core znver3 VM
(~18.5 GB/s read+write for np.copyto, ~30 GB/s for tpp's identity kernel with
non-temporal stores) exp runs at ~16 GB/s, sigmoid/tanh ~13 GB/s, erfc
~8.5 GB/s, gelu ~11 GB/s (torch's gelu with out=: ~9 GB/s), gelu_inv
(g * gelu_grad, three streams) ~14 GB/s, gelu_tanh ~7.5 GB/s and
gelu_tanh_grad ~5 GB/s (in-cache, a 256x256 kernel: exp ~0.6-0.75 ns, gelu
~0.65-0.7 ns per float), i.e. only exp keeps up with DRAM on one core here.
Measured here, each vector op costs ~0.5-1 cycle whatever its kind (min,
and, blend included; unrolling two vectors per iteration gains nothing), so
gelu's ~26 ops are the floor of this method: fewer would need fewer fitted
coefficients, i.e. a looser error bound.
"""
import math
import struct

from llvmlite import ir

__all__ = [
    "exp", "sigmoid", "tanh", "erf", "erfc",
    "gelu", "gelu_grad", "gelu_tanh", "gelu_tanh_grad",
]

_F32 = ir.FloatType()
_I32 = ir.IntType(32)


def _f32(v):
    """Round a Python float to the nearest float32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _split(v):
    hi = _f32(v)
    return hi, _f32(v - hi)


# Coefficients: generated by tools/fit_vecmath.py, kept in vecmath_coeffs.
from .vecmath_coeffs import (  # noqa: E402
    EXP_C,
    ERFC_P,
    ERFC_Q,
    GELU_E,
    GELU_P,
    GELU_Q,
    GELU_GRAD_P,
    GELU_GRAD_Q,
    GELU_GRAD_ROOT,
    ERF_THR,
    ERF_S,
    TGRAD_DELTA,
    TGRAD_H,
    TGRAD_ROOT,
)

# ---------------------------------------------------------------------------
# Derived constants (exact float32 values)
# ---------------------------------------------------------------------------
_LOG2E = _f32(1.0 / math.log(2.0))
_LN2_HI, _LN2_LO = _split(math.log(2.0))
_SH = 12582912.0                 # 1.5 * 2^23: t = y + SH rounds y to an integer
_SH_BIAS = _SH + 127.0           # bits(t) << 23 == 2^n
_SH_BIAS64 = _SH + 127.0 + 64.0  # bits(t) << 23 == 2^(n + 64)
_TWO_M64 = 2.0 ** -64
_SQRT1_2 = math.sqrt(0.5)
# gelu / gelu_grad exp reduction: k = round(-a^2 / (2 GELU_L)) by the shifter, and
# -2 k GELU_L = fma(t, -2 GELU_L, 2 GELU_L SH) exactly (2 GELU_L has 15 significant bits,
# |k| <= 154); bits(t) << 23 == k << 23 (SH's low 9 bits are 0).
GELU_L = 45426.0 / 65536.0             # round(ln2 * 2^16) / 2^16
_GELU_K2 = 2.0 * GELU_L * _SH           # exact
_GELU_S = 2.0 ** 40                     # P/Q scaled by 2^40, E by 2^-40: 2^k P/Q stays normal
# gelu_tanh: v = x (C1 + C3 x^2); C1_HI is a multiple of 2^-19 so that
# Fast2Sum(C1_HI, P) is exact for 0 <= P < 16.
_C1 = 2.0 * math.sqrt(2.0 / math.pi)
_C1_HI = round(_C1 * 2.0 ** 19) / 2.0 ** 19
_C1_LO = _f32(_C1 - _C1_HI)
_C3_HI, _C3_LO = _split(_C1 * 0.044715)
_C3X3 = _f32(3.0 * _C1 * 0.044715)

# clamps
_EXP_HI = 89.0        # e^89 overflows; (q 2^64)^2 stays finite before rounding
_EXP_LO = -104.0      # e^-104 < 2^-150: rounds to 0
_ERFC_ZMAX = 10.3     # erfc(10.3) < 2^-150
_GELU_AMAX = 14.6     # gelu / gelu_grad underflow below -14.6, Phi(-14.6) < 2^-150
_TANH_AMAX = 10.0     # tanh(10) rounds to 1
_GTANH_AMAX = 11.0    # gelu_tanh(-11), gelu_tanh_grad(-11) underflow


class _Ops:
    """Tiny helper binding a builder and a float (vector) type."""

    def __init__(self, b, ty):
        self.b = b
        self.ty = ty
        if isinstance(ty, ir.VectorType):
            if not isinstance(ty.element, ir.FloatType):
                raise TypeError("vecmath: expected <W x float>, got %s" % ty)
            self.w = ty.count
            self.ity = ir.VectorType(_I32, ty.count)
            self.suffix = "v%df32" % ty.count
        elif isinstance(ty, ir.FloatType):
            self.w = None
            self.ity = _I32
            self.suffix = "f32"
        else:
            raise TypeError("vecmath: expected <W x float>, got %s" % ty)

    # constants
    def c(self, v):
        v = _f32(float(v))
        if self.w is None:
            return ir.Constant(_F32, v)
        return ir.Constant(self.ty, [v] * self.w)

    def ci(self, v):
        if self.w is None:
            return ir.Constant(_I32, v)
        return ir.Constant(self.ity, [v] * self.w)

    def _intr(self, name, nargs):
        full = "llvm.%s.%s" % (name, self.suffix)
        m = self.b.module
        fn = m.globals.get(full)
        if fn is None:
            fn = ir.Function(m, ir.FunctionType(self.ty, [self.ty] * nargs), name=full)
        return fn

    # arithmetic (plain IEEE, no fast-math flags)
    def fma(self, a, x, c):
        return self.b.call(self._intr("fma", 3), [a, x, c])

    def fabs(self, x):
        return self.b.call(self._intr("fabs", 1), [x])

    def add(self, a, x):
        return self.b.fadd(a, x)

    def sub(self, a, x):
        return self.b.fsub(a, x)

    def mul(self, a, x):
        return self.b.fmul(a, x)

    def div(self, a, x):
        return self.b.fdiv(a, x)

    def neg(self, x):
        return self.b.fneg(x)

    def sel(self, cond, a, x):
        return self.b.select(cond, a, x)

    def minp(self, x, hi):
        """min(x, hi) that keeps NaN x."""
        hi = self.c(hi)
        return self.b.select(self.b.fcmp_ordered(">", x, hi), hi, x)

    def maxp(self, x, lo):
        """max(x, lo) that keeps NaN x."""
        lo = self.c(lo)
        return self.b.select(self.b.fcmp_ordered("<", x, lo), lo, x)

    def lt(self, x, v):
        return self.b.fcmp_ordered("<", x, self.c(v))

    def bits(self, x):
        return self.b.bitcast(x, self.ity)

    def flt(self, i):
        return self.b.bitcast(i, self.ty)

    def signbit(self, x):
        """i1 mask: sign bit of x set (x < 0, -0.0, negative NaN)."""
        return self.b.icmp_signed("<", self.bits(x), self.ci(0))

    def pow2_from_shifter(self, t):
        """2^(bits of t above the shifter) -- t = y + SH_BIAS[64]."""
        return self.flt(self.b.shl(self.bits(t), self.ci(23)))

    def horner(self, x, coeffs, scale=1.0):
        """sum_k coeffs[k] * scale^k * x^k by FMA Horner (scale a power of 2)."""
        n = len(coeffs) - 1
        acc = self.c(coeffs[n] * scale ** n)
        for k in range(n - 1, -1, -1):
            acc = self.fma(acc, x, self.c(coeffs[k] * scale ** k))
        return acc


def _ops(b, x):
    return _Ops(b, x.type)


def _horner_monic(o, x, coeffs):
    """Horner for a polynomial whose top coefficient is 1: the first step is an add."""
    n = len(coeffs) - 1
    assert coeffs[n] == 1.0 and n >= 1
    acc = o.add(x, o.c(coeffs[n - 1]))
    for k in range(n - 2, -1, -1):
        acc = o.fma(acc, x, o.c(coeffs[k]))
    return acc


def _exp_poly(o, r, scale=1.0):
    """e^(scale*r) ~ 1 + s + c2 s^2 + ... + c6 s^6, s = scale*r  (6 FMAs)."""
    return o.horner(r, (1.0, 1.0) + EXP_C, scale)


# ---------------------------------------------------------------------------
# exp
# ---------------------------------------------------------------------------
def exp(b, x):
    """e^x for <W x float> x (full range, subnormal results, inf/NaN)."""
    o = _ops(b, x)
    xc = o.maxp(o.minp(x, _EXP_HI), _EXP_LO)
    # m = round(x log2e / 2); q = e^((x - 2 m ln2)/2); e^x = (q 2^m)^2
    t = o.fma(xc, o.c(_LOG2E * 0.5), o.c(_SH_BIAS))
    m = o.sub(t, o.c(_SH_BIAS))
    r = o.fma(m, o.c(-2.0 * _LN2_HI), xc)        # exact
    r = o.fma(m, o.c(-2.0 * _LN2_LO), r)
    q = _exp_poly(o, r, 0.5)
    y = o.mul(q, o.pow2_from_shifter(t))
    return o.mul(y, y)


def _exp_nonpos_scaled(o, y):
    """E = e^y * 2^64 for y in [-104, 0] (NaN passes); E is always normal."""
    t = o.fma(y, o.c(_LOG2E), o.c(_SH_BIAS64))
    n = o.sub(t, o.c(_SH_BIAS64))
    r = o.fma(n, o.c(-_LN2_HI), y)                # exact
    r = o.fma(n, o.c(-_LN2_LO), r)
    return o.mul(_exp_poly(o, r), o.pow2_from_shifter(t))


def _exp_neg_sq_scaled(o, a):
    """E = e^(-a^2) * 2^64 for a >= 0 (clamped), with a^2 = h + l split exactly and l folded
    into the (exact) reduction."""
    h = o.mul(a, a)
    l = o.fma(a, a, o.neg(h))
    t = o.fma(h, o.c(-_LOG2E), o.c(_SH_BIAS64))
    n = o.sub(t, o.c(_SH_BIAS64))
    r = o.fma(n, o.c(-_LN2_HI), o.neg(h))         # exact
    c = o.fma(n, o.c(_LN2_LO), l)
    r = o.sub(r, c)
    p = _exp_poly(o, r)
    return o.mul(p, o.pow2_from_shifter(t))


# ---------------------------------------------------------------------------
# sigmoid, tanh
# ---------------------------------------------------------------------------
def sigmoid(b, x):
    """1/(1+e^-x), computed from e^-|x| (never overflows)."""
    o = _ops(b, x)
    na = o.neg(o.fabs(x))
    E = _exp_nonpos_scaled(o, o.maxp(na, _EXP_LO))
    e = o.mul(E, o.c(_TWO_M64))
    num = o.sel(o.signbit(x), e, o.c(1.0))
    return o.div(num, o.add(e, o.c(1.0)))


def tanh(b, x):
    """tanh x = sign(x) em1/(em1 + 2), em1 = expm1(2|x|)."""
    o = _ops(b, x)
    a = o.minp(o.fabs(x), _TANH_AMAX)
    t = o.fma(a, o.c(2.0 * _LOG2E), o.c(_SH_BIAS))
    n = o.sub(t, o.c(_SH_BIAS))
    rh = o.fma(n, o.c(-0.5 * _LN2_HI), a)          # exact; r = 2 rh
    rh = o.fma(n, o.c(-0.5 * _LN2_LO), rh)
    # pm1 = e^(2 rh) - 1 = rh (2 + rh (4 c2 + ...))
    pm1 = o.mul(o.horner(rh, [2.0 ** (k + 1) * c for k, c in enumerate((1.0,) + EXP_C)]), rh)
    s = o.pow2_from_shifter(t)
    em1 = o.fma(s, pm1, o.sub(s, o.c(1.0)))
    q = o.div(em1, o.add(em1, o.c(2.0)))
    sign = b.and_(o.bits(x), o.ci(-0x80000000))
    return o.flt(b.or_(o.bits(q), sign))


# ---------------------------------------------------------------------------
# erf, erfc
# ---------------------------------------------------------------------------
def _erfc_pos(o, a):
    """erfc(a) for a = |x| clamped to [0, 10.3] (NaN passes)."""
    E = _exp_neg_sq_scaled(o, a)
    t = o.div(o.c(1.0), o.fma(a, o.c(ERFC_P), o.c(1.0)))
    G = o.mul(t, o.horner(t, [q * _TWO_M64 for q in ERFC_Q]))
    return o.mul(E, G)


def erfc(b, x):
    """1 - erf x, relatively accurate for large x (down to the subnormals)."""
    o = _ops(b, x)
    a = o.minp(o.fabs(x), _ERFC_ZMAX)
    ec = _erfc_pos(o, a)
    return o.sel(o.signbit(x), o.sub(o.c(2.0), ec), ec)


def erf(b, x):
    """erf x: x S(x^2) for |x| < 0.6, else sign(x) (1 - erfc|x|)."""
    o = _ops(b, x)
    ax = o.fabs(x)
    a = o.minp(ax, _ERFC_ZMAX)
    big = o.sub(o.c(1.0), _erfc_pos(o, a))
    big = o.flt(b.or_(o.bits(big), b.and_(o.bits(x), o.ci(-0x80000000))))
    small = o.mul(x, o.horner(o.mul(x, x), ERF_S))
    return o.sel(o.lt(ax, ERF_THR), small, big)


# ---------------------------------------------------------------------------
# gelu (erf form)
# ---------------------------------------------------------------------------
def _gelu_core(o, x, P, Q):
    """Shared part of gelu / gelu_grad for a = min(|x|, 14.6):
    returns (ac, E, Rk) with  e^(-a^2/2) P(a)/Q(a) = Rk * E  (up to rounding), where
    Rk = 2^(k+40) P(a)/Q(a) (built by an integer add to the exponent; always normal) and
    E = 2^-40 e^(w/2) (normal), w = -a^2 - 2 k GELU_L computed exactly."""
    b = o.b
    ac = o.minp(o.fabs(x), _GELU_AMAX)
    s = o.mul(ac, ac)
    t = o.fma(s, o.c(-0.5 / GELU_L), o.c(_SH))         # SH + k, k = round(-a^2 / (2L))
    c2 = o.fma(t, o.c(-2.0 * GELU_L), o.c(_GELU_K2))    # -2 k L, exact
    w = o.fma(ac, o.neg(ac), c2)                         # -a^2 - 2 k L, one rounding
    E = o.horner(w, [c / _GELU_S for c in GELU_E])
    rq = o.div(o.horner(ac, [c * _GELU_S for c in P]), _horner_monic(o, ac, Q))
    Rk = o.flt(b.add(o.bits(rq), b.shl(o.bits(t), o.ci(23))))   # rq * 2^k
    return ac, E, Rk


def gelu(b, x):
    """x Phi(x) with Phi the standard normal cdf (exact erf GELU).

    x < 0: -a Phi(-a); x >= 0: x - a Phi(-a); with a Phi(-a) = (a Rk) E folded into one
    final fma, which is also the only rounding into the subnormal range."""
    o = _ops(b, x)
    ac, E, Rk = _gelu_core(o, x, GELU_P, GELU_Q)
    m = o.mul(ac, Rk)
    base = o.sel(o.signbit(x), o.c(-0.0), x)
    return o.fma(m, o.neg(E), base)


def gelu_grad(b, x):
    """d/dx gelu = Phi(x) + x phi(x) (relatively accurate at its zero too).

    x = -a <= 0: e^(-a^2/2) (A0 - a) S(a);  x > 0: 1 - (the same)."""
    o = _ops(b, x)
    ac, E, Rk = _gelu_core(o, x, GELU_GRAD_P, GELU_GRAD_Q)
    d = o.add(o.sub(o.c(GELU_GRAD_ROOT[0]), ac), o.c(GELU_GRAD_ROOT[1]))
    # negate d where x >= 0 (sign bit of x clear): d ^ (~x & 0x80000000)
    flip = b.and_(b.not_(o.bits(x)), o.ci(-0x80000000))
    ds = o.flt(b.xor(o.bits(d), flip))
    m = o.mul(ds, Rk)
    base = o.sel(o.signbit(x), o.c(0.0), o.c(1.0))
    return o.fma(m, E, base)


# ---------------------------------------------------------------------------
# gelu (tanh form)
# ---------------------------------------------------------------------------
def _gtanh_core(o, ac):
    """For ac = |x| clamped to [0, 11]: returns (E, wh) with
    E = exp(-ac (C1 + C3 ac^2)) 2^64, the exponent formed in double-float32."""
    wh = o.mul(ac, ac)
    wl = o.fma(ac, ac, o.neg(wh))
    ph = o.mul(o.c(_C3_HI), wh)
    pl = o.fma(o.c(_C3_HI), wh, o.neg(ph))
    gh = o.add(o.c(_C1_HI), ph)                    # Fast2Sum (C1_HI multiple of 2^-19)
    e1 = o.sub(ph, o.sub(gh, o.c(_C1_HI)))
    gl = o.fma(o.c(_C3_HI), wl, pl)
    gl = o.fma(o.c(_C3_LO), wh, gl)
    gl = o.add(gl, e1)
    gl = o.add(gl, o.c(_C1_LO))
    # y = -ac (gh + gl)
    vh = o.mul(ac, gh)
    t = o.fma(vh, o.c(-_LOG2E), o.c(_SH_BIAS64))
    n = o.sub(t, o.c(_SH_BIAS64))
    verr = o.fma(ac, gh, o.neg(vh))
    r = o.fma(n, o.c(-_LN2_HI), o.neg(vh))         # exact
    c = o.fma(ac, gl, verr)
    c = o.fma(n, o.c(_LN2_LO), c)
    r = o.sub(r, c)
    E = o.mul(_exp_poly(o, r), o.pow2_from_shifter(t))
    return E, wh


def gelu_tanh(b, x):
    """0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) = x sigmoid(v)."""
    o = _ops(b, x)
    ac = o.minp(o.fabs(x), _GTANH_AMAX)
    xm = o.maxp(x, -_GTANH_AMAX)
    E, _ = _gtanh_core(o, ac)
    e = o.mul(E, o.c(_TWO_M64))
    neg = o.signbit(x)
    num = o.sel(neg, o.mul(xm, E), x)
    q = o.div(num, o.add(e, o.c(1.0)))
    return o.mul(q, o.sel(neg, o.c(_TWO_M64), o.c(1.0)))


def gelu_tanh_grad(b, x):
    """Exact derivative of gelu_tanh."""
    o = _ops(b, x)
    ac = o.minp(o.fabs(x), _GTANH_AMAX)
    xc = o.maxp(o.minp(x, _GTANH_AMAX), -_GTANH_AMAX)
    E, wh = _gtanh_core(o, ac)
    e = o.mul(E, o.c(_TWO_M64))
    ope = o.add(e, o.c(1.0))
    # s2 = 1 + x v'(x) = 1 + C1 x + 3 C3 x^3
    s1 = o.fma(o.c(_C1_HI), xc, o.c(1.0))
    s1 = o.fma(o.c(_C1_LO), xc, s1)
    s2 = o.fma(o.c(_C3X3), o.mul(xc, wh), s1)
    neg = o.signbit(x)
    num = o.sel(neg, o.mul(E, o.add(s2, e)), o.fma(e, s2, o.c(1.0)))
    q = o.div(num, o.mul(ope, ope))
    res = o.mul(q, o.sel(neg, o.c(_TWO_M64), o.c(1.0)))
    # relative accuracy next to the zero X0: (x - X0) H(x - X0)
    d = o.sub(o.sub(x, o.c(TGRAD_ROOT[0])), o.c(TGRAD_ROOT[1]))
    patch = o.mul(d, o.horner(d, TGRAD_H))
    return o.sel(o.lt(o.fabs(d), TGRAD_DELTA), patch, res)
