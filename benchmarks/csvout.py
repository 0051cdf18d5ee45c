"""The benchmarks' one CSV writer: every row's keys as columns, in first-seen order."""

import csv
import os


def write_rows(rows, path):
    """Write ``rows`` (dicts) to ``path``, creating its folder; missing values stay empty."""
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
