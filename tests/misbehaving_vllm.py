"""A vLLM-shaped HTTP server on loopback that misbehaves as told (hang, 5xx, reset, drip, huge, gzip bomb, a
proxy's HTML page, +3.0 log-probs, malformed answers): tests/unit/test_scorer_backend_failures.py,
tests/integration/test_scorer_outage.py and bench/abuse.py."""

from __future__ import annotations

import gzip
import io
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Misbehaving(BaseHTTPRequestHandler):
    """Answers POST /v1/completions as ``server.mode`` says; "ok" answers valid log-probs of -1 nats."""

    server: MisbehavingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: object) -> None:  # quiet: pytest shows stderr of failing tests
        pass

    def do_GET(self) -> None:  # /v1/models, the first request of a scorer's load and the breaker's probe
        self.server.tries += 1
        if self.server.mode == "hang":
            self.server.release.wait(60)
            return
        if self.server.mode == "html":
            return self._send(200, b"<html><body>502 Bad Gateway (proxy)</body></html>", "text/html")
        if self.server.mode == "ok":
            return self._send(200, json.dumps({"data": [{"id": "m", "max_model_len": 2048}]}).encode())
        self._send(503, b'{"error": {"message": "engine is restarting"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.server.mode
        self.server.tries += 1
        if self.path == "/tokenize" and mode == "ok" and self.server.tokenize is not None:
            return self._send(200, json.dumps({"tokens": self.server.tokenize(body["prompt"])}).encode())
        if mode == "hang":
            self.server.release.wait(60)
            return
        if mode == "reset":  # RST instead of an answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()  # the file objects on it hold it open: close them too
            self.rfile.close()
            self.wfile = io.BytesIO()  # what the handler's finish() flushes now
            return
        if mode == "5xx":
            return self._send(503, b'{"error": {"message": "engine is restarting"}}')
        if mode == "html":
            return self._send(200, b"<html><body>502 Bad Gateway (proxy)</body></html>", "text/html")
        if mode == "drip":  # a valid start, a byte every 50 ms: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            with _suppress_disconnect():
                for _ in range(100000):
                    if self.server.release.wait(0.05):
                        return
                    self.wfile.write(b" ")
                    self.wfile.flush()
            return
        if mode == "huge":
            self.send_response(200)
            self.send_header("Content-Length", str(100 * 2**20))
            self.end_headers()
            with _suppress_disconnect():
                for _ in range(100):
                    self.wfile.write(b" " * 2**20)
            return
        if mode == "gzip-bomb":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(BOMB)))
            self.end_headers()
            with _suppress_disconnect():
                self.wfile.write(BOMB)
            return
        if mode == "malformed":
            return self._send(200, b'{"choices": [{"index": 0, "text": "no log-probs here"}]}')
        value = 3.0 if mode == "positive" else -1.0
        choices = [
            {"index": i, "prompt_logprobs": [None] + [{str(t): {"logprob": value}} for t in sequence[1:]]}
            for i, sequence in enumerate(body["prompt"])
        ]
        self._send(200, json.dumps({"choices": choices}).encode())

    def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _suppress_disconnect:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ConnectionError)


class MisbehavingServer(ThreadingHTTPServer):
    daemon_threads = True
    mode = "ok"
    tries = 0
    tokenize: Callable[[str], list[int]] | None = None  # answers POST /tokenize as the scorer's tokenizer would

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Misbehaving)
        self.release = threading.Event()


BOMB = gzip.compress(b"\0" * 256 * 2**20, compresslevel=9)  # ~250 KB that expands to 256 MB


@contextmanager
def misbehaving_server(mode: str = "ok") -> Iterator[MisbehavingServer]:
    """The server, serving on a thread; its handlers are released and it is closed on exit."""
    httpd = MisbehavingServer()
    httpd.mode = mode
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
