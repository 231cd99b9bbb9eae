#!/usr/bin/env python3
"""The container image's smoke test (run by `scripts/container test`): what a new user does.

The backend and the gateway run as two containers of the image, the gateway in the backend's
network namespace (as a Kubernetes pod's containers share one), the gateway's API published
on a loopback port. Then: a key issued with `<engine> exec … pet-gateway keys issue`, 200 with
it and then 429 with `Retry-After` and the Error body, settings given as `PET_GATEWAY_*`
variables in force (as `check` in the container reports them), `SIGHUP` reloads (the gateway says so
and serves on), the image's `HEALTHCHECK` passes, and `<engine> stop` (SIGTERM) while a request
is in flight: that request is answered and the gateway exits 0. Prints the image's size and
how long the gateway takes from `run` to answering and to ready.
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time


def sh(*args, check=True, timeout=60):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{r.stdout}{r.stderr}")
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def get(port, path, key=None, timeout=5):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    c.request("GET", path, headers=headers)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def until(what, within, check):
    deadline = time.monotonic() + within
    while True:
        try:
            got = check()
            if got:
                return got
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {within} s: {what}")
        time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="podman")
    ap.add_argument("--image", default="pet-gateway:latest")
    ap.add_argument("--port", type=int, help="the gateway's public port here (default: a free one)")
    args = ap.parse_args()
    e = args.engine
    port = args.port or free_port()
    if port_taken(port):
        raise SystemExit(f"port {port} is taken on 127.0.0.1: give another with --port")
    tag = f"pet-smoke-{os.getpid()}"
    backend, gateway = f"{tag}-backend", f"{tag}-gateway"
    try:
        run(e, args.image, port, backend, gateway)
    finally:
        # With their anonymous volumes (the image's VOLUMEs), which would pile up run by run;
        # the gateway first: it is in the backend's network namespace, and podman refuses to
        # remove the backend under it.
        for name in (gateway, backend):
            left = sh(e, "rm", "-f", "-v", "-t", "0", name, check=False)
            if left.returncode != 0 and "no such container" not in left.stderr:
                print(f"warning: could not remove {name}: {left.stderr}", file=sys.stderr)


def run(e, image, port, backend, gateway):
    size = int(sh(e, "image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    print(f"image {image}: {size / 1e6:.0f} MB")
    sh(e, "run", "-d", "--name", backend, "--no-healthcheck", "-p", f"127.0.0.1:{port}:8080",
       "--entrypoint", "/usr/local/bin/pet-backend", image,
       "--listen", "127.0.0.1:8081", "--db", "/var/lib/pet-backend/pets.db")
    started = time.monotonic()
    sh(e, "run", "-d", "--name", gateway, "--network", f"container:{backend}",
       *(arg for var, value in FROM_ENV.items() for arg in ("-e", f"{var}={value}")), image)
    # Listening: any answer on the public port (401 without a key).
    until("the gateway answers on its port", 30, lambda: get(port, "/v1/pets")[0] == 401)
    answering = time.monotonic() - started
    health = [e, "healthcheck", "run", gateway] if e == "podman" else None
    if health:
        until("the image's HEALTHCHECK passes", 30, lambda: sh(*health, check=False).returncode == 0)
    else:
        until("docker reports the container healthy", 60, lambda: sh(
            e, "inspect", "--format", "{{.State.Health.Status}}", gateway).stdout.strip() == "healthy")
    ready = time.monotonic() - started
    print(f"start-up: answering after {answering:.2f} s, ready (HEALTHCHECK) after {ready:.2f} s")

    configured_from_env(e, gateway)

    out = sh(e, "exec", gateway, "pet-gateway", "keys", "issue", "--plan", "free", "--name", "smoke").stdout
    key = out.strip().splitlines()[-1]
    print(f"key issued through {e} exec: {key[:14]}…")
    # The gateway picks the new key up within its reload interval.
    until("the new key works", 10, lambda: get(port, "/v1/pets", key)[0] == 200)
    status, headers = 200, {}
    for _ in range(200):
        status, headers, body = get(port, "/v1/pets", key)
        if status != 200:
            break
    if status != 429 or "retry-after" not in headers:
        raise SystemExit(f"expected 429 with Retry-After after the free plan's 60, got {status} {headers}")
    error = json.loads(body)
    if "code" not in error or "message" not in error:
        raise SystemExit(f"429 without the Error body: {error}")
    print(f"200, then 429 with Retry-After: {headers['retry-after']} and code {error['code']}")

    sh(e, "kill", "--signal", "HUP", gateway)
    until("the gateway logs the SIGHUP reload", 10,
          lambda: "SIGHUP: reloading" in sh(e, "logs", gateway).stderr + sh(e, "logs", gateway).stdout)
    if get(port, "/v1/pets")[0] != 401:
        raise SystemExit("the gateway stopped serving after SIGHUP")
    print("SIGHUP: reloaded, still serving")

    out = sh(e, "exec", gateway, "pet-gateway", "keys", "issue", "--plan", "pro", "--name", "stop").stdout
    spare = out.strip().splitlines()[-1]
    until("the second key works", 10, lambda: get(port, "/v1/pets", spare)[0] == 200)
    graceful_stop(e, port, spare, gateway)


# Settings the image's gateway.toml leaves at their defaults, given as its variables: a list and
# a number, each once file-only (the book, "Configuration": every setting has a variable).
FROM_ENV = {
    "PET_GATEWAY_TRUSTED_PROXIES": "10.0.0.0/8, 192.168.0.0/16",
    "PET_GATEWAY_UNAUTHENTICATED_MAX_TRACKED": "5000",
}


def configured_from_env(e, gateway):
    """`check` in the running container reports each of FROM_ENV in force, from its variable."""
    report = sh(e, "exec", gateway, "pet-gateway", "check").stdout
    expected = {
        "trusted_proxies": '["10.0.0.0/8", "192.168.0.0/16"]',
        "unauthenticated_max_tracked": "5000",
    }
    for name, shown in expected.items():
        var = f"PET_GATEWAY_{name.upper()}"
        line = next((l for l in report.splitlines() if l.startswith(f"{name} ")), "")
        if shown not in line or not line.rstrip().endswith(f"env {var}"):
            raise SystemExit(f"{name}: expected {shown} from env {var}, check reports: {line!r}")
    print(f"configured from its environment: {', '.join(expected)} (check: from env)")


def listener_closed(port):
    try:
        get(port, "/v1/pets", timeout=1)
    except (OSError, http.client.HTTPException):
        return True
    return False


def graceful_stop(e, port, key, gateway):
    """A createPet whose body is still coming when the stop begins is answered, and the gateway
    exits 0."""
    body = json.dumps({"name": "Smoke", "categoryId": 1}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    s.sendall(
        f"POST /v1/pets HTTP/1.1\r\nHost: smoke\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body[:5])
    time.sleep(0.3)
    stop = threading.Thread(target=lambda: sh(e, "stop", "-t", "15", gateway, timeout=60))
    stop.start()
    closed_within = time.monotonic() + 10
    while not listener_closed(port):  # SIGTERM is in: new connections are refused
        if time.monotonic() > closed_within:
            raise SystemExit("the gateway still takes new connections 10 s after the stop began")
        time.sleep(0.05)
    s.sendall(body[5:])
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    s.close()
    stop.join()
    status_line = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    code = sh(e, "inspect", "--format", "{{.State.ExitCode}}", gateway).stdout.strip()
    if not status_line.startswith("HTTP/1.1 2"):
        raise SystemExit(f"the in-flight request got {status_line!r}, not the backend's 2xx: {reply!r}")
    if code != "0":
        raise SystemExit(f"the gateway exited {code} on SIGTERM, not 0")
    print(f"stop with a request in flight: new connections refused, it got {status_line!r}; "
          "the gateway exited 0")


if __name__ == "__main__":
    try:
        main()
    except subprocess.TimeoutExpired as t:
        sys.exit(f"timed out: {t}")
