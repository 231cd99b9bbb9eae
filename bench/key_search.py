#!/usr/bin/env python3
"""The console's admin calls at a large keys file (issue 25): `GET /key-search`, `/bans` and
`/overview` against a release pet-gateway serving `--keys` keys (default 1,000,000), embedded
store, with some keys used and some banned, so that a page shows usage and the ban list has
entries to find among every key.

Prints each call's time (median of `--repeat`) and the gateway's resident memory. One gateway,
one client, on whatever machine this is: read the orders of magnitude.

Usage: bench/key_search.py --bin-dir target/release [--keys 1000000] [--repeat 5]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the bench's own process, port and key helpers)


def call(url, timeout=120):
    """One GET: (milliseconds, status, decoded JSON or None)."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    ms = (time.perf_counter() - started) * 1000
    try:
        return ms, status, json.loads(body)
    except ValueError:
        return ms, status, None


def request(port, key, count):
    """`count` requests with `key` through the gateway (its upstream is closed: 502s are fine,
    the quota decision comes first)."""
    statuses = []
    for _ in range(count):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/pets",
                                     headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                statuses.append(r.status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
    return statuses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True, help="a release build's folder of pet-gateway")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5, help="times each call is made (median)")
    args = ap.parse_args()
    procs = bench.Procs()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plans = work / "plans"
        plans.mkdir()
        (plans / "free.toml").write_text("requests_per_minute = 5\nrequests_per_day = 1000\n")
        keys_file = work / "keys.toml"
        started = time.time()
        keys = bench.write_keys(keys_file, "free", args.keys, "k")[:100]
        print(f"keys file of {args.keys:,} keys written in {time.time() - started:.1f} s")
        port, admin = bench.free_port(), bench.free_port()
        cfg = work / "gateway.toml"
        cfg.write_text(
            f'environment = "bench"\nlisten = "127.0.0.1:{port}"\n'
            f'admin_listen = "127.0.0.1:{admin}"\nupstreams = ["127.0.0.1:9"]\n'
            f'keys_file = "{keys_file}"\nplans_dir = "{plans}"\n[ban]\nstrikes = 1\n')
        try:
            started = time.time()
            p = procs.start([str(Path(args.bin_dir) / "pet-gateway"), "serve", "--config", str(cfg)],
                            env={"RUST_LOG": "error", "PATH": "/usr/bin:/bin"},
                            stderr=open(work / "gateway.log", "w"))
            bench.wait_port(port, timeout=600)
            print(f"started, keys loaded: {time.time() - started:.1f} s, "
                  f"{bench.rss_mib(p.pid):.0f} MiB")
            for key in keys:
                request(port, key, 1)
            for key in keys[:3]:  # past the limit, then once more: banned
                request(port, key, 7)
            base = f"http://127.0.0.1:{admin}"
            first_id = "k_0000000"
            rows = [
                ("first search (reads the records)", "/key-search", 1),
                ("search, q=<one id>", f"/key-search?q={first_id}", args.repeat),
                ("search, id=<one id>", f"/key-search?id={first_id}", args.repeat),
                ("search, page=40000 of everything", "/key-search?page=40000", args.repeat),
                ("search, q=nomatch", "/key-search?q=nomatch", args.repeat),
                ("search, status=active&per_page=100", "/key-search?status=active&per_page=100",
                 args.repeat),
                ("search, status=banned", "/key-search?status=banned", args.repeat),
                ("search, first page, 25 keys with usage", "/key-search", args.repeat),
                ("GET /bans", "/bans", args.repeat),
                ("GET /overview", "/overview", args.repeat),
            ]
            print(f"\n| call ({args.keys:,} keys) | median ms | status | found | gateway RSS MiB |")
            print("|---|---:|---:|---|---:|")
            for name, path, times in rows:
                results = [call(base + path) for _ in range(times)]
                ms = statistics.median(r[0] for r in results)
                status, body = results[-1][1], results[-1][2] or {}
                found = body.get("total", len(body.get("bans", [])) if "bans" in body else "")
                if path == "/overview":
                    found = f"bans_active {body.get('bans_active')}"
                print(f"| {name} | {ms:,.1f} | {status} | {found} | {bench.rss_mib(p.pid):.0f} |")
        finally:
            procs.stop_all()


if __name__ == "__main__":
    main()
