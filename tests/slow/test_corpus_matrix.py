"""The committed SmolLM2 corpus matrix agrees with a fresh scoring by the kernel (a sample of it)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from bench.corpus.simulate import load
from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR
from scoring.models import smollm2_gguf_path

pytestmark = pytest.mark.slow


def test_the_corpus_records_the_scorer_it_was_scored_with():
    scorer = load().raw["scorer"]
    assert scorer["model"] == "smollm2-135m"
    assert scorer["dtype"] == "float32"
    assert scorer["scoring_temperature"] == 1.0
    assert hashlib.sha256(smollm2_gguf_path().read_bytes()).hexdigest() == scorer["gguf_sha256"]


def test_a_sample_of_committed_entries_matches_a_fresh_scoring():
    corpus = load()
    raw = corpus.raw
    rng = np.random.default_rng(0)
    # Two healthy traces of two prompts (one per half) and one template trace of each style.
    picks = [int(rng.choice(corpus.healthy(p))) for p in (0, 1)]
    picks += [int(rng.choice(corpus.templates(s))) for s in range(corpus.n_styles)]
    scorer = load_scorer(ScoringConfig(model="smollm2-135m", device="cpu"), CACHE_DIR)
    columns = [scorer.encode(c["text"]) for c in raw["columns"]]
    for r in picks:
        trace = raw["traces"][r]
        scored = np.flatnonzero(~np.isnan(corpus.L_seq[r]))
        own = int(np.flatnonzero(scored == trace["column"])[0])
        rows = [own] + [j for j in range(len(scored)) if j != own]
        batch = ScoringBatch.from_rows(
            [columns[scored[j]] for j in rows],
            [tuple(trace["token_ids"])] + [tuple(trace["token_ids"][:1])] * (len(rows) - 1),
            rows,
        )
        fresh = score_batch(scorer, batch, ScoringConfig())
        assert np.allclose(fresh.L_seq[0], corpus.L_seq[r, scored], atol=2e-3), f"trace {r}"
        assert np.allclose(fresh.token_entropy[0], corpus.entropy[r], atol=2e-3), f"trace {r}"
        assert trace["token_ids"] == list(scorer.encode(trace["text"]))
