"""A soak: the fleet under steady load while the fault schedule plays, every request recorded,
then judged by `check.py` from the records alone.

    python3 tests/soak/soak.py --minutes 2 --seed 7 [--rate 200] [--out DIR] [--bin-dir DIR]
                               [--plant doubled-limit]

Needs root (the nodes' own users, `nft`, a tmpfs for the spools' disk), redis-server,
redis-sentinel and the built binaries. The run's folder holds every record the checker reads
(setup.json, history.ndjson, events.ndjson, metering/, receiver.ndjson, end.json) and the
logs. `--plant doubled-limit` starts gw3 with the `tight` plan's minute limit doubled: the
checker must fail that run (`test_soak_plant.py`).
"""

import argparse
import hashlib
import hmac
import http.server
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import faults  # noqa: E402
import fleet  # noqa: E402
import load  # noqa: E402

# The soak's plans: (plan file, limits as setup.json states them)
PLANS = {
    "tight": ("requests_per_minute = 30\nrequests_per_day = 5000\nconcurrency = 4\n"
              "[cost]\ncreatePet = 5\n"),
    "daily": "requests_per_minute = 60\nrequests_per_day = 120\nnotify_at = [50, 100]\nconcurrency = 4\n",
    "shared": "requests_per_minute = 40\nrequests_per_day = 5000\nconcurrency = 6\n[cost]\ncreatePet = 5\n",
    "burst": "requests_per_minute = 600\nrequests_per_day = 100000\nconcurrency = 2\n",
    # Above what its keys send (32 a second): they carry a steady load, never paused by a 429.
    "roomy": "requests_per_minute = 3000\nrequests_per_day = 200000\nconcurrency = 20\n",
}
COST = {"tight": {"createPet": 5}, "shared": {"createPet": 5}}
# (name, plan, customer, rate a second, burst, polite): about 200 requests a second in all.
KEYS = ([(f"roomy{i}", "roomy", None, 32.0, 1, True) for i in range(6)]
        + [(f"tight{i}", "tight", None, 1.5, 1, True) for i in range(3)]
        + [("wild", "tight", None, 3.0, 1, False), ("daily", "daily", None, 2.0, 1, True)]
        + [(f"acme{i}", "shared", "acme", 1.0, 1, True) for i in range(3)]
        + [(f"burst{i}", "burst", None, 10.0, 5, True) for i in range(2)]
        + [(f"victim{i}", "roomy", None, 4.0, 1, True) for i in range(4)])
LEASE_SECS = 10
MARGINS = {"fault_before": 1.0, "fault_after": 5.0, "revocation": 1.0, "loss": 2.0,
           "ready_within": 30.0, "kill_notice": 1.0}


def plan_limits(text):
    """The windows of a plan file as setup.json states them (the soak's plans' two forms)."""
    w, concurrency, notify = {}, None, []
    for line in text.splitlines():
        if line.startswith("requests_per_minute"):
            w["60"] = int(line.split("=")[1])
        elif line.startswith("requests_per_day"):
            w["86400"] = int(line.split("=")[1])
        elif line.startswith("concurrency"):
            concurrency = int(line.split("=")[1])
        elif line.startswith("notify_at"):
            notify = json.loads(line.split("=")[1])
    return {"windows": w, "concurrency": concurrency, "notify_at": notify}


class Receiver(http.server.BaseHTTPRequestHandler):
    """The webhook's receiver: checks the `Pet-Signature`, records every event with its time."""

    out, lock, secret = None, threading.Lock(), b""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        fields = [p.split("=", 1) for p in self.headers.get("Pet-Signature", "").split(",") if "=" in p]
        t = dict(fields).get("t", "")
        want = hmac.new(self.secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        if not any(k == "v1" and hmac.compare_digest(want, v) for k, v in fields):
            self.send_response(401)
            self.end_headers()
            return
        now = time.time()
        with self.lock:
            for e in json.loads(body):
                e["received"] = now
                self.out.write(json.dumps(e, separators=(",", ":")) + "\n")
            self.out.flush()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args):
        pass


class Soak:
    def __init__(self, args):
        self.args = args
        self.run_dir = os.path.abspath(args.out)
        self.bin_dir = os.path.abspath(args.bin_dir)
        self.timeline = open(os.path.join(self.run_dir, "events.ndjson"), "a", buffering=1)
        self.tl_lock = threading.Lock()
        self.gateways, self.users, self.keys, self.streams = {}, {}, {}, {}
        self.procs = []
        self.receiver = None
        self.threads = []  # every fault's and key change's, joined before the teardown
        self.player = None
        self.sampling = threading.Event()
        # Key changes are acts, not spans, so they take turns where they share a thing: picking
        # a victim (no two changes take one key), writing the plan file (one `.new` file).
        self.victims_lock, self.plans_lock = threading.Lock(), threading.Lock()

    def event(self, e, quiet=False):
        e.setdefault("t", time.time())
        with self.tl_lock:
            self.timeline.write(json.dumps(e, separators=(",", ":")) + "\n")
        if quiet:
            return
        print(f"  {time.time() - self.t0:7.1f}s {e['kind']} " + " ".join(
            f"{k}={v}" for k, v in e.items() if k not in ("kind", "t")), flush=True)

    # The fleet

    def setup(self):
        run = self.run_dir
        for d in ("logs", "redis", "secrets", "metering", "cli"):
            os.makedirs(os.path.join(run, d), exist_ok=True)
        os.chmod(os.path.join(run, "metering"), 0o1777)
        os.chmod(run, 0o755)
        self.pw = {w: fleet.secret() for w in ("default", "gateway", "admin", "sentinel", "replica",
                                                "peer", "sentinel_gateway", "sentinel_admin")}
        self.files = fleet.write_acl(run, self.pw)
        self.redis = fleet.Redis(run, self.pw)
        p1, p2 = fleet.free_port(), fleet.free_port()
        self.procs.append(self.redis.start_node("a", p1))
        self.procs.append(self.redis.start_node("b", p2, replica_of=p1))
        self.wait_replica_synced("b")
        self.sentinels = [fleet.free_port() for _ in range(3)]
        for port in self.sentinels:
            conf = fleet.sentinel_conf(run, port, p1, self.pw, down_after_ms=2000)
            self.procs.append(fleet.Proc(f"sentinel-{port}", ["redis-sentinel", conf],
                                         os.path.join(run, f"logs/sentinel-{port}.log")).start())
            fleet.wait_port(port)
        self.wait_sentinels_see_replica(p2)
        self.spool_root = os.path.join(run, "spool")
        os.makedirs(self.spool_root, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", self.spool_root],
                       check=True)
        self.backend_port = fleet.free_port()
        self.backend = fleet.Proc("backend", [os.path.join(self.bin_dir, "pet-backend"), "--listen",
                                              f"127.0.0.1:{self.backend_port}", "--db",
                                              os.path.join(run, "backend/pets.db")],
                                  os.path.join(run, "logs/backend.log")).start()
        self.procs.append(self.backend)
        fleet.wait_port(self.backend_port)
        self.start_receiver()
        self.registry_key()

    def wait_replica_synced(self, name, within=20):
        port = self.redis.nodes[name][0]
        deadline = time.time() + within
        while time.time() < deadline:
            try:
                with self.redis.default(port) as r:
                    if b"master_link_status:up" in r.call("INFO", "replication"):
                        return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the replica {name} did not sync within {within} s")

    def wait_sentinels_see_replica(self, replica_port, within=20):
        deadline = time.time() + within
        while time.time() < deadline:
            try:
                got = fleet.resp.call_once(self.sentinels[0], "admin", self.pw["sentinel_admin"],
                                           "SENTINEL", "REPLICAS", fleet.MASTER)
                if str(replica_port).encode() in repr(got).encode():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError("the Sentinels never saw the replica")

    def primary_name(self):
        port = fleet.sentinel_master(self.sentinels[0], self.pw)
        for name, (p, _) in self.redis.nodes.items():
            if p == port:
                return name
        raise RuntimeError(f"the Sentinels name an unknown primary ({port})")

    def wait_writable(self, within=30):
        deadline = time.time() + within
        while time.time() < deadline:
            try:
                port = self.redis.nodes[self.primary_name()][0]
                with self.redis.default(port) as r:
                    r.call("SET", "pet:soak:writable", "1")
                    return
            except Exception:
                time.sleep(0.2)
        raise RuntimeError(f"no writable primary within {within} s")

    def start_receiver(self):
        self.webhook_secret = fleet.secret()
        Receiver.secret = self.webhook_secret.encode()
        Receiver.out = open(os.path.join(self.run_dir, "receiver.ndjson"), "a")
        self.receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
        self.receiver_port = self.receiver.server_address[1]
        threading.Thread(target=self.receiver.serve_forever, daemon=True).start()

    def registry_key(self):
        key = os.path.join(self.run_dir, "secrets/registry-signing.key")
        out = subprocess.run([os.path.join(self.bin_dir, "pet-gateway"), "registry", "keygen",
                              "--out", key], check=True, capture_output=True, text=True).stdout
        self.verify_key = next(w for w in out.split() if w.startswith("ed25519:"))
        self.signing_key = key

    def spec(self):
        nodes = {}
        for i, n in enumerate(fleet.NODES):
            d = os.path.join(self.run_dir, "nodes", n)
            os.makedirs(d, exist_ok=True)
            nodes[n] = {"port": fleet.free_port(), "admin": fleet.free_port(), "dir": d}
        return {"nodes": nodes, "backend_port": self.backend_port, "sentinels": self.sentinels,
                "verify_key": self.verify_key, "lease_secs": LEASE_SECS,
                "receiver_port": self.receiver_port, "spool_root": self.spool_root,
                "admin_token": fleet.secret()}

    def start_nodes(self):
        self.s = self.spec()
        plans_dir = fleet.copy_plans(self.run_dir, {n: t for n, t in PLANS.items()})
        for i, node in enumerate(fleet.NODES, 1):
            user = self.users[node] = fleet.ensure_user(f"petsoak{i}")
            d = self.s["nodes"][node]["dir"]
            fleet.own(d, user, 0o700)
            fleet.write_secret(os.path.join(d, "redis-password"), self.pw["gateway"], user)
            fleet.write_secret(os.path.join(d, "sentinel-password"), self.pw["sentinel_gateway"], user)
            fleet.write_secret(os.path.join(d, "webhook-secret"), self.webhook_secret, user)
            spool = os.path.join(self.spool_root, node)
            os.makedirs(spool, exist_ok=True)
            fleet.own(spool, user, 0o700)
            self.gateways[node] = fleet.Gateway(self.run_dir, node, self.s, self.bin_dir, user)
        if self.args.plant == "doubled-limit":
            self.plant_doubled_limit(plans_dir)
        for g in self.gateways.values():
            g.start()
        for g in self.gateways.values():
            g.wait_ready(60)

    def plant_doubled_limit(self, plans_dir):
        """gw3 alone reads plans where `tight`'s minute limit is twice the fleet's."""
        own = os.path.join(self.run_dir, "plans-gw3")
        shutil.copytree(plans_dir, own)
        with open(os.path.join(own, "tight.toml"), "w") as out:
            out.write(PLANS["tight"].replace("requests_per_minute = 30", "requests_per_minute = 60"))
        g = self.gateways["gw3"]
        text = open(g.config).read().replace(f'plans_dir = "{plans_dir}"', f'plans_dir = "{own}"')
        with open(g.config, "w") as out:
            out.write(text)

    def cli_config(self):
        """The operator's config for `keys` commands: the registry as `admin`, signing key."""
        c = open(self.gateways["gw1"].config).read().splitlines()
        c = [line for line in c if not line.startswith(("keys_file", "audit_log", "metering_file",
                                                        "events_", "redis_password_file",
                                                        "redis_sentinel_password_file", "upgrade_sock",
                                                        "node_id", "listen"))]
        d = os.path.join(self.run_dir, "cli")
        pwf = os.path.join(d, "admin-password")
        spw = os.path.join(d, "sentinel-password")
        for f, v in ((pwf, self.pw["admin"]), (spw, self.pw["sentinel_gateway"])):
            with open(f, "w") as out:
                out.write(v + "\n")
            os.chmod(f, 0o600)
        top = [f'keys_file = "{d}/keys.toml"', f'audit_log = "{d}/audit.log"',
               f'metering_file = "{self.run_dir}/metering/cli"', f'redis_password_file = "{pwf}"',
               f'redis_sentinel_password_file = "{spw}"', 'node_id = "cli"',
               'registry_admin_username = "admin"', f'registry_admin_password_file = "{pwf}"',
               f'registry_signing_key_file = "{self.signing_key}"',
               f'listen = "127.0.0.1:{fleet.free_port()}"']
        ban = c.index("[ban]")
        path = os.path.join(d, "cli.toml")
        with open(path, "w") as out:
            out.write("\n".join(c[:ban] + top + c[ban:]) + "\n")
        self.cli = path

    def keys_cmd(self, *args):
        env = dict(os.environ, PET_GATEWAY_ADMIN_TOKEN=self.s["admin_token"])
        return subprocess.run([os.path.join(self.bin_dir, "pet-gateway"), "keys", *args,
                               "--config", self.cli], capture_output=True, text=True, env=env,
                              timeout=60)

    def issue(self, name, plan, customer=None):
        args = ["issue", "--plan", plan, "--name", name] + (["--customer", customer] if customer else [])
        r = self.keys_cmd(*args)
        if r.returncode != 0:
            raise RuntimeError(f"keys issue {name}: {r.stderr.strip()}")
        token = r.stdout.strip().splitlines()[-1]
        key_id = self.key_id_of(r.stdout + r.stderr)
        quota = f"customer:{customer}" if customer else key_id
        self.keys[key_id] = {"plan": plan, "customer": customer, "quota": quota, "name": name,
                             "token": token}
        return key_id, token

    def wait_known(self, key_ids, within=10.0):
        """Until every node's registry replica has these keys (the load must not start with a
        401 that only says a replica was a poll behind)."""
        deadline = time.time() + within
        for node, g in self.gateways.items():
            for k in key_ids:
                while g.admin_get(f"/keys/{k}")[0] != 200:
                    if time.time() > deadline:
                        raise RuntimeError(f"{node} does not know {k} after {within} s")
                    time.sleep(0.05)

    @staticmethod
    def key_id_of(text):
        for word in text.replace(",", " ").replace("'", " ").replace('"', " ").split():
            if word.startswith("key_") and len(word) == 16:
                return word
        raise RuntimeError(f"no key id in `keys issue`'s output: {text!r}")

    # The run

    def stream(self, key_id, rate, burst, polite, nodes=None):
        k = self.keys[key_id]
        s = load.Stream(key_id, k["token"], k["quota"], rate, burst, COST.get(k["plan"]))
        s.polite, s.nodes = polite, nodes
        self.streams[key_id] = s
        self.load.add(s)
        return s

    def change_keys(self, at, what):
        """One key change or plan edit of the schedule, recorded with the command's exit time."""
        with self.victims_lock:
            rng_pick = sorted(k for k, v in self.keys.items() if v["name"].startswith("victim")
                              and not v.get("gone"))
            if what in ("revoke", "rotate") and not rng_pick:
                # Every victim is gone: a fresh one, issued now, so that no change of the
                # schedule is skipped.
                key_id, _ = self.issue(f"victim{len(self.keys)}", "roomy")
                self.keys[key_id]["late"] = True
                self.event({"kind": "issue", "key": key_id, "plan": "roomy", "customer": None,
                            "quota": key_id})
                self.stream(key_id, 4.0, 1, True)
                self.wait_known([key_id])
                rng_pick = [key_id]
            victim = None
            if what in ("revoke", "rotate"):
                victim = rng_pick[int(at * 10) % len(rng_pick)]
                self.keys[victim]["gone"] = True
        if what == "issue":
            name = f"new{len(self.keys)}"
            key_id, _ = self.issue(name, "tight")
            self.keys[key_id]["late"] = True
            self.event({"kind": "issue", "key": key_id, "plan": "tight", "customer": None,
                        "quota": key_id})
            self.stream(key_id, 1.0, 1, True)
        elif victim:
            if what == "revoke":
                self.revoke(victim)
            else:
                self.rotate(victim)
        elif what in ("plan_raise", "plan_lower"):
            limit = 45 if what == "plan_raise" else 30
            text = PLANS["tight"].replace("requests_per_minute = 30", f"requests_per_minute = {limit}")
            path = os.path.join(self.run_dir, "plans", "tight.toml")
            with self.plans_lock:
                with open(path + ".new", "w") as out:
                    out.write(text)
                os.replace(path + ".new", path)
                self.event({"kind": "plan_edit", "plan": "tight", "window": "60", "limit": limit})

    def revoke(self, victim):
        r = self.keys_cmd("revoke", victim)
        self.event({"kind": "revoke", "key": victim, "rc": r.returncode,
                    "said": (r.stderr.strip().splitlines() or [""])[-1][:200]})
        # The client goes on for 25 s with its revoked key (past a store fault's healing, which
        # delays the revocation on that node): each 2xx then is the checker's.
        self.streams[victim].stop_at = time.time() + 25

    def rotate(self, victim):
        before = time.time()
        r = self.keys_cmd("rotate", victim, "--overlap", "15s")
        if r.returncode != 0:
            raise RuntimeError(f"keys rotate {victim}: {r.stderr.strip()}")
        token = r.stdout.strip().splitlines()[-1]
        successor = next(w for w in self.key_id_candidates(r.stdout + r.stderr) if w != victim)
        old = self.keys[victim]
        self.keys[successor] = {"plan": old["plan"], "customer": None, "quota": old["quota"],
                                "name": old["name"] + "-next", "token": token,
                                "late": True}
        self.event({"kind": "rotate", "key": victim, "successor": successor, "quota": old["quota"],
                    "overlap_until": overlap_end(r.stdout, before + 15)})
        self.stream(successor, 4.0, 1, True)
        self.streams[victim].stop_at = time.time() + 25

    @staticmethod
    def key_id_candidates(text):
        for word in text.replace(",", " ").replace("'", " ").replace('"', " ").split():
            if word.startswith("key_") and len(word) == 16:
                yield word

    def timed(self, plan, act):
        """Runs `act(at, ...)` for each item of `plan` at its time, each in a thread."""
        threads = []
        for item in plan:
            wait = self.t0 + item[0] - time.time()
            if wait > 0:
                time.sleep(wait)
            t = threading.Thread(target=self.guard, args=(act, item), daemon=True)
            t.start()
            threads.append(t)
            self.threads.append(t)
        for t in threads:
            t.join(120)

    def guard(self, act, item):
        try:
            act(*item)
        except Exception as e:
            self.player.errors.append(f"{item}: {type(e).__name__}: {e}")
            print(f"  !! {item}: {type(e).__name__}: {e}", flush=True)

    def play(self):
        secs = self.args.minutes * 60
        sched = faults.schedule(self.args.seed, secs, fleet.NODES, self.args.faults)
        changes = faults.key_changes(self.args.seed, secs)
        print(f"soak: seed {self.args.seed}, {self.args.minutes} min, faults:")
        for at, kind, target, duration in sched:
            print(f"  at {at:6.1f}s {kind} {target or ''} {duration or ''}")
        print("key changes: " + ", ".join(f"{w} at {at}s" for at, w in changes), flush=True)
        self.player = faults.Player(self)
        # The samples' baseline, taken before the first request: a store call that times out
        # in the load's first second is then a counted change, not part of the baseline.
        sample_once(self)
        self.t0 = time.time()
        threading.Thread(target=sample_stores, args=(self,), daemon=True).start()
        self.load.start()
        kt = threading.Thread(target=self.timed, args=(changes, self.change_keys), daemon=True)
        kt.start()
        self.timed([(at, kind, target, d) for at, kind, target, d in sched],
                   lambda at, kind, target, d: self.player.run(kind, target, d, at))
        kt.join(120)
        self.event({"kind": "last_fault_end"})
        last = time.time()
        for node, g in self.gateways.items():
            try:
                self.event({"kind": "ready", "node": node, "after": "last_fault",
                            "t": g.wait_ready(MARGINS["ready_within"] + 30)})
            except RuntimeError as e:
                self.player.errors.append(str(e))
        time.sleep(max(0.0, self.t0 + secs - time.time()))
        self.load_end = time.time()
        self.load.stop()
        return last

    # The end

    def settle(self):
        """Waits until every node wrote the load's last minute and the webhook took every event:
        a minute is written once it ended 10 s ago (docs/src/events.md)."""
        minute_end = (int(self.load_end) // 60 + 1) * 60
        time.sleep(max(0.0, minute_end + 15 - time.time()))
        deadline, quiet = time.time() + 60, 0
        while time.time() < deadline:
            # Two quiet reads in a row, 1.1 s apart, and each read in the order the events
            # travel: the metering file (a round writes it first), the pending gauges, then the
            # spools on disk (a round writes there second; the gauges lag the rounds, so a
            # batch written a moment ago can read as nothing pending; a batch leaves its spool
            # only once the receiver has recorded it and answered).
            # Once every node wrote the last minute and no spool holds a batch, what has not
            # arrived will not (the checker judges whether that loss is a documented one).
            written = self.written_by_all(minute_end - 60)
            pending = sum(pending_events(g.metrics()) for g in self.gateways.values())
            quiet = quiet + 1 if written and pending == 0 and not self.spooled() else 0
            if quiet >= 2:
                return
            time.sleep(1.1)
        print("  !! 60 s after the load's last minute was due, events are still pending, unwritten "
              "or not received (the checker says which)", flush=True)

    def spooled(self):
        """Batches waiting in any node's spool, on disk."""
        return sum(spool_batches(os.path.join(self.spool_root, n)) for n in self.gateways)

    def metering_events(self):
        for name in os.listdir(os.path.join(self.run_dir, "metering")):
            if name.startswith("gw"):
                with open(os.path.join(self.run_dir, "metering", name)) as f:
                    for line in f:
                        if line.strip():
                            yield name[:3], json.loads(line)

    def written_by_all(self, minute):
        """Whether every node wrote usage of the load's last minute (each had traffic in it)."""
        want = time.strftime("%Y-%m-%dT%H:%M:00Z", time.gmtime(minute))
        seen = {node for node, e in self.metering_events()
                if e.get("type") == "pet.usage.v1" and e["data"]["minute"] == want}
        return seen >= set(self.gateways)

    def end_state(self):
        """What Redis holds at the end (each quota's windows, its leases), and the one figure
        taken from the gateways: their store calls that timed out."""
        port = self.redis.nodes[self.primary_name()][0]
        quotas = sorted({k["quota"] for k in self.keys.values()})
        redis, leases = {}, {}
        with self.redis.default(port) as r:
            now = int(r.call("TIME")[0])
            for q in quotas:
                redis[q] = {"windows": decode_windows(r.call("GET", f"{fleet.PREFIX}:windows:{{{q}}}"))}
                leases[q] = decode_leases(r.call("GET", f"{fleet.PREFIX}:leases:{{{q}}}"), now)
        timeouts = {n: metric_sum(g.metrics(), "pet_gateway_store_errors_total", 'kind="timeout"')
                    for n, g in self.gateways.items()}
        spool_left = {n: spool_batches(os.path.join(self.spool_root, n)) for n in self.gateways}
        fleet.dump_json(os.path.join(self.run_dir, "end.json"),
                        {"t": time.time(), "redis": redis, "leases": leases,
                         "store_timeouts": timeouts, "spool_left": spool_left})

    def write_setup(self):
        plans = {n: dict(plan_limits(t), cost=COST.get(n, {})) for n, t in PLANS.items()}
        keys = {k: {"plan": v["plan"], "customer": v["customer"], "quota": v["quota"]}
                for k, v in self.keys.items() if not v.get("late")}
        fleet.dump_json(os.path.join(self.run_dir, "setup.json"), {
            "seed": self.args.seed, "minutes": self.args.minutes, "nodes": fleet.NODES,
            "key_prefix": fleet.PREFIX, "margins": MARGINS, "plans": plans, "keys": keys,
            "rate": self.args.rate, "started": self.t0, "load_end": self.load_end,
            "ended": time.time(), "plant": self.args.plant,
            "fault_errors": self.player.errors, "generator_dropped": self.load.dropped,
            "generator_lag_max": round(self.load.lag_max, 3)})

    def teardown(self):
        """Stops everything the soak started, whatever state it is in: no fault starts a
        process or adds a rule once `stopping` is set, and running ones are waited for."""
        self.sampling.set()
        if self.player:
            self.player.stopping.set()
        for t in self.threads:
            t.join(60)
        for g in self.gateways.values():
            g.stop()
        for p in self.procs:
            p.stop(10)
        for _, (_, p) in (self.redis.nodes.items() if hasattr(self, "redis") else ()):
            p.stop(10)
        if self.receiver:
            self.receiver.shutdown()
        if getattr(self, "spool_root", None) and os.path.ismount(self.spool_root):
            if subprocess.run(["umount", self.spool_root], check=False).returncode != 0:
                subprocess.run(["umount", "--lazy", self.spool_root], check=False)
        drop_partitions()


def overlap_end(text, guess):
    """The old key's end as `keys rotate` printed it ("… works until <RFC 3339>")."""
    import datetime
    for line in text.splitlines():
        if " works until " in line:
            stamp = line.split(" works until ", 1)[1].split(";")[0].strip()
            try:
                return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            except ValueError:
                break
    raise RuntimeError(f"`keys rotate` did not say when the old key ends (about {guess}): {text!r}")


def drop_partitions():
    """Deletes the soak's nft tables, this run's or a killed run's."""
    for i in range(len(fleet.NODES)):
        subprocess.run(["nft", "delete", "table", "inet", f"petsoak_gw{i + 1}"],
                       stderr=subprocess.DEVNULL, check=False)


def sample_stores(soak):
    """Once a second, each node's store errors, timeouts, fallback gauge and decisions made
    without the store from its metrics, to events.ndjson: the checker's allowances come from
    what the gateway counted (a store call can time out with no fault injected), never from a
    guess."""
    while not soak.sampling.wait(1.0):
        sample_once(soak)


def sample_once(soak):
    for node, g in soak.gateways.items():
        text = g.metrics()
        if not text:
            continue  # down (killed) or not answering: the records say so elsewhere
        soak.event({"kind": "store_sample", "node": node,
                    "errors": metric_sum(text, "pet_gateway_store_errors_total", ""),
                    "timeouts": metric_sum(text, "pet_gateway_store_errors_total",
                                           'kind="timeout"'),
                    "fallback": metric_sum(text, "pet_gateway_store_fallback ", ""),
                    # None, not 0, from a build that does not count them: the checker then
                    # keeps the old bound.
                    "local": (metric_sum(text, "pet_gateway_store_local_decisions_total", "")
                              if "pet_gateway_store_local_decisions_total" in text else None)},
                   quiet=True)


def spool_batches(path):
    """A spool's batches: `tmp-` files are a batch being written, not one to deliver (one a
    killed process left is removed by the next after an hour), as the gateway reads it."""
    return len([f for f in os.listdir(path) if f.endswith(".events") and not f.startswith("tmp-")])


def pending_events(metrics):
    return metric_sum(metrics, "pet_gateway_events_pending", "")


def metric_sum(text, name, having):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and having in line and not line.startswith("#"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return int(total)


def decode_windows(v):
    """`<prefix>:windows:{id}`: nine u32 fields, then (length, instance, count) per window
    (proxy/src/quota/store/scripts.rs)."""
    if not v or len(v) < 36 or (len(v) - 36) % 12:
        return {}
    f = struct.unpack("<" + "I" * (len(v) // 4), v)
    return {str(f[i]): [f[i + 1], f[i + 2]] for i in range(9, len(f), 3)}


def decode_leases(v, now):
    """`<prefix>:leases:{id}`: (end, count) pairs; those ending after `now` are held."""
    if not v or len(v) % 8:
        return 0
    f = struct.unpack("<" + "I" * (len(v) // 4), v)
    return sum(c for e, c in zip(f[0::2], f[1::2]) if e > now)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rate", type=float, default=200, help="requests a second in all (about)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bin-dir", default=os.path.join(fleet.ROOT, "target/release"))
    ap.add_argument("--plant", choices=["doubled-limit"], default=None)
    ap.add_argument("--faults", default="all",
                    help="all, none (the load and the key changes alone: the planted run's "
                         "baseline), or kinds separated by commas (each once, a drill)")
    args = ap.parse_args()
    # A SIGTERM (a CI timeout, an operator's kill) still tears the fleet down: the nodes run in
    # sessions of their own and would outlive the soak.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out = args.out or os.path.join(fleet.ROOT, f"target/soak/seed-{args.seed}-{int(time.time())}")
    if os.path.exists(args.out):
        sys.exit(f"soak: {args.out} exists; give another --out")
    os.makedirs(args.out)
    soak = Soak(args)
    soak.t0 = time.time()
    try:
        run(soak)
    finally:
        soak.teardown()
    import check
    report = check.check(args.out)
    print(report.text(), flush=True)
    errors = soak.player.errors
    if errors:
        print("soak: faults that could not be played:\n  " + "\n  ".join(errors))
    sys.exit(0 if report.ok and not errors else 1)


def run(soak):
    drop_partitions()
    soak.setup()
    soak.start_nodes()
    soak.cli_config()
    scale = soak.args.rate / 200.0
    for name, plan, customer, rate, burst, polite in KEYS:
        soak.issue(name, plan, customer)
    soak.wait_known(list(soak.keys))
    nodes = {n: soak.s["nodes"][n]["port"] for n in fleet.NODES}
    soak.load = load.Load(nodes, load.History(os.path.join(soak.run_dir, "history.ndjson")),
                          soak.args.seed)
    for (name, plan, customer, rate, burst, polite), key_id in zip(KEYS, list(soak.keys)):
        soak.stream(key_id, rate * scale, burst, polite)
    if soak.args.plant == "doubled-limit":
        # A client that talks to gw3 alone and ignores its 429s: gw3 admits it up to its own
        # (doubled) limit whatever the other nodes say, which the checker must see.
        key_id, _ = soak.issue("plant", "tight")
        soak.wait_known([key_id])
        soak.stream(key_id, 1.5, 1, False, nodes=["gw3"])
    soak.t0 = time.time()
    soak.play()
    soak.settle()
    soak.end_state()
    soak.write_setup()


if __name__ == "__main__":
    main()
