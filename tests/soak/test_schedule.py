#!/usr/bin/env python3
"""Tests of the soak's fault schedule (faults.py), drawn dry: no fleet, no root.

    python3 -m unittest tests/soak/test_schedule.py      (from the repository root)
    python3 tests/soak/test_schedule.py

The schedules of seeds 1-200, for runs of 2, 3, 5 and 30 minutes, must keep two faults that
act on one thing (`faults.RESOURCES`: the Redis topology, one node, the backend, the spools'
disk) apart, each holding it for its duration and its `HOLD` (seed 11's 3-minute run once had
two `spool_full` overlapping: the first one's end emptied the disk the second still held), and
still be the schedule the soak promises: every kind at least once, one more per 90 s of load,
each starting between 15 s in and 45 s before the end. The player's locks are checked too: a
fault held up past its time is an error, not a silent change of the schedule.
"""

import os
import sys
import threading
import time
import unittest
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults  # noqa: E402
import fleet  # noqa: E402

SEEDS = range(1, 201)
MINUTES = (2, 3, 5, 30)
EPS = 1e-6


def runs():
    for minutes in MINUTES:
        for seed in SEEDS:
            yield minutes, seed, faults.schedule(seed, minutes * 60, fleet.NODES)


def clashes(plan):
    """Pairs of faults of `plan` on a resource of both, the later starting before the earlier's
    hold and GAP are over."""
    out = []
    for i, (a, ka, na, da) in enumerate(plan):
        for b, kb, nb, db in plan[i + 1:]:
            shared = set(faults.resources(ka, na)) & set(faults.resources(kb, nb))
            if shared and b < a + faults.hold(ka, da) + faults.GAP - EPS:
                out.append((sorted(shared), (a, ka, na, da), (b, kb, nb, db)))
    return out


class Schedule(unittest.TestCase):
    def test_no_two_faults_on_one_resource_overlap(self):
        bad = [(m, seed, c[0]) for m, seed, plan in runs() for c in clashes(plan)[:1]]
        self.assertEqual(bad, [], f"{len(bad)} runs (minutes, seed, first clash) overlap two "
                                  f"faults on one resource: {bad[:10]}")

    def test_every_kind_still_drawn(self):
        for m, seed, plan in runs():
            kinds = Counter(k for _, k, _, _ in plan)
            self.assertEqual(set(kinds), set(faults.KINDS), (m, seed))
            self.assertEqual(len(plan), len(faults.KINDS) + int(m * 60 // 90), (m, seed))
            for _, kind, target, duration in plan:
                lo, hi = faults.KINDS[kind][2]
                self.assertTrue(lo <= duration <= hi, (m, seed, kind, duration))
                self.assertEqual(target in fleet.NODES, kind in faults.NODE_KINDS, (m, seed, kind))

    def test_schedule_fits_the_run(self):
        for m, seed, plan in runs():
            secs = m * 60
            self.assertEqual(plan, sorted(plan))
            for at, kind, target, duration in plan:
                self.assertTrue(15.0 <= at <= secs - 45.0, (m, seed, at, kind))
                self.assertEqual(at, round(at, 1), (m, seed, at))
                # Ended, its hold reserved, 20 s before the load ends: healing, readiness.
                self.assertLessEqual(at + faults.hold(kind, duration), secs - 20.0, (m, seed, kind))

    def test_same_seed_same_schedule(self):
        for m in MINUTES:
            self.assertEqual(faults.schedule(11, m * 60, fleet.NODES),
                             faults.schedule(11, m * 60, fleet.NODES))

    def test_drills_fit(self):
        # The planted run's drill (test_soak_plant.py), and every kind alone, in short runs.
        self.assertEqual(len(faults.schedule(11, 72, fleet.NODES, "node_kill,backend_restart")), 2)
        for kind in faults.KINDS:
            for secs in (60, 120):
                self.assertEqual([k for _, k, _, _ in faults.schedule(3, secs, fleet.NODES, kind)],
                                 [kind])
        self.assertEqual(faults.schedule(3, 120, fleet.NODES, "none"), [])


class Resources(unittest.TestCase):
    def test_every_kind_names_what_it_acts_on(self):
        self.assertEqual(set(faults.RESOURCES), set(faults.KINDS))
        self.assertEqual(set(faults.HOLD), set(faults.KINDS))
        for kind in faults.KINDS:
            self.assertTrue(faults.resources(kind, "gw1"), kind)
        # The current primary: a kill (a failover), a restart and a slowed Redis, one at a time.
        for kind in ("primary_kill", "redis_restart", "redis_latency"):
            self.assertIn("redis", faults.resources(kind, None))
        # One node: a kill, an upgrade and a partition of that node, one at a time; other nodes
        # are free.
        for kind in faults.NODE_KINDS:
            self.assertEqual(faults.resources(kind, "gw2"), ("node:gw2",))
        self.assertEqual(faults.resources("spool_full", None), ("disk",))
        self.assertEqual(faults.resources("backend_restart", None), ("backend",))


class Place(unittest.TestCase):
    """`faults.place` on hand-made draws."""

    def place(self, drawn, first=15.0, last=75.0):
        return faults.place(sorted(drawn), fleet.NODES, first, last)

    def test_apart_faults_stay_as_drawn(self):
        drawn = [(20.0, "spool_full", None, 10.0), (40.0, "spool_full", None, 8.0),
                 (21.0, "node_kill", "gw1", 2.0), (22.0, "partition", "gw2", 6.0),
                 (23.0, "redis_latency", None, 5.0), (24.0, "backend_restart", None, 2.0)]
        self.assertEqual(self.place(drawn), sorted(drawn))

    def test_a_later_one_waits_for_the_earlier(self):
        # seed 11, 3 minutes: spool_full at 16.8 for 14.3 s and at 22.1 for 10.3 s
        got = self.place([(16.8, "spool_full", None, 14.3), (22.1, "spool_full", None, 10.3)])
        self.assertEqual(got, [(16.8, "spool_full", None, 14.3),
                               (round(16.8 + 14.3 + faults.HOLD["spool_full"] + faults.GAP, 1),
                                "spool_full", None, 10.3)])

    def test_a_node_fault_takes_a_free_node_at_its_time(self):
        got = self.place([(30.0, "node_kill", "gw1", 3.0), (31.0, "node_upgrade", "gw1", 0.0)])
        self.assertEqual(got, [(30.0, "node_kill", "gw1", 3.0), (31.0, "node_upgrade", "gw2", 0.0)])
        got = self.place([(30.0, "node_kill", "gw1", 3.0), (30.5, "partition", "gw2", 9.0),
                          (31.0, "node_upgrade", "gw1", 0.0)])
        self.assertEqual(got[-1], (31.0, "node_upgrade", "gw3", 0.0))

    def test_pushed_past_the_last_start_pulls_back(self):
        got = self.place([(60.0, "primary_kill", None, 0.0), (70.0, "redis_restart", None, 0.0)])
        self.assertEqual(got, [(round(75.0 - 20.0 - 2.0, 1), "primary_kill", None, 0.0),
                               (75.0, "redis_restart", None, 0.0)])
        self.assertEqual(clashes(got), [])

    def test_no_room_says_so(self):
        with self.assertRaises(SystemExit):
            self.place([(16.0, "primary_kill", None, 0.0), (17.0, "primary_kill", None, 0.0)],
                       first=15.0, last=30.0)


class FakeSoak:
    def __init__(self):
        self.gateways, self.t0, self.events = {}, time.time(), []

    def event(self, e):
        self.events.append(e)


class Player(unittest.TestCase):
    """The player holds each fault's resources while it plays: should one outlast its hold,
    the next waits, and says it started late."""

    def play_two(self, kind_a, target_a, kind_b, target_b):
        soak = FakeSoak()
        p = faults.Player(soak)
        held = Counter()
        most = Counter()
        lock = threading.Lock()

        def act(target, duration):
            with lock:
                held[target] += 1
                most[target] = max(most[target], held[target])
            time.sleep(duration)
            with lock:
                held[target] -= 1

        for kind in (kind_a, kind_b):
            setattr(p, kind, act)
        old = faults.LATE_MAX
        faults.LATE_MAX = 0.1
        try:
            ts = [threading.Thread(target=p.run, args=(kind_a, target_a, 0.3, 0.0)),
                  threading.Thread(target=p.run, args=(kind_b, target_b, 0.3, 0.0))]
            ts[0].start()
            time.sleep(0.05)
            ts[1].start()
            for t in ts:
                t.join()
        finally:
            faults.LATE_MAX = old
        return p, most

    def test_one_resource_one_fault_at_a_time(self):
        p, most = self.play_two("spool_full", None, "spool_full", None)
        self.assertEqual(most[None], 1)
        self.assertEqual(len(p.errors), 1, p.errors)
        self.assertIn("started", p.errors[0])
        self.assertIn("disk by fault 1 (spool_full)", p.errors[0])

    def test_other_resources_overlap(self):
        p, most = self.play_two("spool_full", None, "backend_restart", None)
        self.assertEqual(most[None], 2)
        self.assertEqual(p.errors, [])


if __name__ == "__main__":
    unittest.main()
