"""The regions harness's chart (bench/RESULTS.md, "Regions"): from a run's `history.ndjson`,
the latency of the keys below their limits per set-up and region (p50 and p99), and from a run
under the fault schedule, acme's admissions per minute by region against its limit, with the
faults marked. matplotlib (bench/run installs it).

    python3 tests/regions/chart.py --steady RUN/history.ndjson --faults RUN/history.ndjson \\
        --out bench/charts/regions.png
"""

import argparse
import json
import sys
from collections import Counter

REGIONS = ["a", "b", "c"]
COLOURS = {"a": "#4477aa", "b": "#ee6677", "c": "#228833"}


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def latency_panel(ax, records):
    rows = [r for r in records if "fault" not in r and r["key"].startswith("small")
            and r["status"] == 200]
    bars = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        for region in REGIONS:
            lat = [(r["recv"] - r["sent"]) * 1000 for r in rows
                   if r["setup"] == setup and r["region"] == region]
            if lat:
                bars.append((f"{setup} {region}", percentile(lat, 50), percentile(lat, 99)))
    ys = range(len(bars))
    ax.barh([y + 0.2 for y in ys], [b[2] for b in bars], 0.4, label="p99", color="#ccbb44")
    ax.barh([y - 0.2 for y in ys], [b[1] for b in bars], 0.4, label="p50", color="#4477aa")
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("ms, keys below their limits")
    ax.set_title("latency inside a region")
    ax.legend()


def faults_panel(ax, records, limit):
    rows = [r for r in records if "fault" not in r and r["key"] == "acme"
            and r["status"] == 200 and r.get("minute") is not None]
    start = min(r["sent"] for r in records if "sent" in r)
    first = int(start) // 60 + (1 if start % 60 > 1 else 0)
    last = int(max(r["sent"] for r in records if "sent" in r)) // 60
    minutes = list(range(first, last))
    by = Counter((r["minute"], r["region"]) for r in rows)
    bottom = [0] * len(minutes)
    for region in REGIONS:
        heights = [by[(m, region)] for m in minutes]
        ax.bar(range(len(minutes)), heights, bottom=bottom, color=COLOURS[region],
               label=f"region {region}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.axhline(limit, color="black", linestyle="--", label=f"limit {limit}")
    for r in records:
        if "fault" in r:
            x = (r["at"] - first * 60) / 60 - 0.5
            ax.axvline(x, color="grey", linewidth=0.6)
            ax.text(x, limit * 1.25, r["fault"], rotation=90, fontsize=7, va="top")
    ax.set_xticks(range(len(minutes)), [f"minute {i + 1}" for i in range(len(minutes))])
    ax.set_ylim(0, limit * 1.3)
    ax.set_ylabel("acme admitted (all regions)")
    ax.set_title("a key at twice its limit through the faults")
    ax.legend(loc="lower right", fontsize=7)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steady", required=True, help="history of the set-ups side by side")
    ap.add_argument("--faults", required=True, help="history of `leased` under the faults")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    latency_panel(left, read(a.steady))
    faults_panel(right, read(a.faults), a.limit)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
