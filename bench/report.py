"""Tables of a run's records: one per suite, a row per (case, shape), a column per provider.

Uses rich when it is importable (and `plain` is not asked for), aligned plain text otherwise.
"""
from __future__ import annotations

import sys

PROVIDER_ORDER = ("tpp", "numpy", "torch", "cupy", "cffi")


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "GB/s":
        return f"{value:.1f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _ordered_providers(records) -> list:
    seen = []
    for r in records:
        if r.provider not in seen:
            seen.append(r.provider)
    return sorted(seen, key=lambda p: (PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER
                                       else len(PROVIDER_ORDER), p))


def suite_table(suite: str, records) -> tuple[str, list, list]:
    """(title, headers, rows of strings) for one suite's records."""
    providers = _ordered_providers(records)
    rows_by_key: dict = {}
    mixed = len({r.dtype for r in records}) > 1     # a case run in several dtypes: one row each
    for r in records:
        case = r.case
        if mixed and r.dtype and r.dtype not in case.split():
            case = f"{case} {r.dtype}"
        rows_by_key.setdefault((case, tuple(r.shape), r.unit), {})[r.provider] = r
    others = [p for p in providers if p != "tpp"]
    has_peak = any(r.peak_fraction is not None for r in records)
    headers = ["case", "shape", "unit"] + providers
    if "tpp" in providers:
        headers.append("tpp p20-p80")
        if has_peak:
            headers.append("tpp/peak")
        headers += [f"vs {p}" for p in others]
    rows = []
    for (case, shape, unit), by in rows_by_key.items():
        row = [case, "x".join(map(str, shape)) or "-", unit]
        row += [_fmt(by[p].median, unit) if p in by else "" for p in providers]
        ours = by.get("tpp")
        if "tpp" in providers:
            row.append(f"{_fmt(ours.p20, unit)}-{_fmt(ours.p80, unit)}" if ours else "")
            if has_peak:
                row.append(f"{ours.peak_fraction:.0%}" if ours and ours.peak_fraction is not None
                           else "")
            for p in others:
                ratio = ours.ratios.get(p) if ours else None
                row.append(f"{ratio:.2f}x" if ratio is not None else "")
        rows.append(row)
    return _TITLES.get(suite, suite), headers, rows


_TITLES = {
    "peak": "peak: one core's FMA/bf16-dot compute peak (GFLOP/s) and copy bandwidth, read + "
            "written bytes (GB/s; tpp/peak = share of the best copy at that memory level in "
            "the run)",
    "eltwise": "eltwise: GB/s (read + written bytes / median time); tpp/peak = of the best "
               "copy at the same memory level (at most 100%); vs X = tpp speed / X speed",
    "overhead": "overhead: us per call of each call path (relu 64x64, BRGEMM 16x16x16 x 1, "
                "ops.linear M x K x N, ops.torch.Linear forward); cffi = an empty function, "
                "the floor; vs X = X time / tpp time",
    "jit": "jit: kernel compile and load times (ms)",
    "brgemm": "brgemm: GFLOP/s (2*m*n*k*batch / median time), shape = m x n x k x batch; "
              "tpp/peak = of the FMA (bf16: dot) peak; vs X = tpp speed / X speed",
    "gemm": "gemm: ops.matmul GFLOP/s (2*M*K*N / median time; weights packed once), shape = "
            "M x K x N, t<n> = threads; tpp/peak = of the one-core peak x threads; linear: "
            "us per call; vs X = tpp speed / X speed",
    "mlp": "mlp: one gelu MLP layer, GFLOP/s (fwd+bwd: 6*M*K*N, fwd: 2*M*K*N / median time), "
           "shape = tokens x K x N, t<n> = threads; tpp/peak = of the one-core peak x threads; "
           "vs X = tpp speed / X speed",
}


def render(records, notes=(), header: str = "", file=None, plain: bool = False) -> None:
    file = file or sys.stdout
    suites = []
    for r in records:
        if r.suite not in suites:
            suites.append(r.suite)
    tables = [suite_table(s, [r for r in records if r.suite == s]) for s in suites]
    console = None
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            console = None
        else:
            # a fixed width when writing to a file or pipe: wide tables must not be squeezed
            width = None if file.isatty() else max(80, _min_width(tables))
            console = Console(file=file, width=width, highlight=False)
    if header:
        print(header, file=file)
    for title, headers, rows in tables:
        if console is not None:
            console.print()
            console.print(title, soft_wrap=True, style="bold")
            t = Table(show_lines=False)
            for k, h in enumerate(headers):
                t.add_column(h, justify="left" if k < 3 else "right", no_wrap=True)
            for row in rows:
                t.add_row(*row)
            console.print(t)
        else:
            print(file=file)
            print(title, file=file)
            _plain_table(headers, rows, file)
    if notes:
        print(file=file)
        print("notes:", file=file)
        for n in notes:
            print(f"  - {n}", file=file)


def _min_width(tables) -> int:
    widest = 0
    for _, headers, rows in tables:
        cols = list(zip(headers, *rows)) if rows else [(h,) for h in headers]
        widest = max(widest, sum(max(len(c) for c in col) + 3 for col in cols) + 1)
    return widest


def _plain_table(headers, rows, file) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells):
        out = []
        for k, (c, w) in enumerate(zip(cells, widths)):
            out.append(str(c).ljust(w) if k < 3 else str(c).rjust(w))
        return "  ".join(out).rstrip()
    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in rows:
        print(line(row), file=file)
