"""The vLLM scorer against a real vLLM server: its L equals our kernel's, a run is scored end to end
through it, and a server killed mid-batch loses nothing and scores nothing twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from sqlalchemy import func, select

from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.budget import pair_cost
from scoring.config import CACHE_DIR
from scoring.scorer import ModelLoadError
from service.jobs.scorers import ScorerPool
from service.jobs.vllm import VllmScorer, load_vllm_scorer
from service.jobs.worker import Worker
from service.settings import VllmClientSettings, VllmEndpoint
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Batch, MetricPoint
from tests.fixtures import points_of, wait_for

pytestmark = pytest.mark.vllm

# Float32 on both sides, the same weights: vLLM's CPU kernels sum in another order than ours. Measured here:
# at most 3e-5 nats per token and 2e-4 nats per pair sum (docs/benchmarks.md, vLLM against the kernel).
TOLERANCE_NATS_PER_TOKEN = 2e-4
TOLERANCE_NATS_PER_PAIR = 5e-3
CLIENT = VllmClientSettings(timeout_seconds=120, concurrency=2, retries=2, request_tokens=2048)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    ("You are in a grid world. The goal is directly above you.", "The goal is above me, so I should move up."),
    ("What is 17 times 3?", "17 times 3 is 51 because 17 times 3 equals 51."),
    ("Name the capital of France.", "The capital of France is Paris."),
    ("Sort the numbers 9, 2 and 5.", "Sorted in increasing order the numbers are 2, 5 and 9."),
]


@pytest.fixture(scope="module")
def kernel():
    return load_scorer(ScoringConfig(model="smollm2-135m", device="cpu"), CACHE_DIR)


@pytest.fixture(scope="module")
def remote(vllm_server) -> Iterator[VllmScorer]:
    endpoint = VllmEndpoint.parse(vllm_server.spec)
    assert endpoint is not None
    scorer = load_vllm_scorer(vllm_server.spec, endpoint, CACHE_DIR, CLIENT)
    yield scorer
    scorer.close()


def first_turn_batch(encode) -> ScoringBatch:
    """Four chat prompts, two reasonings each (one empty): every reasoning under every prompt."""
    prompts, reasonings, groups = [], [], []
    for g, (question, thought) in enumerate(QUESTIONS):
        for reasoning in (f"<think>{thought}</think>", "" if g == 3 else f"<think>Let me see. {thought}</think>"):
            prompts.append(encode(CHAT.format(question)))
            reasonings.append(encode(reasoning))
            groups.append(g)
    return ScoringBatch.from_rows(prompts, reasonings, groups)


def multi_turn_batch(encode) -> ScoringBatch:
    """Two three-turn trajectories: each turn's prompt holds the history before it, so prompts nest."""
    prompts, reasonings, groups = [], [], []
    for t, goal in enumerate(("up", "left")):
        history = CHAT.format(f"You are in a grid world; the goal is {goal}. Observation: start.")
        for k in range(3):
            thought = f"<think>Turn {k}: the goal is {goal}, so I move {goal}.</think>"
            prompts.append(encode(history))
            reasonings.append(encode(thought))
            groups.append(3 * t + k)
            history += f"{thought}<answer>{goal}</answer><|im_end|>\n" + CHAT.format(f"Observation {k + 1}: moved.")
    return ScoringBatch.from_rows(prompts, reasonings, groups)


@pytest.mark.parametrize("shape", [first_turn_batch, multi_turn_batch], ids=["first-turn", "multi-turn"])
def test_log_probs_from_vllm_equal_the_kernels_in_float32(kernel, remote, shape):
    batch = shape(kernel.encode)
    config = ScoringConfig(head_tokens=(4, 16))
    ours = score_batch(kernel, batch, config)
    theirs = remote.score(batch, config)
    has_reasoning = batch.reasoning_lengths > 0
    assert np.abs(theirs.L_tok - ours.L_tok)[has_reasoning].max() <= TOLERANCE_NATS_PER_TOKEN
    assert np.abs(theirs.L_seq - ours.L_seq).max() <= TOLERANCE_NATS_PER_PAIR
    for k in config.head_tokens:
        assert np.abs(theirs.L_head[k] - ours.L_head[k]).max() <= TOLERANCE_NATS_PER_PAIR
    assert (theirs.L_seq[~has_reasoning] == 0).all()
    # Every pair re-prefills its prompt: the cost model counts exactly the tokens sent.
    assert theirs.tokens_processed == pair_cost(batch).tokens > ours.tokens_processed
    assert all(len(e) == 0 for e in theirs.token_entropy)  # no full distribution: no entropy


def test_a_server_serving_another_tokenizer_is_refused_at_load(vllm_server):
    spec = vllm_server.spec.replace("tokenizer=smollm2-135m", "tokenizer=tiny-random")
    endpoint = VllmEndpoint.parse(spec)
    assert endpoint is not None
    with pytest.raises(ModelLoadError, match=r"the vLLM server's tokenizer differs from 'tiny-random''s from token 0"):
        load_vllm_scorer("wrong", endpoint, CACHE_DIR, CLIENT)
    wrong_model = VllmEndpoint.parse(spec.replace("model=smollm2", "model=qwen"))
    assert wrong_model is not None
    with pytest.raises(ModelLoadError, match=r"must serve model 'qwen', it serves smollm2"):
        load_vllm_scorer("wrong", wrong_model, CACHE_DIR, CLIENT)


def rollouts(n_groups: int, per_group: int) -> list[dict]:
    """Text trajectories: group g asks ``QUESTIONS[g % 4]`` (a room number apart past 4) and reasons about it."""
    return [
        {
            "group_id": g,
            "reward": float(k % 2),
            "turns": [
                {
                    "prompt": CHAT.format(f"Room {g}. {QUESTIONS[g % 4][0]}"),
                    "response": f"<think>{'Well. ' * k}{QUESTIONS[g % 4][1]}</think><answer>ok</answer>",
                }
            ],
        }
        for g in range(n_groups)
        for k in range(per_group)
    ]


def vllm_settings(vllm_server) -> dict:
    return {"scorers": {"smollm2-vllm": vllm_server.spec}, "default_scorer": "smollm2-vllm"}


def test_the_service_scores_a_run_end_to_end_through_vllm(postgres_url, client_for, vllm_server):
    client = client_for(postgres_url, **vllm_settings(vllm_server))
    run = {"name": "r", "sampler": {"num_samples": 8, "samplers": ["first_turn"]}}
    assert client.post("/v1/runs", json=run).status_code == 201
    response = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": rollouts(4, 2)})
    assert response.status_code == 202, response.json()
    status = wait_for(client, response.json()["batch_id"], timeout=300)
    assert status["status"] == "done", status
    assert status["scorer"] == "smollm2-vllm"
    assert status["results"]["scored_by"] == {
        "engine": "vllm",
        "model": "smollm2",
        "dtype": "float32",
        "server": vllm_server.url,
    }
    metrics = status["results"]["samplers"]["first_turn"]["metrics"]
    assert metrics["retrieval_accuracy"] == 1.0  # each reasoning answers its own question
    assert "mi_estimate" in metrics
    assert "mi_head_estimate" in metrics
    assert "token_entropy_mean" not in metrics  # vLLM gives no full distribution
    # The run page's step view shows what scored it.
    assert client.get("/v1/runs/r/matrix").json()["scored_by"] == status["results"]["scored_by"]


def test_a_server_killed_mid_batch_leaves_the_batch_to_be_retried_and_scored_once(
    postgres_url, client_for, settings_for, vllm_server
):
    # One small request at a time, so the batch spans many requests and the kill lands inside it.
    overrides = vllm_settings(vllm_server) | {"vllm_concurrency": 1, "vllm_retries": 1, "max_batch_tokens": 256}
    client = client_for(postgres_url, embedded_worker=False, **overrides)
    client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 12, "samplers": ["first_turn"]}})
    response = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": rollouts(6, 2)})
    batch_id = response.json()["batch_id"]
    settings = settings_for(postgres_url, **overrides)
    engine = make_engine(postgres_url)
    sessions = make_sessions(engine)
    worker = Worker(sessions, settings, ScorerPool(settings))
    try:
        served = vllm_server.completions_served()
        first = threading.Thread(target=worker.run_once)
        first.start()
        deadline = time.monotonic() + 120
        while vllm_server.completions_served() == served and time.monotonic() < deadline:
            time.sleep(0.05)
        assert vllm_server.completions_served() > served, "the worker never reached the server"
        vllm_server.kill()
        first.join(timeout=120)
        assert not first.is_alive()
        with sessions() as session:
            batch = session.get_one(Batch, batch_id)
            # Back in the queue with the scorer's error, the try not counted (an outage is bounded in time, by
            # scorer_outage_seconds, not by max_attempts); nothing of it written.
            assert (batch.status, batch.attempts, batch.result) == ("queued", 0, None)
            assert "did not answer POST /v1/completions" in (batch.error or "")
            assert not session.scalar(select(func.count()).where(MetricPoint.batch_id == batch_id))

        vllm_server.start()
        # The worker's breaker claims none of the scorer's batches until its probe (GET /v1/models, in a thread
        # run_once starts) finds the server answering; the next run_once then claims and scores the batch.
        deadline = time.monotonic() + 120
        while not worker.run_once() and time.monotonic() < deadline:
            time.sleep(0.5)
        with sessions() as session:
            batch = session.get_one(Batch, batch_id)
            assert (batch.status, batch.attempts) == ("done", 1), batch.error
            assert batch.result is not None
            assert batch.result["scored_by"]["engine"] == "vllm"
            points, distinct = points_of(session, batch_id)
            assert points == distinct
            assert points
    finally:
        worker.close()
        engine.dispose()
