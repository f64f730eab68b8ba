"""The client against a real service that requires tokens: sent from the argument or the environment,
refusals keep the batches spooled for a monitor with a valid token, reads use the same token."""

from __future__ import annotations

import json

import pytest
from bench.serving import issue_token
from rollouts import trajectories
from running_service import RunningService

from collapse_monitor import Monitor, MonitorError
from collapse_monitor.cli import main


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A service with tokens, whose reads need one too; yields (service, {name: token})."""
    folder = tmp_path_factory.mktemp("secured")
    running = RunningService(folder, require_token_for_reads="true", token_cache_seconds="0")
    scopes = {"team": ["--scope", "ingest", "--run-prefix", "team-"], "reader": ["--scope", "read"]}
    issued = {name: issue_token(running.env, *flags, "--name", name) for name, flags in scopes.items()}
    running.start()
    yield running, issued
    running.stop()


def test_a_monitor_sends_its_token_for_writes_and_reads(secured, tmp_path):
    service, issued = secured
    with Monitor(service.url, "team-grpo-1", spool_dir=tmp_path, token=issued["team"], strict=True) as monitor:
        for step in (1, 2):
            monitor.log(step, trajectories(step))
        assert monitor.flush(30)
        assert [step for step, _ in service.batches("team-grpo-1")] == [1, 2]
        assert monitor.run_info()["name"] == "team-grpo-1"  # an ingest token reads its own runs
        assert monitor.alerts() == []


def test_without_a_valid_token_batches_wait_in_the_spool_for_a_monitor_that_has_one(secured, tmp_path, monkeypatch):
    service, issued = secured
    monkeypatch.delenv("COLLAPSE_MONITOR_TOKEN", raising=False)
    run = "team-spooled"
    anonymous = Monitor(service.url, run, spool_dir=tmp_path)
    anonymous.log(1, trajectories(1))
    assert not anonymous.flush(3)
    stats = anonymous.stats()
    assert (stats.sent, stats.rejected, stats.spooled) == (0, 0, 1)
    assert (stats.last_error or "").startswith("401: unauthorized: this request needs an API token")
    assert not anonymous.close(1)

    with pytest.raises(MonitorError, match="403: insufficient_scope: this ingest token may write runs whose name"):
        Monitor(service.url, "other-run", spool_dir=tmp_path, token=issued["team"], strict=True)

    monkeypatch.setenv("COLLAPSE_MONITOR_TOKEN", issued["team"])  # the token from the environment
    with Monitor(service.url, run, spool_dir=tmp_path) as resumed:
        assert resumed.flush(30)
        assert resumed.stats().sent == 1
    assert [step for step, _ in service.batches(run)] == [1]


def test_the_command_line_takes_the_token_as_a_flag(secured, tmp_path, capsys, monkeypatch):
    service, issued = secured
    monkeypatch.delenv("COLLAPSE_MONITOR_TOKEN", raising=False)
    dump = tmp_path / "batches.jsonl"
    dump.write_text(json.dumps({"step": 1, "trajectories": trajectories(1)}) + "\n")
    common = ["send", str(dump), "--url", service.url, "--run", "team-cli", "--spool-dir", str(tmp_path / "spool")]
    assert main([*common, "--token", issued["team"]]) == 0
    assert json.loads(capsys.readouterr().out)["delivered"] is True
    assert (
        main([*common[:-2], "--spool-dir", str(tmp_path / "other"), "--token", issued["reader"], "--timeout", "2"]) == 1
    )
    assert json.loads(capsys.readouterr().out)["stats"]["last_error"].startswith("403: insufficient_scope")
