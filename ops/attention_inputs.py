"""The inputs of ops.attention: dtypes, host views and results, and masks made additive and
blocked the way the nests read them (key rows, or transposed 64 x 64 blocks)."""
from __future__ import annotations

import numpy as np

from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime import arrays as _arrays

from . import _host

DTYPES = (_dt.F32, _dt.BF16)    # what q, k and v may hold


def _dtype(x, name):
    try:
        dt = _dt.lookup(x.dtype)
    except Exception:   # noqa: BLE001 - any dtype tpp does not know
        dt = None
    if dt not in DTYPES:
        raise ArgumentError(f"{name}: expected f32 or bf16 data, got {x.dtype}")
    return dt


def _numpy(x):
    """A numpy view of a host array or CPU torch tensor (bf16 through ml_dtypes): a tensor's
    data as it is (detached: this operator is not differentiable; a lazily negated one
    resolved, a copy)."""
    if type(x) is np.ndarray:
        return x
    import torch
    if x.requires_grad:
        x = x.detach()
    if x.is_neg():
        x = x.resolve_neg()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(_dt.BF16.numpy)
    if x.dtype == torch.bool:
        return x.numpy()
    return x.numpy()


def _result(arr, torch_out):
    """arr (numpy) as a torch tensor when the inputs were torch tensors (zero-copy)."""
    return _host.as_torch(arr) if torch_out else arr


def _mask(mask, shape, dt, device=False):
    """(kind, additive f32 mask broadcast-ready as a 4-D numpy array): kind None, "key" (the
    mask does not vary over the queries: (mb, mh, 1, Sk)) or "full". A device mask (device:
    the data is on a device) is read to the host here; the device path uploads the reblocked
    additive masks (_device_masks)."""
    if mask is None:
        return None, None
    if device:
        mask = _mask_to_host(mask)
    mask = _host.host(mask, "mask")
    native = str(mask.dtype).split(".")[-1]
    mshape = tuple(int(n) for n in mask.shape)
    try:
        ok = len(mshape) <= 4 and np.broadcast_shapes(mshape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ArgumentError(f"mask: shape {mshape} does not broadcast to (B, H, Sq, Sk) = "
                            f"{shape}")
    if native != "bool":
        mdt = _dtype(mask, "mask")
        if mdt not in (_dt.F32, dt):
            raise ArgumentError(f"mask: an additive mask must be f32 or q's dtype ({dt}), got "
                                f"{mask.dtype}")
    add = additive(mask)
    kind = "key" if add.shape[2] == 1 else "full"
    return kind, add


def additive(mask):
    """The additive f32 form of a host mask that _mask accepted (bool: 0 where True, -inf
    where False), as a 4-D numpy array: what the nests add to the scores. Its kind ("key" or
    "full") depends on the mask's shape alone."""
    m = _numpy(_host.contiguous(mask))
    if m.dtype == np.bool_:
        add = np.where(m, np.float32(0), np.float32(-np.inf))
    else:
        add = np.asarray(m, np.float32)
    return add.reshape((1,) * (4 - m.ndim) + m.shape)


def _mask_to_host(mask):
    """A device mask as host data (numpy, or a CPU torch tensor for torch)."""
    if _arrays.is_torch(mask):
        return mask.detach().cpu()
    return _arrays.to_host(_arrays.as_array(mask, "mask"))


def _mask_slabs(pr, nq, nk):
    """(function giving the mask arrays of a chunk (and query block), mask heads): key masks
    as (mheads, NK * BK) additive rows, full masks as (mheads, NK, BK, BQ) transposed blocks
    (key rows, query columns; BQ = BK = pr.block), padded keys -inf, padded queries 0."""
    if pr.mask is None:
        return None, 1
    BQ = BK = pr.block      # noqa: N806
    add = pr.mask
    mb, mh = add.shape[0], add.shape[1]
    hc = pr.hc
    heads = hc if mh > 1 else 1
    if pr.mask_kind == "key":
        rows = np.full((mb, mh, nk * BK), -np.inf, np.float32)
        rows[:, :, :pr.sk] = np.broadcast_to(add[:, :, 0, :], (mb, mh, pr.sk))

        def key(c):
            bh0 = c * hc
            bi, h0 = divmod(bh0, pr.h)
            return rows[bi if mb > 1 else 0, h0:h0 + hc] if mh > 1 else \
                rows[bi if mb > 1 else 0, :1]
        return key, heads
    # full: (mb, mh, NQ, NK, BK, BQ), the transposed blocks
    full = np.broadcast_to(add, (mb, mh, pr.sq, pr.sk))
    blocks = np.full((mb, mh, nq * BQ, nk * BK), -np.inf, np.float32)
    blocks[:, :, :pr.sq, :pr.sk] = full
    blocks[:, :, pr.sq:, :] = 0.0
    blocks = np.ascontiguousarray(
        blocks.reshape(mb, mh, nq, BQ, nk, BK).transpose(0, 2, 1, 4, 5, 3))

    def block(c, i):
        bh0 = c * hc
        bi, h0 = divmod(bh0, pr.h)
        sel = blocks[bi if mb > 1 else 0, i]
        return sel[h0:h0 + hc] if mh > 1 else sel[:1]
    return block, heads
