#!/usr/bin/env python3
"""Tests of the soak checker (check.py) on small synthetic runs.

    python3 -m unittest tests/soak/test_check.py      (from the repository root)
    python3 tests/soak/test_check.py

`build_run` writes a run folder the way the soak would: a load of requests is answered by
`Fleet`, a small model of three gateway nodes on one store that keeps every promise (unless a
test gives it a bug), and its history, metering files, webhook receipts and end state are
written out. The baseline passes every invariant; each test then plants one violation, in the
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
    no answer from a killed node. `bugs`: {"over_admit": {seq}} admits those regardless of the
    windows; {"late_revocation": {node: seconds}} makes a node apply revocations that late."""

    def __init__(self, faults, events, bugs):
        self.faults, self.events, self.bugs = faults, events, bugs
        self.counts, self.strikes, self.ban, self.local = {}, {}, {}, defaultdict(int)
        self.usage = defaultdict(lambda: [0, 0, 0])  # (node, key, op, minute): adm, cost, ref
        self.notices = []  # (node, event)
        self.keys = check.key_table(KEYS, events)

    def during(self, names, node, t, store=None):
        return any(f["name"] in names and node in f["nodes"] and f["start"] <= t <= f["end"]
                   for f in self.faults if store is None or f["store"] == store)

    def revoked(self, key, node, t):
        for e in self.events:
            if e["kind"] == "revoke" and e["key"] == key:
                late = self.bugs.get("late_revocation", {}).get(node, 0.3)
                healed = [f["end"] for f in self.faults if f["store"] and node in f["nodes"]
                          and f["start"] <= e["t"] <= f["end"]]
                return t >= max([e["t"]] + healed) + late
        return False

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
        limits = [(int(w), self.limit(info.plan, w, sent)) for w in plan["windows"]]
        if self.during(check.STORE_FAULTS, node, sent, store=True):
            return self.fallback(req, info, limits, cost)
        return self.store(req, info, limits, cost)

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


def build_run(root, extra_load=(), faults=None, events=(), bugs=None):
    """Writes a consistent run folder at `root`: by default the baseline (a backend restart
    at S+90..S+93, key_c revoked at REVOKE_C)."""
    faults = [fault("backend_restart", 1, S + 90, S + 93)] if faults is None else list(faults)
    timeline = [{"kind": "revoke", "t": REVOKE_C, "key": "key_c"}] + list(events)
    for f in faults:
        for phase in ("start", "end"):
            timeline.append({k: v for k, v in f.items() if k not in ("start", "end")}
                            | {"phase": phase, "t": f[phase]})
        if f["name"] == "node_kill":
            timeline += [{"kind": "kill", "t": f["start"], "node": f["nodes"][0]},
                         {"kind": "start", "t": f["end"], "node": f["nodes"][0]}]
    if faults:
        last = max(f["end"] for f in faults)
        timeline.append({"kind": "last_fault_end", "t": last})
        timeline += [{"kind": "ready", "t": last + 1.5, "node": n, "after": "last_fault"}
                     for n in NODES]
    timeline.sort(key=lambda e: e["t"])
    fleet = Fleet(faults, timeline, bugs or {})
    load = sorted(base_load() + list(extra_load))
    history = [fleet.answer(seq, *x) for seq, x in enumerate(load, 1)]
    write_records(root, fleet, history, timeline)
    return root


def write_records(root, fleet, history, timeline):
    os.makedirs(os.path.join(root, "metering"))
    setup = {"seed": 7, "minutes": 2, "nodes": NODES, "key_prefix": "pet:soak",
             "margins": dict(check.MARGINS), "plans": PLANS, "keys": KEYS,
             "started": S, "load_end": S + 120, "ended": S + 210}
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

    def assertNamed(self, violation, seq):
        self.assertIn(seq, [r.get("seq") for r in violation["records"]], violation)


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
                         ["quota", "revocation", "metering", "notices", "errors", "slots", "ready"])
        history = self.history(d)
        minute = defaultdict(int)  # the fixture exercises what the invariants look at
        for r in history:
            if r["key"] == "key_a" and r["status"] == 200:
                minute[int(r["sent"] // 60)] += r["cost"]
        self.assertIn(30, minute.values(), "a minute filled exactly")
        self.assertTrue(first(history, code="api_key_banned"))
        self.assertTrue(first(history, status=502))
        self.assertTrue(first(history, key="key_c", status=401))
        self.assertIn("2 seen by clients", report.results[3].figure)
        self.assertIn("2 crossings seen", report.results[3].figure)

    def test_a_run_without_faults_passes(self):
        report = self.passes(self.run_dir(faults=[]))
        self.assertIn("no faults", report.results[-1].figure)

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

    def test_an_admission_within_the_margin_passes(self):
        d, _ = self.late_run(0.8, 2.0)
        self.assertIn("worst 0.80 s late", self.passes(d).results[1].figure)

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
    def usage_line(self, d, key, node=None):
        """(file, event) of key's usage in the minute holding S+30 (a healthy one)."""
        minute = rfc3339(int(S + 30) // 60 * 60)
        for path in self.meter_files(d):
            for ev in read_ndjson(path):
                if (ev["type"] == check.USAGE and ev["data"]["key_id"] == key
                        and ev["data"]["minute"] == minute
                        and node in (None, os.path.basename(path).split(".")[0])):
                    return path, ev
        raise AssertionError("no such usage event")

    def test_a_usage_event_one_unit_off_fails(self):
        d = self.run_dir()
        path, ev = self.usage_line(d, "key_b")
        edit_ndjson(path, lambda evs: [e if e["id"] != ev["id"] else
                                       e | {"data": e["data"] | {"cost": e["data"]["cost"] + 1}}
                                       for e in evs])
        v = self.only_fails(d, "metering")
        self.assertIn(ev["id"], [r.get("id") for r in v[0]["records"]])
        self.assertIn("key_b minute", v[0]["what"])

    def test_a_minute_metered_short_needs_a_store_call_that_timed_out(self):
        for timeouts, ok in ((1, True), (0, False)):
            with self.subTest(timeouts=timeouts):
                d = self.run_dir()
                path, ev = self.usage_line(d, "key_b")
                less = {"cost": ev["data"]["cost"] - 1, "admitted": ev["data"]["admitted"] - 1}
                edit_ndjson(path, lambda evs: [e if e["id"] != ev["id"] else
                                               e | {"data": e["data"] | less} for e in evs])
                end = read_json(d, "end.json")
                write_json(os.path.join(d, "end.json"),
                           end | {"store_timeouts": {n: 0 for n in end["store_timeouts"]}
                                  | {"gw1": timeouts}})
                if ok:
                    self.passes(d)
                else:
                    self.assertIn("1 units metered short", self.only_fails(d, "metering")[0]["what"])

    def test_a_minute_lost_with_a_killed_node_is_excused(self):
        d = self.run_dir()
        path, ev = self.usage_line(d, "key_b", "gw1")
        edit_ndjson(path, lambda evs: [e for e in evs if e["id"] != ev["id"]])
        self.assertIn("metered short", self.only_fails(d, "metering")[0]["what"])
        kill = [{"kind": "kill", "t": S + 110, "node": "gw1"},
                {"kind": "start", "t": S + 115, "node": "gw1"}]
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + kill)
        self.assertIn("node kill", self.passes(d).results[2].figure)

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
                    self.assertIn("1 lost with a process stopped", self.passes(d).results[2].figure)
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

    def test_redis_past_metering_needs_store_timeouts(self):
        for timeouts, ok in ((1, True), (0, False)):
            with self.subTest(timeouts=timeouts):
                d = self.run_dir()
                self.redis_day(d, "key_a", 5, timeouts)  # createPet costs 5: the highest cost
                if ok:
                    self.passes(d)
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

    def test_a_missing_ban_event_is_excused_by_a_kill_within_a_second(self):
        for after, ok in ((0.5, True), (3.5, False)):
            with self.subTest(kill_after=after):
                d = self.run_dir()
                banned = self.drop_first_ban(d)
                kill = [{"kind": "kill", "t": banned["sent"] + after, "node": "gw3"},
                        {"kind": "start", "t": banned["sent"] + after + 3, "node": "gw3"}]
                edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: evs + kill)
                if ok:
                    self.assertIn("1 unreported, excused", self.passes(d).results[3].figure)
                else:
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
                    self.assertIn("1 reported but unseen", self.passes(d).results[3].figure)
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

    def test_no_answer_from_a_killed_node_is_excused(self):
        faults = [fault("backend_restart", 1, S + 90, S + 93),
                  fault("node_kill", 2, S + 100, S + 106, ["gw3"])]
        report = self.passes(self.run_dir(faults=faults))
        self.assertIn("no answer: ", report.results[4].figure)


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

    def test_a_node_never_ready_fails(self):
        d = self.run_dir()
        edit_ndjson(os.path.join(d, "events.ndjson"), lambda evs: [
            e for e in evs if not (e["kind"] == "ready" and e["node"] == "gw3")])
        self.assertIn("gw3 never ready", self.only_fails(d, "ready")[0]["what"])


if __name__ == "__main__":
    unittest.main()
