"""One fused MLP layer, y = act(x @ w.T + b), forward and backward, from TPPs only.

    y, saved = ops.mlp_forward(x, w, b, "gelu")   # saved holds what the backward needs
    dx, dw, db = ops.mlp_backward(dy, saved)
    y = ops.mlp(x, w, b, "gelu")                  # inference: the epilogue does it all

Forward: a BRGEMM nest with bias (and, for inference, the activation) fused in its epilogue;
for training the pre-activation z is kept and the activation runs as a unary TPP on each output
tile in the same nest, right after the tile's BRGEMM (ops.matmul.linear_keep).
Backward, with dz = act_inv(dy, z) (the activation's backward TPP):
    dx = dz @ w              BRGEMM nest over w packed as a (N, K) right operand
    dw = dz.T @ x            host arrays of 64+ rows: one GEMM over packed operands (dz's
                             64-row blocks transposed, inside its nest for 4+ blocks of dw
                             rows; x in 64 x 64 tiles or in place; weight_grad_packed);
                             else a BRGEMM nest reading dz transposed (trans_a) and x as it is
    db = dz.sum(axis=0)      a BRGEMM nest of a ones row by dz (ops.blocked.column_sums)
x (M, K) and w (N, K) are f32, or bf16 (f32 accumulation, bf16 results, as torch does). Every
nest takes M at call time: a layer compiles once per (weight shape, dtype, activation) (dw's
two forms once each), and a new M (batch, sequence length) compiles nothing. All of it runs on a GPU too, for device
arrays (ops.matmul's device path; results of the inputs' kind on their device); operands on
different devices are an ArgumentError.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

import tpp
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear
from tpp.core.optable import UNARY_OPS

from . import _host, blocked
from .matmul import ACTIVATIONS, linear, linear_keep, matmul, serial
from .packing import PackedWeight, default_bn, pack_kn, pack_nk

# each fusable activation's backward op and what that op reads besides the gradient: "z"
# (the activation's input) or "y" (its output), from the op table
_BACKWARD = {act: UNARY_OPS[act].backward for act in ACTIVATIONS if act}
_SECOND = {act: {"x": "z", "y": "y"}[UNARY_OPS[UNARY_OPS[act].backward].second]
           for act in ACTIVATIONS if act}


@dataclass
class Saved:
    """What mlp_backward needs from the forward."""
    x: object          # (M, K)
    w: object          # (N, K)
    z: object          # pre-activation (M, N), or the output y for sigmoid/tanh (None: no act)
    activation: str | None
    bias: bool
    lead: tuple = ()   # x's leading dimensions (dx gets them back)


def _check(x, w, b, activation, packed):
    """(x as (M, K) rows, x's leading dims, w contiguous, b) after validating a layer call."""
    x = _host.host(x, "x", device=True)
    w = _host.host(w, "weight", device=True)
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if len(w.shape) != 2:
        raise ArgumentError(f"weight: expected (N, K), got shape {tuple(w.shape)}")
    n, k = w.shape
    x2, lead = _host.rows(x, k, "x")
    if b is not None:
        b = _host.host(b, "bias", device=True)
        if tuple(b.shape) != (n,):
            raise ArgumentError(f"bias: expected shape ({n},), got {tuple(b.shape)}")
    if _host.on_device(x) or _host.on_device(w) or (b is not None and _host.on_device(b)):
        _host.same_device(x=x, weight=w, bias=b)
    if packed is not None:
        check_packed(packed, w)
    return x2, lead, _host.contiguous(w), b


def check_packed(packed, w):
    """ArgumentError unless packed is an ops.PackedWeight of a weight shaped and typed like w
    (N, K): a packed copy of another weight would silently compute with other values."""
    if not isinstance(packed, PackedWeight):
        raise ArgumentError(f"packed: expected an ops.PackedWeight (ops.pack_nk(weight)), got "
                            f"{type(packed).__name__}")
    n, k = w.shape
    dt = _host.dtype_of(w, "weight")
    if (packed.n, packed.k, packed.dtype) != (n, k, dt):
        raise ArgumentError(f"packed: {packed!r} does not match a weight of shape ({n}, {k}) "
                            f"and dtype {dt}")


def _check_saved(saved):
    if not isinstance(saved, Saved):
        raise ArgumentError(f"saved: expected the ops.Saved that ops.mlp_forward returns second "
                            f"(y, saved = ops.mlp_forward(...)), got {type(saved).__name__}")


def _flag(value, name):
    """value as a bool; ArgumentError for anything but a bool (a numpy bool too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def mlp(x, w, b=None, activation=None, *, packed: PackedWeight | None = None, **unknown):
    """act(x @ w.T + b), x (..., K), w (N, K): inference, everything in one nest.
    packed: ops.pack_nk(w), reused instead of packing w again."""
    _host.reject_unknown(mlp, unknown)
    x2, lead, w, b = _check(x, w, b, activation, packed)
    y = linear(x2, packed if packed is not None else pack_nk(w), b, activation)
    return _host.reshape(y, (*lead, w.shape[0]))


def mlp_forward(x, w, b=None, activation=None, *, packed: PackedWeight | None = None,
                **unknown):
    """(y, Saved) for training; y has x's leading dimensions. packed as for mlp."""
    _host.reject_unknown(mlp_forward, unknown)
    x2, lead, w, b = _check(x, w, b, activation, packed)
    return forward_checked(x2, lead, w, b, activation,
                           packed if packed is not None else pack_nk(w))


def forward_checked(x2, lead, w, b, activation, pw):
    """mlp_forward after its checks: x2 (M, K) C-contiguous rows, lead x's leading dims, w the
    contiguous weight, b the bias or None, pw its PackedWeight. Without an activation y is
    the GEMM's output (nothing else kept); f32 sigmoid and tanh (whose backward reads y) run in
    the GEMM's epilogue; relu and gelu (and bf16, where torch rounds z to bf16 before the
    activation) keep z and run the activation as a unary TPP on each tile of z in the GEMM's
    nest (ops.matmul.linear_keep)."""
    n = w.shape[0]
    if activation is None or (_SECOND[activation] == "y" and pw.dtype == _dt.F32):
        y = linear(x2, pw, b, activation)
        keep = None if activation is None else y
    else:   # z and act(z) from one nest: the activation runs on each tile while in cache
        z, y = linear_keep(x2, pw, b, activation)
        keep = z if _SECOND[activation] == "z" else y
    if len(lead) != 1:
        y = _host.reshape(y, (*lead, n))
    return y, Saved(x2, w, keep, activation, b is not None, lead)


def mlp_backward(dy, saved: Saved, *, need_x=True, need_w=True, need_b=True, **unknown):
    """(dx, dw, db) for dy = dL/dy (x's leading dims, N) and the Saved from mlp_forward; a
    gradient not needed (need_* False) is None (db is None without a bias)."""
    _host.reject_unknown(mlp_backward, unknown)
    _check_saved(saved)
    need_x = _flag(need_x, "need_x")
    need_w = _flag(need_w, "need_w")
    need_b = _flag(need_b, "need_b")
    x, w = saved.x, saved.w
    m, k = x.shape
    n = w.shape[0]
    dt = _host.dtype_of(x, "x")
    dy = _host.host(dy, "dy", device=True)
    if _host.on_device(dy) or _host.on_device(x):
        _host.same_device(dy=dy, x=x)
    dy2, _ = _host.rows(dy, n, "dy")
    if dy2.shape[0] != m:
        raise ArgumentError(f"dy: {dy2.shape[0]} rows, the forward had {m}")
    if _host.dtype_of(dy2, "dy") != dt:
        raise ArgumentError(f"dy is {_host.dtype_of(dy2, 'dy')}, the forward ran in {dt}")
    if saved.activation is None:
        dz = dy2
    else:       # an intermediate: per-thread scratch on the host (no page faults per call)
        dz = _host.empty((m, n), dt, dy2) if _host.on_device(dy2) else \
            _host.like(_host.scratch("dz", (m, n), dt), dy2)
        blocked.map_rows(_BACKWARD[saved.activation], [dy2, saved.z], dz)
    dx = dw = db = None
    if need_x:
        dx = _host.reshape(matmul(dz, pack_kn(w)), (*saved.lead, k))
    if need_w:
        dw = (weight_grad_packed if dt == _dt.BF16 or packed_f32_dw() else weight_grad)(dz, x)
    if need_b and saved.bias:
        sums = blocked.column_sums(dz, _host.empty((n,), _dt.F32, dz))
        if dt == _dt.F32:
            db = sums
        else:
            db = _host.empty((1, n), dt, dz)
            blocked.map_rows("identity", [_host.reshape(sums, (1, n))], db)
            db = _host.reshape(db, (n,))
    return dx, dw, db


# Rows of M (the reduction of dw = dz.T @ x) per step of the weight-gradient nest. Each dw
# tile of a BRGEMM call re-reads the call's x rows (MC x 64 columns) and dz columns: with all
# of M in one call (4096 x 256 bytes for f32) they fall out of L2 between the tiles (the rows'
# power-of-two strides alias in the cache sets too) and the nest ran at ~35 GFLOP/s per core;
# 256-row steps keep them in L2: 85-98 GFLOP/s per core (4096x4096x1024, f32, Zen 4; 64 rows:
# 70-75, 128: 82, 512: 80-82).
_MC = 256


@functools.lru_cache(maxsize=256)
def _weight_grad_nest(n, k, dtype):
    """dw (n, k) = dz.T @ x for dz (M, n) and x (M, k), any M >= 1, into an f32 dw: per
    256-row step of M (sequential, outermost) and block of dw (parallel), one BRGEMM summing
    the step's rank-1 updates (depth 1 per pair, count = the step's rows), dz read transposed
    (trans_a) and x row-major, so nothing is transposed or packed; the first step writes dw
    (beta 0), the later ones add to it (beta 1). The tail step past the last full 256 rows
    has a count of its own (M % 256, a size expression)."""
    m = tpp.size("M")
    row_cases, row_blocks = blocked.split(n, blocked.ROWS)
    col_cases, col_blocks = blocked.split(k, blocked.COLS)
    nest = tpp.LoopNest("aBC", a=tpp.Loop(0, m, _MC), b=row_blocks, c=col_blocks)
    r, i, j = nest.vars
    dz = nest.tensor("dz", (m, n), dtype)
    x = nest.tensor("x", (m, k), dtype)
    dw = nest.tensor("dw", (n, k), _dt.F32)
    steps = ((_MC, (r + _MC <= m,)), (m - m // _MC * _MC, (r + _MC > m,)))
    for rows, row_guard in row_cases:
        for cols, col_guard in col_cases:
            for beta, first in ((0, (r == 0,)), (1, (r > 0,))):
                spec = tpp.make_brgemm(rows, cols, 1, lda=n, ldb=k, ldc=k, dtype_a=dtype,
                                       dtype_b=dtype, dtype_c=_dt.F32, trans_a=True, beta=beta)
                for count, step_guard in steps:
                    nest.call(spec, dz[r, i * blocked.ROWS], x[r, j * blocked.COLS],
                              dw[i * blocked.ROWS, j * blocked.COLS], count=count,
                              stride_a=n, stride_b=k,
                              when=row_guard(i) + col_guard(j) + first + step_guard)
    return nest.compile()


also_clear(_weight_grad_nest.cache_clear)   # tpp.clear_caches() empties it too


def weight_grad(dz, x):
    """dz.T @ x (N, K) for dz (M, N) and x (M, K) of one dtype (C-contiguous), any M: f32
    sums, rounded once to a bf16 result."""
    (m, n), k = dz.shape, x.shape[1]
    dt = _host.dtype_of(x, "x")
    if m == 0:
        return _host.zeros((n, k), dt, dz)
    dw = _host.empty((n, k), _dt.F32, dz)
    threads = 1 if serial(2.0 * m * n * k, n * k * dt.itemsize) else None
    _weight_grad_nest(n, k, dt)(dz, x, dw, threads=threads)
    if dt == _dt.F32:
        return dw
    out = _host.empty((n, k), dt, dz)
    blocked.map_rows("identity", [dw], out)
    return out


# dw by a GEMM over packed blocks (weight_grad_packed) for bf16: VNNI dot products need pairs
# along M, which the rank-1 nest widens to f32 FMAs instead (4096x1024x4096 on 2 cores: ~92
# vs ~193 ms; MiniLM's and BERT-base's shapes 1.4-1.8x). f32 takes the rank-1 nest on AMD
# cores: on one Zen 4 thread it is 10-22% faster than packing at MiniLM's and BERT-base's
# shapes and 4096x1024x4096 (thread CPU time); on two threads 3-29% faster at MiniLM's
# (4096 x 384 x 384 .. 4096 x 1536 x 384), equal at 4096x1024x4096 (a whole MLP step too).
# On Sapphire Rapids (two 512-bit FMA pipes) packing wins instead (2 threads, ms, rank-1 /
# packed / torch): 4096x4096x1024 184 / 135 / 116, 4096x3072x768 96 / 77 / 67, 4096x768x3072
# 100 / 76 / 64, 4096x1152x384 16.2 / 15.1 / 13.2, 4096x384x384 4.7 / 5.0 / 4.2; the AMX
# hosts (tpp.has_matrix_unit) stand for that core. PACKED_F32_DW True / False forces either.
PACKED_F32_DW = None


def packed_f32_dw() -> bool:
    """Whether f32 weight gradients take weight_grad_packed (see PACKED_F32_DW)."""
    if PACKED_F32_DW is not None:
        return bool(PACKED_F32_DW)
    return tpp.has_matrix_unit(_dt.BF16)
_TB = 64      # rows of M per transposed block of dz (the GEMM's depth per batch entry)
_STEP = 1024  # rows of M per sequential step of the dw nest


@functools.lru_cache(maxsize=256)
def _blocks_t_nest(n, dtype):
    """dzt (M // 64, n, 64): each whole 64-row block of dz (M, n) transposed (rows past the
    last whole block are not written)."""
    m = tpp.size("M")
    col_cases, col_blocks = blocked.split(n, blocked.COLS)
    nest = tpp.LoopNest("AB", a=tpp.Loop(0, m // _TB, 1), b=col_blocks)
    a, c = nest.vars
    dz = nest.tensor("dz", (m, n), dtype)
    dzt = nest.tensor("dzt", (m // _TB, n, _TB), dtype)
    for cols, guard in col_cases:
        spec = tpp.make_unary("transpose", _TB, cols, ldi=n, ldo=_TB, dtype_in=dtype)
        nest.call(spec, dz[a * _TB, c * blocked.COLS], dzt[a, c * blocked.COLS, 0],
                  when=guard(c))
    return nest.compile()


also_clear(_blocks_t_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def _blocks_x_nest(k, bn, dtype):
    """xp (M // 64, k blocks, 64, bn) (bf16: (.., 32, 2 bn), VNNI pairs): the 64 x bn tiles of
    x (M, k) in whole 64-row blocks, each contiguous."""
    m = tpp.size("M")
    vnni = dtype == _dt.BF16
    col_cases, col_blocks = blocked.split(k, bn)
    nest = tpp.LoopNest("AB", a=tpp.Loop(0, m // _TB, 1), b=col_blocks)
    a, c = nest.vars
    x = nest.tensor("x", (m, k), dtype)
    xp = nest.tensor("xp", (m // _TB, col_blocks, _TB // 2, 2 * bn) if vnni
                     else (m // _TB, col_blocks, _TB, bn), dtype)
    op, ldo = ("vnni2", 2 * bn) if vnni else ("identity", bn)
    for cols, guard in col_cases:
        spec = tpp.make_unary(op, _TB, cols, ldi=k, ldo=ldo, dtype_in=dtype, dtype_out=dtype)
        nest.call(spec, x[a * _TB, c * bn], xp[a, c, 0, 0], when=guard(c))
    return nest.compile()


also_clear(_blocks_x_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def _packed_grad_nest(n, k, bn, dtype, order):
    m = tpp.size("M")
    vnni = dtype == _dt.BF16
    row_cases, row_blocks = blocked.split(n, blocked.ROWS)
    col_cases, col_blocks = blocked.split(k, bn)
    kb = col_blocks
    full = m // _TB * _TB            # rows in whole blocks
    nsteps = tpp.Loop(0, full, _STEP)
    nest = tpp.LoopNest(order, a=nsteps, b=row_blocks, c=col_blocks)
    s, i, j = nest.vars
    dzt = nest.tensor("dzt", (m // _TB, n, _TB), dtype)
    xp = nest.tensor("xp", (m // _TB, kb, _TB // 2, 2 * bn) if vnni
                     else (m // _TB, kb, _TB, bn), dtype)
    dz = nest.tensor("dz", (m, n), dtype)
    x = nest.tensor("x", (m, k), dtype)
    dw = nest.tensor("dw", (n, k), _dt.F32)
    ldb = 2 * bn if vnni else bn
    for rows, rg in row_cases:
        for cols, cg in col_cases:
            for beta, first in ((0, (s == 0,)), (1, (s > 0,))):
                spec = tpp.make_brgemm(rows, cols, _TB, lda=_TB, ldb=ldb, ldc=k, dtype_a=dtype,
                                       dtype_b=dtype, dtype_c=_dt.F32, vnni_b=vnni, beta=beta)
                for count, sg in ((_STEP // _TB, (s + _STEP <= full,)),
                                  ((full - full // _STEP * _STEP) // _TB, (s + _STEP > full,))):
                    nest.call(spec, dzt[s // _TB, i * blocked.ROWS, 0],
                              xp[s // _TB, j, 0, 0],
                              dw[i * blocked.ROWS, j * bn], count=count,
                              stride_a=n * _TB, stride_b=kb * _TB * bn,
                              when=rg(i) + cg(j) + first + sg)
            # rows past the whole blocks: rank-1 updates from dz and x, after the steps
            spec = tpp.make_brgemm(rows, cols, 1, lda=n, ldb=k, ldc=k, dtype_a=dtype,
                                   dtype_b=dtype, dtype_c=_dt.F32, trans_a=True, beta=1)
            nest.call(spec, dz[full, i * blocked.ROWS], x[full, j * bn],
                      dw[i * blocked.ROWS, j * bn], count=m - full, stride_a=n, stride_b=k,
                      when=rg(i) + cg(j) + (m > full, s + _STEP >= full))
    return nest.compile()


also_clear(_packed_grad_nest.cache_clear)


# The weight gradient with dz's blocks transposed inside the GEMM's nest (_fused_grad_nest)
# from this many 64-row blocks of dw (its parallel loop: fewer leave a core idle), x read in
# place where its row stride spreads a panel's rows over the L1 sets (in_place_rows), else
# packed. f32, 2 SPR threads, x 4096 rows, ms, separate passes / fused / fused with x in
# place / torch: K 384 N 1152 14.8 / 13.5 / 12.9 / 12.1; 384 x 1536 19.7 / 18.4 / 17.7 / 17.7;
# 384 x 384 5.2 / 4.6 / 4.2 / 3.8; 1536 x 384 (x packed) 20.3 / 19.4 / - / 16.3.
FUSED_ROW_BLOCKS = 4


def in_place_rows(k: int, dtype) -> bool:
    """Whether the weight gradient's B (x, rows of k) is read in place: f32 rows of whole cache
    lines whose stride in lines shares at most a factor 8 with the 64 L1 sets (K 384: 24
    lines, so 64 rows fall in 32 sets; K 1536: 96 lines, 8 sets, measured 2.6x slower)."""
    row = k * dtype.itemsize
    return dtype == _dt.F32 and row % 64 == 0 and math.gcd(row // 64, 64) <= 8


@functools.lru_cache(maxsize=256)
def _fused_grad_nest(n, k, bn, dtype, in_place):
    """dw (n, k) f32 = dz.T @ x (M >= 64), as _packed_grad_nest's sums in the same order,
    but per sequential step of _STEP rows and block of 64 dw rows (parallel; its panels and
    the step's 64-row sub-blocks sequential) the block's columns of dz are transposed into its
    slot of dzl (row blocks, _STEP / 64, 64, 64) during the first panel, while the next ones
    reuse them from cache; x in place (lda k) or packed (xp, as _blocks_x_nest writes it)."""
    m = tpp.size("M")
    vnni = dtype == _dt.BF16
    rows_ = blocked.ROWS
    row_cases, row_blocks = blocked.split(n, rows_)
    col_cases, kb = blocked.split(k, bn)
    full, subs = m // _TB * _TB, _STEP // _TB
    nest = tpp.LoopNest("aBcd", a=tpp.Loop(0, full, _STEP), b=row_blocks, c=kb, d=subs)
    s, i, j, t = nest.vars
    dzl = nest.tensor("dzl", (row_blocks, subs, rows_, _TB), dtype)
    xp = None if in_place else nest.tensor(
        "xp", (m // _TB, kb, _TB // 2, 2 * bn) if vnni else (m // _TB, kb, _TB, bn), dtype)
    dz = nest.tensor("dz", (m, n), dtype)
    x = nest.tensor("x", (m, k), dtype)
    dw = nest.tensor("dw", (n, k), _dt.F32)
    last = (t == subs - 1,)
    ldb, stride_b = (k, _TB * k) if in_place else (2 * bn if vnni else bn, kb * _TB * bn)
    for rows, rg in row_cases:
        turn = tpp.make_unary("transpose", _TB, rows, ldi=n, ldo=_TB, dtype_in=dtype)
        for sub in ((s + _STEP <= full,),      # a whole step; the last, partial one's blocks
                    (s + _STEP > full, t < (full - full // _STEP * _STEP) // _TB)):
            nest.call(turn, dz[s + t * _TB, i * rows_], dzl[i, t, 0, 0],
                      when=rg(i) + (j == 0,) + sub)
        for cols, cg in col_cases:
            b_at = x[s, j * bn] if in_place else xp[s // _TB, j, 0, 0]
            for beta, first in ((0, (s == 0,)), (1, (s > 0,))):
                spec = tpp.make_brgemm(rows, cols, _TB, lda=_TB, ldb=ldb, ldc=k, dtype_a=dtype,
                                       dtype_b=dtype, dtype_c=_dt.F32, vnni_b=vnni, beta=beta)
                for count, sg in ((subs, (s + _STEP <= full,)),
                                  ((full - full // _STEP * _STEP) // _TB, (s + _STEP > full,))):
                    nest.call(spec, dzl[i, 0, 0, 0], b_at, dw[i * rows_, j * bn], count=count,
                              stride_a=rows_ * _TB, stride_b=stride_b,
                              when=rg(i) + cg(j) + first + sg + last)
            spec = tpp.make_brgemm(rows, cols, 1, lda=n, ldb=k, ldc=k, dtype_a=dtype,
                                   dtype_b=dtype, dtype_c=_dt.F32, trans_a=True, beta=1)
            nest.call(spec, dz[full, i * rows_], x[full, j * bn], dw[i * rows_, j * bn],
                      count=m - full, stride_a=n, stride_b=k,
                      when=rg(i) + cg(j) + (m > full, s + _STEP >= full) + last)
    return nest.compile()


also_clear(_fused_grad_nest.cache_clear)


def weight_grad_packed(dz, x, order="aBC"):
    """weight_grad (dz.T @ x) by a GEMM over packed operands, for host dz and x (numpy arrays
    or torch CPU tensors; device data takes weight_grad): the whole 64-row blocks of dz
    transposed ((M / 64, N, 64); from FUSED_ROW_BLOCKS blocks of dw rows, inside the GEMM's
    nest, _fused_grad_nest) and of x in contiguous 64 x 64 tiles (VNNI pairs for bf16; x read
    in place where in_place_rows says so), in per-thread scratch reused between calls; the
    rows past the last whole block as rank-1 updates. Sums in the same order as weight_grad."""
    (m, n), k = dz.shape, x.shape[1]
    dt = _host.dtype_of(x, "x")
    if m < _TB or _host.on_device(dz) or _host.on_device(x):
        return weight_grad(dz, x)
    bn = default_bn(k)
    threads = 1 if serial(2.0 * m * n * k, n * k * dt.itemsize) else None
    fused = -(-n // blocked.ROWS) >= FUSED_ROW_BLOCKS
    in_place = fused and in_place_rows(k, dt)
    kb = -(-k // bn)
    if not in_place:
        xp = _host.scratch("xp", (m // _TB, kb, _TB // 2, 2 * bn) if dt == _dt.BF16
                           else (m // _TB, kb, _TB, bn), dt)
        _blocks_x_nest(k, bn, dt)(x, xp, threads=threads)
    dw = _host.empty((n, k), _dt.F32, dz)
    if fused:
        dzl = _host.scratch("dzl", (-(-n // blocked.ROWS), _STEP // _TB, blocked.ROWS, _TB), dt)
        _fused_grad_nest(n, k, bn, dt, in_place)(
            *([dzl] + ([] if in_place else [xp]) + [dz, x, dw]), threads=threads)
    else:
        dzt = _host.scratch("dzt", (m // _TB, n, _TB), dt)
        _blocks_t_nest(n, dt)(dz, dzt, threads=threads)
        _packed_grad_nest(n, k, bn, dt, order)(dzt, xp, dz, x, dw, threads=threads)
    if dt == _dt.F32:
        return dw
    out = _host.empty((n, k), dt, dz)
    blocked.map_rows("identity", [dw], out)
    return out
