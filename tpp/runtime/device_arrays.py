"""CUDA data as the library sees it: a zero-copy view of a producer's device array.

Torch CUDA tensors are used as they are (their own shape, stride and data_ptr). Anything else on
a GPU arrives through `__cuda_array_interface__` (cupy, numba, ...) or a CUDA DLPack capsule
(read through cupy) and becomes a `CudaView`: address, shape, strides in elements, dtype, device
ordinal and the producer's object, which is kept alive and handed back for outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import ArgumentError, UnsupportedError

_DLPACK_CUDA = 2          # kDLCUDA in DLPack's DLDeviceType


@dataclass(frozen=True, eq=False)
class CudaView:
    obj: object           # the producer's array
    ptr: int              # address of element 0
    shape: tuple
    strides: tuple        # in elements
    dtype: np.dtype
    readonly: bool
    device: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def is_cuda_object(obj) -> bool:
    """Whether obj is (non-torch) device data: a CUDA array interface or a CUDA DLPack capsule."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or isinstance(obj, np.ndarray):
        return False
    try:
        return dev()[0] == _DLPACK_CUDA
    except (TypeError, ValueError, IndexError, RuntimeError):
        return False


def view(obj, name: str) -> CudaView:
    """The CudaView of a device array (see is_cuda_object)."""
    if not hasattr(obj, "__cuda_array_interface__"):
        obj = _from_dlpack(obj, name)
    cai = obj.__cuda_array_interface__
    try:
        shape = tuple(int(d) for d in cai["shape"])
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ArgumentError(f"{name}: malformed __cuda_array_interface__ ({exc})") from None
    dtype = getattr(obj, "dtype", None)
    dtype = np.dtype(cai["typestr"]) if not isinstance(dtype, np.dtype) else dtype
    if cai.get("mask") is not None:
        raise ArgumentError(f"{name}: masked CUDA arrays are not supported")
    strides = cai.get("strides")
    if strides is None:          # C-contiguous
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        strides = tuple(reversed(strides))
    else:
        if any(s % dtype.itemsize for s in strides):
            raise ArgumentError(f"{name}: strides {tuple(strides)} are not multiples of the "
                                f"element size {dtype.itemsize}")
        strides = tuple(int(s) // dtype.itemsize for s in strides)
    return CudaView(obj, int(ptr or 0), shape, strides, dtype, bool(readonly),
                    _device_of(obj, int(ptr or 0)))


def _from_dlpack(obj, name):
    try:
        import cupy
    except ImportError:
        raise UnsupportedError(f"{name}: CUDA data through DLPack needs cupy "
                               f"(pip install 'tpp[cuda]')") from None
    try:
        return cupy.from_dlpack(obj)
    except Exception as exc:   # cupy raises several types for foreign capsules
        raise ArgumentError(f"{name}: cannot read {type(obj).__name__} through DLPack: {exc}") \
            from None


def _device_of(obj, ptr: int) -> int:
    """The device ordinal: the producer's `.device.id` (cupy), else asked of the driver through
    cupy, else 0 (the interface itself does not say)."""
    dev = getattr(getattr(obj, "device", None), "id", None)
    if isinstance(dev, int):
        return dev
    try:
        import cupy
        return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)
    except Exception:          # no cupy, no driver, or not a device pointer
        return 0


def extent(v: CudaView) -> tuple:
    """[first byte, last byte + 1) of the device memory a view spans."""
    if any(d == 0 for d in v.shape):
        return v.ptr, v.ptr
    span = sum((d - 1) * s for d, s in zip(v.shape, v.strides)) + 1
    return v.ptr, v.ptr + span * v.itemsize
