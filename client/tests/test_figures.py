"""A trainer's own figures through the Monitor: with a step's batch or after it, in logged order (spooled too),
what the service would refuse left out and counted, a refused post kept with its reason."""

from __future__ import annotations

import json
import logging

from rollouts import trajectories

from collapse_monitor import Monitor


def trainer_series(monitor: Monitor) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for point in monitor.metrics(sampler="trainer"):
        out.setdefault(point["name"], {})[point["step"]] = point["value"]
    return out


def test_figures_ride_with_their_batch_or_follow_it_and_are_stored_as_the_trainers_series(service, run_name, tmp_path):
    # durable: every request is written to the spool first, so the figures' spool entries are replayed as well
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1000}, durable=True, strict=True)
    for step in (1, 2):
        monitor.log(step, trajectories(step), figures={"rollout/filter_kept_ratio": step / 4})
        monitor.figures(step, {"actor/entropy": 1.5 * step, "loss": 0.25})
    assert monitor.flush(30)
    assert trainer_series(monitor) == {
        "rollout/filter_kept_ratio": {1: 0.25, 2: 0.5},
        "actor/entropy": {1: 1.5, 2: 3.0},
        "loss": {1: 0.25, 2: 0.25},
    }
    stats = monitor.stats()
    assert (stats.sent, stats.figures_sent, stats.figures_rejected, stats.figures_left_out) == (2, 2, 0, 0)
    assert json.loads(json.dumps(service.payloads(run_name)[0]["figures"])) == {"rollout/filter_kept_ratio": 0.25}
    monitor.close()


def test_what_the_service_would_refuse_is_left_out_counted_and_logged_once(service, run_name, tmp_path, caplog):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1000}, strict=True)
    monitor.log(1, trajectories(1))
    figures = {"loss": 0.5, "kl": float("nan"), "has space": 1.0, "note": "fine", "grad_norm": 1e300}
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        monitor.figures(1, figures)
        monitor.figures(1, figures)  # the same again: a replay of the stored loss, the same warnings not repeated
    assert monitor.flush(30)
    assert trainer_series(monitor) == {"loss": {1: 0.5}}
    stats = monitor.stats()
    assert (stats.figures_sent, stats.figures_left_out) == (2, 8)
    assert caplog.text.count("figure 'kl' of step 1 not sent: nan is not a finite number within +-1e+15") == 1
    assert "figure 'has space' of step 1 not sent: the name must match" in caplog.text
    assert "figure 'note' of step 1 not sent: not a number (str)" in caplog.text
    monitor.close()


def test_figures_of_a_step_without_a_batch_are_refused_and_kept_with_the_reason(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, schedule={"every": 1000})
    monitor.log(1, trajectories(1))
    monitor.figures(7, {"loss": 0.5})
    monitor.figures(1, {"loss": 0.25})  # delivery goes on after the refusal
    assert monitor.flush(30)
    stats = monitor.stats()
    assert (stats.figures_sent, stats.figures_rejected) == (1, 1)
    [kept] = (tmp_path / run_name / "rejected").glob("*-figures-7.json")
    reason = json.loads(kept.with_suffix(".error.json").read_text())
    assert reason["status"] == 404
    assert "has no batch of step 7" in reason["detail"]
    assert trainer_series(monitor) == {"loss": {1: 0.25}}
    monitor.close()
