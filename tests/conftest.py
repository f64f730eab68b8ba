"""Shared fixtures: tiny transformers built from configs in-process (no hub, no files)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring import Scorer, ScoringBatch

# The database fixtures (postgres_url, settings_for, ...) serve the e2e tests too.
pytest_plugins = ["tests.fixtures"]

VOCAB = 64
# The tiny Llama-family layout (llama and qwen2 share it): 2 layers, hidden 32, grouped-query attention.
LLAMA_LAYOUT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.3,
    "attn_implementation": "sdpa",
}


def tiny_scorer(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Scorer:
    """A 2-layer random transformer of the given family; vocab 64, hidden 32."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "gpt2":
            config = GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=256,
                bos_token_id=0,
                eos_token_id=0,
                attn_implementation="sdpa",
            )
            model = GPT2LMHeadModel(config)
        elif family == "qwen2":  # Llama's layout plus q/k/v biases, drawn non-zero here
            model = Qwen2ForCausalLM(Qwen2Config(**LLAMA_LAYOUT, use_sliding_window=False))
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.3)
        else:
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_LAYOUT))
    model.to(dtype).eval()
    return Scorer(name=f"tiny-{family}", model=model, tokenizer=None)


def random_batch(seed: int, n_groups: int = 5, per_group: int = 3, system_len: int = 10) -> ScoringBatch:
    """Prompts sharing a system prefix, varied suffixes, reasoning of 0..8 tokens (some empty)."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, VOCAB, system_len)]
    prompts = {g: system + [int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 8))] for g in range(n_groups)}
    rows = [
        (prompts[g], [int(t) for t in rng.integers(0, VOCAB, rng.integers(0, 9))], g)
        for g in range(n_groups)
        for _ in range(per_group)
    ]
    return ScoringBatch.from_rows([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def trajectory_batch(seed: int, trajectories: int = 3, turns: int = 3, draws: int = 7) -> ScoringBatch:
    """The trajectory sampler's shape: columns are turns; a trajectory's turns share its history."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, VOCAB, 8)]
    turn_rows = []
    for _ in range(trajectories):
        history = list(system)
        for _ in range(turns):
            history = history + [int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 6))]
            reasoning = [int(t) for t in rng.integers(0, VOCAB, rng.integers(0, 7))]
            turn_rows.append((list(history), reasoning))
            history = history + reasoning  # the next turn's prompt holds this turn's response
    chosen = [turn_rows[int(i)] for i in rng.integers(0, len(turn_rows), draws)]  # with replacement
    return ScoringBatch.from_rows([p for p, _ in chosen], [z for _, z in chosen], list(range(draws)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM tests run next to last and the Docker tests last: by then the builds scripts/test started beside
    the suite (``scripts/vllm-env``, ``tests.docker.prepare``) are done (minutes that would otherwise open the run)."""
    items.sort(
        key=lambda item: (item.get_closest_marker("docker") is not None, item.get_closest_marker("vllm") is not None)
    )


@pytest.fixture(scope="session")
def llama64() -> Scorer:
    return tiny_scorer("llama", torch.float64)


@pytest.fixture(scope="session")
def gpt2_64() -> Scorer:
    return tiny_scorer("gpt2", torch.float64)
