"""A fault-injecting, byte-counting HTTP proxy on 127.0.0.1 in front of moto's S3 server.

s3fs talks to the proxy as if it were S3; each request is forwarded to moto unchanged unless a rule
matches it first, or it carries an ``x-amz-checksum-crc32`` its body does not match: S3 refuses that
(400 BadDigest) and moto does not check. Rules answer what a real object store does on a bad day:
throttling (503 SlowDown), access denied (403), a latency spike, a connection dropped half way through
an upload, or an upload that is read and never answered. What passes is counted at the wire
(``Wire``), so an accounting that misses or double counts a transfer cannot agree with it.
"""

from __future__ import annotations

import base64
import http.client
import re
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    400: ("BadDigest", "The CRC32 you specified did not match the calculated checksum."),
}


@dataclass
class Rule:
    """Apply ``action`` to the next ``times`` requests of ``method`` whose path contains ``path``."""

    method: str
    path: str
    action: str
    """``throttle`` | ``deny`` | ``delay`` | ``drop`` | ``hang``."""
    times: int = 1
    seconds: float = 0.0
    hits: int = 0


@dataclass
class Wire:
    """Object bytes that crossed the proxy, per ``bucket/key`` (path-style addressing, as botocore uses
    for an ``http://127.0.0.1`` endpoint)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Payload bytes uploaded per key (puts and parts, retries included)."""
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Body bytes of ``GetObject`` answers per key, ranged or not."""
    sizes: dict[str, int] = field(default_factory=dict)
    """What the bucket holds: each key's size once its put or multipart upload completed."""
    deleted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Each deleted key's size (``DeleteObject``, or a ``DeleteObjects`` batch naming it)."""
    parts_sent: list[tuple[str, int]] = field(default_factory=list)
    """(key, part number) of every part uploaded, in the order they completed."""
    crc32_checked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Uploads (puts and parts) per key whose ``x-amz-checksum-crc32`` header the proxy checked."""
    _parts: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))

    def record(self, method: str, path: str, headers: Any, body: bytes, status: int, data: bytes) -> None:
        """Count one answered request (called under the proxy's lock)."""
        parts = urlsplit(path)
        key = unquote(parts.path.lstrip("/"))
        query = parse_qs(parts.query, keep_blank_values=True)
        payload = int(headers.get("x-amz-decoded-content-length", len(body)))
        if not 200 <= status < 300:
            return
        if method == "PUT" and "/" in key:
            self.sent[key] += payload
            if "uploadId" in query:
                self._parts[query["uploadId"][0]][int(query["partNumber"][0])] = payload
                self.parts_sent.append((key, int(query["partNumber"][0])))
            elif "x-amz-copy-source" not in headers:
                self.sizes[key] = payload
        elif method == "POST" and "uploadId" in query:  # the multipart upload completes
            self.sizes[key] = sum(self._parts.pop(query["uploadId"][0]).values())
        elif method == "DELETE" and "uploadId" in query:  # aborted
            self._parts.pop(query["uploadId"][0], None)
        elif method == "DELETE":
            self._drop(key)
        elif method == "POST" and "delete" in query:
            bucket = key.split("/", 1)[0]
            for name in re.findall(rb"<Key>(.*?)</Key>", body):
                self._drop(f"{bucket}/{_xml_text(name)}")
        elif method == "GET" and "/" in key:  # an object (a listing is GET /bucket?...)
            self.received[key] += len(data)

    def _drop(self, key: str) -> None:
        if key in self.sizes:
            self.deleted[key] += self.sizes.pop(key)


def _xml_text(raw: bytes) -> str:
    text = raw.decode()
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&")):
        text = text.replace(entity, char)
    return text


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []
        """``(method, path, what happened)`` of each request: a rule's action, ``bad-digest`` (refused for a
        body its ``x-amz-checksum-crc32`` does not match) or ``pass``."""
        self.ranges: list[tuple[str, str]] = []
        """``(path, Range header)`` of each ranged GET."""
        self.most_ranges_at_once = 0
        self._ranges_now = 0
        self.most_parts_at_once = 0
        """The most ``UploadPart`` requests in flight at one time."""
        self._parts_now = 0
        self.wire = Wire()
        self.lock = threading.Lock()
        """Held while ``wire`` is updated: hold it to read ``wire`` consistently."""
        self._lock = self.lock
        self._stop = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add(self, method: str, path: str, action: str, *, times: int = 1, seconds: float = 0.0) -> Rule:
        rule = Rule(method, path, action, times, seconds)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _match(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.method == method and rule.path in path and rule.hits < rule.times:
                    rule.hits += 1
                    return rule
        return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        rule = self._match(h.command, h.path)
        ranged = h.command == "GET" and "Range" in h.headers
        part = h.command == "PUT" and "partNumber=" in h.path
        with self._lock:
            if ranged:
                self.ranges.append((h.path, h.headers["Range"]))
                self._ranges_now += 1
                self.most_ranges_at_once = max(self.most_ranges_at_once, self._ranges_now)
            if part:
                self._parts_now += 1
                self.most_parts_at_once = max(self.most_parts_at_once, self._parts_now)
        try:
            self._answer(h, rule, length)
        finally:
            with self._lock:
                self._ranges_now -= ranged
                self._parts_now -= part

    def _answer(self, h: BaseHTTPRequestHandler, rule: Rule | None, length: int) -> None:
        if rule is not None and rule.action == "drop":  # half the body, then the connection is gone
            self.log.append((h.command, h.path, rule.action))
            h.rfile.read(length // 2)
            h.close_connection = True
            h.connection.shutdown(2)
            return
        body = h.rfile.read(length) if length else b""
        crc = h.headers.get("x-amz-checksum-crc32")
        if crc is not None and "aws-chunked" not in h.headers.get("Content-Encoding", ""):
            if base64.b64decode(crc) != zlib.crc32(body).to_bytes(4, "big"):
                self.log.append((h.command, h.path, "bad-digest"))  # refused, whatever rule matched
                self._error(h, 400)
                return
            with self._lock:
                self.wire.crc32_checked[unquote(urlsplit(h.path).path.lstrip("/"))] += 1
        self.log.append((h.command, h.path, rule.action if rule else "pass"))
        if rule is not None:
            if rule.action == "hang":
                self._stop.wait(rule.seconds or None)
                h.close_connection = True
                return
            if rule.action == "delay":
                time.sleep(rule.seconds)
            elif rule.action in ("throttle", "deny"):
                self._error(h, 503 if rule.action == "throttle" else 403)
                return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("expect", "connection")}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            with self._lock:
                self.wire.record(h.command, h.path, h.headers, body, resp.status, data)
            h.send_response(resp.status, resp.reason)
            head = h.command == "HEAD"  # a HEAD answer keeps the object's length
            skip = {"transfer-encoding", "connection", "server", "date"} | (
                set() if head else {"content-length"}
            )
            for key, value in resp.getheaders():
                if key.lower() not in skip:
                    h.send_header(key, value)
            if not head:
                h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        finally:
            conn.close()

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int) -> None:
        code, message = _ERRORS[status]
        data = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
