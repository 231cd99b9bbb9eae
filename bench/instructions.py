#!/usr/bin/env python3
"""Instructions per request of pet-gateway builds, counted by valgrind's callgrind.

CPU time on a shared machine moves by several per cent between runs; an instruction count does
not. For each build given (`--bin-dir DIR`, repeatable: an A/B of commits), the gateway runs under
`valgrind --tool=callgrind` with one worker thread in front of a static nginx upstream; curl sends
a warm-up phase, callgrind's counters are dumped and zeroed, then the measured phase of
`--requests` requests on one kept-alive connection is sent and dumped. That second dump's total
divided by the requests is the figure: start-up, key loading and shutdown are outside it.

Scenarios: the embedded store admitting, and refusing (429), and (with `--redis`) the Redis store
admitting. Needs valgrind, nginx, curl and (for `--redis`) redis-server.

Usage events (issue 24): `--metering` sets `metering_file`; `--notify-at` gives both plans
`notify_at = [80, 100]`, so every admitted request also runs the threshold check (its limits are
far away, so no notice is made: the check's cost, not a notice's); `--webhook` also sets
`events_webhook_url` (a receiver of this script's answering 204), its secret file and spool. The
webhook's work is in the gateway's background threads, which callgrind counts too.

A regression check (issue 33): `--check bench/instructions-baseline.json --passthrough --bin-dir
target/release` fails (exit 1) where a figure is more than 2 % above the baseline's;
`--write-baseline FILE` writes the first build's figures as the new baseline (commit it with the
change that moved them, and say why in the commit).

Traces (issue 35): `--traces` measures, instead of the scenarios above, the embedded store
admitting with traces off, on at `tracing_sample_ratio = 0.01` (the default) and on at 1 (every
request sampled), exporting over OTLP to a receiver of this script's; the exporter's thread is
counted too.

Overload protection (issue 32): `--overload` measures, instead of the scenarios above, the
embedded store admitting with all of it off (`upstream_max_in_flight = "off"`, a plan without a
`concurrency`) and all of it on (places 64, a plan's `concurrency = 64`, the default priority
table), for builds that know it (the build before it would refuse a plan with a concurrency).
"""

import argparse
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the bench's own process, port and key helpers)


def total_instructions(dump):
    """The `summary:` (or `totals:`) line of one callgrind dump: the instructions it counted."""
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{dump}: no summary line")


def send(port, key, count):
    """`count` GETs on one kept-alive connection (curl's URL globbing reuses it)."""
    url = f"http://127.0.0.1:{port}/v1/pets?n=[1-{count}]"
    subprocess.run(["curl", "-s", "-o", "/dev/null", "-H", f"Authorization: Bearer {key}", url],
                   check=True)


def dump(pid, out):
    """Dump and zero the counters of the callgrind run `pid`; return the new dump's path."""
    before = set(out.parent.glob(out.name + "*"))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        new = set(out.parent.glob(out.name + "*")) - before
        if new:
            time.sleep(0.2)  # written whole before the next read
            return new.pop()
        time.sleep(0.1)
    raise SystemExit("callgrind wrote no dump within 30 s")


class Receiver(http.server.BaseHTTPRequestHandler):
    """The receiver for `--webhook` and `--traces`: takes every batch, answers 204."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_):
        pass


def start_receiver():
    """A receiver on a free port, in a daemon thread of this script; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/hooks"


def measure(bin_dir, work, static, plans, keys_file, redis_url, key, warmup, requests, log="warn",
            metering=False, webhook=None, extra=""):
    procs = bench.Procs()
    try:
        port, admin = bench.free_port(), bench.free_port()
        name = f"ir-{port}"
        cfg = work / f"{name}.toml"
        cfg.write_text(
            f'environment = "bench"\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin}"\n'
            f'upstreams = ["127.0.0.1:{static}"]\nkeys_file = "{keys_file}"\nplans_dir = "{plans}"\n'
            f'key_prefix = "bench:{name}"\nthreads = 1\nupgrade_sock = "{work}/{name}.sock"\n'
            + (f'redis_url = "{redis_url}"\nstore_timeout_ms = 5000\n' if redis_url else "")
            + (f'metering_file = "{work}/metering.ndjson"\n' if metering else "")
            + (f'events_webhook_url = "{webhook}"\nevents_webhook_secret_file = "{work}/webhook.secret"\n'
               f'events_spool_dir = "{work}/spool"\n' if webhook else "")
            + extra
            + "[ban]\nstrikes = 1000000000\n")
        command = [str(Path(bin_dir) / "pet-gateway"), "serve", "--config", str(cfg)]
        return counted(procs, work, name, command, port, key, warmup, requests, log)
    finally:
        procs.stop_all()


def measure_passthrough(bin_dir, work, static, key, warmup, requests):
    """The same count for plain pingora passing requests through (bench's `passthrough`): the
    framework's own cost, which pingora patches are measured against."""
    procs = bench.Procs()
    try:
        port = bench.free_port()
        command = [str(Path(bin_dir) / "passthrough"), f"127.0.0.1:{port}", f"127.0.0.1:{static}", "1"]
        return counted(procs, work, f"pt-{port}", command, port, key, warmup, requests, "warn")
    finally:
        procs.stop_all()


def counted(procs, work, name, command, port, key, warmup, requests, log):
    """Instructions per request of `command` (listening on `port`) under callgrind."""
    out = work / f"{name}.callgrind"
    p = procs.start(["valgrind", "--tool=callgrind", "--compress-strings=no",
                     f"--callgrind-out-file={out}"] + command,
                    env={"RUST_LOG": log, "PATH": "/usr/bin:/bin"},
                    stderr=open(work / f"{name}.log", "w"))
    bench.wait_port(port, timeout=120)
    send(port, key, warmup)
    dump(p.pid, out)
    send(port, key, requests)
    return total_instructions(dump(p.pid, out)) / requests


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", action="append", required=True,
                    help="a build's folder of pet-gateway (repeat for an A/B)")
    ap.add_argument("--requests", type=int, default=2000, help="requests in the measured phase")
    ap.add_argument("--warmup", type=int, default=300, help="requests before it")
    ap.add_argument("--redis", action="store_true", help="add the Redis store's admitted row")
    ap.add_argument("--passthrough", action="store_true",
                    help="add plain pingora's pass-through row (bench's passthrough, from each --bin-dir)")
    ap.add_argument("--only-passthrough", action="store_true",
                    help="only the pass-through row (pingora patches)")
    ap.add_argument("--metering", action="store_true",
                    help="the gateways write usage events (metering_file): their cost per request")
    ap.add_argument("--notify-at", action="store_true",
                    help="the plans say notify_at = [80, 100] (with --metering: the threshold check)")
    ap.add_argument("--webhook", action="store_true",
                    help="the gateways also post events to a receiver of this script's (answering 204)")
    ap.add_argument("--traces", action="store_true",
                    help="traces off, on at 0.01 and on at 1, instead of the scenarios")
    ap.add_argument("--overload", action="store_true",
                    help="only overload protection off against on (builds from issue 32 on)")
    ap.add_argument("--name", action="append",
                    help="a label for each --bin-dir, in order (default: the folders)")
    ap.add_argument("--chart", help="also draw the table as a PNG bar chart at this path")
    ap.add_argument("--keep", action="store_true",
                    help="keep the callgrind dumps (their folder is printed) for callgrind_annotate")
    ap.add_argument("--log", default="warn",
                    help="RUST_LOG of the gateways: warn (no access log, the default) or info")
    ap.add_argument("--check", metavar="BASELINE",
                    help="compare the first --bin-dir's figures with this JSON baseline and fail "
                         "(exit 1) where one is more than 2 %% above it")
    ap.add_argument("--write-baseline", metavar="BASELINE",
                    help="write the first --bin-dir's figures to this JSON baseline")
    args = ap.parse_args()

    procs = bench.Procs()
    work = Path(tempfile.mkdtemp(prefix="pet-ir-"))
    try:
        nginx_bin = bench.shutil.which("nginx") or "/usr/sbin/nginx"
        static = bench.free_port()
        bench.start_nginx(procs, nginx_bin, work / "static", static,
                          f"  server {{ listen 127.0.0.1:{static}; location / {{ default_type "
                          "application/json; return 200 '[]'; } }")
        plans = work / "plans"
        plans.mkdir()
        notify = "notify_at = [80, 100]\n" if args.notify_at else ""
        (plans / "unlimited.toml").write_text(
            notify + "requests_per_minute = 100000000\nrequests_per_day = 1000000000\n")
        (plans / "tiny.toml").write_text(notify + "requests_per_minute = 1\nrequests_per_day = 1\n")
        webhook = None
        if args.webhook:
            webhook = start_receiver()
            (work / "webhook.secret").write_text("bench-" + "0" * 58 + "\n")
            (work / "spool").mkdir()
        keys_file = work / "keys.toml"
        admitted = bench.write_keys(keys_file, "unlimited", 1, "admitted")[0]
        refused = bench.append_keys(keys_file, "tiny", 1, "refused")[0]
        redis_url = None
        if args.redis:
            _, redis_port = bench.start_redis(procs)
            redis_url = f"redis://127.0.0.1:{redis_port}/"
        rows = [("embedded, admitted", None, admitted, ""),
                ("embedded, refused (429)", None, refused, "")]
        if redis_url:
            rows.append(("Redis, admitted", redis_url, admitted, ""))
        if args.overload:
            (plans / "held.toml").write_text(
                "requests_per_minute = 100000000\nrequests_per_day = 1000000000\nconcurrency = 64\n")
            held = bench.append_keys(keys_file, "held", 1, "held")[0]
            rows = [("admitted, overload protection off", None, admitted,
                     'upstream_max_in_flight = "off"\n'),
                    ("admitted, all on: places 64, concurrency 64, priorities", None, held,
                     "upstream_max_in_flight = 64\n")]
        if args.traces:
            collector = start_receiver() + "/v1/traces"
            on = f'tracing_otlp_endpoint = "{collector}"\ntracing_sample_ratio = '
            rows = [("admitted, traces off", None, admitted, ""),
                    ("admitted, traces on at 0.01", None, admitted, on + "0.01\n"),
                    ("admitted, traces on at 1 (every request)", None, admitted, on + "1.0\n")]
        if args.only_passthrough:
            rows = []
        dirs = args.bin_dir
        names = args.name or dirs
        if len(names) != len(dirs):
            raise SystemExit("give one --name per --bin-dir")
        print("| instructions per request | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(dirs))
        table = []
        if args.passthrough or args.only_passthrough:
            figures = [measure_passthrough(d, work, static, admitted, args.warmup, args.requests)
                       for d in dirs]
            table.append(("pingora pass-through", figures))
            print("| pingora pass-through | " + " | ".join(f"{f:,.0f}" for f in figures) + " |", flush=True)
        for label, url, key, extra in rows:
            figures = [measure(d, work, static, plans, keys_file, url, key, args.warmup, args.requests,
                               args.log, args.metering, webhook, extra)
                       for d in dirs]
            table.append((label, figures))
            print(f"| {label} | " + " | ".join(f"{f:,.0f}" for f in figures) + " |", flush=True)
        if args.chart:
            chart(Path(args.chart), names, table, args.log)
        ours = {label: round(figures[0]) for label, figures in table}
        if args.write_baseline:
            Path(args.write_baseline).write_text(json.dumps(ours, indent=2) + "\n")
            print(f"baseline written: {args.write_baseline}", file=sys.stderr)
        if args.check:
            failed = check(json.loads(Path(args.check).read_text()), ours)
            if failed:
                raise SystemExit(1)
    finally:
        procs.stop_all()
        if args.keep:
            print(f"callgrind dumps kept in {work}", file=sys.stderr)
        else:
            bench.shutil.rmtree(work, ignore_errors=True)


# How far above its baseline a figure may go: two runs of one build agree within 0.3 %, so
# +2 % is a change, not noise.
TOLERANCE = 1.02


def check(baseline, ours):
    """Each figure of `ours` against `baseline`; prints every row, returns whether one failed.
    A row of the baseline this run did not measure is said, not failed (`--passthrough`,
    `--redis` decide which rows run)."""
    failed, compared = False, 0
    print("\n| against the baseline | baseline | now | change | |")
    print("|---|---:|---:|---:|---|")
    for label, want in baseline.items():
        if label not in ours:
            print(f"| {label} | {want:,} | (not measured) | | |")
            continue
        got = ours[label]
        compared += 1
        bad = got > want * TOLERANCE
        failed |= bad
        print(f"| {label} | {want:,} | {got:,} | {(got / want - 1) * 100:+.1f} % | "
              f"{'FAIL: above +2 %' if bad else 'ok'} |")
    if not compared:
        print("FAIL: no row of the baseline was measured (a renamed row? --passthrough?)")
        return True
    return failed


def chart(path, names, table, log):
    """The table as grouped bars: one group a row, one bar a build."""
    plt = bench.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(table))]
        bars = ax.bar(xs, [figures[i] for _, figures in table], width, label=name)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(table))])
    ax.set_xticklabels([label for label, _ in table], fontsize=8)
    ax.set_ylabel("instructions per request (callgrind)")
    ax.set_title(f"Instructions per request, RUST_LOG={log}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
