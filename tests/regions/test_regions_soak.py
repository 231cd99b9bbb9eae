"""The soak with regions' checker (regions_soak.py) on records made by hand: each invariant
fails on what it must catch, and holds (or excuses) what it must allow.

    python3 -m unittest -q tests/regions/test_regions_soak.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import regions_soak as soak  # noqa: E402

T = 1_800_000_000  # a minute's start


def req(key, region, sent, status=200, code=None, reset=None, node=None):
    r = {"setup": "leased", "key": key, "region": region, "node": node or f"{region}1",
         "sent": sent, "recv": sent + 0.002, "status": status, "minute": int(sent) // 60,
         "headers": {}}
    if code:
        r["code"] = code
    if reset:
        r["headers"]["x-ratelimit-reset"] = str(reset)
    return r


class Quota(unittest.TestCase):
    def test_the_limit_across_regions_holds_and_one_more_is_caught(self):
        rows = [req("acme", "abc"[i % 3], T + i * 0.5) for i in range(60)]
        self.assertEqual(soak.check_quota(rows)[0], [])
        rows.append(req("acme", "c", T + 45))
        self.assertIn("61 admitted, limit 60", soak.check_quota(rows)[0][0])


class Bans(unittest.TestCase):
    def banned(self):
        return [req("acme", "a", T + 10, 429, "api_key_banned", reset=T + 20)]

    def test_an_admission_in_another_region_inside_a_ban_is_caught(self):
        rows = self.banned() + [req("acme", "b", T + 12)]
        self.assertEqual(len(soak.check_bans(rows, ({}, {}, [], []))[0]), 1)

    def test_within_the_bound_or_after_the_end_is_allowed(self):
        rows = self.banned() + [req("acme", "b", T + 10.5), req("acme", "b", T + 19.5)]
        self.assertEqual(soak.check_bans(rows, ({}, {}, [], []))[0], [])

    def test_another_regions_refusal_must_say_banned(self):
        rows = self.banned() + [req("acme", "b", T + 12, 429, "api_key_banned")]
        self.assertEqual(soak.check_bans(rows, ({}, {}, [], []))[0], [])
        rows = self.banned() + [req("acme", "b", T + 12, 429, "rate_limited")]
        self.assertIn("the ban had not crossed", soak.check_bans(rows, ({}, {}, [], []))[0][0])

    def test_the_banning_region_cut_off_or_its_node_killed_excuses_it(self):
        rows = self.banned() + [req("acme", "b", T + 12)]
        self.assertEqual(soak.check_bans(rows, ({"a": [(T + 5, T + 30)]}, {}, [], []))[0], [])
        self.assertEqual(soak.check_bans(rows, ({}, {}, [], [("a1", T + 10.5)]))[0], [])

    def test_a_region_cut_off_or_a_failover_excuses_it(self):
        rows = self.banned() + [req("acme", "b", T + 12)]
        self.assertEqual(soak.check_bans(rows, ({"b": [(T + 5, T + 15)]}, {}, [], []))[0], [])
        self.assertEqual(soak.check_bans(rows, ({}, {}, [(T + 8, T + 13)], []))[0], [])
        self.assertEqual(soak.check_bans(rows, ({}, {"b": [T + 5]}, [], []))[0], [])


class Registry(unittest.TestCase):
    NONE = ({}, {}, [], [])

    def steps(self):
        """A key issued in a at T+10, revoked in b at T+40, answered right in between and after."""
        return [{"fault": "issue reg-0 a", "at": T + 10}, {"fault": "revoke reg-0 b", "at": T + 40},
                req("reg-0", "a", T + 20), req("reg-0", "a", T + 52, 401, "unauthorized")]

    def test_an_issued_key_refused_as_unknown_past_the_bound_is_caught(self):
        records = self.steps() + [req("reg-0", "c", T + 10.5, 401, "unauthorized"),
                                  req("reg-0", "c", T + 11.5)]
        self.assertEqual(soak.check_registry(records, self.NONE)[0], [])
        records.append(req("reg-0", "b", T + 12, 401, "unauthorized"))
        self.assertIn("refused as unknown in region b", soak.check_registry(records, self.NONE)[0][0])

    def test_a_revoked_key_admitted_past_the_bound_is_caught(self):
        records = self.steps() + [req("reg-0", "c", T + 40.5), req("reg-0", "a", T + 42, 401)]
        self.assertEqual(soak.check_registry(records, self.NONE)[0], [])
        records.append(req("reg-0", "c", T + 41.5))
        self.assertIn("admitted in region c", soak.check_registry(records, self.NONE)[0][0])

    def test_a_cut_or_failover_by_the_bound_or_a_node_started_excuses_it(self):
        records = self.steps() + [req("reg-0", "c", T + 43)]
        self.assertEqual(soak.check_registry(records, ({"c": [(T + 30, T + 39)]}, {}, [], []))[0], [])
        self.assertEqual(soak.check_registry(records, ({}, {}, [(T + 41, T + 50)], []))[0], [])
        started = records + [{"fault": "start c1", "at": T + 41}]
        self.assertEqual(soak.check_registry(started, self.NONE)[0], [])

    def test_a_cut_ended_long_before_or_begun_after_the_bound_excuses_nothing(self):
        records = self.steps() + [req("reg-0", "c", T + 43)]
        # Healed 8 s before the answer: the region has read the registry again by then.
        self.assertEqual(len(soak.check_registry(records, ({"c": [(T + 30, T + 35)]}, {}, [], []))[0]), 1)
        # Cut after the region had the revocation: a node keeps what it holds.
        self.assertEqual(len(soak.check_registry(records, ({"c": [(T + 42.5, T + 60)]}, {}, [], []))[0]), 1)
        late = self.steps() + [req("reg-0", "c", T + 30, 401, "unauthorized")]
        self.assertEqual(len(soak.check_registry(late, ({}, {}, [(T + 20, T + 35)], []))[0]), 1)

    def test_a_revocation_is_in_force_from_its_first_attempt(self):
        records = self.steps() + [req("reg-0", "c", T + 39, 401, "unauthorized")]
        self.assertEqual(len(soak.check_registry(records, self.NONE)[0]), 1)
        records[1] = dict(records[1], **{"from": T + 38.5})
        self.assertEqual(soak.check_registry(records, self.NONE)[0], [])

    def test_a_change_no_answer_judged_fails(self):
        records = self.steps()[:3]
        self.assertEqual(soak.check_registry(records, self.NONE)[0],
                         ["reg-0: no answer judged after its revoke"])


class Spans(unittest.TestCase):
    def test_faults_become_spans(self):
        records = [{"fault": "cut c", "at": T}, {"fault": "heal c", "at": T + 20},
                   {"fault": "failover global", "at": T + 30},
                   {"fault": "start global", "at": T + 50},
                   {"fault": "restart redis b", "at": T + 60}, req("acme", "a", T + 70)]
        cut, restarts, failovers = soak.spans(records)
        self.assertEqual(cut["c"], [(T, T + 20)])
        self.assertEqual(restarts["b"], [T + 60])
        self.assertEqual(failovers, [(T + 30, T + 50 + soak.FAILOVER_AFTER)])


class Metering(unittest.TestCase):
    def test_a_sum_off_is_caught_and_a_killed_node_excused(self):
        rows = [req("acme", "a", T + 1, node="a1"), req("acme", "b", T + 2, node="b1")]
        m = T // 60
        self.assertEqual(harness.metering(rows, [m], {("acme", m): 2}, [])["off"], [])
        off = harness.metering(rows, [m], {("acme", m): 1}, [])["off"]
        self.assertEqual(off, [{"key": "acme", "minute": m, "admitted": 2, "metered": 1}])
        excused = harness.metering(rows, [m], {("acme", m): 1}, [("a1", T + 30)])
        self.assertEqual((excused["off"], excused["excused"]), ([], 1))


class Schedule(unittest.TestCase):
    def test_a_seed_draws_the_same_schedule_and_every_fault_is_undone(self):
        for seed in range(20):
            faults = soak.schedule(seed, 30 * 60)
            self.assertEqual(faults, soak.schedule(seed, 30 * 60))
            steps = [what for _, what in faults]
            self.assertEqual(sum(s.startswith("cut") for s in steps),
                             sum(s.startswith("heal") for s in steps))
            self.assertEqual(steps.count("failover global"), steps.count("start global"))
            issued = {s.split()[1]: s.split()[2] for s in steps if s.startswith("issue")}
            revoked = {s.split()[1]: s.split()[2] for s in steps if s.startswith("revoke")}
            self.assertTrue(issued)
            for name, region in revoked.items():
                self.assertNotEqual(region, issued[name], "revoked in another region")


if __name__ == "__main__":
    unittest.main()
