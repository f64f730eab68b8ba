"""TRL's ``report_to`` trackers get the scored figures at the steps they belong to (integrations/trl_trackers.py).

A real tiny GRPO run reports to TensorBoard, Trackio and W&B (offline) while a real service scores
it; the event files are read back with TensorBoard's own reader, the Trackio project from its SQLite
file (in the folder conftest gives Trackio), the W&B run from its ``.wandb`` file. With the service
down, a run trains and logs as it does without the monitor.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import datasets
import pytest
from tiny_trainer import FIRE_AT_ONCE, ROOMS, grpo_config, paced_trainer, tiny_policy
from wandb_files import wandb_history

from collapse_monitor import Monitor
from collapse_monitor.trackers import NAMES

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")
pytest.importorskip("wandb")


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar series in ``folder``'s event files, as TensorBoard reads them: ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        reader = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: every point, none sampled away
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            series.setdefault(tag, {}).update({event.step: event.value for event in reader.Scalars(tag)})
    return series


def trackio_rows(project: str) -> list[dict]:
    """The rows of ``project``'s Trackio metrics table, as logged, in logging order."""
    from trackio.sqlite_storage import SQLiteStorage

    db = sqlite3.connect(SQLiteStorage.get_project_db_path(project))
    try:
        return [json.loads(metrics) for (metrics,) in db.execute("SELECT metrics FROM metrics ORDER BY id")]
    finally:
        db.close()


# TRL 1.16's GRPOConfig still sets the name transformers 5.24 deprecated; nothing for us to change.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_a_grpo_run_shows_the_scored_figures_in_tensorboard_and_trackio_at_their_steps(
    service, run_name, tmp_path, monkeypatch
):
    import wandb

    from collapse_monitor.integrations.trl import attach

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tensorboard"))
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    # W&B reads its environment once a process, at its first run: after slime's tests' runs (offline by their
    # own settings) transformers' wandb.init() went online and failed for want of an API key
    wandb.teardown()
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path / "spool", alerts=FIRE_AT_ONCE)
    args = grpo_config(
        tmp_path / "out",
        max_completion_length=8,
        max_steps=3,
        save_strategy="no",
        report_to=["tensorboard", "trackio", "wandb"],
        project=run_name,
        run_name=run_name,
    )
    # each step waits until the step before is scored, as a real (slower) step would
    trainer = paced_trainer(monitor, args, ROOMS, alert_polls=0)
    attach(trainer, monitor, tracker_poll_seconds=0.1)
    trainer.train()
    wandb.finish()  # transformers leaves the W&B run open; finishing it writes the rest of its file
    monitor.close()

    stored = {
        (point["step"], f"collapse/{point['sampler']}/{point['name']}"): point["value"]
        for point in monitor.metrics(NAMES)
    }
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    written = {
        (step, tag): value
        for tag, series in scalars.items()
        if tag.startswith("collapse/") and tag != "collapse/alert/TemplateCollapse"
        for step, value in series.items()
    }
    steps = {step for step, _ in written}
    # Steps 1 and 2 were scored before training ended; step 3 may have been scored after.
    assert {1, 2} <= steps <= {1, 2, 3}
    assert written == {key: pytest.approx(value, rel=1e-6) for key, value in stored.items() if key[0] in steps}
    # the alert's state at the step it reached it: firing at 2 (FIRE_AT_ONCE); pending at 1 when a fetch
    # came between the two steps' scoring (an alert is listed in the state it is in now)
    alert = scalars["collapse/alert/TemplateCollapse"]
    assert alert in ({1: 1.0, 2: 2.0}, {2: 2.0})
    assert set(scalars["train/reward"]) == {1, 2, 3}  # the trainer's own series, at its own steps

    # Trackio: rows of their own, with the step they belong to as collapse/step, in step order, and as
    # train/global_step, the x-axis that lines them up with the trainer's rows on Trackio's page
    rows = trackio_rows(run_name)
    collapse_rows = [row for row in rows if "collapse/step" in row]
    assert [row["collapse/step"] for row in collapse_rows] == sorted(steps)
    assert all(row.pop("train/global_step") == row["collapse/step"] for row in collapse_rows)
    assert {
        (row["collapse/step"], name): value
        for row in collapse_rows
        for name, value in row.items()
        if name not in ("collapse/step", "collapse/alert/TemplateCollapse")
    } == {key: stored[key] for key in written}
    assert [row["train/global_step"] for row in rows if "train/reward" in row] == [1, 2, 3]

    # W&B: the same rows, plotted against collapse/step (its own step only grows)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, axes = wandb_history(run_file)
    assert {axes[name] for row in collapse_rows for name in row if name != "collapse/step"} == {"collapse/step"}
    assert [
        {name: value for name, value in row.items() if name.startswith("collapse/")}
        for row in history
        if "collapse/step" in row
    ] == collapse_rows
    assert [row["_step"] for row in history] == sorted(row["_step"] for row in history)


def length(completions, **_kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def untimed(series: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The series that do not measure time (runtime, samples per second): equal in two runs of the same seed."""
    return {tag: s for tag, s in series.items() if not any(word in tag for word in ("runtime", "per_second", "time"))}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_with_the_service_down_a_run_trains_and_logs_as_without_the_monitor(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from collapse_monitor.integrations.trl import attach

    def train(folder: Path, attached: bool) -> tuple[dict[str, dict[int, float]], dict]:
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(folder))
        model, tokenizer = tiny_policy()
        args = grpo_config(
            tmp_path / "out", max_completion_length=8, max_steps=2, save_strategy="no", report_to=["tensorboard"]
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[length],
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": ROOMS}),
            processing_class=tokenizer,
        )
        if attached:
            down = Monitor("http://127.0.0.1:9", "down", spool_dir=tmp_path / "spool", exit_timeout=0)
            attach(trainer, down, tracker_poll_seconds=0.1, flush_timeout=1)
        trainer.train()
        return tensorboard_scalars(folder), {k: v.clone() for k, v in trainer.model.state_dict().items()}

    with_down_service, weights = train(tmp_path / "down", attached=True)
    without, expected_weights = train(tmp_path / "plain", attached=False)
    assert not [tag for tag in with_down_service if tag.startswith("collapse/")]
    assert set(with_down_service["train/loss"]) == {1, 2}
    assert untimed(with_down_service) == untimed(without)
    assert all((weights[k] == v).all() for k, v in expected_weights.items())
