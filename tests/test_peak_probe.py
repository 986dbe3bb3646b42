"""The compute-peak probe's code: register-resident FMA / vdpbf16ps chains, AMX tile dots
(assembly only)."""
import dataclasses
import re

import pytest

from tpp_cpu import peak_probe, target


def _loop(asm: str) -> str:
    """The body of the probe's only loop (from its label to the backward jump)."""
    label = re.search(r"^(\.LBB0_\d+):\n(?:.*\n)*?\s+jne\s+\1$", asm, re.M)
    assert label, asm
    return label.group(0)


@pytest.mark.parametrize("isa, kind, instruction, reg", [
    ("avx2", "f32", "vfmadd231ps", "ymm"),
    ("avx512", "f32", "vfmadd231ps", "zmm"),
    ("avx512", "bf16", "vdpbf16ps", "zmm"),
])
def test_probe_loop_is_register_resident(isa, kind, instruction, reg):
    tgt = dataclasses.replace(target.make_target(isa), amx=False)
    body = _loop(peak_probe.assembly(kind, tgt))
    ops = re.findall(rf"^\s+{instruction}\s+%{reg}\d+, %{reg}\d+, %{reg}\d+$", body, re.M)
    assert len(ops) == peak_probe.accumulators(tgt) * peak_probe.UNROLL
    assert "(%" not in body   # no memory operand, no spill
    per = 4 if kind == "bf16" else 2
    assert peak_probe.flops_per_iteration(kind, tgt) == len(ops) * tgt.lanes * per


def test_amx_probe_loop_is_tile_dots_only():
    """On an AMX target the bf16 probe is four accumulator tiles, UNROLL dots each a trip,
    and nothing else in the loop (assembly only: any host can look at it)."""
    host = dataclasses.replace(target.make_target("avx512"), amx=True, bf16_dot=True)
    other = target.Target("avx512", 16, False, "none", cpu="znver4", bf16_dot=True,
                          vector_registers=32, masked_lanes=True, amx=True)   # a CPU without
    for tgt in (host, other):
        asm = peak_probe.assembly("bf16", tgt)
        body = _loop(asm)
        dots = re.findall(r"^\s+tdpbf16ps\s+%tmm[67], %tmm[45], %tmm[0-3]$", body, re.M)
        assert len(dots) == 4 * peak_probe.UNROLL and "tileloadd" not in body
        assert "ldtilecfg" in asm and "tilerelease" in asm
        assert peak_probe.flops_per_iteration("bf16", tgt) == len(dots) * 16 * 16 * 32 * 2


def test_bf16_probe_falls_back_to_f32_without_a_dot_instruction():
    tgt = target.current()
    probe = peak_probe.build("bf16")
    probe(10)
    if tgt.amx:
        assert probe.instruction == "tdpbf16ps" and probe.via is None
    elif tgt.bf16_dot:
        assert probe.instruction == "vdpbf16ps" and probe.via is None
    else:
        assert probe.instruction == "vfmadd231ps" and probe.via.startswith("f32 fma")
    with pytest.raises(ValueError):
        peak_probe.build("f64")
