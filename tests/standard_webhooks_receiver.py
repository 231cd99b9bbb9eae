#!/usr/bin/env python3
"""A webhook receiver that trusts only the `standardwebhooks` package (PyPI), as a receiver of
ours would: every POST is verified by `standardwebhooks.Webhook(secret).verify`, once for each
secret given (a rotation: each must verify on its own), and for each delivery the package is
also shown what it must refuse: the body with one byte changed, a secret that is not ours, and
the same delivery read 10 minutes later (the package's clock moved on: too old).

Listens on 127.0.0.1 on a free port, written to `--port-file` once it listens, answers 503 to
its first `--fail-first` requests (so the gateway retries them), then 200 to a delivery that
verifies and 401 to one that does not. Appends one JSON line per request to `--record`:
{"status", "id", "timestamp", "verified": {secret index: bool}, "refused": {check: bool},
"events": n, "error"}.

Usage: standard_webhooks_receiver.py --record FILE --port-file FILE --secret whsec_...
       [--secret ...] [--fail-first N]"""
import argparse
import base64
import datetime
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import standardwebhooks
import standardwebhooks.webhooks as webhooks


class Later(datetime.datetime):
    """The package's clock, 10 minutes on (it allows 5 either way)."""

    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.now(tz) + datetime.timedelta(minutes=10)


def refused(verify):
    try:
        verify()
    except standardwebhooks.WebhookVerificationError:
        return True
    return False


def checks(secret, body, headers):
    """What the package must refuse of this delivery: each True when it did."""
    wh = standardwebhooks.Webhook(secret)
    tampered = bytearray(body)
    tampered[len(tampered) // 2] ^= 0x01
    stranger = standardwebhooks.Webhook("whsec_" + base64.b64encode(os.urandom(32)).decode())
    out = {
        "tampered_body": refused(lambda: wh.verify(bytes(tampered), headers)),
        "wrong_secret": refused(lambda: stranger.verify(body, headers)),
    }
    real = webhooks.datetime
    webhooks.datetime = Later
    try:
        out["old_timestamp"] = refused(lambda: wh.verify(body, headers))
    finally:
        webhooks.datetime = real
    return out


def main():
    args = argparse.ArgumentParser()
    args.add_argument("--record", required=True)
    args.add_argument("--port-file", required=True)
    args.add_argument("--secret", action="append", required=True)
    args.add_argument("--fail-first", type=int, default=0)
    opts = args.parse_args()
    lock = threading.Lock()
    seen = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            headers = {k: v for k, v in self.headers.items()}
            entry = {
                "id": self.headers.get("webhook-id"),
                "timestamp": self.headers.get("webhook-timestamp"),
                "verified": {},
            }
            with lock:
                seen["requests"] += 1
                failing = seen["requests"] <= opts.fail_first
            try:
                for i, secret in enumerate(opts.secret):
                    events = standardwebhooks.Webhook(secret).verify(body, headers)
                    entry["verified"][i] = True
                entry["events"] = len(events)
                entry["refused"] = checks(opts.secret[0], body, headers)
            except Exception as e:  # noqa: BLE001 - recorded, answered 401
                entry["error"] = f"{type(e).__name__}: {e}"
            verified = len(entry["verified"]) == len(opts.secret)
            status = 503 if failing else (200 if verified else 401)
            entry["status"] = status
            with lock, open(opts.record, "a") as f:
                f.write(json.dumps(entry) + "\n")
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(opts.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(opts.port_file + ".tmp", opts.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
