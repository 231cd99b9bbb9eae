"""The soak's fleet on this machine, all on loopback: Redis (a primary and a replica, with the
shipped redis.conf and ACL users), three Sentinels (the shipped sentinel.conf), the backend, three
gateway nodes on the Sentinels with the signed key registry, and the soak's webhook receiver.

Each gateway runs under a user of its own (`petsoak1`..`petsoak3`), so that one can be cut off
from Redis alone: an `nft` rule drops that user's packets to the Redis and Sentinel ports
(`faults.partition`). Nodes follow the address the Sentinels give, so a proxy in front of one
Redis would be bypassed; a rule on the sending user is not.
"""

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import resp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MASTER = "pet-redis"
PREFIX = "pet:soak"
NODES = ["gw1", "gw2", "gw3"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, within=15.0):
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {within} s")


def secret(n=24):
    return os.urandom(n).hex()


def ensure_user(name):
    """The node's own user (made once; a system user without a home or shell)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True)
        return pwd.getpwnam(name)


class Proc:
    """A process with its log file; `stop` ends it (SIGTERM, then SIGKILL after `grace`)."""

    def __init__(self, name, argv, log, user=None, env=None, cwd=None):
        self.name, self.argv, self.log, self.user, self.env, self.cwd = name, argv, log, user, env, cwd
        self.p = None

    def start(self):
        out = open(self.log, "ab")
        kw = {}
        if self.user is not None:
            kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        self.p = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                  start_new_session=True, **kw)
        out.close()
        return self

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def kill(self):
        if self.alive():
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def stop(self, grace=25.0):
        if not self.alive():
            return
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()


class Redis:
    """The data nodes' shared settings: the shipped redis.conf, the ACL file, passwords."""

    def __init__(self, run, passwords):
        self.run, self.pw = run, passwords
        self.nodes = {}  # name -> (port, Proc)

    def start_node(self, name, port, replica_of=None):
        d = os.path.join(self.run, "redis", name)
        os.makedirs(d, exist_ok=True)
        # A copy of the shipped file: Sentinel has each node rewrite its config (CONFIG REWRITE)
        # when it changes roles.
        conf = os.path.join(d, "redis.conf")
        if not os.path.exists(conf):
            shutil.copyfile(os.path.join(ROOT, "deploy/redis/redis.conf"), conf)
            # The replication password in the file, not on the command line (`ps` shows that).
            with open(conf, "a") as out:
                out.write(f"\nmasteruser replica\nmasterauth {self.pw['replica']}\n")
            os.chmod(conf, 0o600)
        argv = ["redis-server", conf,
                "--port", str(port), "--dir", d, "--aclfile", os.path.join(self.run, "redis/users.acl"),
                "--daemonize", "no", "--logfile", "", "--repl-diskless-sync-delay", "0"]
        if replica_of:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        proc = Proc(f"redis-{name}", argv, os.path.join(self.run, f"logs/redis-{name}.log")).start()
        self.nodes[name] = (port, proc)
        wait_port(port)
        return proc

    def admin(self, port, timeout=2.0):
        return resp.Redis(port, "admin", self.pw["admin"], timeout=timeout)

    def default(self, port, timeout=2.0):
        return resp.Redis(port, "default", self.pw["default"], timeout=timeout)


def write_acl(run, pw):
    """users.acl from the shipped deploy/redis/acl-users, the passwords in files of the run's."""
    files = {}
    for who in ("default", "gateway", "admin", "sentinel", "replica"):
        f = os.path.join(run, "secrets", f"redis-{who}")
        with open(f, "w") as out:
            out.write(pw[who] + "\n")
        os.chmod(f, 0o600)
        files[who] = f
    acl = subprocess.run([os.path.join(ROOT, "deploy/redis/acl-users"), "--prefix", PREFIX,
                          "--default-password-file", files["default"],
                          "--gateway-password-file", files["gateway"],
                          "--admin-password-file", files["admin"],
                          "--sentinel-password-file", files["sentinel"],
                          "--replica-password-file", files["replica"]],
                         check=True, capture_output=True, text=True).stdout
    with open(os.path.join(run, "redis/users.acl"), "w") as out:
        out.write(acl)
    return files


def sentinel_conf(run, port, primary_port, pw, down_after_ms):
    """The shipped sentinel.conf with this run's ports, folder and passwords."""
    text = open(os.path.join(ROOT, "deploy/redis/sentinel.conf")).read()
    d = os.path.join(run, "redis", f"sentinel-{port}")
    os.makedirs(d, exist_ok=True)
    swaps = [("port 26379", f"port {port}"), ("bind 0.0.0.0", "bind 127.0.0.1"),
             ("dir /var/lib/redis", f"dir {d}"),
             (f"sentinel monitor {MASTER} 10.0.0.11 6379 2", f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2"),
             (f"sentinel down-after-milliseconds {MASTER} 5000", f"sentinel down-after-milliseconds {MASTER} {down_after_ms}"),
             (f"sentinel failover-timeout {MASTER} 60000", f"sentinel failover-timeout {MASTER} 10000"),
             ("CHANGE-ME-sentinel-data", pw["sentinel"]), ("CHANGE-ME-peer", pw["peer"]),
             ("CHANGE-ME-gateway", pw["sentinel_gateway"]), ("CHANGE-ME-admin", pw["sentinel_admin"])]
    for old, new in swaps:
        if old not in text:
            raise RuntimeError(f"deploy/redis/sentinel.conf no longer holds {old!r}")
        text = text.replace(old, new)
    path = os.path.join(d, "sentinel.conf")
    with open(path, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)  # every Sentinel password is in it
    return path


def sentinel_master(port, pw):
    """The primary the Sentinel on `port` names now, as a port (None when it cannot say)."""
    try:
        got = resp.call_once(port, "admin", pw["sentinel_admin"], "SENTINEL",
                             "GET-MASTER-ADDR-BY-NAME", MASTER, timeout=1.0)
        return int(got[1]) if got else None
    except (resp.RedisError, OSError, TypeError, ValueError):
        return None


def http_get(url, headers=None, timeout=2.0):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


def gateway_config(run, node, spec):
    """A node's config: its ports, its folders, the Sentinels, the registry, events."""
    n = spec["nodes"][node]
    lines = [
        'environment = "soak"', f'node_id = "{node}"', "threads = 1",
        f'listen = "127.0.0.1:{n["port"]}"', f'admin_listen = "127.0.0.1:{n["admin"]}"',
        f'upstreams = ["127.0.0.1:{spec["backend_port"]}"]',
        f'redis_url = "redis+sentinel://{",".join("127.0.0.1:%d" % p for p in spec["sentinels"])}/{MASTER}"',
        'redis_username = "gateway"', f'redis_password_file = "{n["dir"]}/redis-password"',
        'redis_sentinel_username = "gateway"', f'redis_sentinel_password_file = "{n["dir"]}/sentinel-password"',
        f'key_prefix = "{PREFIX}"', 'keys_source = "store"', f'keys_file = "{n["dir"]}/keys.toml"',
        f'plans_dir = "{run}/plans"', f'audit_log = "{n["dir"]}/audit.log"',
        f'registry_verify_keys = ["{spec["verify_key"]}"]',
        'on_store_error = "local"', "store_timeout_ms = 50",
        f'concurrency_lease_secs = {spec["lease_secs"]}',
        f'upgrade_sock = "{n["dir"]}/upgrade.sock"',
        f'metering_file = "{run}/metering/{node}"',
        f'events_webhook_url = "http://127.0.0.1:{spec["receiver_port"]}/events"',
        f'events_webhook_secret_file = "{n["dir"]}/webhook-secret"',
        f'events_spool_dir = "{spec["spool_root"]}/{node}"',
        "upstream_read_timeout_ms = 5000", "upstream_connect_timeout_ms = 500",
        "grace_period_secs = 1", "shutdown_timeout_secs = 10",
        "[ban]", "strikes = 10", "durations_secs = [20, 40]", "decay_secs = 600",
    ]
    path = os.path.join(n["dir"], "gateway.toml")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")
    return path


class Gateway:
    """One node: its process (or processes during an upgrade), under its own user."""

    def __init__(self, run, node, spec, bin_dir, user):
        self.run, self.node, self.spec, self.user = run, node, spec, user
        self.n = spec["nodes"][node]
        self.bin = os.path.join(bin_dir, "pet-gateway")
        self.config = gateway_config(run, node, spec)
        self.env = dict(os.environ, PET_GATEWAY_ADMIN_TOKEN=spec["admin_token"], RUST_LOG="warn")
        self.proc = None
        self.old = []

    def _proc(self, extra=()):
        return Proc(self.node, [self.bin, "serve", "--config", self.config, *extra],
                    os.path.join(self.run, f"logs/{self.node}.log"), user=self.user, env=self.env)

    def start(self):
        self.proc = self._proc().start()
        return self

    def upgrade(self):
        """`serve --upgrade`: the new process takes the sockets, then the old one gets SIGQUIT."""
        new = self._proc(["--upgrade"]).start()
        time.sleep(1.0)
        if not new.alive():
            raise RuntimeError(f"{self.node}: serve --upgrade exited ({new.p.returncode})")
        self.proc.p.send_signal(signal.SIGQUIT)
        self.old.append(self.proc)
        self.proc = new

    def kill(self):
        self.proc.kill()

    def ready(self):
        status, _ = http_get(f"http://127.0.0.1:{self.n['admin']}/readyz",
                             {"Authorization": f"Bearer {self.spec['admin_token']}"}, timeout=1.0)
        return status == 200

    def wait_ready(self, within=30.0):
        deadline = time.time() + within
        while time.time() < deadline:
            if self.ready():
                return time.time()
            time.sleep(0.1)
        raise RuntimeError(f"{self.node} not ready within {within} s (logs/{self.node}.log)")

    def admin_get(self, path, timeout=2.0):
        return http_get(f"http://127.0.0.1:{self.n['admin']}{path}",
                        {"Authorization": f"Bearer {self.spec['admin_token']}"}, timeout=timeout)

    def metrics(self):
        status, body = self.admin_get("/metrics")
        return body.decode(errors="replace") if status == 200 else ""

    def stop(self):
        for p in self.old + [self.proc]:
            if p:
                p.stop()


def own(path, user, mode):
    os.chown(path, user.pw_uid, user.pw_gid)
    os.chmod(path, mode)


def write_secret(path, value, user):
    with open(path, "w") as out:
        out.write(value + "\n")
    own(path, user, 0o600)


def copy_plans(run, plans):
    d = os.path.join(run, "plans")
    os.makedirs(d, exist_ok=True)
    for name, text in plans.items():
        with open(os.path.join(d, f"{name}.toml"), "w") as out:
            out.write(text)
    os.chmod(d, 0o755)
    return d


def cleanup_dir(path):
    shutil.rmtree(path, ignore_errors=True)


def dump_json(path, value):
    with open(path, "w") as out:
        json.dump(value, out, indent=1, sort_keys=True)
