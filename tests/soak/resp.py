"""A Redis client small enough to read at once (RESP2 over a socket), for the soak's own calls:
its faults (a slow script, a role check) and the counts it reads at the end.

The soak uses no Redis library so that it runs on the machine's Python alone, like the rest of
tests/soak.
"""

import socket


class RedisError(Exception):
    """An error reply, or a connection that failed."""


class Redis:
    """One connection, logged in as `user`; every call has `timeout` seconds."""

    def __init__(self, port, user=None, password=None, timeout=2.0, host="127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.file = self.sock.makefile("rb")
        if password is not None:
            self.call("AUTH", *([user] if user else []), password)

    def close(self):
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, *args):
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        try:
            self.sock.sendall(b"".join(parts))
            return self._reply()
        except (OSError, ValueError) as e:
            raise RedisError(f"{type(e).__name__}: {e}") from e

    def _reply(self):
        line = self.file.readline()
        if not line:
            raise RedisError("the connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.file.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RedisError(f"an unreadable reply: {line!r}")


def call_once(port, user, password, *args, timeout=2.0):
    """One call on a connection of its own."""
    with Redis(port, user, password, timeout=timeout) as r:
        return r.call(*args)
