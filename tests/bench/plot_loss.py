#!/usr/bin/python3
"""Plot training loss against wall-clock time.

    /usr/bin/python3 tests/bench/plot_loss.py LOSS.csv OUT.png [--title T] [--logy] [--minutes]

LOSS.csv has a header row with columns `seconds,loss` and optionally `label`
(any order; extra columns are ignored).  Rows with the same label form one
run, drawn as one line; without a label column the whole file is one run.
LOSS.csv may be `-` for standard input.  Needs matplotlib (Debian:
apt-get install python3-matplotlib).
"""
import argparse
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_runs(path):
    f = sys.stdin if path == "-" else open(path, newline="")
    with f:
        rows = csv.DictReader(f)
        if not rows.fieldnames:
            sys.exit(f"plot_loss: {path}: empty file")
        cols = {c.strip().lower(): c for c in rows.fieldnames}
        for need in ("seconds", "loss"):
            if need not in cols:
                sys.exit(f"plot_loss: {path}: no '{need}' column (have: {', '.join(rows.fieldnames)})")
        runs = {}  # label -> ([seconds], [loss]), in order of first appearance
        for n, r in enumerate(rows, start=2):
            try:
                t, y = float(r[cols["seconds"]]), float(r[cols["loss"]])
            except (TypeError, ValueError):
                print(f"plot_loss: {path}:{n}: skipping unparsable row", file=sys.stderr)
                continue
            label = (r.get(cols["label"]) or "").strip() if "label" in cols else ""
            xs, ys = runs.setdefault(label, ([], []))
            xs.append(t)
            ys.append(y)
    if not runs:
        sys.exit(f"plot_loss: {path}: no data rows")
    return runs


def main():
    ap = argparse.ArgumentParser(description="Plot loss against wall time from a CSV.")
    ap.add_argument("csv", help="CSV with columns seconds,loss[,label] ('-' for stdin)")
    ap.add_argument("out", help="output PNG")
    ap.add_argument("--title", default="Training loss vs. wall time")
    ap.add_argument("--logy", action="store_true", help="log-scale loss axis")
    ap.add_argument("--minutes", action="store_true", help="time axis in minutes")
    ap.add_argument("--size", default="8x4.5", help="figure size in inches, WxH (default 8x4.5)")
    ap.add_argument("--dpi", type=int, default=150)
    a = ap.parse_args()

    try:
        runs = read_runs(a.csv)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        sys.exit(f"plot_loss: {a.csv}: {e}")
    w, h = (float(v) for v in a.size.lower().split("x"))
    fig, ax = plt.subplots(figsize=(w, h))
    scale = 60.0 if a.minutes else 1.0
    for label, (xs, ys) in runs.items():
        pts = sorted(zip(xs, ys))
        ax.plot([p[0] / scale for p in pts], [p[1] for p in pts],
                label=label or None, linewidth=1.6, marker="o" if len(pts) <= 30 else None, markersize=3)
    ax.set_xlabel("wall time (min)" if a.minutes else "wall time (s)")
    ax.set_ylabel("loss")
    ax.set_title(a.title)
    if a.logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    if any(runs.keys()):
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=a.dpi)
    print(f"plot_loss: wrote {a.out} ({len(runs)} run{'s' if len(runs) != 1 else ''})", file=sys.stderr)


if __name__ == "__main__":
    main()
