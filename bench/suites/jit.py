"""jit: what compiling a kernel costs, cold and from the disk cache.

Cases (times in ms; each op's cases are named "<case>/<op>"):
  compile_cold/<op>   k.compile() of a spec never seen before, with an empty TPP_CACHE_DIR, in a
                      process where LLVM is already initialised: IR generation, O3, code
                      generation, linking (the `ld` child's time counts only with
                      --clock wall), the disk-cache write and the load. Fresh specs per repetition
                      (distinct m, same code shape), median over the repetitions.
  compile_first       the first k.compile() of a new process (cold): the above plus LLVM's
                      one-time initialisation (importing llvmlite, target machine).
  cache_load/<op>     the first k.compile() in a new process, against a warm TPP_CACHE_DIR: what
                      a program pays at start-up per kernel it had compiled before (a dlopen:
                      LLVM is not imported); one `python -c` process per repetition.
  cache_load_next/<op>  a second cached kernel in that process: the load alone.
  import_tpp          `import tpp` in a new process (after numpy is imported).
  linear_layer/fwd    the first forward of a new ops.torch.Linear(768, 768) on a (4, 50, 768)
                      input, with an empty cache (LLVM initialised): everything its nests
                      compile (packing, GEMM, remainder kernels). extra: kernels compiled.
  linear_layer/fwd_bwd  that forward plus the first backward (dx and dw nests).
  linear_new_m/fwd, linear_new_m/fwd_bwd  the same layer at a new M (4, 77, 768) afterwards:
                      no compile (extra: kernels compiled, expected 0), only the call.

Durations use the run's clock (--clock: this thread's CPU time by default, or elapsed time).
All of it runs in subprocesses with a private temporary TPP_CACHE_DIR, removed afterwards; the
user's kernel cache is neither read nor written.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import register
from ._common import time_record
from ..timing import summarize

OPS = ("relu", "gelu", "brgemm")   # brgemm: f32, (m, 64) x (64, n), stride batch
N = 64
LOAD_M = 64           # the spec the load processes find in the cache
LOAD_NEXT_M = 63      # the second one they load
LINEAR_N = 768        # linear_* cases: an ops.torch.Linear(768, 768)

# runs in a fresh interpreter: argv[1] is a JSON config; prints one JSON line
_COMPILE_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
clock = time.thread_time if cfg["clock"] == "cpu" else time.perf_counter
import numpy
import tpp
def make(op, m, n):
    return tpp.brgemm(m, n, 64) if op == "brgemm" else tpp.unary(op, m, n)
res = {"first": None, "cold": {}, "errors": {}}
t0 = clock()
tpp.unary("identity", 8, 8).compile()
res["first"] = clock() - t0
for op in cfg["ops"]:
    times = []
    try:
        for r in range(cfg["reps"]):
            k = make(op, cfg["m0"] + r, cfg["n"])
            t0 = clock()
            k.compile()
            times.append(clock() - t0)
        for m in cfg["warm_ms"]:
            make(op, m, cfg["n"]).compile()
    except Exception as exc:
        res["errors"][op] = f"{type(exc).__name__}: {exc}"
    res["cold"][op] = times
print(json.dumps(res))
"""

_LOAD_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
clock = time.thread_time if cfg["clock"] == "cpu" else time.perf_counter
import os
import numpy
before = len([f for f in os.listdir(os.environ["TPP_CACHE_DIR"]) if f.endswith(".tppk")])
t0 = clock()
import tpp
t_import = clock() - t0
def make(op, m, n):
    return tpp.brgemm(m, n, 64) if op == "brgemm" else tpp.unary(op, m, n)
k = make(cfg["op"], cfg["m"], cfg["n"])
t0 = clock()
k.compile()
t_load = clock() - t0
k2 = make(cfg["op"], cfg["m_next"], cfg["n"])
t0 = clock()
k2.compile()
t_next = clock() - t0
after = len([f for f in os.listdir(os.environ["TPP_CACHE_DIR"]) if f.endswith(".tppk")])
print(json.dumps({"import": t_import, "load": t_load, "next": t_next,
                  "new_entries": after - before}))
"""


# a new Linear layer and a new M on it: argv[1] is a JSON config; prints one JSON line
_LINEAR_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
clock = time.thread_time if cfg["clock"] == "cpu" else time.perf_counter
import torch
import tpp, ops.torch
tpp.unary("identity", 8, 8).compile()          # LLVM's one-time initialisation, not counted
torch.manual_seed(0)
layer = ops.torch.Linear(cfg["n"], cfg["n"])
res = {}
for name, seq in (("layer", cfg["seq"]), ("new_m", cfg["seq_next"])):
    x = torch.randn(4, seq, cfg["n"], requires_grad=True)
    built = tpp.cache_info()["compiled"]
    t0 = clock()
    y = layer(x)
    t1 = clock()
    y.sum().backward()
    t2 = clock()
    res[name] = {"fwd": t1 - t0, "fwd_bwd": t2 - t0,
                 "compiled": tpp.cache_info()["compiled"] - built}
print(json.dumps(res))
"""


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _spawn(script: str, cfg: dict, cache_dir: str, timeout: float = 300) -> dict:
    env = dict(os.environ)
    env["TPP_CACHE_DIR"] = cache_dir
    env.pop("TPP_DISK_CACHE", None)
    env["PYTHONPATH"] = os.pathsep.join([_repo_root()] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"subprocess failed (exit {proc.returncode}): "
                           f"{tail[-1] if tail else 'no output'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _reps(ctx) -> tuple[int, int, tuple]:
    """(cold compiles per op, load processes per op, ops)."""
    if ctx.config.tiny:
        return 2, 1, ("relu",)
    if ctx.config.quick:
        return 3, 3, OPS
    return 7, 5, OPS


@register("jit", help="cold compile time of an eltwise kernel and its load time from the "
                      "disk cache in a new process; the first call of a new Linear layer and "
                      "of a new M on it")
def run(ctx):
    if not ctx.wants_dtype("f32"):   # the kernels compiled and loaded are f32
        return
    reps, loads, ops = _reps(ctx)
    shape = (LOAD_M, N)
    cache_dir = tempfile.mkdtemp(prefix="tpp-bench-jit-")
    try:
        cfg = {"ops": list(ops), "reps": reps, "m0": 1000, "n": N,
               "warm_ms": [LOAD_M, LOAD_NEXT_M], "clock": ctx.config.clock}
        ctx.log(f"  compiling {reps} fresh specs per op ({', '.join(ops)}) in a subprocess")
        try:
            res = _spawn(_COMPILE_SCRIPT, cfg, cache_dir)
        except Exception as exc:  # noqa: BLE001
            ctx.failed("jit compile subprocess", exc)
            return
        if res["first"] is not None:
            time_record(ctx, suite="jit", case="compile_first", provider="tpp", shape=(8, 8),
                        stats=summarize([res["first"]]), unit="ms", op="identity")
        working = []
        for op in ops:
            if op in res["errors"]:
                ctx.note(f"jit compile {op}: {res['errors'][op]}")
            times = res["cold"].get(op) or []
            if times and op not in res["errors"]:
                working.append(op)
                time_record(ctx, suite="jit", case=f"compile_cold/{op}", provider="tpp",
                            shape=(1000, N), stats=summarize(times), unit="ms", op=op,
                            repetitions=len(times), m_range=[1000, 1000 + len(times) - 1])
        imports = []
        for op in working:
            load, nxt = [], []
            ctx.log(f"  loading {op} from the disk cache in {loads} new process(es)")
            for _ in range(loads):
                try:
                    r = _spawn(_LOAD_SCRIPT, {"op": op, "m": LOAD_M, "m_next": LOAD_NEXT_M,
                                              "n": N, "clock": ctx.config.clock}, cache_dir)
                except Exception as exc:  # noqa: BLE001
                    ctx.failed(f"jit cache load {op}", exc)
                    break
                if r["new_entries"]:
                    ctx.note(f"jit cache load {op}: the new process stored "
                             f"{r['new_entries']} new cache entr(ies): it recompiled instead "
                             f"of loading (the cache key is not stable across processes?)")
                load.append(r["load"])
                nxt.append(r["next"])
                imports.append(r["import"])
            if load:
                time_record(ctx, suite="jit", case=f"cache_load/{op}", provider="tpp",
                            shape=shape, stats=summarize(load), unit="ms", op=op,
                            processes=len(load))
                time_record(ctx, suite="jit", case=f"cache_load_next/{op}", provider="tpp",
                            shape=(LOAD_NEXT_M, N), stats=summarize(nxt), unit="ms", op=op,
                            processes=len(nxt))
        if imports:
            time_record(ctx, suite="jit", case="import_tpp", provider="tpp", shape=(),
                        stats=summarize(imports), unit="ms", processes=len(imports))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    _linear_cases(ctx, loads)


def _linear_cases(ctx, processes: int):
    """linear_layer/* and linear_new_m/*: one fresh process and empty cache per sample."""
    samples = []
    ctx.log(f"  a new Linear({LINEAR_N}, {LINEAR_N}) layer, then a new M, in {processes} "
            f"new process(es)")
    for _ in range(processes):
        cache_dir = tempfile.mkdtemp(prefix="tpp-bench-jit-")
        try:
            samples.append(_spawn(_LINEAR_SCRIPT, {"n": LINEAR_N, "seq": 50, "seq_next": 77,
                                                   "clock": ctx.config.clock}, cache_dir))
        except Exception as exc:  # noqa: BLE001
            ctx.failed("jit linear layer", exc)
            return
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    for name, seq in (("layer", 50), ("new_m", 77)):
        for part in ("fwd", "fwd_bwd"):
            time_record(ctx, suite="jit", case=f"linear_{name}/{part}", provider="tpp",
                        shape=(4, seq, LINEAR_N), unit="ms", processes=len(samples),
                        stats=summarize([s[name][part] for s in samples]),
                        compiled=[s[name]["compiled"] for s in samples])
