"""What a post costs does not grow with its run's history: a step off the schedule (finished in the request,
its alerts evaluated) and one behind a queued step (the pace read) do the same work at step 150 as at step 10.

Work is counted, not timed: the statements a post sends (both backends) and, on SQLite, the virtual-machine
instructions they execute, which grow with every row a statement reads or sorts.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from service.ingest.batches import ingest_rollouts
from service.ingest.limits import IngestLimits
from service.ingest.runs import create_run
from service.schemas.inputs import BatchIn, RunCreate
from service.storage.database import make_engine, make_sessions

pytestmark = pytest.mark.integration

EVERY = 1_000_000  # steps 2, 3, ... are off the schedule; step 1 is scored
INSTRUCTIONS_PER_TICK = 10


class Work:
    """Statements sent, and SQLite instructions executed (in ticks of ``INSTRUCTIONS_PER_TICK``), by ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.statements = self.ticks = 0
        event.listen(engine, "connect", self._on_connect)
        event.listen(engine, "before_cursor_execute", self._on_statement)

    def _on_connect(self, connection, _record) -> None:
        if isinstance(connection, sqlite3.Connection):
            connection.set_progress_handler(self._tick, INSTRUCTIONS_PER_TICK)

    def _tick(self) -> int:
        self.ticks += 1
        return 0  # go on

    def _on_statement(self, *_args) -> None:
        self.statements += 1


def body(step: int) -> bytes:
    trajectories = [
        {"group_id": g, "reward": float(k), "turns": [{"prompt": f"Room {g}: which way?", "response": "Up."}]}
        for g in range(4)
        for k in range(2)
    ]
    return json.dumps({"step": step, "trajectories": trajectories}).encode()


@pytest.fixture
def posting(database_url, settings_for) -> Iterator:
    """``post(step)``: ingests a batch of run ``r`` in this thread, as the API does (no worker anywhere);
    returns the work it did."""
    settings = settings_for(database_url, embedded_worker=False)
    engine = make_engine(database_url)
    work = Work(engine)
    sessions = make_sessions(engine)
    run = RunCreate.model_validate({"name": "r", "schedule": {"every": EVERY}, "alerts": {"window": 2}})
    create_run(sessions, settings, run)

    def post(step: int) -> tuple[int, int]:
        before = (work.statements, work.ticks)
        raw = body(step)
        ingest_rollouts(sessions, settings, IngestLimits.of(settings), "r", raw, BatchIn.model_validate_json(raw))
        return work.statements - before[0], work.ticks - before[1]

    yield post
    engine.dispose()


def costs(post, first: int, last: int) -> dict[int, tuple[int, int]]:
    """The work of each post of steps ``first`` to ``last``."""
    return {step: post(step) for step in range(first, last + 1)}


def test_a_post_off_the_schedule_costs_the_same_after_150_steps_as_after_10(posting):
    work = costs(posting, 2, 152)
    (early_statements, early_ticks), (late_statements, late_ticks) = work[12], work[152]
    assert late_statements == early_statements
    # Never a pass over the history (the pace read without its indexes: x1.9 at step 152; with them, flat).
    assert late_ticks <= 1.1 * early_ticks


def test_a_post_behind_a_queued_step_reads_the_pace_at_the_same_cost_after_150_steps(posting):
    posting(1)  # scheduled: queued for a worker there is none of, so each later post reads the run's pace
    work = costs(posting, 2, 152)
    (early_statements, early_ticks), (late_statements, late_ticks) = work[12], work[152]
    assert late_statements == early_statements
    assert late_ticks <= 1.1 * early_ticks
