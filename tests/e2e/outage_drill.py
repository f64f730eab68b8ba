"""A database outage drill against a real ``collapse-monitor serve``: what clients see, how fast it recovers.

A client streams batches (retrying every refused or failed one after ``retry_seconds``, with an
idempotency key), probers read /healthz, /readyz and a run every ``probe_seconds``, and the
database is stopped (``pg_ctl stop -m fast``) or frozen (SIGSTOP) for ``outage_seconds`` while a
batch is being scored. Every answer is recorded; ``Drill.figures()`` sums them up. Used by
tests/e2e/test_database_outage_e2e.py (assertions) and bench/outage.py (figures).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine, func, select

from service.storage.tables import Batch, MetricPoint, as_utc
from tests.e2e.pg_cluster import ThrowawayPostgres

ERROR_SHAPE = {"error", "detail", "field", "index"}
RUN = {"name": "outage", "sampler": {"num_samples": None, "samplers": ["trajectory"]}}


def batch(step: int, n_groups: int = 3) -> dict[str, Any]:
    """A small step: the tiny model scores it in well under a second when the machine is not crowded."""
    trajectories = [
        {
            "group_id": g,
            "reward": float(k),
            "turns": [
                {
                    "prompt": f"Step {step}. Board {g}-{t}: wall floor box goal.",
                    "response": f"<think>I push the box {k}.</think><answer>Up</answer>",
                }
                for t in range(2)
            ],
        }
        for g in range(n_groups)
        for k in range(2)
    ]
    return {"step": step, "idempotency_key": f"outage-{step}", "trajectories": trajectories}


@dataclass
class Answer:
    at: float  # time.monotonic() when the request was sent
    what: str  # ingest | run | healthz | readyz
    seconds: float
    status: int | None  # None: no HTTP answer (timeout, reset)
    retry_after: str | None = None
    body: Any = None  # parsed JSON, or the text when it is not JSON

    @property
    def is_json_error(self) -> bool:
        return isinstance(self.body, dict) and set(self.body) >= ERROR_SHAPE


@dataclass
class Drill:
    base: str
    database: ThrowawayPostgres
    kind: str  # stop | freeze
    pace_seconds: float = 1.0
    outage_seconds: float = 6.0
    retry_seconds: float = 0.25
    probe_seconds: float = 0.25
    client_timeout: float = 30.0
    answers: list[Answer] = field(default_factory=list)
    down_at: float = 0.0
    up_at: float = 0.0
    up_wall: float = 0.0  # time.time() of up_at: batches' finished_at are wall-clock times
    ids: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, timeout: float = 90.0) -> None:
        with httpx.Client(base_url=self.base, timeout=self.client_timeout) as http:
            assert http.post("/v1/runs", json=RUN).status_code == 201
        client = threading.Thread(target=self._stream, daemon=True)
        probes = [("healthz", "/healthz"), ("readyz", "/readyz"), ("run", f"/v1/runs/{RUN['name']}")]
        probers = [threading.Thread(target=self._probe, args=probe, daemon=True) for probe in probes]
        for thread in [client, *probers]:
            thread.start()
        deadline = time.monotonic() + timeout
        try:
            self._wait(lambda s: s.count("done") >= 2, deadline, "two scored batches")
            # Out while a batch is being scored if the polls catch one (its finishing write then meets
            # the outage); a small batch scores in moments, so on a crowded machine a poll may not.
            with contextlib.suppress(AssertionError):
                self._wait(lambda s: "scoring" in s, min(deadline, time.monotonic() + 20), "a batch being scored")
            self.down_at = time.monotonic()
            self.database.stop() if self.kind == "stop" else self.database.freeze()
            time.sleep(self.outage_seconds)
            self.database.start() if self.kind == "stop" else self.database.thaw()
            self.up_at, self.up_wall = time.monotonic(), time.time()
            client.join(max(0.0, deadline - time.monotonic()))
            assert not client.is_alive(), "the client did not get every batch in"
            self._wait(lambda s: s.count("done") + s.count("failed") == len(self.ids), deadline, "every batch scored")
        finally:
            self._stop.set()
            self.database.thaw()
            for thread in [client, *probers]:
                thread.join(5)

    def _stream(self) -> None:
        """Steps 0, 1, ... one per ``pace_seconds``, each retried until accepted, up to 3 after the outage."""
        after = 0
        with httpx.Client(base_url=self.base, timeout=self.client_timeout) as http:
            while not self._stop.is_set() and after < 3:
                step = len(self.ids)
                answer = self._send(http, "ingest", "POST", f"/v1/runs/{RUN['name']}/batches", json=batch(step))
                if answer.status in (200, 202):
                    self.ids[step] = answer.body["batch_id"]
                    after += self.up_at > 0
                    time.sleep(self.pace_seconds)
                else:
                    time.sleep(self.retry_seconds)

    def _probe(self, what: str, path: str) -> None:
        with httpx.Client(base_url=self.base, timeout=self.client_timeout) as http:
            while not self._stop.wait(self.probe_seconds):
                self._send(http, what, "GET", path)

    def _send(self, http: httpx.Client, what: str, method: str, path: str, **kwargs: Any) -> Answer:
        at = time.monotonic()
        try:
            response = http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            answer = Answer(at, what, time.monotonic() - at, None, body=f"{type(e).__name__}: {e}")
        else:
            try:
                body = response.json()
            except ValueError:
                body = response.text
            answer = Answer(
                at, what, time.monotonic() - at, response.status_code, response.headers.get("retry-after"), body
            )
        self.answers.append(answer)
        return answer

    def _statuses(self) -> list[str]:
        out = []
        for batch_id in list(self.ids.values()):
            try:
                out.append(httpx.get(f"{self.base}/v1/batches/{batch_id}", timeout=5).json().get("status", "?"))
            except (httpx.HTTPError, ValueError):
                out.append("?")
        return out

    def _wait(self, check: Any, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            try:
                if check(self._statuses()):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def during(self) -> list[Answer]:
        """Answers to requests open while the database was out (sent during it, or answered after it went)."""
        return [a for a in self.answers if a.at < self.up_at and a.at + a.seconds >= self.down_at]

    def stored(self) -> dict[str, Any]:
        """What the database holds: batches per step, scoring attempts, metric points per batch."""
        engine = create_engine(self.database.url)
        try:
            with engine.connect() as connection:
                rows = connection.execute(select(Batch.step, Batch.status, Batch.attempts)).all()
                finished = connection.execute(select(Batch.finished_at).where(Batch.finished_at.is_not(None))).scalars()
                after_up = [
                    t.timestamp() - self.up_wall for t in map(as_utc, finished) if t and t.timestamp() >= self.up_wall
                ]
                points = connection.execute(
                    select(
                        MetricPoint.batch_id,
                        func.count(),
                        func.count(func.distinct(MetricPoint.sampler + MetricPoint.name)),
                    ).group_by(MetricPoint.batch_id)
                ).all()
        finally:
            engine.dispose()
        steps = [step for step, _, _ in rows]
        return {
            "batches": len(rows),
            "lost": len(set(self.ids) - set(steps)),
            "duplicated": len(steps) - len(set(steps)),
            "not_done": sum(status != "done" for _, status, _ in rows),
            "scored_more_than_once": sum(attempts > 1 for _, _, attempts in rows),
            "batches_with_points": len(points),
            "duplicate_points": sum(total - distinct for _, total, distinct in points),
            "first_scored_after_back_seconds": round(min(after_up), 2) if after_up else None,
        }

    def figures(self) -> dict[str, Any]:
        during = self.during()
        codes: dict[str, int] = {}
        for a in during:
            key = f"{a.what} {a.status if a.status is not None else 'no answer'}"
            codes[key] = codes.get(key, 0) + 1
        ingest_2xx = [
            a.at + a.seconds
            for a in self.answers
            if a.what == "ingest" and a.status in (200, 202) and a.at >= self.up_at
        ]
        readyz = [a.seconds for a in during if a.what == "readyz"]
        answered = [a for a in during if a.what in ("ingest", "run")]
        return {
            "kind": self.kind,
            "outage_seconds": round(self.up_at - self.down_at, 2),
            "requests_during_outage": len(during),
            "status_codes": dict(sorted(codes.items())),
            "n_5xx_other_than_503": sum(a.status is not None and a.status >= 500 and a.status != 503 for a in during),
            "n_not_json": sum(
                a.status is not None and a.status >= 400 and not a.is_json_error and a.what != "readyz" for a in during
            ),
            "api_answer_seconds_max": round(max((a.seconds for a in answered), default=0.0), 2),
            "readyz_seconds_max": round(max(readyz, default=0.0), 3),
            "healthz_seconds_max": round(max((a.seconds for a in during if a.what == "healthz"), default=0.0), 3),
            "first_2xx_ingest_after_back_seconds": round(min(ingest_2xx) - self.up_at, 2) if ingest_2xx else None,
            **self.stored(),
        }
