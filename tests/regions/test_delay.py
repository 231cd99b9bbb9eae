"""The delaying proxy: every round trip pays the delay both ways, pipelined messages pay it
once (not once each), bytes keep their order, and a cut drops open connections and refuses new
ones until healed."""

import os
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import delay  # noqa: E402


def echo_server():
    """A loopback echo server on a thread; its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve(conn):
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                conn.sendall(data)

    def accept():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1]


def recv_exactly(conn, n):
    got = b""
    while len(got) < n:
        data = conn.recv(n - len(got))
        if not data:
            raise ConnectionError("closed")
        got += data
    return got


class DelayTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.echo = echo_server()

    def test_a_round_trip_pays_the_delay_both_ways_and_a_pipeline_pays_it_once(self):
        d = delay.Delay(self.echo, 100).start()
        with socket.create_connection(("127.0.0.1", d.port)) as c:
            started = time.monotonic()
            c.sendall(b"ping")
            self.assertEqual(recv_exactly(c, 4), b"ping")
            self.assertGreaterEqual(time.monotonic() - started, 0.2)
            messages = [f"message {i:03};".encode() for i in range(30)]
            started = time.monotonic()
            for m in messages:
                c.sendall(m)
                time.sleep(0.005)
            got = recv_exactly(c, sum(len(m) for m in messages))
            took = time.monotonic() - started
        self.assertEqual(got, b"".join(messages), "in order, whole")
        self.assertGreaterEqual(took, 0.2)
        # 30 messages one after another would take 6 s; pipelined, one round trip and the
        # 0.15 s of sending (a loaded machine given ten times that).
        self.assertLess(took, 3.0)

    def test_a_cut_drops_and_refuses_until_healed(self):
        d = delay.Delay(self.echo, 1).start()
        c = socket.create_connection(("127.0.0.1", d.port))
        c.sendall(b"a")
        self.assertEqual(recv_exactly(c, 1), b"a")
        d.cut()
        c.settimeout(5)
        with self.assertRaises((ConnectionError, OSError)):
            c.sendall(b"b")
            recv_exactly(c, 1)
        c.close()
        late = socket.create_connection(("127.0.0.1", d.port))
        late.settimeout(5)
        with self.assertRaises((ConnectionError, OSError)):
            late.sendall(b"c")
            recv_exactly(late, 1)
        late.close()
        d.heal()
        time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", d.port)) as again:
            again.sendall(b"d")
            self.assertEqual(recv_exactly(again, 1), b"d")

    def test_a_group_in_its_own_process_proxies_cuts_heals_and_counts(self):
        group = delay.Group([self.echo, self.echo], 1)
        self.addCleanup(group.stop)
        for port in group.ports:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"a")
                self.assertEqual(recv_exactly(c, 1), b"a")
        self.assertEqual(group.carried(), 2)
        kept = socket.create_connection(("127.0.0.1", group.ports[1]))
        kept.settimeout(5)
        group.cut()
        with self.assertRaises((ConnectionError, OSError)):
            kept.sendall(b"b")
            recv_exactly(kept, 1)
        kept.close()
        group.heal()
        with socket.create_connection(("127.0.0.1", group.ports[0])) as again:
            again.sendall(b"c")
            self.assertEqual(recv_exactly(again, 1), b"c")
        group.stop()
        self.assertIsNotNone(group.proc.poll(), "standard input closed ends the process")


if __name__ == "__main__":
    unittest.main()
