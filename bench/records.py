"""The result record every suite produces, and what is derived from a run's records.

A record is one measurement of one provider on one case:

  suite          the suite that measured it ("eltwise", "peak", ...)
  case           what was measured ("relu", "copy", "call_raw", ...)
  backend        where it ran ("cpu")
  provider       whose code ran ("tpp", "numpy", "torch", "cffi")
  shape          the block shape, a list of ints ([] when there is none)
  dtype          "f32", ...
  metric         "bandwidth" (unit "GB/s", higher is better), "compute" (unit "GFLOP/s",
                 higher is better) or "time" (unit "us" or "ms", lower is better)
  unit           the unit of median, p20 and p80
  median, p20, p80   statistics over the samples, in `unit`; for a rate the p20 is the rate of
                 the 80th-percentile time, so p20 <= median <= p80 always holds
  peak_fraction  for bandwidth: median / the best copy bandwidth measured in the same run at the
                 same memory level (extra["peak_level"]; see settle_copy_peaks), at most 1; for
                 compute: median / the FMA (or bf16 dot) peak of the record's dtype measured in
                 the same run; None for time
  ratios         on tpp records: {provider: tpp's speed / that provider's speed} for every other
                 provider measured on the same case and shape in the same run (> 1: tpp is
                 faster); empty on other records
  extra          free-form details (bytes per call, calls per sample, the call path, ...)
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

HIGHER_IS_BETTER = {"bandwidth": True, "compute": True, "time": False}

# field name -> accepted JSON types (for schema checks; see tests/test_bench_cli.py)
SCHEMA = {
    "suite": (str,), "case": (str,), "backend": (str,), "provider": (str,), "shape": (list,),
    "dtype": (str,), "metric": (str,), "unit": (str,), "median": (float, int),
    "p20": (float, int), "p80": (float, int), "peak_fraction": (float, int, type(None)),
    "ratios": (dict,), "extra": (dict,),
}


@dataclass
class Record:
    suite: str
    case: str
    provider: str
    shape: list
    metric: str
    unit: str
    median: float
    p20: float
    p80: float
    dtype: str = "f32"
    backend: str = "cpu"
    peak_fraction: float | None = None
    ratios: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def shape_text(self) -> str:
        return "x".join(str(d) for d in self.shape) if self.shape else "-"

    def speed(self) -> float:
        """Larger is better, whatever the metric."""
        return self.median if HIGHER_IS_BETTER.get(self.metric, True) else 1.0 / self.median

    def to_dict(self) -> dict:
        d = asdict(self)
        # a stable, readable key order
        order = ["suite", "case", "backend", "provider", "shape", "dtype", "metric", "unit",
                 "median", "p20", "p80", "peak_fraction", "ratios", "extra"]
        return {k: d[k] for k in order}


def group_key(r: Record) -> tuple:
    return (r.suite, r.case, tuple(r.shape), r.dtype, r.backend, r.metric)


def fill_ratios(records) -> None:
    """Set ratios on every tpp record from the other providers' records of the same case."""
    groups: dict = {}
    for r in records:
        groups.setdefault(group_key(r), []).append(r)
    for members in groups.values():
        ours = [r for r in members if r.provider == "tpp"]
        for r in ours:
            r.ratios = {o.provider: r.speed() / o.speed() for o in members
                        if o.provider != "tpp" and o.speed() > 0 and math.isfinite(o.speed())}


def is_copy(r: Record) -> bool:
    """Whether r measures a CPU copy (any suite, any provider): a candidate yardstick of the
    bandwidth records at its memory level."""
    return r.case == "copy" and r.metric == "bandwidth" and r.backend == "cpu"


def copy_peaks(records) -> dict:
    """{memory level: the best copy GB/s among the records at that level}."""
    best: dict = {}
    for r in records:
        if is_copy(r):
            level = r.extra["peak_level"]
            best[level] = max(best.get(level, 0.0), r.median)
    return best


def settle_copy_peaks(records) -> list:
    """Give every CPU bandwidth record its peak fraction against the yardstick of its memory
    level: the best copy measured at that level in the run (copy_peaks), which is also noted
    in extra["peak_gbps"] (and extra["is_peak"] on copies). No fraction exceeds 1: a record
    faster than the yardstick (a reduction, which reads far more than it writes, or timing
    noise) gets 1.0 and keeps its own ratio in extra["above_peak"]. Returns those records.
    A level without a copy leaves its records' fractions None."""
    peaks = copy_peaks(records)
    above = []
    for r in records:
        if r.metric != "bandwidth" or r.backend != "cpu" or "peak_level" not in r.extra:
            continue
        peak = peaks.get(r.extra["peak_level"])
        if not peak:
            r.peak_fraction = None
            continue
        r.extra["peak_gbps"] = peak
        if is_copy(r):
            r.extra["is_peak"] = r.median == peak
        ratio = r.median / peak
        r.peak_fraction = min(ratio, 1.0)
        if ratio > 1.0:
            r.extra["above_peak"] = ratio
            above.append(r)
    return above


def write_json(records, path) -> None:
    data = [r.to_dict() for r in records]
    write_text(json.dumps(data, indent=1, allow_nan=False), path)


def write_text(text: str, path) -> None:
    """Write text (plus a final newline) to the file `path`, or to stdout when path is '-'."""
    if str(path) == "-":
        print(text)
        return
    with open(path, "w", newline="") as f:
        f.write(text + "\n")
