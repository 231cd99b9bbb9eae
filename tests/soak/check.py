#!/usr/bin/env python3
"""The soak's checker: did the gateway keep its promises during one run?

    python3 tests/soak/check.py RUN_DIR [--json]

Jepsen-style, it reads only the run's records (setup.json, history.ndjson, events.ndjson,
metering/, receiver.ndjson, end.json) and trusts nothing the gateway says about itself, except
the clients' view of each answer (status, code, rate-limit headers) and the figures the docs
allow: each node's counted store errors, timeouts and fallback gauge (its `store_sample`
events, scraped from /metrics; else end.json's store_timeouts). Its margins are its own
(`MARGINS`): a run cannot loosen its judge. Exit 0: every invariant holds; 1: one fails; 2:
the records are missing or unreadable.

Read it top to bottom: 1. load the records; 2. derive facts from them (keys and their quotas,
fault windows, store trouble, where each request counts); 3. one function per invariant, each
saying why it is stated the way it is; 4. the report. Units are integers throughout; times are
Unix seconds.
"""

import argparse
import bisect
import datetime
import json
import math
import os
import re
import sys
from collections import Counter, defaultdict, namedtuple

Result = namedtuple("Result", "name ok figure violations")
Fault = namedtuple("Fault", "name id start end lo hi nodes store loses")
Key = namedtuple("Key", "plan quota")

MARGINS = {"fault_before": 1.0, "fault_after": 5.0, "revocation": 1.0, "loss": 2.0,
           "ready_within": 30.0, "kill_notice": 1.0}
STORE_FAULTS = {"primary_kill", "redis_restart", "partition", "redis_latency"}
COUNT_LOSING_FAULTS = {"primary_kill", "redis_restart"}
# They lose no usage events: the spool and the backend hold none, and an upgrade's old process
# writes the minute in progress at its stop (docs/src/events.md).
LOSSLESS_FAULTS = {"spool_full", "backend_restart", "node_upgrade"}
NODE_FAULTS = {"node_kill", "node_upgrade"}  # each ends when its process started; then `ready`
ADMITTED_ERRORS = {(502, "bad_gateway"), (503, "overloaded"), (504, "gateway_timeout")}
ADMITTED, POSSIBLE, REFUSED = "admitted", "possible", "refused"
USAGE, BANNED, THRESHOLD = "pet.usage.v1", "pet.key.banned.v1", "pet.quota.threshold.v1"
UNWRITTEN_TAIL = 45.0  # a minute ending this close to `ended` may not be in the files yet
BAN_SLACK = 2  # seconds: one ban's X-RateLimit-Reset varies by ±1 s, its event's end by 2
THRESHOLD_KILL = 2.0  # a kill this soon after a crossing may have lost its notice
CLIENT_TIMEOUT = 15.0  # an unanswered request reached the gateway at most this long after sent
LEASE_SECS = 10  # the soak's concurrency_lease_secs: a dead holder's place lingers this long
RELEASE_SLACK = 0.5  # a place is given back on the lane's next store run, just after the answer
BAN_STRIKES = 10  # the soak's [ban] strikes: refusals allowed in a minute, the next one bans
KEY_SYNC = 1.0  # an issued key (or a successor) is known to every node this long after
KEYS_CMD_SECS = 60.0  # a `keys` command that failed may have written this long before its exit
LAG_MAX = 1.0  # seconds the load generator's scheduler may run late before the load is not held
COVERAGE_AFTER = 240.0  # a run this long must have exercised metering, revocation and bans
DAY = 86400
NAMES = {1: "second", 60: "minute", 3600: "hour", DAY: "day"}


class RecordsError(Exception):
    """The run's records are missing or cannot be read: nothing can be checked (exit 2)."""


# ---------------------------------------------------------------------------------------------
# 1. Loading the records

def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RecordsError(f"{path}: {e}") from e


def read_ndjson(path, bad=None):
    """The objects of an NDJSON file, each keeping its line verbatim (`_line`) for the report.
    A line that does not parse is unreadable records (exit 2), or goes to `bad` if given."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    if bad is None:
                        raise RecordsError(f"{path}:{n}: {e}") from e
                    bad.append(f"{path}:{n}: {line.strip()[:200]}")
                    continue
                obj["_line"] = line.rstrip("\n")
                out.append(obj)
    except OSError as e:
        raise RecordsError(f"{path}: {e}") from e
    return out


def read_metering(folder):
    """Every line of every `<node>.YYYY-MM-DD` file, tagged with its node (`_node`). Lines that
    do not parse are kept aside: the docs promise no half-written line, so they are a finding."""
    if not os.path.isdir(folder):
        raise RecordsError(f"{folder}: no metering folder")
    lines, bad = [], []
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"(.+)\.(\d{4}-\d{2}-\d{2})", name)
        if m:
            for ev in read_ndjson(os.path.join(folder, name), bad):
                ev["_node"] = m.group(1)
                lines.append(ev)
    return lines, bad


def unix(value):
    """Unix seconds of an RFC 3339 time (what the gateway writes: `2026-11-18T11:07:40Z`), or
    of a number, in case a writer ever gives one."""
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def iso(t):
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%SZ")


def window_name(length):
    """A window's name in the RateLimit header (the gateway's `Every::name`)."""
    return NAMES.get(length) or window_spec(length)


def window_spec(length):
    """A window as a plan writes it (`Every::spec`): `1d`, `90m`, `10s`; in threshold ids."""
    for unit, secs in (("d", DAY), ("h", 3600), ("m", 60)):
        if length % secs == 0:
            return f"{length // secs}{unit}"
    return f"{length}s"


def rate_windows(header):
    """`"minute";r=12;t=8, "day";r=388;t=51342` -> {"minute": (12, 8), "day": (388, 51342)}."""
    out = {}
    for item in (header or "").split(","):
        name, *params = item.strip().split(";")
        kv = dict(p.strip().split("=", 1) for p in params if "=" in p)
        try:
            out[name.strip().strip('"')] = (int(kv["r"]), int(kv["t"]))
        except (KeyError, ValueError):
            continue
    return out


def classify(req):
    """Whether a request spent its cost. 2xx (and 3xx) and the 502/503/504 the docs say keep what
    was spent: admitted. 401 and 429: refused. No answer, or a 5xx of unknown effect (500, 503
    internal: the store may have counted it before failing): possibly; but a connection
    refused reached no gateway process, so spent nothing, unless it was the retry of a first
    attempt that failed on a reused connection (`first_error`): that one may have reached the
    gateway. Another 4xx with the plan's RateLimit header is the backend's answer to a forwarded
    request: possibly (upper bounds count it, lower bounds do not); without it the gateway
    refused before counting."""
    s = req.get("status")
    if s is None:
        refused = "ConnectionRefused" in str(req.get("error")) and not req.get("first_error")
        return REFUSED if refused else POSSIBLE
    if s >= 500 and (s, req.get("code")) not in ADMITTED_ERRORS:
        return POSSIBLE
    if s < 400 or s >= 500:
        return ADMITTED
    if s in (401, 429):
        return REFUSED
    return POSSIBLE if req.get("ratelimit") else REFUSED


def first_attempt_units(req, cost):
    """Units the first attempt of a retried GET may have spent: it failed on a reused
    connection before any answer, so the gateway may have admitted it (and metered it) before
    the connection broke. When the retry met a refused connection the request as a whole is
    already possibly admitted (classify), so nothing is added twice."""
    if not req.get("first_error"):
        return 0
    retry_refused = req.get("status") is None and "ConnectionRefused" in str(req.get("error"))
    return 0 if retry_refused else cost


# ---------------------------------------------------------------------------------------------
# 2. The run: records plus the facts every invariant shares

class Run:
    """One run's records, read once, and what they say about keys, faults and requests."""

    def __init__(self, run_dir):
        join = lambda name: os.path.join(run_dir, name)  # noqa: E731
        self.setup = read_json(join("setup.json"))
        self.history = read_ndjson(join("history.ndjson"))
        self.events = read_ndjson(join("events.ndjson"))
        self.meter_lines, self.bad_lines = read_metering(join("metering"))
        self.receiver = read_ndjson(join("receiver.ndjson"))
        self.end = read_json(join("end.json"))
        try:
            self.derive()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecordsError(f"{run_dir}: records malformed: {e!r}") from e

    def derive(self):
        """The facts every invariant shares. The margins are the checker's own (setup.json's
        are not read: a run must not be able to loosen its own judge)."""
        s = self.setup
        self.history.sort(key=lambda r: r["sent"])
        self.events.sort(key=lambda e: e["t"])
        samples = [e for e in self.events if e["kind"] == "store_sample"]
        self.events = [e for e in self.events if e["kind"] != "store_sample"]
        self.nodes, self.plans = list(s["nodes"]), s["plans"]
        self.margins = dict(MARGINS)
        self.started, self.load_end, self.ended = s["started"], s["load_end"], s["ended"]
        self.keys = key_table(s["keys"], self.events)
        self.quota_plans = defaultdict(set)
        for k in self.keys.values():
            self.quota_plans[k.quota].add(k.plan)
        self.faults = fault_windows(self.events, self.nodes, self.margins, self.ended)
        self.derive_store(samples)
        loss = self.margins["loss"]
        self.loss_spans = [span for f in self.faults if f.loses
                           for span in ((f.start - loss, f.start), (f.end - loss, f.end))]
        self.kills, self.restarts = kills_and_restarts(self.events, self.faults, self.ended)
        self.edits = defaultdict(list)
        for e in self.events:
            if e["kind"] == "plan_edit":
                self.edits[(e["plan"], str(e["window"]))].append((e["t"], int(e["limit"])))
        self.meter, self.meter_nodes = dedupe(self.meter_lines)
        self.max_cost = max([1] + [int(c) for p in self.plans.values()
                                   for c in p.get("cost", {}).values()])
        self.by_quota = defaultdict(list)
        for req in self.history:
            self.describe(req)
            if req["_quota"] is not None:
                self.by_quota[req["_quota"]].append(req)
        self.spent = self.spending()
        self.coverage, self._places = {}, {}

    def derive_store(self, samples):
        """Each node's store windows: the declared store faults that touch it, UNION the spans
        where its own samples show store trouble (counted, not guessed): with a 50 ms store
        deadline on shared cores, calls time out outside any injected fault, and each such call
        is decided by the node's local limiter (the docs: "a call that misses it decides by
        on_store_error"), which is what every store-fault allowance is for, but only where the
        gateway itself counted it. Also the spans its breaker was open (fallback), and the
        timed-out calls it counted, as running sums for `timeouts_between`."""
        m = self.margins
        self.has_samples = bool(samples)
        self.store_windows, self.fallback_spans, self.timeout_steps = {}, {}, {}
        self.local_steps = {}
        for n in self.nodes:
            steps = sample_steps([e for e in samples if e["node"] == n])
            trouble = [(s[0] - m["fault_before"], s[1] + m["fault_after"])
                       for s in steps if s[2] > 0 or s[4] or (s[5] or 0) > 0]
            declared = [(f.lo, f.hi) for f in self.faults if f.store and n in f.nodes]
            self.store_windows[n] = merged(declared + trouble)
            self.fallback_spans[n] = merged([(s[0] - m["fault_before"], s[1] + m["fault_after"])
                                             for s in steps if s[4]])
            self.timeout_steps[n] = running_sums(steps, 3)
            # Only where every sample counts them (a build that does, throughout).
            if steps and all(s[5] is not None for s in steps):
                self.local_steps[n] = [(s[0], s[1], s[5]) for s in steps]

    def describe(self, req):
        """Hidden fields (`_…`) on each request: class, cost, quota, parsed RateLimit header, and
        the units a first attempt may have spent (`_extra`)."""
        key = self.keys.get(req["key"])
        req["_cls"] = classify(req)
        req["_quota"] = key.quota if key else None
        req["_plan"] = key.plan if key else None
        costs = self.plans[key.plan].get("cost", {}) if key else {}
        req["_cost"] = int(costs.get(req["op"], 1)) if key else int(req.get("cost") or 1)
        req["_rl"] = rate_windows(req.get("ratelimit"))
        req["_extra"] = first_attempt_units(req, req["_cost"])

    def windows_of(self, quota):
        """The windows (lengths in seconds) that any plan of the quota's keys enforces."""
        return sorted({int(w) for p in self.quota_plans[quota]
                       for w in self.plans[p]["windows"] if str(w).isdigit()})

    def locally_enforced(self, quota, length):
        """Whether a node deciding alone enforces this window: those of a minute or shorter, or
        the quota's shortest when it has none (the docs' on_store_error = "local")."""
        return length <= 60 or length == min(self.windows_of(quota))

    def spending(self):
        """(quota, window length, instance) -> the requests that did or may have spent there."""
        spent = defaultdict(list)
        for req in self.history:
            if req["_quota"] is not None and req["_cls"] != REFUSED:
                for w in self.windows_of(req["_quota"]):
                    spent[(req["_quota"], w, instance(req, w))].append(req)
        return spent

    def places(self, quota):
        """(window length, instance) -> (sent times, running sums of units) of every unit of the
        quota that did or may have been counted there (`spend_places`), built on first use."""
        if quota not in self._places:
            rows = defaultdict(list)
            for req in self.by_quota[quota]:
                for w in self.windows_of(quota):
                    for inst, units, _ in spend_places(req, w):
                        rows[(w, inst)].append((req["sent"], units))
            out = {}
            for k, row in rows.items():
                total, sums = 0, []
                for _, units in row:
                    total += units
                    sums.append(total)
                out[k] = ([t for t, _ in row], sums)
            self._places[quota] = out
        return self._places[quota]

    def plan_limit(self, plan, length, s, e, pick=max):
        """The highest limit in force during [s, e) (`pick=min`: the lowest): the one at s, or
        any edit made before e. An edit reaches every node within the revocation margin, so one
        made just before s may not have been in force yet at s."""
        limit = self.plans[plan]["windows"].get(str(length))
        if limit is None:
            return 0
        edits = self.edits.get((plan, str(length)), [])
        reach = self.margins["revocation"]
        limit = ([lim for t, lim in edits if t <= s - reach] or [limit])[-1]
        return pick([limit] + [lim for t, lim in edits if s - reach < t < e])

    def limit_at(self, plan, length, t):
        limit = self.plans[plan]["windows"].get(str(length), 0)
        return ([lim for te, lim in self.edits.get((plan, str(length)), []) if te <= t]
                or [limit])[-1]

    def quota_limit(self, quota, length, s, e):
        """Keys sharing a quota normally share a plan; if not, the most generous one binds."""
        return max(self.plan_limit(p, length, s, e) for p in self.quota_plans[quota])

    def in_store_fault(self, node, t):
        """Whether node was in one of its store windows at t (it may have decided alone)."""
        return self.store_trouble(node, t, t)

    def store_trouble(self, node, a, b):
        """Whether one of node's store windows (merged, sorted) touches [a, b]."""
        windows = self.store_windows.get(node, [])
        i = bisect.bisect_right(windows, (b, math.inf)) - 1
        return i >= 0 and windows[i][1] >= a

    def down(self, node, a, b):
        """Whether node was down (from a kill to its next start) at some time in [a, b]."""
        return any(overlaps(lo, hi, a, b) for lo, hi in self.restarts.get(node, []))

    def timeouts_between(self, node, lo, hi):
        """The store calls node counted as timed out, by the samples taken in [lo, hi]."""
        return between(self.timeout_steps.get(node, []), lo, hi)

    def own_allowance(self, node, quota, s, e, limit):
        """The most units node may have admitted on its own decisions (not the store's) in the
        instance [s, e): its local limiter admits at most the limit alone, and each decision it
        made without the store counted one (`pet_gateway_store_local_decisions_total`, by the
        samples whose step touches the instance, 2 s either side) at the quota's highest cost
        (any quota's decisions count there: a bound, not a share). Where that count cannot be
        trusted the node gets the limit, or twice it: without the count in its samples, or no
        sample after the instance (a late or missed one), the limit; killed, started or upgraded
        near the instance (a count since the last sample dies with the process, a step across
        the restart reads only the new process's, and an upgrade's old and new processes each
        have a local limiter of their own), twice the limit."""
        lo, hi = s - 2, e + 2
        if self.down(node, lo - 2, hi + 2) or self.upgraded(node, lo - 2, hi + 2):
            return 2 * limit
        steps = self.local_steps.get(node)
        if not steps or steps[-1][1] < e:
            return limit
        cost = max([1] + [int(c) for p in self.quota_plans[quota]
                          for c in self.plans[p].get("cost", {}).values()])
        local = sum(n for p, t, n in steps if t >= lo and p <= hi)
        return min(limit, local * cost)

    def upgraded(self, node, a, b):
        """Whether node was upgraded (its old process deciding for up to STOP_AFTER_UPGRADE
        beside the new one) at some time in [a, b]."""
        return any(overlaps(e["t"], e["t"] + STOP_AFTER_UPGRADE, a, b) for e in self.events
                   if e["kind"] == "upgrade" and e["node"] == node)


def running_sums(steps, field):
    """(t, the sum of `field` over the steps up to t) for each step."""
    total, sums = 0, []
    for step in steps:
        total += step[field]
        sums.append((step[1], total))
    return sums


def between(sums, lo, hi):
    """What running `sums` added by the samples taken in [lo, hi]."""
    i = bisect.bisect_left(sums, (lo, -math.inf))
    j = bisect.bisect_right(sums, (hi, math.inf))
    if j <= i:
        return 0
    before = sums[i - 1][1] if i else 0
    return sums[j - 1][1] - before


def sample_steps(samples):
    """(prev t, t, errors, timeouts, fallback, local) for each two consecutive samples of one
    node: the counts between them (a counter that went down was reset by a restart: the delta is
    then the new value), whether its breaker was open at either end, and the decisions it made
    without the store (None where a sample does not say: records of a build before the count)."""
    steps = []
    for prev, cur in zip(samples, samples[1:]):
        delta = lambda f: cur[f] - prev[f] if cur[f] >= prev[f] else cur[f]  # noqa: E731
        known = prev.get("local") is not None and cur.get("local") is not None
        local = int(delta("local")) if known else None
        steps.append((prev["t"], cur["t"], int(delta("errors")), int(delta("timeouts")),
                      bool(prev.get("fallback") or cur.get("fallback")), local))
    return steps


def merged(spans):
    """Spans merged where they touch, sorted: what `Run.store_trouble` bisects."""
    out = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def key_table(setup_keys, events):
    """Every key the run knew: setup's, and those issued or rotated in during the run."""
    keys = {}
    for k, v in setup_keys.items():
        keys[k] = Key(v["plan"], v.get("quota") or quota_id(k, v.get("customer")))
    for e in events:
        if e["kind"] == "issue":
            keys[e["key"]] = Key(e["plan"], e.get("quota") or quota_id(e["key"], e.get("customer")))
        elif e["kind"] == "rotate" and e["key"] in keys:
            old = keys[e["key"]]
            keys[e["successor"]] = Key(e.get("plan") or old.plan, e.get("quota") or old.quota)
    return keys


def quota_id(key, customer):
    return f"customer:{customer}" if customer else key


def fault_windows(events, nodes, m, ended):
    """Faults paired by id, each with its window [start - fault_before, end + fault_after]; one
    never ended lasts until the run's end."""
    starts, ends = {}, {}
    for e in events:
        if e["kind"] == "fault":
            (starts if e["phase"] == "start" else ends)[e["id"]] = e
    faults = []
    for fid, s in starts.items():
        end = ends[fid]["t"] if fid in ends else ended
        name = s["name"]
        faults.append(Fault(name, fid, s["t"], end, s["t"] - m["fault_before"],
                            end + m["fault_after"], tuple(s.get("nodes") or nodes),
                            bool(s.get("store", name in STORE_FAULTS)),
                            bool(s.get("loses_counts", name in COUNT_LOSING_FAULTS))))
    return sorted(faults, key=lambda f: f.start)


def kills_and_restarts(events, faults, ended):
    """Kills (t, node), from `kill` events and node_kill faults; and per node the spans it was
    down, from a kill to its next `start` (or the run's end)."""
    kills = [(e["t"], e["node"]) for e in events if e["kind"] == "kill"]
    kills += [(f.start, n) for f in faults if f.name == "node_kill" for n in f.nodes]
    restarts = defaultdict(list)
    for t, node in sorted(set(k for k in kills if k[0] is not None)):
        back = [e["t"] for e in events
                if e["kind"] == "start" and e["node"] == node and e["t"] >= t]
        restarts[node].append((t, min(back) if back else ended))
    return sorted(set(kills)), restarts


def dedupe(lines):
    """The metering events a reader keeps (the first line of each id), and the nodes that wrote
    each id (two nodes writing one ban or threshold id is a double report, not a duplicate)."""
    kept, nodes = {}, defaultdict(set)
    for ev in lines:
        kept.setdefault(ev["id"], ev)
        nodes[ev["id"]].add(ev["_node"])
    return list(kept.values()), nodes


def instance(req, length):
    """The window instance a request counted in. The gateway's RateLimit entry says `t` seconds
    to that window's end, by the store's clock at the decision (same machine), so its end is
    the multiple of the length nearest to sent+t .. recv+t; else the instance of `sent`."""
    w = req["_rl"].get(window_name(length))
    if w is None or req.get("recv") is None:
        return int(req["sent"] // length)
    return round(((req["sent"] + req["recv"]) / 2 + w[1]) / length) - 1


def candidates(sent, length):
    """The instances an unanswered request may have counted in: the one it was sent in, and the
    next when that starts within the client's timeout (it may have reached the gateway late)."""
    i = int(sent // length)
    return [i, i + 1] if (i + 1) * length - sent <= CLIENT_TIMEOUT else [i]


def spend_places(req, length):
    """(instance, units, certain) for each place a request's units did or may have counted in
    windows of `length`: admitted, where its header says; possibly admitted, where its header
    says, or without one both candidate instances; a first attempt's units likewise."""
    out = []
    if req["_cls"] == ADMITTED:
        out.append((instance(req, length), req["_cost"], True))
    elif req["_cls"] == POSSIBLE:
        if req.get("recv") is not None and window_name(length) in req["_rl"]:
            out.append((instance(req, length), req["_cost"], False))
        else:
            out += [(i, req["_cost"], False) for i in candidates(req["sent"], length)]
    if req["_extra"]:
        out += [(i, req["_extra"], False) for i in candidates(req["sent"], length)]
    return out


def overlaps(lo, hi, s, e):
    return lo < e and hi >= s


def in_spans(t, spans):
    return any(lo <= t <= hi for lo, hi in spans)


def violation(what, records=(), most=5):
    """One broken promise: what, and the records that show it (the first `most`)."""
    return {"what": what, "records": list(records)[:most]}


# ---------------------------------------------------------------------------------------------
# 3. The invariants

def check_quota(run):
    """quota: admitted units per quota and window instance stay within three bounds.

    Only certain admissions count: a request with no answer is possibly admitted, and a check
    that can fail only on what certainly happened may not count it (a node killed while a
    request waited may have refused it; Jepsen's indeterminate operations). The limit is the
    highest in force during the instance (a plan edit can raise it mid-window). lost = the
    quota's units admitted in the `loss` seconds before a count-losing fault's start or end
    (failover, restart): counts Redis may not have replicated or persisted. A request is
    "inside" when its node was in one of its own store windows when sent (declared store faults
    and the store trouble its samples counted), else "outside": decided by the store (a node's
    local decisions all fall in its windows, as it counts each call that failed).

    Windows a node enforces alone (a minute or shorter; the docs' "N nodes admit up to N times
    those limits"), per instance, with own(n) = what node n may have admitted on its own
    decisions: the limit (its local limiter alone), or fewer, its decisions made without the
    store as its samples counted them times the highest cost (`Run.own_allowance`), so that a
    doubled limit cannot hide under ordinary store timeouts:
      - all admitted <= limit + the sum of own(n) over the nodes with a store window
        overlapping the instance + lost;
      - outside <= limit + lost: the store counts exactly what it decides, wherever the others
        were (this catches a node whose own limit is wrong while another is in fallback);
      - for each node n: n's inside + outside <= limit + own(n) + lost: the store admits at
        most limit + lost in all.
    Where F is 0 all three are the same bound. Longer windows (the day) pause in fallback,
    counting nothing: admitted <= limit + the units admitted inside + lost, which is outside <=
    limit + lost. One violation per instance: the first bound it breaks."""
    violations, used_allow, top = [], [], (0, 1)
    for (quota, w, inst), reqs in sorted(run.spent.items(), key=lambda kv: kv[0][2] * kv[0][1]):
        s, e = inst * w, (inst + 1) * w
        limit = run.quota_limit(quota, w, s, e)
        reqs = [r for r in reqs if r["_cls"] == ADMITTED]
        used = sum(r["_cost"] for r in reqs)
        if used * top[1] > top[0] * limit:
            top = (used, limit)
        if used > limit:
            used_allow.append(used - limit)
        broken = quota_bounds(run, quota, w, s, e, limit, reqs)
        if broken:
            violations.append(violation(
                f"{quota} {window_name(w)} from {iso(s)}: {broken[0]}", broken[1]))
    figure = (f"{len(run.spent):,} window instances; most used {top[0]}/{top[1]}; allowance "
              f"used in {len(used_allow)} (max +{max(used_allow, default=0)}); "
              f"{len(violations)} over (minute: all <= limit x (1 + nodes in a store window) + "
              "lost, outside <= limit + lost, a node's inside + outside <= 2 x "
              "limit + lost; day: outside <= limit + lost)")
    return Result("quota", not violations, figure, violations)


def quota_bounds(run, quota, w, s, e, limit, reqs):
    """The first bound of check_quota one instance breaks, as (what, the requests past it), or
    None."""
    lost = lost_units(run, reqs)
    used = sum(r["_cost"] for r in reqs)
    inside = [run.in_store_fault(r["node"], r["sent"]) for r in reqs]
    outside = [r for r, i in zip(reqs, inside) if not i]
    out_units = sum(r["_cost"] for r in outside)
    allow, why = allowance(run, quota, w, s, e, limit, used - out_units, lost)
    if used > limit + allow:
        return (f"{used} units admitted, limit {limit} + allowance {allow} ({why})",
                past(reqs, limit + allow))
    if not run.locally_enforced(quota, w):
        return None
    if out_units > limit + lost:
        return (f"{out_units} units admitted outside their nodes' store windows (decided by "
                f"the store), limit {limit} + {lost} lost", past(outside, limit + lost))
    for n in run.nodes:
        mine = [r for r, i in zip(reqs, inside) if i and r["node"] == n]
        units = sum(r["_cost"] for r in mine)
        own = run.own_allowance(n, quota, s, e, limit)
        if mine and units + out_units > limit + own + lost:
            bound = (f"2 x limit {limit}" if own == limit else
                     f"limit {limit} + {own} by its own decisions counted or allowed")
            return (f"{n} admitted {units} units inside its store windows + {out_units} "
                    f"outside (decided by the store), more than {bound} + {lost} lost",
                    past(sorted(mine + outside, key=lambda r: r["sent"]), limit + own + lost))
    return None


def allowance(run, quota, w, s, e, limit, inside, lost):
    """The allowance over the limit of all admitted units in one window instance (see
    check_quota), and how it came about."""
    if run.locally_enforced(quota, w):
        troubled = [n for n in run.nodes if run.store_trouble(n, s, e)]
        own = sum(min(limit, run.own_allowance(n, quota, s, e, limit)) for n in troubled)
        if own == limit * len(troubled):
            return own + lost, f"{len(troubled)} node(s) in store fault x {limit} + {lost} lost"
        return own + lost, (f"{len(troubled)} node(s) in store fault, {own} by their own "
                            f"decisions counted + {lost} lost")
    return inside + lost, f"{inside} admitted in fallback + {lost} lost"


def lost_units(run, reqs):
    return sum(r["_cost"] for r in reqs if in_spans(r["sent"], run.loss_spans))


def past(reqs, bound):
    """The requests, in the order sent, from the one whose units went past `bound`."""
    total, out = 0, []
    for r in sorted(reqs, key=lambda r: r["sent"]):
        total += r["_cost"]
        if total > bound:
            out.append(r)
    return out


def revoked_at(run):
    """key -> when it stopped being valid: its revocation, or its rotation's overlap_until."""
    out = {}
    for e in run.events:
        if e["kind"] == "revoke":
            t = e["t"]
        elif e["kind"] == "rotate":
            t = e.get("overlap_until", e["t"])
        else:
            continue
        out[e["key"]] = min(t, out.get(e["key"], t))
    return out


def revocation_deadline(run, node, t):
    """When node must have applied a revocation made at t: at t, unless it could not hear of it
    then: a store window of that node in progress at t (the change travels through the store;
    declared faults and counted store trouble alike) delays it to the window's end; a node down
    at t learns at its next start."""
    deadline = t
    for lo, hi in run.store_windows.get(node, []):
        if lo <= t <= hi:
            deadline = max(deadline, hi)
    for down, up in run.restarts.get(node, []):
        if down <= t < up:
            deadline = max(deadline, up)
    return deadline


def check_revocation(run):
    """revocation: no request of a revoked key (or a rotated-away key past overlap_until) is
    admitted by node n when sent later than the node's deadline + the revocation margin (1 s).

    "Admitted" here is every answer that reached the backend's side of the gate (2xx, and the
    502/503/504 that spend), not only 2xx: a revoked key must get 401. The deadline is the
    revocation, pushed back by a store window of n in progress then, or n being down then (the
    docs: in force on every node within a second, through the store). A `keys revoke` that
    exited non-zero (rc) still revoked: the registry write happened, only its confirmation
    failed. The 401s after a revocation are the coverage figure (check_schedule)."""
    revoked, violations, worst, late = revoked_at(run), [], None, 0
    margin, refused = run.margins["revocation"], 0
    for req in run.history:
        t = revoked.get(req["key"])
        if t is None or req["sent"] <= t:
            continue
        refused += req.get("status") == 401
        if req["_cls"] != ADMITTED:
            continue
        late += 1
        worst = max(worst or 0.0, req["sent"] - t)
        deadline = revocation_deadline(run, req["node"], t)
        if req["sent"] > deadline + margin:
            violations.append(violation(
                f"{req['key']} admitted ({req['status']}) by {req['node']} "
                f"{req['sent'] - t:.2f} s after its revocation ({deadline - t + margin:.2f} s "
                "allowed)", [req]))
    run.coverage["revoked_401"] = refused
    unconfirmed = sum(1 for e in run.events if e["kind"] == "revoke" and e.get("rc"))
    figure = (f"{len(revoked)} keys revoked ({unconfirmed} unconfirmed by the CLI); {refused} "
              f"requests refused 401 after a revocation; {late} admissions after one, worst "
              f"{'-' if worst is None else f'{worst:.2f} s'} late; {len(violations)} too late")
    return Result("revocation", not violations, figure, violations)


def check_metering(run):
    """metering: the usage events add up to what the clients saw, and reached the webhook.

    Per key, minute (the store's clock, as both the events and the RateLimit header say) and
    node (the metering file's and the history's): the events' cost lies in [admitted,
    admitted + possibly admitted] by the history. A possibly admitted request without a header
    counts at the high end of both minutes it may be in (sent within the client's timeout of
    the next), and so does a retried GET's first attempt. Over the high end is a violation in
    every node-minute, excused or not: over-billing is never allowed, and fallback decisions
    are not metered, so they cannot cause it. Under the low end is excused where the node's
    unwritten or undecided usage is documented: a fault touching that node (store faults of
    every node touch all, a partition or a kill only its node; spool_full, backend_restart and
    node_upgrade lose nothing), the node killed in that minute or the next (its unwritten
    minutes die with it), its breaker open by its samples (decisions made alone, uncounted),
    or minutes not yet written at the end (written up to 41 s after they end). Elsewhere a
    shortfall is allowed only up to that node's store calls that timed out in the minute (the
    samples' counts from 1 s before it to 1 s after) x the highest cost: such a decision is
    the node's own and not metered (the docs' one loss outside faults). Then the day per
    quota against Redis (check_day), and delivery: every usage, ban and threshold event
    reached the receiver, the spools empty."""
    excused, violations, checked, short, shorts = Counter(), [], 0, 0, []
    rows = node_minutes(run)
    for (key, m, node), (low, high, cost, reqs) in sorted(
            rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if cost > high:
            events = usage_of(run, key, m, node) if len(violations) < 20 else []
            violations.append(violation(
                f"{key} minute {iso(m * 60)} on {node}: metered {cost} units, clients saw "
                f"{low} admitted (+{high - low} possibly)", events + reqs[:5], len(events) + 5))
            continue
        cause = node_minute_excuse(run, node, m)
        if cause:
            excused[cause] += 1
            continue
        checked += 1
        if cost >= low:
            continue
        timeouts = run.timeouts_between(node, m * 60 - 1, m * 60 + 61)
        short, allowed = short + low - cost, timeouts * run.max_cost
        shorts.append((key, m, node))
        if low - cost > allowed:
            violations.append(violation(
                f"{key} minute {iso(m * 60)} on {node}: metered {cost} units, clients saw "
                f"{low} admitted: {low - cost} short, {allowed} allowed ({timeouts} store calls "
                f"that timed out x {run.max_cost})", usage_of(run, key, m, node) + reqs[:5], 10))
    run.coverage["node_minutes"] = checked
    day_figure, day_violations = check_day(run)
    sent_figure, sent_violations = check_delivery(run)
    violations += day_violations + sent_violations
    causes = ", ".join(f"{c} {n}" for c, n in sorted(excused.items())) or "none"
    figure = (f"{checked:,} node-minutes checked ({short} units short in {len(shorts)}; "
              f"allowed in each: its node's timed-out store calls x {run.max_cost}), "
              f"{sum(excused.values())} excused ({causes}); {day_figure}; {sent_figure}; "
              f"{len(violations)} off")
    return Result("metering", not violations, figure, violations)


def minute_of(ev):
    return int(unix(ev["data"]["minute"]) // 60)


def usage_of(run, key, m, node):
    """The usage events of one node-minute of a key: what a metering violation shows."""
    return [ev for ev in run.meter if ev["type"] == USAGE and ev["data"]["key_id"] == key
            and minute_of(ev) == m and ev["_node"] == node]


def node_minutes(run):
    """(key, minute, node) -> [admitted units, admitted + possible units, metered units, the
    key's requests to that node then], for every one with a request or a usage event. The
    node of a usage event is its file's (`<node>.YYYY-MM-DD`)."""
    out = defaultdict(lambda: [0, 0, 0, []])
    for req in run.history:
        if req["key"] not in run.keys:
            continue
        out[(req["key"], instance(req, 60), req["node"])][3].append(req)
        for m, units, certain in spend_places(req, 60):
            row = out[(req["key"], m, req["node"])]
            row[1] += units
            row[0] += units if certain else 0
    for ev in run.meter:
        if ev["type"] == USAGE:
            out[(ev["data"]["key_id"], minute_of(ev), ev["_node"])][2] += int(ev["data"]["cost"])
    return out


def node_minute_excuse(run, node, m):
    """Why node's usage of minute m may be short for a documented reason, or None."""
    s, e = m * 60, m * 60 + 60
    if e > run.ended - UNWRITTEN_TAIL:
        return "not yet written"
    for f in run.faults:
        if f.name not in LOSSLESS_FAULTS and node in f.nodes and overlaps(f.lo, f.hi, s, e):
            return f"fault {f.name}"
    if any(n == node and s <= t < e + 60 for t, n in run.kills):
        return "node kill"
    if any(overlaps(lo, hi, s, e) for lo, hi in run.fallback_spans.get(node, [])):
        return "breaker open (samples)"
    return None


def day_timeouts(run, day):
    """The store calls that timed out during the day, all nodes: by their samples, or, in a run
    without samples, end.json's counters (the nodes' totals since their last start)."""
    if run.has_samples:
        return sum(run.timeouts_between(n, day * DAY, (day + 1) * DAY) for n in run.nodes), \
            "samples"
    return sum(int(v) for v in run.end.get("store_timeouts", {}).values()), "end.json"


def check_day(run):
    """The day per quota: Redis's final count (end.json) against the metered units of that
    UTC day. Surplus (metering - Redis) <= lost (counts Redis lost, as in quota). Shortfall
    (Redis - metering) <= the day's store timeouts x the highest cost (a timed-out call may
    have been counted, and is not metered) + the units sent to a node in the minutes its kill
    lost + the units of minutes possibly unwritten at the end. A quota end.json does not name
    is skipped."""
    day, violations, rows = int(run.end["t"] // DAY), [], 0
    timeouts, source = day_timeouts(run, day)
    top_cost = run.max_cost
    metered = Counter()
    for ev in run.meter:
        key = run.keys.get(ev["data"].get("key_id")) if ev["type"] == USAGE else None
        if key and minute_of(ev) * 60 // DAY == day:
            metered[key.quota] += int(ev["data"]["cost"])
    worst = [0, 0]
    for quota, held in sorted(run.end.get("redis", {}).items()):
        inst, count = held.get("windows", {}).get(str(DAY), [day, None])
        if count is None or quota not in run.quota_plans:
            continue
        rows += 1
        redis = int(count) if int(inst) == day else 0
        reqs = run.spent.get((quota, DAY, day), [])
        short_ok = timeouts * top_cost + unmetered_units(run, reqs)
        surplus_ok = lost_units(run, reqs)
        short, surplus = redis - metered[quota], metered[quota] - redis
        worst = [max(worst[0], short), max(worst[1], surplus)]
        if short > short_ok or surplus > surplus_ok:
            violations.append(violation(
                f"{quota} day: Redis counted {redis}, metering {metered[quota]} (allowed: "
                f"{short_ok} short, {surplus_ok} over)"))
    return (f"day: {rows} quotas against Redis, max {worst[0]} short, {worst[1]} over (short "
            f"allowed: {timeouts} timed-out store calls by {source} x {top_cost} + lost "
            "minutes)", violations)


def unmetered_units(run, reqs):
    """Units that may be in Redis but in no usage event for a documented reason."""
    units = 0
    for r in reqs:
        s = instance(r, 60) * 60
        killed = any(n == r["node"] and s <= t < s + 120 for t, n in run.kills)
        if killed or s + 60 > run.ended - UNWRITTEN_TAIL:
            units += r["_cost"]
    return units


def check_delivery(run):
    """Every usage, ban and threshold event of the metering files reached the webhook's
    receiver (at least once), and no spool still holds a batch at the end.

    Excused, the docs' one loss here: events a process held in memory because the spool's disk
    was full, when that process ended before the disk had room (a SIGKILL, or the old process
    of an upgrade, which gives up after 5 s and counts them dropped). The metering file has
    them. So an event is excused when it was made during a spool_full window and its node was
    killed, or upgraded (its old process stops within STOP_AFTER_UPGRADE), before that window
    ended."""
    received = {ev.get("id") for ev in run.receiver}
    violations, count, excused = [], 0, 0
    for ev in run.meter:
        if ev["type"] in (USAGE, BANNED, THRESHOLD):
            count += 1
            if ev["id"] in received:
                continue
            if lost_with_a_full_spool(run, ev):
                excused += 1
                continue
            violations.append(violation(
                f"event {ev['id']} ({ev['type']}, {ev['_node']}) never reached the "
                "receiver", [ev]))
    for node, left in sorted(run.end.get("spool_left", {}).items()):
        if int(left):
            violations.append(violation(f"{node}'s spool still holds {left} batches"))
    for line in run.bad_lines:
        violations.append(violation(f"unreadable metering line {line}"))
    return (f"webhook: {count:,} events, {count - len(violations) - excused:,} delivered, "
            f"{excused} lost with a process stopped while the spool's disk was full"), violations


STOP_AFTER_UPGRADE = 20.0  # SIGQUIT 1 s after the upgrade, 5 s for the sockets, 1 s grace, 5 s retry


def lost_with_a_full_spool(run, ev):
    made = unix(ev["time"])
    node = ev["_node"]
    stops = [t for t, n in run.kills if n == node]
    stops += [e["t"] for e in run.events if e["kind"] == "upgrade" and e["node"] == node]
    for f in run.faults:
        if f.name != "spool_full" or not f.start - 1 <= made <= f.end + 1:
            continue
        if any(made - STOP_AFTER_UPGRADE <= t <= f.end for t in stops):
            return True
    return False


def client_bans(run):
    """The bans the clients saw, per quota (a ban is the quota's: every key of it is refused):
    runs of 429 api_key_banned whose X-RateLimit-Reset (the ban's end) stays within 2 s."""
    bans = defaultdict(list)
    for req in run.history:
        if req.get("status") == 429 and req.get("code") == "api_key_banned" and req["_quota"]:
            runs = bans[req["_quota"]]
            if runs and abs(ban_end(runs[-1][0]) - ban_end(req)) <= BAN_SLACK:
                runs[-1].append(req)
            else:
                runs.append([req])
    return bans


def ban_end(req):
    """A banned 429's X-RateLimit-Reset (the ban's end); without one, its Retry-After."""
    if req.get("reset") is not None:
        return req["reset"]
    return int(req["sent"] + (req.get("retry_after") or 0))


def check_notices(run):
    """notices: each ban and each threshold crossing reported exactly once.

    Bans: the store starts a ban once, and its node alone reports it, so every ban the
    clients saw has one pet.key.banned.v1 (one id, from one node, its banned_until within 2 s
    of the clients' X-RateLimit-Reset). Missing is excused only when a node was killed within
    kill_notice + 1 s of the ban's first 429 (the notice waits up to a second in the node's
    memory: "at most once across a crash"), or when a node counted store calls timing out in
    the second or two before: a call the node gave up on (its deadline passed while Redis was
    slow or cut off) may still reach Redis and start the ban, and no node hears of it (a
    2-minute CI soak met it: gw1's calls queued through its partition landed as the partition
    ended, and the ban they started had no event). A kill or timeouts of ANY node excuse it: the node that
    decided the ban is not in the records when its event is missing (the first banned 429 a
    client saw may come from another node's ban cache), so it cannot be matched to it.
    A ban event no client saw is fine if no answer outside store windows came for its quota
    during it. Thresholds: see check_thresholds. Bans and crossings seen are coverage figures
    (check_schedule)."""
    violations, seen, excused, by_store, unseen = [], 0, 0, 0, 0
    by_quota = defaultdict(list)
    for ev in run.meter:
        key = run.keys.get(ev["data"].get("key_id")) if ev["type"] == BANNED else None
        if ev["type"] == BANNED:
            by_quota[key.quota if key else ev["data"].get("key_id")].append(ev)
    matched = set()
    for quota, runs in sorted(client_bans(run).items()):
        for reqs in runs:
            seen += 1
            got, why = ban_reported(run, reqs, by_quota[quota])
            matched.update(got)
            excused += why == "excused"
            by_store += why == "excused by a store call"
            if why not in ("ok", "excused", "excused by a store call"):
                violations.append(violation(f"{quota}: ban until {ban_end(reqs[0])} {why}",
                                            reqs))
    for quota, evs in by_quota.items():
        for ev in evs:
            if ev["id"] not in matched:
                unseen += 1
                violations += unseen_ban(run, quota, ev)
    violations += double_reports(run)
    t_figure, t_violations = check_thresholds(run)
    violations += t_violations
    run.coverage["bans"] = seen
    figure = (f"bans: {seen} seen by clients ({excused} unreported, excused by a kill; "
              f"{by_store} by a node's timed-out store calls), "
              f"{unseen} reported but unseen; {t_figure}")
    return Result("notices", not violations, figure, violations)


def ban_reported(run, reqs, events):
    """The ids of the ban events matching one client-seen ban, and "ok", "excused" (a kill),
    "excused by a store call" or why not. The excusing kill or timeouts may be any node's (see
    check_notices: the deciding node is unknown)."""
    resets = [ban_end(r) for r in reqs]
    got = sorted({ev["id"] for ev in events
                  if min(resets) - BAN_SLACK <= unix(ev["data"]["banned_until"])
                  <= max(resets) + BAN_SLACK})
    if len(got) > 1:
        return got, f"reported under {len(got)} ids: {', '.join(got)}"
    if got:
        return got, "ok"
    first, notice = reqs[0]["sent"], run.margins["kill_notice"]
    if any(first - notice <= t <= first + notice + 1 for t, _ in run.kills):
        return got, "excused"
    if late_store_call(run, first, notice):
        return got, "excused by a store call"
    return got, "has no pet.key.banned.v1 event"


def late_store_call(run, first, notice):
    """Whether a node counted store calls timing out (given up on, yet perhaps still to land in
    Redis) within notice + 1 s before `first`: by its samples, the first taken after `first`
    included; without samples, by its store windows."""
    lo = first - notice - 1
    if run.has_samples:
        return any(run.timeouts_between(n, lo, first + 1) > 0 for n in run.nodes)
    return any(run.store_trouble(n, lo, first) for n in run.store_windows)


def unseen_ban(run, quota, ev):
    """A ban event no client saw: a violation if its quota got an answer other than the ban
    while it lasted (from a node that was asking the store)."""
    start, until = unix(ev["time"]) + 1, unix(ev["data"]["banned_until"]) - 1
    odd = [r for r in run.history
           if r["_quota"] == quota and start < r["sent"] < until and r.get("status")
           and r.get("code") != "api_key_banned" and not run.in_store_fault(r["node"], r["sent"])]
    if not odd:
        return []
    return [violation(f"ban event {ev['id']} ({ev['_node']}) but {quota} was answered "
                      f"{odd[0]['status']} during it", [ev] + odd)]


def double_reports(run):
    """Ban and threshold ids written by two nodes: reported twice, not a duplicate line."""
    return [violation(f"{ev['id']} reported by {len(run.meter_nodes[ev['id']])} nodes: "
                      f"{', '.join(sorted(run.meter_nodes[ev['id']]))}", [ev])
            for ev in run.meter
            if ev["type"] in (BANNED, THRESHOLD) and len(run.meter_nodes[ev["id"]]) > 1]


def check_thresholds(run):
    """Thresholds: when the clients' admitted answers show a quota's day `r` reach
    limit - ceil(limit x p / 100) (used at or past p %), one pet.quota.threshold.v1 with the id
    the code derives (`pet.quota.threshold.v1:<quota>:1d:<instance>:<p>`) must exist. Answers
    of a node in a store-fault window are left out (its day pauses). Missing is excused if the
    crossing request's node was in a store fault or a kill followed within 2 s (the notice dies
    with the node); when the crossing request's answer is unknown, if a store fault or kill
    touches the span between the last answer below and the first at or past."""
    ids = {ev["id"] for ev in run.meter if ev["type"] == THRESHOLD}
    seen, excused, violations = 0, 0, []
    for (quota, inst), obs in sorted(day_answers(run).items()):
        plan = obs[0][2]["_plan"]
        for p in run.plans[plan].get("notify_at", []):
            reached = [o for o in obs if o[0] >= math.ceil(o[3] * p / 100)]
            if not reached:
                continue
            seen += 1
            if f"{THRESHOLD}:{quota}:{window_spec(DAY)}:{inst}:{p}" in ids:
                continue
            if crossing_excused(run, obs, p):
                excused += 1
                continue
            violations.append(violation(
                f"{quota} crossed {p} % of its day (used {reached[0][0]} of {reached[0][3]}) "
                "with no pet.quota.threshold.v1", [o[2] for o in reached]))
    run.coverage["crossings"] = seen
    return f"thresholds: {seen} crossings seen ({excused} unreported, excused)", violations


def day_answers(run):
    """(quota, day instance) -> [(used, cost, request, limit)] by the day's `r` in admitted
    answers of nodes not in store fault, ordered by used (the store's order of decisions)."""
    out = defaultdict(list)
    for req in run.history:
        day = req["_rl"].get("day")
        if (req["_cls"] != ADMITTED or day is None or req["recv"] is None
                or run.in_store_fault(req["node"], req["sent"])):
            continue
        limit = run.limit_at(req["_plan"], DAY, req["sent"])
        out[(req["_quota"], instance(req, DAY))].append(
            (limit - day[0], req["_cost"], req, limit))
    return {k: sorted(v, key=lambda o: (o[0], o[2]["sent"])) for k, v in out.items()}


def crossing_excused(run, obs, p):
    """See check_thresholds: whether a missing threshold notice may have died with a node."""
    below = [o for o in obs if o[0] < math.ceil(o[3] * p / 100)]
    first = next(o for o in obs if o[0] >= math.ceil(o[3] * p / 100))
    used, cost, req, limit = first
    if used - cost < math.ceil(limit * p / 100):  # the crossing request itself was answered
        lo, hi, nodes = req["sent"], req["recv"], [req["node"]]
    else:
        lo = max([o[2]["sent"] for o in below], default=run.started)
        hi, nodes = req["recv"], run.nodes
    if any(overlaps(a, b, lo, hi) for n in nodes for a, b in run.store_windows[n]):
        return True
    return any(lo <= t <= hi + THRESHOLD_KILL and n in nodes for t, n in run.kills)


def check_errors(run):
    """errors: the gateway answers every request, and 5xx only where the docs say.

    503 overloaded is the documented shedding (counted, allowed anywhere); 502 bad_gateway and
    504 gateway_timeout only while a backend restarts (its window with margins). Any other 5xx
    (500, 503 internal, ...) is a violation: store faults decide locally, never fail a request.
    No answer is excused only while that node was killed (its node_kill window, or from a
    kill to its start, with margins): an upgrade drops nothing, and a store fault must not hang
    a request (store calls have a 50 ms deadline), so no answer then is a violation too."""
    counts, violations = Counter(), []
    before, after = run.margins["fault_before"], run.margins["fault_after"]
    restarts = [(f.lo, f.hi) for f in run.faults if f.name == "backend_restart"]
    for req in run.history:
        s = req.get("status")
        counts["no answer" if s is None else s] += 1
        node, t = req["node"], req["sent"]
        if s is None:
            down = [(f.lo, f.hi) for f in run.faults if f.name == "node_kill" and node in f.nodes]
            down += [(a - before, b + after) for a, b in run.restarts.get(node, [])]
            if not in_spans(t, down):
                violations.append(violation(
                    f"no answer from {node} ({req.get('error')}) outside its kill windows", [req]))
        elif s >= 500:
            code = req.get("code")
            if (s, code) == (503, "overloaded"):
                continue
            if (s, code) in ADMITTED_ERRORS and in_spans(t, restarts):
                continue
            violations.append(violation(f"{s} {code} from {node} at {iso(t)}", [req]))
    figure = "; ".join(f"{k}: {n:,}" for k, n in sorted(counts.items(), key=lambda kv: str(kv[0])))
    return Result("errors", not violations, f"{figure}; {len(violations)} not allowed", violations)


def check_refusals(run):
    """refusals: the gateway never refuses a request it should have admitted.

    401 unauthorized for a key that was valid when sent (see key_lives), unless the node could
    not have known it: in a store window or down at some time between the key's issue and the
    request (its registry could not sync; the docs: a node serves its snapshot until the store
    returns). 429 rate_limited, api_key_banned and concurrency_limited each need their cause
    in the clients' records (judge_limited, judge_banned, judge_concurrency), unless the
    refusing node was in a store window between sent and answer: its local limiter, ban cache
    and places count on their own, where the records cannot follow."""
    lives, judged, excused, violations = key_lives(run), Counter(), Counter(), []
    bans_until = defaultdict(float)  # quota -> the latest ban end its banned 429s said so far
    judges = {"rate_limited": judge_limited, "concurrency_limited": judge_concurrency}
    for req in run.history:
        status, code = req.get("status"), req.get("code")
        if status == 401 and code == "unauthorized":
            verdict, what = judge_unauthorized(run, req, lives)
        elif status == 429 and req["_quota"] is not None and code == "api_key_banned":
            verdict, what = judge_banned(run, req, bans_until[req["_quota"]])
            bans_until[req["_quota"]] = max(bans_until[req["_quota"]], ban_end(req))
        elif status == 429 and req["_quota"] is not None and code in judges:
            verdict, what = judges[code](run, req)
        else:
            continue
        if verdict is None:
            continue
        judged[(status, code)] += 1
        excused[status] += verdict == "excused"
        if verdict == "violation":
            violations.append(violation(what, [req]))
    codes = ", ".join(f"{c} {judged[(429, c)]}" for c in
                      ("rate_limited", "api_key_banned", "concurrency_limited"))
    figure = (f"401 for a valid key: {judged[(401, 'unauthorized')]} judged ({excused[401]} "
              f"excused: node in a store window or down since the key's issue); 429 judged: "
              f"{codes} ({excused[429]} excused by a store window or a kill); "
              f"{len(violations)} unjustified")
    return Result("refusals", not violations, figure, violations)


def key_lives(run):
    """key -> [issued, valid from, valid until]. setup.json's keys were known to every node
    before the load (issued: the run's start); an issued key or a rotation's successor is valid
    from KEY_SYNC after its event (nodes poll the registry). A revocation ends it, and a
    rotation at its overlap_until, both recorded after the CLI's exit, which follows its
    registry write: by up to the revocation margin, or KEYS_CMD_SECS when the CLI failed (rc:
    the write happened, when is unknown)."""
    lives = {k: [run.started, -math.inf, math.inf] for k in run.setup["keys"]}
    margin = run.margins["revocation"]
    for e in run.events:
        if e["kind"] == "issue":
            lives[e["key"]] = [e["t"], e["t"] + KEY_SYNC, math.inf]
        elif e["kind"] == "rotate":
            lives[e["successor"]] = [e["t"], e["t"] + KEY_SYNC, math.inf]
            old = lives.setdefault(e["key"], [run.started, -math.inf, math.inf])
            old[2] = min(old[2], e.get("overlap_until", e["t"]) - margin)
        elif e["kind"] == "revoke":
            old = lives.setdefault(e["key"], [run.started, -math.inf, math.inf])
            old[2] = min(old[2], e["t"] - (KEYS_CMD_SECS if e.get("rc") else margin))
    return lives


def judge_unauthorized(run, req, lives):
    """A 401 for a key valid when sent: a violation unless its node was in a store window or
    down since the key's issue. (None, None) when the key was not valid: nothing to judge."""
    life = lives.get(req["key"])
    if life is None or not life[1] <= req["sent"] < life[2]:
        return None, None
    node, issued = req["node"], life[0]
    if run.store_trouble(node, issued, req["sent"]) or run.down(node, issued, req["sent"]):
        return "excused", None
    return "violation", (f"{req['key']} refused 401 by {node} at {iso(req['sent'])}, valid "
                         "then (issued before, not revoked, within any rotation's overlap)")


def troubled(run, req):
    """Whether the refusing node was in a store window while it decided (sent .. answer)."""
    return run.store_trouble(req["node"], req["sent"], req.get("recv") or req["sent"])


def judge_limited(run, req):
    """A 429 rate_limited is justified when some window of the key's plan had no room: the
    quota's admitted + possibly admitted units placed in the refusal's instance and sent before
    its answer, plus its cost, pass the lowest limit in force during the instance (a lowered
    limit binds from the next request, so the lowest is the one that may have refused)."""
    if troubled(run, req):
        return "excused", None
    plan, places, seen = req["_plan"], run.places(req["_quota"]), []
    for w in sorted(int(x) for x in run.plans[plan]["windows"] if str(x).isdigit()):
        inst = instance(req, w)
        limit = run.plan_limit(plan, w, inst * w, (inst + 1) * w, pick=min)
        sent, sums = places.get((w, inst), ([], []))
        i = bisect.bisect_left(sent, req["recv"])
        used = sums[i - 1] if i else 0
        if used + req["_cost"] > limit:
            return "ok", None
        seen.append(f"{window_name(w)} {used} + {req['_cost']} of {limit}")
    return "violation", (f"{req['key']} refused 429 rate_limited by {req['node']} at "
                         f"{iso(req['sent'])} with room in every window: {'; '.join(seen)}")


def judge_banned(run, req, banned_until):
    """A 429 api_key_banned needs a ban: the quota's strikes (BAN_STRIKES refusals, rate_limited
    or banned, or unanswered requests that may have been refused, sent in the minute before
    it), or an earlier banned 429 of the quota whose X-RateLimit-Reset is after it was sent
    (the ban it belongs to), or the node in a store window (its ban cache decides alone)."""
    if troubled(run, req):
        return "excused", None
    if banned_until > req["sent"]:
        return "ok", None
    strikes = [r for r in sent_between(run.by_quota[req["_quota"]], req["sent"] - 60,
                                       req["sent"])
               if r is not req and (r.get("status") is None or (
                   r.get("status") == 429 and r.get("code") in ("rate_limited", "api_key_banned")))]
    if len(strikes) >= BAN_STRIKES:
        return "ok", None
    return "violation", (f"{req['key']} refused 429 api_key_banned by {req['node']} at "
                         f"{iso(req['sent'])}: {req['_quota']} had {len(strikes)} refusals in "
                         f"the minute before ({BAN_STRIKES} earn a ban) and no ban in force")


def judge_concurrency(run, req):
    """A 429 concurrency_limited needs the quota's places full: at least the plan's
    `concurrency` other requests of the quota in flight by the clients' records (not refused;
    sent before its answer, answered after it was sent, or never: RELEASE_SLACK for the
    give-back riding the next store run), or a place that may linger (documented: a killed
    node's, or one whose release was in doubt in any node's store window, ends within the lease,
    LEASE_SECS), or the refusing node in a store window (it holds places alone)."""
    sent = req["sent"]
    if troubled(run, req):
        return "excused", None
    if any(sent - LEASE_SECS <= t <= sent for t, _ in run.kills) or \
            any(run.store_trouble(n, sent - LEASE_SECS, sent) for n in run.nodes):
        return "excused", None
    limit = run.plans[req["_plan"]].get("concurrency")
    busy = [r for r in sent_between(run.by_quota[req["_quota"]], sent - 60, req["recv"])
            if r is not req and r["_cls"] != REFUSED
            and (r.get("recv") is None or r["recv"] + RELEASE_SLACK > sent)]
    if limit is not None and len(busy) >= int(limit):
        return "ok", None
    return "violation", (f"{req['key']} refused 429 concurrency_limited by {req['node']} at "
                         f"{iso(sent)}: {len(busy)} other requests of {req['_quota']} in flight, "
                         f"concurrency {limit}")


def sent_between(reqs, lo, hi):
    """The requests (sorted by sent) sent in [lo, hi). A place is not held longer than a minute
    (the client's timeout, a retry, a lingering lease), so a minute back is as far as any
    request in flight or striking can reach."""
    key = lambda r: r["sent"]  # noqa: E731
    return reqs[bisect.bisect_left(reqs, lo, key=key):bisect.bisect_left(reqs, hi, key=key)]


def check_slots(run):
    """slots: no quota still holds a concurrency lease in Redis once the fleet settled. The
    docs promise a lost release ends within concurrency_lease_secs; end.json is read after
    that, so every lease count must be 0."""
    leases = run.end.get("leases", {})
    violations = [violation(f"{quota} still holds {n} leases at the end")
                  for quota, n in sorted(leases.items()) if int(n)]
    figure = f"{len(leases)} quotas, {sum(int(n) for n in leases.values())} leases left"
    return Result("slots", not violations, figure, violations)


def check_ready(run):
    """ready: faults heal by themselves (no operator in the loop). Every node answers its
    readiness probe within ready_within seconds of the last fault's end (without a
    last_fault_end event, the last fault's end is used; a run without faults has nothing to
    recover from); and each node fault (node_kill, node_upgrade: they end when the new
    process started) has its own ready event (`after`: its id) within ready_within of its end.
    A node fault with none before the run ended is a violation: the node never came back, or
    the soak did not look."""
    ends = [e["t"] for e in run.events if e["kind"] == "last_fault_end"]
    last = ends[0] if ends else max((f.end for f in run.faults), default=None)
    if last is None:
        return Result("ready", True, "no faults: nothing to recover from", [])
    within, violations, slowest = run.margins["ready_within"], [], 0.0
    for node in run.nodes:
        ready = [e for e in run.events if e["kind"] == "ready" and e["node"] == node
                 and e["t"] >= last and e.get("after", "last_fault") == "last_fault"]
        if not ready:
            violations.append(violation(f"{node} never ready after the last fault"))
            continue
        slowest = max(slowest, ready[0]["t"] - last)
        if ready[0]["t"] - last > within:
            violations.append(violation(
                f"{node} ready {ready[0]['t'] - last:.1f} s after the last fault "
                f"({within:g} s allowed)", ready[:1]))
    node_faults, slowest_fault = fault_readiness(run, violations)
    figure = (f"{len(run.nodes)} nodes, slowest ready {slowest:.1f} s after the last fault; "
              f"{node_faults} node faults, slowest ready {slowest_fault:.1f} s after its end")
    return Result("ready", not violations, figure, violations)


def fault_readiness(run, violations):
    """Each node fault's ready events (see check_ready): appends to violations; returns how
    many node faults and the slowest ready after one's end."""
    faults = [f for f in run.faults if f.name in NODE_FAULTS]
    within, slowest = run.margins["ready_within"], 0.0
    for f in faults:
        ready = [e for e in run.events if e["kind"] == "ready" and str(e.get("after")) == str(f.id)]
        if not ready:
            violations.append(violation(
                f"{f.name} {f.id} of {', '.join(f.nodes)} ended at {iso(f.end)} with no ready "
                "event after it"))
        for e in ready:
            slowest = max(slowest, e["t"] - f.end)
            if e["t"] - f.end > within:
                violations.append(violation(
                    f"{e['node']} ready {e['t'] - f.end:.1f} s after {f.name} {f.id} ended "
                    f"({within:g} s allowed)", [e]))
    return len(faults), slowest


def check_schedule(run):
    """schedule: the run played what it said, so the other verdicts are about the run the
    schedule describes: no fault that could not be played (setup's fault_errors), no request
    the load generator dropped, its scheduler never more than LAG_MAX late (if recorded).
    And coverage: what the other invariants judged. A run of COVERAGE_AFTER or longer (load_end
    - started) fails when it checked no node-minute of metering, refused no revoked key after
    its revocation (nothing showed the revocation path working), or saw no ban; shorter runs
    (CI's 2 minutes) report coverage only. Computed after the others (it reads their
    coverage), shown first."""
    s, violations = run.setup, []
    for e in s.get("fault_errors") or []:
        violations.append(violation(f"a fault could not be played: {e}"))
    dropped, lag = s.get("generator_dropped"), s.get("generator_lag_max")
    if dropped:
        violations.append(violation(f"the load generator dropped {dropped} requests"))
    if lag is not None and lag > LAG_MAX:
        violations.append(violation(
            f"the load generator's scheduler ran up to {lag:.2f} s late ({LAG_MAX:g} s allowed)"))
    c = run.coverage
    length = run.load_end - run.started
    gaps = [what for what, n in (("no node-minute of metering checked", c.get("node_minutes")),
                                 ("no revoked key refused 401 after its revocation",
                                  c.get("revoked_401")),
                                 ("no ban seen", c.get("bans"))) if not n]
    if length >= COVERAGE_AFTER:
        violations += [violation(f"coverage: {what} in a {length / 60:.1f}-minute run")
                       for what in gaps]
    figure = (f"{len(run.faults)} faults played, {len(s.get('fault_errors') or [])} not; "
              f"generator dropped {dropped if dropped is not None else '-'}, late at most "
              f"{'-' if lag is None else f'{lag:.2f} s'}; coverage: "
              f"{c.get('node_minutes', 0):,} node-minutes metered and checked, "
              f"{c.get('revoked_401', 0)} requests refused after a revocation, "
              f"{c.get('bans', 0)} bans and {c.get('crossings', 0)} threshold crossings seen"
              + ("" if length >= COVERAGE_AFTER else
                 f" (a {length / 60:.1f}-minute run: coverage not required)"))
    return Result("schedule", not violations, figure, violations)


INVARIANTS = [check_schedule, check_quota, check_revocation, check_metering, check_notices,
              check_errors, check_refusals, check_slots, check_ready]
RUN_LAST = {check_schedule}  # it reads what the others covered


# ---------------------------------------------------------------------------------------------
# 4. The report

def load_figure(run):
    """The load held, from the clients' records alone: requests a second over the load's span,
    and the answers' latency (p50, p99, the slowest)."""
    sent = [r["sent"] for r in run.history]
    lat = sorted(r["recv"] - r["sent"] for r in run.history if r.get("recv") is not None)
    if not sent or not lat:
        return "no requests"
    span = max(sent) - min(sent) or 1.0
    q = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))] * 1000  # noqa: E731
    return (f"{len(sent) / span:,.0f} requests a second over {span / 60:.1f} min; answered in "
            f"p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, slowest {lat[-1] * 1000:.0f} ms")


class Report:
    def __init__(self, run, results):
        self.results = results
        self.ok = all(r.ok for r in results)
        ok2xx = sum(1 for r in run.history if 200 <= (r.get("status") or 0) < 300)
        self.summary = (f"soak check: {len(run.nodes)} nodes, {len(run.history):,} requests "
                        f"({ok2xx:,} answered 2xx), {len(run.faults)} faults ("
                        + ", ".join(f"{n} {c}" for n, c in
                                    sorted(Counter(f.name for f in run.faults).items()))
                        + ")\n"
                        f"  load: {load_figure(run)}")

    def result(self, name):
        """The Result of the invariant called `name`."""
        return next(r for r in self.results if r.name == name)

    def text(self):
        lines = [self.summary]
        for r in self.results:
            lines.append(f"  {'PASS' if r.ok else 'FAIL'} {r.name:<12}{r.figure}")
            if r.violations:
                first = r.violations[0]
                more = len(r.violations) - 1
                lines.append(f"      {first['what']}" + (f" (and {more} more)" if more else ""))
                lines += [f"      {rec.get('_line') or json.dumps(rec)}"
                          for rec in first["records"]]
        return "\n".join(lines)

    def json(self):
        clean = lambda rec: {k: v for k, v in rec.items() if not k.startswith("_")}  # noqa
        return {"ok": self.ok, "summary": self.summary, "results": [
            {"name": r.name, "ok": r.ok, "figure": r.figure, "violation_count": len(r.violations),
             "violations": [{"what": v["what"], "records": [clean(x) for x in v["records"]]}
                            for v in r.violations[:20]]} for r in self.results]}


def check(run_dir):
    """Checks one run's folder: a Report (raises RecordsError if the records cannot be read)."""
    run = Run(run_dir)
    results = {}
    for invariant in sorted(INVARIANTS, key=lambda f: f in RUN_LAST):
        try:
            results[invariant] = invariant(run)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecordsError(f"{run_dir}: {invariant.__name__}: records malformed: {e!r}") from e
    return Report(run, [results[f] for f in INVARIANTS])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = check(args.run_dir)
    except RecordsError as e:
        print(f"soak check: cannot read the records: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.json(), indent=1) if args.json else report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
