"""Compile-checking generated CUDA sources with nvcc (no GPU needed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from tpp.core.errors import CompileError, SpecError, UnsupportedError


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


def _run_nvcc(sources: dict, arch: str, kind: str, tmp: str) -> str:
    """Compile `sources` as one translation unit with nvcc to a `kind` ("cubin" or "ptx") file
    in tmp; return its path."""
    target = _arch(arch)
    exe = shutil.which("nvcc")
    if exe is None:
        raise UnsupportedError("nvcc is not on PATH: CUDA sources cannot be compiled here")
    text = "\n".join(f"// ---- {name}\n{src}" for name, src in sources.items())
    cu = os.path.join(tmp, "kernels.cu")
    with open(cu, "w") as f:
        f.write(text)
    out = os.path.join(tmp, f"out.{kind}")
    cmd = [exe, f"-arch={target}", f"-{kind}", "-o", out, cu]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        raise CompileError(f"nvcc took over 600 s ({' '.join(cmd)})") from exc
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}{proc.stdout}")
    return out


def compile_check(sources: dict, arch: str) -> None:
    """Compile all `sources` (name -> CUDA source, kernels already uniquely named) as one
    translation unit to a cubin for `arch`; raise CompileError with nvcc's output on failure."""
    with tempfile.TemporaryDirectory(prefix="tpp-cuda-") as tmp:
        _run_nvcc(sources, arch, "cubin", tmp)


def disassemble(source: str, arch: str, what: str) -> str:
    """The PTX (what="ptx") or SASS (what="sass", through cuobjdump) of one source for arch."""
    if what not in ("ptx", "sass"):
        raise SpecError(f"what must be 'ptx' or 'sass', got {what!r}")
    with tempfile.TemporaryDirectory(prefix="tpp-cuda-") as tmp:
        path = _run_nvcc({"kernel": source}, arch, "ptx" if what == "ptx" else "cubin", tmp)
        if what == "ptx":
            with open(path) as f:
                return f.read()
        tool = shutil.which("cuobjdump")
        if tool is None:
            raise UnsupportedError("cuobjdump is not on PATH: SASS cannot be shown here")
        proc = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise CompileError(f"cuobjdump failed:\n{proc.stderr}")
        return proc.stdout
