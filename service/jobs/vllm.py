"""A scorer served by vLLM: per-token log-probs of every (prompt, reasoning) pair over its OpenAI-compatible API.

A named scorer whose model is ``vllm+http://host:port?model=<served name>&tokenizer=<model>&dtype=<dtype>``
(``VllmEndpoint``) is scored by a vLLM server instead of our kernel: each pair ``[x_u ; z_r]`` is sent
as token ids to ``POST /v1/completions`` with ``max_tokens: 1, prompt_logprobs: 0``, whose answer
holds log p(token | earlier tokens) at every prompt position; the reasoning's positions give the
row's log-probs, summed exactly as the kernel sums its own (``scoring.cross_scores.pair_scores``).

What it cannot give: the full next-token distribution, so no ``token_entropy_*`` figures (MI,
retrieval, H(Z|X) and the head signals need only the log-probs of the sent tokens, which are exact).
It scores at temperature 1 only (vLLM's prompt log-probs are of the raw logits), and its cost is
every pair's whole length (``scoring.budget.pair_cost``): vLLM computes prompt log-probs without its
prefix cache, so each pair re-prefills its prompt.

Failures: a server that does not answer (connection refused, a timeout, a 5xx) after ``retries``
tries raises ``ScorerUnavailable``: the worker puts the batch back in the queue, uncounted, opens
the scorer's circuit breaker and ``probe``s the server until it answers, then scores the batch whole
(nothing of a half-scored batch is written). A 4xx (too long for the
server's context, a model it does not serve) fails the batch with the server's message. Must not
import fastapi.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from scoring.batch import ScoringBatch, Tokens
from scoring.budget import CostModel, batch_cost, pair_cost
from scoring.config import ScoringConfig
from scoring.cross_scores import CrossScores, ScoringError, pair_scores, score_batch, scored_pairs
from scoring.scorer import ModelLoadError, Scorer
from service.jobs.interrupts import ScorerUnavailable
from service.loops import Backoff
from service.schemas.inputs import MAX_ABS_LOGPROB
from service.schemas.results import ScoredBy
from service.settings import VllmClientSettings, VllmEndpoint

log = logging.getLogger("collapse_monitor.worker")

# Tokenized here and by the server at load: text, digits, whitespace runs, punctuation and chat markup.
TOKENIZER_PROBE = (
    "<|im_start|>user\nWhat is 17 times 3? Think step by step.<|im_end|>\n<|im_start|>assistant\n"
    "<think>17 x 3 = 51, since 10 x 3 = 30 and 7 x 3 = 21.</think>\n\n  <answer>51</answer> ünïcödé ✓"
)
# Between tries of one request: 0.5 s, 1 s, 2 s, ... up to 8 s, so a restart of a few seconds is ridden out.
REQUEST_BACKOFF = Backoff(first_seconds=0.5, max_seconds=8.0, jitter=0.25)
# The deadline of the cheap questions (GET /v1/models, at a load and as the breaker's probe; POST /tokenize of
# TOKENIZER_PROBE): a live server answers them in milliseconds, in a few KB.
PROBE_SECONDS = 5.0
PROBE_ANSWER_BYTES = 2**20


class VllmScorer:
    """A scorer served by vLLM; the same surface as ``scoring.Scorer`` where the worker reads it."""

    def __init__(
        self,
        name: str,
        endpoint: VllmEndpoint,
        tokenizer: Any,
        client: VllmClientSettings,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.settings = client
        self.http = httpx.Client(
            base_url=endpoint.url, timeout=client.timeout_seconds, transport=transport, trust_env=False
        )
        self.max_positions: int | None = None

    def encode(self, text: str) -> Tokens:
        """Token ids of ``text`` without special tokens (``scoring.Scorer.encode``)."""
        return tuple(int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def connect(self) -> None:
        """Checks that the server serves ``endpoint.model`` and tokenizes as our tokenizer does.

        Both questions are cheap, so they are asked once each with the probe's deadline (``PROBE_SECONDS``,
        at most ``timeout_seconds``): a server that does not answer holds the worker seconds, not
        ``1 + retries`` whole deadlines, and the worker's circuit breaker probes it from then on.

        Raises:
            ScorerUnavailable: the server did not answer.
            ModelLoadError: it serves another model, or its token ids differ from ours.
        """
        quick = min(PROBE_SECONDS, self.settings.timeout_seconds)
        models = self._request("GET", "/v1/models", timeout_seconds=quick, retries=0).get("data", [])
        served = {m.get("id"): m for m in models}
        if self.endpoint.model not in served:
            raise ModelLoadError(
                f"scorer {self.name!r}: the vLLM server at {self.endpoint.url} must serve model "
                f"{self.endpoint.model!r}, it serves {', '.join(map(str, served)) or 'none'}"
            )
        length = served[self.endpoint.model].get("max_model_len")
        self.max_positions = int(length) if isinstance(length, int) else None
        theirs = self._request(
            "POST",
            "/tokenize",
            {"model": self.endpoint.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False},
            timeout_seconds=quick,
            retries=0,
        ).get("tokens")
        ours = list(self.encode(TOKENIZER_PROBE))
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs or [], strict=False)) if a != b), None)
            where = f"from token {at}" if at is not None else f"in length ({len(ours)} here, {len(theirs or [])})"
            raise ModelLoadError(
                f"scorer {self.name!r}: the vLLM server's tokenizer differs from {self.endpoint.tokenizer!r}'s "
                f"{where}; point tokenizer= at the model the server serves"
            )

    def score(self, batch: ScoringBatch, config: ScoringConfig, check: Callable[[], None] | None = None) -> CrossScores:
        """``scoring.cross_scores.score_batch``'s result, from the server: L_seq, L_head; no entropy.

        Pairs go in requests of at most ``request_tokens`` prompt tokens, ``concurrency`` at a time;
        ``check`` is called while waiting, and an exception it raises abandons the requests not yet sent.
        """
        if config.temperature != 1.0:
            raise ScoringError(
                f"scorer {self.name!r} (vLLM) scores at temperature 1 only, got {config.temperature:g}: vLLM's prompt "
                "log-probs are of the raw logits"
            )
        prompts, pairs = scored_pairs(batch)
        requests = _requests(pairs, prompts, batch.reasonings, self.settings.request_tokens)
        logprobs: dict[tuple[int, int], np.ndarray] = {}
        pool = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="vllm")
        try:
            pending: set[Future[list[np.ndarray]]] = set()
            owner: dict[Future[list[np.ndarray]], list[tuple[int, int]]] = {}
            for chunk in requests:
                sequences = [prompts[u] + batch.reasonings[r] for u, r in chunk]
                starts = [len(prompts[u]) for u, _ in chunk]
                future = pool.submit(self._score_sequences, sequences, starts)
                owner[future] = chunk
                pending.add(future)
            while pending:
                if check is not None:
                    check()
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    for pair, values in zip(owner[future], future.result(), strict=True):
                        logprobs[pair] = values
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        tokens = sum(len(prompts[u]) + len(batch.reasonings[r]) for u, r in pairs)
        return pair_scores(batch, logprobs, config.head_tokens, tokens)

    def _score_sequences(self, sequences: Sequence[Tokens], starts: Sequence[int]) -> list[np.ndarray]:
        """[len(seq) - start] log-probs of each sequence's tokens from ``start`` on, in nats."""
        body = {
            "model": self.endpoint.model,
            "prompt": [list(s) for s in sequences],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0.0,
        }
        answer = self._request("POST", "/v1/completions", body)
        try:
            choices = {int(c["index"]): c for c in answer["choices"]}
            out = []
            for i, (sequence, start) in enumerate(zip(sequences, starts, strict=True)):
                positions = choices[i].get("prompt_logprobs") or []
                if len(positions) != len(sequence):
                    raise MalformedAnswer(
                        f"scorer {self.name!r}: the vLLM server returned {len(positions)} prompt log-probs for a "
                        f"sequence of {len(sequence)} tokens"
                    )
                # Position t holds the log-probs of the sequence's token t given the tokens before it, keyed by id.
                values = [float(positions[t][str(sequence[t])]["logprob"]) for t in range(start, len(sequence))]
                out.append(np.array(values, dtype=np.float64))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, MalformedAnswer):
                raise
            raise MalformedAnswer(
                f"scorer {self.name!r}: the vLLM server at {self.endpoint.url} answered POST /v1/completions without "
                f"the prompt log-probs asked for ({type(e).__name__}: {e})"
            ) from e
        for logprobs in out:
            # The checks a trainer's log-probs pass (schemas.inputs.TurnWithEntropy): a log-probability is finite
            # and <= 0 nats; +3.0 from a broken server would otherwise be scored as total collapse.
            bad = next((v for v in logprobs if not (math.isfinite(v) and -MAX_ABS_LOGPROB <= v <= 0)), None)
            if bad is not None:
                raise MalformedAnswer(
                    f"scorer {self.name!r}: the vLLM server at {self.endpoint.url} returned a log-probability of "
                    f"{bad} nats; log-probs must be finite and <= 0"
                )
        return out

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout_seconds: float | None = None,
        retries: int | None = None,
    ) -> dict[str, Any]:
        """One API call, tried ``1 + retries`` times while the server does not answer (or answers a proxy's page);
        each try within ``timeout_seconds`` (by default the settings' both)."""
        timeout_seconds = self.settings.timeout_seconds if timeout_seconds is None else timeout_seconds
        retries = self.settings.retries if retries is None else retries
        failures = 0
        while True:
            try:
                status, answer = self._exchange(method, path, body, timeout_seconds)
            except _NoAnswer as e:  # past the deadline, too large
                reason = str(e)
            except httpx.TransportError as e:  # refused, reset, no byte within the deadline
                reason = f"{type(e).__name__}: {e}"
            else:
                if 400 <= status < 500:
                    raise ScoringError(
                        f"scorer {self.name!r}: the vLLM server at {self.endpoint.url} refused {method} {path} with "
                        f"{status}: {_message(answer)}"
                    )
                if status < 400:
                    try:
                        data = json.loads(answer)
                    except ValueError:
                        data = None
                    if isinstance(data, dict):
                        return data
                    # A 200 that is not a JSON object is a proxy's or load balancer's page, not vLLM's: an outage.
                    reason = f"{status} that is not a JSON object: {answer[:120]!r}"
                else:
                    reason = f"{status}: {_message(answer)}"
            failures += 1
            if failures > retries:
                raise ScorerUnavailable(
                    f"scorer {self.name!r}: the vLLM server at {self.endpoint.url} did not answer {method} {path} "
                    f"after {failures} tries ({reason})"
                )
            log.warning("scorer %s: %s %s failed (try %d): %s", self.name, method, path, failures, reason)
            time.sleep(REQUEST_BACKOFF.delay(failures))

    def _exchange(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_seconds: float
    ) -> tuple[int, bytes]:
        """One try: the status and the (decompressed) answer, within ``timeout_seconds`` in all and
        ``max_answer_bytes`` as sent and as decompressed.

        httpx's timeouts are per read, so the deadline is checked between the chunks read: a server
        that sends nothing fails at the read timeout (the whole deadline), one that drips bytes at the
        first chunk past it, so a try ends within twice the deadline at worst. The answer is
        decompressed here, bounded chunk by chunk, not by httpx, which expands a chunk whole (a gzip
        bomb's 64 KB read would be 64 MB).
        """
        limit = self.settings.max_answer_bytes
        deadline = time.monotonic() + timeout_seconds
        limit_name = "vllm_timeout_seconds" if timeout_seconds == self.settings.timeout_seconds else "PROBE_SECONDS"
        headers = {"Accept-Encoding": "gzip, deflate"}
        with self.http.stream(method, path, json=body, headers=headers, timeout=timeout_seconds) as response:
            if response.is_stream_consumed:  # read whole by its transport (httpx.MockTransport): nothing left to bound
                if len(response.content) > limit:
                    raise _NoAnswer(f"answer larger than max_answer_bytes={limit}")
                return response.status_code, response.content
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", "gzip", "deflate"):
                raise _NoAnswer(f"answered in a {encoding!r} encoding, not gzip, deflate or none")
            # wbits 47: zlib or gzip headers, detected (deflate in the wild is either)
            inflate = zlib.decompressobj(wbits=47) if encoding != "identity" else None
            sent = 0
            answer = bytearray()
            for chunk in response.iter_raw():
                sent += len(chunk)
                if sent > limit:
                    raise _NoAnswer(f"answer larger than max_answer_bytes={limit} as sent")
                if inflate is None:
                    answer += chunk
                else:
                    pending = chunk
                    while pending:
                        answer += inflate.decompress(pending, limit + 1 - len(answer))
                        pending = inflate.unconsumed_tail
                        if len(answer) > limit:
                            break
                if len(answer) > limit:
                    raise _NoAnswer(f"answer larger than max_answer_bytes={limit} once decompressed")
                if time.monotonic() > deadline:
                    raise _NoAnswer(f"answer not complete within {limit_name}={timeout_seconds:g} ({sent} bytes read)")
            return response.status_code, bytes(answer)

    def close(self) -> None:
        self.http.close()


def load_vllm_scorer(
    name: str,
    endpoint: VllmEndpoint,
    cache_dir: Path,
    client: VllmClientSettings,
    transport: httpx.BaseTransport | None = None,
) -> VllmScorer:
    """Loads ``endpoint.tokenizer``'s tokenizer and checks it and the model against the server (``connect``)."""
    from scoring.models import load_tokenizer

    scorer = VllmScorer(name, endpoint, load_tokenizer(endpoint.tokenizer, cache_dir), client, transport)
    try:
        scorer.connect()
    except BaseException:
        scorer.close()
        raise
    return scorer


def probe(endpoint: VllmEndpoint, timeout_seconds: float) -> str | None:
    """None when the server at ``endpoint`` answers ``GET /v1/models`` with a JSON object within
    ``timeout_seconds`` in all; otherwise why not (the worker's circuit breaker asks this while a scorer
    is down, in a thread of its own, holding no batch)."""
    deadline = time.monotonic() + timeout_seconds
    answer = bytearray()
    try:
        with (
            httpx.Client(base_url=endpoint.url, timeout=timeout_seconds, trust_env=False) as http,
            http.stream("GET", "/v1/models", headers={"Accept-Encoding": "identity"}) as response,
        ):
            for chunk in response.iter_raw():
                answer += chunk
                if len(answer) > PROBE_ANSWER_BYTES:
                    return f"answer larger than {PROBE_ANSWER_BYTES} bytes"
                if time.monotonic() > deadline:
                    return f"answer not complete within {timeout_seconds:g} s"
            status = response.status_code
    except httpx.HTTPError as e:  # refused, reset, no byte within the deadline
        return f"{type(e).__name__}: {e}"
    if status != 200:
        return f"{status}: {_message(bytes(answer))}"
    try:
        data = json.loads(answer)
    except ValueError:
        data = None
    return None if isinstance(data, dict) else f"{status} that is not a JSON object: {bytes(answer[:120])!r}"


def _requests(
    pairs: Sequence[tuple[int, int]], prompts: Sequence[Tokens], reasonings: Sequence[Tokens], budget: int
) -> list[list[tuple[int, int]]]:
    """Consecutive pairs grouped into requests of at most ``budget`` prompt tokens (one pair at least)."""
    requests: list[list[tuple[int, int]]] = []
    tokens = 0
    for u, r in pairs:
        length = len(prompts[u]) + len(reasonings[r])
        if not requests or tokens + length > budget:
            requests.append([])
            tokens = 0
        requests[-1].append((u, r))
        tokens += length
    return requests


class _NoAnswer(Exception):
    """A try that got no usable answer in time or in size: retried as the server not answering."""


class MalformedAnswer(ScoringError):
    """A vLLM answer without the log-probs asked for, or with ones no model gives (not finite, above 0 nats)."""


def _message(answer: bytes) -> str:
    """The server's error message, short."""
    try:
        data = json.loads(answer)
    except ValueError:
        return answer[:300].decode("utf-8", "replace")
    if isinstance(data, dict):
        error = data.get("error", data.get("message", data))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(data)[:300]


AnyScorer = Scorer | VllmScorer


def score_with(
    scorer: AnyScorer, batch: ScoringBatch, config: ScoringConfig, check: Callable[[], None] | None = None
) -> CrossScores:
    """The cross-scores of ``batch``: by our kernel for a loaded model, by its server for a vLLM scorer."""
    if isinstance(scorer, VllmScorer):
        return scorer.score(batch, config, check)
    return score_batch(scorer, batch, config, check)


def cost_model(scorer: AnyScorer) -> CostModel:
    """What a batch costs ``scorer``: the kernel's shared prefixes (``batch_cost``), or every pair whole (vLLM)."""
    return pair_cost if isinstance(scorer, VllmScorer) else batch_cost


def scored_by(scorer: AnyScorer) -> ScoredBy:
    """The provenance a scored batch records: engine, model, precision (and the server of a vLLM scorer)."""
    if isinstance(scorer, VllmScorer):
        return ScoredBy(
            engine="vllm", model=scorer.endpoint.model, dtype=scorer.endpoint.dtype, server=scorer.endpoint.url
        )
    return ScoredBy(engine="kernel", model=scorer.name, dtype=str(scorer.dtype).removeprefix("torch."))
