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

Modules: the forward nest and the step running it (ops.conv_forward), a Conv2d module's
remembered forward (ops.conv_memo), layouts and packing (ops.conv_layout), the weight
gradient (ops.conv_dw), 1x1 GEMMs (ops.conv_pointwise), the folded taps (ops.conv_taps).

Compilation: one nest per layer shape (channels, kernel, stride, padding, dilation, groups,
spatial size, dtype, bias, activation); the batch size N is a runtime size (tpp.size), so a
new batch size compiles nothing. The spatial size is fixed per nest: the NCHW <-> blocked
transposes have leading dimensions H*W, and a kernel's leading dimensions are compile-time.
"""
from __future__ import annotations

import numpy as np

from tpp.runtime import arrays
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.brgemm_spec import ACTIVATIONS
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear

from . import _host
from . import conv_pointwise as _pointwise
from . import conv_dw as _dwv
from . import conv_strided as _strided
from . import conv_taps as _taps
from . import conv_memo as _memo
from .conv_forward import _ForwardStep, _conv_nest, _run_conv, _staged
from .conv_layout import (  # noqa: F401  (public: BlockedActivation, pack_weight, ...)
    Geometry, _padding, geometry, BlockedActivation, BlockedWeight, _threads,
    _to_blocked_nest, _from_blocked_nest, _weight_rows_nest, _weight_blocks_nest,
    _vector_nest, to_blocked, to_blocked_step, from_blocked, pack_weight, pack_transposed,
    transpose_packed, _size, _check_xb
)


for _nest_cache in (_to_blocked_nest, _from_blocked_nest, _weight_rows_nest,
                    _weight_blocks_nest, _vector_nest):
    also_clear(_nest_cache.cache_clear)     # tpp.clear_caches() empties them too


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
            pack=None, memo=None):
    """(y, xb, wb): conv2d's output, the BlockedActivation of x and the packed weight it read
    (a backward reuses them; both None on ops.conv_pointwise's GEMMs). pack: instead of
    packed, a function returning the packed weight, called only where the blocked nest runs
    (Conv2d's cache: a layer whose forward is GEMMs is never packed). memo: a caller's
    conv_memo.ForwardMemo, which a call of the signature it remembers runs straight from."""
    key = None
    if memo is not None:
        key = _memo.signature(x, weight, bias, (stride, padding, dilation, groups), activation,
                              packed is not None or pack is not None)
        run = memo.lookup(key)
        if run is not None:
            return run(x, weight, bias, packed, pack)
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
        run = _PointwiseRun(geo, activation)
    else:
        n = x.shape[0]
        run = _BlockedRun(geo, to_blocked_step(n, geo), _ForwardStep(
            n, geo, bias is not None, activation, None, _on_host(x)))
    if memo is not None:
        memo.remember(key, run)
    return run(x, weight, bias, packed, pack)


class _PointwiseRun:
    """_conv2d's forward on ops.conv_pointwise's GEMMs, for one layer and activation."""
    __slots__ = ("geo", "activation")

    def __init__(self, geo, activation):
        self.geo, self.activation = geo, activation

    def __call__(self, x, weight, bias, packed, pack):
        _check_packed(packed, weight, self.geo, False)      # checked, then unused
        return _pointwise.forward(x, weight, bias, self.activation, self.geo), None, None


class _BlockedRun:
    """_conv2d's blocked forward: x converted (conv_layout.ToBlocked), the weight packed (or
    the packed one checked), the forward nest run (conv_forward._ForwardStep)."""
    __slots__ = ("geo", "to_blocked", "forward")

    def __init__(self, geo, to_blocked_, forward):
        self.geo, self.to_blocked, self.forward = geo, to_blocked_, forward

    def __call__(self, x, weight, bias, packed, pack):
        packed = _check_packed(pack() if pack is not None else packed, weight, self.geo, False)
        wb = packed or pack_weight(weight, self.geo.groups, self.geo.dtype)
        xb = self.to_blocked(x)
        return self.forward(xb.data, wb.data, bias, x), xb, wb


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
        got = (f"a packed weight of {packed.shape}, groups {packed.groups}"
               f"{', transposed' if packed.transposed else ''}, "
               f"{_host.dtype_of(packed.data, 'packed')}" if isinstance(packed, BlockedWeight)
               else type(packed).__name__)
        raise ArgumentError(f"packed: expected pack_weight(weight, {geo.groups}, {geo.dtype}"
                            f"{', transposed=True' if transposed else ''}) of the weight "
                            f"{tuple(weight.shape)}, got {got}")
    return packed


def _forward(xb, wb, bias, geo, activation, like, frame=None):
    """y (N, K, P, Q) of like's kind; with frame (top, bottom, left, right), the blocked
    output (N, G*Kb, P + top + bottom, Q + left + right, bk) with a zero frame instead."""
    step = _ForwardStep(xb.shape[0], geo, bias is not None, activation, frame, _on_host(like))
    return step(xb, wb, bias, like)


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
        dyb0 = to_blocked(dy, dgeo, scratch="conv_dy").data
    if need_dw:
        xb = to_blocked(x, geo, scratch="conv_x").data if xb is None else xb.data
        bc, bk = geo.bc, geo.bk
        cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
        if _dwv.serves(geo, host) and not taps:     # bf16: the dot instruction
            dw = _dwv.weight_grad(xb, dyb0, geo, n, x)
        elif n and taps:
            dwt = _taps.weight_grad(xb, None if dot_taps else dyb0, geo, x, dy)
        else:
            dwt = _host.temp("conv_dwt", (geo.groups, kb * bk, geo.r * geo.s, cb * bc),
                             _dt.F32, x, zero=not n)
        if n and not taps and dw is None:
            _dwv.brgemm_nest(geo.groups, cb, kb, bc, bk, geo.hp, geo.wp, geo.r, geo.s,
                             geo.stride[0], geo.stride[1], geo.dilation[0], geo.dilation[1],
                             geo.p, geo.q, dt)(xb, dyb0, dwt, threads=_threads(geo.flops(n)))
    if need_dw and dw is None:
        dw = _host.empty(tuple(weight.shape), dt, x)
        _dwv.dw_out_nest(geo.groups, geo.kg, geo.cg, kb * bk, cb * bc, geo.r * geo.s, dt)(
            *([dwt, _host.reshape(dw, (geo.k, geo.cg, geo.r * geo.s))] +
              ([_host.temp("conv_dw_rounded", tuple(dwt.shape), dt, x)]
               if dt != _dt.F32 else [])),
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
            _dwv.bias_nest(kbt, bk, pq, dt)(_host.constant(1.0, dt, x, pq),
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
    wbt = packed or pack_weight(weight, geo.groups, geo.dtype, transposed=True,
                                scratch="conv_dx_weight")
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
