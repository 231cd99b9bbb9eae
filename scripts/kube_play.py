#!/usr/bin/env python3
"""Runs rendered Kubernetes manifests with `podman kube play` (Podman 4.3) and checks them: a
key issued in a gateway pod (`podman exec`, as `kubectl exec` would) answers 200 through the
gateway, and the plans ConfigMap, the config ConfigMap and the Deployments' security settings
are in force. `scripts/kube play` calls it; everything it starts is taken down at the end.

What Podman 4.3 does not run, and what is done instead (deploy/README.md says the same):
- Services, NetworkPolicies, PodDisruptionBudgets, HorizontalPodAutoscalers, ServiceMonitors
  and Namespaces are left out: podman has no such objects. Without Services, the played pods
  reach each other by their pod names on a network of their own (`<deployment>-pod-0`), so
  the gateway's config is given those names in place of the Services'.
- Secrets: podman 4.3 crashes on a Secret volume and takes `secretKeyRef` only from a podman
  secret holding a JSON map of base64 values; so the Secrets this script makes (passwords, the
  admin token, the signing key, the Redis ACL file) become such podman secrets for variables
  and host folders for volumes, each owned by the pod's user.
- Ports are not published on the host (podman 4.3 publishes every containerPort there, and
  two pods collide): the check reaches the gateway pod by its address on the network.
- Probes, preStop and the rolling update are not exercised (podman runs health checks from
  systemd timers, absent here).
"""

import argparse
import base64
import http.client
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

LEFT_OUT = {"Namespace", "Service", "NetworkPolicy", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "ServiceMonitor"}
NETWORK = "pet-kube"
ROOT = Path(__file__).resolve().parent.parent
# The project's version ([workspace.package] of Cargo.toml): scripts/container tags the image so,
# and the manifests name that tag (tests/tests/version.rs holds them equal).
VERSION = re.search(r'^version = "(.*)"$', (ROOT / "Cargo.toml").read_text(), re.M).group(1)


def sh(*args, check=True, timeout=120, input=None):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input)
    if check and r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, args))}\n{r.stdout}{r.stderr}")
    return r


def password():
    return secrets.token_urlsafe(32)


def make_secrets(work):
    """The values an operator would put in the Secrets, and the files made from them."""
    out = work / "secrets"
    shutil.rmtree(out, ignore_errors=True)
    os.umask(0o077)  # every file and folder below: its owner's alone
    (out / "own").mkdir(parents=True)
    values = {
        "redis-password": password(),
        "registry-admin-password": password(),
        "admin-token": password(),
        "default-password": password(),
    }
    for name, value in values.items():
        (out / "own" / name).write_text(value + "\n")
    signing = out / "signing"
    signing.mkdir()
    verify = sh("podman", "run", "--rm", "--user", "0", "--entrypoint", "/usr/local/bin/pet-gateway",
                "-v", f"{signing}:/out", f"localhost/pet-gateway:{VERSION}", "registry", "keygen",
                "--out", "/out/registry-signing.key").stdout.split()[0]
    acl = out / "redis-acl"
    acl.mkdir()
    users = sh(str(ROOT / "deploy/redis/acl-users"), "--prefix", "pet:staging",
               "--default-password-file", str(out / "own/default-password"),
               "--gateway-password-file", str(out / "own/redis-password"),
               "--admin-password-file", str(out / "own/registry-admin-password")).stdout
    (acl / "users.acl").write_text(users)
    for folder, uid in ((signing, 10001), (acl, 10002)):
        for f in folder.iterdir():
            os.chown(f, uid, uid)
            f.chmod(0o400)
        os.chown(folder, uid, uid)
        folder.chmod(0o500)
    return values, verify, {"pet-registry-signing-key": signing, "redis-acl": acl}


def podman_secret(name, data):
    sh("podman", "secret", "rm", name, check=False)
    payload = json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})
    sh("podman", "secret", "create", name, "-", input=payload)


def for_podman(docs, verify, folders):
    """The manifests as podman 4.3 can play them (see the module's text)."""
    kept, left_out = [], []
    for d in docs:
        if d["kind"] in LEFT_OUT:
            left_out.append(f"{d['kind']}/{d['metadata']['name']}")
            continue
        d["metadata"].pop("namespace", None)
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pet-gateway-config"):
            toml = d["data"]["gateway.toml"]
            toml = toml.replace('"pet-backend:8081"', '"pet-backend-pod-0:8081"')
            toml = toml.replace("redis://pet-redis:6379", "redis://pet-redis-pod-0:6379")
            d["data"]["gateway.toml"] = toml
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                # Podman 4.3 publishes every containerPort on the host's same port, so two
                # pods (or anything here on 8080) collide; the pods are reached by address.
                for port in c.pop("ports", []):
                    for probe in ("readinessProbe", "livenessProbe"):
                        socket = c.get(probe, {}).get("tcpSocket")
                        if socket and socket.get("port") == port.get("name"):
                            socket["port"] = port["containerPort"]
            for v in d["spec"]["template"]["spec"].get("volumes", []):
                if "secret" in v:
                    folder = folders[v.pop("secret")["secretName"]]
                    v["hostPath"] = {"path": str(folder), "type": "Directory"}
        kept.append(d)
    kept.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pet-registry"},
                 "data": {"verify-keys": verify}})
    # In order of need: what the others read first, then Redis and the backend, the gateway
    # last (its upstream's name must resolve when it starts).
    rank = {"ConfigMap": 0, "PersistentVolumeClaim": 1}
    order = {"pet-redis": 2, "pet-backend": 3, "pet-gateway": 4}
    kept.sort(key=lambda d: rank.get(d["kind"], order.get(d["metadata"]["name"], 5)))
    return kept, left_out


def gateway_ip(container):
    out = sh("podman", "inspect", container, "--format",
             f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}').stdout.strip()
    if not out:
        raise SystemExit(f"{container} has no address on {NETWORK}")
    return out


def get(ip, key):
    c = http.client.HTTPConnection(ip, 8080, timeout=5)
    c.request("GET", "/v1/pets", headers={"Authorization": f"Bearer {key}"})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifests", required=True, help="the rendered overlay")
    ap.add_argument("--work", required=True, help="a folder for what it makes")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    build = ["podman", "build", "-q", "--format", "docker", "--ulimit", "nproc=4096:4096",
             "--ulimit", f"nofile={os.sysconf('SC_OPEN_MAX')}:{os.sysconf('SC_OPEN_MAX')}"]
    sh(*build, "-f", str(ROOT / "deploy/container/Containerfile.redis"), "-t",
       f"pet-redis:{VERSION}", str(ROOT / "deploy"), timeout=600)
    values, verify, folders = make_secrets(work)
    podman_secret("pet-gateway-secrets", {k: values[k] for k in
                                          ("redis-password", "registry-admin-password", "admin-token")})
    docs = [d for d in yaml.safe_load_all(Path(args.manifests).read_text()) if d]
    played, left_out = for_podman(docs, verify, folders)
    print(f"left out (podman 4.3 has no such objects): {', '.join(left_out)}")
    play = work / "play.yaml"
    play.write_text(yaml.safe_dump_all(played, sort_keys=False))
    sh("podman", "network", "create", NETWORK, check=False)
    try:
        run(play)
    finally:
        sh("podman", "kube", "down", str(play), check=False)
        # The claims' volumes, and those podman made of the ConfigMaps.
        volumes = [d["metadata"]["name"] for d in yaml.safe_load_all(play.read_text())
                   if d["kind"] in ("PersistentVolumeClaim", "ConfigMap")]
        sh("podman", "volume", "rm", "-f", *volumes, check=False)
        sh("podman", "network", "rm", "-f", NETWORK, check=False)
        sh("podman", "secret", "rm", "pet-gateway-secrets", check=False)
        shutil.rmtree(work / "secrets", ignore_errors=True)


def run(play):
    started = time.monotonic()
    out = sh("podman", "kube", "play", "--network", NETWORK, str(play), timeout=300)
    gateway = "pet-gateway-pod-0-gateway"
    # A gateway that started before its backend's pod name resolved exits and is restarted by
    # podman, with a growing delay: up to a minute or two on this machine.
    deadline = time.monotonic() + 150
    while sh("podman", "exec", gateway, "pet-gateway", "health", "--ready", check=False).returncode:
        if time.monotonic() > deadline:
            logs = sh("podman", "logs", "--tail", "20", gateway, check=False)
            raise SystemExit(f"the gateway pod is not ready within 150 s:\n{logs.stdout}{logs.stderr}")
        time.sleep(0.5)
    pods = sorted(sh("podman", "pod", "ps", "--format", "{{.Name}}").stdout.split())
    took = time.monotonic() - started
    if took > 10:
        restarts = sh("podman", "inspect", gateway, "--format", "{{.RestartCount}}").stdout.strip()
        logs = sh("podman", "logs", gateway, check=False)
        errors = [l for l in (logs.stdout + logs.stderr).splitlines() if "error" in l.lower()]
        print(f"slow start ({took:.1f} s, {restarts} restarts of the gateway); its errors:\n"
              + "\n".join(errors[-5:]))
    print(f"played: pods {', '.join(pods)}; the gateway ready after "
          f"{time.monotonic() - started:.1f} s ({out.stdout.count('Pod:')} pods reported)")
    issued = sh("podman", "exec", gateway, "pet-gateway", "keys", "issue", "--plan", "free",
                "--name", "kube-play").stdout
    key = issued.strip().splitlines()[-1]
    ip = gateway_ip(gateway)
    deadline = time.monotonic() + 5
    while True:
        status, body = get(ip, key)
        if status == 200:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the key issued in the gateway pod got {status}: {body!r}")
        time.sleep(0.1)
    print(f"a key issued in the gateway pod (podman exec): 200 from {ip}:8080 with it")
    check_security(gateway)


def check_security(gateway):
    """What the Deployment asks of the container, as podman made it."""
    # The image is read-write; only the Deployment's securityContext makes it read-only.
    readonly = sh("podman", "inspect", gateway, "--format", "{{.HostConfig.ReadonlyRootfs}}").stdout.strip()
    if readonly != "true":
        raise SystemExit(f"the gateway container's root filesystem is not read-only ({readonly})")
    if sh("podman", "exec", gateway, "/usr/bin/touch", "/etc/pet-gateway/x", check=False).returncode == 0:
        raise SystemExit("the gateway container could write to /etc/pet-gateway")
    if sh("podman", "exec", gateway, "/bin/sleep", "0").returncode != 0:
        raise SystemExit("no /bin/sleep for the preStop wait")
    env = sh("podman", "exec", gateway, "/usr/bin/env").stdout
    if "PET_GATEWAY_ENVIRONMENT=staging" not in env or "PET_GATEWAY_KEY_PREFIX=pet:staging" not in env:
        raise SystemExit("the overlay's environment and key prefix are not in the gateway's variables")
    print("the gateway container: read-only root filesystem, the staging overlay's variables")


if __name__ == "__main__":
    try:
        main()
    except subprocess.TimeoutExpired as t:
        sys.exit(f"timed out: {t}")
