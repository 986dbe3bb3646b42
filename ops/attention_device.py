"""Attention on device data: the forward and backward of ops.flash_attention for arrays that live
on a device (called from there; see ops.attention for the contract).

Device data (torch CUDA tensors, anything with __cuda_array_interface__: _host.host(...,
device=True)) runs the same nests (Options.cuda: the forward's variant without equations
that reduce over rows, see ops.attention_equations.scores_spec), called with device arrays,
so the runtime sends them to the device's backend: one launch per chunk of heads (per query
block too for 2-D masks), in order, no host threads. Scratch, tail blocks and the padded lse
are allocated on the device per call (the backend's allocator), tails are cut and pasted by
identity TPPs, the constants (scale, the tail's key mask, the ones row) are copied there once
per device. Masks are reblocked on the host (the data is read back once) and uploaded.
Arrays inside are torch tensors (torch data: kernels run on torch's stream) or
ops._host.DeviceView (anything else), viewed by element offsets (_dview).
"""
from __future__ import annotations

import math

import numpy as np

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime import arrays as _arrays

from . import _host
from . import attention_buffers as B
from . import attention_kernels as K
from . import flash_attention as F
from .attention_inputs import _mask_slabs

_DEVICE_CONSTANTS = None


def _dbase(x):
    """A torch CUDA tensor as it is, other device data as a DeviceView."""
    return x if _arrays.is_torch(x) else _host.host(x, "array", device=True)


def _dview(x, offset, shape, strides=None):
    """The view of device array x (_dbase's kinds) `offset` elements past its first element,
    of this shape and element strides (default C-contiguous)."""
    shape = tuple(int(n) for n in shape)
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
    if _arrays.is_torch(x):
        return x.as_strided(shape, strides, x.storage_offset() + offset)
    return _host.DeviceView(x.obj, x.ptr + offset * x.dtype.itemsize, shape, strides, x.dtype,
                            x.readonly, x.index)


def _dnew(pr, shape, dt):
    """An uninitialised device array (the backend's allocation) as _dbase gives it."""
    return _dbase(_host.empty(shape, dt, pr.q))


def _dcopy(src, dst, dt):
    """dst[...] = src for 2-D device views of one shape (one unit stride each): identity TPP."""
    m, n = (int(x) for x in src.shape)
    if m and n:
        tpp.unary("identity", m, n, dtype_in=dt)(src, out=dst)


def _dconstant(pr, name, host_array):
    """host_array copied to q's device once per (device, kind, name) and kept."""
    global _DEVICE_CONSTANTS
    if _DEVICE_CONSTANTS is None:
        from tpp.runtime.lru import LRU
        _DEVICE_CONSTANTS = LRU(32, "device_attention_constants")
    key = (pr.where, pr.torch, name)
    arr = _DEVICE_CONSTANTS.get(key)
    if arr is None:
        from tpp.runtime import registry
        arr = _DEVICE_CONSTANTS[key] = _dbase(registry.for_device(pr.where).to_device(
            np.ascontiguousarray(host_array), pr.where, pr.torch))
    return arr


def _dtail(pr, x3, block, heads):
    """_tail on the device: the zero-padded last partial block of each head of x3 (N, S, D),
    or an unused (heads, block, D) array when S is a multiple of block."""
    n, s, d = (int(x) for x in x3.shape)
    r = s % block
    if r == 0:
        return _dnew(pr, (heads, block, d), pr.dt)
    t = _dbase(_host.zeros((n, block, d), pr.dt, pr.q))
    _dcopy(_dview(x3, (s - r) * d, (n, r * d), (s * d, 1)),
           _dview(t, 0, (n, r * d), (block * d, 1)), pr.dt)
    return t


def _dtail_back(pr, tail, x3, block):
    """The valid rows of each head's tail block into the last rows of x3 (N, S, D)."""
    n, s, d = (int(x) for x in x3.shape)
    r = s % block
    if r and n:
        _dcopy(_dview(tail, 0, (n, r * d), (block * d, 1)),
               _dview(x3, (s - r) * d, (n, r * d), (s * d, 1)), pr.dt)


def _dchunk(arr, c, count):
    """_chunk of a device array."""
    if int(arr.shape[0]) <= count:
        return arr
    rest = tuple(int(x) for x in arr.shape[1:])
    return _dview(arr, c * count * math.prod(rest), (count,) + rest)


def _dheads(x, n, s, d):
    """x (B, H, S, D) device data as (B * H, S, D)."""
    return _dview(x, 0, (n, s, d))


def _device_masks(pr, nq, nk):
    """_mask_slabs with the reblocked masks uploaded once per call: the same function of
    (chunk, query block), giving device views at the host views' offsets."""
    masks, mheads = _mask_slabs(pr, nq, nk)
    if masks is None:
        return None, mheads
    uploads = {}
    from tpp.runtime import registry

    def on_device(*index):
        view = masks(*index)
        base = view
        while isinstance(base.base, np.ndarray):
            base = base.base
        dev = uploads.get(id(base))
        if dev is None:
            dev = uploads[id(base)] = (base, _dbase(registry.for_device(pr.where).to_device(
                base, pr.where, pr.torch)))
        base, dev = dev
        item = view.dtype.itemsize
        offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0])
        return _dview(dev, offset // item, view.shape, tuple(x // item for x in view.strides))
    return on_device, mheads


def device_forward(pr):
    """_forward's work on pr.where: (out, lse) of q's kind on its device."""
    b, h, hk, sq, sk, d, dt = pr.b, pr.h, pr.hk, pr.sq, pr.sk, pr.d, pr.dt
    out = _host.empty((b, h, sq, d), dt, pr.q)
    lse = _host.empty((b, h, sq), _dt.F32, pr.q)
    if not (b * h and sq):
        return out, lse
    hc, g = pr.hc, pr.group
    BQ = BK = pr.block      # noqa: N806  (query and key block rows, as in the nests)
    hkc = hc // g
    nq, nk = -(-sq // BQ), -(-sk // BK)
    out3 = _dheads(_dbase(out), b * h, sq, d)
    q3, k3, v3 = (_dheads(pr.q, b * h, sq, d), _dheads(pr.k, b * hk, sk, d),
                  _dheads(pr.v, b * hk, sk, d))
    lse_p = _dnew(pr, (b * h, nq * BQ), _dt.F32)
    qt, kt, vt = _dtail(pr, q3, BQ, hc), _dtail(pr, k3, BK, hkc), _dtail(pr, v3, BK, hkc)
    outt = _dnew(pr, (b * h if sq % BQ else hc, BQ, d), dt)
    arrays = {"cm": _dconstant(pr, ("cm", sk % BK, BK), B.key_tail_mask(sk, BK)),
              "scale": _dbase(_host.constant(pr.scale, _dt.F32, pr.q)),
              "ones": _dconstant(pr, ("ones", BK), B.ones(BK)),
              "qT": _dnew(pr, (hc, d, BQ), dt),
              "work": _dnew(pr, (hc, K.work_size(d, BQ)), _dt.F32)}
    if K.vnni(pr.options()):
        arrays.update(qV=_dnew(pr, (hc, (d + 1) // 2, 2 * BQ), dt),
                      pb=_dnew(pr, (hc, BK, BQ), dt), vV=_dnew(pr, (hc, BK // 2, 2 * d), dt))
    masks, mheads = _device_masks(pr, nq, nk)
    nest = K.forward(pr.options(mheads))
    for c in range(pr.chunks):
        arrays.update(q=_dchunk(q3, c, hc), k=_dchunk(k3, c, hkc), v=_dchunk(v3, c, hkc),
                      qt=_dchunk(qt, c, hc), kt=_dchunk(kt, c, hkc), vt=_dchunk(vt, c, hkc),
                      out=_dchunk(out3, c, hc), outt=_dchunk(outt, c, hc),
                      lse=_dchunk(lse_p, c, hc))
        F._run_chunk(pr, nest, arrays, c, masks, nq, None)
    _dtail_back(pr, outt, out3, BQ)
    _dcopy(_dview(lse_p, 0, (b * h, sq), (nq * BQ, 1)), _dview(_dbase(lse), 0, (b * h, sq)),
           _dt.F32)
    return out, lse


def device_backward(pr, do4, o4, lse, need):
    """attention_backward's work on pr.where: (dq, dk, dv) of q's kind on its device."""
    b, h, hk, sq, sk, d, dt = pr.b, pr.h, pr.hk, pr.sq, pr.sk, pr.d, pr.dt
    if not (b * h and sq):
        dq = _host.empty((b, h, sq, d), dt, pr.q)
        dk = _host.zeros((b, hk, sk, d), dt, pr.q)
        dv = _host.zeros((b, hk, sk, d), dt, pr.q)
        return tuple(x if want else None for x, want in zip((dq, dk, dv), need))
    dq, dk, dv = (_host.empty(shape, dt, pr.q) for shape in
                  ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d)))
    hc, g = pr.hc, pr.group
    BQ = BK = pr.block      # noqa: N806  (query and key block rows, as in the nests)
    hkc = hc // g
    nq, nk = -(-sq // BQ), -(-sk // BK)
    n, nkv = b * h, b * hk
    q3, o3, do3 = (_dheads(_dbase(x), n, sq, d) for x in (pr.q, o4, do4))
    k3, v3 = (_dheads(_dbase(x), nkv, sk, d) for x in (pr.k, pr.v))
    dq3, dk3, dv3 = (_dheads(_dbase(dq), n, sq, d), _dheads(_dbase(dk), nkv, sk, d),
                     _dheads(_dbase(dv), nkv, sk, d))
    tails = {"qt": _dtail(pr, q3, BQ, hc), "ot": _dtail(pr, o3, BQ, hc),
             "dot": _dtail(pr, do3, BQ, hc), "kt": _dtail(pr, k3, BK, hkc),
             "vt": _dtail(pr, v3, BK, hkc)}
    outs_t = {"dqt": _dnew(pr, (n if sq % BQ else hc, BQ, d), dt),
              "dkt": _dnew(pr, (nkv if sk % BK else hkc, BK, d), dt),
              "dvt": _dnew(pr, (nkv if sk % BK else hkc, BK, d), dt)}
    # lse padded with +inf (padded queries get P = 0), as on the host
    lse_p = _dnew(pr, (n, nq * BQ), _dt.F32)
    tpp.unary("identity", n, nq * BQ, bcast="scalar")(
        _dbase(_host.constant(math.inf, _dt.F32, pr.q)), out=lse_p)
    _dcopy(_dview(_dbase(lse), 0, (n, sq)), _dview(lse_p, 0, (n, sq), (nq * BQ, 1)), _dt.F32)
    per_block = pr.mask_kind == "full"
    snq, snk = (1, nk) if per_block else (nq, 1)
    arrays = {"cm": _dconstant(pr, ("cm", sk % BK, BK), B.key_tail_mask(sk, BK)),
              "scale": _dbase(_host.constant(pr.scale, _dt.F32, pr.q)),
              "delta": _dnew(pr, (hc, snq * BQ), _dt.F32),
              "gq": _dnew(pr, (hc, snq, BQ, d), _dt.F32),
              "gk": _dnew(pr, (hkc, snk, BK, d), _dt.F32),
              "gv": _dnew(pr, (hkc, snk, BK, d), _dt.F32),
              "st": _dnew(pr, (hkc, BK, BQ), _dt.F32),
              "dpt": _dnew(pr, (hkc, BK, BQ), _dt.F32)}
    if K.vnni(pr.options()):
        pairs = (d + 1) // 2
        arrays.update(qT=_dnew(pr, (hc, d, BQ), dt),
                      qV=_dnew(pr, (hc, snq, pairs, 2 * BQ), dt),
                      doV=_dnew(pr, (hc, snq, pairs, 2 * BQ), dt),
                      qN=_dnew(pr, (hc, snq, BQ // 2, 2 * d), dt),
                      doN=_dnew(pr, (hc, snq, BQ // 2, 2 * d), dt),
                      pb=_dnew(pr, (hkc, BK, BQ), dt), dsb=_dnew(pr, (hkc, BK, BQ), dt),
                      kN=_dnew(pr, (hkc, BK // 2, 2 * d), dt))
    else:
        arrays.update(qT=_dnew(pr, (hc, snq, d, BQ), dt), doT=_dnew(pr, (hc, snq, d, BQ), dt))
    masks, mheads = _device_masks(pr, nq, nk)
    nest = K.backward(pr.options(mheads))
    for c in range(pr.chunks):
        arrays.update(q=_dchunk(q3, c, hc), o=_dchunk(o3, c, hc), do=_dchunk(do3, c, hc),
                      k=_dchunk(k3, c, hkc), v=_dchunk(v3, c, hkc), lse=_dchunk(lse_p, c, hc),
                      dq=_dchunk(dq3, c, hc), dk=_dchunk(dk3, c, hkc), dv=_dchunk(dv3, c, hkc))
        for name, arr in tails.items():
            arrays[name] = _dchunk(arr, c, hc if name[0] in "qod" else hkc)
        for name, arr in outs_t.items():
            arrays[name] = _dchunk(arr, c, hc if name == "dqt" else hkc)
        F._run_chunk(pr, nest, arrays, c, masks, nq, None)
    _dtail_back(pr, outs_t["dqt"], dq3, BQ)
    _dtail_back(pr, outs_t["dkt"], dk3, BK)
    _dtail_back(pr, outs_t["dvt"], dv3, BK)
    return tuple(x if want else None for x, want in zip((dq, dk, dv), need))
