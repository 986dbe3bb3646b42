"""Autotuning of ops.matmul / ops.linear (`ops.tune`, defined here): search the blocking, measure, keep the winner on disk.

    result = ops.tune("matmul", 512, 768, 3072)            # M, N, K; f32; <= 20 s by default
    result.best, result.speedup                            # the winner and its gain over the
                                                           # heuristic, measured in this run
    ops.matmul(a, ops.pack_kn(b))                          # now runs the stored winner
    tpp-bench tune --shape 512x768x3072                    # the same from the command line

Opt in: nothing is tuned unless `tune` is called; operators only *read* stored winners. What
is searched, for one (N, K, dtypes) problem at the M given:
  bm      rows per BRGEMM (the register-blocked C tile's row count times a few)
  kc      K elements per BRGEMM call (whole K, or chunks; chunks need an f32 output)
  bn      the packed weight's panel width (ops.pack_kn(b, bn=...))
  order   the parallel band's order: "CB" (column panels outer: a thread walks one panel of
          the weight over many row blocks) or "BC" (row blocks outer: a block of x stays in
          cache while the thread walks the panels)
  threads one thread or the whole team (a small problem can lose to the team's wake-up)
A cost model ranks the candidates first and prunes those whose working set cannot fit (an x
block and a weight panel must fit in L2 together: bm*kc + kc*bn elements); candidates are then
measured in that order (median of a few calls each, interleaved with the heuristic's blocking
so load changes hit both) until the time budget runs out, so a short budget still measures the
most promising ones. The few fastest that beat the heuristic by more than the noise margin
(`margin`, default 3%) are then measured again, interleaved with the heuristic, and the winner
is kept only if it still beats the heuristic's blocking by the margin in that confirmation
round (2 * repeats + 1 calls of each finalist and as many of the heuristic after the budget).
The heuristic is measured as ops.matmul runs a call without a winner (`_baseline`: its panel
width and order, bf16 weights on a matrix unit included; a bf16 output with a long K summed in
f32 chunks, ops.matmul_longk), stored winners ignored while it is built.

Winners are stored in the disk cache (tpp.runtime.cache, `TPP_CACHE_DIR`) under a key of
(N, K, input and output dtype, bias, activation, the CPU's fingerprint; matmul and linear run
one nest, so they share it), with the M they were measured at: another CPU never reads them.
A winner serves the calls of that weight with at least M / SHARE rows (the compiled nest runs
any M); calls with fewer take the heuristic's nest, compiled on the first such call: a winner
found at one M can lose far below it (a "BC" order measured at 4096 rows splits a 65..128-row
call between two threads as one full row block and a sliver: 384 x 384, 70 rows, 2 threads,
107 us with the heuristic, 174 us with such a winner). Tune at the M you run most. Winners
stored by an earlier format (without their M) are not read. The winner's panel width
is stored apart under (N, K, dtype), for ops.pack_kn / pack_nk to pack new weights with it;
a weight packed with another bn keeps the heuristic. `lookup(...)` and `lookup_bn(...)` read
them, memoized per process; `forget()` drops the memo (the disk entries stay: delete
TPP_CACHE_DIR to start over).
"""
from __future__ import annotations

import contextlib
import functools
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import tpp
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime import cache, registry
from tpp.runtime.device import CPU

_FORMAT = "ops.tune/2"     # /2: the value carries the M the winner was measured at
SHARE = 2                  # a winner serves calls of at least its M / SHARE rows
_L2_ELEMENTS = (512 * 1024) // 4     # what the model assumes fits in L2 with room to spare
_OPS = ("matmul", "linear")
FINALISTS = 3              # candidates the confirmation round measures again (_confirmed)


@dataclass(frozen=True)
class Candidate:
    bm: int
    kc: int
    bn: int
    order: str = "CB"
    threads: int | None = None     # None: the team (tpp.get_num_threads())
    group: int | None = None       # weight panels per group (ops.Blocking)

    def blocking(self):
        from .matmul import Blocking
        return Blocking(self.bm, self.kc, self.order, self.threads, self.group)


@dataclass
class TuneResult:
    op: str
    shape: tuple                   # (M, N, K)
    dtype: str
    heuristic: Candidate
    best: Candidate
    seconds: dict = field(default_factory=dict)   # Candidate -> median seconds per call
    stored: bool = False

    @property
    def speedup(self) -> float:
        """The heuristic's time over the winner's (>= 1)."""
        return self.seconds[self.heuristic] / self.seconds[self.best]

    def gflops(self, cand: Candidate) -> float:
        m, n, k = self.shape
        return 2 * m * n * k / self.seconds[cand] / 1e9


def _fingerprint() -> str:
    return registry.for_device(CPU).cache_key_parts()[1]     # the CPU target's key


def _key(n, k, dtype, out_dtype, bias, activation) -> str:
    dtype, out_dtype = _dt.lookup(dtype).name, _dt.lookup(out_dtype).name
    return (f"{_FORMAT}|gemm|n={n}|k={k}|{dtype}->{out_dtype}|bias={bool(bias)}|"
            f"act={activation}|{_fingerprint()}")


def _bn_key(n, k, dtype) -> str:
    return f"{_FORMAT}|bn|n={n}|k={k}|{_dt.lookup(dtype).name}|{_fingerprint()}"


def _disk() -> cache.DiskCache:
    return cache.DiskCache(cache.default_directory())


@functools.lru_cache(maxsize=1024)
def _stored(key: str):
    """The JSON value stored under key, or None (none, or not ours: as if none)."""
    payload = _disk().load(key)
    if payload is None:
        return None
    try:
        return json.loads(payload.decode())
    except (ValueError, UnicodeDecodeError):
        return None


def lookup(n: int, k: int, dtype, out_dtype, bias: bool, activation):
    """The stored winner's Candidate for this problem on this CPU, or None."""
    found = lookup_with_rows(n, k, dtype, out_dtype, bias, activation)
    return None if found is None else found[0]


_IGNORING = threading.local()     # .on: this thread's lookups find nothing (_heuristic_only)


@contextlib.contextmanager
def _heuristic_only():
    """Within: this thread's lookups find no stored winner (tune's baseline is built so)."""
    _IGNORING.on = True
    try:
        yield
    finally:
        _IGNORING.on = False


def lookup_with_rows(n: int, k: int, dtype, out_dtype, bias: bool, activation):
    """(Candidate, the fewest rows it serves: its M // SHARE, at least 1) of the stored winner
    for this problem on this CPU, or None."""
    if getattr(_IGNORING, "on", False):
        return None
    value = _stored(_key(n, k, dtype, out_dtype, bias, activation))
    if not isinstance(value, dict):
        return None
    value = dict(value)
    m = value.pop("m", None)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        return None
    try:
        return Candidate(**value), max(1, m // SHARE)
    except TypeError:
        return None


def lookup_bn(n: int, k: int, dtype):
    """The panel width a stored winner packs (N, K) weights of this dtype with, or None."""
    if getattr(_IGNORING, "on", False):
        return None
    value = _stored(_bn_key(n, k, dtype))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def forget() -> None:
    """Drop this process' memo of stored winners (the disk entries stay)."""
    _stored.cache_clear()


def _tiles(dtype) -> bool:
    """Whether ops.pack_kn gives host weights of this dtype matrix-unit panels."""
    return _dt.lookup(dtype) == _dt.BF16 and tpp.has_matrix_unit(_dt.BF16)


def heuristic(k: int, n: int, out_dtype, dtype=None) -> Candidate:
    """The blocking and panel width ops.matmul runs host data of `dtype` (default: out_dtype)
    with when no winner is stored (matmul.heuristic_blocking, packing.default_bn). A bf16
    output with a long K runs its K in chunks besides (ops.matmul_longk), which no Candidate
    describes: tune measures that plan as the heuristic's (_baseline)."""
    from .matmul import heuristic_blocking
    from .packing import default_bn
    dtype = _dt.lookup(out_dtype if dtype is None else dtype)
    bn = default_bn(n, _tiles(dtype), k)
    bl = heuristic_blocking(k, n, bn, dtype, _dt.lookup(out_dtype))
    return Candidate(bl.bm, min(bl.kc, k), bn, bl.order, group=bl.group)


def candidates(m: int, n: int, k: int, dtype, out_dtype) -> list:
    """Every candidate of the search space that is valid for this problem, ranked by the cost
    model (best first); the heuristic's first of all."""
    from .packing import TILE_PANELS
    base = heuristic(k, n, out_dtype, dtype)
    vnni = dtype == _dt.BF16
    widths = (32, 64, 128) + (TILE_PANELS if _tiles(dtype) else ())
    kcs = {k} if out_dtype == _dt.BF16 else {k} | {c for c in (512, 1024, 2048, 4096) if c < k}
    if vnni:
        kcs = {c for c in kcs if c == k or c % 2 == 0}
    found = set()
    for bm in (32, 64, 96, 128):
        for kc in kcs:
            for bn in widths:
                if bn > max(32, n) or bm > max(32, m):
                    continue
                for order in ("CB", "BC"):
                    for threads in (None, 1):
                        found.add(Candidate(bm, kc, bn, order, threads))
    found.discard(base)
    return [base] + sorted(found, key=lambda c: _model(c, m, n, k))


def _model(c: Candidate, m: int, n: int, k: int) -> float:
    """Estimated relative cost (lower is better): a penalty when the x block and the weight
    panel overflow L2, the C tile reloads per K chunk, the partial row and column blocks'
    wasted work, and the team's split of the band."""
    footprint = c.bm * c.kc + c.kc * c.bn
    spill = max(1.0, footprint / _L2_ELEMENTS) ** 2
    chunks = -(-k // c.kc)
    reload = 1 + 0.03 * (chunks - 1)
    rows = -(-m // c.bm) * c.bm / m
    cols = -(-n // c.bn) * c.bn / n
    team = registry.for_device(CPU).num_threads()
    work = -(-m // c.bm) * -(-n // c.bn)
    threads = 1 if c.threads == 1 else team
    split = -(-work // threads) * threads / max(work, 1)
    parallel = 1.0 if threads == 1 else 1.0 / team
    return spill * reload * rows * cols * split * parallel * (1.05 if c.order == "BC" else 1.0)


def tune(op: str, m: int, n: int, k: int, *, dtype="f32", out_dtype=None, bias: bool = False,
         activation=None, budget_s: float = 20.0, repeats: int = 5, margin: float = 0.03,
         store: bool = True, space=None) -> TuneResult:
    """Search the blocking of `op` ("matmul" or "linear": the same nest) for an (m, k) @ (k, n)
    problem within budget_s seconds of measuring, and store the winner (see the module
    docstring). space: a list of Candidates to try instead of candidates(...)."""
    if op not in _OPS:
        raise ArgumentError(f"ops.tune: op must be one of {', '.join(_OPS)}, got {op!r}")
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ArgumentError(f"ops.tune: {name} must be a positive int, got {v!r}")
    if not budget_s > 0 or not isinstance(repeats, int) or repeats < 1:
        raise ArgumentError("ops.tune: budget_s must be > 0 and repeats an int >= 1")
    m, n, k = int(m), int(n), int(k)
    dt = _dt.lookup(dtype)
    dt_out = _dt.lookup(out_dtype) if out_dtype is not None else dt
    a, b, bias_v = _problem(m, n, k, dt, dt_out, bias)
    space = candidates(m, n, k, dt, dt_out) if space is None else list(space)
    base = heuristic(k, n, dt_out, dt)
    if base not in space:
        space.insert(0, base)
    times: dict = {}
    runner = functools.partial(_runner, a, b, bias_v, dt_out, activation)
    base_run = _baseline(a, b, bias_v, dt_out, activation, base)
    base_times: list = []
    deadline = time.perf_counter() + budget_s
    for cand in space:
        if time.perf_counter() > deadline and cand is not space[0]:
            break
        run = base_run if cand == base else runner(cand)
        samples = []
        for _ in range(repeats):          # interleaved with the heuristic's calls
            samples.append(_time(run))
            if cand != base:
                base_times.append(_time(base_run))
        times[cand] = statistics.median(samples)
    if base_times:
        times[base] = statistics.median(base_times + [times[base]])
    best = _confirmed(times, base, base_run, runner, 2 * repeats + 1, margin)
    result = TuneResult(op, (m, n, k), dt.name, base, best, times)
    if store and best != base:
        disk = _disk()
        result.stored = (disk.store(_key(n, k, dt, dt_out, bias, activation),
                                    json.dumps(dict(asdict(best), m=m)).encode()) is not None
                         and disk.store(_bn_key(n, k, dt), json.dumps(best.bn).encode())
                         is not None)
    from .matmul import forget_tuned
    forget_tuned()      # the plans made so far ignored the stored winners (or predate them)
    return result


def _confirmed(times, base, base_run, runner, rounds, margin):
    """The winner of a search (times: candidate -> median seconds, updated in place): the
    FINALISTS fastest candidates that beat the heuristic by the margin are measured again,
    `rounds` calls each interleaved with the heuristic's, and the winner is the fastest of
    them by these medians if it still beats the heuristic's by the margin, else the heuristic.

    The search's minimum over tens of noisy medians is biased low (whichever candidate drew
    the quietest moments of a shared machine looks fastest): without the confirmation, a
    2-core Zen 5 stored winners that ran at 0.94-0.96x of the heuristic in the next
    measurement (tpp-bench tune, 512x3072x768 and 512x768x3072)."""
    finalists = sorted((c for c in times if c != base and times[c] <= times[base] * (1 - margin)),
                       key=times.get)[:FINALISTS]
    if not finalists:
        return base
    runs = {c: runner(c) for c in finalists}
    samples = {c: [] for c in finalists}
    base_samples = []
    for _ in range(rounds):
        for c in finalists:
            samples[c].append(_time(runs[c]))
            base_samples.append(_time(base_run))
    times[base] = statistics.median(base_samples)
    for c in finalists:
        times[c] = statistics.median(samples[c])
    best = min(finalists, key=times.get)
    return best if times[best] <= times[base] * (1 - margin) else base


def _problem(m, n, k, dt, dt_out, bias):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), np.float32).astype(dt.numpy)
    b = rng.standard_normal((k, n), np.float32).astype(dt.numpy)
    bias_v = rng.standard_normal(n, np.float32).astype(dt_out.numpy) if bias else None
    return a, b, bias_v


def _runner(a, b, bias, dt_out, activation, cand: Candidate):
    """A no-argument callable running ops.matmul with cand's blocking and packing."""
    from .matmul import matmul
    from .packing import pack_kn
    packed = pack_kn(b, bn=cand.bn)
    out = np.empty((a.shape[0], b.shape[1]), dt_out.numpy)
    bl = cand.blocking()
    call = functools.partial(matmul, a, packed, out, bias, activation,
                             out_dtype=dt_out.name, blocking=bl)
    call()      # compile outside the timing
    return call


def _baseline(a, b, bias, dt_out, activation, base: Candidate):
    """A no-argument callable running ops.matmul as it runs without blocking= and without a
    stored winner (base: its Candidate, for the panel width): the candidates' yardstick."""
    from .matmul import forget_tuned, matmul
    from .packing import pack_kn
    out = np.empty((a.shape[0], b.shape[1]), dt_out.numpy)
    forget_tuned()      # no plan made earlier, perhaps on a stored winner, is reused
    with _heuristic_only():
        packed = pack_kn(b, bn=base.bn)
        call = functools.partial(matmul, a, packed, out, bias, activation,
                                 out_dtype=dt_out.name)
        call()      # compiles, and keeps the plan in the weight, built without stored winners
    return call


def _time(run) -> float:
    """Seconds of one call (at least ~2 ms of calls, averaged)."""
    start = time.perf_counter()
    run()
    once = time.perf_counter() - start
    calls = max(1, min(50, int(0.002 / max(once, 1e-7))))
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls
