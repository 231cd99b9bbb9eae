#!/usr/bin/env python3
"""The benchmark: pet-gateway against nginx and HAProxy, one run on one machine, all on loopback.

Every scenario is one wrk run (1 thread, 32 connections) against one proxy in front of the same
upstream. For each it prints requests/s, latency percentiles, the proxy's own CPU time per request
(user + system from /proc/PID/stat over the run, divided by the requests served) and ratios to
nginx and to the upstream alone, computed inside this run. Called by bench/run, which builds the
release binaries and installs wrk, nginx, haproxy and redis-server first.
"""

import argparse
import atexit
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release"
# Where pet-gateway and pet-backend come from; `--bin-dir` points it at another build (an A/B of
# two commits). The bench's own tools (passthrough, store-load) always come from BIN.
GATEWAY_BIN = BIN
PASSTHROUGH = "pingora pass-through (no auth, no quota)"
# `--only REGEX`: the scenarios measured; the others are left out of the run and the table.
ONLY = None
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on port {port} after {timeout}s")


class Procs:
    """Every process started, stopped at the end whatever happens."""

    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        # Own process group: stopping it stops its workers too (nginx forks them).
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def stop(self, p):
        """Stops one (its process group) before the run ends."""
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    def stop_all(self):
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def start_nginx(procs, nginx_bin, folder, port, http, workers=1, cpus=None):
    """nginx with `workers` workers serving the `http` block's servers (listening on `port`)."""
    folder.mkdir(exist_ok=True)
    (folder / "nginx.conf").write_text(
        f"worker_processes {workers}; pid {folder}/nginx.pid; error_log {folder}/error.log;\n"
        "events { worker_connections 4096; }\n"
        "http { access_log off; keepalive_requests 1000000;\n" + http + " }\n")
    p = procs.start(pinned(cpus, [nginx_bin, "-p", str(folder), "-c", str(folder / "nginx.conf"),
                                  "-g", "daemon off;"]),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p


def nginx_proxy(static, port, limit_req=False):
    """The `http` block of nginx proxying to `static` with upstream keep-alive, optionally with
    `limit_req` keyed on the Authorization header."""
    zone = "  limit_req_zone $http_authorization zone=keys:64m rate=100000r/s;\n" if limit_req else ""
    limit = "limit_req zone=keys burst=100000 nodelay; " if limit_req else ""
    return (zone + f"  upstream up {{ server 127.0.0.1:{static}; keepalive 64; }}\n"
            f"  server {{ listen 127.0.0.1:{port};\n"
            f"    location / {{ {limit}proxy_pass http://up;\n"
            "      proxy_http_version 1.1; proxy_set_header Connection \"\"; } }")


def start_redis(procs):
    port = free_port()
    p = procs.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], stdout=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def start_tls_redis(procs, work):
    """A Redis that speaks only TLS, with a CA and server certificate made by `openssl`; returns
    the process, its port and the CA file the gateway trusts."""
    d = work / "redis-tls"
    d.mkdir(exist_ok=True)
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bench CA",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(d / "redis.key"), "-out", str(d / "redis.csr"))
    (d / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(d / "redis.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
        "-CAcreateserial", "-days", "2", "-extfile", str(d / "san.ext"), "-out", str(d / "redis.crt"))
    port = free_port()
    p = procs.start(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                     "--tls-cert-file", str(d / "redis.crt"), "--tls-key-file", str(d / "redis.key"),
                     "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
                     "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    wait_port(port)
    return p, port, d / "ca.crt"


def cpu_seconds(pids, user_only=False):
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        # utime, stime (fields 14, 15)
        total += int(fields[11]) + (0 if user_only else int(fields[12]))
    return total / CLK_TCK


def children(pid):
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def to_ms(text):
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    return float(m.group(1)) * UNITS[m.group(2)] if m else float("nan")


# Appended to every wrk script: wrk's own report stops at p99.
PERCENTILES = """
done = function(summary, latency, requests)
  for _, p in ipairs({50, 99, 99.9}) do
    io.write(string.format("pct %g %d\\n", p, latency:percentile(p)))
  end
end
"""


def wrk(url, seconds, script=None, headers=(), connections=32, cpus=None, threads=1):
    args = pinned(cpus, ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s"])
    for h in headers:
        args += ["-H", h]
    body = Path(script).read_text() if script else ""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(body + PERCENTILES)
    args += ["-s", f.name]
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    res = {"requests": int(re.search(r"(\d+) requests in", out).group(1))}
    res["rps"] = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    for pct in ("50", "99", "99.9"):
        m = re.search(rf"^pct {re.escape(pct)} (\d+)$", out, re.M)
        res[f"p{pct}"] = int(m.group(1)) / 1000 if m else float("nan")  # µs → ms
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non2xx"] = int(non2xx.group(1)) if non2xx else 0
    errors = re.search(r"Socket errors: (.*)", out)
    res["errors"] = errors.group(1) if errors else ""
    return res


def wanted(name):
    """Whether `--only` lets scenario `name` run."""
    return not ONLY or bool(ONLY.search(name))


def measure(name, url, pids, seconds, **kw):
    if not wanted(name):
        return {"name": name, "skipped": True, "requests": 0}
    before, user_before = cpu_seconds(pids), cpu_seconds(pids, user_only=True)
    r = wrk(url, seconds, **kw)
    after, user_after = cpu_seconds(pids), cpu_seconds(pids, user_only=True)
    r["name"] = name
    r["cpu_us"] = (after - before) / max(r["requests"], 1) * 1e6 if pids else float("nan")
    # User time alone: what the process's own code costs, without the kernel's socket work.
    r["user_us"] = (user_after - user_before) / max(r["requests"], 1) * 1e6 if pids else float("nan")
    print(f"  {name}: {r['rps']:.0f} req/s, p99 {r['p99']:.2f} ms, "
          f"{r['cpu_us']:.1f} µs CPU/req, non-2xx {r['non2xx']}", file=sys.stderr, flush=True)
    return r


def write_keys(path, plan, count, prefix="bench"):
    """A keys file in pet-gateway's format; returns the keys. Hashes only go to the file."""
    keys, lines = [], ["# bench keys\n"]
    for i in range(count):
        key = "pet_" + secrets.token_hex(32)
        keys.append(key)
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines.append(f'[[key]]\nid = "{prefix}_{i:07d}"\nplan = "{plan}"\nsha256 = "{digest}"\n'
                     f'created_at = "2026-01-01T00:00:00Z"\n\n')
    path.write_text("".join(lines))
    return keys


def append_keys(path, plan, count, prefix):
    existing = path.read_text()
    tmp = path.with_suffix(".new")
    keys = write_keys(tmp, plan, count, prefix)
    path.write_text(existing + tmp.read_text().split("\n", 1)[1])
    tmp.unlink()
    return keys


def rotation_script(work, keys, name):
    keyfile = work / f"{name}.txt"
    keyfile.write_text("\n".join(keys) + "\n")
    script = work / f"{name}.lua"
    script.write_text(
        "local keys = {}\n"
        f'for line in io.lines("{keyfile}") do keys[#keys + 1] = line end\n'
        "local i = 0\n"
        "request = function()\n"
        "  i = i + 1\n"
        "  if i > #keys then i = 1 end\n"
        '  return wrk.format("GET", "/v1/pets", {["Authorization"] = "Bearer " .. keys[i]})\n'
        "end\n")
    return script


def redis_calls(port):
    """Round trips that carry requests: script calls (the commands a script runs inside Redis,
    TIME, HMGET, HSET, EXPIREAT, are counted by commandstats too but cost no round trip), plus any
    plain command a client sent on its own."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "commandstats"],
                         capture_output=True, text=True).stdout
    stats = {m.group(1): int(m.group(2)) for m in re.finditer(r"cmdstat_([\w|]+):calls=(\d+)", out)}
    scripts = sum(v for k, v in stats.items() if k in ("evalsha", "eval", "evalsha_ro", "eval_ro",
                                                        "script|load", "fcall", "fcall_ro",
                                                        "function|load"))
    return scripts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10, help="length of each wrk run")
    ap.add_argument("--memory-keys", type=int, default=1_000_000,
                    help="distinct keys for the memory figure (0 skips it)")
    ap.add_argument("--memory-only", action="store_true", help="only the memory figure")
    ap.add_argument("--no-decisions", dest="decisions", action="store_false",
                    help="skip the Redis decision load (Redis CPU per decision)")
    ap.add_argument("--no-scaling", dest="scaling", action="store_false",
                    help="skip the table by proxy thread count")
    ap.add_argument("--charts", default=str(ROOT / "bench" / "charts"),
                    help="where the PNG charts go ('' skips them)")
    ap.add_argument("--bin-dir", help="where pet-gateway and pet-backend are (default target/release)")
    ap.add_argument("--only", help="measure only the scenarios whose name matches this regex")
    args = ap.parse_args()
    global GATEWAY_BIN, ONLY
    if args.bin_dir:
        GATEWAY_BIN = Path(args.bin_dir).resolve()
    if args.only:
        ONLY = re.compile(args.only)
    for tool in ("wrk", "nginx", "haproxy", "redis-server", "redis-cli"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(f"{tool} is missing: bench/run installs it")
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    haproxy_bin = shutil.which("haproxy") or "/usr/sbin/haproxy"

    procs = Procs()
    atexit.register(procs.stop_all)  # whatever fails, nothing is left running
    work = Path(tempfile.mkdtemp(prefix="pet-bench-"))
    rows = []
    decisions = []
    scaling = []
    try:
        # The static upstream: nginx answering [] to everything.
        static = free_port()
        start_nginx(procs, nginx_bin, work / "static", static,
                    f"  server {{ listen 127.0.0.1:{static}; location / {{ default_type application/json; "
                    "return 200 '[]'; } }")

        # pet-backend with a page of pets.
        backend = free_port()
        procs.start([str(GATEWAY_BIN / "pet-backend"), "--listen", f"127.0.0.1:{backend}", "--db", str(work / "pets.db")],
                    env={**os.environ, "RUST_LOG": "warn"})
        wait_port(backend)
        for i in range(20):
            subprocess.run(["curl", "-s", "-o", "/dev/null", "-X", "POST", f"http://127.0.0.1:{backend}/v1/pets",
                            "-H", "Content-Type: application/json", "-d", f'{{"name":"pet{i}","categoryId":1}}'])

        # nginx as the proxy: upstream keep-alive, limit_req keyed on Authorization.
        ng = free_port()
        nginx = start_nginx(procs, nginx_bin, work / "nginx", ng, nginx_proxy(static, ng, limit_req=True))

        # HAProxy: a stick table keyed on Authorization tracking http_req_rate.
        hp = free_port()
        hdir = work / "haproxy"
        hdir.mkdir()
        (hdir / "haproxy.cfg").write_text(
            "global\n  nbthread 1\n  maxconn 4096\n"
            "defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n  timeout server 30s\n"
            "  option http-keep-alive\n"
            f"frontend fe\n  bind 127.0.0.1:{hp}\n"
            "  http-request track-sc0 req.hdr(authorization) table keys\n"
            "  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }\n"
            "  default_backend be\n"
            "backend keys\n  stick-table type string len 128 size 1m expire 60s store http_req_rate(60s)\n"
            f"backend be\n  http-reuse always\n  server s1 127.0.0.1:{static}\n")
        haproxy = procs.start([haproxy_bin, "-f", str(hdir / "haproxy.cfg"), "-db"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(hp)

        _, redis_port = start_redis(procs)

        # Plans and keys for the gateways.
        plans = work / "plans"
        plans.mkdir()
        (plans / "unlimited.toml").write_text("requests_per_minute = 100000000\nrequests_per_day = 1000000000\n")
        (plans / "tiny.toml").write_text("requests_per_minute = 1\nrequests_per_day = 1\n")
        keys_file = work / "keys.toml"
        admitted_key = write_keys(keys_file, "unlimited", 1, "admitted")[0]
        refused_key = append_keys(keys_file, "tiny", 1, "refused")[0]
        banned_key = append_keys(keys_file, "tiny", 1, "banned")[0]
        rotation = append_keys(keys_file, "unlimited", 10_000, "rot")
        rot_script = rotation_script(work, rotation, "rotation")

        default_redis = f"redis://127.0.0.1:{redis_port}/"

        def gateway(name, redis, bans, threads=1, extra="", cpus=None, redis_url=None):
            port, admin = free_port(), free_port()
            cfg = work / f"{name}.toml"
            cfg.write_text(
                f'environment = "bench"\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin}"\n'
                f'upstreams = ["127.0.0.1:{static}"]\nkeys_file = "{keys_file}"\nplans_dir = "{plans}"\n'
                f'key_prefix = "bench:{name}"\nthreads = {threads}\nupgrade_sock = "{work}/{name}.sock"\n'
                + (f'redis_url = "{redis_url or default_redis}"\nstore_timeout_ms = 1000\n' if redis else "")
                + extra
                + ("" if bans else "[ban]\nstrikes = 1000000000\n"))
            p = procs.start(pinned(cpus, [str(GATEWAY_BIN / "pet-gateway"), "serve", "--config", str(cfg)]),
                            env={**os.environ, "RUST_LOG": "warn"}, stderr=open(work / f"{name}.log", "w"))
            wait_port(port)
            return p, port

        def passthrough(name, threads=1, cpus=None):
            port = free_port()
            p = procs.start(pinned(cpus, [str(BIN / "passthrough"), f"127.0.0.1:{port}", f"127.0.0.1:{static}",
                                          str(threads)]),
                            env={**os.environ, "RUST_LOG": "warn"}, stderr=open(work / f"{name}.log", "w"))
            wait_port(port)
            return p, port

        embedded, emb_port = gateway("embedded", redis=False, bans=False)
        embedded_bans, embb_port = gateway("embedded-bans", redis=False, bans=True)
        with_redis, red_port = gateway("redis", redis=True, bans=False)
        redis_bans, redb_port = gateway("redis-bans", redis=True, bans=True)

        s = args.seconds if not args.memory_only else 0
        auth = lambda k: (f"Authorization: Bearer {k}",)
        nginx_pids = [nginx.pid] + children(nginx.pid)
        print("running (each line is one wrk run):", file=sys.stderr)
        if args.memory_only:
            raise _SkipScenarios()
        rows.append(measure("upstream alone: static", f"http://127.0.0.1:{static}/v1/pets", [], s))
        rows.append(measure("upstream alone: pet-backend GET /v1/pets", f"http://127.0.0.1:{backend}/v1/pets", [], s))
        rows.append(measure("nginx (proxy_pass + limit_req)", f"http://127.0.0.1:{ng}/v1/pets", nginx_pids, s,
                            headers=auth(admitted_key)))
        rows.append(measure("HAProxy (stick table)", f"http://127.0.0.1:{hp}/v1/pets", [haproxy.pid], s,
                            headers=auth(admitted_key)))
        pt, pt_port = passthrough("passthrough") if wanted(PASSTHROUGH) else (None, 0)
        rows.append(measure(PASSTHROUGH, f"http://127.0.0.1:{pt_port}/v1/pets",
                            [pt.pid] if pt else [], s, headers=auth(admitted_key)))
        rows.append(measure("pet-gateway, embedded, admitted", f"http://127.0.0.1:{emb_port}/v1/pets",
                            [embedded.pid], s, headers=auth(admitted_key)))
        rows.append(measure("pet-gateway, embedded, refused (429)", f"http://127.0.0.1:{emb_port}/v1/pets",
                            [embedded.pid], s, headers=auth(refused_key)))
        rows.append(measure("pet-gateway, embedded, banned (429)", f"http://127.0.0.1:{embb_port}/v1/pets",
                            [embedded_bans.pid], s, headers=auth(banned_key)))
        rows.append(measure("pet-gateway, embedded, 10,000 keys", f"http://127.0.0.1:{emb_port}/v1/pets",
                            [embedded.pid], s, script=rot_script))
        calls0 = redis_calls(redis_port)
        r = measure("pet-gateway, Redis, admitted", f"http://127.0.0.1:{red_port}/v1/pets", [with_redis.pid], s,
                    headers=auth(admitted_key))
        r["redis_per_req"] = (redis_calls(redis_port) - calls0) / max(r["requests"], 1)
        rows.append(r)
        tls_row = "pet-gateway, Redis over TLS, admitted"
        if wanted(tls_row):
            _, tls_port, tls_ca = start_tls_redis(procs, work)
            with_tls, tls_gw = gateway("redis-tls", redis=True, bans=False,
                                       redis_url=f"rediss://127.0.0.1:{tls_port}/",
                                       extra=f'redis_tls_ca_file = "{tls_ca}"\n')
            rows.append(measure(tls_row, f"http://127.0.0.1:{tls_gw}/v1/pets", [with_tls.pid], s,
                                headers=auth(admitted_key)))
        calls0 = redis_calls(redis_port)
        r = measure("pet-gateway, Redis, refused (429)", f"http://127.0.0.1:{red_port}/v1/pets", [with_redis.pid], s,
                    headers=auth(refused_key))
        r["redis_per_req"] = (redis_calls(redis_port) - calls0) / max(r["requests"], 1)
        rows.append(r)
        calls0 = redis_calls(redis_port)
        r = measure("pet-gateway, Redis, banned (429)", f"http://127.0.0.1:{redb_port}/v1/pets", [redis_bans.pid], s,
                    headers=auth(banned_key))
        r["redis_per_req"] = (redis_calls(redis_port) - calls0) / max(r["requests"], 1)
        rows.append(r)
        rows.append(measure("pet-gateway, Redis, 10,000 keys", f"http://127.0.0.1:{red_port}/v1/pets",
                            [with_redis.pid], s, script=rot_script))
        unbatched, unb_port = gateway("redis-unbatched", redis=True, bans=False, extra="store_batch_max = 1\n")
        calls0 = redis_calls(redis_port)
        r = measure("pet-gateway, Redis, admitted, unbatched (store_batch_max = 1)",
                    f"http://127.0.0.1:{unb_port}/v1/pets", [unbatched.pid], s, headers=auth(admitted_key))
        r["redis_per_req"] = (redis_calls(redis_port) - calls0) / max(r["requests"], 1)
        rows.append(r)

        if args.decisions:
            decisions = redis_decisions(procs, s)
        if args.scaling:
            scaling = thread_scaling(procs, gateway, passthrough, nginx_bin, static, work, s,
                                     admitted_key, redis_port)

        memory = None
    except _SkipScenarios:
        memory = None
    try:
        if args.memory_keys:
            print(f"memory: {args.memory_keys} distinct keys through an embedded gateway…", file=sys.stderr, flush=True)
            mem_keys_file = work / "memkeys.toml"
            many = write_keys(mem_keys_file, "unlimited", args.memory_keys, "m")
            mscript = rotation_script(work, many, "memory")
            keys_file_bak = keys_file
            keys_file = mem_keys_file
            mem_gw, mem_port = gateway("memory", redis=False, bans=False)
            keys_file = keys_file_bak
            time.sleep(3)  # let the allocator return what loading the file used for a moment
            rss_loaded = rss_mib(mem_gw.pid)
            # One pass over every key (wrk sends them in order, wrapping around).
            per_sec = 15000
            secs = max(10, args.memory_keys // per_sec + 5)
            mr = wrk(f"http://127.0.0.1:{mem_port}/v1/pets", secs, script=mscript)
            time.sleep(3)
            memory = (args.memory_keys, rss_loaded, rss_mib(mem_gw.pid), mr["requests"])
    finally:
        procs.stop_all()

    rows = [r for r in rows if not r.get("skipped")]
    if not rows:
        report_memory(memory)
        return
    # The ratio columns stay empty when `--only` left their reference out.
    nginx_row = next((r for r in rows if r["name"].startswith("nginx")), None)
    static_row = next((r for r in rows if r["name"] == "upstream alone: static"), None)
    ratio = lambda r, ref: f"{r['rps'] / ref['rps']:.2f}" if ref else ""
    lines = ["| scenario | req/s | p50 ms | p99 ms | p99.9 ms | proxy CPU µs/req | × nginx req/s | × upstream req/s | Redis calls/req |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "" if r["cpu_us"] != r["cpu_us"] else f"{r['cpu_us']:.1f}"
        redis = f"{r['redis_per_req']:.3f}" if "redis_per_req" in r else ""
        note = f" ({r['non2xx']} non-2xx)" if r["non2xx"] and "429" not in r["name"] else ""
        lines.append(f"| {r['name']}{note} | {r['rps']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['p99.9']:.3f} | "
                     f"{cpu} | {ratio(r, nginx_row)} | {ratio(r, static_row)} | {redis} |")
    print("\n".join(lines))
    report_memory(memory)
    print(f"\nwrk -t1 -c32 -d{args.seconds}s per row; every proxy with one worker/thread; "
          f"{os.cpu_count()} CPUs; upstream: nginx returning [] (static) unless named.")
    pt_row = next((r for r in rows if r["name"].startswith("pingora pass-through")), None)
    if pt_row is not None:
        print("\nThe gateway's CPU per request over plain pingora's (the same pingora, runtime settings and upstream):")
    for r in rows if pt_row is not None else []:
        if r["name"].startswith("pet-gateway") and "admitted" in r["name"] or "10,000" in r["name"]:
            print(f"- {r['name']}: {r['cpu_us']:.1f} µs vs {pt_row['cpu_us']:.1f} µs: "
                  f"{(r['cpu_us'] / pt_row['cpu_us'] - 1) * 100:+.0f} %")
    report_decisions(decisions)
    report_scaling(scaling)
    if args.charts:
        charts(Path(args.charts), rows, decisions, scaling)


def pinned(cpus, args):
    """`args` under `taskset -c CPUS` when CPUS is given (machines with cores to spare)."""
    return ["taskset", "-c", cpus] + args if cpus else args


def redis_decisions(procs, seconds):
    """Redis's cost per decision: `store-load` drives the store's `acquire` as hard as it can
    (512 in flight) against a Redis of its own, for one hot key and for 10,000 keys, batched and
    one script run per decision; Redis's `INFO` before and after gives its CPU."""
    out = []
    for keys in (1, 10_000):
        for batch in (128, 1):
            p, port = start_redis(procs)
            res = subprocess.run([str(BIN / "store-load"), "--redis", f"redis://127.0.0.1:{port}/",
                                  "--keys", str(keys), "--batch-max", str(batch), "--concurrency", "512",
                                  "--seconds", str(seconds)], capture_output=True, text=True, check=True)
            d = json.loads(res.stdout)
            n = max(d["decisions"], 1)
            row = {"keys": keys, "batch_max": batch, "decisions_per_s": d["decisions"] / d["seconds"],
                   "script_us": d["script_usec"] / n, "redis_cpu_us": d["redis_cpu_s"] * 1e6 / n,
                   "batch": d["decisions"] / max(d["script_runs"], 1), "errors": d["errors"]}
            row["per_cpu_s"] = 1e6 / row["redis_cpu_us"] if row["redis_cpu_us"] else float("nan")
            print(f"  Redis decisions, {keys} keys, batch max {batch}: {row['decisions_per_s']:.0f}/s, "
                  f"{row['script_us']:.2f} µs script, {row['redis_cpu_us']:.2f} µs Redis CPU per decision",
                  file=sys.stderr, flush=True)
            out.append(row)
            procs.stop(p)
    return out


def report_decisions(decisions):
    if not decisions:
        return
    print("\nRedis per decision (store-load, 512 decisions in flight, every decision an admission):\n")
    print("| keys | batching | decisions/s | avg batch | script µs/decision (commandstats) "
          "| Redis CPU µs/decision (INFO cpu) | decisions per Redis CPU-second |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for d in decisions:
        mode = f"group commit (≤ {d['batch_max']})" if d["batch_max"] > 1 else "one run per decision"
        err = f" ({d['errors']} errors)" if d["errors"] else ""
        print(f"| {d['keys']:,} | {mode}{err} | {d['decisions_per_s']:.0f} | {d['batch']:.1f} | "
              f"{d['script_us']:.2f} | {d['redis_cpu_us']:.2f} | {d['per_cpu_s']:,.0f} |")


def thread_scaling(procs, gateway, passthrough, nginx_bin, static, work, seconds, key, redis_port):
    """Each proxy with 1, 2, 4, 8 threads (as many as the machine allows). With 8 or more CPUs,
    wrk, the upstream, Redis and the proxy are pinned apart (`taskset`); on fewer they share."""
    ncpu = os.cpu_count() or 1
    counts = [n for n in (1, 2, 4, 8) if n <= max(ncpu - 4, 2)] if ncpu >= 8 else [1, 2]
    pin = ncpu >= 8
    proxy_cpus = lambda n: f"4-{3 + n}" if pin else None
    wrk_cpus = "0-1" if pin else None
    out = []
    for n in counts:
        row = lambda name: f"{name}, {n} thread(s)"
        targets = []
        if wanted(row("nginx")):
            port = free_port()
            ng = start_nginx(procs, nginx_bin, work / f"nginx-{n}", port, nginx_proxy(static, port),
                             workers=n, cpus=proxy_cpus(n))
            targets.append(("nginx", ng, port, lambda p: [p.pid] + children(p.pid)))
        if wanted(row("pingora pass-through")):
            p, pp = passthrough(f"pt-{n}", threads=n, cpus=proxy_cpus(n))
            targets.append(("pingora pass-through", p, pp, lambda p: [p.pid]))
        if wanted(row("pet-gateway, embedded")):
            p, gp = gateway(f"emb-{n}", redis=False, bans=False, threads=n, cpus=proxy_cpus(n))
            targets.append(("pet-gateway, embedded", p, gp, lambda p: [p.pid]))
        if wanted(row("pet-gateway, Redis")):
            p, rp = gateway(f"red-{n}", redis=True, bans=False, threads=n, cpus=proxy_cpus(n))
            targets.append(("pet-gateway, Redis", p, rp, lambda p: [p.pid]))
        for name, proc, port, pids in targets:
            r = measure(row(name), f"http://127.0.0.1:{port}/v1/pets", pids(proc), seconds,
                        headers=(f"Authorization: Bearer {key}",), connections=32 * n, cpus=wrk_cpus)
            r["proxy"], r["threads"] = name, n
            out.append(r)
            procs.stop(proc)
    return out


def report_scaling(scaling):
    if not scaling:
        return
    print("\nBy proxy threads (wrk -t1 -c32×threads; nginx worker_processes = threads, no limit_req):\n")
    print("| proxy | threads | req/s | proxy CPU µs/req | CPU/req vs 1 thread |")
    print("|---|---:|---:|---:|---:|")
    first = {}
    for r in scaling:
        base = first.setdefault(r["proxy"], r["cpu_us"])
        print(f"| {r['proxy']} | {r['threads']} | {r['rps']:.0f} | {r['cpu_us']:.1f} | "
              f"{(r['cpu_us'] / base - 1) * 100:+.0f} % |")


def pyplot():
    """matplotlib's pyplot drawing to files, or None (said once) where it is missing: the
    figures are printed either way, and bench/run installs it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no charts (bench/run installs it)", file=sys.stderr)
        return None
    return plt


def charts(folder, rows, decisions, scaling):
    """PNG charts of this run's figures, next to RESULTS.md (matplotlib, installed by bench/run)."""
    plt = pyplot()
    if plt is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    proxied = [r for r in rows if r["cpu_us"] == r["cpu_us"]]
    names = [r["name"] for r in proxied]
    for key, label, fname in (("rps", "requests/s", "throughput.png"),
                              ("cpu_us", "proxy CPU µs per request", "cpu_per_request.png")):
        fig, ax = plt.subplots(figsize=(9, 0.4 * len(names) + 1.5))
        ax.barh(names[::-1], [r[key] for r in proxied][::-1], color="#4477aa")
        ax.set_xlabel(label)
        ax.set_title(f"{label} by scenario (one worker each, one run)")
        fig.tight_layout()
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
    if scaling:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for proxy in dict.fromkeys(r["proxy"] for r in scaling):
            pts = [r for r in scaling if r["proxy"] == proxy]
            a1.plot([p["threads"] for p in pts], [p["rps"] for p in pts], marker="o", label=proxy)
            a2.plot([p["threads"] for p in pts], [p["cpu_us"] for p in pts], marker="o", label=proxy)
        a1.set(xlabel="proxy threads", ylabel="requests/s", title="throughput by threads")
        a2.set(xlabel="proxy threads", ylabel="CPU µs per request", title="CPU per request by threads")
        a2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / "scaling.png", dpi=110)
        plt.close(fig)
    if decisions:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{d['keys']:,} key(s), {'batched' if d['batch_max'] > 1 else 'unbatched'}" for d in decisions]
        ax.barh(labels[::-1], [d["redis_cpu_us"] for d in decisions][::-1], color="#cc6677")
        ax.axvline(2.5, color="black", linestyle="--", linewidth=1, label="target 2.5 µs")
        ax.set_xlabel("Redis CPU µs per decision")
        ax.set_title("Redis CPU per decision")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "redis_per_decision.png", dpi=110)
        plt.close(fig)
    print(f"\ncharts: {', '.join(sorted(p.name for p in folder.glob('*.png')))} in {folder}")


class _SkipScenarios(Exception):
    pass


def report_memory(memory):
    if memory:
        n, loaded, after, sent = memory
        print(f"\nMemory: RSS {loaded:.0f} MiB with {n} keys loaded, {after:.0f} MiB after {sent} requests "
              f"over them (every key seen at least once: {sent >= n}).")


if __name__ == "__main__":
    main()
