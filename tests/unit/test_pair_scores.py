"""Per-pair scoring (a vLLM server's log-probs): the same sums as the kernel, its cost model, its endpoint,
and how its client reports a server that refuses or does not answer. The real server: tests/vllm."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from scoring import ScoringBatch, ScoringConfig, score_batch
from scoring.budget import pair_cost
from scoring.cross_scores import ScoringError, pair_scores, scaled_log_softmax, scored_pairs
from service.jobs.interrupts import ScorerUnavailable
from service.jobs.vllm import VllmScorer
from service.settings import Settings, VllmClientSettings, VllmEndpoint
from tests.conftest import random_batch, trajectory_batch

SPEC = "vllm+http://10.0.0.5:8001/?model=qwen-72b&tokenizer=/models/qwen&dtype=bfloat16"


def pair_log_probs(scorer, batch: ScoringBatch) -> dict[tuple[int, int], np.ndarray]:
    """What a vLLM server returns, naively: one forward of [x_u ; z_r] per pair, its reasoning positions gathered."""
    prompts, pairs = scored_pairs(batch)
    out = {}
    with torch.inference_mode():
        for u, r in pairs:
            x, z = prompts[u], batch.reasonings[r]
            logits = scorer.model(input_ids=torch.tensor([x + z])).logits[0]  # [len(x) + len(z), V]
            logp = scaled_log_softmax(logits[len(x) - 1 : -1], 1.0)  # position t scores token t + 1
            out[(u, r)] = logp.gather(1, torch.tensor(z)[:, None])[:, 0].double().numpy()
    return out


@pytest.mark.parametrize("make", [random_batch, trajectory_batch], ids=["first-turn", "trajectory"])
def test_sums_of_per_pair_log_probs_equal_the_kernels_scores(llama64, make):
    batch = make(seed=2)
    config = ScoringConfig(head_tokens=(1, 3, 100))
    kernel = score_batch(llama64, batch, config)
    pairs = pair_scores(batch, pair_log_probs(llama64, batch), config.head_tokens, tokens_processed=0)
    np.testing.assert_allclose(pairs.L_seq, kernel.L_seq, atol=1e-9)
    for k in config.head_tokens:
        np.testing.assert_allclose(pairs.L_head[k], kernel.L_head[k], atol=1e-9)
    np.testing.assert_allclose(pairs.L_tok, kernel.L_tok, atol=1e-9)
    assert [len(e) for e in pairs.token_entropy] == [0] * batch.n_rows  # no distribution: no entropy
    for a, b in zip(pairs.matched_logprobs, kernel.matched_logprobs, strict=True):  # the trainer gap's input
        np.testing.assert_allclose(a, b, atol=1e-9)


def test_log_probs_of_the_wrong_length_are_refused_naming_the_row(llama64):
    batch = random_batch(seed=2)
    logprobs = pair_log_probs(llama64, batch)
    (u, r), values = next(iter(logprobs.items()))
    logprobs[(u, r)] = values[:-1]
    with pytest.raises(ScoringError, match=rf"row {r}: {len(values) - 1} log-probs for {len(values)} reasoning tokens"):
        pair_scores(batch, logprobs, (), 0)


def test_the_pair_cost_counts_every_pair_whole_once_per_distinct_prompt_and_reasoning():
    # Two distinct prompts (columns 0 and 2 share one), reasonings of 3, 0 and 2 tokens, the first repeated.
    batch = ScoringBatch.from_rows(
        [[1, 2], [3, 4, 5], [1, 2], [3, 4, 5]], [[6, 7, 8], [], [9, 9], [6, 7, 8]], [0, 1, 2, 3]
    )
    cost = pair_cost(batch)
    lengths = [2 + 3, 2 + 2, 3 + 3, 3 + 2]  # (prompt, reasoning) pairs with a reasoning
    assert cost.tokens == sum(lengths)
    assert cost.length == pytest.approx(sum(n * n for n in lengths) / sum(lengths))


def test_a_vllm_scorer_is_named_by_its_url_served_model_tokenizer_and_dtype():
    assert VllmEndpoint.parse(SPEC) == VllmEndpoint(
        url="http://10.0.0.5:8001", model="qwen-72b", tokenizer="/models/qwen", dtype="bfloat16"
    )
    assert VllmEndpoint.parse("smollm2-135m") is None  # a model for our kernel
    assert VllmEndpoint.parse("/models/qwen") is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("vllm+http://h:1?tokenizer=t", r"missing: model"),
        ("vllm+http://h:1?model=m", r"missing: tokenizer"),
        ("vllm+http://?model=m&tokenizer=t", r"missing: host"),
        ("vllm+http://h:1?model=m&tokenizer=t&tp=8", r"takes model, tokenizer and dtype, got tp"),
    ],
)
def test_a_malformed_vllm_scorer_fails_at_startup_naming_the_setting(spec, message):
    with pytest.raises(ValidationError, match=message) as raised:
        Settings(_env_file=None, scorers={"big": spec}, default_scorer="big")
    assert raised.value.errors()[0]["loc"] == ("scorers",)


def scorer_answering(handler, retries: int = 1) -> VllmScorer:
    endpoint = VllmEndpoint.parse(SPEC)
    assert endpoint is not None
    client = VllmClientSettings(timeout_seconds=5, concurrency=2, retries=retries, request_tokens=64)
    tokenizer = {i: i for i in range(64)}  # only its length (the vocabulary) is read here
    return VllmScorer("big", endpoint, tokenizer, client, transport=httpx.MockTransport(handler))


def test_a_server_that_does_not_answer_puts_the_batch_back_after_the_retries():
    tries = []

    def unavailable(request: httpx.Request) -> httpx.Response:
        tries.append(request.url.path)
        return httpx.Response(503, json={"error": {"message": "engine is restarting"}})

    scorer = scorer_answering(unavailable, retries=1)
    with pytest.raises(ScorerUnavailable, match=r"did not answer POST /v1/completions after 2 tries \(503: engine"):
        scorer.score(random_batch(seed=1), ScoringConfig())
    assert set(tries) == {"/v1/completions"}
    scorer.close()


def test_a_request_the_server_refuses_fails_the_batch_with_its_message():
    def refused(_: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 2048 tokens"}})

    scorer = scorer_answering(refused)
    with pytest.raises(ScoringError, match=r"refused POST /v1/completions with 400: This model's maximum context"):
        scorer.score(random_batch(seed=1), ScoringConfig())
    with pytest.raises(ScoringError, match=r"scores at temperature 1 only, got 0.7"):
        scorer.score(random_batch(seed=1), ScoringConfig(temperature=0.7))
    scorer.close()
