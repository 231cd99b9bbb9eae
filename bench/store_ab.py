#!/usr/bin/env python3
"""Redis's cost a decision of two builds, interleaved on one `redis-server`: `store-load` of
each (`--old`, `--new`: the binaries) takes turns, `--rounds` times, at each `--at` setting
(`batch-max:concurrency`, one hot key, two windows, every decision an admission), and the
medians are printed: decisions a script run (as they came), the script's own time a decision
(`INFO commandstats`) and Redis's whole CPU a decision (`INFO cpu`). Issue 33's "the
regression undone" is read here: the old build is 76f7c5f's (before quotas as data), built in
a worktree of its own (`git worktree add ../old 76f7c5f && cargo build --release -p bench`).

On two shared cores the timings move 10-20 % from turn to turn; the rounds alternate (and the
order flips each round) so both builds see the same machine, and the ratio of the medians is
the figure, and each round's paired ratio (its two turns back to back) shows the spread. Run
it with the same binary as `--old` and `--new` (an A/A run) to see the noise alone.
`bench/script_cost.py --callgrind` gives the same comparison in instructions.

Usage: bench/store_ab.py --old ../old-target/release/store-load \\
           --new target/release/store-load [--at 1:16,16:256,128:1024] [--rounds 5] [--seconds 3]
           [--redis-cpus 2 --load-cpus 4-11]
"""

import argparse
import json
import socket
import statistics
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cpus, args):
    return ["taskset", "-c", cpus] + args if cpus else args


def turn(binary, port, batch_max, concurrency, seconds, cpus):
    out = subprocess.run(pinned(cpus, [binary, "--redis", f"redis://127.0.0.1:{port}/", "--keys", "1",
                          "--batch-max", str(batch_max), "--concurrency", str(concurrency),
                          "--seconds", str(seconds)]),
                         capture_output=True, text=True, timeout=seconds + 60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["errors"]:
        raise SystemExit(f"{binary}: {r['errors']} errors")
    d = r["decisions"]
    return (d / max(1, r["script_runs"]), r["script_usec"] / d, r["redis_cpu_s"] * 1e6 / d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--at", default="1:16,16:256,128:1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--redis-cpus", help="taskset -c for redis-server (a machine with cores to spare)")
    ap.add_argument("--load-cpus", help="taskset -c for store-load")
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        redis = subprocess.Popen(pinned(args.redis_cpus, ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no", "--dir", tmp]),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.05)
            print(f"{'batch-max':>9} {'build':>5} {'dec/run':>8} {'script µs/dec':>14} "
                  f"{'Redis CPU µs/dec':>17}  (medians of {args.rounds} alternated turns)")
            for at in args.at.split(","):
                batch_max, concurrency = (int(x) for x in at.split(":"))
                figures = {"old": [], "new": []}
                for r in range(args.rounds + 1):
                    order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                    for build in order:
                        f = turn(getattr(args, build), port, batch_max, concurrency, args.seconds,
                                 args.load_cpus)
                        if r:  # the first round warms up
                            figures[build].append(f)
                medians = {}
                for build in ["old", "new"]:
                    runs, script, cpu = (statistics.median(x) for x in zip(*figures[build]))
                    medians[build] = (script, cpu)
                    print(f"{batch_max:>9} {build:>5} {runs:>8.1f} {script:>14.3f} {cpu:>17.3f}")
                print(f"{'':>9} {'new/old':>14} {medians['new'][0] / medians['old'][0]:>14.2f} "
                      f"{medians['new'][1] / medians['old'][1]:>17.2f}")
                # Each round's two turns ran back to back: their ratio is paired, and the spread
                # of the rounds' ratios is the method's noise on this machine (an A/A run, the
                # same binary as --old and --new, shows it alone).
                paired = sorted(n[2] / o[2] for o, n in zip(figures["old"], figures["new"]))
                print(f"{'':>9} paired Redis CPU new/old by round: median "
                      f"{statistics.median(paired):.2f}, from {paired[0]:.2f} to {paired[-1]:.2f}")
        finally:
            redis.terminate()
            redis.wait()


if __name__ == "__main__":
    main()
