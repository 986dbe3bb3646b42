"""CUDA C for a loop nest (tpp.core.loop_spec.LoopNestSpec): one kernel, whose grid is the
nest's parallel band, calling the block form of each TPP of the body.

The contract (tpp_cuda.plugin.CudaNest runs it):

    kernel_name(spec) -> str       tpp_nest_<hash of spec.key() and THREADS>
    source(spec) -> str            one `extern "C" __global__` kernel, parameters all 64-bit:
                                     1. one device address per tensor, in spec.tensors order
                                        (a pointer to the tensor's element type);
                                     2. one int64 per size, in spec.sizes order;
                                     3. one int64 per order-string level before the parallel
                                        band, in order: that level's value for this launch.
    outer_iterations(spec, sizes) -> list of tuples, the values (3.) of every launch, in the
                                   order the CPU nest runs those levels ([()]: one launch,
                                   []: none)
    launch(spec, sizes) -> Launch  the geometry of every launch of that call
    supported(spec) -> bool        (kernel_name / source raise UnsupportedError otherwise)

`sizes` maps each size name to its int value for the call (None / omitted: a nest without
sizes; a missing size is an ArgumentError). The caller has validated the sizes
(tpp.core.loop_bounds), as for the CPU nest.

Semantics (tpp.core.loop_spec; the CPU backend's tpp_cpu/loopnest.py): the levels before the
parallel band run in every CPU thread with a barrier after each pass over the band; here they
are the host's loop of launches (`outer_iterations`), and their values arrive as arguments.
The band (adjacent upper-case levels) is collapsed into one iteration space of `total` =
product of the levels' trip counts (a level-0 trip count may use the sizes); blocks take its
iterations in a grid-stride loop (`it = blockIdx.x; it < total; it += gridDim.x`), decode each
level's value (mixed radix, innermost fastest, as the CPU does), and skip an iteration whose
blocked level (level > 0) passes its loop's stop. The levels after the band run sequentially
inside the block; a blocked level runs from its parent's value to the parent's block end or
the loop's stop, whichever is first. A nest without a parallel band runs whole in one block.
Loop values, sizes, addresses and guards are int64; `//` is floor division (Python's).

The body: each call is a call of its spec's block function (tpp_cuda.cooperative; every
generator module offers `block_function(spec, threads)`), which ALL threads of the block run
together over the whole block the call addresses, with its operands at tensor base + affine
offset (elements), its int arguments (BRGEMM count / strides, a dropout seed) as int64 and
absent BRGEMM bias / mask as null. A `when` guard wraps the call; guards depend only on loop
values and sizes, so they are block-uniform. A `__syncthreads()` follows every call (outside
its guard), so each call sees its predecessors' results, and the next body iteration this one's.
The block is THREADS threads; the launch's dynamic shared memory is the most any block
function needs (they run one after another, so they share it).
"""
from __future__ import annotations

import functools
import hashlib

from tpp.core.errors import ArgumentError, UnsupportedError
from tpp.core.loop_spec import LETTERS, SIZE, Address, raw_operands

from . import generators
from .cooperative import BLOCK_PREAMBLE, guarded
from .eltwise import _PREAMBLE
from .launch import Launch

THREADS = 128          # threads per block of every nest kernel
MAX_GRID = 65535       # blocks at most: the grid-stride loop covers the rest of the band

_CTYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "u8": "unsigned char",
           "i64": "long long", "i32": "int"}

_NEST_PREAMBLE = guarded("tpp_nest", r"""/* Python's x // d for d >= 1 (C's / truncates) */
static __device__ __forceinline__ long long tpp_floordiv(long long x, long long d) {
  const long long q = x / d;
  return (x % d < 0) ? q - 1 : q;
}
static __device__ __forceinline__ long long tpp_min64(long long a, long long b) {
  return a < b ? a : b;
}
""")


# ---------------------------------------------------------------- the contract
@functools.lru_cache(maxsize=256)
def _blocks(spec) -> dict:
    """call spec -> its Block (block function for THREADS threads), in first-use order;
    UnsupportedError naming the first call the CUDA backend cannot run in a nest. Cached:
    `launch` asks for it at every call of the nest (do not modify the dict)."""
    if getattr(spec, "family", None) != "loopnest":
        raise UnsupportedError(f"tpp_cuda.loopnest builds loop nests, not "
                               f"{getattr(spec, 'family', type(spec).__name__)} specs")
    for t in spec.tensors:
        if t.dtype.name not in _CTYPES:
            raise UnsupportedError(f"tensor {t.name!r}: {t.dtype} tensors are not yet in CUDA "
                                   f"loop nests")
    out = {}
    for k, s in enumerate(spec.kernel_specs()):
        what = f"call {k} ({s.family} {getattr(s, 'op', '')})"
        try:
            module = generators.module_for(s)
            if not module.supported(s) or not hasattr(module, "block_function"):
                raise UnsupportedError(f"{s.family} op {getattr(s, 'op', '?')!r} is not yet in "
                                       f"the CUDA backend")
            if s.family == "brgemm" and s.batch != "stride":
                raise UnsupportedError("a nest calls BRGEMM in stride batch mode")
            out[s] = module.block_function(s, THREADS)
        except UnsupportedError as exc:
            raise UnsupportedError(f"the CUDA backend cannot run this loop nest: {what} has no "
                                   f"block form: {exc}") from None
    return out


def supported(spec) -> bool:
    """Whether `source(spec)` can build the nest."""
    try:
        _blocks(spec)
    except UnsupportedError:
        return False
    return True


def kernel_name(spec) -> str:
    """A C identifier unique to the spec (and THREADS), stable across processes."""
    _blocks(spec)
    digest = hashlib.sha1(f"{spec.key()}/threads={THREADS}".encode()).hexdigest()[:16]
    return f"tpp_nest_{digest}"


def source(spec) -> str:
    """The CUDA C source of the nest's kernel (see the module docstring)."""
    blocks = _blocks(spec)
    functions = "\n".join(dict.fromkeys(b.source for b in blocks.values()))
    kernel = _Kernel(spec, {s: b.name for s, b in blocks.items()}).text(kernel_name(spec))
    return (f"{_PREAMBLE}{BLOCK_PREAMBLE}{_NEST_PREAMBLE}\n{functions}\n"
            f"/* {spec.key()} */\n{kernel}")


def launch(spec, sizes: dict | None = None) -> Launch:
    """The geometry of every launch for these sizes (name -> int; None: a nest without
    sizes): grid min(band iterations, MAX_GRID), at least 1 (one block without a band),
    THREADS threads, the dynamic shared memory the block functions need."""
    blocks = _blocks(spec)
    total = 1
    env = _env(spec, sizes)
    for k in _band(spec):
        lv = spec.levels[k]
        total *= _loop(spec, lv).trips(lv.level, env)
    grid = max(1, min(total, MAX_GRID))
    shared = max((b.shared_bytes for b in blocks.values()), default=0)
    return Launch((grid, 1, 1), (THREADS, 1, 1), shared)


def outer_iterations(spec, sizes: dict | None = None) -> list:
    """The values of the levels before the parallel band (none without a band) for each
    launch, in the order the CPU nest runs them: [()] when there are no such levels, [] when
    their ranges are empty."""
    env = _env(spec, sizes)
    levels = spec.levels[:_band(spec)[0]] if _band(spec) else ()
    out = []

    def walk(k, values, acc):
        if k == len(levels):
            out.append(tuple(acc))
            return
        lv = levels[k]
        loop = _loop(spec, lv)
        stop = loop.stop_at(env)
        if lv.level == 0:
            start, end = loop.start, stop
        else:
            start = values[lv.letter]
            end = min(start + loop.level_step(lv.level - 1), stop)
        for v in range(start, end, loop.level_step(lv.level)):
            walk(k + 1, {**values, lv.letter: v}, acc + [v])

    walk(0, {}, [])
    return out


# ---------------------------------------------------------------- helpers
def _band(spec) -> list:
    return [k for k, lv in enumerate(spec.levels) if lv.parallel]


def _loop(spec, lv):
    return spec.loops[LETTERS.index(lv.letter)]


def _env(spec, sizes) -> dict:
    sizes = sizes or {}
    missing = [n for n in spec.sizes if n not in sizes]
    if missing:
        raise ArgumentError(f"size(s) {', '.join(missing)} of the nest are not given")
    return {SIZE + name: (int(sizes[name]),) * 2 for name in spec.sizes}


def affine(expr, names: dict) -> str:
    """The C int64 expression of an Affine; names maps loop letters and size symbols to C
    variables. Floor terms use tpp_floordiv (Python's //)."""
    parts = []      # (sign, magnitude text)
    for var, c in expr.terms:
        if isinstance(var, str):
            value = names[var]
        else:
            value = f"tpp_floordiv({affine(var.inner, names)}, {var.divisor}LL)"
        parts.append(("-" if c < 0 else "+", value if abs(c) == 1 else f"{abs(c)}LL * {value}"))
    if expr.const or not parts:
        parts.append(("-" if expr.const < 0 else "+", f"{abs(expr.const)}LL"))
    text = ("-" if parts[0][0] == "-" else "") + parts[0][1]
    text += "".join(f" {sign} {value}" for sign, value in parts[1:])
    return text if len(parts) == 1 and parts[0][0] == "+" else f"({text})"


class _Kernel:
    """The text of the nest's kernel (the module docstring's structure)."""

    def __init__(self, spec, functions: dict):
        self.spec, self.functions = spec, functions
        self.band = _band(spec)
        self.outer = list(range(self.band[0])) if self.band else []
        self.lines: list = []

    def emit(self, depth: int, line: str):
        self.lines.append("  " * depth + line)

    def text(self, name: str) -> str:
        spec = self.spec
        params = [f"{_CTYPES[t.dtype.name]}* t{k}" for k, t in enumerate(spec.tensors)]
        params += [f"long long sz{k}" for k in range(len(spec.sizes))]
        params += [f"long long o{k}" for k in self.outer]
        names = {SIZE + s: f"sz{k}" for k, s in enumerate(spec.sizes)}
        for k in self.outer:
            names[spec.levels[k].letter] = f"o{k}"
        doc = ["/* tensors: " + ", ".join(f"t{k} = {t.name}{t.shape_text()} {t.dtype}"
                                          for k, t in enumerate(spec.tensors)) + " */"]
        if spec.sizes:
            doc.append("/* sizes: " + ", ".join(f"sz{k} = {s}" for k, s in
                                                enumerate(spec.sizes)) + " */")
        if self.outer:
            doc.append("/* outer levels (one launch each): " + ", ".join(
                f"o{k} = {self._level_name(k)}" for k in self.outer) + " */")
        self.levels(len(self.outer), names, 1)
        body = "\n".join(self.lines)
        return ("\n".join(doc) + f'\nextern "C" __global__ void __launch_bounds__({THREADS}) '
                f"{name}({', '.join(params)}) {{\n{body}\n}}\n")

    def _level_name(self, k: int) -> str:
        lv = self.spec.levels[k]
        return f"{lv.letter}{lv.level}" + (" (parallel)" if lv.parallel else "")

    def stop(self, loop, names) -> str:
        return f"{loop.stop}LL" if not loop.symbolic else affine(loop.stop, names)

    def levels(self, index: int, names: dict, depth: int):
        spec = self.spec
        if index == len(spec.levels):
            self.body(names, depth)
            return
        if self.band and index == self.band[0]:
            self.parallel_band(names, depth)
            return
        lv = spec.levels[index]
        loop, var = _loop(spec, lv), f"{lv.letter}{lv.level}"
        step = loop.level_step(lv.level)
        if lv.level == 0:
            start, end = f"{loop.start}LL", self.stop(loop, names)
        else:
            start = names[lv.letter]
            end = (f"tpp_min64({start} + {loop.level_step(lv.level - 1)}LL, "
                   f"{self.stop(loop, names)})")
        self.emit(depth, f"for (long long {var} = {start}, {var}_end = {end}; {var} < {var}_end; "
                         f"{var} += {step}LL) {{   /* {self._level_name(index)} */")
        self.levels(index + 1, {**names, lv.letter: var}, depth + 1)
        self.emit(depth, "}")

    def parallel_band(self, names: dict, depth: int):
        """The band collapsed: a grid-stride loop over its iterations, each level's value decoded
        (innermost fastest); an iteration whose blocked level passes the stop is skipped."""
        spec, inner = self.spec, dict(names)
        trips = []
        for k in self.band:
            lv = spec.levels[k]
            loop = _loop(spec, lv)
            if lv.level > 0 or not loop.symbolic:
                trips.append(f"{loop.trips(lv.level, {})}LL")
            else:
                span, step = f"({self.stop(loop, names)} - {loop.start}LL)", loop.level_step(0)
                count = span if step == 1 else f"({span} + {step - 1}LL) / {step}LL"
                trips.append(f"({span} > 0 ? {count} : 0LL)")
        for k, t in zip(self.band, trips):
            self.emit(depth, f"const long long trips{k} = {t};   /* {self._level_name(k)} */")
        total = " * ".join(f"trips{k}" for k in self.band)
        self.emit(depth, f"const long long total = {total};")
        self.emit(depth, "for (long long it = blockIdx.x; it < total; it += gridDim.x) {")
        d = depth + 1
        self.emit(d, "long long rest = it;")
        for k in reversed(self.band):
            self.emit(d, f"const long long index{k} = rest % trips{k};")
            self.emit(d, f"rest /= trips{k};")
        self.emit(d, "(void)rest;")
        for k in self.band:
            lv = spec.levels[k]
            loop, var = _loop(spec, lv), f"{lv.letter}{lv.level}"
            base = f"{loop.start}LL" if lv.level == 0 else inner[lv.letter]
            self.emit(d, f"const long long {var} = {base} + index{k} * "
                         f"{loop.level_step(lv.level)}LL;")
            inner[lv.letter] = var
            if lv.level > 0:     # the parent's block may pass the stop (block-uniform skip)
                self.emit(d, f"if ({var} >= {self.stop(loop, inner)}) continue;")
        self.levels(self.band[-1] + 1, inner, d)
        self.emit(depth, "}")

    def body(self, names: dict, depth: int):
        for call in self.spec.calls:
            args = []
            for arg, op in zip(call.args, raw_operands(call.spec)):
                if arg is None:
                    args.append("nullptr")
                elif isinstance(arg, Address):
                    args.append(f"t{arg.tensor} + {affine(arg.offset, names)}")
                else:
                    args.append(affine(arg, names))
            text = f"{self.functions[call.spec]}({', '.join(args)});"
            if call.when:
                cond = " && ".join(f"{affine(c.expr, names)} {c.op} 0" for c in call.when)
                text = f"if ({cond}) {text}"
            self.emit(depth, text)
            self.emit(depth, "__syncthreads();")
