"""AMX tiles: the operating system's permission, the tile configuration and the instructions,
as LLVM IR.

Intel's Advanced Matrix Extensions add eight tile registers (tmm0-7, each up to 16 rows of 64
bytes) and a tile multiply: `tdpbf16ps c, a, b` adds to the f32 tile c (M rows x N f32) the
product of the bf16 tile a (M rows x K bf16) and the VNNI-paired bf16 tile b (K/2 rows x N
pairs). One such instruction with full tiles is 16 x 16 x 32 multiply-adds, 16 times the work
of an AVX-512 FMA; on a Sapphire Rapids core it issues every 16 cycles (1024 f32 FLOPs per
cycle, ~3 TFLOP/s at 3 GHz, against ~200 GFLOP/s of AVX-512 FMAs).

Linux enables the tile data state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
XFEATURE_XTILEDATA): a tile instruction before that kills the process (SIGILL). The CPU
target (tpp_cpu.target, which imports no LLVM) asks once per process and uses AMX only where
the CPU has it and the request succeeded; TPP_CPU_AMX=0 turns it off.

Tiles take their shapes from a 64-byte configuration loaded by `ldtilecfg` (which also zeroes
every tile). A kernel that uses tiles loads its configuration on entry and releases the tiles
(`tilerelease`) before it returns: a kernel never relies on a configuration left behind by
another (torch's oneDNN kernels configure tiles of their own in the same threads), and a
thread between kernel calls holds no tile state for the OS to save. The pair costs ~60 ns
(measured on a Sapphire Rapids guest: 1e6 ldtilecfg+tilerelease), ~2% of a 64x64x384 call.

The instructions are LLVM's tile-number intrinsics (`llvm.x86.tileloadd64` and friends, what
C's `_tile_loadd` macros become): every tile operand is an immediate register number, so the
generator allocates the eight tiles itself.
"""
from __future__ import annotations

from llvmlite import ir

from .irx import I8, I64, PTR

TILES = 8
ROWS = 16            # most rows of a tile
ROW_BYTES = 64       # most bytes of a tile row

def config_bytes(shapes) -> bytes:
    """The 64-byte palette-1 configuration for `shapes`: (rows, bytes per row) of tiles 0, 1,
    ... (unlisted tiles stay unconfigured)."""
    if len(shapes) > TILES:
        raise ValueError(f"at most {TILES} tiles, got {len(shapes)}")
    raw = bytearray(64)
    raw[0] = 1                                  # palette 1
    for t, (rows, row_bytes) in enumerate(shapes):
        if not (0 < rows <= ROWS and 0 < row_bytes <= ROW_BYTES and row_bytes % 4 == 0):
            raise ValueError(f"tile {t}: {rows} rows of {row_bytes} bytes")
        raw[16 + 2 * t:18 + 2 * t] = row_bytes.to_bytes(2, "little")
        raw[48 + t] = rows
    return bytes(raw)


def _fn(b, name, args):
    module = b.module
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name=name)
    return fn


def _tile(t: int):
    if not 0 <= t < TILES:
        raise ValueError(f"no tile {t}")
    return ir.Constant(I8, t)


def load_config(b, shapes, name="tpp_amx_config"):
    """ldtilecfg from a module constant holding config_bytes(shapes)."""
    data = config_bytes(shapes)
    g = b.module.globals.get(name)
    if g is None:
        ty = ir.ArrayType(I8, 64)
        g = ir.GlobalVariable(b.module, ty, name)
        g.initializer = ir.Constant(ty, bytearray(data))
        g.global_constant = True
        g.linkage = "internal"
        g.align = 64
    b.call(_fn(b, "llvm.x86.ldtilecfg", [PTR]), [g])


def release(b):
    b.call(_fn(b, "llvm.x86.tilerelease", []), [])


def zero(b, t: int):
    b.call(_fn(b, "llvm.x86.tilezero", [I8]), [_tile(t)])


def _i64(x):
    return ir.Constant(I64, x) if isinstance(x, int) else x


def load(b, t: int, ptr, stride_bytes):
    """Tile t <- rows at ptr, ptr + stride, ... (stride: an i64 value or int, in bytes)."""
    b.call(_fn(b, "llvm.x86.tileloadd64", [I8, PTR, I64]), [_tile(t), ptr, _i64(stride_bytes)])


def store(b, t: int, ptr, stride_bytes):
    """Tile t -> rows at ptr, ptr + stride, ..."""
    b.call(_fn(b, "llvm.x86.tilestored64", [I8, PTR, I64]), [_tile(t), ptr, _i64(stride_bytes)])


def dot_bf16(b, c: int, a: int, bt: int):
    """Tile c (f32) += tile a (bf16 rows) x tile bt (bf16 VNNI pairs)."""
    b.call(_fn(b, "llvm.x86.tdpbf16ps", [I8, I8, I8]), [_tile(c), _tile(a), _tile(bt)])
