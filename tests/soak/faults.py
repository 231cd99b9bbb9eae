"""The soak's fault schedule: drawn from the seed, printed, then played against the fleet.

The schedule is a list of `(at, kind, target, duration)`, `at` in seconds from the load's
start. Every kind is drawn at least once (`KINDS`), then more as the run is longer, at times
uniform over the faulty part of the run, so faults overlap: a failover while a node is killed
and the backend restarts is what the soak is for. The same seed gives the same schedule; what
the machine makes of it (how long a failover takes) is recorded, not drawn.

Each fault runs in a thread of its own at its time. Faults on Redis's topology (a primary
killed, a restart, a slow Redis) take one lock, one node's faults (a kill, an upgrade, a
partition) that node's lock, so two faults never pull one thing two ways at once; everything
else overlaps freely. Every fault writes its start and end to events.ndjson, with the nodes it
touches, whether it takes the store from them (`store`) and whether Redis may lose its last
counts (`loses_counts`): the checker's allowances are stated from these.
"""

import os
import random
import subprocess
import threading
import time

import fleet
import resp

# kind: (touches the store, may lose counts, duration range in seconds)
KINDS = {
    "primary_kill": (True, True, (0, 0)),
    "redis_restart": (True, True, (0, 0)),
    "partition": (True, False, (6, 15)),
    "redis_latency": (True, False, (5, 12)),
    "node_kill": (False, False, (1, 4)),
    "node_upgrade": (False, False, (0, 0)),
    "backend_restart": (False, False, (1, 3)),
    "spool_full": (False, False, (8, 20)),
}
NODE_KINDS = {"partition", "node_kill", "node_upgrade"}


def schedule(seed, load_secs, nodes, which="all"):
    """The faults of a run of `load_secs`: every kind once, then one more per 90 s of load,
    between 15 s in and 45 s before the end (the rest is for healing). `which`: `all`, `none`,
    or kinds separated by commas (each once)."""
    rng = random.Random(seed)
    first, last = 15.0, max(30.0, load_secs - 45.0)
    if which != "all":
        kinds = [k for k in which.split(",") if k and k != "none"]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise SystemExit(f"soak: unknown faults {unknown}; the kinds: {', '.join(KINDS)}")
    else:
        kinds = list(KINDS)
        kinds += [rng.choice(list(KINDS)) for _ in range(int(load_secs // 90))]
    plan = []
    for kind in kinds:
        lo, hi = KINDS[kind][2]
        target = rng.choice(nodes) if kind in NODE_KINDS else None
        plan.append((round(rng.uniform(first, last), 1), kind, target, round(rng.uniform(lo, hi), 1)))
    return sorted(plan)


def key_changes(seed, load_secs):
    """When keys are issued, revoked and rotated, and the plan edited: `(at, what)`."""
    rng = random.Random(seed * 31 + 7)
    first, last = 10.0, max(25.0, load_secs - 40.0)
    what = ["issue", "revoke", "rotate", "plan_raise", "plan_lower"]
    what += [rng.choice(["issue", "revoke", "rotate"]) for _ in range(int(load_secs // 60))]
    return sorted((round(rng.uniform(first, last), 1), w) for w in what)


class Player:
    """Plays a schedule against the soak's fleet (`soak.Soak`), recording to its timeline."""

    def __init__(self, soak):
        self.s = soak
        self.redis_lock = threading.Lock()
        self.node_locks = {n: threading.Lock() for n in soak.gateways}
        self.ids = 0
        self.id_lock = threading.Lock()
        self.errors = []
        # Set by the teardown: no fault starts a process or adds a rule after it.
        self.stopping = threading.Event()

    def _record(self, kind, phase, fid, target):
        store, loses, _ = KINDS[kind]
        nodes = [target] if kind in NODE_KINDS else sorted(self.s.gateways)
        if kind not in NODE_KINDS and kind not in ("primary_kill", "redis_restart", "redis_latency"):
            store = False
        self.s.event({"kind": "fault", "name": kind, "phase": phase, "id": fid, "nodes": nodes,
                      "store": store, "loses_counts": loses})

    def run(self, kind, target, duration):
        with self.id_lock:
            self.ids += 1
            fid = self.ids
        lock = self.node_locks[target] if target else (
            self.redis_lock if kind in ("primary_kill", "redis_restart", "redis_latency") else None)
        if lock:
            lock.acquire()
        try:
            if self.stopping.is_set():
                raise RuntimeError("the soak is stopping")
            self._record(kind, "start", fid, target)
            getattr(self, kind)(target, duration)
        except Exception as e:  # recorded and reported: a fault that could not be played
            self.errors.append(f"{kind} {target or ''}: {type(e).__name__}: {e}")
        finally:
            self._record(kind, "end", fid, target)
            try:
                if kind in ("node_kill", "node_upgrade") and not self.stopping.is_set():
                    self.ready_after(target, fid)
            finally:
                if lock:
                    lock.release()

    def ready_after(self, node, fid):
        """A node fault ends when its action is done; how long the node then takes to answer
        its readiness probe is the checker's (`ready`), recorded here."""
        try:
            t = self.s.gateways[node].wait_ready(60)
            self.s.event({"kind": "ready", "node": node, "after": fid, "t": t})
        except RuntimeError as e:
            self.errors.append(f"{node} after fault {fid}: {e}")

    def guard(self):
        """Raises when the soak is stopping: checked before every process start and rule."""
        if self.stopping.is_set():
            raise RuntimeError("the soak is stopping")

    # Redis

    def primary_kill(self, _target, _duration):
        """SIGKILL the primary; the Sentinels promote the replica; the old one comes back as its
        replica. The fault ends when the Sentinels name the new primary and the old is back."""
        s = self.s
        old = s.primary_name()
        port, proc = s.redis.nodes[old]
        proc.kill()
        deadline = time.time() + 30
        while fleet.sentinel_master(s.sentinels[0], s.pw) in (port, None):
            if time.time() > deadline:
                raise RuntimeError("the Sentinels named no new primary within 30 s")
            time.sleep(0.1)
        new_port = fleet.sentinel_master(s.sentinels[0], s.pw)
        self.guard()
        s.redis.start_node(old, port, replica_of=new_port)
        s.wait_replica_synced(old)

    def redis_restart(self, _target, _duration):
        """The primary stopped (SIGTERM: it syncs its AOF) and started again at once."""
        s = self.s
        name = s.primary_name()
        port, proc = s.redis.nodes[name]
        proc.stop(10)
        master = fleet.sentinel_master(s.sentinels[0], s.pw)
        self.guard()
        s.redis.start_node(name, port, replica_of=None if master == port else master)
        s.wait_writable()

    def redis_latency(self, _target, duration):
        """Redis slowed: scripts that hold it busy 30 ms at a time, 20 ms apart, for `duration`."""
        s = self.s
        end = time.time() + duration
        busy = ("local t=redis.call('TIME') local s=t[1]*1000000+t[2] "
                "repeat local n=redis.call('TIME') until n[1]*1000000+n[2]-s > 30000 return 1")
        evals, failures = 0, []
        while time.time() < end and not self.stopping.is_set():
            try:
                with s.redis.default(s.redis.nodes[s.primary_name()][0]) as r:
                    while time.time() < end:
                        r.call("EVAL", busy, 0)
                        evals += 1
                        time.sleep(0.02)
            except (resp.RedisError, OSError, RuntimeError) as e:
                failures.append(str(e))
                time.sleep(0.2)
        # A slow Redis that was not slowed would earn the nodes an allowance for nothing.
        if evals < duration * 5:
            raise RuntimeError(f"Redis was held busy {evals} times in {duration} s "
                               f"({'; '.join(failures[:3]) or 'no error'})")

    # One node

    def partition(self, node, duration):
        """The node's user's packets to every Redis and Sentinel port dropped (nft, loopback)."""
        s = self.s
        uid = s.users[node].pw_uid
        ports = ",".join(str(p) for p in sorted([p for p, _ in s.redis.nodes.values()] + s.sentinels))
        table = f"petsoak_{node}"
        self.guard()
        nft(f"add table inet {table}")
        nft(f"add chain inet {table} out {{ type filter hook output priority 0 ; }}")
        nft(f"add rule inet {table} out meta skuid {uid} tcp dport {{ {ports} }} drop")
        try:
            time.sleep(duration)
        finally:
            nft(f"delete table inet {table}")

    def node_kill(self, node, duration):
        """SIGKILL, `duration` seconds down, started again (its readiness: `ready_after`)."""
        g = self.s.gateways[node]
        g.kill()
        self.s.event({"kind": "kill", "node": node})
        time.sleep(duration)
        self.guard()
        g.start()
        self.s.event({"kind": "start", "node": node})

    def node_upgrade(self, node, _duration):
        g = self.s.gateways[node]
        self.guard()
        self.s.event({"kind": "upgrade", "node": node})
        g.upgrade()

    # Around the gateways

    def backend_restart(self, _target, duration):
        b = self.s.backend
        b.stop(10)
        time.sleep(duration)
        self.guard()
        b.start()
        fleet.wait_port(self.s.backend_port)

    def spool_full(self, _target, duration):
        """The spools' disk (a tmpfs of the run's) filled to the last byte for `duration`."""
        filler = os.path.join(self.s.spool_root, "filler")
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            left = os.statvfs(self.s.spool_root)
            if left.f_bavail * left.f_frsize > 64 * 1024:
                raise RuntimeError(f"the spools' disk still has {left.f_bavail * left.f_frsize} "
                                   "bytes free after filling it")
            time.sleep(duration)
        finally:
            os.unlink(filler)


def nft(rule):
    subprocess.run(["nft", *rule.split()], check=True)
