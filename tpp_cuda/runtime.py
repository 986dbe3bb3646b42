"""Compiling generated CUDA kernels with cupy (NVRTC), caching them, launching them.

`function(spec, device)` returns the `CudaFunction` of a spec on a device, compiled on first use
and cached (the 512 most recently used; cupy also keeps NVRTC's output in memory and in its own
disk cache, so a new process reloads it).
`CudaFunction.launch(args, torch_stream)` launches it with the geometry its generator chose,
on the current stream: torch's when the call's data are torch tensors, else cupy's. Arguments
are the 64-bit values the kernel ABI takes (device addresses, counts, strides, seeds).
`TPP_DUMP=dir` writes each compiled kernel's CUDA source to dir/<kernel name>.cu.

Nothing here checks arrays: `tpp.Kernel` and `tpp.BrgemmKernel` do that before they launch.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from tpp.core.errors import CompileError, UnsupportedError
from tpp.runtime.lru import LRU
from tpp.runtime.registry import Compiled

from . import generators

_U64 = (1 << 64) - 1
_STATIC_SHARED_LIMIT = 48 * 1024


def _cupy():
    try:
        import cupy
    except ImportError:
        raise UnsupportedError("CUDA data needs cupy for the CUDA backend: "
                               "pip install 'tpp[cuda]' (cupy-cuda12x)") from None
    return cupy


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether cupy is installed and sees at least one GPU."""
    try:
        return _cupy().cuda.runtime.getDeviceCount() > 0
    except Exception:     # no cupy, no driver, no device
        return False


_READY: set = set()


def require(device: int) -> None:
    """Raise UnsupportedError unless cupy is installed and CUDA device `device` is usable."""
    if device in _READY:
        return
    cupy = _cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise UnsupportedError(f"CUDA data was given but no usable GPU is visible: {exc}") \
            from None
    if not 0 <= device < count:
        raise UnsupportedError(f"CUDA data on device {device}, but {count} GPU(s) are visible")
    _READY.add(device)


@functools.lru_cache(maxsize=1)
def include_dirs() -> tuple:
    """Directories holding cuda_bf16.h / cuda_fp16.h for NVRTC, best match first: the toolkit
    cupy found NVRTC in (its headers match that NVRTC), the pip nvidia-cuda-runtime package,
    then CUDA_PATH, CUDA_HOME and /usr/local/cuda."""
    roots = []
    try:
        roots.append(_cupy().cuda.get_cuda_path())
    except Exception:
        pass
    dirs = [os.path.join(r, "include") for r in roots if r]
    try:
        import nvidia.cuda_runtime
        dirs += [os.path.join(p, "include") for p in nvidia.cuda_runtime.__path__]
    except ImportError:
        pass
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    dirs += [os.path.join(r, "include") for r in roots if r]
    found = []
    for d in dirs:
        if os.path.exists(os.path.join(d, "cuda_bf16.h")) and d not in found:
            found.append(d)
    return tuple(found)


class CudaFunction(Compiled):
    """One compiled kernel of one spec on one device (the CUDA backend's Compiled object)."""

    def __init__(self, spec, device: int):
        cupy = _cupy()
        self.spec, self.device = spec, device
        self.name = generators.kernel_name(spec)
        self.source = generators.source(spec)
        # a loop nest's geometry depends on its sizes: the caller passes it at each launch
        self.geometry = None if spec.family == "loopnest" else generators.launch(spec)
        self.key_parts = ("cuda", f"device={device}")
        _dump(self.name, self.source)
        options = ("--std=c++17",) + tuple(f"-I{d}" for d in include_dirs())
        with cupy.cuda.Device(device):
            try:
                module = cupy.RawModule(code=self.source, options=options)
                self._fn = module.get_function(self.name)
            except cupy.cuda.compiler.CompileException as exc:
                raise CompileError(f"NVRTC could not compile {self.name}:\n{exc}") from None
            self._smem_allowed = _STATIC_SHARED_LIMIT
            if self.geometry is not None:
                self._allow_shared(self.geometry.shared_bytes)

    def _allow_shared(self, nbytes: int) -> None:
        """Let the kernel take nbytes of dynamic shared memory (beyond the default 48 KiB)."""
        if nbytes > self._smem_allowed:
            self._fn.max_dynamic_shared_size_bytes = nbytes
            self._smem_allowed = nbytes

    def launch(self, args, torch_stream: bool = False, geometry=None):
        """Launch with the 64-bit argument values `args` on the current stream (torch's when
        torch_stream, else cupy's), with `geometry` (a tpp_cuda.launch.Launch; default: the
        one the spec's generator chose). Returns at once: the kernel runs asynchronously."""
        cupy = _cupy()
        g = geometry or self.geometry
        if g.shared_bytes > self._smem_allowed:
            with cupy.cuda.Device(self.device):
                self._allow_shared(g.shared_bytes)
        values = tuple(np.uint64(int(a) & _U64) for a in args)
        with cupy.cuda.Device(self.device):
            stream = _torch_stream(cupy, self.device) if torch_stream else \
                cupy.cuda.get_current_stream()
            self._fn(g.grid, g.block, values, shared_mem=g.shared_bytes, stream=stream)

    def dump(self, what: str = "cuda") -> str:
        """The CUDA source ("cuda"), or what nvcc makes of it ("ptx", "sass") for sm_90."""
        if what == "cuda":
            return self.source
        from . import nvcc
        return nvcc.disassemble(self.source, "sm_90", what)

    def __repr__(self):
        return f"<CudaFunction {self.name} on cuda:{self.device}>"


def _torch_stream(cupy, device):
    import torch
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device)


def _dump(name, source):
    folder = os.environ.get("TPP_DUMP")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.cu"), "w") as f:
            f.write(source)


# (spec, device) -> CudaFunction. Dropping one leaves its CUDA module loaded (cupy memoizes
# RawModules per device), so a kernel still queued on a stream never loses its code.
_FUNCTIONS = LRU(512, "cuda_functions")


def function(spec, device: int) -> CudaFunction:
    """The compiled kernel of `spec` on CUDA device `device` (cached, see _FUNCTIONS)."""
    key = (spec, device)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        require(device)
        fn = _FUNCTIONS[key] = CudaFunction(spec, device)
    return fn


def empty(shape, dtype, device: int, like_torch: bool):
    """An uninitialised device array (torch CUDA tensor if like_torch, else cupy) of a
    tpp.core.dtypes.DType on `device`."""
    require(device)
    if like_torch:
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype.torch_name), device=f"cuda:{device}")
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=dtype.numpy)


def to_device(host: np.ndarray, device: int, like_torch: bool):
    """A device copy of a host array, allocated and copied on the stream a launch for torch
    (like_torch) or cupy data uses, so the pools reuse it only after that launch."""
    require(device)
    if like_torch:
        import torch
        return torch.from_numpy(np.ascontiguousarray(host)).to(f"cuda:{device}", non_blocking=False)
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.asarray(host)
