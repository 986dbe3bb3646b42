"""Binding user arrays to a primitive's operands: validation, pointers, leading dimensions.

Accepted on the host: numpy arrays, torch CPU tensors, and anything numpy can view without a
copy (`__array_interface__`, the buffer protocol, DLPack). On a GPU: torch CUDA tensors and
anything with `__cuda_array_interface__` or a CUDA DLPack capsule (cupy, numba, ...), seen
through `tpp.device_arrays.CudaView`. Every check raises ArgumentError (or UnsupportedError for
what no backend can run) naming the operand, what was expected and what was given; nothing
reaches compiled code unchecked.
"""
from __future__ import annotations

import cffi
import numpy as np

from . import device_arrays
from . import dtypes as _dt
from .device_arrays import CudaView
from .errors import ArgumentError, UnsupportedError

ffi = cffi.FFI()

_NP_DTYPES = {d.numpy: d for d in (_dt.F32, _dt.BF16, _dt.F16, _dt.I64, _dt.U8)}
_TORCH_DTYPES: dict = {}


def _torch_dtype(t):
    if not _TORCH_DTYPES:
        import torch
        for d in (_dt.F32, _dt.BF16, _dt.F16, _dt.I64, _dt.U8):
            _TORCH_DTYPES[getattr(torch, d.torch_name)] = d
    return _TORCH_DTYPES.get(t.dtype)


def is_torch(obj) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


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
    if device_of(arr) is not None:
        raise UnsupportedError(f"{name}: CUDA data ({type(obj).__name__}); {what} runs on the "
                               f"CPU only")
    return arr


def device_of(arr):
    """None for host data, else the CUDA device ordinal."""
    if type(arr) is np.ndarray:
        return None
    if isinstance(arr, CudaView):
        return arr.device
    if is_torch(arr) and arr.device.type != "cpu":
        if arr.device.type != "cuda":
            raise UnsupportedError(f"tensors on {arr.device} are not supported (CPU or CUDA)")
        return arr.device.index if arr.device.index is not None else 0
    return None


def common_device(named_arrays):
    """The one device of all (name, array) pairs (None: the host); a mix is an ArgumentError."""
    where = {}
    for name, arr in named_arrays:
        where.setdefault(device_of(arr), name)
    if len(where) > 1:
        spots = ", ".join(f"{name} on {'the host' if d is None else f'cuda:{d}'}"
                          for d, name in where.items())
        raise ArgumentError(f"the operands live on different devices ({spots}); move them to "
                            f"one device first")
    return next(iter(where), None)


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


def geometry(arr, name: str):
    """(DType or None, shape, strides in elements, writable, native dtype) of an array/tensor."""
    if isinstance(arr, CudaView):
        return _NP_DTYPES.get(arr.dtype), arr.shape, arr.strides, not arr.readonly, arr.dtype
    if is_torch(arr):
        if str(arr.layout) != "torch.strided":
            raise ArgumentError(f"{name}: a {arr.layout} tensor has no strided memory to read; "
                                f"pass a dense tensor (.to_dense())")
        dt = _torch_dtype(arr)
        return dt, tuple(arr.shape), tuple(arr.stride()), True, arr.dtype
    dt = _NP_DTYPES.get(arr.dtype)
    isz = arr.itemsize
    strides = arr.strides
    if any(s % isz for s in strides):
        raise ArgumentError(f"{name}: strides {strides} are not multiples of the element size {isz}")
    return dt, arr.shape, tuple(s // isz for s in strides), arr.flags.writeable, arr.dtype


def first_block(arr):
    """arr[0] of a batched (count, rows, cols) array, as a view."""
    if isinstance(arr, CudaView):
        return CudaView(arr.obj, arr.ptr, arr.shape[1:], arr.strides[1:], arr.dtype,
                        arr.readonly, arr.device)
    return arr[0]


def pointer(arr):
    """A cffi void* to the first element (zero copy)."""
    if is_torch(arr):
        return ffi.cast("void *", arr.data_ptr())
    if arr.flags.c_contiguous and arr.size:
        return ffi.from_buffer(arr)
    return ffi.cast("void *", arr.ctypes.data)


def address(arr) -> int:
    """The address of the first element, as an int (for calls through integer arguments)."""
    if isinstance(arr, CudaView):
        return arr.ptr
    return arr.data_ptr() if is_torch(arr) else arr.ctypes.data


def overlap(a, b) -> bool:
    """Whether the memory spans of two arrays/tensors intersect."""
    lo, hi = extent(a)
    olo, ohi = extent(b)
    return lo < ohi and olo < hi


def check_output_tensor(arr, name: str):
    """An output torch tensor that requires grad while autograd records is refused, as torch
    refuses an in-place write there: a write autograd cannot see would make gradients wrong."""
    if is_torch(arr) and arr.requires_grad:
        import torch
        if torch.is_grad_enabled():
            raise ArgumentError(f"{name}: the output tensor requires grad; writing into it "
                                f"would bypass autograd (use a tensor that does not require "
                                f"grad, or write under torch.no_grad())")


def check(op, arr, name: str) -> int:
    """Validate arr against the Operand op; returns the ld to compile for (0 if not a block)."""
    dt, shape, strides, writable, given = geometry(arr, name)
    if dt is not op.dtype:
        raise ArgumentError(f"{name}: expected dtype {op.dtype}, got {given}")
    if op.role != "in":
        if not writable:
            raise ArgumentError(f"{name}: the output array is read-only")
        check_output_tensor(arr, name)
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


def extent(arr):
    """[first byte, last byte + 1) of the memory an array or tensor spans."""
    if isinstance(arr, CudaView):
        return device_arrays.extent(arr)
    if is_torch(arr):
        isz = arr.element_size()
        start = arr.data_ptr()
        span = sum((d - 1) * s for d, s in zip(arr.shape, arr.stride())) + 1
        return start, start + span * isz
    low, high = np.byte_bounds(arr) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(arr)
    return low, high


def allocate(op, like_torch: bool, device=None):
    """A new array for an output operand: numpy or torch like the inputs on the host; torch or
    cupy (as a CudaView) on CUDA device `device`."""
    if op.layout in ("block", "mask"):
        shape = (op.rows, op.cols)
    else:
        shape = (op.cols if op.layout != "col" else op.rows,)
    if device is not None:
        from tpp_cuda import runtime
        out = runtime.empty(shape, op.dtype, device, like_torch)
        return out if like_torch else device_arrays.view(out, op.name)
    if like_torch:
        import torch
        return torch.empty(shape, dtype=getattr(torch, op.dtype.torch_name))
    return np.empty(shape, op.dtype.numpy)
