"""Compile-checking generated CUDA sources with nvcc (no GPU needed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from tpp.errors import CompileError, SpecError, UnsupportedError


def available() -> bool:
    """Whether an nvcc executable is on PATH."""
    return shutil.which("nvcc") is not None


def _arch(arch: str) -> str:
    arch = str(arch).lower()
    if arch.startswith("sm_"):
        arch = arch[3:]
    if not arch.isalnum():
        raise SpecError(f"arch must look like 'sm_80' or '80', got {arch!r}")
    return f"sm_{arch}"


def compile_check(sources: dict, arch: str) -> None:
    """Compile all `sources` (name -> CUDA source, kernels already uniquely named) as one
    translation unit to a cubin for `arch`; raise CompileError with nvcc's output on failure."""
    target = _arch(arch)
    exe = shutil.which("nvcc")
    if exe is None:
        raise UnsupportedError("nvcc is not on PATH: CUDA sources cannot be compile-checked here")
    text = "\n".join(f"// ---- {name}\n{src}" for name, src in sources.items())
    with tempfile.TemporaryDirectory(prefix="tpp-cuda-") as tmp:
        cu = os.path.join(tmp, "kernels.cu")
        with open(cu, "w") as f:
            f.write(text)
        cmd = [exe, f"-arch={target}", "-cubin", "-o", os.path.join(tmp, "out.cubin"), cu]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as exc:
            raise CompileError(f"nvcc took over 600 s ({' '.join(cmd)})") from exc
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}{proc.stdout}")
