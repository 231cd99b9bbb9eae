"""The soak's fault schedule: drawn from the seed, printed, then played against the fleet.

The schedule is a list of `(at, kind, target, duration)`, `at` in seconds from the load's
start. Every kind is drawn at least once (`KINDS`), then more as the run is longer, at times
uniform over the faulty part of the run, so faults overlap: a failover while a node is killed
and the backend restarts is what the soak is for. But two faults that act on one thing
(`RESOURCES`: the Redis topology, one node, the backend, the spools' disk) never overlap: each
holds its resources from its time for its duration and `HOLD` more (what its play may take
beyond the duration), and a fault drawn into another's hold is moved to the nearest time that
is free (later first), or for a node fault to another node that is free at its time. So the
schedule printed is the one played. The same seed gives the same schedule; what the machine
makes of it (how long a failover takes) is recorded, not drawn.

Each fault runs in a thread of its own at its time, holding a lock per resource while it
plays: should a fault outlast its `HOLD`, the next on that resource waits for it, and one that
starts more than LATE_MAX after its time is a fault error (the run did not play the schedule
it printed; the checker's `schedule` fails). Every fault writes its start and end to
events.ndjson, with the nodes it touches, whether it takes the store from them (`store`) and
whether Redis may lose its last counts (`loses_counts`): the checker's allowances are stated
from these.
"""

import math
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
# kind: what its start and end act on. Two faults that share one never overlap. "node" is the
# node the fault picks (`node:gw1`); the others are one of a fleet.
RESOURCES = {
    # Each acts on the current primary as the Sentinels name it at the fault's start (after a
    # failover, the other data node): a kill is a failover and the old primary's return as a
    # replica, a restart during one would stop the node being promoted or coming back, and a
    # slowed Redis during either would be a slow one no longer, its scripts failing.
    "primary_kill": ("redis",),
    "redis_restart": ("redis",),
    "redis_latency": ("redis",),
    # That node's process (a kill, an upgrade: two processes on one set of sockets) and its
    # user's packets (a partition): a node killed while upgraded, or started while cut off
    # from Redis, is neither fault as the checker states it (nor ready when it expects).
    "partition": ("node",),
    "node_kill": ("node",),
    "node_upgrade": ("node",),
    "backend_restart": ("backend",),  # one process: a second stop, a second start on its port
    "spool_full": ("disk",),  # the spools' tmpfs and its one filler file
}
# kind: seconds it may hold its resources beyond its drawn duration, as the schedule reserves
# them (its play's waits, with room for a slow machine).
HOLD = {
    "primary_kill": 20.0,  # a new primary (3.7-4.4 s measured), the old back and synced
    "redis_restart": 12.0,  # the stop (its AOF synced), the start, a write taken (or a failover)
    "partition": 1.0,  # the nft table added and deleted
    "redis_latency": 1.0,  # a connection to the primary
    "node_kill": 10.0,  # the start and its readiness (which waits for a restarting backend)
    "node_upgrade": 10.0,  # 1 s for the new process, then its readiness
    "backend_restart": 6.0,  # the stop, then its port open again
    "spool_full": 2.0,  # dd filling the tmpfs, the unlink
}
GAP = 2.0  # seconds between two faults on one resource
LATE_MAX = 1.0  # a fault that starts later than its time by more (held up by another) is an error


def resources(kind, target):
    """What a fault acts on (`RESOURCES`), its node named."""
    return tuple(f"node:{target}" if r == "node" else r for r in RESOURCES[kind])


def hold(kind, duration):
    """Seconds a fault of `duration` holds its resources, as the schedule reserves them."""
    return duration + HOLD[kind]


def schedule(seed, load_secs, nodes, which="all"):
    """The faults of a run of `load_secs`: every kind once, then one more per 90 s of load,
    starting between 15 s in and 45 s before the end (the rest is for healing), no two that
    share a resource overlapping (`place`). `which`: `all`, `none`, or kinds separated by
    commas (each once)."""
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
    drawn = []
    for kind in kinds:
        lo, hi = KINDS[kind][2]
        target = rng.choice(nodes) if kind in NODE_KINDS else None
        drawn.append((round(rng.uniform(first, last), 1), kind, target, round(rng.uniform(lo, hi), 1)))
    return place(sorted(drawn), nodes, first, last)


def place(drawn, nodes, first, last):
    """The drawn faults (in time order) where none overlaps another on a resource of its own
    (`RESOURCES`), a fault's hold and GAP apart: each at its time, or a node fault at its time
    on another node free then; else after the last fault on its resource (on the node free
    first). Should that push faults past `last`, those are pulled back, each to just before
    the next on its resource, as far as `first`."""
    plan = []  # [at, kind, target, duration], in the order placed (their drawn times')
    free_at = {}  # resource -> when it is free again (the last fault's hold and GAP)
    for at, kind, target, duration in drawn:
        options = [target] + [n for n in nodes if n != target] if kind in NODE_KINDS else [None]
        # (when free, the drawn node first on a tie, the node)
        start, _, t = min((max([at] + [up(free_at.get(r, 0.0)) for r in resources(kind, n)]), i, n)
                          for i, n in enumerate(options))
        plan.append([start, kind, t, duration])
        for r in resources(kind, t):
            free_at[r] = start + hold(kind, duration) + GAP
    next_at = {}  # resource -> the start of the next fault on it (pulling back)
    for f in reversed(plan):
        at, kind, t, duration = f
        room = min([last] + [down(next_at[r] - hold(kind, duration) - GAP)
                             for r in resources(kind, t) if r in next_at])
        if room < at:
            if room < first:
                raise SystemExit(
                    f"soak: no room for {kind} (held {hold(kind, duration):g} s) between "
                    f"{first:g} s and {last:g} s beside the other faults on "
                    f"{', '.join(resources(kind, t))}: a longer run, or fewer faults")
            f[0] = at = room
        for r in resources(kind, t):
            next_at[r] = at
    return sorted(tuple(f) for f in plan)


def up(t):
    """`t` to the tenth of a second at or after it (the schedule's times are in tenths)."""
    return round(math.ceil(t * 10 - 1e-6) / 10, 1)


def down(t):
    return round(math.floor(t * 10 + 1e-6) / 10, 1)


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
        self.locks = {}  # resource -> its lock, made on first use (under id_lock)
        self.holders = {}  # resource -> the fault holding it: (id, kind)
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

    def run(self, kind, target, duration, at=None):
        """Plays one fault holding its resources; `at`: its time in the schedule (seconds from
        the load's start), to tell a fault held up by another."""
        with self.id_lock:
            self.ids += 1
            fid = self.ids
            held = sorted(resources(kind, target))
            locks = [self.locks.setdefault(r, threading.Lock()) for r in held]
        before = {r: self.holders.get(r) for r in held}
        for lock in locks:
            lock.acquire()
        try:
            for r in held:
                self.holders[r] = (fid, kind)
            if self.stopping.is_set():
                raise RuntimeError("the soak is stopping")
            late = time.time() - (self.s.t0 + at) if at is not None else 0.0
            if late > LATE_MAX:
                # Played all the same (the checker reads when it started), but not the schedule
                # printed: its HOLD is short for this machine.
                by = ", ".join(f"{r} by fault {h[0]} ({h[1]})" for r, h in before.items() if h)
                why = f"held up: {by} (its HOLD is short)" if by else "with nothing held"
                self.errors.append(f"{kind} {target or ''}: started {late:.1f} s after its time "
                                   f"({at} s), {why}")
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
                for r, lock in zip(held, locks):
                    self.holders.pop(r, None)
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
