"""The command line: JSON in, JSON out, and one line with exit code 2 for every kind of bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scoring.estimators import PAPER_METRICS
from service.cli import main

MATRIX = {
    "row_group_ids": [0, 0, 1, 1],
    "reasoning_lengths": [3, 4, 2, 5],
    "L_seq": [[-3, -9], [-4, -10], [-8, -2], [-12, -5]],
}


def run(capsys, args, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, data, name="in.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_metrics_prints_exactly_the_ragen_names(tmp_path, capsys):
    code, out, err = run(capsys, ["metrics", "--input", write(tmp_path, MATRIX)])
    assert code == 0, err
    metrics = json.loads(out)
    assert list(metrics) == list(PAPER_METRICS)
    # L_tok defaults to L_seq / length: rows' matched per-token values are -1, -1, -1, -1.
    assert metrics["matched_log_prob_mean"] == -1.0
    assert metrics["mi_upper_bound"] == pytest.approx(math.log(2))
    assert metrics["retrieval_accuracy"] == 1.0


def test_metrics_reads_stdin_and_runs_steps_through_one_ema(capsys, monkeypatch):
    second = MATRIX | {"L_seq": [[-3, -4], [-4, -5], [-8, -2], [-9, -5]], "config": {"ema_decay": 0.5}}
    code, out, _ = run(capsys, ["metrics", "--input", "-"], json.dumps({"steps": [MATRIX, second]}), monkeypatch)
    assert code == 0
    first, then = json.loads(out)
    assert then["marginal_std_ema"] == pytest.approx(0.5 * first["marginal_std"] + 0.5 * then["marginal_std"])


def test_metrics_with_one_column_prints_an_empty_object_and_says_why(tmp_path, capsys):
    data = {"row_group_ids": [3, 3], "reasoning_lengths": [1, 1], "L_seq": [[-1], [-2]]}
    code, out, err = run(capsys, ["metrics", "--input", write(tmp_path, data)])
    assert (code, json.loads(out)) == (0, {})
    assert "fewer than two columns (N=1)" in err


def test_column_prompts_make_identical_prompts_one_answer(tmp_path, capsys):
    data = MATRIX | {"column_prompt_tokens": [[1, 2], [1, 2]]}
    _, out, _ = run(capsys, ["metrics", "--input", write(tmp_path, data)])
    assert json.loads(out)["retrieval_chance_level"] == 1.0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("{nope", "error: input: not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        (MATRIX | {"reasoning_lengths": [1]}, "error: reasoning_lengths: must hold one length per row (4), got 1"),
        (
            MATRIX | {"L_seq": [[1, 2], [1], [1, 2], [1, 2]]},
            "error: L_seq[1]: must hold one value per column (2 distinct",
        ),
        (MATRIX | {"L_seq": [[1, "x"]] * 4}, "error: L_seq[0][1]: Input should be a valid number"),
        (MATRIX | {"L_tok": [[1, 2]]}, "error: L_tok: must hold one row per row group id (4), got 1"),
        (MATRIX | {"column_prompt_tokens": [[1]]}, "error: column_prompt_tokens: must hold one prompt per column (2"),
        (MATRIX | {"colour": 1}, "error: colour: Extra inputs are not permitted"),
        (MATRIX | {"config": {"ema_decay": 2}}, "error: config.ema_decay: Input should be less than or equal to 1"),
        (
            '{"row_group_ids": [0, 1], "reasoning_lengths": [1, 1], "L_seq": [[NaN, 1], [1, 1]]}',
            "error: L_seq[0][0]: Input should be a finite number",
        ),
        (
            {"steps": [MATRIX, MATRIX | {"reasoning_lengths": []}]},
            "error: steps[1].reasoning_lengths: must hold one length",
        ),
        ({"steps": []}, "error: steps: List should have at least 1 item"),
    ],
)
def test_bad_metrics_input_exits_2_with_one_line_naming_the_field(tmp_path, capsys, payload, message):
    code, out, err = run(capsys, ["metrics", "--input", write(tmp_path, payload)])
    assert code == 2
    assert out == ""
    assert err.startswith(message)
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["metrics"], "error: collapse-monitor metrics: the following arguments are required: --input"),
        (
            ["metrics", "--input", "/nonexistent/x.json"],
            "error: --input: cannot read '/nonexistent/x.json': No such file",
        ),
        ([], "error: collapse-monitor: the following arguments are required: COMMAND"),
        (["plot"], "error: collapse-monitor: argument COMMAND: invalid choice: 'plot'"),
        (["score", "--input", "x"], "error: collapse-monitor score: the following arguments are required: --model"),
        (
            ["score", "--model", "m", "--input", "x", "--dtype", "int4"],
            "error: collapse-monitor score: argument --dtype",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    code, _out, err = run(capsys, args)
    assert code == 2
    assert err.startswith(message)
    assert err.count("\n") == 1


def test_filter_prints_selection_rows_and_ragen_metrics(tmp_path, capsys):
    code, out, _ = run(
        capsys, ["filter", "--input", write(tmp_path, {"rewards": [[1, 0, 1], [1, 1, 1], [0, 0.5, 1], [3]]})]
    )
    assert code == 0
    result = json.loads(out)
    assert result["selected_groups"] == [0, 2]
    assert result["kept_row_indices"] == [0, 1, 2, 6, 7, 8]
    assert result["group_reward_std"][1:] == [0.0, 0.5, 0.0]
    assert result["metrics"]["rollout/filter_kept_ratio"] == 0.5
    assert result["single_sample_groups"] == [3]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"rewards": []}, "error: rewards: List should have at least 1 item"),
        ({"rewards": [[1], []]}, "error: rewards[1]: List should have at least 1 item"),
        (
            {"rewards": [[1]], "strategy": "top_q"},
            "error: strategy: Input should be 'top_p', 'top_k', 'top_k_abs' or 'min_p'",
        ),
        ({"rewards": [[1]], "value": -1}, "error: value: Input should be greater than or equal to 0"),
        ({"rewards": [[1]], "metric": "entropy"}, "error: metric: Input should be"),
    ],
)
def test_bad_filter_input_exits_2_naming_the_field(tmp_path, capsys, payload, message):
    code, _, err = run(capsys, ["filter", "--input", write(tmp_path, payload)])
    assert code == 2
    assert err.startswith(message)


def rows_jsonl(*rows):
    return "\n".join(json.dumps(r) for r in rows) + "\n"


GOOD_ROWS = rows_jsonl(
    {"group_id": 0, "prompt": "State: goal up.", "response": "<think>I go up</think><answer>Up</answer>"},
    {"group_id": 0, "prompt": "State: goal up.", "response": "<answer>Up</answer>"},
    {"group_id": 1, "prompt_token_ids": [5, 6, 7], "reasoning_token_ids": [8, 9]},
    {"group_id": 2, "prompt": "What is 17 * 3?", "reasoning": "17 * 3 = 51"},
)


def test_score_reports_metrics_breakdown_and_the_matrix(tmp_path, capsys):
    args = ["score", "--model", "tiny-random", "--device", "cpu", "--input", write(tmp_path, GOOD_ROWS, "rows.jsonl")]
    code, out, err = run(capsys, [*args, "--cache-dir", str(tmp_path)])
    assert code == 0, err
    result = json.loads(out)
    assert (result["rows"], result["columns"]) == (3, 3)
    assert result["line_of_row"] == [1, 3, 4]
    assert result["dropped_empty_reasoning_lines"] == [2]
    assert len(result["L_seq"]) == 3
    assert all(len(row) == 3 for row in result["L_seq"])
    assert {"mi_estimate", "retrieval_accuracy", "token_entropy_mean", "token_entropy_p90"} <= set(result["metrics"])
    assert [c["group_id"] for c in result["per_prompt"]] == [0, 1, 2]
    low, high = result["intervals"]["mi_estimate"]
    assert low <= high


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "error: --input: no rows (expected one JSON object per line)"),
        ('{"group_id": 0, "prompt": "a", "reasoning": "b"}\n[oops\n', [], "error: line 2: not valid JSON"),
        (rows_jsonl({"prompt": "a", "reasoning": "b"}), [], "error: line 1: group_id: Field required"),
        (
            rows_jsonl({"group_id": 0, "prompt": "a", "prompt_token_ids": [1], "reasoning": "b"}),
            [],
            "error: line 1: input: Value error, give exactly one of prompt, prompt_token_ids",
        ),
        (
            rows_jsonl({"group_id": 0, "prompt": "a", "response": "<answer>x</answer>"}),
            [],
            "error: --input: every row has empty reasoning; nothing to score",
        ),
        (
            rows_jsonl({"group_id": 0, "prompt_token_ids": [1], "reasoning_token_ids": [99999]}),
            [],
            "error: row 0: reasoning token id 99999 is outside the vocabulary",
        ),
        (
            rows_jsonl(
                {"group_id": 0, "prompt_token_ids": [1, 2], "reasoning_token_ids": [1]},
                {"group_id": 0, "prompt_token_ids": [3], "reasoning_token_ids": [1]},
            ),
            [],
            "error: group 0: rows 0 and 1 carry different prompts",
        ),
        (
            GOOD_ROWS,
            ["--max-reasoning-tokens", "1"],
            "error: --max-reasoning-tokens: max_reasoning_tokens must be >= 2",
        ),
        (GOOD_ROWS, ["--temperature", "0"], "error: --temperature must be > 0, got 0.0"),
        (GOOD_ROWS, ["--model", "no-such-model"], "error: --model: model must be one of tiny-random, smollm2-135m"),
    ],
)
def test_bad_score_input_exits_2_with_one_line(tmp_path, capsys, content, extra, message):
    args = ["score", "--model", "tiny-random", "--device", "cpu", "--cache-dir", str(tmp_path)]
    code, out, err = run(capsys, [*args, "--input", write(tmp_path, content, "rows.jsonl"), *extra])
    assert code == 2
    assert out == ""
    assert err.startswith(message)
    assert err.count("\n") == 1


def test_the_installed_console_script_exits_2_without_a_traceback(tmp_path):
    bad = write(tmp_path, {"rewards": [[1], []]})
    proc = subprocess.run(
        [Path(sys.executable).parent / "collapse-monitor", "filter", "--input", bad],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr == "error: rewards[1]: List should have at least 1 item after validation, not 0\n"
    assert "Traceback" not in proc.stderr


def test_threads_caps_the_scoring_process_from_the_flag_or_the_environment(monkeypatch):
    import torch

    from service.cli.flags import service_settings
    from service.cli.main import build_parser
    from service.jobs.scorers import ScorerPool

    for key in [k for k in os.environ if k.startswith("COLLAPSE_MONITOR_")]:
        monkeypatch.delenv(key)
    args = build_parser().parse_args(["serve", "--threads", "1"])
    assert service_settings(args).threads == 1
    monkeypatch.setenv("COLLAPSE_MONITOR_THREADS", "2")
    settings = service_settings(build_parser().parse_args(["worker"]))
    assert settings.threads == 2
    before = torch.get_num_threads()
    try:
        ScorerPool(settings)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
