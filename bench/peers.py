#!/usr/bin/env python3
"""Like with like (issue 23, items 2 and 3): pet-gateway against peers doing the same job, with
access logs on and off, as proxy CPU time per request.

The rows of bench/bench.py compare the gateway with a plain nginx that authenticates nobody and
with access logs off everywhere. Here the peer is nginx with Lua (bench/peers/) doing what the
gateway does on its admitted path: the bearer key's SHA-256 looked up in the same keys file,
minute and day windows counted in a shared dict or in Redis (one EVALSHA round trip), the same
rate-limit headers, the same access line when the log is on. Plain nginx and a plain pingora
pass-through are the floors of the two stacks.

On a 2-core machine a figure moves by several per cent from one run to the next, so a ratio of
two rows measured minutes apart means little. Every proxy is started once; each round then runs
every scenario once (wrk -t1 -c32, one key on an unlimited plan), in an order rotated from round
to round, and the rounds are repeated. A row reports the median of its rounds; each derived
figure (the access log's cost, the gateway over its peer) is computed within each round, from
rows measured seconds apart, and its median reported.

Before measuring, each proxy is checked once with curl (an admitted key gets 200 and
X-RateLimit-Remaining; where the proxy does the gateway's job, a key over a 1-per-minute plan
gets 429 with Retry-After and an unknown key 401), and a row with non-2xx answers or more than a
handful of socket errors stops the run: a misconfigured peer must not pass for a fast one. Each
proxy then gets one unmeasured second of load (JIT traces, connection pools) before round 1.
Called by `bench/run --peers`, which builds the binaries and installs the tools first.

`--threads 1,2,4,8` (issue 33, "many cores") measures instead the gateway (embedded, log on)
and the shared-dict peer (log on) at each count of threads (nginx: workers), with wrk
`-c32×N` and up to 4 wrk threads. With 8 + N CPUs or more every process is pinned apart
(`taskset`): the proxy on CPUs 4..3+N, the upstream and Redis on 2-3, wrk on the last four;
the table gives each row's CPU a request against its own at one thread, and the gateway's
against the peer's at the same count.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the bench's own process, port, key and wrk helpers)

PEERS = Path(__file__).resolve().parent / "peers"
LUA_MODULE = Path("/usr/lib/nginx/modules/ngx_http_lua_module.so")
CPUS = os.cpu_count() or 1
# Socket errors a row may have (wrk's last requests cut off at the end of a run) before it fails.
MAX_SOCKET_ERRORS = 10

# The rows, in table order.
STATIC = "upstream alone: static"
NGINX_OFF = "nginx (proxy_pass + limit_req), log off"
NGINX_ON = "nginx (proxy_pass + limit_req), log on"
LUA_DICT_OFF = "nginx+Lua, shared dict, 1 worker, log off"
LUA_DICT_ON = "nginx+Lua, shared dict, 1 worker, log on"
LUA_REDIS_OFF = "nginx+Lua, Redis, 1 worker, log off"
LUA_REDIS_ON = "nginx+Lua, Redis, 1 worker, log on"
PASSTHROUGH = "pingora pass-through, 1 thread"
GW_EMB_OFF = "pet-gateway, embedded, 1 thread, log off"
GW_EMB_ON = "pet-gateway, embedded, 1 thread, log on"
GW_REDIS_OFF = "pet-gateway, Redis, 1 thread, log off"
GW_REDIS_ON = "pet-gateway, Redis, 1 thread, log on"
GW_EMB_METERED = "pet-gateway, embedded, 1 thread, log on, metering on"
GW_EMB_TRACED = "pet-gateway, embedded, 1 thread, log on, traces at 0.01"
LUA_DICT_CPUS = "nginx+Lua, shared dict, workers = CPUs, log on"
LUA_REDIS_CPUS = "nginx+Lua, Redis, workers = CPUs, log on"
GW_EMB_SHIPPED = "pet-gateway, embedded, as shipped (threads = CPUs, log on)"
GW_REDIS_SHIPPED = "pet-gateway, Redis, as shipped (threads = CPUs, log on)"
# The shipped threading's alternative (issue 33): the same, with pingora's work stealing on.
GW_EMB_STEALING = "pet-gateway, embedded, threads = CPUs, work stealing on, log on"
# The as-shipped rows with `metering_file` set, as deploy/'s configs ship it commented (issue 24).
GW_EMB_SHIPPED_METERED = "pet-gateway, embedded, as shipped, metering on"
GW_REDIS_SHIPPED_METERED = "pet-gateway, Redis, as shipped, metering on"

# Each gateway row's nginx+Lua peer: the same store, log state and number of workers.
PEER_OF = {
    GW_EMB_OFF: LUA_DICT_OFF, GW_EMB_ON: LUA_DICT_ON,
    GW_REDIS_OFF: LUA_REDIS_OFF, GW_REDIS_ON: LUA_REDIS_ON,
    GW_EMB_SHIPPED: LUA_DICT_CPUS, GW_REDIS_SHIPPED: LUA_REDIS_CPUS,
    GW_EMB_SHIPPED_METERED: LUA_DICT_CPUS, GW_REDIS_SHIPPED_METERED: LUA_REDIS_CPUS,
}
PEER_OF.update({peer: peer for peer in list(PEER_OF.values())})


class Row:
    """One scenario: a proxy started once and measured once a round.

    `pids` gives the processes whose CPU is the proxy's (nginx: master and workers, read at
    each run); `redis` marks rows whose Redis CPU and script calls are measured too; `job` marks
    proxies that do the gateway's job (curl checks their 401 and 429 too); `log` is the access
    log file of a row with its log on."""

    def __init__(self, name, port, pids, redis=False, job=False, log=None):
        self.name, self.port, self.pids = name, port, pids
        self.redis, self.job, self.log = redis, job, log
        self.runs = []  # one dict per round: rps, cpu_us, redis_us, redis_calls

    def median(self, key):
        values = [r[key] for r in self.runs if key in r and r[key] == r[key]]
        return statistics.median(values) if values else float("nan")


class Bench:
    """What every proxy shares: the processes, the work folder, the upstream, Redis, the keys."""

    def __init__(self, args):
        self.procs = bench.Procs()
        self.work = Path(tempfile.mkdtemp(prefix="pet-peers-"))
        self.nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.seconds = args.seconds
        self.only = re.compile(args.only) if args.only else None
        # `--threads` on a machine with cores to spare: every process pinned apart.
        counts = [int(n) for n in args.threads.split(",")] if getattr(args, "threads", None) else []
        # Proxy on 4..3+N, wrk on the last four: apart only with 8 + N CPUs.
        self.pin = bool(counts) and CPUS >= 8 + max(counts)

    def wanted(self, name):
        return not self.only or bool(self.only.search(name))

    def start_shared(self):
        """The static upstream (nginx answering [] to everything), Redis, plans and keys."""
        self.static = bench.free_port()
        bench.start_nginx(self.procs, self.nginx, self.work / "static", self.static,
                          f"  server {{ listen 127.0.0.1:{self.static}; location / {{ "
                          "default_type application/json; return 200 '[]'; } }",
                          cpus="2-3" if self.pin else None)
        self.redis, self.redis_port = bench.start_redis(self.procs)
        if self.pin:
            subprocess.run(["taskset", "-a", "-p", "-c", "2-3", str(self.redis.pid)],
                           stdout=subprocess.DEVNULL, check=True)
        self.plans = self.work / "plans"
        self.plans.mkdir()
        (self.plans / "unlimited.toml").write_text(
            "requests_per_minute = 100000000\nrequests_per_day = 1000000000\n")
        (self.plans / "tiny.toml").write_text("requests_per_minute = 1\nrequests_per_day = 1\n")
        self.keys_file = self.work / "keys.toml"
        self.admitted = bench.write_keys(self.keys_file, "unlimited", 1, "admitted")[0]
        self.tiny = bench.append_keys(self.keys_file, "tiny", 1, "tiny")[0]

    def nginx_from(self, template, name, subs, cpus=None):
        """nginx run from one of bench/peers' templates, its @NAME@ placeholders filled in."""
        folder = self.work / name
        folder.mkdir()
        port = bench.free_port()
        subs = {"PREFIX": folder, "PORT": port, "UPSTREAM_PORT": self.static, **subs}
        text = (PEERS / template).read_text()
        for key, value in subs.items():
            text = text.replace(f"@{key}@", str(value))
        left = re.findall(r"^[^#]*?(@[A-Z_]+@)", text, re.M)
        if left:
            raise SystemExit(f"{template}: placeholders left unfilled: {left}")
        conf = folder / "nginx.conf"
        conf.write_text(text)
        p = self.procs.start(bench.pinned(cpus, [self.nginx, "-p", str(folder), "-c", str(conf),
                                                 "-g", "daemon off;"]),
                             stdout=subprocess.DEVNULL, stderr=open(folder / "stderr.log", "w"))
        try:
            bench.wait_port(port)
        except SystemExit:
            raise SystemExit(f"{name}: nginx did not start; see {folder}/error.log and stderr.log")
        return p, port, folder

    def plain_nginx(self, name, log):
        """The plain nginx of bench.py's table (proxy_pass + limit_req), one worker."""
        p, port, folder = self.nginx_from("nginx-plain.conf.in", slug(name), {
            "WORKERS": 1, "ACCESS_LOG": access_log(self.work / slug(name), "plain", log)})
        return Row(name, port, nginx_pids(p), log=log and folder / "access.log")

    def lua_peer(self, name, store, workers, log, cpus=None):
        """The nginx+Lua peer (bench/peers/gateway.lua) on the shared dict or on Redis."""
        p, port, folder = self.nginx_from("nginx-lua.conf.in", slug(name), {
            "WORKERS": workers, "PEERS_DIR": PEERS, "KEYS_FILE": self.keys_file,
            "PLANS_DIR": self.plans, "STORE": store, "REDIS_PORT": self.redis_port,
            "KEY_PREFIX": f"peers:{slug(name)}",
            "ACCESS_LOG": access_log(self.work / slug(name), "gateway", log)}, cpus=cpus)
        return Row(name, port, nginx_pids(p), redis=store == "redis", job=True,
                   log=log and folder / "access.log")

    def gateway(self, name, redis, log, threads=1, metering=False, cpus=None, extra=""):
        """pet-gateway from bench.py's --bin-dir build. threads=None: as shipped (the config's
        defaults, RUST_LOG unset); else configured as bench.py's rows are (bans off, a 1 s
        store deadline), RUST_LOG=info (log on) or warn (log off)."""
        port, admin = bench.free_port(), bench.free_port()
        cfg = self.work / f"{slug(name)}.toml"
        text = (f'environment = "bench"\nlisten = "127.0.0.1:{port}"\n'
                f'admin_listen = "127.0.0.1:{admin}"\nupstreams = ["127.0.0.1:{self.static}"]\n'
                f'keys_file = "{self.keys_file}"\nplans_dir = "{self.plans}"\n'
                f'key_prefix = "peers:{slug(name)}"\nupgrade_sock = "{self.work}/{slug(name)}.sock"\n'
                + extra)
        if redis:
            text += f'redis_url = "redis://127.0.0.1:{self.redis_port}/"\n'
        if metering:
            text += f'metering_file = "{self.work}/{slug(name)}.metering.ndjson"\n'
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        if threads is not None:
            text += f"threads = {threads}\n" + ("store_timeout_ms = 1000\n" if redis else "")
            text += "[ban]\nstrikes = 1000000000\n"
            env["RUST_LOG"] = "info" if log else "warn"
        cfg.write_text(text)
        logfile = self.work / f"{slug(name)}.log"
        p = self.procs.start(bench.pinned(cpus, [str(bench.GATEWAY_BIN / "pet-gateway"), "serve",
                                                 "--config", str(cfg)]),
                             env=env, stderr=open(logfile, "w"))
        bench.wait_port(port)
        return Row(name, port, lambda: [p.pid], redis=redis, job=True, log=log and logfile)

    def traces_settings(self, ratio):
        """Traces on at `ratio`, to an OTLP receiver of this script's (it takes every batch)."""
        if not hasattr(self, "collector"):
            import http.server
            import threading

            class Collector(http.server.BaseHTTPRequestHandler):
                def do_POST(self):
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

                def log_message(self, *_):
                    pass

            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.collector = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        return f'tracing_otlp_endpoint = "{self.collector}"\ntracing_sample_ratio = {ratio}\n'

    def passthrough(self, name):
        """bench's plain pingora proxy (no auth, no quota): the framework's floor. Taken from
        `--bin-dir` when it is there, so that it runs the same (patched) pingora as the gateway."""
        port = bench.free_port()
        binary = bench.GATEWAY_BIN / "passthrough"
        if not binary.exists():
            binary = bench.BIN / "passthrough"
        p = self.procs.start([str(binary), f"127.0.0.1:{port}",
                              f"127.0.0.1:{self.static}", "1"],
                             env={**os.environ, "RUST_LOG": "warn"},
                             stderr=open(self.work / "passthrough.log", "w"))
        bench.wait_port(port)
        return Row(name, port, lambda: [p.pid])

    def start_rows(self):
        """Every wanted row's proxy, started once, in table order."""
        starts = [
            (STATIC, lambda: Row(STATIC, self.static, lambda: [])),
            (NGINX_OFF, lambda: self.plain_nginx(NGINX_OFF, log=False)),
            (NGINX_ON, lambda: self.plain_nginx(NGINX_ON, log=True)),
            (LUA_DICT_OFF, lambda: self.lua_peer(LUA_DICT_OFF, "shared", 1, log=False)),
            (LUA_DICT_ON, lambda: self.lua_peer(LUA_DICT_ON, "shared", 1, log=True)),
            (LUA_REDIS_OFF, lambda: self.lua_peer(LUA_REDIS_OFF, "redis", 1, log=False)),
            (LUA_REDIS_ON, lambda: self.lua_peer(LUA_REDIS_ON, "redis", 1, log=True)),
            (PASSTHROUGH, lambda: self.passthrough(PASSTHROUGH)),
            (GW_EMB_OFF, lambda: self.gateway(GW_EMB_OFF, redis=False, log=False)),
            (GW_EMB_ON, lambda: self.gateway(GW_EMB_ON, redis=False, log=True)),
            (GW_REDIS_OFF, lambda: self.gateway(GW_REDIS_OFF, redis=True, log=False)),
            (GW_REDIS_ON, lambda: self.gateway(GW_REDIS_ON, redis=True, log=True)),
            (GW_EMB_METERED, lambda: self.gateway(GW_EMB_METERED, redis=False, log=True, metering=True)),
            (GW_EMB_TRACED, lambda: self.gateway(GW_EMB_TRACED, redis=False, log=True,
                                                 extra=self.traces_settings(0.01))),
            (LUA_DICT_CPUS, lambda: self.lua_peer(LUA_DICT_CPUS, "shared", CPUS, log=True)),
            (LUA_REDIS_CPUS, lambda: self.lua_peer(LUA_REDIS_CPUS, "redis", CPUS, log=True)),
            (GW_EMB_SHIPPED, lambda: self.gateway(GW_EMB_SHIPPED, redis=False, log=True, threads=None)),
            (GW_REDIS_SHIPPED, lambda: self.gateway(GW_REDIS_SHIPPED, redis=True, log=True, threads=None)),
            (GW_EMB_STEALING, lambda: self.gateway(GW_EMB_STEALING, redis=False, log=True, threads=None,
                                                   extra="work_stealing = true\n")),
            (GW_EMB_SHIPPED_METERED, lambda: self.gateway(GW_EMB_SHIPPED_METERED, redis=False, log=True,
                                                          threads=None, metering=True)),
            (GW_REDIS_SHIPPED_METERED, lambda: self.gateway(GW_REDIS_SHIPPED_METERED, redis=True,
                                                            log=True, threads=None, metering=True)),
        ]
        return [start() for name, start in starts if self.wanted(name)]

    def start_thread_rows(self, counts):
        """`--threads`: the shared-dict peer and the embedded gateway, log on, at each count."""
        rows = []
        for n in counts:
            cpus = f"4-{3 + n}" if self.pin else None
            for row in (self.lua_peer(f"nginx+Lua, shared dict, {n} worker(s), log on", "shared",
                                      n, log=True, cpus=cpus),
                        self.gateway(f"pet-gateway, embedded, {n} thread(s), log on", redis=False,
                                     log=True, threads=n, cpus=cpus)):
                row.threads = n
                row.load = {"connections": 32 * n, "threads": min(n, 4),
                            "cpus": f"{CPUS - 4}-{CPUS - 1}" if self.pin else None}
                rows.append(row)
        return rows

    def verify(self, row):
        """One request per case with curl: the proxy answers, and does the job it claims."""
        status, headers = curl(row.port, self.admitted)
        if status != 200:
            raise SystemExit(f"FAIL {row.name}: the admitted key got {status}, not 200")
        if row.job and "x-ratelimit-remaining" not in headers:
            raise SystemExit(f"FAIL {row.name}: no X-RateLimit-Remaining on an admitted request")
        if not row.job:
            return
        first, _ = curl(row.port, self.tiny)
        status, headers = curl(row.port, self.tiny)
        if first != 200 or status != 429 or "retry-after" not in headers:
            raise SystemExit(f"FAIL {row.name}: a key on a 1-per-minute plan got {first} then "
                             f"{status} (Retry-After: {headers.get('retry-after')}), not 200 then "
                             "429 with Retry-After")
        status, _ = curl(row.port, "pet_" + "0" * 64)
        if status != 401:
            raise SystemExit(f"FAIL {row.name}: an unknown key got {status}, not 401")

    def warm_up(self, row):
        """One unmeasured second of load: LuaJIT's traces compiled, connection pools filled."""
        bench.wrk(f"http://127.0.0.1:{row.port}/v1/pets", 1,
                  headers=(f"Authorization: Bearer {self.admitted}",))

    def measure(self, row):
        """One wrk run of `row`; its CPU per request, and Redis's for a Redis row."""
        pids = row.pids()
        if row.redis:
            redis_cpu = bench.cpu_seconds([self.redis.pid])
            calls = bench.redis_calls(self.redis_port)
        r = bench.measure(row.name, f"http://127.0.0.1:{row.port}/v1/pets", pids, self.seconds,
                          headers=(f"Authorization: Bearer {self.admitted}",),
                          **getattr(row, "load", {}))
        check(row.name, r)
        run = {"rps": r["rps"], "cpu_us": r["cpu_us"], "user_us": r["user_us"]}
        if row.redis:
            n = max(r["requests"], 1)
            run["redis_us"] = (bench.cpu_seconds([self.redis.pid]) - redis_cpu) / n * 1e6
            run["redis_calls"] = (bench.redis_calls(self.redis_port) - calls) / n
            if run["redis_calls"] < 0.01:
                raise SystemExit(f"FAIL {row.name}: {run['redis_calls']:.3f} Redis script calls "
                                 "per request: the row is not using Redis")
        row.runs.append(run)


def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def access_log(folder, fmt, on):
    """The `access_log` directive's arguments: buffered like the gateway's log, or off."""
    return f"{folder}/access.log {fmt} buffer=64k flush=1s" if on else "off"


def nginx_pids(p):
    """nginx's master and its workers, read when asked (workers fork after the port opens)."""
    return lambda: [p.pid] + bench.children(p.pid)


def curl(port, key):
    """GET /v1/pets with `key`: (status, {lowercase header: value})."""
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-D", "-", "-H",
                          f"Authorization: Bearer {key}", f"http://127.0.0.1:{port}/v1/pets"],
                         capture_output=True, text=True).stdout
    lines = out.splitlines()
    status = int(lines[0].split()[1]) if lines else 0
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


def check(name, r):
    """Stops the run when a row's answers were not the admitted 2xx it is meant to measure."""
    if r["non2xx"]:
        raise SystemExit(f"FAIL {name}: {r['non2xx']} non-2xx responses of {r['requests']}")
    errors = sum(int(n) for n in re.findall(r"\d+", r["errors"]))
    if errors > MAX_SOCKET_ERRORS:
        raise SystemExit(f"FAIL {name}: socket errors: {r['errors']}")


def run_rounds(b, rows, rounds):
    """Every row once a round, the order rotated by one each round."""
    for k in range(rounds):
        shift = k % len(rows)
        print(f"round {k + 1} of {rounds}:", file=sys.stderr, flush=True)
        for row in rows[shift:] + rows[:shift]:
            b.measure(row)


def fmt(x, digits=1):
    return "" if x != x else f"{x:.{digits}f}"


def paired(rows, a, b, f):
    """f(row a's CPU, row b's CPU) in each round, or None when either row was left out."""
    if a not in rows or b not in rows:
        return None
    return [f(x["cpu_us"], y["cpu_us"]) for x, y in zip(rows[a].runs, rows[b].runs)]


def print_table(rows):
    print("| row | req/s | proxy CPU µs/req | CPU min–max | Redis CPU µs/req | Redis calls/req "
          "| × nginx+Lua (same store, log, workers) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        cpus = [r["cpu_us"] for r in row.runs if r["cpu_us"] == r["cpu_us"]]
        spread = f"{min(cpus):.1f}–{max(cpus):.1f}" if cpus else ""
        ratio = paired(rows, name, PEER_OF.get(name, ""), lambda x, y: x / y)
        print(f"| {name} | {row.median('rps'):.0f} | {fmt(row.median('cpu_us'))} | {spread} | "
              f"{fmt(row.median('redis_us'))} | {fmt(row.median('redis_calls'), 3)} | "
              f"{fmt(statistics.median(ratio), 2) if ratio else ''} |")


def print_threads(rows, args, pinned):
    """`--threads`: CPU a request by count, each against its own at the first count, and the
    gateway against the peer at the same count (the ratio's median over the rounds)."""
    print(f"| threads | nginx+Lua µs/req | pet-gateway µs/req | gateway × peer | peer vs 1st | "
          f"gateway vs 1st | req/s peer / gateway |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    peers = {r.threads: r for r in rows if r.name.startswith("nginx")}
    gws = {r.threads: r for r in rows if r.name.startswith("pet-gateway")}
    first = min(peers)
    for n in sorted(peers):
        p, g = peers[n], gws[n]
        ratio = statistics.median(x["cpu_us"] / y["cpu_us"] for x, y in zip(g.runs, p.runs))
        print(f"| {n} | {fmt(p.median('cpu_us'))} | {fmt(g.median('cpu_us'))} | {ratio:.2f} | "
              f"{(p.median('cpu_us') / peers[first].median('cpu_us') - 1) * 100:+.0f} % | "
              f"{(g.median('cpu_us') / gws[first].median('cpu_us') - 1) * 100:+.0f} % | "
              f"{p.median('rps'):.0f} / {g.median('rps'):.0f} |")
    print(f"\n{args.rounds} round(s), {args.seconds} s a run, wrk -c32×N with up to 4 threads; "
          f"{CPUS} CPUs{', every process pinned apart' if pinned else ', shared'}.")


def verdict(ok):
    return "**met**" if ok else "**not met**"


def print_derived(rows):
    """The figures issue 23's targets are about, each from pairs of rows in the same round."""
    print("\nEach figure computed within each round, then the median (per-round values in brackets).")
    print("\n(a) The access log's cost, log on − log off (target for the gateway, bench/RESULTS.md: "
          "≤ 1.5 µs, and ≤ 5 % of the log-off row):\n")
    for label, on, off, target in (
            ("pet-gateway, embedded, 1 thread", GW_EMB_ON, GW_EMB_OFF, True),
            ("pet-gateway, Redis, 1 thread", GW_REDIS_ON, GW_REDIS_OFF, True),
            ("nginx+Lua, shared dict, 1 worker (reference)", LUA_DICT_ON, LUA_DICT_OFF, False),
            ("nginx+Lua, Redis, 1 worker (reference)", LUA_REDIS_ON, LUA_REDIS_OFF, False),
            ("nginx (proxy_pass + limit_req) (reference)", NGINX_ON, NGINX_OFF, False)):
        us = paired(rows, on, off, lambda x, y: x - y)
        pct = paired(rows, on, off, lambda x, y: (x / y - 1) * 100)
        if us is None:
            continue
        mu, mp = statistics.median(us), statistics.median(pct)
        line = (f"- {label}: {mu:+.2f} µs ({mp:+.1f} %) "
                f"[{', '.join(f'{x:+.1f}' for x in us)} µs]")
        if target:
            line += f": ≤ 1.5 µs {verdict(mu <= 1.5)}, ≤ 5 % {verdict(mp <= 5)}"
        print(line)
    metering = []
    for label, on, off in (
            ("embedded, 1 thread, log on", GW_EMB_METERED, GW_EMB_ON),
            ("embedded, as shipped", GW_EMB_SHIPPED_METERED, GW_EMB_SHIPPED),
            ("Redis, as shipped", GW_REDIS_SHIPPED_METERED, GW_REDIS_SHIPPED)):
        us = paired(rows, on, off, lambda x, y: x - y)
        if us is not None:
            mu = statistics.median(us)
            metering.append(f"- {label}: {mu:+.2f} µs [{', '.join(f'{x:+.1f}' for x in us)} µs]: "
                            f"≤ 1 µs {verdict(mu <= 1.0)}")
    if metering:
        print("\n(f) Usage metering's cost (issue 24), metering on − off (target ≤ 1 µs):\n")
        print("\n".join(metering))
    us = paired(rows, GW_EMB_TRACED, GW_EMB_ON, lambda x, y: x - y)
    if us is not None:
        mu = statistics.median(us)
        print("\n(t) Traces' cost (issue 35), on at 0.01 − off, embedded, 1 thread, log on "
              "(target ≤ 1 µs):\n")
        print(f"- CPU: {mu:+.2f} µs [{', '.join(f'{x:+.1f}' for x in us)} µs]: ≤ 1 µs {verdict(mu <= 1.0)}")
        user = [x["user_us"] - y["user_us"]
                for x, y in zip(rows[GW_EMB_TRACED].runs, rows[GW_EMB_ON].runs)]
        mu = statistics.median(user)
        print(f"- user time alone: {mu:+.2f} µs [{', '.join(f'{x:+.1f}' for x in user)} µs]")
    print()
    for label, a, b, limit in (
            ("(b) gateway as shipped, embedded ÷ nginx+Lua shared dict, workers = CPUs, log on",
             GW_EMB_SHIPPED, LUA_DICT_CPUS, 1.0),
            ("(c) gateway as shipped, Redis ÷ nginx+Lua Redis, workers = CPUs, log on",
             GW_REDIS_SHIPPED, LUA_REDIS_CPUS, 1.0),
            ("(b') (b) with metering on", GW_EMB_SHIPPED_METERED, LUA_DICT_CPUS, 1.0),
            ("(c') (c) with metering on", GW_REDIS_SHIPPED_METERED, LUA_REDIS_CPUS, 1.0),
            ("(d) gateway embedded, 1 thread, log off ÷ pingora pass-through, 1 thread",
             GW_EMB_OFF, PASSTHROUGH, 1.1),
            ("(e) gateway Redis ÷ gateway embedded, 1 thread, log off",
             GW_REDIS_OFF, GW_EMB_OFF, 1.1),
            ("(g) gateway embedded, threads = CPUs, work stealing on ÷ nginx+Lua shared dict, "
             "workers = CPUs, log on", GW_EMB_STEALING, LUA_DICT_CPUS, 1.0),
            ("(h) work stealing on ÷ off (as shipped), embedded, threads = CPUs "
             "(below 1: on is cheaper)", GW_EMB_STEALING, GW_EMB_SHIPPED, 1.0)):
        ratios = paired(rows, a, b, lambda x, y: x / y)
        if ratios is None:
            continue
        m = statistics.median(ratios)
        print(f"- {label}: {m:.2f} [{', '.join(f'{x:.2f}' for x in ratios)}]: "
              f"target ≤ {limit:g} {verdict(m <= limit)}")


def print_degraded(rows):
    """Redis rows whose log says some requests were counted locally (Redis too slow)."""
    for row in rows.values():
        if row.redis and row.log and Path(row.log).exists():
            n = Path(row.log).read_text(errors="replace").count("store_degraded=true")
            if n:
                print(f"\nnote: {row.name}: {n} requests logged store_degraded=true "
                      "(counted locally, not in Redis)")


def chart(folder, rows):
    """A bar chart of the median CPU per request, each row's min–max as its error bar."""
    plt = bench.pyplot()
    if plt is None:
        return
    shown = [r for r in rows.values() if r.median("cpu_us") == r.median("cpu_us")]
    names = [r.name for r in shown][::-1]
    med = [r.median("cpu_us") for r in shown][::-1]
    lo = [m - min(x["cpu_us"] for x in r.runs) for m, r in zip(med, shown[::-1])]
    hi = [max(x["cpu_us"] for x in r.runs) - m for m, r in zip(med, shown[::-1])]
    colors = ["#4477aa" if n.startswith("pet-gateway") else "#cc6677" if "Lua" in n else "#999999"
              for n in names]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(names) + 1.6))
    ax.barh(names, med, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_xlabel("proxy CPU µs per request (median of rounds; bars: min–max)")
    ax.set_title("pet-gateway and its peers, alternated rounds")
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / "peers_cpu_per_request.png", dpi=110)
    plt.close(fig)
    print(f"\nchart: {folder / 'peers_cpu_per_request.png'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5, help="length of each wrk run")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (each runs every row once)")
    ap.add_argument("--bin-dir", help="where pet-gateway (and passthrough, when there) are (default target/release)")
    ap.add_argument("--only", help="only the rows whose name matches this regex")
    ap.add_argument("--charts", default=str(bench.ROOT / "bench" / "charts"),
                    help="where the PNG chart goes ('' skips it)")
    ap.add_argument("--threads", help="counts of threads to compare, e.g. 1,2,4,8 (many cores)")
    args = ap.parse_args()
    if args.bin_dir:
        bench.GATEWAY_BIN = Path(args.bin_dir).resolve()
    for tool in ("wrk", "nginx", "redis-server", "redis-cli", "curl"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(f"{tool} is missing: bench/run --peers installs it")
    if not LUA_MODULE.exists():
        raise SystemExit(f"{LUA_MODULE} is missing (libnginx-mod-http-lua): bench/run --peers installs it")

    b = Bench(args)
    try:
        b.start_shared()
        counts = [int(n) for n in args.threads.split(",")] if args.threads else None
        rows = b.start_thread_rows(counts) if counts else b.start_rows()
        if not rows:
            raise SystemExit(f"--only {args.only!r} matches no row")
        for row in rows:
            b.verify(row)
        print(f"{len(rows)} proxies answer as they should; warming each up for a second",
              file=sys.stderr, flush=True)
        for row in rows:
            b.warm_up(row)
        print("measuring (one line per wrk run):", file=sys.stderr, flush=True)
        run_rounds(b, rows, args.rounds)
        time.sleep(1.5)  # nginx flushes its buffered logs every second
    finally:
        b.procs.stop_all()

    by_name = {r.name: r for r in rows}
    if counts:
        print_threads(rows, args, b.pin)
        return
    print_table(by_name)
    print(f"\n{args.rounds} round(s) of wrk -t1 -c32 -d{args.seconds}s per row, the order rotated each "
          f"round; medians. {CPUS} CPUs, shared by wrk, the proxies, the upstream and Redis. Proxy "
          "CPU: user + system of its processes (/proc/PID/stat) over the run ÷ requests. Redis "
          "calls: script runs (EVALSHA, or FCALL for the gateway) per request.")
    print_derived(by_name)
    print_degraded(by_name)
    if args.charts:
        chart(Path(args.charts), by_name)


if __name__ == "__main__":
    main()
