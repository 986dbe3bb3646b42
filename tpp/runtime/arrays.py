"""Binding user arrays to a primitive's operands: validation, pointers, leading dimensions.

Accepted on the host: numpy arrays, torch CPU tensors, and anything numpy can view without a
copy (`__array_interface__`, the buffer protocol, DLPack). On a GPU: torch CUDA tensors and
anything with `__cuda_array_interface__` or a CUDA DLPack capsule (cupy, numba, ...), seen
through `tpp.runtime.device_arrays.CudaView`. Every check raises ArgumentError (or UnsupportedError for
what no backend can run) naming the operand, what was expected and what was given; nothing
reaches compiled code unchecked.

Validation costs O(1) Python work per operand. What depends only on an array's signature
(its type, shape, strides, dtype and device: `signature`) is computed once per signature and
cached: its `Layout` (dtype, strides in elements, the byte span around its first element) and,
per operand, the ld a block check returns (`LayoutChecks`). What depends on the object itself
is read on every call: its address, its writability and, for torch outputs, its autograd state.
Overlap is decided on (address, byte span) integers (`span`, `extent`, `overlap`).
"""
from __future__ import annotations

from dataclasses import dataclass

import ctypes

import cffi
import numpy as np

from . import device_arrays
from ..core import dtypes as _dt
from .device import CPU, Device
from .device_arrays import CudaView
from ..core.errors import ArgumentError, UnsupportedError
from . import registry
from .lru import also_clear

ffi = cffi.FFI()
_cast = ffi.cast

CACHE_LIMIT = 256    # entries a signature cache keeps before it starts over

_NP_DTYPES = {d.numpy: d for d in (_dt.F32, _dt.BF16, _dt.F16, _dt.I64, _dt.U8)}
_TORCH_DTYPES: dict = {}


def _torch_dtype(t):
    if not _TORCH_DTYPES:
        import torch
        for d in (_dt.F32, _dt.BF16, _dt.F16, _dt.I64, _dt.U8):
            _TORCH_DTYPES[getattr(torch, d.torch_name)] = d
    return _TORCH_DTYPES.get(t.dtype)


_TORCH_TYPES: set = set()       # the torch tensor types seen (is_torch's fast answer)


def is_torch(obj) -> bool:
    t = type(obj)
    if t in _TORCH_TYPES:
        return True
    if t.__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        _TORCH_TYPES.add(t)
        return True
    return False


def as_array(obj, name: str):
    """obj itself if it is a numpy array or a torch tensor (any device), a CudaView of other
    device data, else a zero-copy numpy view."""
    if type(obj) is np.ndarray or is_torch(obj):
        return obj
    if isinstance(obj, np.ndarray):
        return obj
    if device_arrays.is_cuda_object(obj):
        return device_arrays.view(obj, name)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array_struct__"):
        return np.asarray(obj)
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (RuntimeError, BufferError, TypeError) as exc:
            raise ArgumentError(f"{name}: cannot view {type(obj).__name__} on the host: {exc}")
    try:
        memoryview(obj)
    except TypeError:
        raise ArgumentError(f"{name}: expected an array (numpy, torch, cupy, or an object with "
                            f"__array_interface__, __cuda_array_interface__ or __dlpack__), got "
                            f"{type(obj).__name__}") from None
    return np.asarray(obj)


def as_host_array(obj, name: str, what: str = "this operation"):
    """Like as_array, for code that runs on the CPU only: device data is an UnsupportedError."""
    arr = as_array(obj, name)
    device = device_of(arr)
    if not device.is_host:
        raise UnsupportedError(f"{name}: data on {device} ({type(obj).__name__}); {what} runs "
                               f"on the CPU only")
    return arr


def device_of(arr) -> Device:
    """The Device where a bound array's data lives (CPU for host memory)."""
    if type(arr) is np.ndarray:
        return CPU
    if isinstance(arr, CudaView):
        return Device("cuda", arr.device)
    if is_torch(arr) and arr.device.type != "cpu":
        return Device(arr.device.type, arr.device.index or 0)
    return CPU


def common_device(named_arrays) -> Device:
    """The one device of all (name, array) pairs; a mix is an ArgumentError."""
    where = {}
    for name, arr in named_arrays:
        where.setdefault(device_of(arr), name)
    if len(where) > 1:
        raise different_devices(where)
    return next(iter(where), CPU)


def different_devices(where: dict) -> ArgumentError:
    """The error for operands on several devices; where: Device -> the first operand's name
    there."""
    spots = ", ".join(f"{name} on {'the host' if d.is_host else d}" for d, name in where.items())
    return ArgumentError(f"the operands live on different devices ({spots}); move them to one "
                         f"device first")


def shared_device(layouts, named_arrays) -> Device:
    """The one device of `layouts` (the host also when there are none: a call of an op
    with no input arrays and no outputs given allocates them on the host); where they differ,
    common_device's error naming the (name, array) pairs."""
    if not layouts:
        return CPU
    device = layouts[0].device
    for lay in layouts:
        if lay.device != device:
            return common_device(named_arrays)
    return device


def user_object(arr):
    """What to hand back to the user for a bound array (the producer's object for a view)."""
    return arr.obj if isinstance(arr, CudaView) else arr


def to_host(arr) -> np.ndarray:
    """A numpy copy (or view) of a bound array, from any device (synchronises for device data)."""
    if isinstance(arr, CudaView):
        import cupy
        return cupy.asnumpy(arr.obj)
    if is_torch(arr):
        return arr.detach().cpu().numpy()
    return arr


# ------------------------------------------------------------ layouts (cached per signature)
@dataclass(frozen=True, eq=False, slots=True)
class Layout:
    """What validation reads from an array apart from its address, writability and autograd
    state. A function of the array's signature, so computed once per signature (`layout`).
    Compared and hashed by identity (a cheap key for the per-operand caches)."""
    dtype: object          # the library's DType, None when it has none
    native: object         # the producer's dtype (for messages)
    shape: tuple
    strides: tuple         # in elements
    itemsize: int
    device: Device          # where the data lives (tpp.runtime.device)
    kind: str              # "numpy" (anything numpy reads), "torch" or "cuda" (a CudaView)
    low: int               # bytes from the first element to the lowest byte spanned (<= 0)
    high: int              # bytes from the first element to one past the highest (0: empty)

    def same_view(self, addr: int, other: "Layout", other_addr: int) -> bool:
        """Whether (self, addr) and (other, other_addr) are the identical array: same kind,
        address, shape, strides and element size (an element-wise op may write onto it)."""
        return (addr == other_addr and self.kind == other.kind and self.shape == other.shape
                and self.strides == other.strides and self.itemsize == other.itemsize)


_LAYOUTS: dict = {}     # signature -> Layout
also_clear(_LAYOUTS.clear)
_TORCH_STRIDED: list = []


def signature(arr):
    """A hashable key of everything `layout` reads (type, shape, strides, dtype, device), or
    None for arrays whose layout is not cached (device views, numpy subclasses, tensors that
    are not strided); () for None (no array). Arrays with equal signatures have equal
    layouts."""
    t = type(arr)
    if t is np.ndarray:
        return t, arr.shape, arr.strides, arr.dtype
    if arr is None:
        return ()
    if is_torch(arr):
        if not _TORCH_STRIDED:
            import torch
            _TORCH_STRIDED.append(torch.strided)
        if arr.layout is not _TORCH_STRIDED[0] or arr.is_neg():
            return None
        return t, arr.shape, arr.stride(), arr.dtype, arr.device
    return None


def signatures(*arrs):
    """The tuple of the arrays' signatures (an absent array, None, counts as ()), or None if
    one of them has no signature: a key for what a call decides from its arrays' layouts."""
    key = tuple(map(signature, arrs))
    return None if None in key else key


def remember(cache: dict, key, value) -> None:
    """cache[key] = value in a cache of at most CACHE_LIMIT entries (it starts over when full:
    the entries are cheap to recompute). A key of None is not stored."""
    if key is not None:
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        cache[key] = value


def layout(arr, name: str) -> Layout:
    """The Layout of a bound array (see as_array); ArgumentError for strides that are not
    whole elements and tensors without strided memory, UnsupportedError for other devices."""
    key = signature(arr)
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _compute_layout(arr, name)
        remember(_LAYOUTS, key, lay)
    return lay


def _compute_layout(arr, name: str) -> Layout:
    if isinstance(arr, CudaView):
        return _make_layout(_NP_DTYPES.get(arr.dtype), arr.dtype, arr.shape, arr.strides,
                            arr.itemsize, Device("cuda", arr.device), "cuda")
    if is_torch(arr):
        if str(arr.layout) != "torch.strided":
            raise ArgumentError(f"{name}: a {arr.layout} tensor has no strided memory to read; "
                                f"pass a dense tensor (.to_dense())")
        if arr.is_neg():    # its memory holds -x: a kernel reading it would compute on that
            raise ArgumentError(f"{name}: a tensor with torch's negative bit set (a lazy "
                                f"negation, e.g. x.conj().imag): pass x.resolve_neg()")
        return _make_layout(_torch_dtype(arr), arr.dtype, tuple(arr.shape), tuple(arr.stride()),
                            arr.element_size(), device_of(arr), "torch")
    isz = arr.itemsize
    strides = arr.strides
    if any(s % isz for s in strides):
        raise ArgumentError(f"{name}: strides {strides} are not multiples of the element size {isz}")
    return _make_layout(_NP_DTYPES.get(arr.dtype), arr.dtype, tuple(arr.shape),
                        tuple(s // isz for s in strides), isz, CPU, "numpy")


def _make_layout(dtype, native, shape, strides, itemsize, device, kind) -> Layout:
    low, high = span(shape, strides, itemsize)
    return Layout(dtype, native, tuple(int(d) for d in shape), tuple(int(s) for s in strides),
                  int(itemsize), device, kind, low, high)


def span(shape, strides, itemsize: int) -> tuple:
    """(low, high): an array of this shape and these strides (in elements, any sign) spans the
    bytes [first element + low, first element + high); (0, 0) when it has no elements."""
    low = high = 0
    for d, s in zip(shape, strides):
        if d == 0:
            return 0, 0
        if s < 0:
            low += (d - 1) * s
        else:
            high += (d - 1) * s
    return low * itemsize, (high + 1) * itemsize


def geometry(arr, name: str):
    """(DType or None, shape, strides in elements, writable, native dtype) of an array/tensor."""
    lay = layout(arr, name)
    return lay.dtype, lay.shape, lay.strides, writable(arr, lay), lay.native


def writable(arr, lay: Layout) -> bool:
    """Whether the array may be written (numpy's flag, a view's read-only bit; torch: True)."""
    if lay.kind == "numpy":
        return arr.flags.writeable
    return lay.kind == "torch" or not arr.readonly


def first_block(arr):
    """arr[0] of a batched (count, rows, cols) array, as a view."""
    if isinstance(arr, CudaView):
        return CudaView(arr.obj, arr.ptr, arr.shape[1:], arr.strides[1:], arr.dtype,
                        arr.readonly, arr.device)
    return arr[0]


def pointer(arr):
    """A cffi void* to the first element (zero copy)."""
    return _cast("void *", address(arr))


def address(arr) -> int:
    """The address of the first element, as an int (for calls through integer arguments)."""
    if type(arr) is np.ndarray:
        if _DATA_FIELD is not None:
            return _DATA_FIELD(id(arr) + _DATA_OFFSET).value
        return arr.ctypes.data
    if isinstance(arr, CudaView):
        return arr.ptr
    return arr.data_ptr() if is_torch(arr) else arr.ctypes.data


def _numpy_data_field():
    """(reader, offset): where an ndarray object keeps its data pointer, read as
    reader(id(arr) + offset).value in ~0.1 us (.ctypes.data takes ~1 us). numpy's C ABI fixes
    the field (PyArrayObject_fields.data, right after the object header) and CPython's id() is
    the object's address; both are verified here on sample arrays, and where they do not hold
    (another Python implementation) the reader is None and .ctypes.data is used."""
    reader, offset = ctypes.c_size_t.from_address, object.__basicsize__
    base = np.zeros((4, 6))
    samples = (base, base[1:, ::-2], base.T, np.zeros(0, np.uint8), np.arange(5)[::-1])
    try:
        if all(reader(id(a) + offset).value == a.ctypes.data for a in samples):
            return reader, offset
    except (TypeError, ValueError, OverflowError):
        pass
    return None, 0


_DATA_FIELD, _DATA_OFFSET = _numpy_data_field()


def extent(arr, name: str = "array") -> tuple:
    """[first byte, last byte + 1) of the memory an array or tensor spans (empty: lo == hi)."""
    lay = layout(arr, name)
    start = address(arr)
    return start + lay.low, start + lay.high


def overlap(a, b) -> bool:
    """Whether the memory spans of two arrays/tensors intersect."""
    return spans_overlap(extent(a), extent(b))


def spans_overlap(a: tuple, b: tuple) -> bool:
    """Whether two byte ranges [lo, hi) intersect (an empty range intersects nothing)."""
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def check_output_tensor(arr, name: str):
    """An output torch tensor that requires grad while autograd records is refused, as torch
    refuses an in-place write there: a write autograd cannot see would make gradients wrong."""
    if is_torch(arr) and arr.requires_grad:
        import torch
        if torch.is_grad_enabled():
            raise ArgumentError(f"{name}: the output tensor requires grad; writing into it "
                                f"would bypass autograd (use a tensor that does not require "
                                f"grad, or write under torch.no_grad())")


def check_output(arr, lay: Layout, name: str) -> None:
    """The checks of an output that depend on the object, not its signature (made on every
    call): not read-only, and not a torch tensor autograd would miss a write into."""
    kind = lay.kind
    if kind == "torch":
        check_output_tensor(arr, name)
    elif not arr.flags.writeable if kind == "numpy" else arr.readonly:
        raise ArgumentError(f"{name}: the output array is read-only")


def check(op, arr, name: str) -> int:
    """Validate arr against the Operand op; returns the ld to compile for (0 if not a block)."""
    lay = layout(arr, name)
    ld = check_layout(op, lay, name)
    if op.role != "in":
        check_output(arr, lay, name)
    return ld


class LayoutChecks:
    """check_layout(op, layout, name) for one operand, remembered per Layout: the ld of a
    layout checked once is returned again at the cost of a dict lookup. Errors are not
    remembered (an invalid layout raises on every call)."""

    __slots__ = ("op", "_lds")

    def __init__(self, op):
        self.op = op
        self._lds: dict = {}

    def ld(self, lay: Layout, name: str) -> int:
        ld = self._lds.get(lay)
        if ld is None:
            ld = check_layout(self.op, lay, name)
            remember(self._lds, lay, ld)
        return ld


def check_layout(op, lay: Layout, name: str) -> int:
    """The checks of arr against the Operand op that depend only on its layout (dtype, shape,
    strides); returns the ld to compile for (0 if not a block)."""
    shape, strides = lay.shape, lay.strides
    if lay.dtype is not op.dtype:
        raise ArgumentError(f"{name}: expected dtype {op.dtype}, got {lay.native}")
    layout = op.layout
    if layout == "block":
        rows = shape[0] if len(shape) == 2 else None
        if len(shape) != 2 or shape[1] != op.cols or (op.rows != -1 and rows != op.rows):
            want = f"(rows, {op.cols})" if op.rows == -1 else f"({op.rows}, {op.cols})"
            raise ArgumentError(f"{name}: expected shape {want}, got {tuple(shape)}")
        if rows < 1:
            raise ArgumentError(f"{name}: expected at least one row, got shape {tuple(shape)}")
        if op.cols > 1 and strides[1] != 1:
            raise ArgumentError(f"{name}: columns must be contiguous (column stride 1 element), "
                                f"got stride {strides[1]}")
        if rows == 1:
            return op.ld
        ld = strides[0]
        if ld < op.cols:
            raise ArgumentError(f"{name}: row stride (ld) {ld} is smaller than the row "
                                f"length {op.cols}")
        return ld
    if layout == "mask":
        if tuple(shape) != (op.rows, op.cols) or not contiguous(shape, strides):
            raise ArgumentError(f"{name}: expected a contiguous uint8 bitmask of shape "
                                f"({op.rows}, {op.cols}), got shape {tuple(shape)} strides {strides}")
        return 0
    length = 1 if layout == "scalar" else (op.rows if layout == "col" else op.cols)
    size = 1
    for d in shape:
        size *= d
    if size != length or sum(1 for d in shape if d != 1) > 1:
        raise ArgumentError(f"{name}: expected {length} values ({layout} operand, shape "
                            f"{_vector_shapes(layout, length)}), got shape {tuple(shape)}")
    if not contiguous(shape, strides):
        raise ArgumentError(f"{name}: a {layout} operand must be contiguous, got strides {strides}")
    return 0


def contiguous(shape, strides) -> bool:
    """Whether (shape, strides in elements) describe C-contiguous memory (size-1 dims free)."""
    expected = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _vector_shapes(layout, length):
    if layout == "scalar":
        return "(), (1,) or (1, 1)"
    if layout == "row":
        return f"({length},) or (1, {length})"
    return f"({length},) or ({length}, 1)"


def allocate(op, like_torch: bool, device: Device = CPU):
    """A new array for an output operand: numpy or torch like the inputs on the host; on
    another device what its backend allocates (a torch tensor, else seen through as_array)."""
    if op.layout in ("block", "mask"):
        shape = (op.rows, op.cols)
    else:
        shape = (op.cols if op.layout != "col" else op.rows,)
    if not device.is_host:
        out = registry.for_device(device).empty(shape, op.dtype, device, like_torch)
        return out if is_torch(out) else as_array(out, op.name)
    if like_torch:
        import torch
        return torch.empty(shape, dtype=getattr(torch, op.dtype.torch_name))
    return np.empty(shape, op.dtype.numpy)
