"""The records as CSV (--csv): one row per record, from `Record.to_dict()` (the JSON fields).

Columns: suite, case, backend, provider, shape, dtype, metric, unit, median, p20, p80,
peak_fraction, ratios. `extra` is left out (free-form; the JSON has it). Formats:
  shape          the dimensions joined by "x" ("64x64", "64x64x64x16"); "" when there are none
  median, p20, p80, peak_fraction   repr of the float (round-trips exactly); peak_fraction ""
                 when None
  ratios         "provider=ratio" pairs joined by ";" in the record's order, each ratio to 3
                 significant digits ("numpy=1.16;torch=1.15"); "" when empty
"""
from __future__ import annotations

import csv
import io

from .records import write_text

COLUMNS = ("suite", "case", "backend", "provider", "shape", "dtype", "metric", "unit",
           "median", "p20", "p80", "peak_fraction", "ratios")


def csv_row(record) -> dict:
    """{column: text} for one record."""
    d = record.to_dict()
    row = {k: d[k] for k in COLUMNS}
    row["shape"] = "x".join(str(v) for v in d["shape"])
    for key in ("median", "p20", "p80", "peak_fraction"):
        row[key] = "" if d[key] is None else repr(float(d[key]))
    row["ratios"] = ";".join(f"{p}={v:.3g}" for p, v in d["ratios"].items())
    return row


def to_csv(records) -> str:
    """The CSV text of the records: a header line, then one line per record (no final newline)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow(csv_row(r))
    return buf.getvalue().rstrip("\n")


def write_csv(records, path) -> None:
    """Write the CSV to the file `path`, or to stdout when path is '-'."""
    write_text(to_csv(records), path)
