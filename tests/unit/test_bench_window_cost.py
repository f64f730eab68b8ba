"""bench/window_cost.py's score stage, on a tiny random model and a few made-up traces."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from bench import window_cost

TEXT = "the robot turns right twice and then moves three cells forward, so it faces south now " * 2


def test_score_stage_windows_each_batch_as_the_service_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = tmp_path / "long.json.gz"
    rows = [
        {"kind": "healthy", "prompt": 0, "text": TEXT, "reasoning_tokens": 40},
        {"kind": "healthy", "prompt": 4, "text": "17 times 23 is 391. " * 4, "reasoning_tokens": 30},
        {"kind": "template", "style": 0, "text": "Solve the task step by step. " * 4, "reasoning_tokens": 30},
        {"kind": "template", "style": 1, "text": "First, I think. " * 4, "reasoning_tokens": 20},
    ]
    with gzip.open(traces, "wt", encoding="utf-8") as f:
        json.dump({"settings": {"prompts": [0, 4]}, "traces": rows}, f)
    argv = ["window_cost.py", "score", "--model", "tiny-random", "--traces", str(traces), "--windows", "4,full"]
    monkeypatch.setattr(sys, "argv", argv)

    window_cost.main()

    report = json.loads(capsys.readouterr().out)
    assert [(r["dtype"], r["max_reasoning_tokens"]) for r in report["results"]] == [
        ("float32", 4),
        ("bfloat16", 4),
        ("float32", "full"),
        ("bfloat16", "full"),
    ]
    short, full = report["results"][0], report["results"][2]
    assert short["healthy"]["reasoning_tokens_mean"] == 4
    assert short["healthy"]["truncated_reasoning_ratio"] == 1
    assert full["template"]["truncated_reasoning_ratio"] == 0
    assert short["tokens_processed"] < full["tokens_processed"]
    for r in report["results"]:
        assert r["gap"]["mi_estimate"] == pytest.approx(r["healthy"]["mi_estimate"] - r["template"]["mi_estimate"])
        assert 0 <= r["healthy"]["retrieval_accuracy"] <= 1
    assert [c["max_reasoning_tokens"] for c in report["bf16_vs_fp32"]] == [4, "full"]
    assert report["healthy_traces"] == report["template_traces"] == 2
