"""What the generators emit: vector code for each ISA, masked tails, no scalar loops."""
import numpy as np
import pytest

import tpp
from tpp_cpu import target


def test_avx512_code_uses_zmm_and_k_masked_tails():
    asm = tpp.unary("relu", 4, 37).dump("asm", isa="avx512")
    assert "zmm" in asm
    assert "{%k" in asm            # the 37 % 16 = 5 tail is a k-masked move


def test_avx2_code_uses_ymm_and_masked_moves():
    asm = tpp.unary("relu", 4, 37).dump("asm", isa="avx2")
    assert "ymm" in asm and "zmm" not in asm
    assert "vmaskmovps" in asm     # the 37 % 8 = 5 tail


def test_bf16_and_f16_conversions_are_vectorised():
    asm = tpp.unary("identity", 4, 64, dtype_in="f16", dtype_out="bf16").dump("asm", isa="avx2")
    assert "vcvtph2ps" in asm      # f16 -> f32 through F16C
    assert "vpsrld" in asm         # f32 -> bf16 by integer rounding


def test_dump_ir_and_optimised_ir():
    k = tpp.unary("exp", 4, 16)
    assert "define void @\"tpp_" in k.dump("ir")
    assert "fmul" in k.dump("opt") or "fma" in k.dump("opt")
    with pytest.raises(ValueError):
        k.dump("pdf")


def test_dump_environment_variable_writes_files(tmp_path, monkeypatch):
    from tpp_cpu import backend
    monkeypatch.setenv("TPP_DUMP", str(tmp_path))
    spec = tpp.unary("sqrt", 3, 7).spec
    backend.build_object(spec, target.current(), "tpp_dump_test")
    names = sorted(p.suffixes[-1] for p in tmp_path.iterdir())
    assert names == [".ll", ".ll", ".s"]


def test_forced_avx2_target_runs_here(monkeypatch):
    monkeypatch.setenv("TPP_CPU_ISA", "avx2")
    assert target.current().lanes == 8
    spec = tpp.unary("negate", 5, 13, dtype_in="bf16").spec
    k = tpp.Kernel(spec)   # a fresh kernel object, compiled for the forced target
    x = np.arange(65, dtype=np.float32).reshape(5, 13).astype(tpp.BF16.numpy)
    np.testing.assert_array_equal(k(x).astype(np.float32), -x.astype(np.float32))


def test_bad_isa_name(monkeypatch):
    monkeypatch.setenv("TPP_CPU_ISA", "sse2")
    with pytest.raises(tpp.UnsupportedError, match="TPP_CPU_ISA"):
        target.current()


def test_has_dot_instruction_follows_the_target(monkeypatch):
    """tpp.has_dot_instruction: bf16 where the code has vdpbf16ps (an avx512_bf16 host, not
    forced to AVX2), never f32 or f16; an unknown dtype is a SpecError."""
    assert tpp.has_dot_instruction("bf16") == target.current().bf16_dot
    assert tpp.has_dot_instruction(tpp.BF16, tpp.CPU) == target.current().bf16_dot
    assert not tpp.has_dot_instruction("f32") and not tpp.has_dot_instruction("f16")
    monkeypatch.setenv("TPP_CPU_ISA", "avx2")
    assert not tpp.has_dot_instruction("bf16")
    assert tpp.has_dot_instruction("bf16", "cpu") == tpp.has_dot_instruction("bf16")
    with pytest.raises(tpp.SpecError, match="unknown dtype"):
        tpp.has_dot_instruction("int3")
    with pytest.raises(tpp.ArgumentError, match="device"):
        tpp.has_dot_instruction("bf16", 3)
