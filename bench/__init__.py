"""tpp-bench: microbenchmarks of the TPP library (`python -m bench`, or the `tpp-bench` script).

Every figure is a ratio measured in the same run: against the machine's own peak (measured by
the `peak` suite) and against numpy and torch on the same shapes. Layout:

  bench/cli.py        the command line (`main(argv) -> int`)
  bench/timing.py     the measuring method (warm-up, calibrated loops, median/p20/p80)
  bench/records.py    the result record (the --json schema) and ratios between providers
  bench/report.py     the tables
  bench/export.py     --csv
  bench/plot.py       --plot (bar charts per suite, the roofline; matplotlib)
  bench/progress.py   the progress line on stderr (rich, on a terminal)
  bench/info.py       `tpp-bench info`
  bench/suites/       the registry (`@register("name")`) and one module per suite

Importing this package imports nothing heavy: the CLI sets thread counts before numpy/torch load.
"""
__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
