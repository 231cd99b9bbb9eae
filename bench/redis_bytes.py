#!/usr/bin/env python3
"""Redis memory a quota costs, in the storage form the gateway writes today: one string
`<key_prefix>:windows:{<quota id>}` of 36 bytes and 12 a window, with an expiry (see
proxy/src/quota/store/scripts.rs). Starts a redis-server of its own on a free loopback port,
writes N such strings for 2 and for 4 windows, and prints used_memory's growth a key
(deploy/README.md, "Redis sizing and what a full Redis does", quotes the figures).

  bench/redis_bytes.py [N]   (default 100000)"""
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(port, *args, stdin=None):
    return subprocess.run(["redis-cli", "-p", str(port), *args], input=stdin,
                          capture_output=True, check=True).stdout


def used(port):
    for line in cli(port, "info", "memory").decode().splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    raise SystemExit("no used_memory in INFO")


def fill(port, n, windows):
    value = b"x" * (36 + 12 * windows)
    out = []
    for i in range(n):
        key = b"pet:production:windows:{key_%012x}" % (0x6426AE2C0000 + i)
        out.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nEX\r\n$5\r\n86400\r\n"
                   % (len(key), key, len(value), value))
    cli(port, "--pipe", stdin=b"".join(out))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--dir", d],
                                  stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    cli(port, "ping")
                    break
                except subprocess.CalledProcessError:
                    time.sleep(0.05)
            version = cli(port, "info", "server").decode().split("redis_version:")[1].split()[0]
            for windows in (2, 4):
                cli(port, "flushall")
                before = used(port)
                fill(port, n, windows)
                print(f"Redis {version}, {n} quotas of {windows} windows: "
                      f"{(used(port) - before) / n:.0f} bytes a quota")
        finally:
            server.terminate()
            server.wait(10)


main()
