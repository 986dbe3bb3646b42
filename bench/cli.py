"""tpp-bench: the microbenchmark command line.

    tpp-bench                         the default suites (peak, eltwise, overhead, brgemm, and
                                      gemm, mlp at their quick sizes; ~30 s)
    tpp-bench gemm mlp                ops.matmul, ops.mlp_forward/backward at full sizes (~1 min)
    tpp-bench eltwise jit             named suites
    tpp-bench norm                    LayerNorm, RMSNorm, softmax (ops.norms) vs torch, 1 thread
    tpp-bench attention               fused attention fwd, fwd+bwd (ops.attention) vs torch SDPA
    tpp-bench conv                    ResNet-50 conv2d layers, fwd and training (ops.conv) vs torch
    tpp-bench model                   all-MiniLM-L6-v2 via ops.torch.optimize vs torch eager (.[model])
    tpp-bench eltwise --shapes 64x64,1024x1024 --json out.json
    tpp-bench brgemm --dtype bf16 --csv out.csv --plot out.png   (out-brgemm.png, ...)
    tpp-bench info                    the machine, the selected target, library versions
    tpp-bench --list                  the suites

Exit status: 0 after a run (cases that could not run are listed under "notes"), 1 when a suite
crashed, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors by raising instead of exiting (main returns a code)."""

    def exit(self, status=0, message=None):
        if message:
            self._print_message(message, sys.stderr)
        raise _Exit(status)


class _Exit(Exception):
    def __init__(self, status):
        super().__init__(status)
        self.status = status


def _shape_list(text: str) -> list:
    shapes = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            m, n = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected shapes like 64x64,4096x4096, got "
                                             f"{part!r}") from None
        if m < 1 or n < 1:
            raise argparse.ArgumentTypeError(f"shape dimensions must be >= 1, got {part!r}")
        shapes.append((m, n))
    if not shapes:
        raise argparse.ArgumentTypeError("expected at least one shape such as 64x64")
    return shapes


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tpp-bench",
        description="Microbenchmarks of the TPP library, each figure a ratio measured in the "
                    "same run: against the machine's compute peak or copy-bandwidth peak and "
                    "against numpy and torch on the same shapes.",
        epilog="suites: 'info', or see --list. Without a suite: the default set, quickly.")
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help="suites to run (default: the quick default set); 'info' describes the "
                        "machine")
    p.add_argument("--quick", action="store_true",
                   help="shorter measurements (noisier figures)")
    p.add_argument("--json", metavar="FILE",
                   help="write the records as a JSON list to FILE ('-' for stdout)")
    p.add_argument("--csv", metavar="FILE",
                   help="write the records as CSV to FILE ('-' for stdout; columns as in the "
                        "JSON, without extra)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a bar chart per suite to FILE-<suite>.png and a roofline to "
                        "FILE-roofline.png (needs matplotlib)")
    p.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                   help="threads for numpy/torch (default 1: the benchmarks are single-threaded; "
                        "gemm and mlp run their thread teams on every core, or on N if N > 1)")
    p.add_argument("--shapes", type=_shape_list, metavar="MxN[,MxN...]",
                   help="block shapes for the eltwise suite (default 64x64,4096x4096)")
    p.add_argument("--providers", default="tpp,numpy,torch,cupy", metavar="LIST",
                   help="comma-separated providers to measure (default tpp,numpy,torch,cupy; "
                        "cupy is measured in the CUDA suites)")
    p.add_argument("--dtype", metavar="LIST",
                   help="comma-separated dtypes of the cases to run (default: all; "
                        "f32, bf16); the peak suite's yardsticks always run")
    p.add_argument("--backend", choices=("cpu", "cuda", "all"), default="all",
                   help="whose default suites run: cpu, cuda (needs cupy and a GPU), or all "
                        "(default: the CPU's, and the GPU's when one is usable)")
    p.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                   help="what a sample's duration is: 'cpu' = this thread's CPU time (immune to "
                        "being descheduled on a shared machine), 'wall' = elapsed time; 'auto' "
                        "(default): cpu with --threads 1, wall otherwise")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking tpp's outputs against tpp.core.reference")
    p.add_argument("--plain", action="store_true", help="plain-text tables even if rich is "
                   "installed")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: tiny sizes
    return p


def pin_threads(threads: int) -> None:
    """Set the thread-count variables before numpy/torch are imported (later has no effect on
    their OpenMP/BLAS pools; torch is pinned again with torch.set_num_threads)."""
    for var in THREAD_ENV:
        os.environ[var] = str(threads)


def cuda_usable() -> bool:
    """Whether the CUDA suites can run here (cupy installed, a GPU visible)."""
    try:
        from tpp_cuda import runtime
    except ImportError:
        return False
    return runtime.available()


def _backends(args) -> tuple:
    if args.backend == "all":
        return ("cpu", "cuda") if cuda_usable() else ("cpu",)
    return (args.backend,)


def _check(args, parser):
    """Usage errors found after parsing (raises _Exit(2) through parser.error)."""
    if args.backend == "cuda" and not cuda_usable():
        parser.error("--backend cuda: no usable GPU (the CUDA backend needs cupy, "
                     "pip install 'tpp[cuda]', and a visible NVIDIA GPU); use --backend cpu")
    if args.csv == "-" and args.json == "-":
        parser.error("--csv - and --json -: only one of them can write to stdout")
    if args.plot == "-":
        parser.error("--plot needs a file name such as out.png")
    if args.plot:
        from . import plot
        if not plot.available():
            parser.error("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[plot]')")


def _dtypes(args, parser) -> tuple:
    from .suites import DTYPES
    if args.dtype is None:
        return DTYPES
    dtypes = tuple(d.strip() for d in args.dtype.split(",") if d.strip())
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        parser.error(f"unknown dtype(s): {', '.join(bad) or '(none given)'}; "
                     f"known: {', '.join(DTYPES)}")
    return dtypes


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        pin_threads(args.threads)    # first: the --plot check imports matplotlib, hence numpy
        _check(args, parser)
    except _Exit as e:
        return e.status

    from . import suites as registry
    from .records import fill_ratios, settle_copy_peaks

    known = registry.load()
    if args.list:
        width = max(len(n) for n in known)
        for s in known.values():
            mark = "*" if s.default else " "
            print(f"{mark} {s.name:<{width}} {s.help}")
        print(f"  {'info':<{width}} the machine, the selected target, GPUs, library versions")
        print("(* = in the default set)")
        return 0

    names = list(args.suites)
    unknown = [n for n in names if n != "info" and n not in known]
    backends = _backends(args)
    try:
        if unknown:
            parser.error(f"unknown suite(s): {', '.join(unknown)}; known: info, "
                         f"{', '.join(known)}")
        gpu_named = [n for n in names if n in known and known[n].backend == "cuda"]
        if gpu_named and not cuda_usable():
            parser.error(f"{', '.join(gpu_named)}: no usable GPU (the CUDA suites need cupy and "
                         f"a visible NVIDIA GPU)")
    except _Exit as e:
        return e.status
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    bad = [p for p in providers if p not in ("tpp", "numpy", "torch", "cupy")]
    if bad or not providers:
        try:
            parser.error(f"unknown provider(s): {', '.join(bad) or '(none given)'}; "
                         f"known: tpp, numpy, torch, cupy")
        except _Exit as e:
            return e.status
    try:
        dtypes = _dtypes(args, parser)
    except _Exit as e:
        return e.status

    from . import info as sysinfo

    if "info" in names:
        details = sysinfo.collect()
        sysinfo.render(details, file=sys.stderr if args.json == "-" else sys.stdout)
        names = [n for n in names if n != "info"]
        if not names:
            if args.json:
                import json
                from .records import write_text
                write_text(json.dumps(details, indent=1), args.json)
            return 0
        print()

    overview = not names
    if overview:
        names = registry.defaults(backends)   # quick: ~30 s on a 2-core Zen 3 (CPU)
    clock = args.clock if args.clock != "auto" else ("cpu" if args.threads == 1 else "wall")
    config = registry.Config(quick=args.quick, tiny=args.tiny, shapes=args.shapes,
                             clock=clock, overview=overview,
                             threads=args.threads, providers=providers, dtypes=dtypes,
                             verify=args.verify,
                             verbose=not args.quiet)
    ctx = registry.Context(config)
    from . import progress
    bar = progress.start(config.verbose)
    ctx.progress = bar.step if bar else None
    from .timing import steady_malloc
    malloc = steady_malloc()     # freed large outputs stay in the process: no page-fault lottery
    t0 = time.perf_counter()
    status = 0
    try:
        for name in names:
            try:
                ctx.run(name)
            except KeyboardInterrupt:
                ctx.note(f"interrupted during {name}")
                status = 130
                break
            except Exception as exc:  # noqa: BLE001 - report, keep what was measured
                import traceback
                traceback.print_exc(file=sys.stderr)
                ctx.failed(f"suite {name} crashed", exc)
                status = 1
    finally:
        if bar:
            bar.stop()
    for r in settle_copy_peaks(ctx.records):
        ctx.note(f"{r.suite} {r.case} {r.shape_text} {r.provider}: {r.extra['above_peak']:.2f}x "
                 f"the best copy at its memory level; its peak fraction is capped at 100%")
    fill_ratios(ctx.records)

    details = sysinfo.collect()
    mode = "tiny" if config.tiny else ("quick" if config.quick else "standard")
    header = (f"tpp-bench | {sysinfo.summary_line(details)} | threads {config.threads} | "
              f"{mode} | clock {clock} | malloc {malloc} | {time.perf_counter() - t0:.0f} s")
    from . import report
    # with --json - or --csv - the records go to stdout, so the table goes to stderr
    to_stdout = "-" in (args.json, args.csv)
    report.render(ctx.records, ctx.notes, header=header, plain=args.plain,
                  file=sys.stderr if to_stdout else sys.stdout)
    return _write_outputs(args, ctx.records) or status


def _write_outputs(args, records) -> int:
    """--json, --csv, --plot; 1 if one could not be written, else 0."""
    from .export import write_csv
    from .records import write_json
    writers = [(args.json, write_json), (args.csv, write_csv)]
    if args.plot:
        from .plot import write_plots
        writers.append((args.plot, write_plots))
    rc = 0
    for path, write in writers:
        if not path:
            continue
        try:
            write(records, path)
        except OSError as exc:
            print(f"tpp-bench: cannot write {path}: {exc}", file=sys.stderr)
            rc = 1
    return rc
