#!/usr/bin/env python3
"""Tests of the soak checker (check.py) on small synthetic runs.

    python3 -m unittest tests/soak/test_check.py      (from the repository root)
    python3 tests/soak/test_check.py

`build_run` writes a run folder the way the soak would: a load of requests is answered by
`Fleet`, a small model of three gateway nodes on one store that keeps every promise (unless a
test gives it a bug), and its history, events (faults, key changes, readiness, each node's
store samples), metering files, webhook receipts and end state are written out. The baseline passes every invariant; each test then plants one violation, in the
model (`bugs`) or in the written records, and checks that exactly that invariant fails and
that its first violation names the planted record.
"""

import contextlib
import io
import json
import math
import os
import sys
import tempfile
import unittest
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check  # noqa: E402

S = 1795000000.0  # the run's start
NODES = ["gw1", "gw2", "gw3"]
PLANS = {
    "tight": {"windows": {"60": 30, "86400": 70}, "concurrency": 4, "cost": {"createPet": 5},
              "notify_at": [80, 100]},
    "pro": {"windows": {"60": 100, "86400": 5000}, "concurrency": 8, "cost": {},
            "notify_at": [80, 100]},
    "tiny": {"windows": {"60": 5, "86400": 1000}, "concurrency": 4, "cost": {}, "notify_at": []},
}
KEYS = {
    "key_a": {"plan": "tight", "customer": None, "quota": "key_a"},
    "key_b": {"plan": "pro", "customer": "acme", "quota": "customer:acme"},
    "key_c": {"plan": "pro", "customer": "acme", "quota": "customer:acme"},
    "key_t": {"plan": "tiny", "customer": None, "quota": "key_t"},
}
REVOKE_C = S + 60.2
STRIKES, BAN_SECS = 10, 30


def base_load():
    """key_a fills its minutes and earns bans; key_b and key_c share acme's roomy quota (key_c
    is revoked at REVOKE_C); an unknown key gets 401s. key_t is left to the tests."""
    load = [(S + 0.1 + i, "key_a", NODES[i % 3], "createPet" if i % 10 == 9 else "listPets")
            for i in range(120)]
    load += [(S + 0.35 + 2 * i, "key_b", NODES[(i + 1) % 3], "listPets") for i in range(60)]
    load += [(S + 0.85 + 2 * i, "key_c", NODES[(i + 2) % 3], "getPet") for i in range(60)]
    return load + [(S + 5.5, "key_zz", "gw1", "listPets"), (S + 70.5, "key_zz", "gw2", "listPets")]


def fault(name, fid, start, end, nodes=None):
    store = name in check.STORE_FAULTS
    return {"kind": "fault", "name": name, "id": fid, "start": start, "end": end,
            "nodes": nodes or NODES, "store": store, "loses_counts": name in
            check.COUNT_LOSING_FAULTS}


def rfc3339(t):
    return check.datetime.datetime.fromtimestamp(int(t), check.datetime.timezone.utc) \
        .strftime("%Y-%m-%dT%H:%M:%SZ")


class Fleet:
    """Three nodes on one store, answering requests in the order sent: fixed windows, strikes
    and bans, thresholds, a local fallback during store faults, 502 during a backend restart,
    no answer from a killed node, and each node's store samples (its counted store errors,
    timeouts and breaker). `bugs`: {"over_admit": {seq}} admits those regardless of the
    windows; {"late_revocation": {node: seconds}} makes a node apply revocations that late;
    {"doubled_limit": (node, plan)} gives that node the plan with its minute limit doubled (the
    planted soak's bug).
    Not a bug, a condition of shared cores: {"timeouts": {node: [(lo, hi, counted)]}} makes the
    node's store calls time out then (counted in its samples), each decided by its local
    limiter and not metered; `counted`: the store ran the call all the same."""

    def __init__(self, faults, events, bugs):
        self.faults, self.events, self.bugs = faults, events, bugs
        self.counts, self.strikes, self.ban, self.local = {}, {}, {}, defaultdict(int)
        self.alone = []  # (t, node): each decision a node made without the store
        self.usage = defaultdict(lambda: [0, 0, 0])  # (node, key, op, minute): adm, cost, ref
        self.notices = []  # (node, event)
        self.keys = check.key_table(KEYS, events)
        self.errors = [(f["start"], n, f["name"] == "redis_latency")  # the breaker's 3 failures
                       for f in faults if f["store"] for n in f["nodes"] for _ in range(3)]

    def during(self, names, node, t, store=None):
        return any(f["name"] in names and node in f["nodes"] and f["start"] <= t <= f["end"]
                   for f in self.faults if store is None or f["store"] == store)

    def revoked(self, key, node, t):
        for e in self.events:
            if e["kind"] in ("revoke", "rotate") and e["key"] == key:
                at = e["t"] if e["kind"] == "revoke" else e["overlap_until"]
                late = self.bugs.get("late_revocation", {}).get(node, 0.3)
                healed = [f["end"] for f in self.faults if f["store"] and node in f["nodes"]
                          and f["start"] <= at <= f["end"]]
                return t >= max([at] + healed) + late
        return False

    def timed_out(self, node, t):
        """None, or whether the store counted the call that timed out (see `bugs`)."""
        for lo, hi, counted in self.bugs.get("timeouts", {}).get(node, ()):
            if lo <= t <= hi:
                return counted
        return None

    def answer(self, seq, sent, key, node, op):
        req = {"seq": seq, "node": node, "key": key, "op": op, "cost": 1, "sent": sent,
               "recv": round(sent + 0.004, 3), "status": 401, "error": None,
               "code": "unauthorized", "limit": None, "remaining": None, "reset": None,
               "ratelimit": None, "retry_after": None}
        if self.during({"node_kill"}, node, sent):
            req.update(recv=None, status=None, code=None, error="ConnectionRefusedError")
            return req
        info = self.keys.get(key)
        if info is None or self.revoked(key, node, sent):
            return req
        plan = PLANS[info.plan]
        req["cost"] = cost = plan["cost"].get(op, 1)
        twice = 2 if self.bugs.get("doubled_limit") == (node, info.plan) else 1
        limits = [(int(w), self.limit(info.plan, w, sent) * (twice if int(w) <= 60 else 1))
                  for w in plan["windows"]]
        if self.during(check.STORE_FAULTS, node, sent, store=True):
            return self.fallback(req, info, limits, cost)
        counted = self.timed_out(node, sent)
        if counted is not None:
            self.errors.append((sent, node, True))
            if counted:
                self.count_only(info, limits, cost, int(sent))
            return self.fallback(req, info, limits, cost)
        return self.store(req, info, limits, cost)

    def count_only(self, info, limits, cost, now):
        """The store deciding a call whose answer never reached the node: counted if room."""
        used = {w: self.window(info.quota, w, now) for w, _ in limits}
        if all(used[w] + cost <= lim for w, lim in limits):
            for w, _ in limits:
                self.counts[(info.quota, w)] = (now // w, used[w] + cost)

    def samples(self, start, end):
        """Each node's store_sample once a second while it is up: its counters since its last
        start (a kill resets them) and its breaker (open during a store fault)."""
        out = []
        for node in NODES:
            starts = [e["t"] for e in self.events if e["kind"] == "start" and e["node"] == node]
            for k in range(int(end - start)):
                t = start + k + 0.5
                if self.during({"node_kill"}, node, t):
                    continue
                since = max([s for s in starts if s <= t], default=0)
                errs = [timeout for at, n, timeout in self.errors if n == node and since < at <= t]
                alone = sum(1 for at, n in self.alone if n == node and since < at <= t)
                out.append({"kind": "store_sample", "t": t, "node": node, "errors": len(errs),
                            "timeouts": sum(errs), "fallback": int(self.during(
                                check.STORE_FAULTS, node, t, store=True)), "local": alone})
        return out

    def limit(self, plan, w, t):
        """The plan's limit at t, plan edits included."""
        lim = PLANS[plan]["windows"][w]
        for e in self.events:
            if e["kind"] == "plan_edit" and (e["plan"], e["window"]) == (plan, w) and e["t"] <= t:
                lim = e["limit"]
        return lim

    def window(self, quota, w, now):
        inst, count = self.counts.get((quota, w), (now // w, 0))
        return count if inst == now // w else 0

    def store(self, req, info, limits, cost):
        now, quota = int(req["sent"]), info.quota
        slot = self.usage[(req["node"], req["key"], req["op"], now // 60 * 60)]
        if self.ban.get(quota, 0) > now:
            slot[2] += 1
            return self.banned(req, limits, now)
        used = {w: self.window(quota, w, now) for w, _ in limits}
        if all(used[w] + cost <= lim for w, lim in limits) or \
                req["seq"] in self.bugs.get("over_admit", ()):
            for w, lim in limits:
                self.counts[(quota, w)] = (now // w, used[w] + cost)
                self.thresholds(req, info, w, lim, used[w], cost, now)
            slot[0], slot[1] = slot[0] + 1, slot[1] + cost
            restart = self.during({"backend_restart"}, req["node"], req["sent"])
            code = "bad_gateway" if restart else None
            req.update(status=502 if restart else 200, code=code)
            return self.headers(req, limits, {w: used[w] + cost for w in used}, now)
        slot[2] += 1
        minute, n = self.strikes.get(quota, (now // 60, 0))
        n = n + 1 if minute == now // 60 else 1
        self.strikes[quota] = (now // 60, n)
        if n > STRIKES:
            self.ban[quota], self.strikes[quota] = now + BAN_SECS, (now // 60, 0)
            self.notices.append((req["node"], ban_event(req, info, now, now + BAN_SECS)))
            return self.banned(req, limits, now)
        req.update(status=429, code="rate_limited", retry_after=1)
        return self.headers(req, limits, used, now)

    def fallback(self, req, info, limits, cost):
        """A node deciding alone: its own minute count, the day paused, nothing metered."""
        now = int(req["sent"])
        if self.ban.get(info.quota, 0) > now:
            return self.banned(req, limits, now)
        self.alone.append((req["sent"], req["node"]))
        short = [(w, lim) for w, lim in limits if w <= 60]
        slot = (req["node"], info.quota, now // 60)
        if self.local[slot] + cost <= short[0][1] or req["seq"] in self.bugs.get("over_admit", ()):
            self.local[slot] += cost
            req.update(status=200, code=None)
        else:
            req.update(status=429, code="rate_limited", retry_after=1)
        return self.headers(req, short, {60: self.local[slot]}, now)

    def banned(self, req, limits, now):
        until = self.ban[self.keys[req["key"]].quota]
        req.update(status=429, code="api_key_banned", retry_after=until - now)
        self.headers(req, limits, {w: lim for w, lim in limits}, now)
        req.update(remaining=0, reset=until)
        return req

    def headers(self, req, limits, used, now):
        items = [(w, lim, max(lim - used[w], 0), (now // w + 1) * w) for w, lim in limits]
        req["ratelimit"] = ", ".join(f'"{check.window_name(w)}";r={r};t={reset - now}'
                                     for w, _, r, reset in items)
        _, req["limit"], req["remaining"], req["reset"] = min(items, key=lambda x: (x[2], x[0]))
        return req

    def thresholds(self, req, info, w, limit, before, cost, now):
        for p in PLANS[info.plan]["notify_at"] if w >= 86400 else ():
            mark = math.ceil(limit * p / 100)
            if before < mark <= before + cost:
                self.notices.append((req["node"], event(
                    f"{check.THRESHOLD}:{info.quota}:1d:{now // w}:{p}", check.THRESHOLD, now,
                    {"key_id": req["key"], "customer": customer(info), "plan": info.plan,
                     "window": "1d", "threshold": p, "used": before + cost, "limit": limit,
                     "reset": rfc3339((now // w + 1) * w)}, req["node"])))


def customer(info):
    return info.quota.split(":", 1)[1] if info.quota.startswith("customer:") else None


def event(eid, kind, t, data, node="gw1"):
    return {"specversion": "1.0", "id": eid, "source": f"pet-gateway/soak/{node}", "type": kind,
            "time": rfc3339(t), "datacontenttype": "application/json", "data": data}


def ban_event(req, info, now, until):
    key = req["key"]
    data = {"key_id": key, "plan": info.plan, "banned_until": rfc3339(until),
            "reason": "kept sending after 429"}
    if customer(info):
        data["customer"] = customer(info)
    return event(f"{check.BANNED}:{key}:{until}", check.BANNED, now, data, req["node"])


def usage_events(fleet):
    """The nodes' pet.usage.v1 events, one per node, key, operation and minute."""
    out = []
    for n, ((node, key, op, minute), (adm, cost, ref)) in enumerate(sorted(fleet.usage.items())):
        info = fleet.keys[key]
        data = {"key_id": key, "customer": customer(info), "plan": info.plan, "operation": op,
                "minute": rfc3339(minute), "admitted": adm, "cost": cost, "refused": ref}
        if data["customer"] is None:
            del data["customer"]
        out.append((node, event(f"{node}.4242.19a6c1f3e2b.{n + 1}", check.USAGE, minute + 50,
                                data, node)))
    return out


def build_run(root, extra_load=(), faults=None, events=(), bugs=None, samples=True):
    """Writes a consistent run folder at `root`: by default the baseline (a backend restart
    at S+90..S+93, key_c revoked at REVOKE_C, every node's store samples; `samples=False`: a
    run of an older soak, without them)."""
    faults = [fault("backend_restart", 1, S + 90, S + 93)] if faults is None else list(faults)
    timeline = [{"kind": "revoke", "t": REVOKE_C, "key": "key_c", "rc": 0}] + list(events)
    for f in faults:
        for phase in ("start", "end"):
            timeline.append({k: v for k, v in f.items() if k not in ("start", "end")}
                            | {"phase": phase, "t": f[phase]})
        node = f["nodes"][0]
        if f["name"] == "node_kill":
            timeline += [{"kind": "kill", "t": f["start"], "node": node},
                         {"kind": "start", "t": f["end"], "node": node}]
        if f["name"] == "node_upgrade":
            timeline.append({"kind": "upgrade", "t": f["start"], "node": node})
        if f["name"] in check.NODE_FAULTS:
            timeline.append({"kind": "ready", "t": f["end"] + 1.0, "node": node, "after": f["id"]})
    if faults:
        last = max(f["end"] for f in faults)
        timeline.append({"kind": "last_fault_end", "t": last})
        timeline += [{"kind": "ready", "t": last + 1.5, "node": n, "after": "last_fault"}
                     for n in NODES]
    timeline.sort(key=lambda e: e["t"])
    fleet = Fleet(faults, timeline, bugs or {})
    load = sorted(base_load() + list(extra_load))
    history = [fleet.answer(seq, *x) for seq, x in enumerate(load, 1)]
    if samples:
        timeline = sorted(timeline + fleet.samples(S, S + 210), key=lambda e: e["t"])
    write_records(root, fleet, history, timeline)
    return root


def write_records(root, fleet, history, timeline):
    os.makedirs(os.path.join(root, "metering"))
    setup = {"seed": 7, "minutes": 2, "nodes": NODES, "key_prefix": "pet:soak",
             "margins": dict(check.MARGINS), "plans": PLANS, "keys": KEYS,
             "started": S, "load_end": S + 120, "ended": S + 210, "fault_errors": [],
             "generator_dropped": 0, "generator_lag_max": 0.05}
    write_json(os.path.join(root, "setup.json"), setup)
    write_ndjson(os.path.join(root, "history.ndjson"), history)
    write_ndjson(os.path.join(root, "events.ndjson"), timeline)
    written = usage_events(fleet) + fleet.notices
    files = defaultdict(list)
    for node, ev in written:
        files[f"{node}.{ev['time'][:10]}"].append(ev)
    for name, evs in files.items():
        write_ndjson(os.path.join(root, "metering", name), evs)
    received = [ev | {"received": S + 215} for _, ev in written]
    write_ndjson(os.path.join(root, "receiver.ndjson"), received + received[:3])  # at least once
    quotas = {k["quota"] for k in KEYS.values()}
    redis = defaultdict(lambda: {"windows": {}})
    for (quota, w), (inst, count) in fleet.counts.items():
        redis[quota]["windows"][str(w)] = [inst, count]
    write_json(os.path.join(root, "end.json"), {
        "t": S + 205, "redis": redis, "leases": {q: 0 for q in sorted(quotas)},
        "store_timeouts": {n: 0 for n in NODES}, "spool_left": {n: 0 for n in NODES}})


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def write_ndjson(path, objs):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in objs)


def read_json(*path):
    with open(os.path.join(*path), encoding="utf-8") as f:
        return json.load(f)


def read_ndjson(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def edit_ndjson(path, change):
    """Rewrites an NDJSON file through change(list of objects) -> list of objects."""
    write_ndjson(path, change(read_ndjson(path)))


class CheckTest(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp, self.n = tmp.name, 0

    def run_dir(self, **kw):
        self.n += 1
        return build_run(os.path.join(self.tmp, f"run{self.n}"), **kw)

    def history(self, d):
        return read_ndjson(os.path.join(d, "history.ndjson"))

    def meter_files(self, d):
        folder = os.path.join(d, "metering")
        return [os.path.join(folder, n) for n in sorted(os.listdir(folder))]

    def only_fails(self, d, name):
        """Checks d, asserts that `name` alone fails, and returns its violations."""
        report = check.check(d)
        failed = [r.name for r in report.results if not r.ok]
        self.assertEqual(failed, [name], report.text())
        self.assertFalse(report.ok)
        self.assertIn("FAIL " + name, report.text())
        return report.result(name).violations

    def passes(self, d):
        report = check.check(d)
        self.assertTrue(report.ok, report.text())
        return report

    def failing(self, d):
        """The names of the invariants that fail on d."""
        return [r.name for r in check.check(d).results if not r.ok]

    def assertNamed(self, violation, seq):
        self.assertIn(seq, [r.get("seq") for r in violation["records"]], violation)

    def plant(self, d, *records):
        """Adds requests to d's history (refused, or possibly admitted: nothing the model's
        metering or counts would have seen); returns their seqs."""
        edit_ndjson(os.path.join(d, "history.ndjson"), lambda rs: rs + list(records))
        return [r["seq"] for r in records]

    def add_timeouts(self, d, node, at, n=1):
        """Makes node's samples from `at` on count n more store calls that timed out."""
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e | {"errors": e["errors"] + n, "timeouts": e["timeouts"] + n}
            if e["kind"] == "store_sample" and e["node"] == node and e["t"] >= at else e
            for e in evs])

    def edit_setup(self, d, **fields):
        write_json(os.path.join(d, "setup.json"), read_json(d, "setup.json") | fields)


SEQ = iter(range(100000, 200000))


def request(sent, key, node, status, code=None, op="listPets", ratelimit=None, **more):
    """A history record planted by a test (answered 4 ms after `sent`)."""
    return {"seq": next(SEQ), "node": node, "key": key, "op": op, "cost": 1, "sent": sent,
            "recv": round(sent + 0.004, 3), "status": status, "error": None, "code": code,
            "limit": None, "remaining": None, "reset": None, "ratelimit": ratelimit,
            "retry_after": None, "attempts": 1} | more


def first(records, **match):
    """The first record (in the order sent) whose fields equal `match`, with a `when` test."""
    when = match.pop("when", lambda r: True)
    return next(r for r in sorted(records, key=lambda r: r["sent"])
                if all(r.get(k) == v for k, v in match.items()) and when(r))


class Baseline(CheckTest):
    def test_the_baseline_keeps_every_promise(self):
        d = self.run_dir()
        report = self.passes(d)
        self.assertEqual([r.name for r in report.results],
                         ["schedule", "quota", "revocation", "metering", "notices", "errors",
                          "refusals", "slots", "ready"])
        history = self.history(d)
        minute = defaultdict(int)  # the fixture exercises what the invariants look at
        for r in history:
            if r["key"] == "key_a" and r["status"] == 200:
                minute[int(r["sent"] // 60)] += r["cost"]
        self.assertIn(30, minute.values(), "a minute filled exactly")
        self.assertTrue(first(history, code="api_key_banned"))
        self.assertTrue(first(history, status=502))
        self.assertTrue(first(history, key="key_c", status=401))
        self.assertIn("2 seen by clients", report.result("notices").figure)
        self.assertIn("2 crossings seen", report.result("notices").figure)
        self.assertIn("rate_limited 20, api_key_banned 50", report.result("refusals").figure)
        self.assertIn("2 bans", report.result("schedule").figure)
        self.assertTrue(any(e["kind"] == "store_sample"
                            for e in read_ndjson(os.path.join(d, "events.ndjson"))))

    def test_a_run_of_an_older_soak_without_samples_passes(self):
        report = self.passes(self.run_dir(samples=False))
        self.assertIn("by end.json", report.result("metering").figure)

    def test_a_run_without_faults_passes(self):
        report = self.passes(self.run_dir(faults=[]))
        self.assertIn("no faults", report.result("ready").figure)

    def test_the_command_line_says_pass_fail_or_unreadable_by_its_exit(self):
        d = self.run_dir()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(check.main([d]), 0)
            self.assertEqual(check.main([d, "--json"]), 0)
        self.assertIn("PASS quota", out.getvalue())
        write_json(os.path.join(d, "end.json"), read_json(d, "end.json") | {"leases": {"key_a": 1}})
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(check.main([d]), 1)
        os.remove(os.path.join(d, "end.json"))
        with contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(check.main([d]), 2)
        self.assertIn("end.json", err.getvalue())
        with self.assertRaises(check.RecordsError):
            check.check(os.path.join(self.tmp, "nowhere"))


class Quota(CheckTest):
    def test_one_admission_past_the_limit_fails(self):
        seq = first(self.history(self.run_dir()), key="key_a", code="rate_limited")["seq"]
        v = self.only_fails(self.run_dir(bugs={"over_admit": {seq}}), "quota")
        self.assertNamed(v[0], seq)
        self.assertIn("31 units admitted, limit 30 + allowance 0", v[0]["what"])

    def test_a_store_fault_allows_the_limit_again_per_node_in_fallback_and_no_more(self):
        """gw1 partitioned: it admits key_t's 5 a minute alone while the store admits 5: 10 =
        5 + 5 x 1 passes; one more admission fails."""
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("partition", 2, S + 25, S + 35, ["gw1"])]
        load = [(S + 26.2 + i, "key_t", "gw1", "listPets") for i in range(7)]
        load += [(S + 40.2 + i, "key_t", "gw2", "listPets") for i in range(7)]
        d = self.run_dir(extra_load=load, faults=faults)
        self.passes(d)
        history = self.history(d)
        self.assertEqual(sum(1 for r in history if r["key"] == "key_t" and r["status"] == 200), 10)
        seq = first(history, key="key_t", node="gw2", status=429)["seq"]
        v = self.only_fails(self.run_dir(extra_load=load, faults=faults,
                                         bugs={"over_admit": {seq}}), "quota")
        self.assertNamed(v[0], seq)
        self.assertIn("11 units admitted, limit 5 + allowance 5 (1 node(s) in store fault",
                      v[0]["what"])

    def test_the_highest_limit_in_force_during_the_window_binds(self):
        edit = {"kind": "plan_edit", "t": S + 50, "plan": "tight", "window": "60", "limit": 45}
        d = self.run_dir(events=[edit])
        self.passes(d)
        edit_ndjson(os.path.join(d, "events.ndjson"),  # as if raised only after that minute
                    lambda evs: [e | {"t": S + 85} if e["kind"] == "plan_edit" else e for e in evs])
        v = self.only_fails(d, "quota")
        self.assertIn("limit 30", v[0]["what"])


class StoreSamples(CheckTest):
    def test_store_windows_add_the_trouble_the_samples_counted(self):
        """Between two samples of a node: errors up (or down to a new value: a restart reset the
        counter, the delta is that value), or the breaker open at either end, is store trouble
        over [prev - 1 s, cur + 5 s]; a counter reset to 0 is none."""
        rows = [(10, 0, 0, 0), (11, 0, 0, 0), (12, 2, 2, 0), (40, 2, 2, 0), (41, 1, 1, 0),
                (60, 1, 1, 0), (99, 1, 1, 0), (100, 1, 1, 1), (101, 1, 1, 0), (102, 1, 1, 0),
                (130, 0, 0, 0), (131, 0, 0, 0)]
        samples = [{"kind": "store_sample", "t": S + t, "node": "gw1", "errors": e,
                    "timeouts": to, "fallback": fb} for t, e, to, fb in rows]
        d = self.run_dir(faults=[fault("partition", 1, S + 150, S + 160, ["gw2"])])
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e for e in evs if e["kind"] != "store_sample"] + samples)
        run = check.Run(d)
        self.assertEqual(run.store_windows["gw1"],
                         [(S + 10, S + 17), (S + 39, S + 46), (S + 98, S + 106)])
        self.assertEqual(run.fallback_spans["gw1"], [(S + 98, S + 106)])
        self.assertEqual(run.store_windows["gw2"], [(S + 149, S + 165)])  # declared alone
        self.assertEqual(run.store_windows["gw3"], [])
        self.assertEqual([run.timeouts_between("gw1", S + lo, S + hi)
                          for lo, hi in ((12, 12), (13, 41), (42, 200), (0, 200))], [2, 1, 0, 3])

    def test_a_node_deciding_alone_outside_any_fault_needs_its_samples(self):
        """gw2's store calls time out (the store never running them) at S+40..S+46: it admits
        key_t's 5 alone while gw3 gets 5 from the store: 10 = 5 x (1 + 1), as its samples
        count. Without the samples the same run reads as 5 over."""
        load = [(S + 40.2 + i, "key_t", "gw2", "listPets") for i in range(6)]
        load += [(S + 50.2 + i, "key_t", "gw3", "listPets") for i in range(6)]
        bugs = {"timeouts": {"gw2": [(S + 40, S + 46, False)]}}
        d = self.run_dir(extra_load=load, bugs=bugs)
        self.passes(d)
        self.assertEqual(sum(1 for r in self.history(d) if r["key"] == "key_t"
                             and r["status"] == 200), 10)
        d = self.run_dir(extra_load=load, bugs=bugs, samples=False)
        self.assertEqual(self.failing(d), ["quota", "metering"])
        self.assertIn("key_t minute from 11:07:00Z: 10 units admitted, limit 5 + allowance 0 "
                      "(0 node(s) in store fault x 5 + 0 lost)",
                      [v["what"] for v in check.check(d).result("quota").violations])


class QuotaBounds(CheckTest):
    def test_a_doubled_limit_is_caught_while_another_node_decides_alone(self):
        """gw3 reads tiny's minute limit as 10 (the planted soak's bug) and admits 10 of key_t's
        12 at S+40..S+51 through the store. With the only store fault in another minute, the
        total bound catches it; with gw1 partitioned in the same minute (F = 1) the total may
        reach 10, but all 10 were decided by the store, outside every store window: > 5."""
        load = [(S + 40.2 + i, "key_t", "gw3", "listPets") for i in range(12)]
        for start, what in ((S + 150, "10 units admitted, limit 5 + allowance 0"),
                            (S + 25, "10 units admitted outside their nodes' store windows "
                                     "(decided by the store), limit 5 + 0 lost")):
            with self.subTest(partition_at=start - S):
                faults = [fault("backend_restart", 1, S + 90, S + 93),
                          fault("partition", 2, start, start + 10, ["gw1"])]
                self.passes(self.run_dir(extra_load=load, faults=faults))
                d = self.run_dir(extra_load=load, faults=faults,
                                 bugs={"doubled_limit": ("gw3", "tiny")})
                v = self.only_fails(d, "quota")
                self.assertIn(f"key_t minute from 11:07:00Z: {what}", v[0]["what"])
                self.assertEqual(v[0]["records"][0]["node"], "gw3")

    def test_a_doubled_limit_cannot_hide_under_an_ordinary_store_timeout(self):
        """gw3 reads tiny's minute limit as 10 and one of its store calls times out (counted,
        decided alone) in the same minute: it is then inside a store window, where a node was
        allowed the limit again on its own. Its samples count one decision made without the
        store, so its own allowance is 1, and the 10 it admitted fail; records without that
        count (an older build) keep the old allowance, and pass."""
        load = [(S + 40.2 + i, "key_t", "gw3", "listPets") for i in range(10)]
        faults = [fault("backend_restart", 1, S + 90, S + 93)]
        bugs = {"timeouts": {"gw3": [(S + 40, S + 40.5, False)]}}
        self.passes(self.run_dir(extra_load=load, faults=faults, bugs=bugs))
        planted = dict(bugs, doubled_limit=("gw3", "tiny"))
        d = self.run_dir(extra_load=load, faults=faults, bugs=planted)
        v = self.only_fails(d, "quota")
        # 10: the one it decided alone, and 9 the store gave it (the old bound's 2 x 5).
        self.assertIn("key_t minute from 11:07:00Z: 10 units admitted, limit 5 + allowance 1 "
                      "(1 node(s) in store fault, 1 by their own decisions counted + 0 lost)",
                      v[0]["what"])
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            {k: v for k, v in e.items() if k != "local"} for e in evs])
        self.assertNotIn("quota", self.failing(d))

    def test_a_node_alone_admits_the_limit_once_beside_the_store(self):
        """gw1 and gw2 partitioned in one minute, gw3 admitted key_t's 5 through the store.
        gw1 admitting 5 alone passes (5 + 5 <= 2 x 5); 10 alone (its local limiter broken)
        fails: the total, 15, was within 5 x 3 by nodes in store fault, but is over what their
        own decisions counted allow (gw1 the limit, gw2 the 4 it decided alone for any quota).
        Without those counts, the per-node bound catches it."""
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("partition", 2, S + 25, S + 35, ["gw1"]),
                  fault("partition", 3, S + 45, S + 50, ["gw2"])]
        load = [(S + 26 + 0.5 * i, "key_t", "gw1", "listPets") for i in range(10)]
        load += [(S + 60.2 + i, "key_t", "gw3", "listPets") for i in range(7)]
        d = self.run_dir(extra_load=load, faults=faults)
        self.passes(d)
        refused = {r["seq"] for r in self.history(d)
                   if r["key"] == "key_t" and r["node"] == "gw1" and r["status"] == 429}
        self.assertEqual(len(refused), 5)
        d = self.run_dir(extra_load=load, faults=faults, bugs={"over_admit": refused})
        v = self.only_fails(d, "quota")
        self.assertIn("key_t minute from 11:07:00Z: 15 units admitted, limit 5 + allowance 9 "
                      "(2 node(s) in store fault, 9 by their own decisions counted + 0 lost)",
                      v[0]["what"])
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            {k: v for k, v in e.items() if k != "local"} for e in evs])
        v = self.only_fails(d, "quota")
        self.assertIn("key_t minute from 11:07:00Z: gw1 admitted 10 units inside its store "
                      "windows + 5 outside (decided by the store), more than 2 x limit 5 + 0 "
                      "lost",
                      v[0]["what"])


class Refusals(CheckTest):
    def verdict(self, d, ok, what=None):
        if ok:
            return self.passes(d).result("refusals").figure
        v = self.only_fails(d, "refusals")
        if what:
            self.assertIn(what, v[0]["what"])
        return v

    def test_a_401_for_a_valid_key_fails(self):
        """key_c is revoked at S+60.2 (the CLI's exit: its registry write may come up to the
        revocation margin before): a 401 at S+59.5 is not judged, one at S+59.0 or for key_b
        is a violation."""
        for key, sent, ok in (("key_c", S + 59.5, True), ("key_c", S + 59.0, False),
                              ("key_b", S + 30.5, False)):
            with self.subTest(key=key, sent=sent - S):
                d = self.run_dir()
                seq, = self.plant(d, request(sent, key, "gw1", 401, "unauthorized"))
                if not ok:
                    self.assertNamed(self.verdict(d, ok, f"{key} refused 401 by gw1")[0], seq)
                else:
                    self.verdict(d, ok)

    def test_a_401_for_a_key_issued_a_second_before_is_excused_only_if_its_node_could_not_sync(
            self):
        issue = {"kind": "issue", "t": S + 20, "key": "key_n", "plan": "tiny", "quota": "key_n"}
        down = [{"kind": "kill", "t": S + 15, "node": "gw2"},
                {"kind": "start", "t": S + 20.5, "node": "gw2"}]
        for sent, partition, events, ok in (
                (S + 20.8, None, [], True), (S + 21.2, None, [], False),
                (S + 21.2, S + 10, [], True), (S + 21.2, S + 2, [], False),
                (S + 21.2, None, down, True)):
            with self.subTest(sent=sent - S, partition=partition and partition - S,
                              down=bool(events)):
                faults = [fault("backend_restart", 1, S + 90, S + 93)]
                if partition:
                    faults.append(fault("partition", 2, partition, partition + 8, ["gw2"]))
                d = self.run_dir(faults=faults, events=[issue] + events)
                self.plant(d, request(sent, "key_n", "gw2", 401, "unauthorized"))
                figure = self.verdict(d, ok, "key_n refused 401 by gw2")
                if ok and sent > S + 21:
                    self.assertIn("1 judged (1 excused", figure)

    def test_a_rotation_keeps_the_old_key_to_its_overlap_and_the_new_one_from_a_second_after(
            self):
        rotate = {"kind": "rotate", "t": S + 50, "key": "key_b", "successor": "key_b2",
                  "quota": "customer:acme", "overlap_until": S + 65}
        for key, sent, ok in (("key_b2", S + 50.5, True), ("key_b2", S + 51.5, False),
                              ("key_b", S + 63.5, False), ("key_b", S + 64.5, True)):
            with self.subTest(key=key, sent=sent - S):
                d = self.run_dir(events=[rotate])
                self.plant(d, request(sent, key, "gw3", 401, "unauthorized"))
                self.verdict(d, ok, f"{key} refused 401 by gw3")

    def test_a_429_rate_limited_needs_a_full_window_or_a_node_deciding_alone(self):
        for partition, ok in ((None, False), (S + 25, True)):
            with self.subTest(partition=partition):
                faults = [fault("backend_restart", 1, S + 90, S + 93)]
                if partition:
                    faults.append(fault("partition", 2, partition, partition + 8, ["gw1"]))
                d = self.run_dir(faults=faults)
                self.plant(d, request(S + 30.5, "key_b", "gw1", 429, "rate_limited"))
                self.verdict(d, ok, "key_b refused 429 rate_limited by gw1 at 11:07:10Z with "
                                    "room in every window: minute ")

    def test_a_lowered_limit_justifies_429s_from_within_its_window(self):
        """tight lowered to 20 at S+30: key_a's 429s at 20..29 units used are justified by the
        lowest limit in force during the minute; moved to S+85 (the next minute) they are not."""
        edit = {"kind": "plan_edit", "t": S + 30, "plan": "tight", "window": "60", "limit": 20}
        d = self.run_dir(events=[edit])
        self.passes(d)
        edit_ndjson(os.path.join(d, "events.ndjson"),
                    lambda evs: [e | {"t": S + 85} if e["kind"] == "plan_edit" else e for e in evs])
        self.verdict(d, False, "key_a refused 429 rate_limited by")

    def test_a_ban_needs_ten_strikes_in_the_minute_before_or_a_ban_in_force(self):
        d = self.run_dir()
        history = self.history(d)
        banned = first(history, code="api_key_banned")
        strikes = [r for r in history if r["key"] == "key_a" and r["code"] == "rate_limited"
                   and banned["sent"] - 60 <= r["sent"] < banned["sent"]]
        self.assertEqual(len(strikes), 10)  # the baseline passes with exactly 10
        edit_ndjson(os.path.join(d, "history.ndjson"),
                    lambda rs: [r for r in rs if r["seq"] != strikes[0]["seq"]])
        v = self.verdict(d, False, "key_a refused 429 api_key_banned by")
        self.assertIn("had 9 refusals in the minute before", v[0]["what"])
        self.assertNamed(v[0], banned["seq"])
        self.assertEqual(len(v), 1, "the ban's later 429s follow the first's X-RateLimit-Reset")

    def test_a_ban_out_of_nowhere_fails_unless_its_node_decided_alone(self):
        """Even with its pet.key.banned.v1 written: the gateway's word is not the cause."""
        for partition, ok in ((None, False), (S + 25, True)):
            with self.subTest(partition=partition):
                faults = [fault("backend_restart", 1, S + 90, S + 93)]
                if partition:
                    faults.append(fault("partition", 2, partition, partition + 8, ["gw2"]))
                d = self.run_dir(faults=faults)
                until = int(S + 60)
                self.plant(d, request(S + 30.5, "key_b", "gw2", 429, "api_key_banned",
                                      reset=until, retry_after=30))
                ev = ban_event({"key": "key_b", "node": "gw2"},
                               check.Key("pro", "customer:acme"), int(S + 30), until)
                for path in (os.path.join(d, "metering", "gw2.2026-11-18"),
                             os.path.join(d, "receiver.ndjson")):
                    edit_ndjson(path, lambda evs: evs + [ev])
                self.verdict(d, ok, "key_b refused 429 api_key_banned by gw2")

    def test_a_concurrency_refusal_needs_the_quotas_places_full(self):
        """pro's concurrency is 8: key_b's 429 concurrency_limited at S+31.5 needs 8 other
        requests of acme's quota in flight, or a place that may linger: a node killed (or a
        store window) in the 10 s before, not 11 s."""
        for busy, kill, partition, ok in ((8, None, None, True), (7, None, None, False),
                                          (7, S + 21.5, None, True), (7, S + 20.5, None, False),
                                          (7, None, S + 15, True)):
            with self.subTest(busy=busy, kill=kill and kill - S, partition=partition):
                faults = [fault("backend_restart", 1, S + 90, S + 93)]
                if partition:
                    faults.append(fault("partition", 2, partition, partition + 9, ["gw3"]))
                events = [] if kill is None else [{"kind": "kill", "t": kill, "node": "gw3"},
                                                  {"kind": "start", "t": kill + 0.5,
                                                   "node": "gw3"}]
                d = self.run_dir(faults=faults, events=events)
                flight = [request(S + 31.45 + 0.001 * i, "key_c", "gw2", 404, "not_found",
                                  ratelimit='"minute";r=50;t=48', recv=S + 31.6)
                          for i in range(busy)]
                self.plant(d, request(S + 31.5, "key_b", "gw1", 429, "concurrency_limited"),
                           *flight)
                self.verdict(d, ok, "key_b refused 429 concurrency_limited by gw1 at 11:07:11Z: "
                                    "7 other requests of customer:acme in flight, concurrency 8")


class Schedule(CheckTest):
    def test_a_run_that_did_not_play_its_schedule_fails(self):
        for fields, ok in (({"fault_errors": ["partition gw2: CalledProcessError"]}, False),
                           ({"generator_dropped": 3}, False), ({"generator_lag_max": 1.5}, False),
                           ({"generator_lag_max": 1.0}, True), ({"generator_lag_max": None}, True)):
            with self.subTest(**fields):
                d = self.run_dir()
                self.edit_setup(d, **fields)
                if ok:
                    self.passes(d)
                else:
                    what = self.only_fails(d, "schedule")[0]["what"]
                    self.assertIn({"fault_errors": "could not be played: partition gw2",
                                   "generator_dropped": "dropped 3 requests",
                                   "generator_lag_max": "up to 1.50 s late"}[next(iter(fields))],
                                  what)

    def test_a_run_of_four_minutes_must_have_judged_metering_revocations_and_bans(self):
        d = self.run_dir()
        self.edit_setup(d, load_end=S + 240)
        self.assertIn("30 requests refused after a revocation, 2 bans",
                      self.passes(d).result("schedule").figure)
        for drop, what in ((lambda r: r["key"] == "key_c" and r["status"] == 401,
                            "no revoked key refused 401 after its revocation"),
                           (lambda r: r["code"] == "api_key_banned", "no ban seen")):
            with self.subTest(what=what):
                d = self.run_dir()
                edit_ndjson(os.path.join(d, "history.ndjson"),
                            lambda rs: [r for r in rs if not drop(r)])
                self.edit_setup(d, load_end=S + 239.9)  # a short run: reported, not required
                self.assertIn("coverage not required", self.passes(d).result("schedule").figure)
                self.edit_setup(d, load_end=S + 240)
                self.assertIn(f"coverage: {what} in a 4.0-minute run",
                              self.only_fails(d, "schedule")[0]["what"])


class Revocation(CheckTest):
    def late_run(self, after, late, faults=None):
        d = self.run_dir(extra_load=[(REVOKE_C + after, "key_c", "gw2", "getPet")], faults=faults,
                         bugs={"late_revocation": {"gw2": late}})
        req = first(self.history(d), key="key_c", sent=REVOKE_C + after)
        self.assertEqual(req["status"], 200)
        return d, req

    def test_an_admission_1_5_s_after_a_revocation_fails(self):
        d, req = self.late_run(1.5, 2.0)
        v = self.only_fails(d, "revocation")
        self.assertNamed(v[0], req["seq"])
        self.assertIn("key_c admitted (200) by gw2 1.50 s after its revocation", v[0]["what"])

    def test_a_run_cannot_loosen_its_own_margins(self):
        """setup.json's margins are not read: the checker's MARGINS judge."""
        d, req = self.late_run(1.5, 2.0)
        self.edit_setup(d, margins=dict(check.MARGINS, revocation=10.0, fault_after=60.0))
        self.assertNamed(self.only_fails(d, "revocation")[0], req["seq"])

    def test_a_revocation_the_cli_could_not_confirm_still_revokes(self):
        d, req = self.late_run(1.5, 2.0)
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e | {"rc": 1, "said": "no gateway answered"} if e["kind"] == "revoke" else e
            for e in evs])
        v = self.only_fails(d, "revocation")
        self.assertNamed(v[0], req["seq"])
        self.assertIn("1 unconfirmed by the CLI", check.check(d).result("revocation").figure)

    def test_an_admission_within_the_margin_passes(self):
        d, _ = self.late_run(0.8, 2.0)
        self.assertIn("worst 0.80 s late", self.passes(d).result("revocation").figure)

    def test_a_store_fault_in_progress_at_the_revocation_delays_the_deadline(self):
        faults = [fault("partition", 1, REVOKE_C - 5, REVOKE_C + 3, ["gw2"])]
        self.passes(self.late_run(6.0, 4.0, faults)[0])  # fault end + 5 s + 1 s: T + 9
        d, req = self.late_run(9.5, 7.0, faults)
        self.assertNamed(self.only_fails(d, "revocation")[0], req["seq"])

    def test_a_rotated_key_is_revoked_at_overlap_until(self):
        d = self.run_dir()
        rotate = {"kind": "rotate", "t": S + 50, "key": "key_b", "successor": "key_b2",
                  "quota": "customer:acme", "overlap_until": S + 100}
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + [rotate])
        late = first(self.history(d), key="key_b", status=200, when=lambda r: r["sent"] > S + 101)
        self.assertNamed(self.only_fails(d, "revocation")[0], late["seq"])


class Metering(CheckTest):
    def usage_line(self, d, key, node=None, at=S + 30):
        """(file, event) of key's usage in the minute holding `at` (S+30: a healthy one)."""
        minute = rfc3339(int(at) // 60 * 60)
        for path in self.meter_files(d):
            for ev in read_ndjson(path):
                if (ev["type"] == check.USAGE and ev["data"]["key_id"] == key
                        and ev["data"]["minute"] == minute
                        and node in (None, os.path.basename(path).split(".")[0])):
                    return path, ev
        raise AssertionError("no such usage event")

    def meter_less(self, d, key, node, less, at=S + 30):
        """Takes `less` units off key's usage on node in the minute holding `at`, and off
        Redis's day (units neither metered nor counted: the day check stays consistent, the
        minute alone is judged)."""
        path, ev = self.usage_line(d, key, node, at)
        data = ev["data"] | {"cost": ev["data"]["cost"] - less}
        edit_ndjson(path, lambda evs: [e if e["id"] != ev["id"] else e | {"data": data}
                                       for e in evs])
        end = read_json(d, "end.json")
        end["redis"][check.key_table(KEYS, []).get(key, check.Key(None, key)).quota][
            "windows"]["86400"][1] -= less
        write_json(os.path.join(d, "end.json"), end)
        return ev

    def admitted(self, d, key, node, at):
        """The units the clients saw admitted for key on node in the minute holding `at`."""
        return sum(r["cost"] for r in self.history(d) if r["key"] == key and r["node"] == node
                   and r["status"] == 200 and int(r["sent"]) // 60 == int(at) // 60)

    def test_a_usage_event_one_unit_off_fails(self):
        d = self.run_dir()
        ev = self.meter_less(d, "key_b", "gw1", -1)
        v = self.only_fails(d, "metering")
        self.assertIn(ev["id"], [r.get("id") for r in v[0]["records"]])
        self.assertIn("key_b minute 11:07:00Z on gw1: metered 11 units", v[0]["what"])

    def test_over_metering_fails_even_in_a_minute_a_fault_excuses(self):
        """gw1 partitioned: its minute may be short, never over."""
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("partition", 2, S + 25, S + 35, ["gw1"])]
        for over, ok in ((0, True), (1, False)):
            with self.subTest(over=over):
                d = self.run_dir(faults=faults)
                _, ev = self.usage_line(d, "key_b", "gw1")
                metered = ev["data"]["cost"]
                self.assertLess(metered, self.admitted(d, "key_b", "gw1", S + 30))
                self.meter_less(d, "key_b", "gw1",
                                metered - self.admitted(d, "key_b", "gw1", S + 30) - over)
                if ok:
                    self.assertIn("fault partition", self.passes(d).result("metering").figure)
                else:
                    self.assertIn(ev["id"], [r.get("id") for r in
                                             self.only_fails(d, "metering")[0]["records"]])

    def test_a_minute_metered_short_needs_its_nodes_store_calls_that_timed_out(self):
        """gw1's key_b minute 5 units short: one timed-out call of gw1 counted in that minute
        (or within a second of it) allows the highest cost, 5; not 6, and not another node's,
        nor one counted 2 s after the minute."""
        end = (int(S + 30) // 60 + 1) * 60
        for less, node, at, allowed in ((5, "gw1", S + 30, 5), (5, "gw1", end + 0.5, 5),
                                        (6, "gw1", S + 30, 5), (5, "gw2", S + 30, 0),
                                        (5, "gw1", end + 1.5, 0)):
            with self.subTest(less=less, node=node, at=at - S):
                d = self.run_dir()
                self.meter_less(d, "key_b", "gw1", less)
                self.add_timeouts(d, node, at)
                if less <= allowed:
                    self.assertIn(f"{less} units short in 1",
                                  self.passes(d).result("metering").figure)
                else:
                    self.assertIn(f"{less} short, {allowed} allowed",
                                  self.only_fails(d, "metering")[0]["what"])

    def test_calls_that_timed_out_outside_faults_are_decided_alone_and_counted(self):
        """gw2's store calls time out at S+40..S+44 (the store counting them all the same): its
        decisions are its own, not metered, and its samples count them: its minutes short and
        Redis's day past metering, within the counted timeouts. Without the samples (an older
        soak) nothing allows them, and key_a's day, filled by the store, also reads as over
        its limit, as the store decided those calls twice."""
        load = [(S + 40.2 + i, "key_t", "gw2", "listPets") for i in range(4)]
        bugs = {"timeouts": {"gw2": [(S + 40, S + 44, True)]}}
        figure = self.passes(self.run_dir(extra_load=load, bugs=bugs)).result("metering").figure
        self.assertIn("units short in", figure)
        self.assertIn("8 timed-out store calls by samples", figure)
        d = self.run_dir(extra_load=load, bugs=bugs, samples=False)
        self.assertEqual(self.failing(d), ["quota", "metering"])
        what = [v["what"] for v in check.check(d).result("metering").violations]
        self.assertIn("key_t minute 11:07:00Z on gw2: metered 0 units, clients saw 4 admitted: "
                      "4 short, 0 allowed (0 store calls that timed out x 5)", what)
        self.assertIn("key_t day: Redis counted 4, metering 0 (allowed: 0 short, 0 over)", what)

    def test_faults_excuse_only_the_nodes_they_touch(self):
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("partition", 2, S + 25, S + 35, ["gw2"])]
        for node, ok in (("gw2", True), ("gw1", False)):
            with self.subTest(node=node):
                d = self.run_dir(faults=faults)
                self.meter_less(d, "key_b", node, 2)
                if ok:
                    self.passes(d)
                else:
                    self.assertIn("on gw1: metered", self.only_fails(d, "metering")[0]["what"])

    def test_an_upgrade_loses_no_usage(self):
        """The old process writes the minute in progress at its stop: an upgrade excuses
        nothing (it did before: only spool_full and backend_restart were lossless)."""
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("node_upgrade", 2, S + 30, S + 31, ["gw1"])]
        d = self.run_dir(faults=faults)
        self.passes(d)
        self.meter_less(d, "key_b", "gw1", 1)
        self.assertIn("on gw1: metered", self.only_fails(d, "metering")[0]["what"])

    def test_a_minute_lost_with_a_killed_node_is_excused_on_that_node_only(self):
        for killed, ok in (("gw1", True), ("gw3", False)):
            with self.subTest(killed=killed):
                d = self.run_dir()
                path, ev = self.usage_line(d, "key_b", "gw1")
                edit_ndjson(path, lambda evs: [e for e in evs if e["id"] != ev["id"]])
                self.assertIn("10 short", self.only_fails(d, "metering")[0]["what"])
                kill = [{"kind": "kill", "t": S + 110, "node": killed},  # the minute after
                        {"kind": "start", "t": S + 115, "node": killed}]
                edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + kill)
                if ok:
                    self.assertIn("node kill", self.passes(d).result("metering").figure)
                else:
                    self.assertIn("on gw1", self.only_fails(d, "metering")[0]["what"])

    def test_a_possibly_admitted_request_may_count_in_the_next_minute(self):
        """gw1 killed at S+62..S+72: key_a's GET at S+66.1 met a refused connection on its
        retry, but its first attempt failed on a reused connection: possibly admitted, and
        within the client's timeout of the minute at S+80, it may be metered in either. One at
        S+63.1 (16.9 s before) may not count in the next minute."""
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("node_kill", 2, S + 62, S + 72, ["gw1"])]
        for sent, ok in ((S + 66.1, True), (S + 63.1, False)):
            with self.subTest(sent=sent - S):
                d = self.run_dir(faults=faults)
                req = first(self.history(d), key="key_a", sent=sent)
                self.assertEqual((req["node"], req["error"]), ("gw1", "ConnectionRefusedError"))
                edit_ndjson(os.path.join(d, "history.ndjson"), lambda rs: [
                    r | {"attempts": 2, "first_error": "ConnectionResetError"}
                    if r["seq"] == req["seq"] else r for r in rs])
                self.meter_less(d, "key_a", "gw1", -1, at=S + 100)
                if ok:
                    self.passes(d)
                else:
                    self.assertIn("key_a minute 11:08:00Z on gw1: metered",
                                  self.only_fails(d, "metering")[0]["what"])

    def test_an_event_the_webhook_never_delivered_fails(self):
        d = self.run_dir()
        _, ev = self.usage_line(d, "key_a")
        edit_ndjson(os.path.join(d, "receiver.ndjson"),
                    lambda evs: [e for e in evs if e["id"] != ev["id"]])
        v = self.only_fails(d, "metering")
        self.assertIn(ev["id"], v[0]["what"])

    def test_an_undelivered_event_is_excused_only_when_its_process_stopped_on_a_full_spool(self):
        for upgraded, ok in ((True, True), (False, False)):
            with self.subTest(upgraded=upgraded):
                _, ev = self.usage_line(self.run_dir(), "key_a", "gw2")
                made = check.unix(ev["time"])
                full = fault("spool_full", 7, made - 5, made + 10)
                events = [{"kind": "upgrade", "t": made - 7, "node": "gw2"}] if upgraded else []
                d = self.run_dir(faults=[fault("backend_restart", 1, S + 90, S + 93), full],
                                 events=events)
                edit_ndjson(os.path.join(d, "receiver.ndjson"),
                            lambda evs: [e for e in evs if e["id"] != ev["id"]])
                if ok:
                    self.assertIn("1 lost with a process stopped",
                                  self.passes(d).result("metering").figure)
                else:
                    self.assertIn(ev["id"], self.only_fails(d, "metering")[0]["what"])

    def test_batches_left_in_a_spool_fail(self):
        d = self.run_dir()
        end = read_json(d, "end.json")
        write_json(os.path.join(d, "end.json"), end | {"spool_left": {"gw1": 0, "gw3": 2}})
        self.assertIn("gw3", self.only_fails(d, "metering")[0]["what"])


class MeteringDay(CheckTest):
    def redis_day(self, d, quota, delta, timeouts=0):
        end = read_json(d, "end.json")
        end["redis"][quota]["windows"]["86400"][1] += delta
        end["store_timeouts"]["gw1"] = timeouts
        write_json(os.path.join(d, "end.json"), end)

    def test_redis_short_of_metering_needs_counts_lost_in_a_failover(self):
        """key_b's requests at S+98.35 and S+100.35 are within `loss` of a primary kill's start
        (S+100) and end (S+102): Redis may have lost their 2 units, not 3."""
        faults = [fault("backend_restart", 1, S + 90, S + 93), fault("primary_kill", 2, S + 100,
                                                                     S + 102)]
        for delta, ok in ((-2, True), (-3, False)):
            with self.subTest(redis_lost=-delta):
                d = self.run_dir(faults=faults)
                self.redis_day(d, "customer:acme", delta)
                if ok:
                    self.passes(d)
                else:
                    v = self.only_fails(d, "metering")
                    self.assertIn("customer:acme day", v[0]["what"])
                    self.assertIn("2 over", v[0]["what"])

    def test_redis_past_metering_needs_store_timeouts_counted_by_the_samples(self):
        """5 units (createPet, the highest cost) past metering: one timed-out call anywhere in
        the day allows it, by the samples; end.json's counter is read only without samples."""
        for samples, sampled, ended, ok in ((True, 1, 0, True), (True, 0, 1, False),
                                            (False, 0, 1, True), (False, 0, 0, False)):
            with self.subTest(samples=samples, sampled=sampled, end_json=ended):
                d = self.run_dir(samples=samples)
                self.redis_day(d, "key_a", 5, ended)
                if sampled:
                    self.add_timeouts(d, "gw3", S + 150)
                if ok:
                    figure = self.passes(d).result("metering").figure
                    self.assertIn(f"1 timed-out store calls by "
                                  f"{'samples' if samples else 'end.json'}", figure)
                else:
                    self.assertIn("key_a day", self.only_fails(d, "metering")[0]["what"])


class Notices(CheckTest):
    def ban(self, d):
        """(file, event) of the run's first ban event."""
        for path in self.meter_files(d):
            for ev in read_ndjson(path):
                if ev["type"] == check.BANNED:
                    return path, ev
        raise AssertionError("no ban event")

    def drop_first_ban(self, d):
        path, ev = self.ban(d)
        for p in (path, os.path.join(d, "receiver.ndjson")):
            edit_ndjson(p, lambda evs: [e for e in evs if e["id"] != ev["id"]])
        return first(self.history(d), code="api_key_banned")

    def test_a_ban_reported_by_two_nodes_fails(self):
        d = self.run_dir()
        path, ev = self.ban(d)
        other = os.path.join(d, "metering", ("gw3" if "gw1" in path else "gw1") + path[-11:])
        edit_ndjson(other, lambda evs: evs + [ev])
        v = self.only_fails(d, "notices")
        self.assertIn(f"{ev['id']} reported by 2 nodes", v[0]["what"])

    def test_one_ban_under_two_ids_fails(self):
        d = self.run_dir()
        path, ev = self.ban(d)
        until = int(check.unix(ev["data"]["banned_until"])) + 1
        twin = ev | {"id": f"{check.BANNED}:key_a:{until}",
                     "data": ev["data"] | {"banned_until": rfc3339(until)}}
        for p in (path, os.path.join(d, "receiver.ndjson")):
            edit_ndjson(p, lambda evs: evs + [twin])
        self.assertIn("reported under 2 ids", self.only_fails(d, "notices")[0]["what"])

    def test_a_missing_ban_event_fails(self):
        d = self.run_dir()
        banned = self.drop_first_ban(d)
        v = self.only_fails(d, "notices")
        self.assertNamed(v[0], banned["seq"])
        self.assertIn("has no pet.key.banned.v1 event", v[0]["what"])

    def test_a_missing_ban_event_is_excused_by_a_kill_of_any_node_within_a_second(self):
        """Any node: the one that decided the ban is not in the records when its event is
        missing."""
        for node, after, ok in [(n, 0.5, True) for n in NODES] + [("gw3", 3.5, False)]:
            with self.subTest(node=node, kill_after=after):
                d = self.run_dir()
                banned = self.drop_first_ban(d)
                kill = [{"kind": "kill", "t": banned["sent"] + after, "node": node},
                        {"kind": "start", "t": banned["sent"] + after + 3, "node": node}]
                edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + kill)
                if ok:
                    self.assertIn("1 unreported, excused", self.passes(d).result("notices").figure)
                else:
                    self.assertNamed(self.only_fails(d, "notices")[0], banned["seq"])

    def test_a_missing_ban_event_is_excused_by_timed_out_store_calls_of_any_node_just_before(self):
        """A call its node gave up on may land in Redis later (a partition's queued calls land
        as it ends) and start a ban nobody reports: excused when any node's samples counted
        store calls timing out within 2 s before the first banned 429; not by timeouts 4 s
        before, nor by a store window whose node counted none (a fault declared, nothing timed
        out)."""
        for node, before, ok in [(n, 1.0, True) for n in NODES] + [("gw2", 4.0, False)]:
            with self.subTest(node=node, timeouts_before=before):
                d = self.run_dir()
                banned = self.drop_first_ban(d)
                self.add_timeouts(d, node, banned["sent"] - before)
                if ok:
                    self.assertIn("1 by a node's timed-out store calls",
                                  self.passes(d).result("notices").figure)
                else:
                    self.assertNamed(self.only_fails(d, "notices")[0], banned["seq"])
        d = self.run_dir()
        banned = self.drop_first_ban(d)
        cut = {k: v for k, v in fault("partition", 99, 0, 0, ["gw1"]).items()
               if k not in ("start", "end")}
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + [
            cut | {"phase": "start", "t": banned["sent"] - 5},
            cut | {"phase": "end", "t": banned["sent"] - 0.5}])
        self.assertNamed(self.only_fails(d, "notices")[0], banned["seq"])

    def test_a_ban_event_no_client_saw_fails_unless_the_quota_was_quiet(self):
        key = KEYS["key_c"]
        for start, ok in ((S + 10, False), (S + 150, True)):
            with self.subTest(start=start):
                d = self.run_dir()
                ev = ban_event({"key": "key_c", "node": "gw2"},
                               check.Key(key["plan"], key["quota"]), start, start + 30)
                for p in (os.path.join(d, "metering", "gw2.2026-11-18"),
                          os.path.join(d, "receiver.ndjson")):
                    edit_ndjson(p, lambda evs: evs + [ev])
                if ok:
                    self.assertIn("1 reported but unseen", self.passes(d).result("notices").figure)
                else:
                    self.assertIn(ev["id"], self.only_fails(d, "notices")[0]["what"])

    def test_a_missing_threshold_event_fails(self):
        d = self.run_dir()
        gone = f"{check.THRESHOLD}:key_a:1d:{int(S // 86400)}:80"
        for p in self.meter_files(d) + [os.path.join(d, "receiver.ndjson")]:
            edit_ndjson(p, lambda evs: [e for e in evs if e["id"] != gone])
        v = self.only_fails(d, "notices")
        self.assertIn("key_a crossed 80 % of its day (used 56 of 70)", v[0]["what"])
        crossing = first(self.history(d), key="key_a",  # used 56: r = 70 - 56
                         when=lambda r: '"day";r=14;' in str(r["ratelimit"]))
        self.assertNamed(v[0], crossing["seq"])


class Errors(CheckTest):
    def plant(self, d, **fields):
        """Rewrites key_b's first 200 after S+30 with `fields`; returns its seq."""
        seq = first(self.history(d), key="key_b", status=200,
                    when=lambda r: r["sent"] > S + 30)["seq"]
        edit_ndjson(os.path.join(d, "history.ndjson"),
                    lambda rs: [r | fields if r["seq"] == seq else r for r in rs])
        return seq

    def test_a_500_fails(self):
        d = self.run_dir()
        seq = self.plant(d, status=500, code="internal", ratelimit=None, limit=None,
                         remaining=None, reset=None)
        self.assertNamed(self.only_fails(d, "errors")[0], seq)

    def test_a_502_outside_a_backend_restart_fails(self):
        d = self.run_dir()
        seq = self.plant(d, status=502, code="bad_gateway")
        self.assertNamed(self.only_fails(d, "errors")[0], seq)

    def test_no_answer_outside_any_fault_window_fails(self):
        d = self.run_dir()
        seq = self.plant(d, status=None, recv=None, error="timeout", code=None, ratelimit=None,
                         limit=None, remaining=None, reset=None)
        v = self.only_fails(d, "errors")
        self.assertNamed(v[0], seq)
        self.assertIn("no answer from", v[0]["what"])

    def test_a_refused_retry_after_a_first_attempt_that_failed_is_possibly_admitted(self):
        """The first attempt failed on a reused connection before any answer: it may have
        reached the gateway; the retry's refused connection does not make it spend nothing."""
        refused = {"status": None, "recv": None, "error": "ConnectionRefusedError", "attempts": 1}
        self.assertEqual(check.classify(refused), check.REFUSED)
        retried = refused | {"attempts": 2, "first_error": "ConnectionResetError"}
        self.assertEqual(check.classify(retried), check.POSSIBLE)
        self.assertEqual(check.first_attempt_units(retried, 5), 0)  # possibly, once
        answered = retried | {"status": 200, "error": None}
        self.assertEqual(check.classify(answered), check.ADMITTED)
        self.assertEqual(check.first_attempt_units(answered, 5), 5)  # and its first attempt
        self.assertEqual(check.classify(refused | {"error": "timeout"}), check.POSSIBLE)

    def test_no_answer_from_a_killed_node_is_excused(self):
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("node_kill", 2, S + 100, S + 106, ["gw3"])]
        report = self.passes(self.run_dir(faults=faults))
        self.assertIn("no answer: ", report.result("errors").figure)


class SlotsAndReady(CheckTest):
    def test_a_lease_left_at_the_end_fails(self):
        d = self.run_dir()
        end = read_json(d, "end.json")
        write_json(os.path.join(d, "end.json"), end | {"leases": end["leases"] | {"key_a": 1}})
        self.assertIn("key_a still holds 1 leases", self.only_fails(d, "slots")[0]["what"])

    def test_a_node_ready_40_s_after_the_last_fault_fails(self):
        d = self.run_dir()
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e | {"t": S + 93 + 40} if e["kind"] == "ready" and e["node"] == "gw2" else e
            for e in evs])
        v = self.only_fails(d, "ready")
        self.assertIn("gw2 ready 40.0 s after the last fault", v[0]["what"])

    def test_each_node_fault_needs_its_own_ready_within_30_s_of_its_end(self):
        """A node fault ends when its process started; its `ready` (after: its id) must come
        within ready_within of that, and must come."""
        for name in sorted(check.NODE_FAULTS):
            faults = [fault("backend_restart", 1, S + 90, S + 93),
                      fault(name, 2, S + 100, S + 104, ["gw3"])]
            for moved, ok in ((30.0, True), (31.0, False), (None, False)):
                with self.subTest(fault=name, ready_after=moved):
                    d = self.run_dir(faults=faults)
                    edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
                        e | {"t": S + 104 + moved} if e.get("after") == 2 else e
                        for e in evs if moved is not None or e.get("after") != 2])
                    if ok:
                        self.assertIn("1 node faults, slowest ready 30.0 s after its end",
                                      self.passes(d).result("ready").figure)
                        continue
                    what = self.only_fails(d, "ready")[0]["what"]
                    self.assertIn(f"gw3 ready 31.0 s after {name} 2 ended (30 s allowed)"
                                  if moved else f"{name} 2 of gw3 ended at 11:08:24Z with no "
                                  "ready event after it", what)

    def test_a_node_never_ready_fails(self):
        d = self.run_dir()
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e for e in evs if not (e["kind"] == "ready" and e["node"] == "gw3")])
        self.assertIn("gw3 never ready", self.only_fails(d, "ready")[0]["what"])


if __name__ == "__main__":
    unittest.main()
