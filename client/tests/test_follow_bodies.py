"""``follow`` on steps past the service's limits of one batch: read in bounded memory, sent as the whole groups
that fit, a refused body not kept, a body refused for its scoring cost refitted to it (issue 38 item 3). The small
service takes bodies of at most 256 KiB; the other has the service's defaults."""

from __future__ import annotations

import json
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench.follow_traces import write_traces
from bench.peak import run_measured
from running_service import RunningService

from collapse_monitor.batches import BatchLimits, encode, normalize
from collapse_monitor.dumps import batches_of
from collapse_monitor.monitor import Monitor

CLI = Path(sys.executable).parent / "collapse-monitor-client"
BODY = 256 * 1024


@pytest.fixture(scope="module")
def small_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    running = RunningService(tmp_path_factory.mktemp("small"), max_body_bytes=str(BODY), scoring_paused="true")
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def default_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    running = RunningService(tmp_path_factory.mktemp("default"), scoring_paused="true")
    running.start()
    yield running
    running.stop()


def follow(url: str, folder: Path, run: str, spool: Path, *options: str) -> tuple[int, dict[str, Any], str, int]:
    """``follow --once`` in a child: its exit, its result, its log and its own peak RSS in MB."""
    command = [str(CLI), "follow", str(folder), "--url", url, "--run", run, "--once", "--settle", "0"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code, peak_mb = run_measured([*command, "--spool-dir", str(spool), *options], stdout=out, stderr=err)
        out.seek(0)
        err.seek(0)
        return code, json.loads(out.read()), err.read().decode(), peak_mb


def groups_step(path: Path, step: int, n_groups: int) -> None:
    """A step of ``n_groups`` groups of 4 trajectories, ~12 KB each: 8 groups are ~390 KB, past one body."""
    trajectories = [
        {"group_id": f"g{g}", "reward": float(k % 2), "prompt": f"prompt {g}", "response": f"{g}.{k} " + "x" * 12_000}
        for g in range(n_groups)
        for k in range(4)
    ]
    path.write_text(json.dumps({"step": step, "trajectories": trajectories}) + "\n")


@pytest.mark.parametrize("given", [("--max-body-bytes", str(BODY)), ()])  # or told by the service
def test_a_step_past_the_body_limit_is_sent_as_the_first_whole_groups_that_fit(
    small_service: RunningService, run_name: str, tmp_path: Path, given: tuple[str, ...]
) -> None:
    folder = tmp_path / "rollouts"
    folder.mkdir()
    groups_step(folder / "1.jsonl", 1, 8)
    groups_step(folder / "2.jsonl", 2, 1)
    code, result, log, _ = follow(small_service.url, folder, run_name, tmp_path / "spool", *given)
    assert code == 0, log
    assert result["steps"] == [1, 2]
    assert result["stats"]["rejected"] == 0
    [first, second] = small_service.payloads(run_name)
    prompts = [t["turns"][0]["prompt"] for t in first["trajectories"]]
    # 192 KiB of trajectories (the body less room for its key and figures): the first 4 groups, each whole
    assert prompts == [f"prompt {g}" for g in range(4) for _ in range(4)]
    assert len(second["trajectories"]) == 4
    assert "4 groups (16 trajectories): 'g4', 'g5', 'g6', 'g7' left out" in log
    assert not (tmp_path / "spool" / run_name / "rejected").exists()


def test_a_body_the_service_refuses_for_its_size_keeps_its_reason_not_its_body(
    small_service: RunningService, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A field the client does not know is passed through, never cut: a trajectory past one body alone is sent as
    # it is, fitting it again to the limit its 413 names leaves it so, and it is refused for good (a body that can
    # be cut is fitted and taken: test_service_limits.py).
    monitor = Monitor(small_service.url, run_name, spool_dir=tmp_path / "spool")
    monitor.log(1, [{"group_id": 0, "reward": 1.0, "prompt": "p", "response": "r", "note": "n" * 300_000}])
    monitor.log(2, [{"group_id": 0, "reward": 1.0, "prompt": "p", "response": "r"}])
    assert monitor.close(60)
    stats = monitor.stats()
    assert (stats.sent, stats.rejected) == (1, 1)
    assert "413" in caplog.text
    [reason] = (tmp_path / "spool" / run_name / "rejected").iterdir()
    assert reason.name.endswith("-batch-1.error.json")
    refused = json.loads(reason.read_text())
    assert refused["status"] == 413
    assert refused["bytes"] > BODY
    assert [step for step, _ in small_service.batches(run_name)] == [2]


def test_a_long_prime_rl_trace_is_read_in_bounded_memory_and_its_first_turns_delivered(
    small_service: RunningService, run_name: str, tmp_path: Path
) -> None:
    # One trace of ~1,000 turns in 1.1 MB: its turns' prompts, the conversation before each, are ~330 MB
    # together; follow took 1.8 GB to build them into one body the service refused.
    folder = tmp_path / "out"
    path = write_traces(folder, 1.1, episodes=1)
    code, result, log, peak_mb = follow(
        small_service.url, folder, run_name, tmp_path / "spool", "--max-body-bytes", str(BODY)
    )
    assert code == 0, log
    assert result["steps"] == [1]
    assert peak_mb < 300  # the interpreter, httpx and one body of 256 KiB; was 1.8 GB with the default limits
    [stored] = small_service.payloads(run_name)
    [trajectory] = stored["trajectories"]
    turns = trajectory["turns"]
    assert 1 < len(turns) < 256
    assert len(json.dumps(stored).encode()) <= BODY
    first = json.loads(path.read_text())["traces"][0]["nodes"]
    assert turns[0]["prompt"].startswith(f"system: {first[0]['message']['content']}")  # short: whole
    assert all(t["prompt"].endswith("\nassistant:") for t in turns)  # long: their last characters
    assert f"a trace of 1070 turns is sent as its first {len(turns)}," in log


def test_a_long_prime_rl_trace_is_taken_with_the_default_limits_refitted_to_the_scoring_cost_refused(
    default_service: RunningService, run_name: str, tmp_path: Path
) -> None:
    # Its first 256 turns of ~25k-token prompts made a 19 MB body that the service refused for its scoring cost
    # (~102M tokens: 64 rows x 64 columns of them, against max_scoring_cost 16M); users had to pass
    # --max-text-chars by hand, though the client cannot know the run's samplers or the service's limit.
    folder = tmp_path / "out"
    write_traces(folder, 1.1, episodes=1)
    code, result, log, peak_mb = follow(default_service.url, folder, run_name, tmp_path / "spool")
    assert code == 0, log
    stats = result["stats"]
    assert (stats["sent"], stats["rejected"], stats["refitted"]) == (1, 0, 1)
    assert "more than its max_scoring_cost=16000000; sent again as" in log
    assert peak_mb < 400  # the 19 MB body, parsed and cut once
    [stored] = default_service.payloads(run_name)
    [trajectory] = stored["trajectories"]
    turns = trajectory["turns"]
    assert len(turns) == 256  # every turn kept, its prompt shorter
    assert all(t["prompt"].endswith("\nassistant:") for t in turns)  # a prompt keeps its last characters
    assert len(json.dumps(stored)) < 4_000_000
    assert stored["idempotency_key"] == default_service.batches(run_name)[0][1]
    assert not (tmp_path / "spool" / run_name / "rejected").exists()


def test_a_logged_step_refused_for_its_scoring_cost_is_refitted_in_memory_and_taken(
    default_service: RunningService, run_name: str, tmp_path: Path
) -> None:
    # 64 rows of 8 groups, 20,000-character prompts: ~31M tokens for the run's two default samplers, past 16M
    rows = [
        {"group_id": g, "reward": float(k % 2), "prompt": f"{g} " + "p" * 20_000, "response": f"answer {k}"}
        for g in range(8)
        for k in range(8)
    ]
    monitor = Monitor(default_service.url, run_name, spool_dir=tmp_path, strict=True)
    monitor.log(3, rows)
    assert monitor.close(120)
    stats = monitor.stats()
    assert (stats.sent, stats.rejected, stats.refitted, stats.spilled) == (1, 0, 1, 0)  # never on disk
    [stored] = default_service.payloads(run_name)
    prompts = [t["turns"][0]["prompt"] for t in stored["trajectories"]]
    assert len(prompts) == 64
    assert len({len(p) for p in prompts}) == 1  # equally long: cut to one length
    assert 5_000 < len(prompts[0]) < 10_000
    assert [t["turns"][0]["response"] for t in stored["trajectories"]] == [r["response"] for r in rows]  # short


def test_a_verl_step_file_is_read_a_row_at_a_time_holding_about_one_body() -> None:
    # 4,000 single-turn verl rows of ~10 KB (40 MB) in one step: they were all held until the file's end
    def rows() -> Iterator[tuple[int, dict[str, Any], int]]:
        for i in range(4000):
            row = {"input": f"prompt {i // 8} " + "q" * 2000, "output": f"{i} " + "a" * 8000, "score": i % 2, "step": 3}
            yield i + 1, row, 10_000

    limits = BatchLimits(max_body_bytes=BODY)
    tracemalloc.start()
    try:
        [(step, fit)] = batches_of(rows(), "3.jsonl", limits=limits).items()
        kept = fit.items()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert step == 3
    assert len(kept) == 16  # the first 2 whole groups of 8 within 192 KiB
    assert [t["turns"][0]["prompt"][:9] for t in kept] == ["prompt 0 "] * 8 + ["prompt 1 "] * 8
    assert peak < 8 * BODY  # the kept body, one row at a time and the keys of the groups left out, not 40 MB


def test_a_step_of_long_prompts_holds_them_cut_as_sent_and_as_many_whole_groups_as_fit() -> None:
    # Groups of 4 told by their prompt alone, 5,000 characters that differ only in their opening: cut to their last
    # 2,000, as sending cuts them, they would all read as one group unless each keeps its own.
    def rows() -> Iterator[tuple[int, dict[str, Any], int]]:
        for i in range(400):
            yield i + 1, {"step": 1, "prompt": f"prompt {i // 4} " + "q" * 5000, "response": "a" * 3000}, 8_000

    limits = BatchLimits(max_body_bytes=BODY, max_text_chars=2000)
    [kept] = [fit.items() for fit in batches_of(rows(), "1.jsonl", limits=limits).values()]
    assert all(len(t["prompt"]) == len(t["response"]) == 2000 for t in kept)
    group_ids = [row["group_id"] for row in normalize(kept)]
    assert group_ids == [i // 4 for i in range(len(kept))]  # groups kept whole and apart
    fit = encode("run", 1, normalize(kept), limits=limits)[2]
    assert (fit.left_out, fit.n_cut) == ({}, 0)  # sent as read
    group_bytes = fit.kept_bytes * 4 // len(kept)
    assert fit.kept_bytes + group_bytes > limits.trajectory_bytes  # the next group would not have fitted
    as_written = 4 * (len(json.dumps(next(rows())[1])) + 1)
    assert len(kept) >= 2 * 4 * (limits.trajectory_bytes // as_written)  # twice what fit at the size as written


def test_a_step_whose_cost_lies_in_its_prompts_not_its_long_reasonings_is_refitted_on_its_prompts(
    default_service: RunningService, run_name: str, tmp_path: Path
) -> None:
    # 12,000-character prompts, 100,000-character responses: the service counts a reasoning up to its window (512
    # tokens), so the cost (~21M) lies in the prompts; the first refit cut the long responses and saved nothing
    rows = [
        {
            "group_id": g,
            "reward": float(k % 2),
            "prompt": f"{g} " + "p" * 12_000 + " end",
            "response": f"{k} " + "r" * 100_000,
        }
        for g in range(8)
        for k in range(8)
    ]
    monitor = Monitor(default_service.url, run_name, spool_dir=tmp_path, strict=True)
    monitor.log(4, rows)
    assert monitor.close(120)
    stats = monitor.stats()
    assert (stats.sent, stats.rejected, stats.refitted) == (1, 0, 2)
    [stored] = default_service.payloads(run_name)
    turns = [t["turns"][0] for t in stored["trajectories"]]
    assert len({len(t["prompt"]) for t in turns}) == 1
    assert 5_000 < len(turns[0]["prompt"]) < 12_000
    assert all(t["prompt"].endswith(" end") for t in turns)  # its last characters
    assert all(t["response"].startswith(f"{k % 8} r") for k, t in enumerate(turns))  # its first
