#!/usr/bin/env python3
"""Redis's cost a decision of the ACQUIRE script, by script text alone, for any commits.

`store-load` measures a whole build (its client, its batcher, its script); this measures the
script: the ACQUIRE text of each revision given (`--rev REV`, repeatable; `WORK` for the working
tree) is read out of its `scripts.rs`, loaded into one `redis-server`, and run by `EVALSHA` with
batches of `--decisions` decisions of one hot key (every decision an admission: two windows, the
minute and the day, limits that never bite), the arguments in the form that revision's store
sends. Revisions take turns, `--rounds` times, each turn `--runs` script runs pipelined. Per
turn: the script's own time a decision (`INFO commandstats`) and Redis's whole CPU a decision
(user + system, `/proc`), then the medians.

The arguments follow the store's four forms: before quotas as data (76f7c5f: a minute and a day
limit per decision), quotas as data (1cabfdf: sets of limits, a set and a cost per decision),
with leases (issue 32: a lease length after the ban lengths, a concurrency per set) and packed
(issue 33: the same numbers as little-endian 64-bit integers in two strings, each key once).
The form is recognised from the script's text.

A revision named with `+fcall` (`--rev WORK+fcall`) runs as the gateway runs it on Redis 7
and later: its ACQUIRE loaded as a Redis Function library (the part before the run once, at
`FUNCTION LOAD`; issue 33) and called by `FCALL`; without it, by `EVALSHA` as a script.

With `--callgrind`, `redis-server` runs under valgrind's callgrind instead, and each turn's
figure is the instructions Redis executed a decision (the counters zeroed before the turn and
dumped after it; everything Redis did in between: reading the commands, the script, the
replies): a figure that does not move with the machine, where timings on two shared cores move
by 20 % from run to run. Fewer runs a turn suffice (`--decisions-a-turn 5000`).

Usage: bench/script_cost.py --rev 76f7c5f --rev 1cabfdf --rev WORK --rev WORK+fcall --decisions 1,16,128
"""

import argparse
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["proxy/src/quota/store/scripts.rs", "proxy/src/store/scripts.rs"]


def source(rev):
    if rev == "WORK":
        return (ROOT / PATHS[0]).read_text()
    for path in PATHS:
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True,
                           text=True)
        if r.returncode == 0:
            return r.stdout
    raise SystemExit(f"{rev}: no scripts.rs")


def acquire_text(rs):
    """ACQUIRE as Redis gets it: the macros it names expanded, as often as they nest."""
    macros = dict(re.findall(r'macro_rules! (\w+) \{\s*\(\) => \{\s*(.*?)\n    \};\n\}', rs,
                             re.S))
    m = re.search(r'pub const ACQUIRE: &str = (.*?);\n', rs, re.S)
    if not m:
        raise SystemExit("no ACQUIRE")

    def expand(text):
        parts = []
        for piece in re.finditer(r'(\w+)!\(\)|r#"(.*?)"#', text, re.S):
            parts.append(expand(macros[piece.group(1)]) if piece.group(1) else piece.group(2))
        return "".join(parts)
    return expand(m.group(1))


RUN_STARTS = "local now = tonumber(redis.call('TIME')[1])"


def library_of(text):
    """ACQUIRE as a function library (`function.rs`): its part before the run, then the run."""
    cut = text.index(RUN_STARTS)
    return ("#!lua name=pet_gateway_bench\n" + text[:cut] +
            "\nredis.register_function('pet_acquire_bench', function(KEYS, ARGV)\n" +
            text[cut:] + "\nend)\n")


def args_for(text, decisions):
    """KEYS and ARGV of one batch of `decisions` admissions of one key, in the text's form."""
    key = b"bench:windows:{k1}" if ":windows:{" in text else b"bench:state:{k1}"
    if "local H, E = ARGV[1], ARGV[2]" in text:
        # Packed (issue 33): the key once, the head and the entries as little-endian i64s.
        head = struct.pack("<10q", 10, 86400, 1, 60, 30, 1, 2, 60, 1_000_000_000, 86400) + \
            struct.pack("<2q", 1_000_000_000, 0)
        return [key], [head, struct.pack("<3q", 1, 1, 1) * decisions]
    keys = [key] * decisions
    argv = [b"10", b"86400", b"1", b"60"]
    if "lease_secs" in text:
        argv += [b"30", b"1", b"2", b"60", b"1000000000", b"86400", b"1000000000", b"0"]
    elif "nsets" in text:
        argv += [b"1", b"2", b"60", b"1000000000", b"86400", b"1000000000"]
    else:
        argv += [b"1000000000", b"1000000000"] * decisions
        return keys, argv
    argv += [b"1", b"1"] * decisions
    return keys, argv


def resp(*parts):
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        p = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.f = self.s.makefile("rb")

    def send(self, data):
        self.s.sendall(data)

    def reply(self):
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return rest
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.f.read(n + 2)[:-2]
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected {line!r}")

    def call(self, *parts):
        self.send(resp(*parts))
        return self.reply()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_secs(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def script_usec(conn):
    info = conn.call("INFO", "commandstats").decode()
    calls = usec = 0
    for m in re.finditer(r"cmdstat_(?:evalsha|fcall):calls=(\d+),usec=(\d+)", info):
        calls, usec = calls + int(m.group(1)), usec + int(m.group(2))
    return calls, usec


def run_batches(conn, command, runs):
    """`runs` copies of `command`, pipelined 32 at a time."""
    left = runs
    while left:
        n = min(32, left)
        conn.send(command * n)
        for _ in range(n):
            conn.reply()
        left -= n


def command_for(sha, keys, argv):
    """EVALSHA of the script `sha`, or FCALL of the bench's function when `sha` is None."""
    if sha is None:
        return resp(b"FCALL", b"pet_acquire_bench", str(len(keys)).encode(), *keys, *argv)
    return resp(b"EVALSHA", sha, str(len(keys)).encode(), *keys, *argv)


def turn(conn, pid, sha, keys, argv, runs, decisions):
    """`runs` script runs: (script µs, Redis CPU µs) a decision."""
    command = command_for(sha, keys, argv)
    calls0, usec0 = script_usec(conn)
    cpu0 = cpu_secs(pid)
    run_batches(conn, command, runs)
    cpu1 = cpu_secs(pid)
    calls1, usec1 = script_usec(conn)
    done = (calls1 - calls0) * decisions
    return (usec1 - usec0) / done, (cpu1 - cpu0) * 1e6 / done


def counted_turn(conn, pid, out, sha, keys, argv, runs, decisions):
    """`runs` script runs under callgrind: (instructions a decision, None)."""
    command = command_for(sha, keys, argv)
    subprocess.run(["callgrind_control", "--zero", str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_batches(conn, command, runs)
    path = dump(pid, out)
    total = total_instructions(path)
    path.unlink()
    return total / (runs * decisions), None


def dump(pid, out):
    """Dump callgrind's counters of `pid`; the new dump's path."""
    before = set(out.parent.glob(out.name + "*"))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        new = set(out.parent.glob(out.name + "*")) - before
        if new:
            time.sleep(0.2)
            return new.pop()
        time.sleep(0.05)
    raise SystemExit("callgrind wrote no dump within 30 s")


def total_instructions(path):
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{path}: no summary line")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", action="append", required=True)
    ap.add_argument("--decisions", default="1,16,128")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decisions-a-turn", type=int, default=200_000)
    ap.add_argument("--callgrind", action="store_true",
                    help="count Redis's instructions a decision instead of timing it")
    args = ap.parse_args()
    texts = {rev: acquire_text(source(rev.removesuffix("+fcall"))) for rev in args.rev}
    if sum(rev.endswith("+fcall") for rev in args.rev) > 1:
        raise SystemExit("one revision at most may run as a function")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        under = (["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
                 if args.callgrind else [])
        redis = subprocess.Popen(under + ["redis-server", "--port", str(port), "--bind",
                                          "127.0.0.1", "--save", "", "--appendonly", "no",
                                          "--dir", tmp],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 30
            while True:
                try:
                    conn = Conn(port)
                    conn.call("PING")
                    break
                except (OSError, RuntimeError):
                    if time.time() > deadline:
                        raise
                    time.sleep(0.05)
            shas = {}
            for rev, text in texts.items():
                if rev.endswith("+fcall"):
                    conn.call("FUNCTION", "LOAD", "REPLACE", library_of(text).encode())
                    shas[rev] = None
                else:
                    shas[rev] = conn.call("SCRIPT", "LOAD", text.encode())
            if args.callgrind:
                print(f"{'decisions a run':>16} {'revision':>10} {'Redis instructions/dec':>23}"
                      f"  (medians of {args.rounds} alternated turns)")
            else:
                print(f"{'decisions a run':>16} {'revision':>10} {'script µs/dec':>14} "
                      f"{'Redis CPU µs/dec':>17}  (medians of {args.rounds} alternated turns)")
            for decisions in [int(d) for d in args.decisions.split(",")]:
                runs = max(50, args.decisions_a_turn // decisions)
                figures = {rev: ([], []) for rev in args.rev}
                for r in range(args.rounds + 1):
                    order = args.rev[r % len(args.rev):] + args.rev[:r % len(args.rev)]
                    for rev in order:
                        keys, argv = args_for(texts[rev], decisions)
                        if args.callgrind:
                            s, c = counted_turn(conn, redis.pid, out, shas[rev], keys, argv,
                                                runs, decisions)
                        else:
                            s, c = turn(conn, redis.pid, shas[rev], keys, argv, runs,
                                        decisions)
                        if r:  # the first round warms up
                            figures[rev][0].append(s)
                            figures[rev][1].append(c)
                for rev in args.rev:
                    s, c = figures[rev]
                    if args.callgrind:
                        print(f"{decisions:>16} {rev:>10} {statistics.median(s):>23,.0f}")
                    else:
                        print(f"{decisions:>16} {rev:>10} {statistics.median(s):>14.3f} "
                              f"{statistics.median(c):>17.3f}")
                sys.stdout.flush()
        finally:
            redis.terminate()
            redis.wait()


if __name__ == "__main__":
    main()
