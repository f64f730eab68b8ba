"""Figures a trainer computed itself (its SNR filter's, its policy's token entropy, its logged losses): stored as
series of sampler ``trainer`` beside the batch of their step.

They come two ways, for the two moments a trainer knows them: with the step's batch (``BatchIn.figures``,
known when the batch was generated), or in a small post after it (``FiguresIn``: TRL and verl log a step's
figures once its batch has been sent). Either way they belong to the step's batch: stored with its id and
segment, deleted with it, never scored and never read by the alert rules. A figure is stored once: a post
sending it again with the same value is a replay, with another value a 409. Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.orm import Session, sessionmaker

from service.errors import FigureConflict, NotFound
from service.reads.runs import require_run
from service.schemas.inputs import FiguresAccepted, FiguresIn
from service.storage import points, queue
from service.storage.labels import TRAINER
from service.storage.points import Point
from service.storage.runs import current_segment, lock_run
from service.storage.tables import Batch


def record_trainer_figures(session: Session, run_id: int, batch: Batch, figures: Mapping[str, float]) -> int:
    """Stores ``figures`` as the ``trainer`` points of ``batch`` (in the caller's transaction); returns how many."""
    found = [Point(TRAINER, name, float(value)) for name, value in sorted(figures.items())]
    return points.record_points(session, run_id, batch.id, batch.step, batch.segment, found, None, None)


def ingest_figures(sessions: sessionmaker[Session], run_name: str, payload: FiguresIn) -> FiguresAccepted:
    """Stores a step's figures beside the newest batch of that step in the run's current segment.

    Raises:
        NotFound: no such run, or no batch of the step (figures follow their step's batch).
        FigureConflict: a figure of the step stored already with another value (nothing is stored).
    """
    with sessions.begin() as session:  # under the run's lock: concurrent posts of a step end in a replay or a 409
        run = require_run(session, run_name)
        if lock_run(session, run.id) is None:  # deleted since the read above: its 404, as require_run words it
            require_run(session, run_name)
        batch = queue.newest_batch_of_step(session, run.id, payload.step, current_segment(session, run.id))
        if batch is None:
            raise NotFound(
                f"run {run_name!r} has no batch of step {payload.step} (in its current segment): a step's figures "
                "follow its batch, so send the batch first",
                field="step",
            )
        stored = points.batch_values(session, batch.id, TRAINER)
        clashes = sorted(name for name, value in payload.figures.items() if name in stored and stored[name] != value)
        if clashes:
            listed = ", ".join(f"{name} ({stored[name]!r}, now {payload.figures[name]!r})" for name in clashes[:5])
            raise FigureConflict(
                f"{len(clashes)} figures of step {payload.step} were stored already with other values: {listed}; "
                "a step's figure is sent once",
                field=f"figures.{clashes[0]}",
            )
        new = {name: value for name, value in payload.figures.items() if name not in stored}
        record_trainer_figures(session, run.id, batch, new)
        return FiguresAccepted(batch_id=batch.id, step=payload.step, stored=len(new), replayed=not new)
