"""A service configured with batch limits smaller than its defaults, and a client told none by hand: the monitor
learns them when it creates its run, or from the 413 naming one, and delivers every step fitted to them (issue 38
follow-ups). One real ``collapse-monitor serve``, scoring paused."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.serving import free_port
from prometheus_client.parser import text_string_to_metric_families
from running_service import RunningService

from collapse_monitor import BatchLimits, Monitor

CLI = Path(sys.executable).parent / "collapse-monitor-client"
LIMITS = BatchLimits(max_body_bytes=200_000, max_trajectories=16, max_turns=4, max_text_chars=2000, max_token_ids=100)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    settings = {name: str(getattr(LIMITS, name)) for name in LIMITS.__dataclass_fields__}
    running = RunningService(tmp_path_factory.mktemp("small-limits"), scoring_paused="true", **settings)
    running.start()
    yield running
    running.stop()


def step_past_every_limit(n_turns: int = 6, n_chars: int = 2500, n_ids: int = 300) -> list[dict[str, Any]]:
    """8 groups of 4 (past max_trajectories), 6 turns each (past max_turns); the even groups' turns of token-id
    lists past max_token_ids, the odd groups' of texts past max_text_chars; ~630 KB of JSON (past max_body_bytes)."""

    def turn(g: int, k: int, t: int) -> dict[str, Any]:
        if g % 2 == 0:
            return {"prompt_token_ids": [g, t, *[i % 50 for i in range(n_ids)]], "reasoning_token_ids": [k] * n_ids}
        return {"prompt": f"{g}.{t} " + "p" * n_chars + " end", "response": f"{k} " + "r" * n_chars}

    return [
        {"group_id": g, "reward": float(k % 2), "turns": [turn(g, k, t) for t in range(n_turns)]}
        for g in range(8)
        for k in range(4)
    ]


def refusals_413(service: RunningService) -> float:
    """The 413s the service has answered so far, on any route (its ``/metrics``)."""
    [requests] = [
        f
        for f in text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text)
        if f.name == ("collapse_monitor_requests")
    ]
    return sum(sample.value for sample in requests.samples if sample.labels.get("status") == "413")


def follow_once(service: RunningService, folder: Path, run: str, spool: Path, *given: str) -> dict[str, Any]:
    """``follow --once`` in a child; its result (stdout)."""
    command = [str(CLI), "follow", str(folder), "--url", service.url, "--run", run, "--once", "--settle", "0"]
    with tempfile.TemporaryFile() as out:
        done = subprocess.run([*command, "--spool-dir", str(spool), *given], stdout=out, check=False)
        out.seek(0)
        assert done.returncode == 0
        result: dict[str, Any] = json.loads(out.read())
    return result


def assert_within(batch: dict[str, Any], limits: BatchLimits) -> None:
    assert len(json.dumps(batch).encode()) <= limits.max_body_bytes
    assert 0 < len(batch["trajectories"]) <= limits.max_trajectories
    for trajectory in batch["trajectories"]:
        assert 0 < len(trajectory["turns"]) <= limits.max_turns
        for turn in trajectory["turns"]:
            assert all(len(turn.get(key, "")) <= limits.max_text_chars for key in ("prompt", "response"))
            ids = ("prompt_token_ids", "reasoning_token_ids")
            assert all(len(turn.get(key, [])) <= limits.max_token_ids for key in ids)


def test_a_monitor_given_no_limits_fits_a_step_to_the_limits_its_service_told(
    small: RunningService, run_name: str, tmp_path: Path
) -> None:
    monitor = Monitor(small.url, run_name, spool_dir=tmp_path)
    monitor.log(1, step_past_every_limit())
    assert monitor.close(60)
    assert monitor.limits == LIMITS  # told with the run: the first body was fitted to them
    stats = monitor.stats()
    assert (stats.sent, stats.rejected, stats.refitted) == (1, 0, 0)
    assert stats.rows_cut > 0
    assert stats.rows_left_out > 0  # whole groups past the body or the trajectory count
    [stored] = small.payloads(run_name)
    assert_within(stored, LIMITS)
    texts = [turn for t in stored["trajectories"] for turn in t["turns"] if "prompt" in turn]
    assert texts
    assert all(turn["prompt"].endswith(" end") for turn in texts)  # a prompt keeps its last characters
    assert not (tmp_path / run_name / "rejected").exists()


def test_limits_given_are_kept_where_smaller_and_lowered_to_the_services_elsewhere(
    small: RunningService, run_name: str, tmp_path: Path
) -> None:
    given = BatchLimits(max_body_bytes=64 << 20, max_trajectories=100_000, max_text_chars=10**6, max_token_ids=20)
    monitor = Monitor(small.url, run_name, spool_dir=tmp_path, limits=given, strict=True)  # strict: told at once
    assert monitor.limits == BatchLimits(**{**vars(LIMITS), "max_token_ids": 20})
    monitor.log(1, step_past_every_limit())
    assert monitor.close(60)
    stats = monitor.stats()
    assert (stats.sent, stats.rejected, stats.refitted) == (1, 0, 0)
    [stored] = small.payloads(run_name)
    assert_within(stored, monitor.limits)
    assert max(len(t["turns"][0].get("reasoning_token_ids", [])) for t in stored["trajectories"]) == 20


def test_steps_spooled_before_the_service_answered_are_fitted_to_its_limits_before_they_are_sent(
    small: RunningService, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The trainer started while the service was down: its steps were fitted to the defaults and spooled.
    down = Monitor(f"http://127.0.0.1:{free_port()}", run_name, spool_dir=tmp_path, timeout=2, durable=True)
    for step in (1, 2):
        down.log(step, step_past_every_limit())
    assert not down.close(timeout=1)
    assert down.limits == BatchLimits()
    spooled = sorted((tmp_path / run_name).glob("*.json"))
    assert [p.name for p in spooled] == ["000000000000-batch-1.json", "000000000001-batch-2.json"]
    assert all(p.stat().st_size > LIMITS.max_body_bytes for p in spooled)

    refused_before = refusals_413(small)
    restarted = Monitor(small.url, run_name, spool_dir=tmp_path)
    restarted.log(3, step_past_every_limit())
    assert restarted.close(60)
    stats = restarted.stats()
    assert (stats.sent, stats.rejected, stats.refitted) == (3, 0, 2)  # the spooled ones refitted once each
    # ... before they were sent: the limits told with the run say the spooled bodies are past max_body_bytes
    assert refusals_413(small) == refused_before
    assert caplog.text.count("past the service's max_body_bytes=200000; sent as") == 2
    assert [step for step, _ in small.batches(run_name)] == [1, 2, 3]
    for stored in small.payloads(run_name):
        assert_within(stored, LIMITS)
    assert not (tmp_path / run_name / "rejected").exists()
    assert not list((tmp_path / run_name).glob("*.json"))


def test_a_run_attached_after_a_conflict_learns_each_limit_from_its_413(
    small: RunningService, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A 409 run_conflict answer tells no limits (as an older service's answer does): each 413 names one.
    assert httpx.post(f"{small.url}/v1/runs", json={"name": run_name, "temperature": 0.5}).status_code == 201
    monitor = Monitor(small.url, run_name, spool_dir=tmp_path, temperature=0.9)
    monitor.log(1, step_past_every_limit())
    assert monitor.close(60)
    stats = monitor.stats()
    assert stats.run_conflict is not None
    assert (stats.sent, stats.rejected) == (1, 0)
    assert 1 <= stats.refitted <= 5  # at most one refit a limit
    [stored] = small.payloads(run_name)
    assert_within(stored, LIMITS)
    assert "fitted to the service's limits" in caplog.text
    learned = {name: getattr(monitor.limits, name) for name in LIMITS.__dataclass_fields__}
    assert all(value in (getattr(LIMITS, name), getattr(BatchLimits(), name)) for name, value in learned.items())
    assert learned["max_body_bytes"] == LIMITS.max_body_bytes  # refused first: before the body is read


@pytest.mark.parametrize("given", [(), ("--max-token-ids", "10")])
def test_follow_fits_a_step_to_the_services_limits_and_the_smaller_ones_given(
    small: RunningService, run_name: str, tmp_path: Path, given: tuple[str, ...]
) -> None:
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "1.jsonl").write_text(json.dumps({"step": 1, "trajectories": step_past_every_limit()}) + "\n")
    command = [str(CLI), "follow", str(folder), "--url", small.url, "--run", run_name, "--once", "--settle", "0"]
    with tempfile.TemporaryFile() as out:
        done = subprocess.run([*command, "--spool-dir", str(tmp_path / "spool"), *given], stdout=out, check=False)
        out.seek(0)
        result = json.loads(out.read())
    assert done.returncode == 0
    assert (result["stats"]["sent"], result["stats"]["rejected"]) == (1, 0)
    [stored] = small.payloads(run_name)
    limits = BatchLimits(**{**vars(LIMITS), "max_token_ids": 10}) if given else LIMITS
    assert_within(stored, limits)
    ids = [len(t["turns"][0].get("reasoning_token_ids", [])) for t in stored["trajectories"]]
    assert max(ids) == limits.max_token_ids


def sent_bytes(trajectory: dict[str, Any], limits: BatchLimits) -> int:
    """What a trajectory of texts takes in a body, with its comma, its turns and texts cut to ``limits`` (naively)."""
    turns = [
        {"prompt": turn["prompt"][-limits.max_text_chars :], "response": turn["response"][: limits.max_text_chars]}
        for turn in trajectory["turns"][: limits.max_turns]
    ]
    return len(json.dumps({**trajectory, "turns": turns}, separators=(",", ":")).encode()) + 1


def whole_groups_that_fit(trajectories: list[dict[str, Any]], limits: BatchLimits, size: Any) -> list[int]:
    """The groups, in order, kept while each whole fits one body's trajectories (``size``: a trajectory's bytes)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory["group_id"], []).append(trajectory)
    kept: list[int] = []
    n_bytes = n_kept = 0
    for group, members in groups.items():
        group_bytes = sum(size(t) for t in members)
        if n_bytes + group_bytes <= limits.trajectory_bytes and n_kept + len(members) <= limits.max_trajectories:
            kept.append(group)
            n_bytes += group_bytes
            n_kept += len(members)
    return kept


def test_a_followed_step_of_texts_past_the_limits_holds_every_whole_group_that_fits_once_cut(
    small: RunningService, run_name: str, tmp_path: Path
) -> None:
    # The even groups: 6 turns of texts past max_text_chars, ~72 KB a group as written, ~32 KB once cut; the odd
    # groups: 2 short turns. Read at their size as written, the first group alone fits with the odd ones.
    def turn(g: int, k: int, t: int, n_chars: int) -> dict[str, str]:
        return {"prompt": f"{g}.{t} " + "p" * n_chars + " end", "response": f"{k} " + "r" * n_chars}

    step = [
        {"group_id": g, "reward": float(k), "turns": [turn(g, k, t, 3000) for t in range(6)]}
        if g % 2 == 0
        else {"group_id": g, "reward": float(k), "turns": [turn(g, k, t, 500) for t in range(2)]}
        for g in range(8)
        for k in range(2)
    ]
    expected = whole_groups_that_fit(step, LIMITS, lambda t: sent_bytes(t, LIMITS))
    as_written = whole_groups_that_fit(step, LIMITS, lambda t: len(json.dumps(t, separators=(",", ":"))) + 1)
    assert len(as_written) < len(expected) < 8  # the body binds, and binds later once cut
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "1.jsonl").write_text("".join(json.dumps({"step": 1, **t}) + "\n" for t in step))

    result = follow_once(small, folder, run_name, tmp_path / "spool")
    stats = result["stats"]
    assert (stats["sent"], stats["rejected"], stats["refitted"]) == (1, 0, 0)
    # cut and left out as the file was read, counted as the monitor counts its own
    n_cut = sum(sent_bytes(t, LIMITS) < len(json.dumps(t, separators=(",", ":"))) + 1 for t in step)
    assert (stats["rows_cut"], stats["rows_left_out"]) == (n_cut, len(step) - 2 * len(expected))
    [stored] = small.payloads(run_name)
    assert_within(stored, LIMITS)
    groups = [t["group_id"] for t in stored["trajectories"]]
    assert groups == [g for g in expected for _ in range(2)]
