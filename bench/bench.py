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


def cpu_seconds(pids):
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
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


def wrk(url, seconds, script=None, headers=()):
    args = ["wrk", "-t1", "-c32", f"-d{seconds}s"]
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


def measure(name, url, pids, seconds, **kw):
    before = cpu_seconds(pids)
    r = wrk(url, seconds, **kw)
    after = cpu_seconds(pids)
    r["name"] = name
    r["cpu_us"] = (after - before) / max(r["requests"], 1) * 1e6 if pids else float("nan")
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
    scripts = sum(v for k, v in stats.items() if k in ("evalsha", "eval", "evalsha_ro", "eval_ro", "script|load"))
    return scripts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10, help="length of each wrk run")
    ap.add_argument("--memory-keys", type=int, default=1_000_000,
                    help="distinct keys for the memory figure (0 skips it)")
    ap.add_argument("--memory-only", action="store_true", help="only the memory figure")
    args = ap.parse_args()
    for tool in ("wrk", "nginx", "haproxy", "redis-server", "redis-cli"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(f"{tool} is missing: bench/run installs it")
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    haproxy_bin = shutil.which("haproxy") or "/usr/sbin/haproxy"

    procs = Procs()
    atexit.register(procs.stop_all)  # whatever fails, nothing is left running
    work = Path(tempfile.mkdtemp(prefix="pet-bench-"))
    rows = []
    try:
        # The static upstream: nginx answering [] to everything.
        static = free_port()
        sdir = work / "static"
        sdir.mkdir()
        (sdir / "nginx.conf").write_text(
            f"worker_processes 1; pid {sdir}/nginx.pid; error_log {sdir}/error.log;\n"
            "events { worker_connections 4096; }\n"
            "http { access_log off; keepalive_requests 1000000;\n"
            f"  server {{ listen 127.0.0.1:{static}; location / {{ default_type application/json; return 200 '[]'; }} }} }}\n")
        procs.start([nginx_bin, "-p", str(sdir), "-c", str(sdir / "nginx.conf"), "-g", "daemon off;"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(static)

        # pet-backend with a page of pets.
        backend = free_port()
        procs.start([str(BIN / "pet-backend"), "--listen", f"127.0.0.1:{backend}", "--db", str(work / "pets.db")],
                    env={**os.environ, "RUST_LOG": "warn"})
        wait_port(backend)
        for i in range(20):
            subprocess.run(["curl", "-s", "-o", "/dev/null", "-X", "POST", f"http://127.0.0.1:{backend}/v1/pets",
                            "-H", "Content-Type: application/json", "-d", f'{{"name":"pet{i}","categoryId":1}}'])

        # nginx as the proxy: upstream keep-alive, limit_req keyed on Authorization.
        ng = free_port()
        ndir = work / "nginx"
        ndir.mkdir()
        (ndir / "nginx.conf").write_text(
            f"worker_processes 1; pid {ndir}/nginx.pid; error_log {ndir}/error.log;\n"
            "events { worker_connections 4096; }\n"
            "http { access_log off; keepalive_requests 1000000;\n"
            "  limit_req_zone $http_authorization zone=keys:64m rate=100000r/s;\n"
            f"  upstream up {{ server 127.0.0.1:{static}; keepalive 64; }}\n"
            f"  server {{ listen 127.0.0.1:{ng};\n"
            "    location / { limit_req zone=keys burst=100000 nodelay; proxy_pass http://up;\n"
            "      proxy_http_version 1.1; proxy_set_header Connection \"\"; } } }\n")
        nginx = procs.start([nginx_bin, "-p", str(ndir), "-c", str(ndir / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(ng)

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

        redis_port = free_port()
        procs.start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], stdout=subprocess.DEVNULL)
        wait_port(redis_port)

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

        def gateway(name, redis, bans):
            port, admin = free_port(), free_port()
            cfg = work / f"{name}.toml"
            cfg.write_text(
                f'environment = "bench"\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin}"\n'
                f'upstreams = ["127.0.0.1:{static}"]\nkeys_file = "{keys_file}"\nplans_dir = "{plans}"\n'
                f'key_prefix = "bench:{name}"\nthreads = 1\nupgrade_sock = "{work}/{name}.sock"\n'
                + (f'redis_url = "redis://127.0.0.1:{redis_port}/"\nstore_timeout_ms = 1000\n' if redis else "")
                + ("" if bans else "[ban]\nstrikes = 1000000000\n"))
            p = procs.start([str(BIN / "pet-gateway"), "serve", "--config", str(cfg)],
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

    if not rows:
        report_memory(memory)
        return
    nginx_row = next(r for r in rows if r["name"].startswith("nginx"))
    static_row = rows[0]
    lines = ["| scenario | req/s | p50 ms | p99 ms | p99.9 ms | proxy CPU µs/req | × nginx req/s | × upstream req/s | Redis calls/req |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "" if r["cpu_us"] != r["cpu_us"] else f"{r['cpu_us']:.1f}"
        redis = f"{r['redis_per_req']:.3f}" if "redis_per_req" in r else ""
        note = f" ({r['non2xx']} non-2xx)" if r["non2xx"] and "429" not in r["name"] else ""
        lines.append(f"| {r['name']}{note} | {r['rps']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['p99.9']:.3f} | "
                     f"{cpu} | {r['rps'] / nginx_row['rps']:.2f} | {r['rps'] / static_row['rps']:.2f} | {redis} |")
    print("\n".join(lines))
    report_memory(memory)
    print(f"\nwrk -t1 -c32 -d{args.seconds}s per row; every proxy with one worker/thread; "
          f"{os.cpu_count()} CPUs; upstream: nginx returning [] (static) unless named.")


class _SkipScenarios(Exception):
    pass


def report_memory(memory):
    if memory:
        n, loaded, after, sent = memory
        print(f"\nMemory: RSS {loaded:.0f} MiB with {n} keys loaded, {after:.0f} MiB after {sent} requests "
              f"over them (every key seen at least once: {sent >= n}).")


if __name__ == "__main__":
    main()
