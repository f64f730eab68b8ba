"""The Monitor against a real service over loopback: order, replays, refusals, spooling, strictness."""

from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
from bench.serving import free_port
from rollouts import trajectories

from collapse_monitor import Monitor, MonitorError, TrajectoryError


def test_every_step_arrives_once_in_order_and_is_read_back(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1000})
    for step in range(1, 11):
        monitor.log(step, trajectories(step))
    assert monitor.flush(30)
    stats = monitor.stats()
    assert (stats.logged, stats.sent, stats.replayed, stats.rejected, stats.queued, stats.spooled) == (
        10,
        10,
        0,
        0,
        0,
        0,
    )
    assert stats.last_step_sent == 10
    assert stats.service_reachable is True
    arrived = service.batches(run_name)
    assert [step for step, _ in arrived] == list(range(1, 11))
    assert all(key.startswith(f"{run_name}-{step}-") for step, key in arrived)
    service.wait_until_processed(run_name, 10)
    points = monitor.metrics(["num_trajectories"])
    assert [(p["step"], p["value"]) for p in points] == [(s, 8.0) for s in range(1, 11)]
    assert monitor.run_info()["last_step"] == 10
    assert monitor.alerts() == []
    assert monitor.close()


def test_a_rerun_under_the_same_name_replays_identical_steps_and_adds_changed_ones(service, run_name, tmp_path):
    with Monitor(service.url, run_name, spool_dir=tmp_path) as first:
        for step in (1, 2, 3):
            first.log(step, trajectories(step))
    second = Monitor(service.url, run_name, spool_dir=tmp_path)
    for step in (1, 2, 3):
        second.log(step, trajectories(step))  # same content: the service recognises the replays
    second.log(2, trajectories(2, per_group=3))  # resumed from a checkpoint: new rollouts at step 2
    assert second.flush(30)
    stats = second.stats()
    assert (stats.sent, stats.replayed, stats.rejected) == (4, 3, 0)
    assert [step for step, _ in service.batches(run_name)] == [1, 2, 3, 2]
    second.close()


def test_a_step_below_one_already_scored_is_logged_with_the_services_resume_warning(
    service, run_name, tmp_path, caplog
):
    with Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1}) as first:
        for step in (1, 2, 3):
            first.log(step, trajectories(step))
    service.wait_until_processed(run_name, 3)  # step 3 taken for scoring: a step 2 now starts a segment
    resumed = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1})
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        resumed.log(2, trajectories(2, per_group=3))
        assert resumed.flush(30)
    assert f"step 2 went back below step 3, already taken for scoring: run {run_name!r} starts segment 1" in caplog.text
    assert resumed.stats().server_warnings == 1
    resumed.close()


def test_run_settings_pass_through_and_other_settings_attach_with_a_warning(service, run_name, tmp_path, caplog):
    monitor = Monitor(
        service.url,
        run_name,
        spool_dir=tmp_path,
        metadata={"model": "tiny", "algorithm": "GRPO"},
        schedule={"every": 5},
        run_settings={"temperature": 0.7, "sampler": {"num_samples": 16}},
    )
    monitor.log(1, trajectories(1))
    assert monitor.flush(30)
    info = monitor.run_info()
    assert info["schedule"] == {"every": 5, "budget_seconds": None}  # null: the service's budget
    assert info["temperature"] == 0.7
    assert info["metadata"]["algorithm"] == "GRPO"
    assert info["sampler"]["num_samples"] == 16
    monitor.close()

    other = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 3})
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        other.log(2, trajectories(2))
        assert other.flush(30)
    assert "schedule" in (other.stats().run_conflict or "")
    assert "sending to the existing run" in caplog.text
    assert [step for step, _ in service.batches(run_name)] == [1, 2]
    other.close()


def test_a_refused_batch_is_kept_with_the_reason_and_later_steps_still_arrive(service, run_name, tmp_path, caplog):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path)
    bad = [dict(t, unknown_field=1) for t in trajectories(1)]
    with caplog.at_level(logging.ERROR, logger="collapse_monitor"):
        monitor.log(1, bad)
        monitor.log(2, trajectories(2))
        assert monitor.flush(30)
    stats = monitor.stats()
    assert (stats.sent, stats.rejected) == (1, 1)
    assert "trajectories[0].unknown_field: Extra inputs are not permitted" in (stats.last_error or "")
    assert "refused the batch of step 1" in caplog.text
    [kept] = (tmp_path / run_name / "rejected").glob("*-batch-1.json")
    assert json.loads(kept.read_text())["trajectories"][0]["unknown_field"] == 1
    assert json.loads(kept.with_suffix(".error.json").read_text())["status"] == 422
    assert [step for step, _ in service.batches(run_name)] == [2]
    monitor.close()


def test_text_no_database_can_store_still_arrives(service, run_name, tmp_path):
    # A policy can emit token 0 or undecodable bytes: the step must not be lost for one character.
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path)
    odd = [dict(t, response=t["response"] + "\x00 \udc80") for t in trajectories(1)]
    monitor.log(1, odd)
    assert monitor.flush(30)
    assert (monitor.stats().sent, monitor.stats().rejected) == (1, 0)
    assert [step for step, _ in service.batches(run_name)] == [1]
    monitor.close()


def test_malformed_input_never_raises_by_default_and_is_counted(service, run_name, tmp_path, caplog):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path)
    with caplog.at_level(logging.ERROR, logger="collapse_monitor"):
        monitor.log(1, [{"group_id": 0, "reward": 1.0, "prompt": "p"}])
        monitor.log(-1, trajectories(1))
        monitor.log(2, trajectories(2))
    assert monitor.flush(30)
    stats = monitor.stats()
    assert (stats.invalid, stats.sent) == (2, 1)
    assert "needs a response" in caplog.text
    assert "step must be at least 0" in caplog.text
    monitor.close()


def test_strict_mode_raises_instead(service, run_name, tmp_path):
    with pytest.raises(MonitorError, match="cannot create run"):
        Monitor(f"http://127.0.0.1:{free_port()}", run_name, spool_dir=tmp_path, strict=True, timeout=2)
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, strict=True)
    with pytest.raises(TrajectoryError, match="needs a prompt"):
        monitor.log(1, [{"group_id": 0, "reward": 1.0, "response": "r"}])
    monitor.log(1, [dict(t, unknown_field=1) for t in trajectories(1)])
    with pytest.raises(MonitorError, match="refused the batch of step 1"):
        monitor.flush(30)
    monitor.log(2, trajectories(2))
    assert monitor.close()


def test_an_unreachable_service_spools_and_the_next_monitor_replays_in_order(service, run_name, tmp_path, caplog):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trainer = Monitor(down, run_name, spool_dir=tmp_path, timeout=2)
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        for step in (1, 2, 3):
            trainer.log(step, trajectories(step))
        assert not trainer.flush(1.5)
        trainer.checkpoint(tmp_path / "nowhere", step=3)
        assert not trainer.close(timeout=1)
    assert "retrying with backoff" in caplog.text
    stats = trainer.stats()
    assert (stats.sent, stats.spooled, stats.dropped) == (0, 4, 0)
    assert stats.retries >= 1
    assert stats.service_reachable is False
    assert sorted(p.name for p in (tmp_path / run_name).glob("*.json")) == [
        "000000000000-batch-1.json",
        "000000000001-batch-2.json",
        "000000000002-batch-3.json",
        "000000000003-checkpoint-3.json",
    ]

    # The trainer restarts, now with the service reachable: the spooled steps go first.
    restarted = Monitor(service.url, run_name, spool_dir=tmp_path)
    restarted.log(4, trajectories(4))
    assert restarted.flush(30)
    assert [step for step, _ in service.batches(run_name)] == [1, 2, 3, 4]
    stats = restarted.stats()
    assert (stats.sent, stats.checkpoints_rejected, stats.spooled) == (4, 1, 0)  # no checkpoint_root match
    restarted.close()


def test_checkpoints_are_announced_between_the_batches_they_follow(service, run_name, tmp_path):
    checkpoint = service.folder / "checkpoints" / run_name / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    # policy mode, but no step is scheduled for scoring: only the announcement order is under test
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, scorer_mode="policy", schedule={"every": 1000})
    monitor.log(1, trajectories(1))
    monitor.checkpoint(checkpoint, step=1)
    monitor.log(2, trajectories(2))
    assert monitor.close()
    assert monitor.stats().checkpoints_sent == 1
    assert service.checkpoints(run_name) == [(str(checkpoint), "full", 1)]
    assert service.checkpoint_of_batches(run_name) == [(1, None), (2, str(checkpoint))]


def test_client_side_sampling_sends_at_most_max_groups(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, max_groups=3)
    monitor.log(1, trajectories(1, n_groups=10, per_group=2))
    assert monitor.close()
    assert monitor.stats().rows_sampled_out == 14
    service.wait_until_processed(run_name, 1)
    assert [p["value"] for p in monitor.metrics(["num_groups", "num_trajectories"])] == [3.0, 6.0]


@pytest.fixture
def stuck_endpoint():
    """A loopback port that accepts connections and never answers (a hung proxy or service)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_memory_stays_bounded_while_the_sender_waits_on_a_hung_service(stuck_endpoint, run_name, tmp_path):
    monitor = Monitor(stuck_endpoint, run_name, spool_dir=tmp_path, max_queue=2, timeout=30)
    for step in range(1, 8):
        monitor.log(step, trajectories(step))
        assert monitor.stats().queued <= 2
    stats = monitor.stats()
    assert stats.dropped == 0
    assert stats.queued + stats.spooled == 7
    assert (
        sorted(int(p.name.split("-")[2].split(".")[0]) for p in (tmp_path / run_name).glob("*.json"))
        == list(range(1, 8))[: stats.spooled]
    )
    monitor.close(timeout=0)  # the hung request may take its full timeout: leave it to the daemon thread


def test_log_returns_at_once_while_the_service_is_down(run_name, tmp_path):
    monitor = Monitor(f"http://127.0.0.1:{free_port()}", run_name, spool_dir=tmp_path, timeout=2)
    done = threading.Event()

    def train() -> None:
        for step in range(1, 51):
            monitor.log(step, trajectories(step))
        done.set()

    worker = threading.Thread(target=train)
    worker.start()
    assert done.wait(10), "log() blocked on an unreachable service"
    worker.join()
    assert not monitor.close(timeout=0.5)
    stats = monitor.stats()
    assert stats.logged == 50
    assert stats.dropped == 0
    assert stats.spooled == 50
