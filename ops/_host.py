"""Array bookkeeping the operators share: the kind of array given is the kind returned.

Operators take numpy arrays or torch CPU tensors and return the kind they were given; these
helpers allocate, view and validate without copying where the layout allows. The operators
that run on a GPU too (ops.matmul, ops.linear, the MLP, ops.pack_*, ops.blocked, ops.norms,
ops.residual_norm) also take device arrays: torch CUDA tensors (used as they are) and anything
with `__cuda_array_interface__` or a CUDA DLPack capsule (cupy, numba, ...), which `host(x,
name, device=True)` turns into a `DeviceView`. Their outputs come from the device's backend
(`empty`: torch CUDA for torch inputs, else what the backend's `empty` gives, cupy for the
CUDA backend), on the inputs' device; every device-side step is a TPP kernel or nest.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
import types

import numpy as np

import tpp
from tpp.runtime import arrays, device_arrays, recording, registry
from tpp.runtime.device import CPU, Device
from tpp.runtime.device_arrays import CudaView
from tpp.runtime.lru import LRU, also_clear

from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError, UnsupportedError


def host(x, name: str, device: bool = False):
    """x as a numpy array or CPU torch tensor; with device=True a device array too (a torch
    CUDA tensor as it is, other device data as a DeviceView), else device data is an
    UnsupportedError naming the operator and the device. numpy arrays and CPU tensors of a
    type seen before return at once (a tensor's .device costs ~0.8 us; .is_cpu ~0.1)."""
    t = type(x)
    if t is np.ndarray or (t in _CPU_TENSOR_TYPES and x.is_cpu):
        return x
    if t is DeviceView and device:
        return x
    arr = arrays.as_array(x, name)
    if isinstance(arr, np.ndarray):     # a subclass (np.memmap, ...): its plain ndarray view
        return arr.view(np.ndarray)
    where = arrays.device_of(arr)
    if not where.is_host:
        if not device:
            raise UnsupportedError(f"{_operator()}: {name} is on {where} "
                                   f"({type(x).__name__}); this operator runs on the CPU only "
                                   f"(on a GPU: ops.matmul, ops.linear, the MLP, ops.pack_kn / "
                                   f"pack_nk, ops.blocked, the norms and softmax, attention, "
                                   f"conv2d)")
        return arr if arrays.is_torch(arr) else DeviceView.of(arr)
    if arr is x and arrays.is_torch(x) and t.__module__.startswith("torch"):
        _CPU_TENSOR_TYPES.add(t)     # torch.Tensor, torch.nn.Parameter
    return arr


_CPU_TENSOR_TYPES: set = set()


def know_cpu_tensor_types(*types):
    """Let host() (and the planned calls' signatures, ops.norm_plans) take these torch tensor
    types at once, before their first sight (torch.Tensor, torch.nn.Parameter)."""
    _CPU_TENSOR_TYPES.update(types)


def _operator() -> str:
    """The public ops entry point the current call came through (the outermost ops frame on
    the stack: ops.layer_norm, ops.torch_norms.LayerNorm.forward, ...), for error messages."""
    name, frame = "ops", sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("ops.") and module != __name__:
            code = frame.f_code
            package = sys.modules.get("ops")
            fn = getattr(package, code.co_name, None) if package is not None else None
            if getattr(fn, "__code__", None) is code:
                name = f"ops.{code.co_name}"
            else:
                name = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
        frame = frame.f_back
    return name


class DeviceView:
    """A view of device memory for the operators: address, shape, strides (elements), numpy
    dtype, device, and the producer's object `obj` (kept alive). It exposes
    `__cuda_array_interface__` (v3), so kernels and nests take it like the producer's array,
    and offers what the operators use on arrays: shape, ndim, dtype, reshape (C-contiguous
    views only), T (2-D) and is_contiguous()."""

    __slots__ = ("obj", "ptr", "shape", "strides", "dtype", "readonly", "index")

    def __init__(self, obj, ptr, shape, strides, dtype, readonly, index):
        self.obj, self.ptr, self.shape, self.strides = obj, ptr, tuple(shape), tuple(strides)
        self.dtype, self.readonly, self.index = dtype, readonly, index

    @staticmethod
    def of(view: CudaView) -> "DeviceView":
        return DeviceView(view.obj, view.ptr, view.shape, view.strides, view.dtype,
                          view.readonly, view.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def where(self) -> Device:
        return Device("cuda", self.index)

    @property
    def device(self):
        """The producer-style device (`.id`), read by tpp.runtime.device_arrays."""
        return types.SimpleNamespace(id=self.index)

    @property
    def __cuda_array_interface__(self) -> dict:
        size = self.dtype.itemsize
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.ptr, self.readonly),
                "strides": tuple(s * size for s in self.strides)}

    def is_contiguous(self) -> bool:
        """C-contiguous strides (any strides when there are no elements)."""
        return 0 in self.shape or arrays.contiguous(self.shape, self.strides)

    def reshape(self, *shape) -> "DeviceView":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if math.prod(shape) != math.prod(self.shape) or not self.is_contiguous():
            raise ArgumentError(f"cannot view device data of shape {self.shape} (strides "
                                f"{self.strides}) as {shape}")
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        return DeviceView(self.obj, self.ptr, shape, tuple(reversed(strides)), self.dtype,
                          self.readonly, self.index)

    @property
    def T(self) -> "DeviceView":
        return DeviceView(self.obj, self.ptr, self.shape[::-1], self.strides[::-1], self.dtype,
                          self.readonly, self.index)

    def __repr__(self):
        return f"<DeviceView {self.shape} {self.dtype} on cuda:{self.index}>"


def on_device(x) -> bool:
    """Whether x (an array as `host(..., device=True)` returns it, or a backend's device
    array: cupy, ...) lives on a device."""
    t = type(x)
    if t is np.ndarray:
        return False
    if t is DeviceView:
        return True
    if arrays.is_torch(x):
        return not x.is_cpu
    return device_arrays.is_cuda_object(x)


def device_of(x) -> Device:
    """The Device of an operator's array (as host(..., device=True) returns it, or the
    backend's allocation)."""
    t = type(x)
    if t is np.ndarray:
        return CPU
    if t is DeviceView:
        return x.where
    if arrays.is_torch(x):
        return CPU if x.is_cpu else arrays.device_of(x)
    return arrays.device_of(arrays.as_array(x, "array"))


def same_device(**named) -> Device:
    """The one Device of the named arrays (None values skipped). UnsupportedError (the
    registry's) for data on a device no backend runs (meta, ...); ArgumentError naming them
    when they live on different devices."""
    where = {}
    for name, x in named.items():
        if x is not None:
            where.setdefault(device_of(x), name)
    for d in where:
        if not d.is_host:
            registry.for_device(d)
    if len(where) > 1:
        raise arrays.different_devices(where)
    return next(iter(where), CPU)


def wants_grad(*tensors) -> bool:
    """Whether autograd records a call on these torch tensors (None allowed): grad mode is on
    and one of them requires a gradient. The torch drop-ins skip their autograd.Function
    (its cost and what it keeps for a backward) otherwise."""
    import torch
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def reject_unknown(fn, unknown: dict):
    """ArgumentError if `unknown` (the **unknown a public entry point `fn` collected) is not
    empty, naming fn as users call it (ops.matmul, ops.blocked.transpose) and the keywords it
    accepts. The rule every ops entry point follows: a misspelt keyword is never a TypeError."""
    if unknown:
        checks.reject_unknown_call(_public_name(fn), unknown, _parameters(fn))


def _public_name(fn) -> str:
    package = sys.modules.get("ops")
    if package is not None and getattr(package, fn.__name__, None) is fn:
        return f"ops.{fn.__name__}"
    return f"{fn.__module__}.{fn.__qualname__}"


def _parameters(fn) -> tuple:
    """fn's named parameters (positional or keyword), without *args and **kwargs."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def dtype_of(x, name: str) -> _dt.DType:
    try:
        dt = _dt.lookup(x.dtype)
    except Exception:
        dt = None
    if dt not in _dt.FLOAT_DTYPES:
        raise ArgumentError(f"{name}: expected f32, bf16 or f16 data, got {getattr(x, 'dtype', x)}")
    return dt


ALIGN = 64     # bytes: where every host array the operators allocate starts


ALIGNED_FROM = 1 << 16   # bytes from which per-call outputs are aligned (np_empty's from_bytes)


def np_empty(shape, dtype, from_bytes: int = 0) -> np.ndarray:
    """np.empty at a 64-byte boundary (an array over a buffer 64 bytes larger) when it holds
    from_bytes or more, else plain np.empty. numpy only promises 16 bytes, and a 64-byte
    load or AMX tile row that straddles two cache lines costs two: bf16 BRGEMMs on tiles ran
    at ~900 instead of ~2700 GFLOP/s (32x32x256 x1000, one Sapphire Rapids core) on numpy's
    placement. The aligned array costs ~1 us to make against np.empty's ~0.25: a per-call
    output of a small problem passes from_bytes (ALIGNED_FROM). dtype: a numpy dtype."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if hasattr(shape, "__iter__") else (int(shape),)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < from_bytes:
        return np.empty(shape, dtype)
    buf = np.empty(nbytes + ALIGN, np.uint8)
    return np.ndarray(shape, dtype, buf, -arrays.address(buf) % ALIGN)


def np_zeros(shape, dtype) -> np.ndarray:
    out = np_empty(shape, dtype)
    out.fill(0)
    return out


def empty(shape, dtype: _dt.DType, like):
    """An uninitialised array of the same kind as `like` (numpy array, torch tensor) on its
    device: on a GPU, what the device's backend allocates (a torch tensor for torch `like`,
    else the backend's array: cupy for CUDA)."""
    if type(like) is np.ndarray:
        return np_empty(shape, dtype.numpy)
    if arrays.is_torch(like):
        if not like.is_cpu:
            return _device_empty(shape, dtype, like)
        import torch
        return torch_empty(*shape, dtype=getattr(torch, dtype.torch_name))
    if on_device(like):
        return _device_empty(shape, dtype, like)
    return np_empty(shape, dtype.numpy)


def as_torch(arr):
    """arr (a host numpy array) as a torch CPU tensor viewing the same memory (bf16 too)."""
    import torch
    if arr.dtype == _dt.BF16.numpy:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def like(arr, like_this):
    """arr (a host numpy array) as an array of like_this's kind: as_torch(arr) when
    like_this is a torch tensor, else arr itself."""
    return as_torch(arr) if arrays.is_torch(like_this) else arr


# ------------------------------------------------------------ per-thread scratch
# An operator's large intermediate (never returned to the caller) is kept by the thread that
# made it and handed to its next call of the same name: a fresh 64 MB array costs ~8-15 ms of
# page faults here, as long as a pass over it. At most SCRATCH_KEEP_BYTES per name and
# thread are kept (larger ones are made fresh every call); tpp.clear_caches() drops the
# calling thread's.
SCRATCH_KEEP_BYTES = 128 << 20
_SCRATCH = threading.local()


def scratch(name: str, shape, dtype: _dt.DType) -> np.ndarray:
    """An uninitialised C-contiguous host array for an intermediate called `name`: the one
    this thread's last call of that name used when the shape and dtype are the same. Its
    contents are undefined, and it is valid only until this thread asks for `name` again:
    two live intermediates need two names."""
    shape = tuple(shape)
    if math.prod(shape) * dtype.itemsize > SCRATCH_KEEP_BYTES:
        return np_empty(shape, dtype.numpy)
    kept = _SCRATCH.__dict__.setdefault("arrays", {})
    arr = kept.get(name)
    if arr is None or arr.shape != shape or arr.dtype != dtype.numpy:
        kept[name] = None       # the old one goes before the new one is made
        arr = kept[name] = np_empty(shape, dtype.numpy)
    return arr


also_clear(lambda: _SCRATCH.__dict__.pop("arrays", None))


def temp(name, shape, dtype: _dt.DType, like, zero: bool = False):
    """An intermediate of one call, of like's kind: for host data this thread's scratch
    `name` (its rules: valid until the thread asks for `name` again), on a device or with
    name None a fresh array; zeroed when asked. A large temporary made fresh on every call
    page-faults in on every call once glibc has trimmed the heap or unmapped the block
    (1000-1500 faults per call, 11 -> 20-28 ms, a conv backward of 3x3 512 @7 f32 in a VM)."""
    if name is None or on_device(like):
        return (zeros if zero else empty)(shape, dtype, like)
    arr = scratch(name, shape, dtype)
    if zero:
        arr.fill(0)
    return as_torch(arr) if arrays.is_torch(like) else arr


# ------------------------------------------------------------ large torch outputs
# A fresh output bigger than glibc's mmap threshold comes from mmap: its first write faults
# every 4 KiB page in (~2 us each in a VM: 64 MB -> ~30 ms, as long as a 2-thread GEMM of
# 1.5 GFLOP). numpy asks the kernel for transparent huge pages on allocations of 4 MB and
# more (madvise MADV_HUGEPAGE: 512x fewer faults, 64 MB -> ~8 ms); torch's CPU allocator
# does not unless THP_MEM_ALLOC_ENABLE is set. torch_empty gives the operators' large
# torch outputs the same advice numpy's get (the 2 MiB-aligned interior of the block; a
# no-op where the kernel has THP off or the memory is already resident).
HUGE_PAGE = 2 << 20
ADVISE_BYTES = 4 << 20          # numpy's threshold
_MADV_HUGEPAGE = 14             # Linux
_MADVISE = []                   # [libc madvise] once looked up; [None] where unavailable


def _madvise():
    if not _MADVISE:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                fn = ctypes.CDLL(None).madvise
                fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _MADVISE.append(fn)
    return _MADVISE[0]


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for transparent huge pages over the whole 2 MiB pages inside [address, address +
    nbytes) (advice only: errors are ignored)."""
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    fn = _madvise() if hi > lo else None
    if fn is not None:
        fn(lo, hi - lo, _MADV_HUGEPAGE)


def torch_empty(*sizes, dtype, like=None):
    """torch.empty(*sizes, dtype=dtype) on the CPU, advised to huge pages from ADVISE_BYTES
    (as numpy advises its arrays); with a torch tensor `like` not on the CPU,
    like.new_empty(sizes, dtype=dtype) on its device."""
    if like is not None and not like.is_cpu:
        return like.new_empty(sizes, dtype=dtype)
    import torch
    t = torch.empty(*sizes, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= ADVISE_BYTES:
        advise_huge_pages(t.data_ptr(), nbytes)
    return t


def _device_empty(shape, dtype, like):
    where = device_of(like)
    return registry.for_device(where).empty(tuple(int(d) for d in shape), dtype, where,
                                            arrays.is_torch(like))


def zeros(shape, dtype: _dt.DType, like):
    """Zeros like `empty`; on a device written by the zero TPP."""
    if on_device(like):
        out = _device_empty(shape, dtype, like)
        cols = shape[-1] if len(shape) else 1
        rows = math.prod(shape) // cols if cols else 0
        if rows and cols:
            tpp.unary("zero", rows, cols, dtype_in=dtype)(out=reshape(out, (rows, cols)))
        return out
    if arrays.is_torch(like):
        import torch
        out = torch_empty(*shape, dtype=getattr(torch, dtype.torch_name))
        recording.host(_zero, out)          # a step a recording replays (ops.replay)
        return out
    return np_zeros(shape, dtype.numpy)


def _zero(out):
    out.zero_()


_CONSTANTS = LRU(64, "device_constants")   # (Device, DType, torch?, value, n) -> n-element array


def constant(value: float, dtype: _dt.DType, like, n: int = 1):
    """A read-only-by-convention array of n elements `value` where `like` lives (made there
    once per device, dtype, kind and n, then reused)."""
    where, torch_kind = device_of(like), arrays.is_torch(like)
    key = (where, dtype, torch_kind, value, n)
    arr = _CONSTANTS.get(key)
    if arr is None:
        arr = _CONSTANTS[key] = registry.for_device(where).to_device(
            np.full(n, value, dtype.numpy), where, torch_kind)
    return arr


def reshape(x, shape):
    """x viewed with `shape` (its own reshape; a DeviceView for device data without one)."""
    if hasattr(x, "reshape"):
        return x.reshape(tuple(shape))
    return DeviceView.of(arrays.as_array(x, "array")).reshape(shape)


def contiguous(x):
    """x itself when C-contiguous, else a C-contiguous copy (the nests take dense tensors);
    on a device the copy is a TPP (2-D arrays with one unit stride): see _device_copy. A torch
    tensor with the negative bit set (a lazy negation) is copied with its values resolved."""
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    if isinstance(x, np.ndarray):       # a subclass (np.memmap, ...): its plain ndarray view
        return contiguous(x.view(np.ndarray))
    if arrays.is_torch(x):
        if x.is_neg():      # torch's lazy negation: its memory holds -x
            x = x.resolve_neg()
        if x.is_contiguous():
            return x
        if not x.is_cpu:
            return _device_copy(x)
        if x.requires_grad:
            return x.contiguous()
        out = torch_empty(*x.shape, dtype=x.dtype)
        recording.host(_copy, out, x)       # a step a recording replays (ops.replay)
        return out
    x = host(x, "array", device=True)       # other device data: a DeviceView
    return x if x.is_contiguous() else _device_copy(x)


def _copy(out, x):
    out.copy_(x)


def _device_copy(x):
    """A C-contiguous device copy of a device array: a 2-D one whose rows (identity TPP) or
    columns (transpose TPP of the transposed view) are unit-stride by a TPP; other torch
    tensors by torch's .contiguous() (as on the host); else UnsupportedError."""
    shape = tuple(x.shape)
    strides = tuple(x.stride()) if arrays.is_torch(x) else x.strides
    dt = dtype_of(x, "array")
    if len(shape) == 2:
        out = _device_empty(shape, dt, x)
        rows, cols = shape
        if strides[1] == 1:
            tpp.unary("identity", rows, cols, dtype_in=dt)(x, out=out)
            return out
        if strides[0] == 1:
            tpp.unary("transpose", cols, rows, dtype_in=dt)(x.T, out=out)
            return out
    if arrays.is_torch(x):
        return x.contiguous()
    raise UnsupportedError(f"{_operator()}: device data of shape {shape} and strides {strides} "
                           f"(elements) must be C-contiguous (or 2-D with one unit stride)")


def overlap(a, b) -> bool:
    """Whether the memory two arrays (host or device, as the operators hold them) span
    intersects."""
    return arrays.overlap(arrays.as_array(a, "a"), arrays.as_array(b, "b"))


def rows(x, k: int, name: str):
    """x (..., k) as a C-contiguous (M, k) view and the leading shape."""
    shape = tuple(x.shape)
    if len(shape) < 1 or shape[-1] != k:
        raise ArgumentError(f"{name}: expected shape (..., {k}), got {shape}")
    lead = shape[:-1]
    m = 1
    for d in lead:
        m *= d
    x = contiguous(x)
    return x.reshape(m, k), lead


_OPTIMIZER_STEPS = [0]      # torch.optim steps taken in this process (weight_key)
_WATCHING_STEPS: list = []


def _count_step(optimizer, args, kwargs):
    _OPTIMIZER_STEPS[0] += 1


def optimizer_steps() -> int:
    """The torch.optim steps taken in this process so far (counted once weight_key ran)."""
    return _OPTIMIZER_STEPS[0]


def weight_key(w, fresh: bool = False) -> tuple:
    """What identifies a torch weight's values to a packed copy of it: storage address, version
    counter (in-place writes bump it), the count of optimizer steps taken in the process
    (torch's fused optimizers, fused=True, update weights without bumping their versions; a
    step of any optimizer makes every key new, counted by a global step hook), dtype, shape
    and strides. An inference tensor (made under torch.inference_mode) has no version
    counter: its key is new at every call, so its packed copy is rebuilt each time rather
    than trusted after a write it cannot see. So is the key of a weight read with
    fresh=True: a training call's (training_call)."""
    if not _WATCHING_STEPS:
        from torch.optim import optimizer
        optimizer.register_optimizer_step_post_hook(_count_step)
        _WATCHING_STEPS.append(True)
    if fresh or w.is_inference():
        return (w.data_ptr(), object(), w.dtype, w.shape, w.stride())
    return (w.data_ptr(), w._version, _OPTIMIZER_STEPS[0], w.dtype, w.shape, w.stride())


def torchs_to_dispatch(tensors) -> bool:
    """Whether torch's own operator must take a call on these tensors (None allowed):
    __torch_function__ objects (tensor subclasses), or a torch.func transform in progress
    (vmap, grad, jvp, ...), whose wrapped tensors hold no storage a kernel could read."""
    import torch
    return (torch.overrides.has_torch_function(tuple(t for t in tensors if t is not None))
            or transforming())


def transforming() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is in progress (~25 ns)."""
    import torch
    return torch._C._functorch.peek_interpreter_stack() is not None


def training_call(module) -> bool:
    """Whether a call of module is a training step (module.training, grad mode on). Its
    weights' packed copies are made afresh (weight_key(w, fresh=True)): a training loop may
    update the weights without bumping their version counters (p.data.sub_(lr * p.grad), as
    torch's own tutorials do), and a copy kept from one step would be stale at the next. A
    copy made then also never serves a later call, so an evaluation after training packs
    again."""
    import torch
    return module.training and torch.is_grad_enabled()


def packed_copy(module, name, sources, make):
    """make()'s value (a packed copy of module's weights), cached in module.__dict__
    ["_tpp_packed"] under name while every source tensor's weight_key is unchanged (None
    sources allowed; off the CPU the key names the device too, so a moved parameter is
    packed again). The detached sources are kept alive with the entry: their addresses are
    part of the key and must not be reused by other tensors while it lives. The cache is
    derived data: the modules using it drop it when pickled or deep-copied."""
    cache = module.__dict__.get("_tpp_packed")
    if cache is None:
        cache = module.__dict__["_tpp_packed"] = {}
    fresh = training_call(module)
    key = tuple(None if t is None else weight_key(t, fresh) if t.is_cpu else
                (t.device, weight_key(t, fresh)) for t in sources)
    got = cache.get(name)
    if got is not None and got[0] == key:
        return got[1]
    value = make()
    cache[name] = (key, value, tuple(None if t is None else t.detach() for t in sources))
    return value


def finite_number(value, name: str) -> float:
    """A finite real number (not a bool, not a string) as a float; ArgumentError otherwise."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise ArgumentError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ArgumentError(f"{name} must be finite, got {value!r}")
    return v
