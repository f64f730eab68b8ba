"""Scorer loading: built-ins, local folders, refusals with the fix in the message."""

from __future__ import annotations

import pytest
import torch

from scoring import ModelLoadError, Scorer, ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.models import build_tiny_random
from scoring.verification import verify_scorer
from tests.conftest import LLAMA_LAYOUT


def test_tiny_random_is_deterministic_and_tokenizes_text(tmp_path):
    a = load_scorer(ScoringConfig(model="tiny-random", device="cpu"), tmp_path)
    b = load_scorer(ScoringConfig(model="tiny-random", device="cpu"), tmp_path)
    text = "<think> move up </think>"
    assert a.encode(text) == b.encode(text)
    assert len(a.encode(text)) > 0
    batch = ScoringBatch.from_rows([a.encode("State: goal up.")] * 2, [a.encode("I go up"), a.encode("go")], [0, 1])
    assert (score_batch(a, batch, ScoringConfig()).L_seq == score_batch(b, batch, ScoringConfig()).L_seq).all()


def test_building_tiny_random_leaves_the_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_tiny_random()
    assert torch.equal(torch.rand(3), expected)


def test_a_saved_model_folder_loads_in_the_requested_dtype(tmp_path):
    model, tokenizer = build_tiny_random()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    scorer = load_scorer(ScoringConfig(model=str(tmp_path / "m"), device="cpu", dtype="bfloat16"), tmp_path)
    assert scorer.dtype == torch.bfloat16
    assert scorer.max_positions == 4096


def test_unknown_model_names_are_refused_with_the_choices(tmp_path):
    with pytest.raises(ModelLoadError, match="model must be one of tiny-random, smollm2-135m, a local model folder"):
        load_scorer(ScoringConfig(model="gpt-17"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_scorer(ScoringConfig(model=str(tmp_path / "empty")), tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="device 'cuda' was asked for but CUDA is not available"):
        load_scorer(ScoringConfig(model="tiny-random", device="cuda"), tmp_path)


FULL = {"layer_types": ["full_attention"]}


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        (FULL | {"final_logit_softcapping": 0.5, "attn_logit_softcapping": None}, "disagrees with the model's own"),
        (FULL | {"final_logit_softcapping": None, "attn_logit_softcapping": 5.0}, "does not implement softcap"),
        (
            {"layer_types": ["sliding_attention"], "final_logit_softcapping": None, "attn_logit_softcapping": None},
            "does not implement sliding_window",
        ),
    ],
)
def test_models_the_kernel_cannot_reproduce_are_refused(attention, message):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # One layer (``layer_types`` lists one); head_dim set, as Gemma2's default is 256.
    layout = LLAMA_LAYOUT | {"num_hidden_layers": 1, "head_dim": 8, "attn_implementation": "eager"}
    model = Gemma2ForCausalLM(Gemma2Config(**layout, **attention)).eval()
    with pytest.raises(ModelLoadError, match=message):
        verify_scorer(Scorer(name="gemma2", model=model, tokenizer=None))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0}, "temperature must be > 0, got 0"),
        ({"max_batch_tokens": 0}, "max_batch_tokens must be >= 1, got 0"),
        ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, float64; got 'int8'"),
        ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    ],
)
def test_bad_scoring_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScoringConfig(**kwargs)
