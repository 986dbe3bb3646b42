"""A small toolbox over llvmlite.ir: vector constants, intrinsics, loops, typed loads/stores.

Every load widens to f32 and every store narrows from f32, so generators compute in f32 only.
A vector of `w` lanes covers elements [j, j+w) of a row; a tail covers fewer, given as `count`
active lanes, and compiles to masked moves (k-masks on AVX-512, vmaskmov or element moves on
AVX2), never to a scalar loop.
"""
from __future__ import annotations

import contextlib

from llvmlite import ir

F32 = ir.FloatType()
F16 = ir.HalfType()
I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
PTR = ir.PointerType()


class _BFloat(ir.Type):
    """LLVM's `bfloat`, which llvmlite.ir lacks (the operand type of vdpbf16ps)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


BFLOAT = _BFloat()


def vec(ty, w: int) -> ir.VectorType:
    return ir.VectorType(ty, w)


class _Literal(ir.Constant):
    """A constant printed as the given text (`undef`, `poison`, `zeroinitializer`,
    `splat (float 1.0)`): llvmlite prints a vector constant lane by lane, which for a
    <16 x float> is ~300 bytes to build, print and parse per use."""

    def __init__(self, ty, text: str, lanes=None):
        self.type = ty
        self.constant = text if lanes is None else lanes   # lanes: what llvmlite checks
        self._text = text

    def _get_reference(self):
        return self._text


# Constants are immutable values and may be shared by any number of instructions and
# modules: each is built (and its text printed) once per process.
_CONSTANTS: dict = {}
_ZERO_I32 = ir.Constant(I32, 0)


def _cached(key, make):
    c = _CONSTANTS.get(key)
    if c is None:
        c = _CONSTANTS[key] = make()
    return c


def _is_zero(value) -> bool:
    """value is an integer or +0.0 (not -0.0, whose bits are not zero)."""
    return value == 0 and str(value)[0] != "-"


def const(ty, value):
    """A scalar constant, or a vector constant with every lane equal to value."""
    if isinstance(ty, ir.VectorType):
        def make():
            if _is_zero(value):
                return _Literal(ty, "zeroinitializer")
            return _Literal(ty, f"splat ({ir.Constant(ty.element, value)})")
        return _cached(("splat", str(ty), type(value), repr(value)), make)
    # keyed by repr: -0.0 == 0.0 (and nan != nan) as Python floats, not as constants
    return _cached(("scalar", str(ty), type(value), repr(value)), lambda: ir.Constant(ty, value))


def undef(ty):
    """`undef` of any type, printed as one word."""
    return _cached(("undef", str(ty)), lambda: _Literal(ty, "undef"))


def poison(ty):
    """`poison` of any type, printed as one word."""
    return _cached(("poison", str(ty)), lambda: _Literal(ty, "poison"))


def indices(values) -> ir.Constant:
    """The constant <n x i32> of a shuffle mask (all-zero masks print as zeroinitializer)."""
    values = tuple(values)

    def make():
        ty = vec(I32, len(values))
        if not any(values):
            return _Literal(ty, "zeroinitializer", (_ZERO_I32,) * len(values))
        return ir.Constant(ty, list(values))
    return _cached(("indices", values), make)


def shuffle(b: ir.IRBuilder, x, y, mask):
    """shufflevector x, y (None: undef of x's type) with the index list mask."""
    return b.shuffle_vector(x, undef(x.type) if y is None else y, indices(mask))


def i64(value: int):
    return const(I64, value)


def splat(b: ir.IRBuilder, scalar, w: int):
    """A vector with every lane equal to a runtime scalar (LLVM's own splat idiom)."""
    ty = vec(scalar.type, w)
    one = b.insert_element(poison(ty), scalar, _ZERO_I32)
    return b.shuffle_vector(one, poison(ty), indices((0,) * w))


def lane_mask(w: int, count: int):
    """The constant <w x i1> with the first `count` lanes on."""
    return _cached(("mask", w, count),
                   lambda: ir.Constant(vec(I1, w), [1 if i < count else 0 for i in range(w)]))


def _mangle(ty) -> str:
    if isinstance(ty, ir.VectorType):
        return f"v{ty.count}{_mangle(ty.element)}"
    if isinstance(ty, ir.PointerType):
        return "p0"
    if isinstance(ty, ir.FloatType):
        return "f32"
    if isinstance(ty, ir.HalfType):
        return "f16"
    if isinstance(ty, ir.IntType):
        return f"i{ty.width}"
    raise TypeError(ty)


def intrinsic(module: ir.Module, base: str, ret, args, overloads=None) -> ir.Function:
    """Declare (once per module) the LLVM intrinsic `base` overloaded on `overloads` types."""
    overloads = [ret] if overloads is None else overloads
    name = ".".join([base] + [_mangle(t) for t in overloads])
    existing = module.globals.get(name)
    if existing is not None:
        return existing
    return ir.Function(module, ir.FunctionType(ret, args), name=name)


def call(b: ir.IRBuilder, base: str, *args, ret=None, overloads=None):
    """Call an intrinsic whose return type defaults to the first argument's type."""
    ret = args[0].type if ret is None else ret
    fn = intrinsic(b.module, base, ret, [a.type for a in args], overloads)
    return b.call(fn, list(args))


def fma(b, x, y, z):
    return call(b, "llvm.fma", x, y, z)


def dpbf16(b, acc, x, y):
    """vdpbf16ps: acc[j] += x[2j]*y[2j] + x[2j+1]*y[2j+1]; acc <w x f32>, x and y any 64-byte
    vectors holding 2w bf16 values (bitcast here). Needs avx512_bf16 (w = 16)."""
    w = acc.type.count
    bf = vec(BFLOAT, 2 * w)
    fn = intrinsic(b.module, "llvm.x86.avx512bf16.dpbf16ps.512", acc.type, [acc.type, bf, bf], [])
    return b.call(fn, [acc, b.bitcast(x, bf), b.bitcast(y, bf)])


def fabs(b, x):
    return call(b, "llvm.fabs", x)


# ---------------------------------------------------------------- loops
@contextlib.contextmanager
def for_range(b: ir.IRBuilder, count, step: int = 1, start=0, name="i"):
    """`for i in range(start, count, step)`; count/start are ints or i64 values. Yields i."""
    count = i64(count) if isinstance(count, int) else count
    start = i64(start) if isinstance(start, int) else start
    pre = b.block
    fn = pre.function
    head = fn.append_basic_block(f"{name}.head")
    body = fn.append_basic_block(f"{name}.body")
    done = fn.append_basic_block(f"{name}.done")
    b.branch(head)
    b.position_at_end(head)
    idx = b.phi(I64, name=name)
    idx.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<", idx, count), body, done)
    b.position_at_end(body)
    yield idx
    nxt = b.add(idx, i64(step), name=f"{name}.next")
    idx.add_incoming(nxt, b.block)
    b.branch(head)
    b.position_at_end(done)


class Carried:
    """The loop index and the values a `for_carry` loop carries (the body replaces `values`)."""

    def __init__(self, index, values):
        self.index = index
        self.values = values


@contextlib.contextmanager
def for_carry(b: ir.IRBuilder, count, values, step: int = 1, start=0, name="i"):
    """`for i in range(start, count, step)` carrying `values` (e.g. accumulators) in registers:
    the body reads `state.values` and assigns the next ones to it; after the loop,
    `state.values` are the final values (the initial ones when the loop runs zero times)."""
    count = i64(count) if isinstance(count, int) else count
    start = i64(start) if isinstance(start, int) else start
    pre = b.block
    fn = pre.function
    head = fn.append_basic_block(f"{name}.head")
    body = fn.append_basic_block(f"{name}.body")
    done = fn.append_basic_block(f"{name}.done")
    b.branch(head)
    b.position_at_end(head)
    idx = b.phi(I64, name=name)
    idx.add_incoming(start, pre)
    phis = []
    for v in values:
        phi = b.phi(v.type)
        phi.add_incoming(v, pre)
        phis.append(phi)
    b.cbranch(b.icmp_signed("<", idx, count), body, done)
    b.position_at_end(body)
    state = Carried(idx, list(phis))
    yield state
    end = b.block
    idx.add_incoming(b.add(idx, i64(step), name=f"{name}.next"), end)
    for phi, v in zip(phis, state.values):
        phi.add_incoming(v, end)
    b.branch(head)
    b.position_at_end(done)
    state.values = list(phis)


# ---------------------------------------------------------------- memory
def storage_type(dtype):
    """The LLVM element type holding a dtype's bits."""
    return {"f32": F32, "f16": F16, "bf16": I16, "i64": I64, "u8": I8}[dtype.name]


STREAM_PIECE = 16   # bytes per non-temporal store
# Memory-bound kernels load unaligned f32 blocks on AVX-512 hosts as two 32-byte halves per
# 64-byte vector (load_vec(halves=True), chosen at run time by by_input_alignment): numpy
# places arrays at 16-byte boundaries, and a 64-byte load from such an address spans two cache
# lines every time. On Zen 5 such loads halved LayerNorm's and RMSNorm's forward over
# 4096 x 1024 f32 (~75 -> 27-35 GB/s, one thread; 128 to 4096 columns alike) and cost a
# binary add a quarter; as halves (vmovups ymm + vinsertf64x4) they run at about the aligned
# speed. Each half is a volatile load: LLVM would otherwise merge two adjacent loads back into
# one 64-byte load.
HALF_BYTES = 32
ALIGNED_BYTES = 64   # inputs at this boundary load whole vectors (by_input_alignment)
_ALIGN = {"float": 4, "half": 2, "i16": 2, "i64": 8, "i8": 1, "i32": 4}


class _VolatileLoad(ir.LoadInstr):
    """A load LLVM must emit as written (`load volatile`): neither merged with its neighbours
    nor removed."""

    @classmethod
    def make(cls, b, ptr, typ, align):
        load = b.load(ptr, typ=typ, align=align)
        load.__class__ = cls
        return load

    def descr(self, buf):
        [ptr] = self.operands
        buf.append(f"load volatile {self.type}, {ptr.type} {ptr.get_reference()}, "
                   f"align {self.align}{self._stringify_metadata(leading_comma=True)}\n")


def all_aligned(b, pointers, boundary: int):
    """An i1: every pointer is at a multiple of `boundary` bytes (a power of two)."""
    aligned = ir.Constant(I1, 1)
    for ptr in pointers:
        low = b.and_(b.ptrtoint(ptr, I64), i64(boundary - 1))
        aligned = b.and_(aligned, b.icmp_unsigned("==", low, i64(0)))
    return aligned


def by_input_alignment(b, inputs, w: int, body, least: int = 1):
    """body(halves) for the alignment of the call's block inputs: inputs are (pointer, Operand)
    of a kernel; the blocks whose vectors of w elements are wider than HALF_BYTES count (rows,
    read from L1 once per vector, measured no faster as halves). Where there are fewer than
    `least`: body(False). Where every one is at an ALIGNED_BYTES boundary with a pitch of a
    multiple of it: body(False), whole-vector loads; else body(True), the blocks' loads as
    halves. The check is a run-time branch between the two bodies, or none where a pitch
    makes every other row unaligned whatever its base: then body(True) alone."""
    wide = [(ptr, o) for ptr, o in inputs if o.layout == "block"
            and o.dtype.itemsize * w > HALF_BYTES]
    if len(wide) < max(1, least):
        body(False)
        return
    if any((o.ld * o.dtype.itemsize) % ALIGNED_BYTES for _, o in wide):
        body(True)
        return
    aligned = all_aligned(b, [ptr for ptr, _ in wide], ALIGNED_BYTES)
    with b.if_else(aligned) as (then, otherwise):
        with then:
            body(False)
        with otherwise:
            body(True)


def element_ptr(b, base, offset, ty):
    """Address of element `offset` (i64) of type `ty` from an untyped base pointer."""
    return b.gep(base, [offset], source_etype=ty)


def load_vec(b, base, offset, ty, w: int, count: int | None = None, align: int | None = None,
             halves: bool = False):
    """Load w elements of type ty (count < w: the first count lanes, the rest zero); align
    overrides the alignment assumed (default: the element's own). halves=True: a full vector
    of more than HALF_BYTES bytes is loaded as HALF_BYTES pieces (see HALF_BYTES)."""
    vt = vec(ty, w)
    ptr = element_ptr(b, base, offset, ty)
    align = _ALIGN[str(ty)] if align is None else align
    if count is None or count >= w:
        per = HALF_BYTES // align
        if halves and w > per and w % per == 0:
            pieces = [_VolatileLoad.make(b, element_ptr(b, ptr, i64(k), ty), vec(ty, per), align)
                      for k in range(0, w, per)]
            while len(pieces) > 1:
                pieces = [shuffle(b, lo, hi, range(2 * lo.type.count))
                          for lo, hi in zip(pieces[::2], pieces[1::2])]
            return pieces[0]
        return b.load(ptr, typ=vt, align=align)
    fn = intrinsic(b.module, "llvm.masked.load", vt, [PTR, I32, vec(I1, w), vt], [vt, PTR])
    return b.call(fn, [ptr, ir.Constant(I32, align), lane_mask(w, count), const(vt, 0)])


def store_vec(b, value, base, offset, count: int | None = None, streaming: bool = False):
    """Store a vector (count < lanes: only the first count lanes). streaming=True makes a full
    store non-temporal (it bypasses the caches), as 16-byte pieces: the address must then be
    16-byte aligned, which the caller guarantees (numpy only promises 16)."""
    vt = value.type
    ty, w = vt.element, vt.count
    ptr = element_ptr(b, base, offset, ty)
    align = _ALIGN[str(ty)]
    if count is None or count >= w:
        if streaming and (align * w) % STREAM_PIECE == 0:
            per = STREAM_PIECE // align
            flag = b.module.add_metadata([ir.Constant(I32, 1)])
            for k in range(0, w, per):
                piece = shuffle(b, value, None, range(k, k + per))
                addr = element_ptr(b, ptr, i64(k), ty)
                b.store(piece, addr, align=STREAM_PIECE).set_metadata("nontemporal", flag)
        else:
            b.store(value, ptr, align=align)
        return
    if count == 1 and isinstance(ty, ir.IntType) and ty.width < 64:
        # One active lane of integers narrower than 64 bits (bf16 bits): a scalar store of
        # lane 0, not a masked store. LLVM 22's X86 backend (llvmlite 0.48-0.50) lowers a
        # one-lane masked store of `trunc <16 x i32> to <16 x i16>` (which LLVM 20 makes a
        # k-masked vpmovdw) to a store of the untruncated i32 lane, `vmovd %xmm, (mem)`:
        # 2 bytes written past the element (apparently llvm/llvm-project#179489, fixed on
        # LLVM main by PR #179853). The scalar store is a 16-bit vpextrw on every LLVM and ISA,
        # and no slower than kmov + vpmovdw; other counts and element types keep masked stores.
        b.store(b.extract_element(value, _ZERO_I32), ptr, align=align)
        return
    fn = intrinsic(b.module, "llvm.masked.store", ir.VoidType(), [vt, PTR, I32, vec(I1, w)], [vt, PTR])
    b.call(fn, [value, ptr, ir.Constant(I32, align), lane_mask(w, count)])


STREAM_BYTES = 16 << 20   # outputs at least this big are written with non-temporal stores


def with_streaming(b, outputs, body, force: bool = False):
    """Emit body(streaming) for a kernel writing `outputs`, a list of (pointer, rows, pitch in
    bytes). If they total STREAM_BYTES or more (or force) and every pitch is a multiple of
    STREAM_PIECE, two copies are emitted behind a run-time check that every pointer is 16-byte
    aligned: one with non-temporal stores followed by an sfence, one without. Else
    body(False) alone."""
    total = sum(rows * pitch for _, rows, pitch in outputs)
    if (total < STREAM_BYTES and not force) or any(pitch % STREAM_PIECE for _, _, pitch in outputs):
        body(False)
        return
    aligned = ir.Constant(I1, 1)
    for ptr, _, _ in outputs:
        low = b.and_(b.ptrtoint(ptr, I64), i64(STREAM_PIECE - 1))
        aligned = b.and_(aligned, b.icmp_unsigned("==", low, i64(0)))
    with b.if_else(aligned) as (then, otherwise):
        with then:
            body(True)
            call(b, "llvm.x86.sse.sfence", ret=ir.VoidType(), overloads=[])
        with otherwise:
            body(False)


# A compute-bound map (a kernel without reductions doing this many vector operations per
# vector or more, a transcendental counted by its expansion: gelu) keeps few loads in flight,
# too few to cover memory's latency; on targets with eager_prefetch it prefetches its block
# inputs at least MAP_AHEAD_BYTES (whole rows) ahead. See tpp_cpu.equation, Prefetch.
MAP_PREFETCH_OPS = 8
MAP_AHEAD_BYTES = 4096


def map_rows_ahead(row_bytes: int) -> int:
    """Rows of row_bytes each that a heavy map prefetches ahead (MAP_AHEAD_BYTES or more)."""
    return -(-MAP_AHEAD_BYTES // row_bytes)


def prefetch(b, base, offset, ty, locality: int = 3):
    """Prefetch for reading the line holding base[offset] (elements of type ty); a prefetch
    never faults, so the address may lie past the end of an array."""
    call(b, "llvm.prefetch", element_ptr(b, base, offset, ty), ir.Constant(I32, 0),
         ir.Constant(I32, locality), ir.Constant(I32, 1), ret=ir.VoidType(), overloads=[PTR])


def load_scalar(b, base, offset, ty, align: int | None = None):
    return b.load(element_ptr(b, base, offset, ty), typ=ty,
                  align=_ALIGN[str(ty)] if align is None else align)


def to_f32(b, raw, dtype):
    """Widen a loaded vector (or scalar) of dtype's storage type to f32 (exact)."""
    if dtype.name == "f32":
        return raw
    if isinstance(raw.type, ir.VectorType):
        f32, i32 = vec(F32, raw.type.count), vec(I32, raw.type.count)
    else:
        f32, i32 = F32, I32
    if dtype.name == "f16":
        return b.fpext(raw, f32)
    return b.bitcast(b.shl(b.zext(raw, i32), const(i32, 16)), f32)


def from_f32(b, value, dtype):
    """Narrow an f32 vector to dtype's storage type, rounding to nearest even."""
    if dtype.name == "f32":
        return value
    w = value.type.count
    if dtype.name == "f16":
        return b.fptrunc(value, vec(F16, w))
    vi = vec(I32, w)
    bits = b.bitcast(value, vi)
    lsb = b.and_(b.lshr(bits, const(vi, 16)), const(vi, 1))
    rounded = b.lshr(b.add(bits, b.add(lsb, const(vi, 0x7FFF))), const(vi, 16))
    quiet = b.or_(b.lshr(bits, const(vi, 16)), const(vi, 0x40))  # nan stays nan, quieted
    isnan = b.fcmp_unordered("uno", value, value)
    return b.trunc(b.select(isnan, quiet, rounded), vec(I16, w))


def load_f32(b, base, offset, dtype, w, count=None, halves=False):
    return to_f32(b, load_vec(b, base, offset, storage_type(dtype), w, count, halves=halves),
                  dtype)


def store_f32(b, value, base, offset, dtype, count=None, streaming=False):
    store_vec(b, from_f32(b, value, dtype), base, offset, count, streaming)


# Whole-vector non-temporal stores: with_streaming's stores are 16-byte pieces (numpy only
# promises 16-byte alignment), four stores and three extracts per 64-byte vector; where every
# block output is 64-byte aligned with a pitch of whole 64-byte lines (ops.norms allocates its
# large outputs so, torch aligns to 64) one store per vector does it: 4096 x 1024 f32 softmax,
# whose output pass is otherwise that store, 1.5 -> 1.3 ms.
WHOLE_BYTES = 64


def whole_or_pieces(b, blocks, streaming, body):
    """body("whole") behind a run-time check that every output is WHOLE_BYTES-aligned (when
    streaming and every pitch allows it), else body(streaming)."""
    if not streaming or any(pitch % WHOLE_BYTES for _, _, pitch in blocks):
        body(streaming)
        return
    aligned = all_aligned(b, [ptr for ptr, _, _ in blocks], WHOLE_BYTES)
    with b.if_else(aligned) as (then, otherwise):
        with then:
            body("whole")
        with otherwise:
            body(streaming)


def store_whole_nt(b, value, base, offset, dtype):
    """One non-temporal store of a whole vector of dtype's storage type (aligned to its size:
    64 bytes of f32, 32 of bf16, by whole_or_pieces' check; LLVM 22 still writes the bf16
    one as two 16-byte stores)."""
    ptr = element_ptr(b, base, offset, storage_type(dtype))
    size = value.type.count * dtype.itemsize
    flag = b.module.add_metadata([ir.Constant(I32, 1)])
    b.store(value, ptr, align=size).set_metadata("nontemporal", flag)


# ---------------------------------------------------------------- the kernel ABI
def new_kernel(symbol: str, n_pointers: int, n_scalars: int = 0):
    """A module with `void symbol(i64 ptr0, ..., i64 scalar0, ...)`, every pointer passed as an
    integer (the raw-pointer call path passes Python ints). Returns (module, builder, ptrs,
    scalars) with the builder in the entry block."""
    module = ir.Module(name=symbol)
    fnty = ir.FunctionType(ir.VoidType(), [I64] * (n_pointers + n_scalars))
    fn = ir.Function(module, fnty, name=symbol)
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ptrs = [b.inttoptr(a, PTR, name=f"p{k}") for k, a in enumerate(fn.args[:n_pointers])]
    return module, b, ptrs, list(fn.args[n_pointers:])


# ---------------------------------------------------------------- bitmasks
def load_bits(b, base, byte_offset, w: int, count: int | None = None):
    """Load the bits of w lanes (w a multiple of 8) as <w x i1>; a tail reads ceil(count/8) bytes."""
    nbytes = w // 8 if count is None else (count + 7) // 8
    raw = b.load(element_ptr(b, base, byte_offset, I8), typ=ir.IntType(8 * nbytes), align=1)
    if 8 * nbytes < w:
        raw = b.zext(raw, ir.IntType(w))
    return b.bitcast(raw, vec(I1, w))


def store_bits(b, bits, base, byte_offset, count: int | None = None):
    """Store <w x i1> as w/8 bytes; a tail stores ceil(count/8) bytes, unused bits cleared."""
    w = bits.type.count
    if count is not None and count < w:
        bits = b.and_(bits, lane_mask(w, count))
    nbytes = w // 8 if count is None else (count + 7) // 8
    raw = b.bitcast(bits, ir.IntType(w))
    if 8 * nbytes < w:
        raw = b.trunc(raw, ir.IntType(8 * nbytes))
    b.store(raw, element_ptr(b, base, byte_offset, I8), align=1)
