"""The soak's load generator: many keys at a fixed total rate, every request recorded.

Each key is a stream with a rate of its own and a behaviour (`steady`, a `tight` plan whose
limits bite, a `wild` script that keeps sending after its 429s and so gets banned, a `burst`er
whose requests arrive several at once so its concurrency bites, a customer's keys sharing one
quota, `createPet` costing 5). A scheduler hands each request, at its time, to a pool of workers;
each worker keeps one connection per node. Every request is written to `history.ndjson` as sent
and as answered (or not): the checker reads nothing else of the clients'.

A request with no answer within `TIMEOUT` is recorded with `status: null`: the checker counts it
as possibly admitted. The generator never waits on a slow node beyond that.

The workers behave like a careful HTTP/1.1 client (urllib3's, Go's): a kept-alive connection the
server has closed meanwhile (a node that drained it in an upgrade) is not reused, and a GET that
fails on a reused connection before any answer is sent once more on a new one (RFC 9112 9.3.1),
which the record says (`attempts: 2`). A POST is never sent twice.
"""

import heapq
import http.client
import json
import queue
import random
import select
import threading
import time

# Past the backend's own deadline (upstream_read_timeout_ms = 5000 in the soak), so a slow
# backend's 504 is an answer, not a request left without one.
TIMEOUT = 15.0
HEADERS = {"x-ratelimit-limit": "limit", "x-ratelimit-remaining": "remaining",
           "x-ratelimit-reset": "reset"}


class Stream:
    """One key's requests: `rate` a second on average, `burst` at a time."""

    def __init__(self, key, token, quota, rate, burst=1, costs=None, create_share=0.1):
        self.key, self.token, self.quota, self.costs = key, token, quota, costs or {}
        self.rate, self.burst, self.create_share = rate, burst, create_share
        self.stop_at = None  # a revoked key goes on a while, then stops
        self.polite = True  # waits out a 429's Retry-After (a wild script does not)
        self.nodes = None  # the nodes it talks to (None: any, at random)
        self.pause_until = 0.0


class History:
    """history.ndjson, one line a request, written by whichever worker finished it."""

    def __init__(self, path):
        self.out = open(path, "a", buffering=1)
        self.lock = threading.Lock()
        self.seq = 0
        self.counts = {}

    def next_seq(self):
        with self.lock:
            self.seq += 1
            return self.seq

    def write(self, record):
        line = json.dumps(record, separators=(",", ":"))
        with self.lock:
            self.out.write(line + "\n")
            k = record["status"] if record["status"] is not None else "none"
            self.counts[k] = self.counts.get(k, 0) + 1

    def close(self):
        self.out.close()


class Load:
    """The scheduler and its workers; `add`/`remove` change the streams while it runs."""

    def __init__(self, nodes, history, seed, workers=48):
        self.nodes = nodes  # name -> port
        self.history = history
        self.rng = random.Random(seed ^ 0x5EED)
        self.heap, self.lock = [], threading.Lock()
        self.jobs = queue.Queue(maxsize=4096)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(workers)]
        self.dropped = 0
        self.lag_max = 0.0  # how late the scheduler sent a request at worst (a saturated soak)

    def add(self, stream, at=None):
        with self.lock:
            heapq.heappush(self.heap, (at or time.time(), id(stream), stream))

    def start(self):
        for t in self.threads:
            t.start()
        self.sched = threading.Thread(target=self._schedule, daemon=True)
        self.sched.start()

    def stop(self):
        self.stopping.set()
        self.sched.join()
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(TIMEOUT + 2)

    def _schedule(self):
        while not self.stopping.is_set():
            with self.lock:
                due = self.heap[0][0] if self.heap else time.time() + 0.05
            wait = due - time.time()
            if wait > 0:
                time.sleep(min(wait, 0.05))
                continue
            with self.lock:
                _, _, s = heapq.heappop(self.heap)
            if s.stop_at is not None and time.time() > s.stop_at:
                continue
            if s.pause_until <= time.time():
                self.lag_max = max(self.lag_max, time.time() - due)
                self._enqueue(s)
            with self.lock:
                gap = self.rng.expovariate(s.rate / s.burst)
                heapq.heappush(self.heap, (due + gap, id(s), s))

    def _enqueue(self, s):
        node = self.rng.choice(s.nodes or sorted(self.nodes))
        for _ in range(s.burst):
            op = "createPet" if self.rng.random() < s.create_share else "listPets"
            try:
                self.jobs.put_nowait((s, node, op))
            except queue.Full:
                # The workers are all stuck: recorded in the summary, never silently.
                self.dropped += 1

    def _worker(self):
        conns = {}
        while True:
            job = self.jobs.get()
            if job is None:
                break
            s, node, op = job
            conns[node] = self._send(conns.get(node), s, node, op)
        for c in conns.values():
            if c:
                c.close()

    def _send(self, conn, s, node, op):
        rec = {"seq": self.history.next_seq(), "node": node, "key": s.key, "op": op,
               "cost": s.costs.get(op, 1), "sent": None, "recv": None, "status": None,
               "error": None, "code": None, "limit": None, "remaining": None, "reset": None,
               "ratelimit": None, "retry_after": None}
        if conn is not None and dropped(conn):
            conn.close()
            conn = None
        reused = conn is not None
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.nodes[node], timeout=TIMEOUT)
        body, method, path = None, "GET", "/v1/pets?limit=5"
        headers = {"Authorization": f"Bearer {s.token}"}
        if op == "createPet":
            method, path = "POST", "/v1/pets"
            body = json.dumps({"name": f"soak-{rec['seq']}", "categoryId": 1})
            headers["Content-Type"] = "application/json"
        rec["sent"] = time.time()
        rec["attempts"] = 1
        try:
            try:
                r, data = exchange(conn, method, path, body, headers)
            except (ConnectionError, http.client.RemoteDisconnected) as first:
                if not reused or method != "GET":
                    raise
                rec["first_error"] = type(first).__name__
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.nodes[node], timeout=TIMEOUT)
                rec["attempts"] = 2
                r, data = exchange(conn, method, path, body, headers)
            rec["recv"] = time.time()
            rec["status"] = r.status
            self._headers(rec, r, data)
            if r.status == 429 and s.polite and rec["retry_after"]:
                s.pause_until = rec["recv"] + rec["retry_after"]
            if r.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as e:
            rec["error"] = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
            conn.close()
            conn = None
        self.history.write(rec)
        return conn

    @staticmethod
    def _headers(rec, r, data):
        for h, field in HEADERS.items():
            v = r.getheader(h)
            if v is not None:
                try:
                    rec[field] = int(v)
                except ValueError:
                    pass
        rec["ratelimit"] = r.getheader("ratelimit")
        ra = r.getheader("retry-after")
        rec["retry_after"] = int(ra) if ra and ra.isdigit() else None
        if r.status >= 300:
            try:
                rec["code"] = json.loads(data).get("code")
            except (ValueError, AttributeError):
                rec["code"] = None


def exchange(conn, method, path, body, headers):
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    return r, r.read()


def dropped(conn):
    """Whether the server closed this idle connection (it reads as ready: EOF, or stray bytes)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
