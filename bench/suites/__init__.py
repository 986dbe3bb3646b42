"""The suite registry and the context a suite runs in.

A suite is a function `run(ctx)` registered under a name:

    from bench.suites import register

    @register("eltwise", help="...", default=True, requires=("peak",))
    def run(ctx):
        ...
        ctx.add(Record(...))

`default=True` puts it in the set `tpp-bench` runs without arguments; `requires` names suites
whose results it uses (run first, once, if the user did not ask for them); `backend` ("cpu" or
"cuda") says where it measures: `--backend` picks the default suites of the backends it names. A new suite is a
module in this package listed in `BUILTIN` (or any module that calls `register` and is imported
before the CLI resolves names).
"""
from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass, field

from ..records import Record
from ..timing import Settings

# modules of this package that define suites, imported by load(); order is the listing order
BUILTIN = ("peak", "eltwise", "overhead", "jit", "brgemm", "gemm", "mlp", "norm", "attention",
           "bert_linear", "model", "conv", "tune", "cuda")
BACKENDS = ("cpu", "cuda")

# the dtypes the suites' cases are measured in (a record's `dtype`); what --dtype accepts
DTYPES = ("f32", "bf16")


@dataclass(frozen=True)
class Suite:
    name: str
    run: object
    help: str = ""
    default: bool = False
    requires: tuple = ()
    backend: str = "cpu"


SUITES: dict[str, Suite] = {}


def register(name: str, *, help: str = "", default: bool = False, requires=(),
             backend: str = "cpu"):
    """Decorator: register run(ctx) as the suite `name`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn):
        if name in SUITES and SUITES[name].run is not fn:
            raise ValueError(f"suite {name!r} is registered twice")
        SUITES[name] = Suite(name, fn, help or (fn.__doc__ or "").strip().split("\n")[0],
                             default, tuple(requires), backend)
        return fn
    return deco


def load() -> dict[str, Suite]:
    """Import the built-in suite modules (they import numpy: call after the thread setup)."""
    for mod in BUILTIN:
        importlib.import_module(f"{__name__}.{mod}")
    return SUITES


def defaults(backends=("cpu",)) -> list[str]:
    """The default suites of the given backends, in listing order."""
    return [s.name for s in SUITES.values() if s.default and s.backend in backends]


@dataclass
class Config:
    quick: bool = False
    tiny: bool = False                 # test mode: minimal sizes and times, numbers meaningless
    overview: bool = False             # the default set, no suite named: quick problem sizes
    shapes: list | None = None         # eltwise shapes [(m, n), ...]; None: the suite's default
    threads: int = 1
    clock: str = "wall"                # timing.CLOCKS key
    providers: tuple = ("tpp", "numpy", "torch", "cupy")
    dtypes: tuple = DTYPES             # cases of other dtypes are skipped (see wants_dtype)
    verify: bool = True
    verbose: bool = True

    @property
    def settings(self) -> Settings:
        return Settings.for_mode(quick=self.quick, tiny=self.tiny, clock=self.clock)


@dataclass
class Context:
    config: Config
    records: list = field(default_factory=list)
    notes: list = field(default_factory=list)      # cases skipped or failed, and why
    done: set = field(default_factory=set)
    # "f32"/"bf16" -> compute peak (GFLOP/s), "cuda_copy" -> the device copy (GB/s); the CPU
    # bandwidth yardsticks are the copy records themselves (records.settle_copy_peaks)
    peaks: dict = field(default_factory=dict)
    # called with a label as each case starts measuring (a progress display), or None
    progress: object = None
    _torch: object = None
    _torch_checked: bool = False

    @property
    def settings(self) -> Settings:
        return self.config.settings

    def wants(self, provider: str) -> bool:
        return provider in self.config.providers

    def wants_dtype(self, dtype: str) -> bool:
        """Whether cases of this dtype are to run (--dtype). The peak suite does not ask: its
        compute and copy peaks are the yardsticks of every other record."""
        return dtype in self.config.dtypes

    def step(self, label: str) -> None:
        """A case starts measuring (the shared timing helpers call this)."""
        if self.progress is not None:
            self.progress(label)

    @property
    def torch(self):
        """The torch module pinned to the configured threads, or None if it is not installed."""
        if not self._torch_checked:
            self._torch_checked = True
            if self.wants("torch"):
                try:
                    import torch
                except Exception as exc:  # noqa: BLE001 - any import failure means "no torch"
                    self.note(f"torch not available ({type(exc).__name__}: {exc}); "
                              f"torch columns skipped")
                else:
                    torch.set_num_threads(self.config.threads)
                    self._torch = torch
        return self._torch

    def add(self, record: Record) -> Record:
        self.records.append(record)
        return record

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(f"note: {text}")

    def failed(self, what: str, exc: BaseException) -> None:
        msg = str(exc).strip().splitlines()
        self.note(f"{what}: {type(exc).__name__}: {msg[0] if msg else ''}")

    def log(self, text: str) -> None:
        if self.config.verbose:
            print(text, file=sys.stderr, flush=True)

    def run(self, name: str) -> None:
        """Run a suite (and what it requires) unless it already ran in this context."""
        if name in self.done:
            return
        suite = SUITES[name]
        self.done.add(name)
        for dep in suite.requires:
            self.run(dep)
        self.log(f"[{name}] running")
        t0 = time.perf_counter()
        suite.run(self)
        self.log(f"[{name}] done in {time.perf_counter() - t0:.1f} s")
