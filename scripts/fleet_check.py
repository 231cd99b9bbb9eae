#!/usr/bin/env python3
"""The local fleet's check (run by `scripts/fleet test` on a fleet it brought up).

A key issued on one gateway works on all three; its revocation on another is in force on all
three within 1 s; the three share one count (a Free key's 60 a minute, spread over them);
Prometheus has every target up, every alert rule evaluating and none firing; every query of the
shipped dashboard parses and returns data.
"""

import argparse
import http.client
import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def container(engine, project, service):
    out = subprocess.run(
        [engine, "ps", "--filter", f"label=com.docker.compose.project={project}",
         "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}"],
        capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise SystemExit(f"no running container of the fleet's {service}")
    return out[0]


def cli(engine, name, *args):
    r = subprocess.run([engine, "exec", name, "pet-gateway", *args], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"pet-gateway {' '.join(args)} on {name} failed: {r.stderr}")
    return r.stdout


ADMITTED = {}


def status(port, key, path="/v1/pets"):
    """The status of one request; every 200 is counted per key (the check's own polls spend
    quota too)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    r = c.getresponse()
    r.read()
    c.close()
    ADMITTED[key] = ADMITTED.get(key, 0) + (r.status == 200)
    return r.status


def within(seconds, what, check):
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > seconds:
            raise SystemExit(f"not within {seconds} s: {what}")
        time.sleep(0.02)


def prometheus(addr, path, **query):
    c = http.client.HTTPConnection(*addr.split(":"), timeout=10)
    c.request("GET", f"/api/v1/{path}?{urllib.parse.urlencode(query)}")
    body = json.loads(c.getresponse().read())
    c.close()
    return body


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="podman")
    ap.add_argument("--project", default="pet-fleet")
    ap.add_argument("--ports", required=True, help="the three gateways' ports, comma-separated")
    ap.add_argument("--prometheus", required=True, help="host:port")
    args = ap.parse_args()
    e, ports = args.engine, [int(p) for p in args.ports.split(",")]
    gw1, gw2 = container(e, args.project, "gw1"), container(e, args.project, "gw2")

    # The count below must fall in one UTC minute.
    if time.time() % 60 > 40:
        time.sleep(61 - time.time() % 60)
    out = cli(e, gw1, "keys", "issue", "--plan", "free", "--name", "fleet-check")
    key = out.strip().splitlines()[-1]
    key_id = out.split()[1]
    took = within(1.0, "the key issued on gw1 works on all three",
                  lambda: all(status(p, key) == 200 for p in ports))
    print(f"a key issued on gw1 works on all three gateways ({took:.2f} s)")

    # One count: the Free plan's 60 a minute, however the requests spread.
    for i in range(90):
        s = status(ports[i % 3], key)
        if s not in (200, 429):
            raise SystemExit(f"unexpected {s} while spending the key")
    admitted = ADMITTED[key]
    if admitted != 60:
        raise SystemExit(f"the fleet admitted {admitted} of the key's requests this minute, not 60: not one count")
    print(f"one count across the fleet: {admitted} admitted (Free: 60 a minute)")
    for p in ports:
        status(p, "pet_fleet_not_a_key_000000000000000000")  # a 401 for the dashboard

    cli(e, gw2, "keys", "revoke", key_id)
    took = within(1.0, "the revocation on gw2 in force on all three",
                  lambda: all(status(p, key) == 401 for p in ports))
    print(f"revoked on gw2, refused by all three within {took:.2f} s")

    check_prometheus(args.prometheus)


def check_prometheus(addr):
    # Two scrapes of every target after the traffic: rates need two samples.
    def targets_up():
        active = prometheus(addr, "targets")["data"]["activeTargets"]
        return len(active) == 4 and all(t["health"] == "up" for t in active)
    within(30, "Prometheus has its four targets up", targets_up)
    time.sleep(11)
    rules = prometheus(addr, "rules")["data"]["groups"]
    bad = [r["name"] for g in rules for r in g["rules"] if r.get("health") != "ok"]
    if bad or not rules:
        raise SystemExit(f"alert rules not evaluating: {bad or 'none loaded'}")
    firing = [a["labels"]["alertname"] for a in prometheus(addr, "alerts")["data"]["alerts"]
              if a["state"] == "firing"]
    if firing:
        raise SystemExit(f"alerts firing on a healthy fleet: {firing}")
    count = sum(len(g["rules"]) for g in rules)
    print(f"Prometheus: 4 targets up, {count} alert rules evaluating, none firing")

    dash = json.loads((ROOT / "deploy/grafana/pet-gateway.json").read_text())
    errors, empty, total = [], [], 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$env", "fleet").replace("$__rate_interval", "1m")
            total += 1
            r = prometheus(addr, "query", query=expr)
            if r["status"] != "success":
                errors.append(f"{panel['title']}: {r.get('error')}")
            elif not r["data"]["result"]:
                empty.append(f"{panel['title']}: {expr}")
    if errors:
        raise SystemExit("dashboard queries that do not parse:\n" + "\n".join(errors))
    if empty:
        raise SystemExit(f"{len(empty)} of {total} dashboard queries return no data:\n" + "\n".join(empty))
    print(f"the dashboard: all {total} queries return data")


if __name__ == "__main__":
    try:
        main()
    except (OSError, http.client.HTTPException, subprocess.TimeoutExpired) as err:
        sys.exit(f"fleet check: {err}")
