#!/usr/bin/env python3
"""Issue 32's benchmark: the backend protected, pet-gateway beside nginx and HAProxy, in one run.

A backend of fixed capacity of the bench's own (`capacity-backend`: 4 workers, 25 ms a request,
so 160 requests a second, the rest queued inside it) behind each proxy, and clients that record
every answer (`overload-load`). Rows:

- Heavy beside light: a light key (2 connections) alone, then beside a heavy key (64
  connections), through: the gateway without places (`upstream_max_in_flight = "off"`: what
  shipped before), its fair queue alone (places = the backend's workers, no concurrency), the
  queue with `concurrency = 8`, the adaptive limit with `concurrency = 8`, nginx (`limit_conn` 8
  per bearer token, `max_conns` 4) and HAProxy (`maxconn` 4, `timeout queue` 1 s, `conn_cur` 8
  per key). Targets: the light key's p99 within 2x of alone, at least half its throughput.
- A burst: 50 keys offering 3x the backend's capacity (480 a second, open loop), 10 % createPet,
  a client timeout of 2 s. Targets: goodput at least 90 % of the capacity, the p99 of admitted
  requests within 2x unloaded plus the queue's 1 s, every createPet served while listPets is
  shed, no client waiting past its timeout.
- The adaptive limit following the backend: a backend whose workers change 4 -> 2 -> 8 under
  more load than it takes; for each change, how long until the gateway's limit is within
  [0.75, 1.5] x the workers and stays there (target 5 s), read from its metrics every 100 ms.
- CPU a request with all of it on (places, concurrency, priorities) against off, through a fast
  upstream (a static nginx), wrk -c32, alternated rounds, proxy CPU from /proc; beside the build
  given with --baseline-dir (the one before this work) when there is one. Target: <= +1 us.
- Redis per decision (`store-load`, one hot key and 10,000 keys, alternated): the previous
  build, this one without a concurrency, this one with one (a decision is then its acquire and
  its release). Target: with a concurrency <= 1.3x, without unchanged.

Called by `bench/run --overload`, which builds the binaries and installs the peers first.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (processes, ports, keys, wrk, /proc CPU)

WORKERS, SERVICE_MS = 4, 25
CAPACITY = WORKERS * 1000 / SERVICE_MS
QUEUE_MS = 1000
CLIENT_TIMEOUT_MS = 2000


class Overload:
    def __init__(self, args):
        self.procs = bench.Procs()
        self.work = Path(tempfile.mkdtemp(prefix="pet-overload-"))
        self.seconds = args.seconds
        self.rounds = args.rounds
        self.nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        self.baseline = Path(args.baseline_dir) if args.baseline_dir else None
        self.only = re.compile(args.only) if args.only else None

    def wanted(self, name):
        return not self.only or bool(self.only.search(name))

    # ---- the parts ---------------------------------------------------------------------

    def backend(self):
        """A fresh backend of fixed capacity (its queue empty), for one row."""
        port = bench.free_port()
        self.procs.start([str(bench.BIN / "capacity-backend"), "--listen", f"127.0.0.1:{port}",
                          "--workers", str(WORKERS), "--service-ms", str(SERVICE_MS)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bench.wait_port(port)
        return port

    def keys(self):
        self.plans = self.work / "plans"
        self.plans.mkdir()
        roomy = "requests_per_minute = 100000000\nrequests_per_day = 1000000000\n"
        (self.plans / "open.toml").write_text(roomy)
        (self.plans / "capped.toml").write_text(roomy + "concurrency = 8\n")
        (self.plans / "bench.toml").write_text(roomy + "concurrency = 64\n")
        self.keys_file = self.work / "keys.toml"
        self.heavy, self.light = bench.write_keys(self.keys_file, "open", 2, "open")
        self.heavy8, self.light8 = bench.append_keys(self.keys_file, "capped", 2, "capped")
        self.burst = bench.append_keys(self.keys_file, "open", 50, "burst")
        self.cpu_key = bench.append_keys(self.keys_file, "bench", 1, "cpu")[0]
        self.plain_key = bench.append_keys(self.keys_file, "open", 1, "plain")[0]
        (self.work / "burst-keys.txt").write_text("\n".join(self.burst) + "\n")
        # The build before this work knows no `concurrency` in a plan: plans and a key of its own.
        self.old_plans = self.work / "plans-before"
        self.old_plans.mkdir()
        (self.old_plans / "open.toml").write_text(roomy)
        self.old_keys_file = self.work / "keys-before.toml"
        self.old_key = bench.write_keys(self.old_keys_file, "open", 1, "before")[0]

    def gateway(self, name, upstream, settings, binary=None, before=False):
        """pet-gateway, one thread, its log off, bans off, on `upstream`; `before`: the keys
        and plans the build before this work reads."""
        keys_file, plans = ((self.old_keys_file, self.old_plans) if before
                            else (self.keys_file, self.plans))
        port, admin = bench.free_port(), bench.free_port()
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        cfg = self.work / f"{slug}.toml"
        cfg.write_text(
            f'environment = "bench"\nlisten = "127.0.0.1:{port}"\n'
            f'admin_listen = "127.0.0.1:{admin}"\nupstreams = ["127.0.0.1:{upstream}"]\n'
            f'keys_file = "{keys_file}"\nplans_dir = "{plans}"\n'
            f'upgrade_sock = "{self.work}/{slug}.sock"\nthreads = 1\n{settings}'
            "[ban]\nstrikes = 1000000000\n")
        env = {**os.environ, "RUST_LOG": "warn"}
        binary = binary or bench.GATEWAY_BIN / "pet-gateway"
        p = self.procs.start([str(binary), "serve", "--config", str(cfg)], env=env,
                             stderr=open(self.work / f"{slug}.log", "w"))
        bench.wait_port(port)
        return port, [p.pid], admin

    def nginx_peer(self, upstream):
        """Open-source nginx: `limit_conn` 8 per bearer token and `max_conns` 4 on the backend
        (past which it has no queue: 502)."""
        port = bench.free_port()
        p = bench.start_nginx(
            self.procs, self.nginx, self.work / f"nginx-{port}", port,
            "  limit_conn_zone $http_authorization zone=perkey:10m;\n"
            f"  upstream up {{ server 127.0.0.1:{upstream} max_conns={WORKERS}; keepalive 64; }}\n"
            f"  server {{ listen 127.0.0.1:{port};\n"
            "    location / { limit_conn perkey 8; limit_conn_status 429; proxy_pass http://up;\n"
            "      proxy_http_version 1.1; proxy_set_header Connection \"\"; } }")
        return port, [p.pid] + bench.children(p.pid)

    def haproxy_peer(self, upstream):
        """HAProxy: `maxconn` 4 on the backend with a queue of `timeout queue` 1 s (503 past
        it), POSTs first in it (`set-priority-class`), and `conn_cur` 8 per bearer token in a
        stick table (connections, not requests)."""
        port = bench.free_port()
        folder = self.work / f"haproxy-{port}"
        folder.mkdir()
        (folder / "haproxy.cfg").write_text(
            "global\n  nbthread 1\n  maxconn 8192\n"
            "defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n"
            f"  timeout server 30s\n  timeout queue {QUEUE_MS}ms\n  option http-keep-alive\n"
            f"frontend fe\n  bind 127.0.0.1:{port}\n"
            "  http-request track-sc0 req.hdr(authorization) table perkey\n"
            "  http-request deny deny_status 429 if { sc0_conn_cur gt 8 }\n"
            "  http-request set-priority-class int(-10) if METH_POST\n"
            "  default_backend be\n"
            "backend perkey\n  stick-table type string len 128 size 100k expire 60s store conn_cur\n"
            f"backend be\n  http-reuse always\n  server s1 127.0.0.1:{upstream} maxconn {WORKERS}\n")
        p = self.procs.start([self.haproxy, "-f", str(folder / "haproxy.cfg"), "-db"],
                             stdout=subprocess.DEVNULL, stderr=open(folder / "stderr.log", "w"))
        bench.wait_port(port)
        return port, [p.pid]

    def load(self, port, groups=(), burst=False):
        """One run of overload-load against `port`: each group's (and the burst's) figures."""
        args = [str(bench.BIN / "overload-load"), "--url", f"http://127.0.0.1:{port}",
                "--seconds", str(self.seconds), "--timeout-ms", str(CLIENT_TIMEOUT_MS)]
        for name, key, conns in groups:
            args += ["--group", f"{name}:{key}:{conns}"]
        if burst:
            args += ["--burst", f"{self.work / 'burst-keys.txt'}:{int(3 * CAPACITY)}:10"]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        rows = (json.loads(line) for line in out.splitlines() if line.strip())
        return {r["group"]: r for r in rows}

    # ---- the rows ----------------------------------------------------------------------

    def proxies(self, rows_of):
        """(name, start(upstream) -> (port, pids), light key, heavy key) of each proxy."""
        settings = lambda places, conc: (f'upstream_max_in_flight = {places}\n'
                                         f'upstream_queue_timeout_ms = {QUEUE_MS}\n'
                                         'upstream_auto_min = 2\nupstream_auto_max = 64\n')
        gw = lambda name, places: (lambda up: self.gateway(name, up, settings(places, 0))[:2])
        return [r for r in [
            ("pet-gateway, no places (off)", gw("off", '"off"'), self.light, self.heavy),
            ("pet-gateway, fair queue (places 4)", gw("fair", WORKERS), self.light, self.heavy),
            ("pet-gateway, fair queue + concurrency 8", gw("fair8", WORKERS), self.light8, self.heavy8),
            ("pet-gateway, adaptive + concurrency 8", gw("auto8", '"auto"'), self.light8, self.heavy8),
            ("nginx (limit_conn 8, max_conns 4)", self.nginx_peer, self.light, self.heavy),
            ("HAProxy (maxconn 4, queue 1 s, conn_cur 8)", self.haproxy_peer, self.light, self.heavy),
        ] if r[0] in rows_of and self.wanted(r[0])]

    def heavy_beside_light(self):
        rows = []
        names = [p[0] for p in self.proxies_all()]
        for name, start, light, heavy in self.proxies(names):
            port, _ = start(self.backend())
            alone = self.load(port, [("light", light, 2)])["light"]
            both = self.load(port, [("light", light, 2), ("heavy", heavy, 64)])
            rows.append({"name": name, "alone": alone, "light": both["light"],
                         "heavy": both["heavy"]})
            print(f"  {name}: light alone p99 {alone['ok_p99_ms']:.0f} ms "
                  f"{alone['ok_per_s']:.0f}/s; beside heavy p99 {both['light']['ok_p99_ms']:.0f} ms "
                  f"{both['light']['ok_per_s']:.0f}/s", file=sys.stderr, flush=True)
        return rows

    def proxies_all(self):
        return self.proxies([
            "pet-gateway, no places (off)", "pet-gateway, fair queue (places 4)",
            "pet-gateway, fair queue + concurrency 8", "pet-gateway, adaptive + concurrency 8",
            "nginx (limit_conn 8, max_conns 4)", "HAProxy (maxconn 4, queue 1 s, conn_cur 8)"])

    def bursts(self):
        rows = []
        wanted = ["pet-gateway, no places (off)", "pet-gateway, fair queue (places 4)",
                  "pet-gateway, adaptive + concurrency 8", "nginx (limit_conn 8, max_conns 4)",
                  "HAProxy (maxconn 4, queue 1 s, conn_cur 8)"]
        for name, start, _, _ in self.proxies(wanted):
            port, _ = start(self.backend())
            r = self.load(port, burst=True)
            rows.append({"name": name, **r})
            b = r.get("burst", {})
            print(f"  burst through {name}: {b.get('ok_per_s', 0):.0f}/s admitted, p99 "
                  f"{b.get('ok_p99_ms', 0):.0f} ms, timeouts {b.get('timeouts', 0)}",
                  file=sys.stderr, flush=True)
        return rows

    def adaptive_follow(self, phase_s=15):
        """Seconds the adaptive limit takes to follow each change of the backend's workers."""
        backend = self.backend()
        port, _, admin = self.gateway(
            "follow", backend,
            'upstream_max_in_flight = "auto"\nupstream_auto_min = 1\nupstream_auto_max = 64\n'
            f'upstream_queue_timeout_ms = {QUEUE_MS}\nupstream_reserved_share = 0\n')
        args = [str(bench.BIN / "overload-load"), "--url", f"http://127.0.0.1:{port}",
                "--seconds", str(3 * phase_s + 2), "--timeout-ms", str(CLIENT_TIMEOUT_MS),
                "--group", f"load:{self.light}:24"]
        load = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = []
        try:
            # The first phase starts with the gateway: the limit learnt from nothing.
            for workers in (4, 2, 8):
                urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{backend}/control/workers/{workers}", method="POST"),
                    timeout=5).read()
                changed, seen = time.time(), []
                while time.time() - changed < phase_s:
                    seen.append((time.time() - changed, limit_of(admin)))
                    time.sleep(0.1)
                inside = lambda v: v is not None and 0.75 * workers <= v <= 1.5 * workers
                # The first moment it entered the band and stayed there 2 s; then the share of
                # the phase's rest it spent there (the measurement every 30 s drops it to its
                # lower bound for a moment).
                settled, share = None, None
                for i, (at, _) in enumerate(seen):
                    window = [v for a, v in seen[i:] if a < at + 2]
                    if at + 2 <= phase_s and all(inside(v) for v in window):
                        settled = at
                        rest = [v for _, v in seen[i:]]
                        share = sum(map(inside, rest)) / len(rest)
                        break
                values = [v for _, v in seen[-20:] if v is not None]
                rows.append({"workers": workers, "settled_s": settled, "share": share,
                             "last_2s": (min(values), max(values)) if values else None})
                print(f"  adaptive: {workers} workers, within the band after {settled} s",
                      file=sys.stderr, flush=True)
        finally:
            load.kill()
            load.wait()
        return rows

    def cpu_on_off(self):
        """The gateway's CPU a request with all of it on against off (and the previous build),
        through a fast upstream, in alternated rounds."""
        static = bench.free_port()
        bench.start_nginx(self.procs, self.nginx, self.work / "static", static,
                          f"  server {{ listen 127.0.0.1:{static}; location / {{ "
                          "default_type application/json; return 200 '[]'; } }")
        on = ('upstream_max_in_flight = 64\nupstream_queue_timeout_ms = 1000\n')
        rows = [("all on: places 64, concurrency 64, priorities", on, self.cpu_key, None),
                ("all off: no places, no concurrency", 'upstream_max_in_flight = "off"\n',
                 self.plain_key, None)]
        if self.baseline:
            rows.append(("previous build (before issue 32)", "", self.old_key,
                         self.baseline / "pet-gateway"))
        started = []
        for name, settings, key, binary in rows:
            if not self.wanted(name):
                continue
            port, pids, _ = self.gateway("cpu " + name, static, settings, binary,
                                         before=binary is not None)
            url = f"http://127.0.0.1:{port}/v1/pets"
            bench.wrk(url, 1, headers=(f"Authorization: Bearer {key}",))
            started.append({"name": name, "url": url, "pids": pids, "key": key, "runs": []})
        for round_ in range(self.rounds):
            order = started[round_ % len(started):] + started[:round_ % len(started)]
            for row in order:
                r = bench.measure(row["name"], row["url"], row["pids"], self.seconds,
                                  headers=(f"Authorization: Bearer {row['key']}",))
                if r["non2xx"]:
                    raise SystemExit(f"FAIL {row['name']}: {r['non2xx']} answers were not 2xx")
                row["runs"].append(r["cpu_us"])
        return started

    def redis_decisions(self):
        """store-load against a Redis of its own: previous build, this one, this one with a
        concurrency; alternated, `rounds` times."""
        _, port = bench.start_redis(self.procs)
        url = f"redis://127.0.0.1:{port}/"
        builds = [("this build, no concurrency", bench.BIN / "store-load", [])]
        builds.append(("this build, concurrency 1000000 (acquire + release)",
                       bench.BIN / "store-load", ["--key-concurrency", "1000000"]))
        if self.baseline and (self.baseline / "store-load").exists():
            builds.insert(0, ("previous build", self.baseline / "store-load", []))
        results = {}
        for keys in (1, 10_000):
            for round_ in range(self.rounds):
                order = builds[round_ % len(builds):] + builds[:round_ % len(builds)]
                for name, binary, extra in order:
                    subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], check=True,
                                   capture_output=True)
                    out = subprocess.run([str(binary), "--redis", url, "--keys", str(keys),
                                          "--seconds", str(self.seconds), "--concurrency", "64"]
                                         + extra, capture_output=True, text=True, check=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    d = max(r["decisions"], 1)
                    results.setdefault((keys, name), []).append({
                        "per_s": d / r["seconds"],
                        "batch": d / max(r["script_runs"], 1),
                        "script_us": r["script_usec"] / d,
                        "cpu_us": r["redis_cpu_us_per_decision"],
                    })
                    print(f"  store-load {keys} keys, {name}: {r['redis_cpu_us_per_decision']:.2f} "
                          f"us Redis CPU a decision", file=sys.stderr, flush=True)
        return results


# ---- the report ----------------------------------------------------------------------------

def ok(flag):
    return "yes" if flag else "**no**"


def print_heavy(rows):
    print("\n### Heavy key (64 connections) beside a light key (2)\n")
    print(f"Backend: {WORKERS} workers x {SERVICE_MS} ms ({CAPACITY:.0f} requests/s). Figures of "
          "the light key's admitted (2xx) answers; the heavy key's answers by status.\n")
    print("| proxy | light alone: /s, p50, p99 | beside heavy: /s, p50, p99 | p99 x alone "
          "| throughput / alone | within 2x and >= half? | heavy: 2xx/s, refusals |")
    print("|---|---|---|---:|---:|---|---|")
    for r in rows:
        a, l, h = r["alone"], r["light"], r["heavy"]
        p99x = l["ok_p99_ms"] / a["ok_p99_ms"] if a["ok_p99_ms"] else float("nan")
        thr = l["ok_per_s"] / a["ok_per_s"] if a["ok_per_s"] else float("nan")
        refused = ", ".join(f"{s}: {n}" for s, n in sorted(h["status"].items()) if s != "200")
        print(f"| {r['name']} | {a['ok_per_s']:.0f}, {a['ok_p50_ms']:.0f} ms, {a['ok_p99_ms']:.0f} ms "
              f"| {l['ok_per_s']:.0f}, {l['ok_p50_ms']:.0f} ms, {l['ok_p99_ms']:.0f} ms | {p99x:.2f} "
              f"| {thr:.2f} | {ok(p99x <= 2 and thr >= 0.5)} | {h['ok_per_s']:.0f}/s; "
              f"{refused or 'none'} |")


def print_bursts(rows):
    print(f"\n### A burst of 50 keys offering 3x the capacity ({3 * CAPACITY:.0f}/s, 10 % "
          f"createPet, client timeout {CLIENT_TIMEOUT_MS / 1000:.0f} s)\n")
    bound = 2 * SERVICE_MS + QUEUE_MS
    print(f"Targets: goodput >= 90 % of {CAPACITY:.0f}/s, p99 of admitted <= {bound} ms, every "
          "createPet served, no client timeout.\n")
    print("| proxy | goodput /s (% of capacity) | p99 admitted | createPet served / sent "
          "| listPets by status | client timeouts | all targets? |")
    print("|---|---:|---:|---:|---|---:|---|")
    for r in rows:
        b, c, l = r.get("burst", {}), r.get("burst createPet", {}), r.get("burst listPets", {})
        good = b.get("ok_per_s", 0)
        created = c.get("status", {}).get("200", 0) + c.get("status", {}).get("201", 0)
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(l.get("status", {}).items()))
        met = (good >= 0.9 * CAPACITY and b.get("ok_p99_ms", 1e9) <= bound
               and created == c.get("sent", -1) and b.get("timeouts", 1) == 0)
        print(f"| {r['name']} | {good:.0f} ({100 * good / CAPACITY:.0f} %) | {b.get('ok_p99_ms', 0):.0f} ms "
              f"| {created} / {c.get('sent', 0)} | {statuses} | {b.get('timeouts', 0)} | {ok(met)} |")


def print_cpu(rows):
    print("\n### The gateway's CPU a request, overload protection on and off\n")
    print("One key, wrk -t1 -c32, a static upstream, one thread, log off; the median of "
          "alternated rounds.\n")
    print("| build and settings | CPU us/request (each round) | median |")
    print("|---|---|---:|")
    med = {}
    for r in rows:
        med[r["name"]] = statistics.median(r["runs"])
        runs = ", ".join(f"{x:.1f}" for x in r["runs"])
        print(f"| {r['name']} | {runs} | {med[r['name']]:.1f} |")
    on = next((v for k, v in med.items() if k.startswith("all on")), None)
    off = next((v for k, v in med.items() if k.startswith("all off")), None)
    if on is not None and off is not None:
        print(f"\nOn against off: {on - off:+.2f} us a request (target <= +1 us: {ok(on - off <= 1)}).")


def print_redis(results):
    print("\n### Redis per decision (store-load, 64 tasks; a decision with a concurrency is its "
          "acquire and its release)\n")
    print("| keys | build | decisions/s | per script run | script us/decision | Redis CPU us/decision |")
    print("|---:|---|---:|---:|---:|---:|")
    for (keys, name), runs in results.items():
        m = lambda k: statistics.median(r[k] for r in runs)
        print(f"| {keys:,} | {name} | {m('per_s'):,.0f} | {m('batch'):.1f} | {m('script_us'):.2f} "
              f"| {m('cpu_us'):.2f} |")
    for keys in sorted({k for k, _ in results}):
        cpu = {n: statistics.median(r["cpu_us"] for r in runs)
               for (k, n), runs in results.items() if k == keys}
        base = cpu.get("previous build") or cpu.get("this build, no concurrency")
        with_c = next((v for n, v in cpu.items() if n.startswith("this build, concurrency")), None)
        without = cpu.get("this build, no concurrency")
        if base and with_c:
            print(f"\n{keys:,} keys: with a concurrency {with_c / base:.2f}x the previous build's "
                  f"Redis CPU a decision (target <= 1.3x: {ok(with_c / base <= 1.3)}); without "
                  f"{without / base:.2f}x.")


def limit_of(admin):
    """`pet_gateway_upstream_limit` from the gateway's metrics (one backend), or None."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2).read()
    except OSError:
        return None
    for line in text.decode().splitlines():
        if line.startswith("pet_gateway_upstream_limit"):
            return float(line.rsplit(" ", 1)[1])
    return None


def print_follow(rows):
    print("\n### The adaptive limit following the backend (workers 4 -> 2 -> 8, 25 ms each)\n")
    print("24 connections of one key, more than the backend takes; places between 1 and 64, no "
          "reserve; the limit read every 100 ms. Seconds from each change until the limit is "
          "within [0.75, 1.5] x the workers for 2 s (target 5 s), and the share of the phase's "
          "rest it stays there (the measurement every 30 s drops it to the lower bound).\n")
    print("| workers now | in the band after | share of the rest in it | limit in the last 2 s |")
    print("|---:|---:|---:|---|")
    for r in rows:
        s = f"{r['settled_s']:.1f} s" if r["settled_s"] is not None else "**never**"
        share = f"{100 * r['share']:.0f} %" if r["share"] is not None else "-"
        lo_hi = f"{r['last_2s'][0]:.0f} to {r['last_2s'][1]:.0f}" if r["last_2s"] else "-"
        now = f"{r['workers']} (from the start)" if r is rows[0] else str(r["workers"])
        print(f"| {now} | {s} | {share} | {lo_hi} |")


def chart(folder, heavy, bursts):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no chart)", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["name"].replace(", ", ",\n", 1) for r in heavy]
    a.bar(range(len(heavy)), [r["alone"]["ok_p99_ms"] for r in heavy], 0.4, label="light alone")
    beside = a.bar([i + 0.4 for i in range(len(heavy))], [r["light"]["ok_p99_ms"] for r in heavy],
                   0.4, label="light beside heavy (label: its answers/s against alone)")
    a.bar_label(beside, [f"{r['light']['ok_per_s']:.0f}/{r['alone']['ok_per_s']:.0f}"
                         for r in heavy], fontsize=7)
    a.set_xticks([i + 0.2 for i in range(len(heavy))], names, fontsize=7, rotation=20, ha="right")
    a.set_ylabel("light key's p99 (ms)")
    a.set_title("Heavy key beside a light one")
    a.legend()
    names = [r["name"].replace(", ", ",\n", 1) for r in bursts]
    b.bar(range(len(bursts)), [r.get("burst", {}).get("ok_per_s", 0) for r in bursts])
    b.axhline(0.9 * CAPACITY, color="red", linestyle="--", label="90 % of capacity")
    b.set_xticks(range(len(bursts)), names, fontsize=7, rotation=20, ha="right")
    b.set_ylabel("admitted per second")
    b.set_title("50 keys at 3x capacity")
    b.legend()
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / "overload.png", dpi=110)
    print(f"(chart: {folder / 'overload.png'})", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bin-dir", help="pet-gateway from another build")
    p.add_argument("--baseline-dir", help="the build before this work: pet-gateway and store-load "
                   "for the CPU and Redis comparisons")
    p.add_argument("--only", help="only the rows whose name matches")
    p.add_argument("--charts", default=str(bench.ROOT / "bench" / "charts"))
    p.add_argument("--no-cpu", action="store_true")
    p.add_argument("--no-redis", action="store_true")
    args = p.parse_args()
    if args.bin_dir:
        bench.GATEWAY_BIN = Path(args.bin_dir)
    o = Overload(args)
    import atexit
    atexit.register(o.procs.stop_all)
    o.keys()
    heavy = o.heavy_beside_light()
    bursts = o.bursts()
    follow = o.adaptive_follow() if o.wanted("adaptive follow") else []
    cpu = [] if args.no_cpu else o.cpu_on_off()
    redis = {} if args.no_redis else o.redis_decisions()
    print(f"\n## Overload protection beside nginx {nginx_version(o.nginx)} and HAProxy "
          f"{haproxy_version(o.haproxy)} ({os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})")
    print_heavy(heavy)
    print_bursts(bursts)
    if follow:
        print_follow(follow)
    if cpu:
        print_cpu(cpu)
    if redis:
        print_redis(redis)
    if args.charts:
        chart(Path(args.charts), heavy, bursts)


def nginx_version(binary):
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr
    m = re.search(r"nginx/([\d.]+)", out)
    return m.group(1) if m else "?"


def haproxy_version(binary):
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stdout
    m = re.search(r"version ([\d.]+)", out)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    main()
