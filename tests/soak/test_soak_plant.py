"""A real planted violation: a soak whose gw3 runs with the `tight` plan's minute limit doubled
(every other node, and the records, say 30), with a client that talks to gw3 alone, under a
node kill and a backend restart, must fail the checker's `quota` invariant, and only it. The checker's other invariants are planted in records (test_check.py); this one shows the
whole chain, gateway to records to checker, catches a node that admits too much.

    python3 tests/soak/test_soak_plant.py [--bin-dir target/debug]
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import check  # noqa: E402
import fleet  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=os.path.join(fleet.ROOT, "target/debug"))
    args = ap.parse_args()
    out = os.path.join(fleet.ROOT, f"target/soak/planted-doubled-limit-{int(time.time())}")
    # With faults on (a node killed, the backend restarted): the allowances of a store fault
    # would cover a node deciding alone, so the planted node is caught where none is.
    r = subprocess.run([sys.executable, os.path.join(HERE, "soak.py"), "--minutes", "1.2",
                        "--seed", "11", "--faults", "node_kill,backend_restart",
                        "--plant", "doubled-limit",
                        "--bin-dir", args.bin_dir, "--out", out])
    report = check.check(out)
    failed = sorted(r.name for r in report.results if not r.ok)
    if r.returncode == 0 or failed != ["quota"]:
        sys.exit(f"test_soak_plant: a node with a doubled limit should fail `quota` alone; "
                 f"soak exited {r.returncode}, failed: {failed or 'nothing'} (records: {out})")
    # Caught for the planted reason: a minute over its bound whose requests all went to gw3
    # (the plant's client talks to gw3 alone; every other key's go to all three nodes).
    if not any("minute" in v["what"] and v["records"]
               and all(q.get("node") == "gw3" for q in v["records"])
               for v in report.result("quota").violations):
        sys.exit(f"test_soak_plant: `quota` failed, but on no minute of the planted key at gw3 "
                 f"(records: {out})")
    print(f"test_soak_plant: the doubled limit was caught: {report.result('quota').figure}")


if __name__ == "__main__":
    main()
