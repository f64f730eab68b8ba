"""A run's metric series as ``GET /v1/runs/{run}/metrics`` answers them: JSON, CSV or columns.

JSON and CSV are encoded as the points are read, a chunk at a time, into a spool sent once the read
is over, so no database session waits on a slow client; at most ``SERIES_READERS`` such reads run at
once. Must not import fastapi.
"""

from __future__ import annotations

import csv
import io
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Literal

import orjson
from sqlalchemy.orm import Session, sessionmaker

from service.errors import ReadsBusy
from service.schemas.reads import MetricPointOut
from service.storage import points
from service.storage.points import SeriesQuery
from service.storage.tables import iso_time

# Series reads reading from the database at once: below every pool's size (SQLite 5 + 10, Postgres
# 10 + 20), so that /readyz, writes and the worker's claims always find a connection.
SERIES_READERS = 4
SERIES_READ_WAIT_SECONDS = 10.0  # a read waits this long for its turn, then 503 reads_busy
SPOOL_MEMORY_BYTES = 8 * 2**20  # an answer's part kept in memory; the rest of it waits in a temporary file
SPOOL_READ_BYTES = 256 * 1024
# The segment column comes only with segments=all, so the default CSV keeps the columns it always had.
CSV_COLUMNS = [name for name in MetricPointOut.model_fields if name != "segment"]


def series_columns(session: Session, run: str, query: SeriesQuery) -> bytes:
    """The points as per (sampler, name) arrays of steps and values, with ``truncated`` past ``query.limit``."""
    found, truncated = points.metric_columns(session, query)
    series = [
        {"sampler": s, "name": n, "steps": steps, "values": values} for (s, n), (steps, values) in sorted(found.items())
    ]
    # orjson: a long run's history is ~10^5 floats, which the json module writes 20x slower.
    return orjson.dumps({"run": run, "series": series, "truncated": truncated})


def spooled_series(
    sessions: sessionmaker[Session],
    readers: threading.BoundedSemaphore,
    run: str,
    query: SeriesQuery,
    format: Literal["json", "csv"],
) -> Iterator[bytes]:
    """The points as JSON (``MetricSeries``) or CSV, read whole now, then sent from the spool.

    Waits up to ``SERIES_READ_WAIT_SECONDS`` for one of the ``readers`` (``SERIES_READERS``), else 503.
    """
    if not readers.acquire(timeout=SERIES_READ_WAIT_SECONDS):
        raise ReadsBusy(f"{SERIES_READERS} series reads are being read from the database already; retry shortly")
    try:
        return _spooled(_csv_body(sessions, query) if format == "csv" else _json_body(sessions, run, query))
    finally:
        readers.release()


def _spooled(body: Iterator[bytes] | Iterator[str]) -> Iterator[bytes]:
    """``body`` written out whole (its database session closed with it), then sent from a temporary file.

    Called in the handler (the thread pool): the series is read and encoded at the database's pace,
    not the client's. Streamed straight from the cursor, an answer kept its session and pooled
    connection while the client read it: 16 clients that never read held the whole pool, and every
    database request, ``/readyz`` too, answered 503 (issue 29). Memory stays bounded (at most
    ``SPOOL_MEMORY_BYTES`` per answer, the rest on disk).
    """
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115  # closed by the generator below
    try:
        for part in body:
            spool.write(part.encode() if isinstance(part, str) else part)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return _sent_from(spool)


def _sent_from(spool: IO[bytes]) -> Iterator[bytes]:
    with spool:
        while part := spool.read(SPOOL_READ_BYTES):
            yield part


def _json_body(sessions: sessionmaker[Session], run: str, query: SeriesQuery) -> Iterator[bytes]:
    """``MetricSeries`` as JSON (its fields in order), written a chunk of points at a time."""
    yield b'{"run":' + orjson.dumps(run) + b',"points":['
    separator = b""
    with sessions() as session:
        for chunk in points.metric_series(session, query):
            rows = [
                {
                    "step": step,
                    "segment": segment,
                    "sampler": sampler,
                    "name": name,
                    "value": value,
                    "scorer": scorer,
                    "checkpoint": checkpoint,
                    "time": iso_time(created) or "",
                }
                for step, segment, sampler, name, value, scorer, checkpoint, created in chunk
            ]
            yield separator + orjson.dumps(rows)[1:-1]
            separator = b","
    yield b"]}"


def _csv_body(sessions: sessionmaker[Session], query: SeriesQuery) -> Iterator[str]:
    """The points as CSV (``CSV_COLUMNS``, then ``segment`` with segments=all), a chunk at a time."""
    all_segments = query.all_segments
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*CSV_COLUMNS, "segment"] if all_segments else CSV_COLUMNS)
    with sessions() as session:
        for chunk in points.metric_series(session, query):
            for step, segment, sampler, name, value, scorer, checkpoint, created in chunk:
                row = [step, sampler, name, value, scorer, checkpoint, iso_time(created) or ""]
                writer.writerow([*row, segment] if all_segments else row)
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()
