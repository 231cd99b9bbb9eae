"""A real planted violation for the soak with regions: region c's nodes run with acme's minute
limit doubled (its plan says 120; every other region's, and the records', 60), so region c asks
the global store with a limit of 120 and is granted past the true one. Under the soak's faults
the checker's `quota` must fail, on acme, and nothing else.

    python3 tests/regions/test_regions_plant.py [--bin-dir target/debug]
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import regions_soak  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=os.path.join(harness.ROOT, "target/debug"))
    args = ap.parse_args()
    out = os.path.join(harness.ROOT, f"target/regions/planted-doubled-limit-{int(time.time())}")
    r = subprocess.run([sys.executable, os.path.join(HERE, "regions_soak.py"), "--minutes", "1.5",
                        "--seed", "11", "--plant", "doubled-limit", "--bin-dir", args.bin_dir,
                        "--out", out])
    metered = {(k, m): n for k, m, n in
               regions_soak.json.load(open(os.path.join(out, "metered.json")))}
    results = regions_soak.check(out, metered)
    failed = sorted(name for name, (violations, _) in results.items() if violations)
    if r.returncode == 0 or failed != ["quota"]:
        sys.exit(f"test_regions_plant: a region granted past the limit should fail `quota` "
                 f"alone; the soak exited {r.returncode}, failed: {failed or 'nothing'} "
                 f"(records: {out})")
    if not all(v.startswith("acme ") for v in results["quota"][0]):
        sys.exit(f"test_regions_plant: `quota` failed on a key other than acme: "
                 f"{results['quota'][0]} (records: {out})")
    print(f"test_regions_plant: the doubled limit was caught: {results['quota'][0][0]}")


if __name__ == "__main__":
    main()
