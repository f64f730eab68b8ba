"""A vLLM scorer whose server misbehaves, against a real HTTP server on loopback: every try ends within its
deadline, answers are read within a size cap (as sent and decompressed), an outage (hang, 5xx, reset, drip,
a proxy's HTML page) is retried and then reported as the server not answering, and an answer without valid
log-probs fails with a named error. The real vLLM server: tests/vllm."""

from __future__ import annotations

import gzip
import io
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scoring import ScoringConfig
from service.jobs.interrupts import ScorerUnavailable
from service.jobs.vllm import MalformedAnswer, VllmScorer
from service.settings import VllmClientSettings, VllmEndpoint
from tests.conftest import random_batch

DEADLINE_SECONDS = 1.0
CAP_BYTES = 2**20
# Generous: two tries of one deadline, the backoff between them, and a busy machine.
WITHIN_SECONDS = 20.0


class Misbehaving(BaseHTTPRequestHandler):
    """Answers POST /v1/completions as ``server.mode`` says; "ok" answers valid log-probs of -1 nats."""

    server: MisbehavingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: object) -> None:  # quiet: pytest shows stderr of failing tests
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.server.mode
        self.server.tries += 1
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

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Misbehaving)
        self.release = threading.Event()


BOMB = gzip.compress(b"\0" * 256 * 2**20, compresslevel=9)  # ~250 KB that expands to 256 MB


@pytest.fixture
def server() -> Iterator[MisbehavingServer]:
    httpd = MisbehavingServer()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


def scorer_of(server: MisbehavingServer) -> VllmScorer:
    port = server.server_address[1]
    endpoint = VllmEndpoint.parse(f"vllm+http://127.0.0.1:{port}?model=m&tokenizer=t")
    assert endpoint is not None
    client = VllmClientSettings(
        timeout_seconds=DEADLINE_SECONDS, concurrency=2, retries=1, request_tokens=64, max_answer_bytes=CAP_BYTES
    )
    return VllmScorer("big", endpoint, {i: i for i in range(64)}, client)


def test_a_server_answering_valid_log_probs_is_scored(server):
    scorer = scorer_of(server)
    scores = scorer.score(random_batch(seed=1), ScoringConfig())
    assert (scores.L_seq <= 0).all()
    scorer.close()


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("hang", r"ReadTimeout"),
        ("drip", r"answer not complete within vllm_timeout_seconds=1"),
        ("5xx", r"503: engine is restarting"),
        ("reset", r"(RemoteProtocolError|ReadError)"),
        ("html", r"200 that is not a JSON object: b'<html>"),
        ("huge", r"answer larger than max_answer_bytes=1048576 as sent"),
        ("gzip-bomb", r"answer larger than max_answer_bytes=1048576 once decompressed"),
    ],
)
def test_a_server_that_gives_no_usable_answer_is_retried_then_reported_within_the_deadline(server, mode, cause):
    server.mode = mode
    scorer = scorer_of(server)
    start = time.monotonic()
    with pytest.raises(
        ScorerUnavailable,
        match=rf"scorer 'big': the vLLM server at http://127.0.0.1:\d+ did not "
        rf"answer POST /v1/completions after 2 tries \({cause}",
    ):
        scorer.score(random_batch(seed=1), ScoringConfig())
    assert time.monotonic() - start < WITHIN_SECONDS
    assert server.tries >= 2  # retried: an outage, not the batch's fault
    scorer.close()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("positive", r"returned a log-probability of 3.0 nats; log-probs must be finite and <= 0"),
        (
            "malformed",
            r"answered POST /v1/completions without the prompt log-probs asked for \(.*prompt_logprobs|"
            r"returned 0 prompt log-probs",
        ),
    ],
)
def test_an_answer_without_valid_log_probs_fails_the_batch_naming_the_backend(server, mode, message):
    server.mode = mode
    scorer = scorer_of(server)
    with pytest.raises(MalformedAnswer, match=rf"scorer 'big'.*({message})"):
        scorer.score(random_batch(seed=1), ScoringConfig())
    assert server.tries == 1 or mode == "malformed"  # not retried: the same answer would come again
    scorer.close()
