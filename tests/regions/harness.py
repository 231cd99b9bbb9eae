"""Regions on one machine (issue 48): three regions of two gateway nodes each, the backend reached
from every region without delay (so the latency measured is the gateway's), and between regions a
delay (`--delay-ms`, each way) made by a delaying TCP proxy (`delay.py`; this kernel has no
`netem`). A load generator of its own records every request (region, node, key, status, headers,
send and receive time) to `history.ndjson`, then the run is judged per window from those records.
Each region's clients run in a process of their own, and each region's delaying proxies in
another (`delay.Group`): Python threads share one interpreter lock, and a latency measured in
region a must not grow with the work of the other regions' clients or of the proxies.

The set-ups it runs (`--setup`, several in one run, side by side):

- `single`: one region alone (region a's nodes on its Redis, no delay): the latency reference;
- `one-redis`: today's first way, every region on region a's Redis, b and c through the delay;
- `redis-per-region`: today's second way, each region on its own Redis, counting alone;
- `leased`: regions (`region`, `global_store_url`): each region decides in its own Redis, out of
  units the global store grants it ahead of use. The global store lives in region a: a primary
  and a replica (`appendfsync always`) behind three Sentinels, the nodes on
  `redis+sentinel://` with `global_store_replicas = 1`.

Nodes follow the addresses the Sentinels give, so the delay must sit on every path those
addresses take: region b's and c's nodes run as users of their own (`petregions-b`,
`petregions-c`), and an `nft` table (`inet petregions_<pid>`) redirects each such user's connections to
every port of the global store (data nodes and Sentinels) to a delaying proxy of that region's
(region a's nodes, root, reach it directly). Cutting a region's proxies is its partition.

With `--faults`, the `leased` set-up runs under a fault schedule (`FAULTS`, seconds from the
load's start): region c cut off from the global store for 40 s, region b's Redis killed and
started again empty, the global store's primary killed (the Sentinels fail over to the replica;
the old primary comes back as a replica 20 s later), a node of region a killed and started
again, and from then on `acme`'s traffic moved from region a to regions b and c (a sends no
more). The figures are judged through them, minute by minute.

The load: `acme`, the biggest customer, one key spread unevenly over the regions at about twice
its plan's minute limit (its windows show the over-admission), and in each region a key well
below its limits (its requests show the latency). Every loop is bounded in count and time; the
run stops by itself.

    scripts/regions [--setup single,one-redis,redis-per-region,leased] [--minutes M]
                    [--delay-ms D] [--faults]
                    [--bin-dir DIR] [--out DIR]
"""

import argparse
import datetime
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "soak"))
import delay  # noqa: E402
import fleet  # noqa: E402

ROOT = fleet.ROOT
REGIONS = ["a", "b", "c"]
ADMIN_TOKEN = "Regions-harness-admin-token-0123456789"
# acme's share of its requests by region (uneven), and its rate against its minute limit.
ACME_SHARE = {"a": 0.5, "b": 0.3, "c": 0.2}
ACME_PER_MINUTE = 60
ACME_LOAD = 2.0
SMALL_RATE = 2.0  # each region's small key, requests a second (far below its limits)
PLANS = {
    "acme": "requests_per_minute = 60\nrequests_per_day = 100000\n",
    "small": "requests_per_minute = 10000\nrequests_per_day = 1000000\n",
}
TIMEOUT = 5.0
# The fault schedule (`--faults`, the `leased` set-up): seconds from the load's start.
FAULTS = [(30, "cut c"), (70, "heal c"), (85, "restart redis b"), (95, "failover global"),
          (110, "kill a2"), (115, "start global"), (120, "start a2"), (130, "move acme")]
MASTER = "pet-global"
# The nft table of this run (another run's is left alone); one left by a run that died is
# deleted by the next run's start.
NFT_TABLE = f"petregions_{os.getpid()}"
FAR_USERS = {"b": "petregions-b", "c": "petregions-c"}
# acme's shares once its traffic moved (from a to c).
ACME_MOVED = {"a": 0.0, "b": 0.3, "c": 0.7}


class Fleet:
    """One set-up's processes: Redis servers, delaying proxies, the backend, six nodes."""

    def __init__(self, run, setup, bin_dir, delay_ms):
        self.run, self.setup, self.bin_dir, self.delay_ms = run, setup, bin_dir, delay_ms
        self.procs, self.proxies, self.nodes = [], [], {}
        self.ids = {}
        # For the faults: each region's path to the global store (its delaying proxies' group).
        self.global_paths = {}
        # The global store: its data nodes' processes by port, the Sentinels' ports, the
        # primary killed by the failover fault.
        self.global_data, self.sentinels, self.killed_primary = {}, [], None
        # What the soak with regions (tests/regions/soak.py) changes: its fault schedule, its
        # ban policy (the harness's keeps acme from being banned), the plans of one region (a
        # planted violation).
        self.faults, self.ban = FAULTS, ["[ban]", "strikes = 1000000"]
        self.region_plans = {}
        # Keys the run issues while it runs (the soak's registry steps): their names and rate a
        # second in every region; each one's token is written to `tokens_dir` once issued.
        self.issued_later, self.tokens_dir = [], os.path.join(run, "tokens")
        self.revoked_at = {}
        # A token left by an earlier run in this folder would be sent as this run's.
        shutil.rmtree(self.tokens_dir, ignore_errors=True)
        # The soak's registry steps: keys in the key registry, which lives in the global store
        # (`keys_source = "store"`), rather than in a keys file every node copies.
        self.registry = False
        # Set when acme's traffic moves (`move acme`): read by every region's load process.
        self.moved = None
        for d in ("logs", "plans", "nodes", "tokens"):
            os.makedirs(os.path.join(run, d), exist_ok=True)

    def start(self):
        regions = REGIONS[:1] if self.setup == "single" else REGIONS
        own = self.setup in ("redis-per-region", "leased")
        redis = {r: self.redis(r) for r in (regions if own else ["a"])}
        # The global store lives in region a; b and c reach it across the delay.
        far = self.global_sentinel() if self.setup == "leased" else None
        backend = self.backend()
        fleet.copy_plans(self.run, PLANS)
        for r, plans in self.region_plans.items():
            fleet.copy_plans(os.path.join(self.run, f"region-{r}"), plans)
        keys = os.path.join(self.run, "keys.toml")
        for r in regions:
            # A region reaches region a's Redis across the delay; its own (or a's, from a) at once.
            port = redis.get(r) or self.delayed(redis["a"])
            for i in (1, 2):
                self.nodes[f"{r}{i}"] = self.node(f"{r}{i}", r, port, backend, keys, far)
        self.tokens = self.issue(keys)
        for name, n in self.nodes.items():
            if not self.registry:
                shutil.copy(keys, n["keys"])
            user = self.far_user(n["region"]) if far else None
            if user:
                node_dir = os.path.dirname(n["keys"])
                for path in (node_dir, os.path.join(node_dir, "metering"), n["keys"], n["config"]):
                    if os.path.exists(path):
                        os.chown(path, user.pw_uid, user.pw_gid)
            n["proc"] = fleet.Proc(name, [os.path.join(self.bin_dir, "pet-gateway"), "serve",
                                          "--config", n["config"]],
                                   os.path.join(self.run, f"logs/{name}.log"), user=user,
                                   env=dict(os.environ, PET_GATEWAY_ADMIN_TOKEN=ADMIN_TOKEN,
                                            RUST_LOG="warn")).start()
            self.procs.append(n["proc"])
        for n in self.nodes.values():
            fleet.wait_port(n["port"], within=60)
        return self

    def redis(self, region, durable=False, primary=None):
        port = fleet.free_port()
        # The global store as the book's chapter on regions lays it out: every write on disk
        # before it is answered.
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if durable else [
            "--appendonly", "no"]
        d = os.path.join(self.run, f"redis-{region}")
        os.makedirs(d, exist_ok=True)
        self.procs.append(fleet.Proc(f"redis-{region}", [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""] + persist +
            ["--dir", d] + (["--replicaof", "127.0.0.1", str(primary)] if primary else []),
            os.path.join(self.run, f"logs/redis-{region}.log")).start())
        fleet.wait_port(port)
        return port

    def global_sentinel(self):
        """The global store in region a: a primary, a replica, three Sentinels; the paths of
        regions b and c to each of their ports delayed (`nft` redirects their nodes' users).
        Returns the nodes' `global_store_url`."""
        primary = self.redis("global-1", durable=True)
        self.global_data[primary] = self.procs[-1]
        replica = self.redis("global-2", durable=True, primary=primary)
        self.global_data[replica] = self.procs[-1]
        self.sentinels = [self.sentinel(i, primary) for i in (1, 2, 3)]
        drop_nft()
        nft(f"add table inet {NFT_TABLE}")
        nft(f"add chain inet {NFT_TABLE} out {{ type nat hook output priority -100 ; }}")
        for r, name in FAR_USERS.items():
            uid = fleet.ensure_user(name).pw_uid
            ports = [primary, replica] + self.sentinels
            group = delay.Group(ports, self.delay_ms)
            self.proxies.append(group)
            self.global_paths[r] = group
            for port, via in zip(ports, group.ports):
                nft(f"add rule inet {NFT_TABLE} out meta skuid {uid} tcp dport {port} "
                    f"redirect to :{via}")
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER}"

    def sentinel(self, i, primary):
        port = fleet.free_port()
        d = os.path.join(self.run, f"sentinel-{i}")
        os.makedirs(d, exist_ok=True)
        conf = os.path.join(d, "sentinel.conf")
        with open(conf, "w") as out:
            out.write(f"port {port}\nbind 127.0.0.1\ndir {d}\n"
                      f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                      f"sentinel down-after-milliseconds {MASTER} 2000\n"
                      f"sentinel failover-timeout {MASTER} 10000\n")
        self.procs.append(fleet.Proc(f"sentinel-{i}", ["redis-sentinel", conf],
                                     os.path.join(self.run, f"logs/sentinel-{i}.log")).start())
        fleet.wait_port(port)
        return port

    def global_primary(self):
        """The global store's primary port, as the Sentinels say."""
        for s in self.sentinels:
            r = subprocess.run(["redis-cli", "-p", str(s), "SENTINEL", "get-master-addr-by-name",
                                MASTER], capture_output=True, text=True)
            lines = r.stdout.split()
            if r.returncode == 0 and len(lines) == 2:
                return int(lines[1])
        raise RuntimeError("no Sentinel names the global store's primary")

    @staticmethod
    def far_user(region):
        name = FAR_USERS.get(region)
        return fleet.ensure_user(name) if name else None

    def delayed(self, port):
        group = delay.Group([port], self.delay_ms)
        self.proxies.append(group)
        return group.ports[0]

    def backend(self):
        port = fleet.free_port()
        self.procs.append(fleet.Proc("backend", [
            os.path.join(self.bin_dir, "pet-backend"), "--listen", f"127.0.0.1:{port}",
            "--db", os.path.join(self.run, "pets.db")],
            os.path.join(self.run, "logs/backend.log")).start())
        fleet.wait_port(port)
        return port

    def node(self, name, region, redis_port, backend, keys, global_url=None):
        d = os.path.join(self.run, "nodes", name)
        os.makedirs(d, exist_ok=True)
        os.makedirs(os.path.join(d, "metering"), exist_ok=True)
        n = {"region": region, "port": fleet.free_port(), "admin": fleet.free_port(),
             "keys": os.path.join(d, "keys.toml"), "config": os.path.join(d, "gateway.toml")}
        # Across regions a decision waits a round trip of the delay: a deadline of 50 ms would
        # send every far decision to on_store_error, which is not today's set-up either.
        timeout = 50 if global_url else int(max(50, 5 * self.delay_ms))
        lines = [
            'environment = "regions"', f'node_id = "{name}"', "threads = 1",
            f'listen = "127.0.0.1:{n["port"]}"', f'admin_listen = "127.0.0.1:{n["admin"]}"',
            f'upstreams = ["127.0.0.1:{backend}"]', f'redis_url = "redis://127.0.0.1:{redis_port}/"',
            'key_prefix = "pet:regions"', f'keys_file = "{n["keys"]}"',
            f'metering_file = "{d}/metering/{name}"',
            f'plans_dir = "{self.plans_dir(region)}"', f"store_timeout_ms = {timeout}",
            "grace_period_secs = 1", "shutdown_timeout_secs = 2",
        ]
        if global_url:
            lines += [f'region = "{region}"', 'on_store_error = "closed"',
                      f'global_store_url = "{global_url}"', "global_store_replicas = 1"]
            if self.registry:
                lines.append('keys_source = "store"')
        else:
            lines.append('on_store_error = "local"')
        # acme sends twice its limit on purpose: its refusals must not ban it, or the minutes
        # after a ban would say nothing of what the set-up admits (bans per region: the book).
        lines += self.ban
        with open(n["config"], "w") as out:
            out.write("\n".join(lines) + "\n")
        return n

    def plans_dir(self, region):
        if region in self.region_plans:
            return os.path.join(self.run, f"region-{region}", "plans")
        return os.path.join(self.run, "plans")

    def issue(self, keys):
        """acme's key and a small key per region, in the keys file every node copies."""
        # A node's config with the shared keys file (a node's own is a copy of it).
        config = os.path.join(self.run, "issue.toml")
        with open(next(iter(self.nodes.values()))["config"]) as f:
            text = f.read()
        with open(config, "w") as out:
            out.write("\n".join(f'keys_file = "{keys}"' if line.startswith("keys_file") else line
                                for line in text.splitlines()) + "\n")
        tokens, self.ids = {}, {}
        for name, plan in [("acme", "acme")] + [(f"small-{r}", "small") for r in REGIONS]:
            r = subprocess.run(
                [os.path.join(self.bin_dir, "pet-gateway"), "keys", "issue", "--plan", plan,
                 "--name", name, "--config", config], capture_output=True, text=True, check=True)
            self.ids[name], tokens[name] = issued(r.stdout)
        return tokens

    def registry_step(self, verb, name, region):
        """`keys issue` (plan small) or `keys revoke` of the key `name` in `region`, run as that
        region's nodes run (its first node's config and user: a cut region reaches the global
        store only once healed), tried again for up to 60 s (a cut, a failover); an issued key's
        token goes to `tokens_dir` for the clients. The change is in the registry when this
        returns: its record is dated then, with when the first attempt began (`from`: the
        change may be in force from then) and the attempts it took."""
        n = self.nodes[f"{region}1"]
        args = (["issue", "--plan", "small", "--name", name] if verb == "issue"
                else ["revoke", self.ids[name]])
        argv = [os.path.join(self.bin_dir, "pet-gateway"), "keys", *args, "--config", n["config"]]
        began = time.time()
        deadline, attempts = began + 60, 0
        while True:
            attempts += 1
            try:
                r = run_as(self.far_user(region), argv, timeout=20)
                if r.returncode == 0:
                    break
                why = r.stderr.strip()
            except subprocess.TimeoutExpired:
                why = "no answer within 20 s"
            if time.time() > deadline:
                raise RuntimeError(f"keys {verb} {name} in region {region}: {why}")
            time.sleep(0.5)
        if verb == "issue":
            self.ids[name], token = issued(r.stdout)
            path = os.path.join(self.tokens_dir, name)
            with open(path + ".new", "w") as f:
                f.write(token)
            os.replace(path + ".new", path)
        else:
            self.revoked_at[name] = time.time()
        return {"attempts": attempts, "from": began}

    def global_calls(self):
        """Per key name, the global store's calls its regions made (`leased` only), read from
        the ledger itself (`ledger.rs`): each grant call counts itself in `n:<region>` of the
        first instance it named, each give-back leaves its id on every instance it named."""
        if not self.sentinels:
            return {}
        cli = ["redis-cli", "-p", str(self.global_primary())]
        keys = subprocess.run(cli + ["--scan", "--pattern", "pet:regions:grants:*"],
                              capture_output=True, text=True, check=True).stdout.split()
        calls = {}
        for key in keys:
            quota = key.split("{", 1)[1].split("}", 1)[0]
            fields = subprocess.run(cli + ["HKEYS", key], capture_output=True, text=True,
                                    check=True).stdout.split()
            entry = calls.setdefault(quota, [0, set()])
            entry[1].update(f for f in fields if f.startswith("b:"))
            for f in fields:
                if f.startswith("n:"):
                    entry[0] += int(subprocess.run(
                        cli + ["HGET", key, f], capture_output=True, text=True,
                        check=True).stdout.strip() or 0)
        by_id = {v: k for k, v in self.ids.items()}
        return {by_id.get(q, q): n + len(gives) for q, (n, gives) in calls.items()}

    def metered(self):
        """Per (key name, minute), the units every node's metering file says it admitted."""
        by_id = {v: k for k, v in self.ids.items()}
        out = {}
        for name in self.nodes:
            folder = os.path.join(self.run, "nodes", name, "metering")
            for file in sorted(os.listdir(folder)):
                with open(os.path.join(folder, file)) as f:
                    for line in f:
                        ev = json.loads(line)
                        if ev.get("type") != "pet.usage.v1":
                            continue
                        d = ev["data"]
                        minute = int(datetime.datetime.fromisoformat(
                            d["minute"].replace("Z", "+00:00")).timestamp()) // 60
                        k = (by_id.get(d["key_id"], d["key_id"]), minute)
                        out[k] = out.get(k, 0) + int(d["cost"])
        return out

    def fault(self, what):
        """One step of `FAULTS`."""
        verb, _, target = what.partition(" ")
        if verb == "cut":
            self.global_paths[target].cut()
        elif verb == "heal":
            self.global_paths[target].heal()
        elif verb == "failover":
            # The primary killed: the Sentinels promote the replica.
            port = self.global_primary()
            self.killed_primary = self.global_data[port]
            self.killed_primary.kill()
        elif what == "start global":
            # Back on its port with its AOF: the Sentinels make it the new primary's replica.
            old = self.killed_primary
            fresh = fleet.Proc(old.name, old.argv, old.log).start()
            self.procs[self.procs.index(old)] = fresh
            self.global_data = {p: fresh if proc is old else proc
                                for p, proc in self.global_data.items()}
        elif verb == "restart":
            # Killed, and started again on its port with nothing: every count and unit it held
            # is gone.
            old = next(p for p in self.procs if p.name == target.replace(" ", "-"))
            old.kill()
            fresh = fleet.Proc(old.name, old.argv, old.log).start()
            self.procs[self.procs.index(old)] = fresh
        elif verb == "kill":
            self.nodes[target]["proc"].kill()
        elif verb == "start":
            n = self.nodes[target]
            n["proc"] = fleet.Proc(target, n["proc"].argv, n["proc"].log, user=n["proc"].user,
                                   env=n["proc"].env).start()
            self.procs.append(n["proc"])
        elif verb in ("issue", "revoke"):
            name, region = target.split()
            return self.registry_step(verb, name, region)
        elif verb == "forget":
            # The run's clients stop sending the key, 15 s after its revocation returned (a
            # revoked key's requests would soon meet the per-address limit on invalid keys).
            time.sleep(max(0.0, self.revoked_at.get(target, 0) + 15 - time.time()))
            os.remove(os.path.join(self.tokens_dir, target))
        elif verb == "move":
            self.moved.set()

    def stop(self):
        for p in reversed(self.procs):
            p.stop(grace=5)
        for group in self.proxies:
            group.stop()
        if self.sentinels:
            drop_nft()


def issued(stdout):
    """The key id and the token that `keys issue` printed."""
    return stdout.split()[1], stdout.strip().splitlines()[-1]


def run_as(user, argv, timeout):
    """`argv` run to its end as `user` (None: as this process), its output captured."""
    kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def nft(rule):
    subprocess.run(["nft", *rule.split()], check=True)


def drop_nft():
    """Deletes this run's nft table, and any a run that is no longer alive left behind."""
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[-1] if line.startswith("table inet petregions_") else ""
        pid = name.rpartition("_")[2]
        if name and (name == NFT_TABLE or not os.path.exists(f"/proc/{pid}")):
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True)


def minute_of(headers, recv):
    """The minute instance an answer counted in, from its `RateLimit` header's `t` (seconds to
    the window's end, by the store's clock), else from the receive time."""
    for part in headers.get("ratelimit", "").split(","):
        if part.strip().startswith('"minute"') and ";t=" in part:
            t = int(part.split(";t=")[1].split(";")[0])
            return int(round(recv + t)) // 60 - 1
    return int(recv) // 60


def client(setup, region, nodes, key, token, rate, until, out, lock, parent):
    """One key's requests from one region at `rate()` a second, alternating its region's nodes
    (`nodes`: name and port), each on a kept-alive connection; every request recorded. `token()`
    is the key's token, or None while it has none yet (a key the run issues later)."""
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
             for name, port in nodes}
    due, i = time.time(), 0
    while due < until and os.getppid() == parent:
        now_rate, bearer = rate(), token()
        if now_rate <= 0 or bearer is None:
            time.sleep(0.2)
            due = time.time()
            continue
        time.sleep(max(0.0, due - time.time()))
        name, port = nodes[i % len(nodes)]
        i += 1
        sent = time.time()
        rec = {"setup": setup, "region": region, "node": name, "key": key, "sent": sent}
        try:
            conns[name].request("GET", "/v1/pets?limit=1",
                                headers={"Authorization": f"Bearer {bearer}"})
            resp = conns[name].getresponse()
            body = resp.read()
            rec["recv"] = time.time()
            rec["status"] = resp.status
            if resp.status != 200:
                try:
                    rec["code"] = json.loads(body).get("code")
                except ValueError:
                    rec["code"] = None
            rec["headers"] = {k.lower(): v for k, v in resp.getheaders()
                              if k.lower().startswith(("x-ratelimit", "ratelimit", "retry-after"))}
            rec["minute"] = minute_of(rec["headers"], rec["recv"])
        except (OSError, http.client.HTTPException) as e:
            rec["recv"], rec["status"], rec["error"] = time.time(), None, str(e)
            conns[name].close()
            conns[name] = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        with lock:
            out.write(json.dumps(rec) + "\n")
        due += 1.0 / now_rate


def region_load(setup, region, nodes, keys, until, part, moved, tokens_dir, parent):
    """A region's clients, in a process of their own (as a region's clients are near it): the
    load generator's threads share one interpreter lock, and a region's measured latency must
    not depend on how many other regions' clients the run has. `keys`: per key its name, its
    token (None: read from `tokens_dir` once the run issued it), its rate before and after
    `moved` is set. Records go to `part`, merged into the history once every region is done.
    The clients stop early if the harness (`parent`) is gone."""
    lock, threads, failed = threading.Lock(), [], []
    # A client that dies fails the region's load (its records would be missing, and every
    # check would pass on fewer of them).
    threading.excepthook = lambda args: failed.append(f"{args.thread.name}: {args.exc_value!r}")

    def token_of(name, token):
        if token is not None:
            return lambda: token
        path = os.path.join(tokens_dir, name)
        return lambda: read_token(path)

    with open(part, "w") as out:
        for name, token, before, after in keys:
            rate = (lambda b, a: lambda: a if moved.is_set() else b)(before, after)
            threads.append(threading.Thread(target=client, name=name, daemon=True, args=(
                setup, region, nodes, name, token_of(name, token), rate, until, out, lock,
                parent)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, until - time.time()) + 60)
        failed += [f"{t.name}: still running" for t in threads if t.is_alive()]
    if failed:
        raise SystemExit(f"region {region}'s load failed: {'; '.join(failed)}")


def read_token(path):
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def load(fl, seconds, history, faults=False):
    """Every region's load, each in a process of its own (`region_load`), and the fault
    schedule here; returns once all of them are done, the records in `history`."""
    start = time.time()
    until = start + seconds
    regions = sorted({n["region"] for n in fl.nodes.values()})
    acme_rate = ACME_LOAD * ACME_PER_MINUTE / 60.0
    share = {r: ACME_SHARE[r] / sum(ACME_SHARE[x] for x in regions) for r in regions}
    ctx = multiprocessing.get_context("spawn")
    fl.moved = ctx.Event()
    procs = []
    for r in regions:
        nodes = [(name, n["port"]) for name, n in sorted(fl.nodes.items()) if n["region"] == r]
        keys = [("acme", fl.tokens["acme"], acme_rate * share[r], acme_rate * ACME_MOVED[r]),
                (f"small-{r}", fl.tokens[f"small-{r}"], SMALL_RATE, SMALL_RATE)]
        keys += [(name, None, rate, rate) for name, rate in fl.issued_later]
        p = ctx.Process(target=region_load, name=f"load-{r}", daemon=True, args=(
            fl.setup, r, nodes, keys, until, f"{history}.{r}", fl.moved, fl.tokens_dir,
            os.getpid()))
        p.start()
        procs.append(p)
    try:
        with open(history, "a") as out:
            if faults:
                schedule(fl, start, until, out)
            for p in procs:
                p.join(max(0.0, until - time.time()) + 60)
                if p.exitcode != 0:
                    raise RuntimeError(f"{p.name} ended with {p.exitcode} (its records are "
                                       "not whole)")
            for r in regions:
                with open(f"{history}.{r}") as part:
                    shutil.copyfileobj(part, out)
                os.remove(f"{history}.{r}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def schedule(fl, start, until, out):
    """Runs the fleet's fault schedule (`FAULTS`, or the soak's) at its times, each recorded
    in the history."""
    for at, what in fl.faults:
        if start + at >= until:
            return
        time.sleep(max(0.0, start + at - time.time()))
        extra = fl.fault(what) or {}
        out.write(json.dumps({"setup": fl.setup, "fault": what, "at": time.time(),
                              **extra}) + "\n")


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def judge(records, setup, calls=None, metered=None):
    """Per region, the small keys' latency; per whole minute, acme's admissions over all regions
    against its limit; per key, the global store's calls per 1,000 admitted (`leased`); per key
    and whole minute, the units every region's nodes metered against the admissions."""
    rows = [r for r in records if r["setup"] == setup and "fault" not in r]
    out = {"setup": setup, "latency_ms": {}, "acme_minutes": [], "global_calls": {},
           "faults": [r["fault"] for r in records if r["setup"] == setup and "fault" in r]}
    for key, n in sorted((calls or {}).items()):
        admitted = sum(1 for r in rows if r["key"] == key and r["status"] == 200)
        out["global_calls"][key] = {"calls": n, "admitted": admitted,
                                    "per_1000": round(1000 * n / max(admitted, 1), 1)}
    for region in REGIONS:
        lat = [(r["recv"] - r["sent"]) * 1000 for r in rows
               if r["region"] == region and r["key"].startswith("small") and r["status"] == 200]
        if lat:
            out["latency_ms"][region] = {"n": len(lat), "p50": round(percentile(lat, 50), 2),
                                         "p99": round(percentile(lat, 99), 2)}
    acme = [r for r in rows if r["key"] == "acme" and r.get("minute") is not None]
    first, last = min(r["sent"] for r in rows), max(r["sent"] for r in rows)
    # Whole minutes only: those the load covered from start to end (a second of slack).
    minutes = sorted(m for m in {r["minute"] for r in acme}
                     if m * 60 >= first - 1 and (m + 1) * 60 <= last + 1)
    for m in minutes:
        admitted = sum(1 for r in acme if r["minute"] == m and r["status"] == 200)
        sent = sum(1 for r in acme if r["minute"] == m)
        out["acme_minutes"].append({"minute": m, "sent": sent, "admitted": admitted,
                                    "limit": ACME_PER_MINUTE,
                                    "over": max(0, admitted - ACME_PER_MINUTE)})
    out["errors"] = sum(1 for r in rows if r["status"] is None or r["status"] >= 500)
    if metered is not None:
        out["metering"] = metering(rows, minutes, metered, [
            (r["fault"].split()[1], r["at"]) for r in records
            if r["setup"] == setup and r.get("fault", "").startswith("kill")])
    return out


def metering(rows, minutes, metered, kills):
    """Per key and whole minute, the metered units summed over every node of every region
    against the key's admissions (each request costs 1 unit here). A node killed (`kills`: its
    name, when) loses the minutes it had not written yet (the one it died in, and the one
    before, written up to 41 s after its end): a key's minute with a request to it then is
    excused, not checked."""
    lost = {(node, int(t) // 60 - i) for node, t in kills for i in (0, 1)}
    out = {"checked": 0, "equal": 0, "excused": 0, "off": []}
    for key in sorted({r["key"] for r in rows}):
        for m in minutes:
            mine = [r for r in rows if r["key"] == key and r.get("minute") == m]
            admitted = sum(1 for r in mine if r["status"] == 200)
            units = metered.get((key, m), 0)
            if any((r["node"], m) in lost for r in mine):
                out["excused"] += 1
                continue
            out["checked"] += 1
            if units == admitted:
                out["equal"] += 1
            else:
                out["off"].append({"key": key, "minute": m, "admitted": admitted,
                                   "metered": units})
    return out


def stop_on_sigterm():
    """SIGTERM ends the run as an exception does: every process stopped, the nft table gone."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv):
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default="single,one-redis,redis-per-region")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--faults", action="store_true",
                    help="run the leased set-up under the fault schedule (FAULTS)")
    a = ap.parse_args(argv)
    if not 0 < a.minutes <= 60:
        ap.error("--minutes: more than 0, at most 60")
    # Absolute: the nodes' configs name these paths (read from the config's own folder).
    run = os.path.abspath(a.out or os.path.join(ROOT, "target", "regions",
                                                f"run-{int(time.time())}"))
    a.bin_dir = os.path.abspath(a.bin_dir)
    os.makedirs(run, exist_ok=True)
    history = os.path.join(run, "history.ndjson")
    results = []
    for setup in a.setup.split(","):
        fl = Fleet(os.path.join(run, setup), setup, a.bin_dir, a.delay_ms)
        try:
            fl.start()
            # From the next minute's start, so every minute judged is whole.
            time.sleep(60 - time.time() % 60 + 0.5)
            load(fl, a.minutes * 60, history, a.faults and setup == "leased")
            calls = fl.global_calls()
            delayed = {r: group.carried() for r, group in fl.global_paths.items()}
        finally:
            fl.stop()
        with open(history) as f:
            results.append(judge([json.loads(line) for line in f], setup, calls, fl.metered()))
        # The connections each far region's nodes made to the global store through its delay
        # (none would mean the Sentinels' addresses bypassed it).
        results[-1]["delayed_connections"] = delayed
        print(json.dumps(results[-1]), flush=True)
    fleet.dump_json(os.path.join(run, "results.json"), results)
    print(table(results, a.delay_ms))
    return 0


def table(results, delay_ms):
    lines = [f"regions harness: 3 regions, 2 nodes each, {delay_ms:g} ms each way between them",
             "| set-up | region | p50 ms | p99 ms | acme minutes | admitted / limit (min, max) "
             "| over (max) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        minutes = r["acme_minutes"]
        most = max((m["admitted"] for m in minutes), default=0)
        least = min((m["admitted"] for m in minutes), default=0)
        over = max((m["over"] for m in minutes), default=0)
        for region, lat in sorted(r["latency_ms"].items()):
            lines.append(f"| {r['setup']} | {region} | {lat['p50']} | {lat['p99']} | "
                         f"{len(minutes)} | {least}, {most} / {ACME_PER_MINUTE} | {over} |")
    for r in results:
        m = r.get("metering")
        if m:
            lines.append(f"metering, {r['setup']}: {m['equal']} of {m['checked']} key-minutes "
                         f"metered exactly what was admitted ({m['excused']} excused by a node "
                         f"killed); off: {m['off'] or 'none'}")
        if r.get("delayed_connections"):
            lines.append(f"connections to the global store through the delay, {r['setup']}: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(r["delayed_connections"].items())))
        for key, c in r.get("global_calls", {}).items():
            lines.append(f"global store calls, {r['setup']}, {key}: {c['calls']} for "
                         f"{c['admitted']} admitted ({c['per_1000']} per 1,000)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
