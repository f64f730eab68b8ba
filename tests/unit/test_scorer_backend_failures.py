"""A vLLM scorer whose server misbehaves, against a real HTTP server on loopback: every try ends within its
deadline, answers are read within a size cap (as sent and decompressed), an outage (hang, 5xx, reset, drip,
a proxy's HTML page) is retried and then reported as the server not answering, and an answer without valid
log-probs fails with a named error; the circuit breaker's probe says whether the server answers. The real vLLM
server: tests/vllm."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from scoring import ScoringConfig
from service.jobs.interrupts import ScorerUnavailable
from service.jobs.vllm import MalformedAnswer, VllmScorer, probe
from service.settings import VllmClientSettings, VllmEndpoint
from tests.conftest import random_batch
from tests.misbehaving_vllm import MisbehavingServer, misbehaving_server

DEADLINE_SECONDS = 5.0  # a try of a well-behaved answer must fit it on a busy machine (else it is retried)
CAP_BYTES = 2**20
# Generous: two tries of one deadline, the backoff between them, and a busy machine.
WITHIN_SECONDS = 20.0


@pytest.fixture
def server() -> Iterator[MisbehavingServer]:
    with misbehaving_server() as httpd:
        yield httpd


def endpoint_of(server: MisbehavingServer) -> VllmEndpoint:
    endpoint = VllmEndpoint.parse(f"vllm+http://127.0.0.1:{server.server_address[1]}?model=m&tokenizer=t")
    assert endpoint is not None
    return endpoint


@contextmanager
def scorer_of(server: MisbehavingServer, concurrency: int = 2) -> Iterator[VllmScorer]:
    """Closed however the test ends, so no connection of it is left for a later test's garbage collection."""
    client = VllmClientSettings(
        timeout_seconds=DEADLINE_SECONDS,
        concurrency=concurrency,
        retries=1,
        request_tokens=64,
        max_answer_bytes=CAP_BYTES,
    )
    scorer = VllmScorer("big", endpoint_of(server), {i: i for i in range(64)}, client)
    try:
        yield scorer
    finally:
        scorer.close()


def test_a_server_answering_valid_log_probs_is_scored(server):
    with scorer_of(server) as scorer:
        scores = scorer.score(random_batch(seed=1), ScoringConfig())
    assert (scores.L_seq <= 0).all()


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("hang", r"ReadTimeout"),
        ("drip", r"answer not complete within vllm_timeout_seconds=5"),
        ("5xx", r"503: engine is restarting"),
        ("reset", r"(RemoteProtocolError|ReadError)"),
        ("html", r"200 that is not a JSON object: b'<html>"),
        ("huge", r"answer larger than max_answer_bytes=1048576 as sent"),
        ("gzip-bomb", r"answer larger than max_answer_bytes=1048576 once decompressed"),
    ],
)
def test_a_server_that_gives_no_usable_answer_is_retried_then_reported_within_the_deadline(server, mode, cause):
    server.mode = mode
    start = time.monotonic()
    with (
        scorer_of(server) as scorer,
        pytest.raises(
            ScorerUnavailable,
            match=rf"scorer 'big': the vLLM server at http://127.0.0.1:\d+ did not "
            rf"answer POST /v1/completions after 2 tries \({cause}",
        ),
    ):
        scorer.score(random_batch(seed=1), ScoringConfig())
    assert time.monotonic() - start < WITHIN_SECONDS
    assert server.tries >= 2  # retried: an outage, not the batch's fault


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
    # One request at a time: with two in flight, the second is sent before the first's answer fails the batch.
    with (
        scorer_of(server, concurrency=1) as scorer,
        pytest.raises(MalformedAnswer, match=rf"scorer 'big'.*({message})"),
    ):
        scorer.score(random_batch(seed=1), ScoringConfig())
    assert server.tries == 1 or mode == "malformed"  # not retried: the same answer would come again


def test_the_breakers_probe_finds_a_live_server_answering(server):
    assert probe(endpoint_of(server), DEADLINE_SECONDS) is None


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("hang", r"ReadTimeout"),
        ("5xx", r"503: engine is restarting"),
        ("html", r"200 that is not a JSON object: b'<html>"),
    ],
)
def test_the_breakers_probe_says_why_a_server_does_not_answer_within_its_deadline(server, mode, reason):
    server.mode = mode
    start = time.monotonic()
    assert re.match(reason, probe(endpoint_of(server), 1.0) or "")
    assert time.monotonic() - start < WITHIN_SECONDS
    assert server.tries == 1  # one try: the worker's back-off spaces the probes


def test_the_breakers_probe_of_a_closed_port_says_it_was_refused():
    with socket.socket() as s:  # bound, then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = VllmEndpoint.parse(f"vllm+http://127.0.0.1:{port}?model=m&tokenizer=t")
    assert endpoint is not None
    assert (probe(endpoint, 1.0) or "").startswith("ConnectError")
