"""The two forms of every generated TPP body: a standalone kernel, or a block-cooperative
`__device__` function (what a loop nest calls, tpp_cuda.loopnest).

A generator writes the body of a spec once, in terms of eight names for its place in the work:

    bix, biy   the block's index (x, y)          gdx, gdy   blocks in the grid (x, y)
    tix, tiy   the thread's index in the block   bdx, bdy   threads in the block (x, y)

and a `Form` declares them in a prologue:

* `KERNEL` (the standalone `extern "C" __global__` kernel): they are blockIdx, gridDim,
  threadIdx and blockDim, so the body's grid-stride loops cover the problem for any grid.
* `Form(threads)` (the block form): a `__device__` function all `threads` threads of a 1-D
  block call together (blockDim == (threads, 1, 1)); the block is the whole grid
  (bix = biy = 0, gdx = gdy = 1) and its linear thread index is split as tix = t % BX,
  tiy = t / BX, with BX * BY == threads (a generator picks BX, BY). So the same loops make the
  one block do all the work. Every thread must call the function (it may contain barriers); it
  returns with no barrier at its end: the caller synchronizes before touching its results.

`Form.function(name, params, body, ...)` wraps the body as the form's C function. A block
function's definition is guarded by `#ifndef TPP_BLOCK_<name>`, so several sources that call
the same function may be joined into one translation unit. `Block` is what a generator's
`block_function(spec, threads)` returns: the function's name, its source (preambles included)
and the dynamic shared memory it uses (`extern __shared__ ... tpp_smem[]`, shared by all block
functions of one kernel: they run one after another, separated by barriers).
"""
from __future__ import annotations

from dataclasses import dataclass

_NAMES = ("bix", "biy", "gdx", "gdy", "tix", "tiy", "bdx", "bdy")
BLOCK_PREAMBLE = "#include <assert.h>\n"   # a block form asserts its block shape
BLOCK_THREADS = (64, 128, 256, 512, 1024)    # the thread counts a block form supports


@dataclass(frozen=True)
class Block:
    """A spec's block function: `name(params...)` (the standalone kernel's parameters, in its
    order), defined in `source`, using `shared_bytes` of dynamic shared memory."""
    name: str
    source: str
    shared_bytes: int = 0


@dataclass(frozen=True)
class Form:
    """KERNEL (threads None) or the block form for a 1-D block of `threads` threads."""
    threads: int | None = None

    def __post_init__(self):
        if self.threads is not None and self.threads not in BLOCK_THREADS:
            raise ValueError(f"a block function runs on {BLOCK_THREADS} threads, "
                             f"got {self.threads}")

    @property
    def kernel(self) -> bool:
        return self.threads is None

    def name(self, kernel_name: str) -> str:
        """The C name of the spec's function in this form."""
        return kernel_name if self.kernel else f"{kernel_name}_b{self.threads}"

    def split(self, bx: int) -> tuple:
        """(BX, BY) of a block form whose body wants BX threads along x: BX (a power of two,
        clipped to the block), BY = threads / BX."""
        bx = min(bx, self.threads)
        if self.threads % bx:
            raise ValueError(f"block width {bx} does not divide {self.threads} threads")
        return bx, self.threads // bx

    def prologue(self, bx: int | None = None, by: int | None = None) -> str:
        """The declarations of the eight names. Kernel form: the built-ins; with bx, by given
        the kernel is written for blockDim == (bx, by, 1) (constants BX, BY, asserted). Block
        form: bx * by == threads (BX, BY constants; blockDim.x == threads asserted)."""
        if self.kernel:
            text = ("  const unsigned bix = blockIdx.x, biy = blockIdx.y, gdx = gridDim.x, "
                    "gdy = gridDim.y;\n"
                    "  const unsigned tix = threadIdx.x, tiy = threadIdx.y, bdx = blockDim.x, "
                    "bdy = blockDim.y;\n")
            if bx is not None:
                text += (f"  constexpr int BX = {bx}, BY = {by};\n"
                         f"  assert(blockDim.x == BX && blockDim.y == BY && blockDim.z == 1);\n")
        else:
            if bx is None or bx * by != self.threads:
                raise ValueError(f"a block form splits its {self.threads} threads as BX x BY, "
                                 f"got {bx} x {by}")
            text = (f"  constexpr int BX = {bx}, BY = {by};\n"
                    f"  assert(blockDim.x == {self.threads} && blockDim.y == 1 && "
                    f"blockDim.z == 1);\n"
                    "  const unsigned bix = 0, biy = 0, gdx = 1, gdy = 1;\n"
                    "  const unsigned tix = threadIdx.x % BX, tiy = threadIdx.x / BX, "
                    "bdx = BX, bdy = BY;\n")
        return text + "  " + " ".join(f"(void){n};" for n in _NAMES) + "\n"

    def function(self, kernel_name: str, params, body: str, *, bounds: str = "") -> str:
        """The C function of this form: `extern "C" __global__ void [bounds] name(params)`
        for the kernel, a guarded `__device__ void name(params)` for a block form. `body`
        includes its prologue."""
        name, params = self.name(kernel_name), ", ".join(params)
        if self.kernel:
            return f'extern "C" __global__ void {bounds}{name}({params}) {{\n{body}}}\n'
        guard = f"TPP_BLOCK_{name}"
        return (f"#ifndef {guard}\n#define {guard}\n"
                f"__device__ __noinline__ void {name}({params}) {{\n{body}}}\n#endif\n")


KERNEL = Form()


def guarded(name: str, text: str) -> str:
    """text wrapped in an include guard named after `name` (helpers a block function needs,
    defined once in a translation unit that joins several sources)."""
    return f"#ifndef TPP_DEFS_{name}\n#define TPP_DEFS_{name}\n{text}#endif\n"


def pow2_at_least(k: int) -> int:
    p = 1
    while p < k:
        p *= 2
    return p
