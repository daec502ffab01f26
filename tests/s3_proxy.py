"""An HTTP proxy on 127.0.0.1 in front of an S3 server that counts the object bytes crossing it.

Per object key it counts the payload sent up (``PutObject`` bodies and ``UploadPart`` bodies) and
down (``GetObject`` bodies, ranged or not), and it keeps what the bucket holds: each key's size once its
put or multipart upload completes, dropped when the key is deleted (``DeleteObject`` or a
``DeleteObjects`` batch, whose keys it reads from the request). Bytes are counted at the wire, so an
accounting that misses or double counts a transfer cannot agree with it. Path-style addressing only
(what botocore uses for an ``http://127.0.0.1`` endpoint).
"""

from __future__ import annotations

import http.client
import re
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class CountingProxy:
    """Start with ``with CountingProxy(target) as proxy``; point clients at ``proxy.url``."""

    def __init__(self, target: str) -> None:
        self.target = urlsplit(target)
        self.lock = threading.Lock()
        self.sent: dict[str, int] = defaultdict(int)
        """Payload bytes uploaded per key (puts and parts, retries included)."""
        self.received: dict[str, int] = defaultdict(int)
        """Body bytes of ``GetObject`` responses per key."""
        self.sizes: dict[str, int] = {}
        """What the bucket holds: key -> size."""
        self.deleted: dict[str, int] = defaultdict(int)
        """Bytes deleted per key (its size when deleted)."""
        self._parts: dict[str, dict[int, int]] = defaultdict(dict)
        self.parts_sent: list[tuple[str, int]] = []
        """(key, part number) of every part uploaded, in the order they completed."""
        self.most_parts_at_once = 0
        """The most ``UploadPart`` requests in flight at one time."""
        self._parts_now = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self._body()
                part = self.command == "PUT" and "partNumber=" in self.path
                if part:
                    with proxy.lock:
                        proxy._parts_now += 1
                        proxy.most_parts_at_once = max(proxy.most_parts_at_once, proxy._parts_now)
                try:
                    self._relay(body)
                finally:
                    if part:
                        with proxy.lock:
                            proxy._parts_now -= 1

            def _relay(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy._count(self.command, self.path, self.headers, body, resp.status, data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self, method: str, path: str, headers: Any, body: bytes, status: int, data: bytes) -> None:
        parts = urlsplit(path)
        key = unquote(parts.path.lstrip("/"))  # bucket/key
        query = parse_qs(parts.query, keep_blank_values=True)
        payload = int(headers.get("x-amz-decoded-content-length", len(body)))
        ok = 200 <= status < 300
        with self.lock:
            if method == "PUT" and ok and "/" in key:
                self.sent[key] += payload
                if "uploadId" in query:
                    self._parts[query["uploadId"][0]][int(query["partNumber"][0])] = payload
                    self.parts_sent.append((key, int(query["partNumber"][0])))
                elif "x-amz-copy-source" not in headers:
                    self.sizes[key] = payload
            elif method == "POST" and ok and "uploadId" in query:  # the multipart upload completes
                self.sizes[key] = sum(self._parts.pop(query["uploadId"][0]).values())
            elif method == "DELETE" and ok and "uploadId" in query:
                self._parts.pop(query["uploadId"][0], None)
            elif method == "DELETE" and ok:
                self._drop(key)
            elif method == "POST" and ok and "delete" in query:  # DeleteObjects: keys in the request
                bucket = key.split("/", 1)[0]
                for k in re.findall(rb"<Key>(.*?)</Key>", body):
                    self._drop(f"{bucket}/{_xml_text(k)}")
            elif method == "GET" and ok and "/" in key:  # an object (a listing is GET /bucket?...)
                self.received[key] += len(data)

    def _drop(self, key: str) -> None:
        if key in self.sizes:
            self.deleted[key] += self.sizes.pop(key)


def _xml_text(raw: bytes) -> str:
    text = raw.decode()
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&")):
        text = text.replace(entity, char)
    return text
