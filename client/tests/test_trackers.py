"""Scored figures for the trainer's tracker: each scored step once, in step order, nothing while the service is down."""

from __future__ import annotations

from rollouts import trajectories

from collapse_monitor.monitor import Monitor
from collapse_monitor.trackers import NAMES, ScoredFigures, merge_newest


def test_each_scored_step_is_taken_once_under_the_prefix_and_merged_for_verl(service, run_name):
    monitor = Monitor(service.url, run_name)
    for step in (1, 2):
        monitor.log(step, trajectories(step))
    assert monitor.close(timeout=60)
    service.wait_until_processed(run_name, 2)

    figures = ScoredFigures(Monitor(service.url, run_name))
    figures.poll()
    taken = figures.take()
    assert list(taken) == [1, 2]
    for figures_of_step in taken.values():  # collapse/<sampler>/<name>, every diagnostic of each sampler
        assert {key.rsplit("/", 1)[1] for key in figures_of_step} >= set(NAMES)
        assert all(key.startswith("collapse/") for key in figures_of_step)
    figures.poll()
    assert figures.take() == {}  # nothing scored since: nothing taken twice

    monitor = Monitor(service.url, run_name)
    monitor.log(3, trajectories(3))
    assert monitor.close(timeout=60)
    service.wait_until_processed(run_name, 3)
    figures.poll()
    metrics: dict = {"actor/loss": 0.5}
    merge_newest(figures, metrics)
    assert metrics["collapse/step"] == 3.0
    assert {key.rsplit("/", 1)[1] for key in metrics if key.startswith("collapse/")} >= set(NAMES)
    assert metrics["actor/loss"] == 0.5


def test_a_service_that_is_down_gives_nothing_and_raises_nothing():
    figures = ScoredFigures(Monitor("http://127.0.0.1:9", "down"))
    figures.poll()
    metrics: dict = {"actor/loss": 0.5}
    merge_newest(figures, metrics)
    assert metrics == {"actor/loss": 0.5}
