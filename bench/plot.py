"""PNG charts of a run's records (--plot FILE.png); needs matplotlib (the "plot" extra).

Contract of write_plots(records, path):
  - one grouped bar chart per suite that has records, written to FILE-<suite>.png (FILE is
    `path` without a ".png" suffix): a bar per provider for each (case, shape), its height the
    median, a whisker from p20 to p80, the unit on the y axis; one panel per unit where a suite
    mixes units (peak: GFLOP/s and GB/s);
  - FILE-roofline.png when the peak suite's records are there: the f32 compute roof (the
    "fma f32" record's median) and a bandwidth roof per copy level (the best "copy" record at
    each extra["peak_level"]), arithmetic intensity (FLOP/byte) on a log x axis; tpp's points
    placed at the intensity their records let us compute honestly: brgemm from
    extra["flops_per_call"] / extra["bytes_per_call"]; eltwise relu, add_row and reduce_sum
    from one operation per input element / extra["bytes_per_call"] (GFLOP/s = GB/s * that
    intensity). Other records (exp, gelu: no defined FLOP count; transpose: none) are left out;
  - returns the paths written. The Agg backend is used: no display is needed.
"""
from __future__ import annotations

from pathlib import Path

from .records import copy_peaks
from .report import PROVIDER_ORDER

# eltwise cases with a defined count of operations per input element (max, add, add)
ELTWISE_OPS_PER_ELEMENT = {"relu": 1, "add_row": 1, "reduce_sum": 1}


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def output_path(path, name: str) -> Path:
    """FILE.png -> FILE-<name>.png (a path without the .png suffix gets it appended)."""
    p = Path(path)
    if p.suffix.lower() == ".png":
        p = p.with_suffix("")
    return p.with_name(f"{p.name}-{name}.png")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plots(records, path) -> list:
    plt = _pyplot()
    written = []
    suites = list(dict.fromkeys(r.suite for r in records))
    for suite in suites:
        fig = suite_chart(plt, suite, [r for r in records if r.suite == suite])
        written.append(_save(plt, fig, output_path(path, suite)))
    fig = roofline_chart(plt, records)
    if fig is not None:
        written.append(_save(plt, fig, output_path(path, "roofline")))
    return written


def _save(plt, fig, out: Path) -> Path:
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _providers(records) -> list:
    seen = list(dict.fromkeys(r.provider for r in records))
    return sorted(seen, key=lambda p: (PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER
                                       else len(PROVIDER_ORDER), p))


def suite_chart(plt, suite: str, records):
    """A figure: grouped bars of the median per (case, shape) and provider, a panel per unit."""
    units = list(dict.fromkeys(r.unit for r in records))
    fig, axes = plt.subplots(len(units), 1, squeeze=False,
                             figsize=(max(6.0, 0.9 * _groups(records) + 2), 3.6 * len(units)))
    for ax, unit in zip(axes[:, 0], units):
        recs = [r for r in records if r.unit == unit]
        providers = _providers(recs)
        groups = list(dict.fromkeys((r.case, r.shape_text) for r in recs))
        width = 0.8 / max(1, len(providers))
        for j, prov in enumerate(providers):
            xs, ys, lo, hi = [], [], [], []
            for i, key in enumerate(groups):
                r = next((r for r in recs if (r.case, r.shape_text) == key
                          and r.provider == prov), None)
                if r is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r.median)
                    lo.append(max(0.0, r.median - r.p20))
                    hi.append(max(0.0, r.p80 - r.median))
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=prov)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{c}\n{s}" if s != "-" else c for c, s in groups], fontsize=8,
                           rotation=30 if len(groups) > 6 else 0)
        values = [r.median for r in recs if r.median > 0]
        if values and max(values) / min(values) > 100:
            ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_title(f"tpp-bench {suite}: median (whiskers p20-p80)")
    fig.tight_layout()
    return fig


def _groups(records) -> int:
    return len({(r.case, r.shape_text, r.unit) for r in records})


def roofs(records) -> tuple:
    """(f32 compute peak GFLOP/s or None, {level: best copy GB/s}) from the run's records."""
    compute = next((r.median for r in records if r.suite == "peak" and r.metric == "compute"
                    and r.case == "fma f32"), None)
    return compute, copy_peaks(records)


def intensity(r) -> float | None:
    """FLOP per byte of a tpp record where it can be computed from the record, else None."""
    if r.provider != "tpp":
        return None
    nbytes = r.extra.get("bytes_per_call")
    if not nbytes:
        return None
    if r.suite == "brgemm" and r.extra.get("flops_per_call"):
        return r.extra["flops_per_call"] / nbytes
    ops = ELTWISE_OPS_PER_ELEMENT.get(r.case)
    if r.suite == "eltwise" and ops and len(r.shape) == 2:
        return ops * r.shape[0] * r.shape[1] / nbytes
    return None


def roofline_chart(plt, records):
    """The roofline figure, or None without the peak suite's f32 compute and copy records."""
    compute, bandwidth = roofs(records)
    if not compute or not bandwidth:
        return None
    points = []
    for r in records:
        ai = intensity(r)
        if ai:
            gflops = r.median if r.metric == "compute" else r.median * ai
            points.append((r, ai, gflops))
    ais = [ai for _, ai, _ in points] + [compute / bw for bw in bandwidth.values()]
    x_lo, x_hi = min(ais + [0.05]) / 2, max(ais + [10.0]) * 4
    fig, ax = plt.subplots(figsize=(12, 5.5))
    xs = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    for level, bw in sorted(bandwidth.items(), key=lambda kv: -kv[1]):
        ax.plot(xs, [min(compute, bw * x) for x in xs],
                label=f"roof: {level} copy {bw:.1f} GB/s, f32 FMA {compute:.1f} GFLOP/s")
    for r, ai, gflops in points:
        ax.plot([ai], [gflops], "o" if r.suite == "brgemm" else "s", linestyle="none",
                label=f"tpp {r.suite} {r.case} {r.shape_text} ({r.dtype}): "
                      f"{gflops:.3g} GFLOP/s at {ai:.3g} FLOP/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("roofline: one core (peak suite), tpp's brgemm and eltwise cases")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig
