"""Fused (flash-style) scaled dot-product attention from BRGEMMs and equations in loop nests.

    out = ops.attention(q, k, v, mask=None, causal=False, scale=None, dropout_p=0.0, seed=None)
    out, lse = ops.attention_forward(q, k, v, ...)               # lse: f32 (B, H, Sq)
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, ..., need=(True, True, True))

Contract (torch.nn.functional.scaled_dot_product_attention's semantics):
  q (B, H, Sq, D); k and v (B, Hk, Sk, D) with H % Hk == 0 (grouped-query attention: query head
  h uses kv head h // (H // Hk); dk and dv have k's shape, summed over each group). numpy arrays
  or CPU torch tensors (torch in, torch out), all f32 or all bf16 (bf16 in and out; the
  softmax, its statistics and every accumulation in f32; lse is f32). Non-contiguous inputs
  are copied first.
  scale: default 1 / sqrt(D). mask: boolean (True: the key takes part) or additive float
  (f32 or q's dtype), broadcastable to (B, H, Sq, Sk). causal: key j is visible to query i iff
  j <= i (top-left aligned, torch's is_causal); combined with a mask when both are given.
  A query that sees no key (every key masked) gets an output row of 0, lse -inf and zero
  gradients, as torch's CPU kernel gives.
  dropout_p: dropout on the probabilities (the normaliser uses the undropped ones, like
  torch), drawn from an integer seed (None: a random one): the same seed gives the same keep
  bits, and attention_backward regenerates them from the same seed (it must be given), so
  forward and backward agree. The bits are the operator's own (a function of the seed, the
  head's index b * H + h and the element), not torch's.
  Device data (torch CUDA tensors, cupy, anything with __cuda_array_interface__; all operands
  and the mask on one device) runs the same nests on the device's backend and returns q's kind
  on that device (see "On a device" below); host and device operands mixed: ArgumentError.
  Bad input raises tpp.core.errors.ArgumentError: shapes that do not match, a head dim mismatch,
  H % Hk != 0, a mask of a shape that does not broadcast or of another dtype, a dtype other
  than f32 / bf16, mixed dtypes, an unknown keyword.

Algorithm (FlashAttention; see ops.attention_kernels for the nests). Blocks of 64 query rows
and 64 keys (a problem whose longer sequence fits in 48 or fewer takes one block of the next
multiple of 16 instead: attention_equations.block_for); the scores of block (i, j) never
leave a 64 x 64 f32 scratch block, so memory beyond the inputs and outputs is O(S * D) per
head. The forward's step for (i, j):
S^T = K_j Q_i^T (BRGEMM), the online softmax (masked, diagonal, tail and dropout blocks: the
scaled and masked z in place first; the column maxima by a reduce TPP, a (1 x 64) equation
updating the running max m and sum l in place with alpha = exp(m_old - m_new), then P^T in
place by an exponential equation), acc *= alpha, acc += P V_j (BRGEMM, trans_a), l +=
column sums of P^T (a ones-row BRGEMM); after the last key block out = acc / l and lse =
m + log l. Causal: key blocks past the query block are skipped by the guards (no work), the
diagonal block masks key > query by the element indices. The backward (FlashAttention-2):
Delta_i = rowsum(dO_i * O_i); for each kv head (in parallel) and key block j, for each query
head of its group and query block i: S^T, dP^T = V_j dO_i^T (BRGEMMs), one equation giving
P^T (dropped) and dS^T = scale * P^T * (dP^T - Delta) (from tpp.grad of the forward softmax
graph), dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i += dS K_j (BRGEMMs, f32 accumulators); the
thread owning a kv head owns its query heads' dQ, so no two threads write one block.

Compilation and calls: one forward and one backward nest per (head dim, dtype, heads per call,
group, causal, mask kind, dropout p, block size): a new batch size or sequence length
compiles nothing (the sequence lengths are sizes of the nests; the forward's first call
builds the nests of all four block classes, _Problem.nest; a backward compiles once per
block class: the longer sequence up to 16, 32, 48, and longer). A nest serves HC consecutive
heads of the flattened (B * H) heads (HC: the largest divisor of H that is a multiple of the
group, at most MAX_UNROLL): loop expressions are affine, so one nest cannot index both a
runtime head count and a runtime sequence length; this module calls it B * H / HC times,
either one after the other, each on every thread, or spread over Python worker threads (each
nest on one thread; a nest call releases the GIL): ops.attention_schedule decides. 2-D masks
(varying over queries and keys) run one call per query block (see ops.attention_kernels).
A call without dropout on contiguous host data reuses what an earlier call of the same
shapes, dtypes, causality, scale and mask shape and dtype validated and derived
(_plain_problem: the checks, the nest, its constant inputs; the mask's values are read
afresh), so its Python cost before the first nest call stays small.
Memory: the inputs' per-call copies are the last partial block of each head (sequences not a
multiple of the block; kept by the calling thread for its next calls: ops.attention_buffers);
the forward's scratch is O(HC) blocks (its query blocks run in order inside a head); the
backward's per worker O(HC * Sq * D) (f32 dQ accumulators, the packed query side),
HC capped so that that stays near SCRATCH_PER_CALL (B1 H12 S8192 D64 f32 fwd+bwd: about 24 MB
of peak RSS beyond inputs and outputs, tested in a subprocess); a mask is reblocked to an f32
additive copy at its own broadcast shape (key masks O(S), 2-D masks O(Sq * Sk) like the
mask itself).

On a device: one launch per chunk of heads (and per query block with a 2-D mask), in order;
the forward's nest is its device variant (Options.cuda: the masked / diagonal / tail /
dropout block steps without equations that reduce over rows, which the CUDA backend does not
build; results equal the host's to rounding, the dropout bits are the same); scratch and tail
blocks are device allocations per call, cut and pasted by identity TPPs; a mask is read back
to the host once per call, reblocked there as on the host and uploaded.

Dropout with a 2-D mask, GQA and every tail combination are supported. bf16, where the host
has a bf16 dot instruction (tpp.has_dot_instruction; avx512_bf16) and on devices, runs every
BRGEMM on bf16 A and VNNI-packed bf16 B (vdpbf16ps; f32 accumulation): Q_i^T, V_j, K_j, Q_i,
dO_i and dO_i^T are packed in the nests, and P (forward and backward) and dS are rounded to
bf16 before their products, as FlashAttention does; the softmax statistics, l (the sum of the
unrounded P) and lse stay f32. A host without one (AVX2) widens bf16 to f32 in every product
anyway: there bf16 takes the f32 nests' layouts (no packing, P and dS stay f32;
attention_equations.vnni). Accuracy: bf16 outputs and gradients within the
tests' bf16 tolerance (rtol = atol = 2e-2 of the largest value) of f32 torch.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

import tpp
from tpp.runtime import arrays as _arrays
from tpp.runtime import recording
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear

from . import _host
from . import attention_kernels as K
from .attention_inputs import _dtype, _mask, _mask_slabs, _numpy, _result, additive
from . import attention_buffers as B
from .attention_schedule import schedule

MAX_UNROLL = 16          # heads a nest handles per call (its calls are unrolled per head)
SCRATCH_PER_CALL = 4 << 20   # bytes of per-sequence scratch a call's heads may hold (see _Problem)
BLOCKS_PER_CALL = 256        # (64 x 64) score blocks a call's heads may hold, above one head
_SERIAL_FLOPS = 2e6      # smaller problems run on one thread (waking the team costs more)


# ---------------------------------------------------------------- public API
def attention(q, k, v, *, mask=None, causal=False, scale=None, dropout_p=0.0, seed=None,
              **unknown):
    """softmax(q k^T * scale + mask) v per (batch, head); see the module docstring."""
    _host.reject_unknown(attention, unknown)
    return _forward(q, k, v, mask, causal, scale, dropout_p, seed, want_lse=False)[0]


def attention_forward(q, k, v, *, mask=None, causal=False, scale=None, dropout_p=0.0,
                      seed=None, **unknown):
    """(out, lse): lse f32 (B, H, Sq), the log-sum-exp of each query row's scaled and masked
    scores (what attention_backward needs besides out)."""
    _host.reject_unknown(attention_forward, unknown)
    return _forward(q, k, v, mask, causal, scale, dropout_p, seed)


def attention_backward(dout, q, k, v, out, lse, *, mask=None, causal=False, scale=None,
                       dropout_p=0.0, seed=None, need=(True, True, True), **unknown):
    """(dq, dk, dv) of attention_forward(q, k, v, ...) = (out, lse) for the output gradient
    dout (q's shape and dtype); every option as the forward was called (seed: the forward's,
    required with dropout). dq like q, dk and dv like k; None where need says so."""
    _host.reject_unknown(attention_backward, unknown)
    pr = None
    if seed is None and (type(dropout_p) is float or type(dropout_p) is int) \
            and dropout_p == 0:     # the forward's plain case: its validated template
        pr = _plain_problem(q, k, v, causal, scale, mask)
    if pr is None:
        pr = _Problem(q, k, v, mask, causal, scale, dropout_p, seed, need_seed=True)
    if not isinstance(need, (tuple, list)) or len(need) != 3:
        raise ArgumentError(f"need must be a tuple of 3 bools, got {need!r}")
    need = tuple(bool(x) for x in need)
    shape = (pr.b, pr.h, pr.sq, pr.d)
    do4, o4 = (_same(x, name, shape, pr) for x, name in ((dout, "dout"), (out, "out")))
    lse = _on_problem_device(lse, "lse", pr)
    if tuple(lse.shape) != shape[:3] or _dtype(lse, "lse") != _dt.F32:
        raise ArgumentError(f"lse: expected f32 of shape {shape[:3]}, got {lse.dtype} "
                            f"{tuple(lse.shape)}")
    lse = _host.contiguous(lse)
    if not any(need):
        return None, None, None
    if pr.where is not None:
        from .attention_device import device_backward
        return device_backward(pr, do4, o4, lse, need)
    lse = _numpy(lse)
    dq = _host.np_empty(shape, pr.dt.numpy, _host.ALIGNED_FROM)
    dk = _host.np_empty((pr.b, pr.hk, pr.sk, pr.d), pr.dt.numpy, _host.ALIGNED_FROM)
    dv = _host.np_empty(dk.shape, dk.dtype, _host.ALIGNED_FROM)
    if pr.b * pr.h == 0:
        dk[...] = 0
        dv[...] = 0
    elif pr.sq == 0:
        dk[...] = 0
        dv[...] = 0
    else:
        _backward_run(pr, do4, o4, lse, dq, dk, dv)
    return tuple(_result(x, pr.torch) if want else None
                 for x, want in zip((dq, dk, dv), need))


def _same(x, name, shape, pr):
    x = _on_problem_device(x, name, pr)
    if tuple(x.shape) != shape:
        raise ArgumentError(f"{name}: expected q's shape {shape}, got {tuple(x.shape)}")
    if _dtype(x, name) != pr.dt:
        raise ArgumentError(f"{name}: expected {pr.dt} (q's dtype), got {x.dtype}")
    x = _host.contiguous(x)
    return x if pr.where is not None else _numpy(x)


def _on_problem_device(x, name, pr):
    """x (host() with device data allowed) on the device of q, k and v: ArgumentError when it
    lives elsewhere."""
    x = _host.host(x, name, device=True)
    if _host.on_device(x) != (pr.where is not None):
        _host.same_device(q=pr.q, **{name: x})
    return x


# ---------------------------------------------------------------- argument handling
class _Problem:
    """Validated arguments as numpy arrays (zero-copy views of torch tensors), the geometry
    and the nest options."""

    def __init__(self, q, k, v, mask, causal, scale, dropout_p, seed, need_seed=False):
        q, k, v = (_host.host(x, name, device=True) for x, name in ((q, "q"), (k, "k"),
                                                                     (v, "v")))
        self.torch = _arrays.is_torch(q)
        # the device of the data: None on the host; else the device path (_device_forward)
        self.where = None
        nd = np.ndarray
        if not (type(q) is nd and type(k) is nd and type(v) is nd and (
                mask is None or type(mask) is nd)) and not (
                self.torch and q.is_cpu and getattr(k, "is_cpu", False) is True
                and getattr(v, "is_cpu", False) is True
                and (mask is None or getattr(mask, "is_cpu", False) is True)) and (
                _host.on_device(q) or _host.on_device(k) or _host.on_device(v)
                or (mask is not None and _host.on_device(mask))):
            self.where = _host.same_device(q=q, k=k, v=v, mask=mask)
            if self.where.is_host:
                self.where = None
        for x, name in ((k, "k"), (v, "v")):
            if _arrays.is_torch(x) != self.torch:
                raise ArgumentError(f"{name}: q, k and v must all be numpy arrays or all torch "
                                    f"tensors")
        dts = [_dtype(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
        if len(set(dts)) > 1:
            raise ArgumentError(f"q, k and v must have one dtype, got {', '.join(map(str, dts))}")
        self.dt = dts[0]
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            if len(x.shape) != 4:
                raise ArgumentError(f"{name}: expected a 4-D (B, heads, S, D) array, got shape "
                                    f"{tuple(x.shape)}")
        b, h, sq, d = (int(n) for n in q.shape)
        bk, hk, sk, dk = (int(n) for n in k.shape)
        if tuple(v.shape) != tuple(k.shape):
            raise ArgumentError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        if bk != b:
            raise ArgumentError(f"k: batch {bk} differs from q's {b}")
        if dk != d:
            raise ArgumentError(f"k: head dim {dk} differs from q's {d}")
        if hk < 1 or h % hk:
            raise ArgumentError(f"q has {h} heads, k and v {hk}: the query heads must be a "
                                f"multiple of the kv heads")
        if d < 1 or sk < 1:
            raise ArgumentError(f"head dim and key length must be >= 1, got D={d}, Sk={sk}")
        self.b, self.h, self.hk, self.sq, self.sk, self.d = b, h, hk, sq, sk, d
        self.group = h // hk
        if self.where is None:
            self.q, self.k, self.v = (_numpy(_host.contiguous(x)) for x in (q, k, v))
        else:
            self.q, self.k, self.v = (_host.contiguous(x) for x in (q, k, v))
        if not isinstance(causal, (bool, np.bool_)):
            raise ArgumentError(f"causal must be True or False, got {causal!r}")
        self.causal = bool(causal)
        self.scale = 1.0 / math.sqrt(d) if scale is None else _number(scale, "scale")
        p = _number(dropout_p, "dropout_p")
        if not 0.0 <= p < 1.0:
            raise ArgumentError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        self.p = p
        if p > 0 and seed is None:
            if need_seed:
                raise ArgumentError("seed: dropout_p > 0 needs the forward's seed")
            seed = int(np.random.randint(0, 2 ** 62, dtype=np.int64))
        if seed is not None and (isinstance(seed, (bool, np.bool_))
                                 or not isinstance(seed, (int, np.integer))):
            raise ArgumentError(f"seed must be an int, got {seed!r}")
        self.seed = None if seed is None else int(seed) & ((1 << 64) - 1)
        self.mask_kind, self.mask = _mask(mask, (b, h, sq, sk), self.dt,
                                          self.where is not None)
        self.block = K.block_for(sq, sk)
        self.hc = _chunk_heads(h, self.group, sq, d, -(-sq // self.block) * -(-sk // self.block))
        self.chunks = b * h // self.hc
        self.memo = {}      # what the forward derives from these fields (shared by the
                            # problems of one _plain_problem template)

    def options(self, mheads=1) -> K.Options:
        return K.Options(self.d, self.dt, self.hc, self.group, self.causal,
                         self.mask_kind == "key", self.mask_kind == "full", mheads, self.p,
                         self.scale < 0, cuda=self.where is not None, block=self.block)

    def nest(self, build, mheads=1, siblings=False):
        """build(self.options(mheads)) (K.forward or K.backward). siblings (the forward): on
        the host, for a problem taking as many heads per call as a one-block sequence would,
        the nests of the other block classes are built first (the same options and heads per
        call): a model seen at one sequence length then runs inference at another, shorter
        or longer (up to where long sequences take fewer heads per call), compiling nothing,
        at the price of compiling four forward nests at its first call instead of one."""
        own = self.options(mheads)
        if siblings and self.where is None and (own, self.h) not in _SIBLINGS_BUILT:
            if own.hc == _chunk_heads(self.h, self.group, K.BLOCK, self.d, 1):
                for b in K.BLOCKS:
                    if b != self.block:
                        build(dataclasses.replace(own, block=b))
            _SIBLINGS_BUILT.add((own, self.h))  # (checked once: 15.8 -> 2.4 us a masked call)
        return build(own)

    @property
    def chunk_flops(self) -> float:
        """A forward nest call's multiply-adds x 2 (the backward's: 2.5 times as many)."""
        return 4.0 * self.hc * self.sq * self.sk * self.d

    @property
    def serial(self) -> bool:
        """Whether the problem is too small to share (waking the team costs more)."""
        return 4.0 * self.b * self.h * self.sq * self.sk * self.d < _SERIAL_FLOPS


_PLANS: dict = {}
_PLAN_KEYS = 64
_SIBLINGS_BUILT: set = set()    # (options, heads) whose block-class siblings _Problem.nest built
also_clear(_SIBLINGS_BUILT.clear)   # (the nests' caches are cleared with it)
also_clear(_PLANS.clear)        # tpp.clear_caches() drops the templates (and their nests)


def _plain_problem(q, k, v, causal, scale, mask=None):
    """The _Problem of a call without dropout on C-contiguous numpy arrays or CPU torch
    tensors (of a tensor type seen before, not requiring grad) q, k and v, and a mask of the
    same kind or None, from a template per (type, shapes, dtypes, causal, scale, the mask's
    shape and dtype) that _Problem validated and set up before (its arrays dropped): the same
    object for a fraction of the cost (_Problem's checks run ~60 us right after a large call,
    whose data has evicted the interpreter's working set, ~2% of a B8 H12 S128 call on 2
    threads), or None for other arguments. The mask's values are read every call
    (attention_inputs.additive); its kind follows from its shape."""
    t = type(q)
    if type(k) is not t or type(v) is not t or type(causal) is not bool \
            or not (scale is None or type(scale) is float):
        return None
    if t is np.ndarray:
        if not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous):
            return None
        if mask is not None and type(mask) is not np.ndarray:
            return None
    elif t in _host._CPU_TENSOR_TYPES:
        for x in (q, k, v):
            if not x.is_cpu or x.requires_grad or not x.is_contiguous():
                return None
        if mask is not None and (type(mask) not in _host._CPU_TENSOR_TYPES
                                 or not mask.is_cpu or mask.requires_grad):
            return None
    else:
        return None
    key = (t, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal, scale,
           None if mask is None else (tuple(mask.shape), mask.dtype))
    plan = _PLANS.get(key)
    if plan is None:
        pr = _Problem(q, k, v, mask, causal, scale, 0.0, None)     # validates: may raise
        if pr.where is not None:
            return pr
        plan = object.__new__(_Problem)
        plan.__dict__.update(pr.__dict__)
        # the template keeps no caller's data alive
        plan.q = plan.k = plan.v = plan.mask = None
        if len(_PLANS) >= _PLAN_KEYS:
            _PLANS.clear()
        _PLANS[key] = plan
        return pr
    pr = object.__new__(_Problem)
    pr.__dict__.update(plan.__dict__)
    if t is np.ndarray:
        pr.q, pr.k, pr.v = q, k, v
    else:
        pr.q, pr.k, pr.v = _numpy(q), _numpy(k), _numpy(v)
    if mask is not None:
        pr.mask = additive(mask)
    return pr


def _chunk_heads(h, group, sq, d, blocks):
    """Heads per nest call for sq queries of head dim d in `blocks` score blocks per head:
    few when the sequence is long (the backward's scratch holds f32 dQ accumulators and the
    packed query side of its heads, O(hc * Sq * D)), and few enough blocks per call that the
    calls spread evenly over the threads, also when a busy machine takes a thread's core
    away for a while (calls are handed out one at a time, each a few ms)."""
    return _heads_per_call(h, group, max(1, min(SCRATCH_PER_CALL // (4 * max(sq, 1) * d),
                                                BLOCKS_PER_CALL // max(1, blocks))))


def _heads_per_call(h, group, limit=MAX_UNROLL):
    """The largest divisor of h that is a multiple of group and at most MAX_UNROLL and limit
    (group itself when that is larger)."""
    best = group
    for d in range(group, min(h, max(min(MAX_UNROLL, limit), group)) + 1, group):
        if h % d == 0:
            best = d
    return best


_number = _host.finite_number


# ---------------------------------------------------------------- forward
def _forward(q, k, v, mask, causal, scale, dropout_p, seed, want_lse=True):
    pr = None
    if seed is None and (type(dropout_p) is float or type(dropout_p) is int) \
            and dropout_p == 0:
        pr = _plain_problem(q, k, v, causal, scale, mask)
    if pr is None:
        pr = _Problem(q, k, v, mask, causal, scale, dropout_p, seed)
    if pr.where is not None:
        from .attention_device import device_forward
        return device_forward(pr)
    b, h, hk, sq, sk, d, dt = pr.b, pr.h, pr.hk, pr.sq, pr.sk, pr.d, pr.dt
    BQ = BK = pr.block      # noqa: N806  (query and key block rows, as in the nests)
    # torch allocates a torch caller's output: a recording sees it made (ops.replay)
    if pr.torch:
        import torch
        result = _host.torch_empty(b, h, sq, d, dtype=getattr(torch, dt.torch_name))
    else:
        result = _host.np_empty((b, h, sq, d), dt.numpy, _host.ALIGNED_FROM)
    out = _numpy(result)
    nq = -(-sq // BQ)
    nk = -(-sk // BK)
    lse_p = _host.np_empty((b * h, max(nq, 1) * BQ), np.float32, _host.ALIGNED_FROM)
    if b * h and sq:
        _forward_run(pr, out.reshape(b * h, sq, d), lse_p, nq, nk)
    if not want_lse:        # attention(): the log-sum-exp is not returned
        return result, None
    lse = np.ascontiguousarray(lse_p[:, :sq]).reshape(b, h, sq)
    return result, _result(lse, pr.torch)


def _forward_run(pr, out3, lse_p, nq, nk):
    hc, g, d, dt = pr.hc, pr.group, pr.d, pr.dt
    BQ = BK = pr.block      # noqa: N806
    hkc = hc // g
    q3 = pr.q.reshape(-1, pr.sq, d)
    k3 = pr.k.reshape(-1, pr.sk, d)
    v3 = pr.v.reshape(-1, pr.sk, d)
    qt, kt, vt = B.tail(q3, BQ, hc, "q"), B.tail(k3, BK, hkc, "k"), B.tail(v3, BK, hkc, "v")
    outt = B.held("out", (q3.shape[0], BQ, d), dt.numpy) if pr.sq % BQ else \
        B.dummy("out", (hc, BQ, d), dt.numpy)
    got = pr.memo.get("fwd")
    if got is None:     # the nests' constant inputs (read only) and the options
        shared = {"cm": B.key_tail_mask(pr.sk, BK), "scale": np.full(1, pr.scale, np.float32),
                  "ones": B.ones(BK)}
        got = pr.memo["fwd"] = shared, K.vnni(pr.options()), K.tiles(pr.options())
    shared, vnni, tiles = got

    def scratch():
        return dict(B.reused(("fwd", hc, d, dt, vnni, BQ), fresh), **shared)

    def fresh():
        arrays = dict(qT=_host.np_empty((hc, d, BQ), dt.numpy),
                      work=_host.np_empty((hc, K.work_size(d, BQ)), np.float32))
        if vnni:
            arrays.update(qV=_host.np_empty((hc, (d + 1) // 2, 2 * BQ), dt.numpy),
                          pb=_host.np_empty((hc, (2 if tiles else 1) * BK, BQ), dt.numpy),
                          vV=_host.np_empty((hc, BK // 2, 2 * d), dt.numpy))
        return arrays

    masks, mheads = _mask_slabs(pr, nq, nk)
    nest = pr.memo.get(("nest", mheads))
    if nest is None:
        nest = pr.memo[("nest", mheads)] = pr.nest(K.forward, mheads, siblings=True)

    def run(c, arrays, threads):
        arrays.update(q=q3[c * hc:(c + 1) * hc], k=k3[c * hkc:(c + 1) * hkc],
                      v=v3[c * hkc:(c + 1) * hkc], qt=B.chunk(qt, c, hc),
                      kt=B.chunk(kt, c, hkc), vt=B.chunk(vt, c, hkc),
                      out=out3[c * hc:(c + 1) * hc], outt=B.chunk(outt, c, hc),
                      lse=lse_p[c * hc:(c + 1) * hc])
        _run_chunk(pr, nest, arrays, c, masks, nq, threads)

    schedule(pr.chunks, pr.serial, run, scratch, hc, pr.chunk_flops)
    if pr.sq % BQ:
        r = pr.sq % BQ
        recording.host(np.copyto, out3[:, pr.sq - r:], outt[:, :r])


def _run_chunk(pr, nest, arrays, c, masks, nq, threads):
    """One nest call for chunk c (one per query block for full masks)."""
    sizes = {}
    if pr.p:
        sizes.update(SEEDLO=pr.seed & 0xFFFFFFFF, SEEDHI=(pr.seed >> 32) & 0xFFFF,
                     CH=c * pr.hc)
    if masks is None:
        nest.run(arrays, threads, **sizes)
    elif pr.mask_kind == "key":
        arrays["km"] = masks(c)
        nest.run(arrays, threads, **sizes)
    else:
        for i in range(nq):
            arrays["mk"] = masks(c, i)
            nest.run(arrays, threads, I=i, **sizes)


# ---------------------------------------------------------------- backward
def _backward_run(pr, do4, o4, lse, dq, dk, dv):
    hc, g, d, dt, sq, sk = pr.hc, pr.group, pr.d, pr.dt, pr.sq, pr.sk
    BQ = BK = pr.block      # noqa: N806
    hkc = hc // g
    nq, nk = -(-sq // BQ), -(-sk // BK)
    q3, o3, do3 = (x.reshape(-1, sq, d) for x in (pr.q, o4, do4))
    k3, v3 = (x.reshape(-1, sk, d) for x in (pr.k, pr.v))
    dq3, dk3, dv3 = dq.reshape(-1, sq, d), dk.reshape(-1, sk, d), dv.reshape(-1, sk, d)
    tails = {name: B.tail(x3, BQ if name[0] in "qod" else BK, hc if name[0] in "qod" else hkc,
                         name) for name, x3 in (("qt", q3), ("ot", o3), ("dot", do3),
                                                ("kt", k3), ("vt", v3))}
    outs_t = {"dqt": B.held("dqt", (q3.shape[0], BQ, d), dt.numpy) if sq % BQ else
              B.dummy("dqt", (hc, BQ, d), dt.numpy),
              "dkt": B.held("dkt", (k3.shape[0], BK, d), dt.numpy) if sk % BK else
              B.dummy("dkt", (hkc, BK, d), dt.numpy),
              "dvt": B.held("dvt", (k3.shape[0], BK, d), dt.numpy) if sk % BK else
              B.dummy("dvt", (hkc, BK, d), dt.numpy)}
    lse_p = np.full((q3.shape[0], nq * BQ), np.inf, np.float32)
    lse_p[:, :sq] = lse.reshape(-1, sq)
    per_block = pr.mask_kind == "full"
    snq = 1 if per_block else nq
    shared = {"cm": B.key_tail_mask(sk, BK), "scale": np.full(1, pr.scale, np.float32)}

    snk = nk if per_block else 1
    vnni = K.vnni(pr.options())
    # per worker O(hc * Sq * D): kept for the thread's next call only while small
    small = 4 * hc * (snq * BQ + hkc * snk * BK) * d * 3 <= B.REUSED_BYTES

    def scratch():
        if small:
            return dict(B.reused(("bwd", hc, hkc, snq, snk, d, dt, vnni, nest.direct, BQ),
                                fresh), **shared)
        return dict(fresh(), **shared)

    def fresh():
        arrays = dict(delta=_host.np_empty((hc, snq * BQ), np.float32),
                      st=_host.np_empty((hkc, BK, BQ), np.float32),
                      dpt=_host.np_empty((hkc, BK, BQ), np.float32))
        if not nest.direct:     # (a direct nest accumulates in dq, dk, dv)
            arrays.update(gq=_host.np_empty((hc, snq, BQ, d), np.float32),
                          gk=_host.np_empty((hkc, snk, BK, d), np.float32),
                          gv=_host.np_empty((hkc, snk, BK, d), np.float32))
        if K.vnni(pr.options()):
            pairs = (d + 1) // 2
            arrays.update(qT=_host.np_empty((hc, d, BQ), dt.numpy),
                          qV=_host.np_empty((hc, snq, pairs, 2 * BQ), dt.numpy),
                          doV=_host.np_empty((hc, snq, pairs, 2 * BQ), dt.numpy),
                          qN=_host.np_empty((hc, snq, BQ // 2, 2 * d), dt.numpy),
                          doN=_host.np_empty((hc, snq, BQ // 2, 2 * d), dt.numpy),
                          pb=_host.np_empty((hkc, BK, BQ), dt.numpy),
                          dsb=_host.np_empty((hkc, (2 if K.tiles(pr.options()) else 1) * BK, BQ),
                                       dt.numpy),
                          kN=_host.np_empty((hkc, BK // 2, 2 * d), dt.numpy))
        else:
            arrays.update(qT=_host.np_empty((hc, snq, d, BQ), dt.numpy),
                          doT=_host.np_empty((hc, snq, d, BQ), dt.numpy))
        return arrays

    masks, mheads = _mask_slabs(pr, nq, nk)
    nest = pr.nest(K.backward, mheads)

    def run(c, arrays, threads):
        qs, ks = slice(c * hc, (c + 1) * hc), slice(c * hkc, (c + 1) * hkc)
        arrays.update(q=q3[qs], o=o3[qs], do=do3[qs], k=k3[ks], v=v3[ks], lse=lse_p[qs],
                      dq=dq3[qs], dk=dk3[ks], dv=dv3[ks])
        for name, arr in tails.items():
            arrays[name] = B.chunk(arr, c, hc if name[0] in "qod" else hkc)
        for name, arr in outs_t.items():
            arrays[name] = B.chunk(arr, c, hc if name == "dqt" else hkc)
        _run_chunk(pr, nest, arrays, c, masks, nq, threads)

    schedule(pr.chunks, pr.serial, run, scratch, hkc, pr.chunk_flops)
    for x3, tail_arr, block in ((dq3, outs_t["dqt"], BQ), (dk3, outs_t["dkt"], BK),
                                (dv3, outs_t["dvt"], BK)):
        r = x3.shape[1] % block
        if r:
            x3[:, x3.shape[1] - r:] = tail_arr[:, :r]
