"""2-D convolution (NCHW, like torch.nn.functional.conv2d) from BRGEMM loop nests.

    y = ops.conv2d(x, w, bias, stride=2, padding=1, activation="relu")
    dx, dw, db = ops.conv2d_backward(dy, x, w, stride=2, padding=1, need=(True, True, True))

x (N, C, H, W), w (K, C/groups, R, S), bias (K,) numpy arrays or torch CPU tensors, f32, or
bf16 (f32 accumulation, bf16 results). Any stride, dilation and groups (depthwise included),
padding an int, a pair, a 4-tuple (top, bottom, left, right), "same" or "valid".

On a GPU: the same calls (and the blocked helpers below) take device arrays (torch CUDA
tensors, cupy, anything with `__cuda_array_interface__`) and return the input's kind on its
device: every step above runs as the same loop nest, dispatched to the device's backend by
tpp.runtime.loops.CompiledNest (the zeroed frames and accumulators by the zero TPP, the bias
gradient's row of ones copied to the device once per device). Operands on different devices
(x, weight, bias, dy, packed, xb): ArgumentError naming them. Device data must be
C-contiguous, except 2-D arrays and torch tensors (_host.contiguous).

Blocked chains (no per-layer conversion; ops.conv, not re-exported):
    xb = ops.conv.blocked(x, padding=1)                    # a BlockedActivation, framed
    pw = ops.conv.pack_weight(w, 1, tpp.F32)               # a BlockedWeight, packed once
    hb = ops.conv.conv2d_blocked(xb, pw, b, padding=1, activation="relu", out_padding=1)
    y = ops.conv.to_nchw(hb)                               # the output written in the next
                                                           # layer's zero frame, then NCHW
Layouts (the TPP way; every conversion is a nest of transpose / identity / vnni2 TPPs):
    activations  [N][G*Cb][Hp][Wp][bc]      (BlockedActivation; channels zero-padded to blocks
                                              of bc per group, the conv's zero padding stored)
    weights      [G*Kb][Cb][R][S][bc][bk]   (f32), [..][bc/2][2*bk] VNNI-2 pairs (bf16)
    outputs      [N][G*Kb][P][Q][bk]
with bc, bk = min(64, channels per group) (even for bf16). The padding is physical: the
NCHW -> blocked conversion writes the image inside a zeroed [Hp][Wp] frame, so converting is
the one copy per call and no tap ever reads outside the image (no border special cases).

Forward nest: parallel over (n, output-channel block, output row p), then blocks of output
pixels q; for each tap (r, s) one BRGEMM of (pixels x bc) @ (bc x bk) batch-reduced over the
input-channel blocks of the group (stride batch: stride_a = Hp*Wp*bc, stride_b = R*S*bc*bk),
lda = stride*bc (strided pixels are read in place). The first tap writes C (beta 0), the
others add (beta 1), and the last applies bias and activation in the BRGEMM epilogue (fewer
input blocks than kernel columns, 3x3 64 and 128: one BRGEMM per block and kernel row whose
batch is the row's taps, stride_a = dilation*bc; 2-7% faster at one thread). bf16
accumulates the taps in an f32 tile and rounds it once (an identity TPP). An NCHW output is
written by the nest too, each finished tile transposed into it while in cache
(conv_layout.write_nchw); the blocked output is kept only for chains (conv2d_blocked).
Host data with a weight slice per output block (all its input blocks and taps) over
conv_chunks.WEIGHT_SLICE_BYTES sums the input blocks in chunks (WEIGHT_CHUNK_BYTES), an
outermost sequential loop: every tile of a chunk before the next chunk, so that a chunk's
weights stay in the L2 cache while the rows and images reuse them (3x3 512 @7 f32: 1.18 MB
per output block, 8 chunks; the forward 385 -> ~500 GFLOP/s at 2 cores). The data
gradient's nest does the same.

Backward data: the transposed convolution, as the same forward nest on dy scattered into a
zeroed frame (stride-1 positions spaced by the stride, a border of dilation*(R-1)), with the
weights flipped and transposed (packed by a nest); the result is the gradient of the padded
input, cropped by the conversion back to NCHW (device data). Host data instead runs
stride**2 stride-1 sub-convolutions, one per phase of the input pixels, for the unpadded
pixels only (ops.conv_strided: the zero-spread form does stride**2 times the multiply-adds,
and at stride 1 computes the padding too: 512 @7, 81 pixels for 49).
Backward weight (ops.conv_dw): per (output block, input block, tap) a BRGEMM dy^T @ x over
the output pixels of one row (trans_a), batch-reduced over a run of output rows, summed over
the runs and the batch (bf16 host data: x^T @ dy with dy in VNNI pairs of pixels, on
vdpbf16ps).
Backward bias: a BRGEMM of a ones row by dy, batch-reduced over the images (host data: a row
sum of dy as it is). At most 4 input channels per group (the stem, depthwise; host data):
the forward and weight gradient fold a kernel row's taps into one BRGEMM (ops.conv_taps;
bf16: the data and weight gradients on vdpbf16ps, the forward without channel padding). The
data gradient's packed weight is made from the forward's when that is at hand (turning its
blocks is faster than packing w afresh: conv_layout.pack_transposed).

1x1 layers (no padding, groups 1, f32 or bf16, host data; strided ones on their selected
pixels, ops.conv_subsample) run as GEMMs on the NCHW arrays as they are (ops.conv_pointwise;
no conversion, no packing; a forward given packed= only for images of at least 90% whole
16-pixel vectors, a data gradient only for images of more than 256 output pixels, smaller
ones taking the blocked data gradient: see conv_pointwise.eligible). Other packed= / xb= are
checked, then unused.

Compilation: one nest per layer shape (channels, kernel, stride, padding, dilation, groups,
spatial size, dtype, bias, activation); the batch size N is a runtime size (tpp.size), so a
new batch size compiles nothing. The spatial size is fixed per nest: the NCHW <-> blocked
transposes have leading dimensions H*W, and a kernel's leading dimensions are compile-time.
"""
from __future__ import annotations

import functools

import numpy as np

import tpp
from tpp.runtime import arrays, registry
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.brgemm_spec import ACTIVATIONS
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import LRU, also_clear

from . import _host
from . import conv_pointwise as _pointwise
from . import conv_dw as _dwv
from . import conv_strided as _strided
from . import conv_taps as _taps
from .conv_layout import (  # noqa: F401  (public: BlockedActivation, pack_weight, ...)
    BLOCK, PIXELS, _SERIAL_FLOPS, Geometry, block, _pair, _padding, geometry,
    BlockedActivation, BlockedWeight, _threads, _block_cases, _to_blocked_nest,
    _from_blocked_nest, _weight_rows_nest, _weight_blocks_nest, _vector_nest, to_blocked,
    from_blocked, pack_weight, pack_transposed, transpose_packed, _pad_bias, _size,
    nchw_output, write_nchw, _dw_out_nest, _check_xb
)
from .conv_chunks import chunk_cases, weight_chunks


# The forward writes an NCHW output from its nest, each tile transposed while in cache, instead
# of leaving the blocked output to from_blocked (batch 4, 2 Zen 4 cores, paired: the stem
# f32/bf16 5-6% faster, the 3x3 and 1x1 layers 0-4%)
NCHW_IN_NEST = True


# ------------------------------------------------------------------ the convolution nest
@functools.lru_cache(maxsize=256)
def _conv_nest(groups, cb, kb, bc, bk, hp, wp, r, s, sh, sw, dh, dw, p, q, dtype,
               has_bias, activation, frame=(0, 0, 0, 0), fold=True, kg=None, chunked=True):
    """yb (N, groups*kb, p, q, bk) = act(conv(xb (N, groups*cb, hp, wp, bc), wb) + bias),
    written inside a frame (top, bottom, left, right) of yb that the nest leaves alone; with
    kg (output channels per group), each finished tile also goes to the NCHW y (N,
    groups*kg, p*q) (conv_layout.write_nchw). chunked: a large weight slice is summed in
    chunks (ops.conv_chunks; for a CPU's L2 cache: False for device data)."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    bq = min(q, PIXELS)
    full, tail = divmod(q, bq)
    # fewer input blocks than kernel columns: per (input block, kernel row) a BRGEMM whose
    # batch is the row's taps (A and B strides uniform in j); else per tap, over the blocks
    fold = fold and 1 < s and cb < s
    # a large weight slice is summed over in chunks of input blocks, each chunk's pass over
    # every tile finished before the next (ops.conv_chunks)
    chunks = weight_chunks(cb, r * s * bc * bk * dtype.itemsize) if chunked and not fold else 1
    # the pixel-block loop is parallel too where there is one row (a flattened 1x1 layer)
    order = ("ABCDE" if p == 1 else "ABCDe") if chunks == 1 else \
        ("fABCDE" if p == 1 else "fABCDe")
    nest = tpp.LoopNest(order, a=n, b=groups, c=kb, d=p, e=full + (tail > 0),
                        **({"f": chunks} if chunks > 1 else {}))
    a, g, k, c, d = nest.vars[:5]
    f = nest.vars[5] if chunks > 1 else 0
    cs = cb // chunks
    b = g * kb + k
    xb = nest.tensor("xb", (n, groups * cb, hp, wp, bc), dtype)
    wshape = (groups * kb, cb, r, s) + ((bc // 2, 2 * bk) if vnni else (bc, bk))
    wb = nest.tensor("wb", wshape, dtype)
    acc_dt = _dt.F32
    bias_t = nest.tensor("bias", (groups * kb * bk,), acc_dt) if has_bias else None
    ft, fb, fl, fr = frame
    yb = nest.tensor("yb", (n, groups * kb, p + ft + fb, q + fl + fr, bk), dtype)
    staged = _staged(dtype, has_bias, r, s)
    acc = nest.tensor("acc", (n, groups * kb, p, q, bk), acc_dt) if staged else yb
    y = None if kg is None else nchw_output(nest, kg, groups, p, q, dtype)
    ah, aw = (0, 0) if staged else (ft, fl)
    cases = ([(bq, (d < full,) if tail else ())] if full else []) + \
        ([(tail, (d == full,))] if tail else [])
    taps = [(u, i, 0) for u in range(cb) for i in range(r)] if fold else \
        [(0, i, j) for i in range(r) for j in range(s)]
    batch = (s, dw * bc, bc * bk) if fold else (cs, hp * wp * bc, r * s * bc * bk)
    x_block = g * cb + f * cs
    for pixels, when in cases:
        for fwhen, first_chunk, last_chunk in chunk_cases(f, chunks):
            for t, (u, i, j) in enumerate(taps):
                last = t == len(taps) - 1 and last_chunk
                spec = tpp.make_brgemm(
                    pixels, bk, bc, lda=sw * bc, ldb=2 * bk if vnni else bk, ldc=bk,
                    dtype_a=dtype, dtype_b=dtype, dtype_c=acc_dt if staged else dtype,
                    beta=0 if (t == 0 and first_chunk) else 1,
                    vnni_b=vnni, bias="row" if (has_bias and last) else None,
                    activation=activation if last else None)
                nest.call(spec, xb[a, x_block + u, c * sh + i * dh, d * bq * sw + j * dw],
                          wb[b, f * cs + u, i, j], acc[a, b, ah + c, aw + d * bq],
                          bias=bias_t[b * bk] if (has_bias and last) else None,
                          count=batch[0], stride_a=batch[1], stride_b=batch[2],
                          when=when + fwhen)
        lwhen = when + chunk_cases(f, chunks)[-1][0]     # the tile is finished
        if staged:
            spec = tpp.make_unary("identity", pixels, bk, dtype_in=acc_dt, dtype_out=dtype)
            nest.call(spec, acc[a, b, c, d * bq], yb[a, b, ft + c, fl + d * bq], when=lwhen)
        if y is not None:
            write_nchw(nest, y, yb[a, b, ft + c, fl + d * bq], y[a, g * kg + k * bk,
                       c * q + d * bq], pixels, k, kb, kg, bk, lwhen)
    return nest.compile()


def _staged(dtype, has_bias, r, s) -> bool:
    """Whether _conv_nest sums a bf16 tile in an f32 accumulator (acc) and rounds it once: when
    several BRGEMM calls add to it (taps) or an f32 bias row joins it. A 1x1 bias-free tile is
    one call, rounded straight from the BRGEMM."""
    return dtype == _dt.BF16 and (r * s > 1 or has_bias)


def _run_conv(args, hp, wp, r, s, sh, sw, p, q, frame, make):
    """make(hp, wp, p, q) called on args (xb, wb[, bias], yb[, acc]). A 1x1 stride-1 layer
    on whole images (no padding, no output frame) runs as one row of hp*wp pixels: its pixel
    blocks span image rows (full BRGEMMs, a parallel pixel loop)."""
    if (r, s, sh, sw, hp, wp, tuple(frame)) == (1, 1, 1, 1, p, q, (0, 0, 0, 0)) and p > 1:
        args = [a if len(a.shape) != 5 else
                _host.reshape(a, (a.shape[0], a.shape[1], 1, p * q, a.shape[4]))
                for a in args]
        hp, wp, p, q = 1, p * q, 1, p * q
    return make(hp, wp, p, q), args


for _nest_cache in (_to_blocked_nest, _from_blocked_nest, _weight_rows_nest,
                    _weight_blocks_nest, _vector_nest, _conv_nest, _dw_out_nest):
    also_clear(_nest_cache.cache_clear)     # tpp.clear_caches() empties them too


@functools.lru_cache(maxsize=None)
def _ones(n, dtype):
    ones = _host.zeros((n,), dtype, None)
    ones[:] = 1
    ones.flags.writeable = False
    return ones


_DEVICE_ONES = LRU(16, "device_conv_ones")  # (Device, n, DType, torch?) -> n ones there


def _ones_like(n, dtype, like):
    """n ones of dtype where `like` lives (the host's cached array; on a device a copy made
    there once per device, dtype and kind, then reused, like _host.constant)."""
    if not _host.on_device(like):
        return _ones(n, dtype)
    where, torch_kind = _host.device_of(like), arrays.is_torch(like)
    key = (where, n, dtype, torch_kind)
    ones = _DEVICE_ONES.get(key)
    if ones is None:
        ones = _DEVICE_ONES[key] = registry.for_device(where).to_device(
            _ones(n, dtype), where, torch_kind)
    return ones


# ------------------------------------------------------------------ checks
def _inputs(x, w, bias, name_x="x", dy=None):
    """x, w (C-contiguous), bias and dy after the checks: numpy / CPU torch, or all on one
    device (ArgumentError naming a mix)."""
    x = _host.host(x, name_x, device=True)
    w = _host.host(w, "weight", device=True)
    if bias is not None:
        bias = _host.host(bias, "bias", device=True)
    if dy is not None:
        dy = _host.host(dy, "dy", device=True)
    if not (_on_host(x) and _on_host(w) and _on_host(bias) and _on_host(dy)):
        _host.same_device(**{name_x: x, "weight": w, "bias": bias, "dy": dy})
    dt = _host.dtype_of(x, name_x)
    if dt not in (_dt.F32, _dt.BF16):
        raise ArgumentError(f"{name_x}: conv2d takes f32 or bf16 data, got {dt}")
    if _host.dtype_of(w, "weight") != dt:
        raise ArgumentError(f"the weight is {w.dtype} but {name_x} is {x.dtype}; use one dtype")
    if arrays.is_torch(x) != arrays.is_torch(w):
        raise ArgumentError(f"{name_x} and the weight must both be numpy arrays or both torch "
                            f"tensors")
    if bias is not None and _host.dtype_of(bias, "bias") not in (_dt.F32, dt):
        raise ArgumentError(f"bias: expected {dt} or f32, got {bias.dtype}")
    if dy is not None:
        return _host.contiguous(x), _host.contiguous(w), bias, _host.contiguous(dy)
    return _host.contiguous(x), _host.contiguous(w), bias


_NDARRAY = np.ndarray


def _on_host(a) -> bool:
    """Whether a (as _host.host(..., device=True) returned it, or None) is host data: numpy
    and CPU tensors answer at once."""
    return a is None or type(a) is _NDARRAY or not _host.on_device(a)


# ------------------------------------------------------------------ forward
def conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
           activation=None, packed=None, **unknown):
    """act(conv2d(x, weight) + bias) like torch.nn.functional.conv2d: x (N, C, H, W), weight
    (K, C/groups, R, S), bias (K,) or None; returns (N, K, P, Q) of x's kind and dtype.
    packed: pack_weight(weight, groups, dtype) made earlier (reused: nothing is packed)."""
    if unknown:
        _host.reject_unknown(conv2d, unknown)
    return _conv2d(x, weight, bias, stride, padding, dilation, groups, activation, packed)[0]


def _conv2d(x, weight, bias, stride, padding, dilation, groups, activation, packed,
            pack=None):
    """(y, xb, wb): conv2d's output, the BlockedActivation of x and the packed weight it read
    (a backward reuses them; both None on ops.conv_pointwise's GEMMs). pack: instead of
    packed, a function returning the packed weight, called only where the blocked nest runs
    (Conv2d's cache: a layer whose forward is GEMMs is never packed)."""
    x, weight, bias = _inputs(x, weight, bias)
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dt = _host.dtype_of(x, "x")
    geo = geometry(tuple(x.shape), tuple(weight.shape), dt, stride, padding, dilation, groups)
    if bias is not None and tuple(bias.shape) != (geo.k,):
        raise ArgumentError(f"bias: expected shape ({geo.k},), got {tuple(bias.shape)}")
    packed = _check_packed(packed, weight, geo, False)
    # GEMMs (packed unused), but a packed weight is used for images that fill the GEMM's
    # vectors badly (eligible): without one, packing costs more than the blocked forward saves
    if _pointwise_layer(geo, x, weight, bias, forward=packed is not None or pack is not None):
        return _pointwise.forward(x, weight, bias, activation, geo), None, None
    if pack is not None:
        packed = _check_packed(pack(), weight, geo, False)
    wb = packed or pack_weight(weight, geo.groups, dt)
    xb = to_blocked(x, geo)
    return _forward(xb.data, wb.data, bias, geo, activation, x), xb, wb


def _pointwise_layer(geo, *arrays_, forward=False, data_grad=False) -> bool:
    """Whether ops.conv_pointwise serves this layer's forward (or weight and bias gradients;
    with data_grad, its data gradient): a 1x1 (any stride), unpadded, ungrouped f32 or bf16
    layer on host data (numpy / CPU torch; device data takes the blocked path); see
    conv_pointwise.eligible."""
    return _pointwise.eligible(geo, forward, data_grad) and all(_on_host(a) for a in arrays_)


def serves_pointwise(x, weight, stride=1, padding=0, dilation=1, groups=1, *,
                     forward=True) -> bool:
    """Whether conv2d (forward) / conv2d_backward's data gradient (forward=False) run this
    layer on ops.conv_pointwise's GEMMs (so a packed weight would go unused); False for
    arguments they would reject."""
    try:
        geo = geometry(tuple(x.shape), tuple(weight.shape), _host.dtype_of(x, "x"), stride,
                       padding, dilation, groups)
    except (ArgumentError, TypeError, ValueError):
        return False
    return _pointwise_layer(geo, _host.host(x, "x", device=True),
                            _host.host(weight, "weight", device=True), forward=forward,
                            data_grad=not forward)


def _check_packed(packed, weight, geo, transposed):
    """packed if it is a BlockedWeight of this weight's shape, groups, dtype and use; None
    when packed is None; else an ArgumentError."""
    if packed is None:
        return None
    if isinstance(packed, BlockedWeight) and not (_on_host(weight) and _on_host(packed.data)):
        _host.same_device(weight=weight, packed=packed.data)
    if (not isinstance(packed, BlockedWeight) or packed.shape != tuple(weight.shape)
            or packed.groups != geo.groups or packed.transposed != transposed
            or _host.dtype_of(packed.data, "packed") != geo.dtype):
        raise ArgumentError(f"packed: expected pack_weight(weight, {geo.groups}, {geo.dtype}"
                            f"{', transposed=True' if transposed else ''}) of the weight "
                            f"{tuple(weight.shape)}, got {packed!r}")
    return packed


def _forward(xb, wb, bias, geo, activation, like, frame=None):
    """y (N, K, P, Q) of like's kind; with frame (top, bottom, left, right), the blocked
    output (N, G*Kb, P + top + bottom, Q + left + right, bk) with a zero frame instead."""
    n = xb.shape[0]
    bc, bk = geo.bc, geo.bk
    cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
    p, q = geo.p, geo.q
    ft, fb, fl, fr = frame or (0, 0, 0, 0)
    yshape = (n, geo.groups * kb, p + ft + fb, q + fl + fr, bk)
    if frame is not None:
        y = yb = _host.zeros(yshape, geo.dtype, like)
    else:
        y = _host.empty((n, geo.k, p, q), geo.dtype, like)
        yb = _host.empty(yshape, geo.dtype, like)
    if n == 0:
        return y
    args = [xb, wb]
    if bias is not None:
        args.append(_pad_bias(bias, geo.groups, geo.kg, bk, like))
    args.append(yb)
    taps = _taps.eligible(cb, bc, geo.s, geo.dilation[1]) and _on_host(like)    # the stem
    # bf16 tiles summed over several BRGEMM calls go through an f32 accumulator (the taps
    # nest's one call per tile only with a bias, see conv_taps.conv_nest)
    if (_taps.staged_tiles(geo.dtype, bias is not None) if taps else
            _staged(geo.dtype, bias is not None, geo.r, geo.s)):
        args.append(_host.empty((n, geo.groups * kb, p, q, bk), _dt.F32, like))
    fr = tuple(frame or (0, 0, 0, 0))
    # an NCHW output is written by the nest itself, tile by tile (conv_layout.write_nchw)
    kg = None if frame is not None or not NCHW_IN_NEST else geo.kg
    if taps:
        args[0], args[1], depth = _taps.operands(xb, wb, geo, q)
        nest = _taps.conv_nest(geo.groups, kb, bc, bk, geo.hp, geo.r, geo.s, geo.stride[0],
                               geo.dilation[0], p, q, geo.dtype, bias is not None,
                               activation, fr, kg, depth)
    else:
        nest, args = _run_conv(
            args, geo.hp, geo.wp, geo.r, geo.s, geo.stride[0], geo.stride[1], p, q, fr,
            lambda hp, wp, p_, q_: _conv_nest(
                geo.groups, cb, kb, bc, bk, hp, wp, geo.r, geo.s, geo.stride[0],
                geo.stride[1], geo.dilation[0], geo.dilation[1], p_, q_, geo.dtype,
                bias is not None, activation, fr, kg=kg, chunked=_on_host(like)))
    if kg is not None:
        args.append(_host.reshape(y, (n, geo.k, p * q)))
    nest(*args, threads=_threads(geo.flops(n)))
    if frame is None and kg is None:
        from_blocked(yb, geo.k, geo.groups, bk, p, q, y)
    return y


# ------------------------------------------------------------------ backward
def conv2d_backward(dy, x, weight, *, stride=1, padding=0, dilation=1, groups=1,
                    need=(True, True, True), packed=None, xb=None, **unknown):
    """Gradients of y = conv2d(x, weight, bias) (no activation) given dy (N, K, P, Q):
    (dx, dweight, dbias), each None where `need` says so. dbias is f32 for f32 data and
    bf16 for bf16 (like torch), summed in f32. packed: pack_weight(weight, groups, dtype,
    transposed=True) made earlier; xb: the BlockedActivation of x the forward read (its
    frame this layer's padding): each is then not made again."""
    if unknown:
        _host.reject_unknown(conv2d_backward, unknown)
    x, weight, _, dy = _inputs(x, weight, None, dy=dy)
    dt = _host.dtype_of(x, "x")
    if _host.dtype_of(dy, "dy") != dt:
        raise ArgumentError(f"dy is {dy.dtype} but x is {x.dtype}; use one dtype")
    if not (isinstance(need, (tuple, list)) and len(need) == 3):
        raise ArgumentError(f"need: expected three booleans (dx, dweight, dbias), got {need!r}")
    geo = geometry(tuple(x.shape), tuple(weight.shape), dt, stride, padding, dilation, groups)
    n = x.shape[0]
    if tuple(dy.shape) != (n, geo.k, geo.p, geo.q):
        raise ArgumentError(f"dy: expected shape {(n, geo.k, geo.p, geo.q)}, got "
                            f"{tuple(dy.shape)}")
    need_dx, need_dw, need_db = (bool(v) for v in need)
    packed = _check_packed(packed, weight, geo, True) if need_dx else None
    if need_dw and xb is not None:
        xb = _check_xb(xb, x, geo)
    dx = dw = db = None
    if _pointwise_layer(geo, x, weight, dy):    # GEMMs on NCHW (xb: unused)
        if need_dx and _pointwise_layer(geo, data_grad=True):   # packed: unused too
            dx = _pointwise.data_grad(dy, weight, geo)
        elif need_dx:       # small images: the blocked data gradient
            dx = _host_data_grad(dy, weight, geo, x, packed)
        return (dx,
                _pointwise.convert(_pointwise.weight_grad(dy, x, geo), dt) if need_dw else None,
                _pointwise.convert(_pointwise.bias_grad(dy, geo), dt) if need_db else None)
    # dy in the output layout (its blocks are the data gradient's input blocks)
    dgeo = Geometry(geo.k, geo.c, geo.p, geo.q, geo.r, geo.s, geo.groups, (1, 1),
                    (0, 0, 0, 0), geo.dilation, dt)
    if need_dx and _on_host(x):
        dx = _host_data_grad(dy, weight, geo, x, packed)
        need_dx = False
    if need_dx:
        # the gradient of the padded input: dy scattered (stride), framed by dil*(R-1)
        eh, ew = geo.dilation[0] * (geo.r - 1), geo.dilation[1] * (geo.s - 1)
        frame = (geo.hp + eh, geo.wp + ew)
        dyb = to_blocked(dy, dgeo, scatter=geo.stride, frame=frame, origin=(eh, ew))
        tgeo = Geometry(geo.k, geo.c, frame[0], frame[1], geo.r, geo.s, geo.groups, (1, 1),
                        (0, 0, 0, 0), geo.dilation, dt)
        # tgeo.p, tgeo.q == geo.hp, geo.wp
        wbt = packed or pack_weight(weight, geo.groups, dt, transposed=True)
        dxp = _conv_padded(dyb.data, wbt.data, tgeo, geo, x)
        dx = _host.empty(tuple(x.shape), dt, x)
        from_blocked(dxp, geo.c, geo.groups, geo.bc, geo.h, geo.w, dx,
                     origin=(geo.pad[0], geo.pad[2]))
    host = _on_host(x)
    taps = host and _taps.serves(geo)   # few input channels (the stem): ops.conv_taps
    dot_taps = taps and _taps.dot_dy(geo)     # whose bf16 weight gradient reads dy as it is
    if (need_dw and not dot_taps) or (need_db and not host):
        dyb0 = to_blocked(dy, dgeo).data
    if need_dw:
        xb = to_blocked(x, geo).data if xb is None else xb.data
        bc, bk = geo.bc, geo.bk
        cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
        if _dwv.serves(geo, host) and not taps:     # bf16: the dot instruction
            dw = _dwv.weight_grad(xb, dyb0, geo, n, x)
        elif n and taps:
            dwt = _taps.weight_grad(xb, None if dot_taps else dyb0, geo, x, dy)
        else:
            dwt = (_host.empty if n else _host.zeros)(
                (geo.groups, kb * bk, geo.r * geo.s, cb * bc), _dt.F32, x)
        if n and not taps and dw is None:
            _dwv.brgemm_nest(geo.groups, cb, kb, bc, bk, geo.hp, geo.wp, geo.r, geo.s,
                             geo.stride[0], geo.stride[1], geo.dilation[0], geo.dilation[1],
                             geo.p, geo.q, dt)(xb, dyb0, dwt, threads=_threads(geo.flops(n)))
    if need_dw and dw is None:
        dw = _host.empty(tuple(weight.shape), dt, x)
        _dw_out_nest(geo.groups, geo.kg, geo.cg, kb * bk, cb * bc, geo.r * geo.s, dt)(
            *([dwt, _host.reshape(dw, (geo.k, geo.cg, geo.r * geo.s))] +
              ([_host.empty(tuple(dwt.shape), dt, x)] if dt != _dt.F32 else [])),
            threads=_threads(64 * _size(dwt)))
    if need_db and host:    # a row sum of dy as it is (NCHW), no blocked copy
        db = _pointwise.convert(_pointwise.bias_grad(
            dy, Geometry(1, geo.k, geo.p, geo.q, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), dt)), dt)
    elif need_db:
        bk = geo.bk
        kbt = geo.groups * -(-geo.kg // bk)
        dbp = _host.zeros((kbt * bk,), _dt.F32, x)
        pq = geo.p * geo.q
        if n:
            _dwv.bias_nest(kbt, bk, pq, dt)(_ones_like(pq, dt, x),
                                            _host.reshape(dyb0, (n, kbt, pq, bk)), dbp,
                                            threads=_threads(2.0 * _size(dy)))
        db = _host.empty((geo.k,), dt, x)
        _vector_nest(geo.groups, geo.kg, kbt // geo.groups * bk, _dt.F32, dt, False)(
            dbp, db, threads=1)
    return dx, dw, db


def _host_data_grad(dy, weight, geo, x, packed):
    """dx of host data: stride**2 stride-1 sub-convolutions, one per phase (ops.conv_strided),
    with packed (or the weight packed here) or, for few channels (the stem), pixels as the
    GEMM columns."""
    if _strided.small(geo):
        return _strided.data_grad_small(dy, weight, geo, x)
    wbt = packed or pack_weight(weight, geo.groups, geo.dtype, transposed=True)
    return _strided.data_grad(dy, wbt.data, geo, x)


def _conv_padded(dyb, wbt, tgeo, geo, like):
    """The blocked gradient of the padded input (N, G*Cb, hp, wp, bc)."""
    n = dyb.shape[0]
    bc_in, bk_out = tgeo.bc, tgeo.bk      # dy's blocks (= geo.bk), dx's blocks (= geo.bc)
    cb, kb = -(-tgeo.cg // bc_in), -(-tgeo.kg // bk_out)
    yb = _host.empty((n, geo.groups * kb, tgeo.p, tgeo.q, bk_out), geo.dtype, like)
    if n == 0:
        return yb
    args = [dyb, wbt, yb]
    if _staged(geo.dtype, False, geo.r, geo.s):
        args.append(_host.empty(tuple(yb.shape), _dt.F32, like))
    nest, args = _run_conv(
        args, tgeo.hp, tgeo.wp, geo.r, geo.s, 1, 1, tgeo.p, tgeo.q, (0, 0, 0, 0),
        lambda hp, wp, p_, q_: _conv_nest(
            geo.groups, cb, kb, bc_in, bk_out, hp, wp, geo.r, geo.s, 1, 1, geo.dilation[0],
            geo.dilation[1], p_, q_, geo.dtype, False, None, chunked=_on_host(like)))
    nest(*args, threads=_threads(tgeo.flops(n)))
    return yb


# ------------------------------------------------------------------ blocked chains
def conv2d_blocked(xb, weight, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
                   activation=None, out_padding=0, **unknown) -> BlockedActivation:
    """conv2d on a BlockedActivation (from to_blocked, or a previous conv2d_blocked) whose
    stored frame is this layer's padding; weight (K, C/groups, R, S) or a BlockedWeight from
    pack_weight (packed once, reused). Returns the output blocked, inside a zero frame of
    out_padding (the next layer's padding): a network keeps its activations blocked, and
    converts with to_nchw at the end. No copy per layer."""
    if unknown:
        _host.reject_unknown(conv2d_blocked, unknown)
    if not isinstance(xb, BlockedActivation):
        raise ArgumentError(f"xb: expected an ops.conv.BlockedActivation, got "
                            f"{type(xb).__name__}")
    if isinstance(weight, BlockedWeight):
        packed, wshape = weight, weight.shape
        if weight.transposed or weight.groups != groups:
            raise ArgumentError("weight: a BlockedWeight packed for another use")
        dt = _host.dtype_of(weight.data, "weight")
    else:
        weight = _host.contiguous(_host.host(weight, "weight", device=True))
        wshape, dt, packed = tuple(weight.shape), _host.dtype_of(weight, "weight"), None
    if _host.dtype_of(xb.data, "xb") != dt or dt not in (_dt.F32, _dt.BF16):
        raise ArgumentError(f"xb is {xb.data.dtype} and the weight {dt}: one dtype, f32 or "
                            f"bf16")
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    geo = geometry((xb.n, xb.channels, xb.h, xb.w), wshape, dt, stride, padding, dilation,
                   groups)
    if geo.pad != tuple(xb.pad) or geo.bc != xb.bc or xb.groups != geo.groups:
        raise ArgumentError(f"xb is stored with the frame {xb.pad}, blocks of {xb.bc} and "
                            f"groups={xb.groups}; this layer reads {geo.pad}, {geo.bc}, "
                            f"{geo.groups} (convert with to_blocked)")
    if bias is not None:
        bias = _host.host(bias, "bias", device=True)
        if tuple(bias.shape) != (geo.k,):
            raise ArgumentError(f"bias: expected shape ({geo.k},), got {tuple(bias.shape)}")
    wdata = packed.data if packed is not None else weight
    if not (_on_host(xb.data) and _on_host(wdata) and _on_host(bias)):
        _host.same_device(xb=xb.data, weight=wdata, bias=bias)
    if packed is None:
        packed = pack_weight(weight, geo.groups, dt)
    frame = _padding(out_padding, 1, 1, (1, 1), (1, 1))
    data = _forward(xb.data, packed.data, bias, geo, activation, xb.data, frame=frame)
    return BlockedActivation(data, geo.k, geo.p, geo.q, geo.groups, geo.bk, frame)


def to_nchw(xb: BlockedActivation):
    """The (N, C, H, W) array a BlockedActivation holds (its frame and padded channels
    dropped)."""
    if not isinstance(xb, BlockedActivation):
        raise ArgumentError(f"expected an ops.conv.BlockedActivation, got {type(xb).__name__}")
    dt = _host.dtype_of(xb.data, "xb")
    out = _host.empty((xb.n, xb.channels, xb.h, xb.w), dt, xb.data)
    return from_blocked(xb.data, xb.channels, xb.groups, xb.bc, xb.h, xb.w, out,
                        origin=(xb.pad[0], xb.pad[2]))


def blocked(x, *, padding=0, groups=1, **unknown) -> BlockedActivation:
    """x (N, C, H, W) as a BlockedActivation framed for a layer of this padding (an int, a
    pair or a 4-tuple) and groups."""
    if unknown:
        _host.reject_unknown(blocked, unknown)
    x = _host.contiguous(_host.host(x, "x", device=True))
    dt = _host.dtype_of(x, "x")
    if dt not in (_dt.F32, _dt.BF16):
        raise ArgumentError(f"x: f32 or bf16, got {dt}")
    shape = tuple(x.shape)
    if len(shape) != 4 or shape[1] % max(1, checks.as_int(groups) or 1):
        raise ArgumentError(f"x: expected (N, C, H, W) with C divisible by groups, got {shape}")
    c = shape[1]
    geo = geometry(shape, (c, c // groups, 1, 1), dt, 1, padding, 1, groups)
    return to_blocked(x, geo)
