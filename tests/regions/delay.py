"""A TCP proxy that delays every byte by a fixed time each way: the path between two regions on
one machine, whose kernel has no `netem`. Bytes keep their order and are not held back by one
another (a chunk read at t goes out at t + delay however many are in flight), so a pipelined
client sees the delay once per round trip, as across a real link, not once per command. A
proxy can be cut (new connections refused, open ones dropped: a partition) and healed.

    python3 tests/regions/delay.py LISTEN_PORT TARGET_PORT DELAY_MS   (runs until killed)

or, from Python, `Delay(target_port, delay_ms).start()` on a thread of its own, or
`Group([target_port, ...], delay_ms)`: a region's proxies in a process of their own, so that
their work does not share a global interpreter lock with the load generator that times the
requests (a harness measuring latency must not slow its own clocks).
"""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time


class Delay:
    def __init__(self, target_port, delay_ms, listen_port=0, host="127.0.0.1"):
        self.target = (host, target_port)
        self.delay = delay_ms / 1000.0
        self.host, self.port = host, listen_port
        self.loop = None
        self.server = None
        self.writers = set()
        self.cut_now = False
        self.ready = threading.Event()
        # Connections carried (not refused by a cut): a harness shows its paths were taken.
        self.carried = 0

    # The thread's side.

    def start(self):
        """Runs the proxy on a daemon thread; returns once it listens (its port: `self.port`)."""
        threading.Thread(target=self._run, daemon=True, name=f"delay-{self.target[1]}").start()
        if not self.ready.wait(10):
            raise RuntimeError("the delaying proxy did not start")
        return self

    def _run(self):
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._listen())
        self.ready.set()
        self.loop.run_forever()

    async def _listen(self):
        self.server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    def cut(self):
        """A partition: every open connection dropped, new ones refused, until `heal`."""
        self.loop.call_soon_threadsafe(self._cut)

    def heal(self):
        self.loop.call_soon_threadsafe(setattr, self, "cut_now", False)

    def _cut(self):
        self.cut_now = True
        for w in list(self.writers):
            w.transport.abort()

    # The loop's side.

    async def _accept(self, reader, writer):
        if self.cut_now:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if self.cut_now:
            # Cut while this connection was being opened: `_cut` could not see it yet.
            for w in (writer, up_writer):
                w.transport.abort()
            return
        self.carried += 1
        for w in (writer, up_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.writers.add(w)
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self.writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader, writer):
        """Reads as fast as the sender sends; each chunk leaves `delay` after it came."""
        queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.transport.abort()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((time.monotonic() + self.delay, data or None))
                if not data:
                    break
            await sender
        except (ConnectionError, asyncio.CancelledError):
            sender.cancel()


class Group:
    """Delaying proxies to `targets`, in a child process (`delay.py --group`) steered by lines
    on its standard input: `cut`, `heal`, `carried` (answered with the connections carried, a
    JSON number). The child ends when its standard input closes, so a harness that dies takes
    its proxies with it."""

    def __init__(self, targets, delay_ms):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--group", str(delay_ms)] + [str(t) for t in targets],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the delaying proxies' process did not start")
        self.ports = json.loads(line)

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def cut(self):
        self.must("cut")

    def heal(self):
        self.must("heal")

    def must(self, command):
        answer = self.ask(command)
        if answer != command:
            raise RuntimeError(f"the delaying proxies' process: {answer}")

    def carried(self):
        return self.ask("carried")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_group(delay_ms, targets):
    """The child of `Group`: one proxy per target, then commands until standard input ends."""
    proxies = [Delay(t, delay_ms).start() for t in targets]
    print(json.dumps([p.port for p in proxies]), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "carried":
            print(json.dumps(sum(p.carried for p in proxies)), flush=True)
            continue
        if command not in ("cut", "heal"):
            print(json.dumps(f"unknown: {command}"), flush=True)
            continue
        for p in proxies:
            getattr(p, command)()
        # Answered once every proxy's loop has done it: a cut is in force when `cut` returns.
        done = []
        for p in proxies:
            ran = threading.Event()
            p.loop.call_soon_threadsafe(ran.set)
            done.append(ran.wait(5))
        print(json.dumps(command if all(done) else f"{command}: not done within 5 s"),
              flush=True)


def main(argv):
    if argv[:1] == ["--group"]:
        serve_group(float(argv[1]), [int(t) for t in argv[2:]])
        return
    listen, target, delay_ms = int(argv[0]), int(argv[1]), float(argv[2])
    d = Delay(target, delay_ms, listen_port=listen).start()
    print(f"127.0.0.1:{d.port} -> 127.0.0.1:{target}, {delay_ms} ms each way", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
