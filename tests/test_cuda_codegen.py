"""The CUDA backend's element-wise source generator: every generated kernel compiles with nvcc
(sm_80 and sm_90, all in one translation unit per arch), names are unique and stable, and the
index arithmetic of each operand layout matches numpy's strides and the reference's bitmask."""
import re

import numpy as np
import pytest

import tpp
from tpp.core import optable, reference
from tpp.core.errors import CompileError, SpecError, UnsupportedError
from tpp.core.spec import make_binary, make_unary
from tpp_cuda import eltwise, nvcc
from tpp_cuda.expr_cuda import float_literal

pytestmark = pytest.mark.skipif(not nvcc.available(), reason="nvcc is not on PATH")

M, N, LD = 7, 13, 16


def _unary_specs():
    specs = []
    for name, info in tpp.UNARY_OPS.items():
        if info.kind not in ("map", "map_inv"):
            continue
        specs.append(make_unary(name, M, N, ldi=LD, ldo=LD + 3))
        for din, dout in (("bf16", "bf16"), ("f16", "f16"), ("bf16", "f32"), ("f32", "f16"),
                          ("f16", "bf16")):
            specs.append(make_unary(name, M, N, dtype_in=din, dtype_out=dout))
    specs += [make_unary("relu", M, N, ldi=LD, bitmask=True),
              make_unary("relu", 3, 8, dtype_in="bf16", bitmask=True),
              make_unary("relu_inv", M, N, ldo=LD, bitmask=True),
              make_unary("relu_inv", M, N, dtype_in="f16", dtype_out="bf16", bitmask=True),
              make_unary("gelu", M, N, approximate="tanh"),
              make_unary("gelu", M, N, dtype_in="bf16", approximate="tanh"),
              make_unary("gelu_inv", M, N, approximate="tanh"),
              make_unary("leaky_relu", M, N, alpha=0.2),
              make_unary("leaky_relu_inv", M, N, alpha=float("inf")),
              make_unary("elu", M, N, alpha=0.5), make_unary("elu_inv", M, N, alpha=1e-5),
              make_unary("dropout", M, N, p=0.0), make_unary("dropout", 1, 1, p=0.9999),
              make_unary("dropout_inv", M, N, p=0.1, ldi=LD, ldo=LD + 1)]
    specs += [make_unary("exp", M, N, bcast=b, dtype_in="bf16", dtype_out="f32")
              for b in ("row", "col", "scalar")]
    return specs


def _binary_specs():
    specs = []
    for name in tpp.BINARY_OPS:
        specs.append(make_binary(name, M, N, ldi0=LD, ldi1=LD + 1, ldo=LD + 2))
        specs.append(make_binary(name, M, N, dtype_in0="bf16", dtype_in1="f16"))
        if tpp.BINARY_OPS[name].kind != "compare":
            specs.append(make_binary(name, M, N, dtype_in0="f16", dtype_out="bf16"))
        for b in ("row", "col", "scalar"):
            specs.append(make_binary(name, M, N, bcast_in1=b, ldi0=LD))
            specs.append(make_binary(name, M, N, bcast_in0=b, dtype_in1="bf16"))
    specs.append(make_binary("mul", M, N, bcast_in0="row", bcast_in1="col"))
    return specs


SPECS = _unary_specs() + _binary_specs()


@pytest.fixture(scope="module")
def sources():
    return {eltwise.kernel_name(s): eltwise.source(s) for s in SPECS}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_all_sources_compile(sources, arch):
    nvcc.compile_check(sources, arch)


def test_compile_error_carries_nvcc_output():
    with pytest.raises(CompileError, match="error"):
        nvcc.compile_check({"bad": 'extern "C" __global__ void f() { undeclared_thing; }'}, "80")


@pytest.mark.parametrize("arch", ["sm 80", "", "sm_8.0"])
def test_bad_arch_is_a_spec_error(arch):
    with pytest.raises(SpecError, match="arch must look like"):
        nvcc.compile_check({}, arch)


def test_every_elementwise_op_is_covered():
    ops = {s.op for s in SPECS}
    for table in (tpp.UNARY_OPS, tpp.BINARY_OPS):
        for name, info in table.items():
            if info.kind in ("map", "map_inv", "compare"):
                assert name in ops


def test_kernel_names_unique_and_stable(sources):
    assert len(sources) == len(SPECS)
    for name in sources:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
    spec = make_unary("gelu", M, N, ldi=LD, approximate="tanh")
    again = make_unary("gelu", M, N, ldi=LD, approximate="tanh")
    assert eltwise.kernel_name(spec) == eltwise.kernel_name(again)
    assert eltwise.kernel_name(spec) != eltwise.kernel_name(spec.replace(ldi=LD + 1))
    # the name is a function of spec.key() only (no per-process state): pin one
    assert eltwise.kernel_name(make_binary("add", 4, 4, ldi0=4)) == \
        "tpp_binary_add_b81a1524e8099dcc"


@pytest.mark.parametrize("spec", [
    make_unary("reduce_sum", 4, 4), make_unary("reduce_max", 4, 4, axis=0),
    make_unary("transpose", 4, 4), make_unary("vnni2", 4, 4, dtype_in="bf16"),
    make_unary("vnni2_inv", 4, 4, dtype_in="bf16"), make_unary("gather_rows", 4, 4),
    make_unary("scatter_rows", 4, 4), tpp.make_brgemm(4, 4, 4)], ids=lambda s: s.op
    if hasattr(s, "op") else "brgemm")
def test_unsupported_kinds_raise(spec):
    with pytest.raises(UnsupportedError, match="not yet in the CUDA backend"):
        eltwise.source(spec)
    with pytest.raises(UnsupportedError):
        eltwise.kernel_name(spec)
    assert not eltwise.supported(spec)


def test_source_has_ld_constants_and_operand_order():
    u = make_unary("relu_inv", 5, 11, ldi=37, ldo=41, bitmask=False)
    b = make_binary("muladd", 5, 11, ldi0=19, ldi1=23, ldo=29)
    src_u, src_b = eltwise.source(u), eltwise.source(b)
    assert "i * 37 + j" in src_u and "i * 41 + j" in src_u
    for ld in (19, 23, 29):
        assert f"i * {ld} + j" in src_b
    for spec, src in ((u, src_u), (b, src_b), (make_unary("relu", 3, 9, bitmask=True), None)):
        src = src or eltwise.source(spec)
        sig = re.search(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src)
        assert sig.group(1) == eltwise.kernel_name(spec)
        names = [a.split()[-1] for a in sig.group(2).split(",")]
        assert names == [o.name for o in spec.operands()]


def test_seed_argument_follows_the_pointers():
    """dropout takes `long long seed` after its pointers (the CPU ABI); nothing else does."""
    for spec in SPECS:
        sig = re.search(r'extern "C" __global__ void \w+\(([^)]*)\)',
                        eltwise.source(spec)).group(1)
        names = [a.split()[-1] for a in sig.split(",")]
        assert names == [o.name for o in spec.operands()] + list(spec.scalars), spec.key()
        assert (spec.op == "dropout") == (spec.scalars == ("seed",))
        if spec.scalars:
            assert sig.endswith("long long seed")


@pytest.mark.parametrize("p", [0.0, 0.1, 1 / 3, 0.5, 0.9999])
def test_dropout_constants_come_from_the_table(p):
    """The keep threshold and the scale of the definition (optable.dropout_threshold /
    dropout_scale) reach the source; dropout writes its mask 8 columns per thread."""
    src = eltwise.source(make_unary("dropout", 3, 13, p=p))
    assert f">= 0x{optable.dropout_threshold(p):08x}u;" in src
    literal = float_literal(float(optable.dropout_scale(p)))
    assert f"__fmul_rn(x, {literal})" in src
    assert f"__fmul_rn(g, {literal})" in eltwise.source(make_unary("dropout_inv", 3, 13, p=p))
    assert "CHUNKS = 2" in src and "mask[i * 2 + jc] = (unsigned char)bits;" in src
    assert "seed >> 32" in src and "(unsigned int)(i * N + j)" in src


def test_params_reach_the_source():
    assert "__fmul_rn(x, 0.25f)" in eltwise.source(make_unary("leaky_relu", 2, 2, alpha=0.25))
    body = lambda src: src.split("*/", 1)[1]      # the kernel, without the spec comment
    tanh = eltwise.source(make_unary("gelu", 2, 2, approximate="tanh"))
    exact = eltwise.source(make_unary("gelu", 2, 2))
    assert body(tanh) != body(exact) and "__fmaf_rn" in body(exact)
    assert body(eltwise.source(make_unary("gelu_inv", 2, 2))) != \
        body(eltwise.source(make_unary("gelu_inv", 2, 2, approximate="tanh")))
    assert "__float2bfloat16_rn" in eltwise.source(make_unary("exp", 2, 2, dtype_out="bf16"))


def _view(operand, m, n):
    """A numpy view of the operand as an (m, n) broadcast array, over element-sized cells."""
    if operand.layout == "block":
        return np.zeros((m, operand.ld), np.float32)[:, :n]
    shape = {"row": (1, n), "col": (m, 1), "scalar": (1, 1)}[operand.layout]
    return np.broadcast_to(np.zeros(shape, np.float32), (m, n))


@pytest.mark.parametrize("spec", [
    make_binary("add", 6, 19, ldi0=23, bcast_in1="row"), make_binary("sub", 6, 19, bcast_in0="col",
                                                                    ldi1=20, ldo=31),
    make_binary("cmp_lt", 6, 19, bcast_in0="scalar", bcast_in1="col"),
    make_unary("relu", 5, 17, ldi=18, ldo=40, bitmask=True), make_unary("relu_inv", 5, 9,
                                                                      bitmask=True, ldi=12)],
    ids=lambda s: s.op)
def test_offset_expressions_match_numpy_and_the_reference_mask(spec):
    m, n = spec.m, spec.n
    for operand in spec.operands():
        expr = eltwise.offset_expr(operand)
        for i in range(m):
            for j in range(n):
                got = eval(expr, {"i": i, "j": j})
                if operand.layout == "mask":
                    hot = np.zeros((m, n), bool)
                    hot[i, j] = True
                    packed = reference.pack_mask(hot)
                    assert packed.shape == (m, operand.cols)
                    (flat,) = np.flatnonzero(packed)
                    assert got == flat and packed.flat[flat] == 1 << (j % 8)
                else:
                    v = _view(operand, m, n)
                    assert got * 4 == i * v.strides[0] + j * v.strides[1]
