#!/usr/bin/env python3
"""An OTLP/HTTP traces receiver for the tests, decoding with the `opentelemetry-proto` package
(PyPI), the protocol's own generated messages, so that what it records is what any collector
would read, not what our code thinks it wrote.

Listens on 127.0.0.1 on a free port (written to `--port-file` once it listens), takes
`POST /v1/traces` with `Content-Type: application/x-protobuf`, decodes each body as an
`ExportTraceServiceRequest` and appends one JSON line per span to `--record`:
{"trace_id", "span_id", "parent_span_id" (hex, "" for none), "name", "kind" (the enum's name),
"start_ns", "end_ns", "attributes" {key: value}, "status" (the code's name), "status_message",
"flags", "resource" {key: value}, "scope", "scope_version"}. Answers 200 with an empty
`ExportTraceServiceResponse`, or 400 to a body that does not decode. `--delay S` holds each
answer that long (a slow collector); `--tls-cert PEM --tls-key PEM` serves HTTPS.

Usage: otlp_receiver.py --record FILE --port-file FILE [--delay SECONDS]
       [--tls-cert PEM --tls-key PEM]"""
import argparse
import json
import os
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


def spans_of(request):
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "kind": Span.SpanKind.Name(s.kind),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "attributes": attributes(s.attributes),
                    "status": Status.StatusCode.Name(s.status.code),
                    "status_message": s.status.message,
                    "flags": s.flags,
                    "resource": resource,
                    "scope": ss.scope.name,
                    "scope_version": ss.scope.version,
                }


def main():
    args = argparse.ArgumentParser()
    args.add_argument("--record", required=True)
    args.add_argument("--port-file", required=True)
    args.add_argument("--delay", type=float, default=0.0)
    args.add_argument("--tls-cert")
    args.add_argument("--tls-key")
    opts = args.parse_args()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            request = ExportTraceServiceRequest()
            try:
                request.ParseFromString(body)
            except Exception:  # noqa: BLE001 - a body that is not the message: 400
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            time.sleep(opts.delay)
            lines = [json.dumps(s) + "\n" for s in spans_of(request)]
            with lock, open(opts.record, "a") as f:
                f.writelines(lines)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if opts.tls_cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(opts.tls_cert, opts.tls_key)
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    with open(opts.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(opts.port_file + ".tmp", opts.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
