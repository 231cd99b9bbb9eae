"""The soak with regions (issue 48; `scripts/soak --regions`): the regions harness's `leased`
fleet (three regions of two nodes, a Redis each, the global store behind Sentinel, 40 ms between
regions) under a fault schedule drawn from a seed, then judged from the records alone.

The schedule repeats every three minutes, each time in a new order and at new moments: a far
region cut off from the global store (10-30 s), the global store's primary killed (the
Sentinels fail over) and started again 15-25 s later as a replica, a region's Redis restarted
empty, a node killed and started 10 s later; acme's traffic moves out of region a once, in the
first cycle. The ban policy is short (5 refusals in a minute, 5 s bans), so acme, sending twice
its limit, is banned again and again: bans cross regions under the faults.

The checker (`check`), from `history.ndjson`, the metering files and nothing the gateway says of
itself:

- **quota**: for every key and minute instance (the `RateLimit` header's, the store's clock),
  the answers 200 in all regions together are at most the limit: no allowance, whatever the
  faults (a request without an answer counts as not admitted: the check fails only on what
  certainly happened).
- **bans**: a ban seen in one region (an answer `api_key_banned`, its `X-RateLimit-Reset` the
  ban's end) admits nothing of its key in any region from 1 s after the first such answer to
  1 s before its end, and every other region's refusals of it from then to 2 s before its end
  say `api_key_banned` (a `rate_limited` or `region_unleased` there is a ban that did not
  cross), unless the answering region was cut off from the global store, its Redis had
  restarted within 12 s (a node writes every ban again every 10 s), or the global store was
  failing over (from its kill until 10 s after its old primary is back), then or in the second
  before; or the banning region was cut off since the ban, or its banning node died within a
  second of it.
- **metering**: the units every node of every region metered, per key and minute, equal the
  admissions (a node killed excuses the minutes it had not written).
- **registry**: the keys live in the key registry in the global store. Each cycle issues a key
  in one region and revokes it 30-60 s later in another (`keys` run as that region's user, so a
  cut region's change waits for the heal), and every region sends it a request a second
  meanwhile and for 15 s after: from 1 s after the issue (dated when `keys issue` returned) no
  region refuses it as unknown until the revocation's first attempt, and from 1 s after the
  revocation returned none admits it, unless the
  answering region was cut off from the global store by then (until 5 s after the heal; a cut
  begun later excuses nothing, as a node keeps the records it holds through a partition), the
  global store's primary had been killed by then (for 10 s: its readers follow the new one), or the
  answering node had started less than 3 s before (it serves its snapshot until the registry
  answers). Each change must have answers judged.

Not judged here: rotation (`tests/tests/gateway_regions.rs` and the registry's own tests), and the
day window (never near its limit in this load).

`--plant doubled-limit` gives region c's nodes acme's plan at twice its minute limit: a region
asking the global store with a wrong limit is granted past the true one, and `quota` must catch
it.

    scripts/soak --regions [--minutes M] [--seed S] [--plant doubled-limit] [--out DIR]
                           [--bin-dir DIR]
"""

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

CYCLE = 180  # seconds: each cycle of the schedule
BAN = ["[ban]", "strikes = 5", "durations_secs = [5]"]
LIMITS = {"acme": 60}  # the minute limits the records are judged against (the true plan's)
SMALL_LIMIT = 10000
BAN_BOUND = 1.0  # seconds: a ban holds in every region this long after it is first seen
RESTART_REIMPORT = 12.0  # a region's Redis restarted: its bans written again within this
FAILOVER_AFTER = 10.0  # the global store's failover excuses bans until this long after it is back
REGISTRY_BOUND = 1.0  # seconds: a key issued or revoked is in force in every region this long after
REGISTRY_RATE = 1.0  # each registry key's requests a second, in every region
HEALED_AFTER = 5.0  # a region cut off reads the registry again within this long after the heal
REGISTRY_FAILOVER = 10.0  # a failover: the registry's readers follow the new primary within this
STARTED_AFTER = 3.0  # a node started serves its snapshot until the registry answers, this long


def schedule(seed, seconds):
    """The faults of a run of `seconds`, drawn from `seed`: (seconds from the start, step)."""
    rng = random.Random(seed)
    out = []
    for cycle in range(int(seconds // CYCLE) + 1):
        base = cycle * CYCLE
        slots = rng.sample(range(5, 125, 30), 4)
        cut, failover, restart, kill = slots
        far = rng.choice(["b", "c"])
        out += [(base + cut, f"cut {far}"), (base + cut + rng.randint(10, 30), f"heal {far}")]
        out += [(base + failover, "failover global"),
                (base + failover + rng.randint(15, 25), "start global")]
        out.append((base + restart, f"restart redis {rng.choice(harness.REGIONS)}"))
        node = f"{rng.choice(harness.REGIONS)}{rng.choice([1, 2])}"
        out += [(base + kill, f"kill {node}"), (base + kill + 10, f"start {node}")]
        if cycle == 0:
            out.append((base + rng.randint(40, 100), "move acme"))
        out += registry_steps(seed, cycle)
    return sorted(f for f in out if f[0] < seconds - 5)


def registry_steps(seed, cycle):
    """A cycle's key: issued in one region, revoked 30-60 s later in another, forgotten by the
    clients 15 s after the revocation returned (drawn apart from the faults, so a seed's faults
    stay as they were)."""
    rng = random.Random(f"registry {seed} {cycle}")
    base, name = cycle * CYCLE, registry_key(cycle)
    issued, revoked = rng.sample(harness.REGIONS, 2)
    at = base + rng.randint(10, 90)
    gone = at + rng.randint(30, 60)
    return [(at, f"issue {name} {issued}"), (gone, f"revoke {name} {revoked}"),
            (gone + 15, f"forget {name}")]


def registry_key(cycle):
    return f"reg-{cycle}"


def run(args):
    # Absolute: the nodes' configs name these paths, and a config's relative path is read
    # from the config's own folder.
    out = os.path.abspath(args.out or os.path.join(harness.ROOT, "target", "regions",
                                                   f"soak-{args.seed}-{int(time.time())}"))
    args.bin_dir = os.path.abspath(args.bin_dir)
    os.makedirs(out, exist_ok=True)
    history = os.path.join(out, "history.ndjson")
    fl = harness.Fleet(os.path.join(out, "leased"), "leased", args.bin_dir, args.delay_ms)
    fl.faults, fl.ban = schedule(args.seed, args.minutes * 60), BAN
    fl.registry = True
    fl.issued_later = [(what.split()[1], REGISTRY_RATE) for _, what in fl.faults
                       if what.startswith("issue")]
    if args.plant == "doubled-limit":
        fl.region_plans["c"] = dict(harness.PLANS, acme="requests_per_minute = 120\n"
                                    "requests_per_day = 100000\n")
    try:
        fl.start()
        time.sleep(60 - time.time() % 60 + 0.5)
        harness.load(fl, args.minutes * 60, history, faults=True)
    finally:
        fl.stop()
    metered = fl.metered()
    harness.fleet.dump_json(os.path.join(out, "metered.json"),
                            [[k, m, n] for (k, m), n in sorted(metered.items())])
    return out, metered


def spans(records):
    """From the fault records: per far region its cut spans, per region its Redis restarts,
    and the global store's failover spans."""
    cut, restarts, failovers, open_cut, down = defaultdict(list), defaultdict(list), [], {}, None
    for r in sorted((r for r in records if "fault" in r), key=lambda r: r["at"]):
        verb, _, target = r["fault"].partition(" ")
        if verb == "cut":
            open_cut[target] = r["at"]
        elif verb == "heal" and target in open_cut:
            cut[target].append((open_cut.pop(target), r["at"]))
        elif verb == "restart":
            restarts[target.split()[-1]].append(r["at"])
        elif verb == "failover":
            down = r["at"]
        elif r["fault"] == "start global" and down is not None:
            failovers.append((down, r["at"] + FAILOVER_AFTER))
            down = None
    end = max((r.get("recv") or r.get("at") or 0) for r in records)
    for region, at in open_cut.items():
        cut[region].append((at, end))
    if down is not None:
        failovers.append((down, end))
    return cut, restarts, failovers


def check_quota(rows):
    admitted = defaultdict(list)
    for r in rows:
        if r["status"] == 200 and r.get("minute") is not None:
            admitted[(r["key"], r["minute"])].append(r)
    violations = []
    for (key, minute), reqs in sorted(admitted.items()):
        limit = LIMITS.get(key, SMALL_LIMIT)
        if len(reqs) > limit:
            by = defaultdict(int)
            for q in reqs:
                by[q["region"]] += 1
            violations.append(f"{key} minute {minute}: {len(reqs)} admitted, limit {limit} "
                              f"(by region {dict(by)})")
    most = max((len(v) for (k, _), v in admitted.items() if k == "acme"), default=0)
    return violations, f"{len(admitted)} key-minutes; acme's most {most} of {LIMITS['acme']}"


def excused(region, t, cut, restarts, failovers):
    if any(lo - 1 <= t <= hi + 1 for lo, hi in cut.get(region, [])):
        return True
    if any(at <= t <= at + RESTART_REIMPORT for at in restarts.get(region, [])):
        return True
    return any(lo - 1 <= t <= hi for lo, hi in failovers)


def ban_excused(ban, r, faults):
    """Whether answer `r`, inside `ban` (first seen: time, region, node), may miss it: its own
    region could not learn it then (cut off, its Redis restarted, the global store failing
    over), the banning region could not publish it before (cut off from the ban's start to the
    answer), or the banning node died within a second of the ban (its publish with it)."""
    first, region, node = ban
    cut, restarts, failovers, kills = faults
    if excused(r["region"], r["sent"], cut, restarts, failovers) or excused(
            r["region"], first, cut, restarts, failovers):
        return True
    if any(overlaps(lo - 1, hi + 1, first - 1, r["sent"]) for lo, hi in cut.get(region, [])):
        return True
    if any(lo - 1 <= first and hi >= r["sent"] - 1 for lo, hi in failovers):
        return True
    return any(n == node and first - 2 <= at <= first + 1 for n, at in kills)


def overlaps(lo, hi, a, b):
    return lo <= b and a <= hi


def check_bans(rows, faults):
    """Per ban (its key and end), from a second after its first `api_key_banned` answer: no
    region admits the key until a second before its end, and every other region's refusals of
    it until two seconds before its end say `api_key_banned` (a `rate_limited` or
    `region_unleased` there is a ban that did not cross), unless excused (`ban_excused`)."""
    bans = defaultdict(list)  # (key, end) -> (time, region, node) of each banned answer
    for r in rows:
        if r.get("code") == "api_key_banned" and "x-ratelimit-reset" in r["headers"]:
            bans[(r["key"], int(r["headers"]["x-ratelimit-reset"]))].append(
                (r["recv"], r["region"], r["node"]))
    violations, admitted, crossed = [], 0, 0
    for (key, end), seen in sorted(bans.items()):
        ban = min(seen)
        first, region = ban[0], ban[1]
        for r in rows:
            if r["key"] != key or not first + BAN_BOUND <= r["sent"] <= end - 1:
                continue
            other_refusal = (r["region"] != region and r["status"] == 429
                             and r["sent"] <= end - 2)
            if r["status"] != 200 and not other_refusal:
                continue
            if ban_excused(ban, r, faults):
                continue
            if r["status"] == 200:
                admitted += 1
                violations.append(f"{key} admitted in region {r['region']} ({r['node']}) "
                                  f"{r['sent'] - first:.2f} s after its ban in {region} was "
                                  f"first answered, ban ending {end}")
            elif r.get("code") == "api_key_banned":
                crossed += 1
            else:
                violations.append(f"{key} refused {r.get('code')} in region {r['region']} "
                                  f"({r['node']}) {r['sent'] - first:.2f} s after its ban in "
                                  f"{region} was first answered: the ban had not crossed")
    return violations, (f"{len(bans)} bans seen; {crossed} refusals in other regions said "
                        f"banned, {admitted} admissions inside one")


def registry_excused(r, at, faults, starts):
    """Whether answer `r` may miss a registry change made at `at`: its region was cut off from
    the global store before it could have learned the change (a cut begun within the bound) and
    is not yet `HEALED_AFTER` past the heal (a node keeps the records it holds through a
    partition: a cut begun later excuses nothing); the global store's primary was killed by
    then and its readers may not have followed the new one yet (`REGISTRY_FAILOVER`); or its
    node had just started (it serves its snapshot until the registry answers)."""
    cut, _, failovers, _ = faults
    learned_by = at + REGISTRY_BOUND
    if any(lo - 1 <= learned_by and r["sent"] <= hi + HEALED_AFTER
           for lo, hi in cut.get(r["region"], [])):
        return True
    if any(lo - 1 <= learned_by and r["sent"] <= lo + REGISTRY_FAILOVER for lo, _ in failovers):
        return True
    return any(n == r["node"] and s - 1 <= r["sent"] <= s + STARTED_AFTER for n, s in starts)


def check_registry(records, faults):
    """Per key the run issued in one region and revoked in another (`issue`/`revoke` steps,
    dated when the change was in the registry): from `REGISTRY_BOUND` after the issue until the
    revocation, no region refuses it as unknown (401); from `REGISTRY_BOUND` after the
    revocation, no region admits it; unless excused (`registry_excused`). Also the slowest
    region, per change, among the answers judged."""
    steps, starts = defaultdict(dict), []
    for r in records:
        verb, _, target = r.get("fault", "").partition(" ")
        if verb in ("issue", "revoke"):
            name, region = target.split()
            steps[name][verb] = (r["at"], region, r.get("from", r["at"]))
        elif verb == "start" and target != "global":
            starts.append((target, r["at"]))
    violations, judged, slowest = [], defaultdict(int), {"issue": 0.0, "revoke": 0.0}
    for r in records:
        step = steps.get(r.get("key"))
        if "fault" in r or not step or "issue" not in step:
            continue
        revoke = step.get("revoke")
        if revoke and r["sent"] >= revoke[2]:
            # From the revocation's first attempt: in force from then, certainly once it returned.
            verb, at, wrong = "revoke", revoke[0], r["status"] == 200
        else:
            verb, at, wrong = "issue", step["issue"][0], r["status"] == 401
        if wrong and r["sent"] < at + REGISTRY_BOUND:
            slowest[verb] = max(slowest[verb], r["sent"] - at)
            continue
        if r["sent"] < at + REGISTRY_BOUND or registry_excused(r, at, faults, starts):
            continue
        judged[(r["key"], verb)] += 1
        if wrong:
            what = "admitted" if verb == "revoke" else "refused as unknown"
            violations.append(f"{r['key']} {what} in region {r['region']} ({r['node']}) "
                              f"{r['sent'] - at:.2f} s after its {verb} in region "
                              f"{step[verb][1]}")
    # A change no answer judged proves nothing: the run must send the key past the bound.
    for name, step in sorted(steps.items()):
        for verb in step:
            if not judged[(name, verb)]:
                violations.append(f"{name}: no answer judged after its {verb}")
    return violations, (f"{len(steps)} keys issued and revoked across regions; "
                        f"{sum(judged.values())} answers "
                        f"judged; the latest wrong answer inside the bound came "
                        f"{slowest['issue']:.2f} s after an issue, {slowest['revoke']:.2f} s "
                        f"after a revocation")


def check(out, metered):
    records = [json.loads(line) for line in open(os.path.join(out, "history.ndjson"))]
    rows = [r for r in records if "fault" not in r]
    cut, restarts, failovers = spans(records)
    kills = [(r["fault"].split()[1], r["at"]) for r in records
             if r.get("fault", "").startswith("kill")]
    results = {}
    results["quota"] = check_quota(rows)
    results["bans"] = check_bans(rows, (cut, restarts, failovers, kills))
    results["registry"] = check_registry(records, (cut, restarts, failovers, kills))
    first, last = min(r["sent"] for r in rows), max(r["sent"] for r in rows)
    minutes = sorted(m for m in {r.get("minute") for r in rows} if m is not None
                     and m * 60 >= first - 1 and (m + 1) * 60 <= last + 1)
    m = harness.metering(rows, minutes, metered, kills)
    results["metering"] = ([f"{o}" for o in m["off"]],
                           f"{m['equal']} of {m['checked']} key-minutes exact, "
                           f"{m['excused']} excused by a node killed")
    return results


def main(argv):
    harness.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--plant", choices=["doubled-limit"])
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--bin-dir", default=os.path.join(harness.ROOT, "target", "release"))
    ap.add_argument("--out")
    ap.add_argument("--check-only", metavar="DIR", help="judge a finished run's records again")
    args = ap.parse_args(argv)
    if args.check_only:
        out = args.check_only
        metered = {(k, m): n for k, m, n in json.load(open(os.path.join(out, "metered.json")))}
    else:
        if not 1 <= args.minutes <= 60:
            ap.error("--minutes: from 1 to 60")
        out, metered = run(args)
    results = check(out, metered)
    ok = True
    for name, (violations, figure) in results.items():
        ok &= not violations
        print(f"{'ok  ' if not violations else 'FAIL'} {name}: {figure}")
        for v in violations[:10]:
            print(f"     {v}")
    print(f"soak with regions: {'every invariant held' if ok else 'violations'} (records: {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
