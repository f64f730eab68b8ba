"""The background sender: one thread per monitor that delivers requests in the order they were logged.

Requests wait in a bounded in-memory queue. The thread posts the oldest one; while the service is
unreachable (or answers 429/503), it backs off exponentially with jitter, honouring
``Retry-After``, and moves everything queued in memory to the spool, so a long outage costs disk,
not memory. The spool is always older than the memory queue (everything logged after a spill is
spilled behind it until the spool has drained), so requests leave in logged order: spool first,
then memory. Refused requests are moved to the spool's ``rejected/`` folder and counted, never
dropped silently (of one refused for its size, 413, only the reason is kept). A batch refused for its
scoring cost (413, ``max_scoring_cost``: the run's samplers and the service's limit, which the client
cannot know beforehand) is first refitted to the limit the refusal names (``batches.refit``: its
longest texts and token lists cut) and sent again. The batch limits in force (``limits``) are the
service's, told when the run is created (the smaller of each where the user gave some); a batch
refused for one of them (413 naming it: fitted before they were told, by an earlier process, or
against an older service that does not tell them) is fitted again to the limit named
(``batches.refit_to_limits``) and sent again; one whose body is past the ``max_body_bytes`` in force is
fitted so before it is sent, not after a 413. Must not import the integrations.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from collapse_monitor.batches import CUT_KEYS, LIMIT_NAMES, PROMPT_KEYS, BatchLimits, refit, refit_to_limits
from collapse_monitor.spool import Entry, Spool
from collapse_monitor.transport import Outcome, Transport, limit_passed

logger = logging.getLogger("collapse_monitor")

# A 500 is the service's own failure on this request; after this many the request is set aside
# instead of blocking every later step behind it.
MAX_SERVER_ERRORS = 5
# A batch refused for its scoring cost is refitted at most this many times, each to this share of the limit the
# refusal names. The first cuts the longest texts and token lists, whatever they are; a reasoning counts only up
# to the service's window, though, so when long reasonings were what it cut, the service refuses again, and the
# later refits cut prompts alone.
MAX_REFITS = 3
REFIT_MARGIN = 0.9
# A batch refused for a batch limit is fitted again at most this many times: once per limit it may pass (each
# refit fits it to every limit known; a limit the service names lowers the client's for good).
MAX_LIMIT_REFITS = len(LIMIT_NAMES)
PATHS = {"batch": "batches", "checkpoint": "checkpoints", "figures": "figures"}  # what each request posts to
COUNTS = {  # each request's Stats counters when accepted and when refused
    "batch": ("sent", "rejected"),
    "checkpoint": ("checkpoints_sent", "checkpoints_rejected"),
    "figures": ("figures_sent", "figures_rejected"),
}


@dataclass(frozen=True)
class Stats:
    """What the monitor has done so far (``Monitor.stats()``)."""

    logged: int = 0  # batches taken by log()
    sent: int = 0  # batches the service accepted, replays included
    replayed: int = 0  # of those, answered as replays of an earlier send (nothing stored twice)
    rejected: int = 0  # refused by the service; kept under <spool>/rejected/ with the reason
    invalid: int = 0  # refused by log() itself (malformed trajectories); see the log
    dropped: int = 0  # lost: no room in memory nor in the spool, or logged after close()
    retries: int = 0  # failed attempts that were retried
    checkpoints_sent: int = 0
    checkpoints_rejected: int = 0
    figures_sent: int = 0  # posts of a step's trainer figures the service accepted (Monitor.figures)
    figures_rejected: int = 0  # of those, refused (kept under <spool>/rejected/ with the reason)
    figures_left_out: int = 0  # figures not sent: not a finite number, a name the service refuses, over the limit
    queued: int = 0  # waiting in memory now
    spooled: int = 0  # waiting on disk now
    spilled: int = 0  # ever written to the spool
    rows_sampled_out: int = 0  # trajectories left out by max_groups / max_rows
    rows_left_out: int = 0  # trajectories left out (whole groups) to fit the service's limits of one batch
    rows_cut: int = 0  # trajectories sent with texts or token lists cut to the service's limits of one batch
    refitted: int = 0  # batches refused (413) for their scoring cost or a batch limit, fitted to it and sent again
    server_warnings: int = 0  # warnings the service attached to accepted batches
    read_errors: int = 0  # alerts() / metrics() / run_info() calls that failed
    alert_polls: int = 0  # answered polls of the on_alert watchers
    alert_poll_errors: int = 0  # their failed polls (retried with backoff)
    alert_events: int = 0  # alert state changes handed to on_alert callbacks
    alert_callback_errors: int = 0  # of those, callbacks that raised (logged)
    last_step_sent: int | None = None
    last_error: str | None = None
    service_reachable: bool | None = None  # None until the first attempt
    run_conflict: str | None = None  # the run existed with other settings; attached to it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class Request:
    """One POST to make: a batch or a checkpoint announcement."""

    kind: str  # "batch" | "checkpoint" | "figures"
    step: int | None
    encode: Callable[[], tuple[str, bytes]] | None = None  # builds (key, body) off the training thread
    body: bytes | None = None
    key: str = ""
    entry: Entry | None = None  # set while the request lives in the spool
    server_errors: int = 0
    run_missing: int = 0
    refits: int = 0  # for the scoring cost
    limit_refits: int = 0  # for a batch limit

    def payload(self, spool: Spool) -> bytes:
        if self.body is None:
            if self.encode is not None:
                self.key, self.body = self.encode()
                self.encode = None
            elif self.entry is not None:
                self.body = spool.read(self.entry)
        assert self.body is not None, "a request has a body, an encoder or a spool entry"
        return self.body

    def describe(self) -> str:
        what = {"checkpoint": "checkpoint announcement", "figures": "figures"}.get(self.kind, "batch")
        return f"{what} of step {self.step}" + (f" ({self.key})" if self.key else "")


@dataclass
class _Counts:
    values: dict[str, Any] = field(default_factory=lambda: Stats().as_dict())

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] += n

    def set(self, name: str, value: Any) -> None:
        self.values[name] = value


@dataclass(eq=False)  # stateful: equal only to itself
class Sender:
    """Delivers requests in order from one background thread; see the module docstring."""

    transport: Transport
    spool: Spool
    run: str
    run_body: bytes
    max_queue: int
    max_spool_bytes: int
    durable: bool
    given_limits: BatchLimits | None = None  # the user's, if any
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0

    def __post_init__(self) -> None:
        # The batch limits in force (replaced whole, never changed in place: the training thread reads them
        # in durable mode): the given or default ones until the service tells its own.
        self.limits = self.given_limits or BatchLimits()
        self.run_ready = False
        self.failure: str | None = None  # the first error a strict monitor must raise
        self._cond = threading.Condition()
        self._spill_lock = threading.Lock()  # one spiller at a time keeps spooled order
        self._memory: deque[Request] = deque()
        self._in_transit = 0  # popped from memory, not yet in the spool
        self._current: Request | None = None  # the spool head being worked on
        self._counts = _Counts()
        self._failures = 0  # consecutive failed attempts
        self._attempts_failed = 0  # all failed attempts, for flush(give_up_when_unreachable)
        self._resume_at = 0.0  # our own backoff: flush() may cut it short
        self._not_before = 0.0  # the service's Retry-After: always honoured
        self._retry_now = False
        self._stop = False
        self._spool_broken = False
        self._thread: threading.Thread | None = None

    # The training thread's side -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"collapse-monitor-{self.run}", daemon=True)
        self._thread.start()

    def submit(self, request: Request, rows: Mapping[str, int] | None = None) -> None:
        """Queues a request; never blocks on the network (spills to disk when the queue is full).

        ``rows``: a batch's row counters to add (``rows_sampled_out``, ``rows_cut``, ``rows_left_out``)."""
        with self._cond:
            if request.kind == "batch":
                self._counts.add("logged")
                for name, n in (rows or {}).items():
                    self._counts.add(name, n)
            if not self.durable and len(self._memory) < self.max_queue:
                self._memory.append(request)
                self._cond.notify_all()
                return
        # Durable mode, or the sender is stuck behind a slow request: the request (and everything
        # queued before it) goes to disk now, on this thread, so memory stays bounded.
        if not self.spill(also=request):
            with self._cond:
                self._counts.add("dropped")
                self._counts.set("last_error", f"dropped the {request.describe()}: queue full, spool unavailable")
            logger.error(
                "collapse-monitor dropped the %s: %d requests wait in memory and the spool at %s cannot take more",
                request.describe(),
                self.max_queue,
                self.spool.folder,
            )

    def spill(self, also: Request | None = None) -> bool:
        """Moves every request queued in memory (then ``also``) to the spool; False if one could not go."""
        with self._spill_lock:
            with self._cond:
                items = list(self._memory)
                self._memory.clear()
                if also is not None:
                    items.append(also)
                self._in_transit += len(items)
            written = 0
            try:
                for request in items:
                    body = request.payload(self.spool)
                    if self.spool.pending_bytes + len(body) > self.max_spool_bytes:
                        raise OSError(f"the spool holds {self.spool.pending_bytes} bytes, its limit")
                    request.entry = self.spool.put(request.kind, request.step, body)
                    written += 1
                self._spool_broken = False
                return True
            except OSError as e:
                if not self._spool_broken:
                    logger.error("collapse-monitor cannot write to its spool at %s: %s", self.spool.folder, e)
                self._spool_broken = True
                with self._cond:
                    unwritten = items[written:] if also is None else items[written:-1]
                    self._memory.extendleft(reversed(unwritten))
                return also is None or written == len(items)
            finally:
                with self._cond:
                    self._in_transit -= len(items)
                    self._counts.add("spilled", written)
                    self._cond.notify_all()

    def flush(self, timeout: float, give_up_when_unreachable: bool = False) -> bool:
        """Waits until everything logged so far is delivered (or refused); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._retry_now = True  # skip the current backoff once: flush means "try now"
            failed_before = self._attempts_failed
            self._cond.notify_all()
            while self._memory or self._in_transit or self.spool.pending:
                if give_up_when_unreachable and self._attempts_failed > failed_before:
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def stop(self, grace_seconds: float) -> None:
        """Stops the thread (after its current request) and spools whatever is still in memory."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(grace_seconds)
        self.spill()

    def stats(self) -> Stats:
        with self._cond:
            values = dict(self._counts.values)
            values["queued"] = len(self._memory) + self._in_transit
        values["spooled"] = self.spool.pending
        return Stats(**values)

    def count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts.add(name, n)

    def note_error(self, message: str) -> None:
        with self._cond:
            self._counts.set("last_error", message)

    # The sender thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            action, request = self._wait_for_work()
            if action == "stop":
                self.transport.close()  # closed by its own thread: never under a request in flight
                return
            try:
                if action == "spill":
                    self.spill()
                elif not self.run_ready:
                    self.create_run()
                else:
                    assert request is not None
                    self._fit_past_body(request)
                    self._settle(request, self.transport.post(self._path(request), request.payload(self.spool)))
            except Exception:  # a bug here must not kill the thread and strand every later batch
                logger.exception("collapse-monitor sender failed; retrying with backoff")
                self._back_off(Outcome("retry", detail="internal error (see the log)"))

    def _wait_for_work(self) -> tuple[str, Request | None]:
        with self._cond:
            while True:
                if self._stop:
                    return "stop", None
                request = self._next_request()
                if request is None:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                wait = max(self._not_before, now if self._retry_now else self._resume_at) - now
                if wait <= 0:
                    self._retry_now = False
                    return "send", request
                if self._memory and not self._spool_broken:
                    return "spill", None
                self._cond.wait(wait)

    def _next_request(self) -> Request | None:
        entry = self.spool.head()
        if entry is not None:
            if self._current is None or self._current.entry != entry:
                self._current = Request(entry.kind, entry.step, entry=entry, key=entry.path.name)
            return self._current
        return self._memory[0] if self._memory else None

    def _path(self, request: Request) -> str:
        return f"/v1/runs/{self.run}/{PATHS[request.kind]}"

    def learn_limits(self, answer: Any) -> None:
        """Puts in force the batch limits of the service's answer to ``POST /v1/runs`` (its ``limits``; an
        older service's answer has none, and the limits in force stay)."""
        told = answer.get("limits") if isinstance(answer, dict) else None
        if not isinstance(told, dict):
            return
        limits = (self.given_limits or BatchLimits()).told(told, is_given=self.given_limits is not None)
        if limits != self.limits:
            logger.info("collapse-monitor: batches are fitted to the service's limits: %s", limits)
        self.limits = limits

    def create_run(self) -> None:
        """Creates (or attaches to) the run, learning the service's limits; on failure backs off (the thread retries).

        Called by the thread before it sends anything, or once before it starts (a durable monitor, which fits each
        batch as it is logged)."""
        outcome = self.transport.post("/v1/runs", self.run_body)
        answer = outcome.answer if isinstance(outcome.answer, dict) else {}
        if outcome.kind == "ok":
            self.learn_limits(answer)
        if outcome.kind == "ok" or answer.get("error") == "run_conflict":
            if outcome.kind != "ok":
                # The run exists with other settings: its batches still belong to it (a resumed
                # trainer), so attach and say so once rather than hold every step back.
                logger.warning(
                    "collapse-monitor: %s; sending to the existing run with its stored settings", outcome.detail
                )
                with self._cond:
                    self._counts.set("run_conflict", outcome.detail)
            self.run_ready = True
            self._on_reachable()
            return
        if outcome.kind == "retry":
            self._back_off(outcome)
            return
        # Settings the service refuses (unknown scorer, bad field): nothing can be sent until an
        # operator fixes it, so keep everything spooled and ask again slowly.
        message = f"the service refused to create run {self.run!r}: {outcome.detail}"
        logger.error("collapse-monitor: %s; batches stay in %s", message, self.spool.folder)
        self._record_failure(message)
        self._back_off(outcome, at_least=60.0)

    def _settle(self, request: Request, outcome: Outcome) -> None:
        if outcome.kind == "ok":
            self._delivered(request, outcome)
        elif outcome.kind == "run_missing" and request.run_missing == 0:
            request.run_missing += 1  # the service lost the run (a new database): create it, then retry
            self.run_ready = False
        elif outcome.kind == "unauthorized":
            # The token is missing, wrong, revoked or not for this run: every later request would be
            # refused the same way, so keep them all spooled (a monitor with a valid token sends them)
            # and ask again slowly, in case an operator fixes the token's scope meanwhile.
            message = f"the service refused the token for the {request.describe()}: {outcome.detail}"
            if self.failure is None:
                logger.error("collapse-monitor: %s; batches stay in %s", message, self.spool.folder)
            self._record_failure(message)
            self._back_off(outcome, at_least=60.0)
        elif request.kind == "batch" and (passed := limit_passed(outcome)) and self._may_refit(request, passed[0]):
            limit, allowed, got = passed
            if limit == "max_scoring_cost":
                self._refit(request, outcome, got, allowed)
            else:
                self._fit_to_limit(request, outcome, limit, allowed, got)
        elif outcome.kind == "retry" and not (outcome.status == 500 and request.server_errors + 1 >= MAX_SERVER_ERRORS):
            if outcome.status == 500:
                request.server_errors += 1
            self._back_off(outcome)
        else:
            self._refused(request, outcome)

    def _may_refit(self, request: Request, limit: str) -> bool:
        if limit == "max_scoring_cost":
            return request.refits < MAX_REFITS
        return limit in LIMIT_NAMES and request.limit_refits < MAX_LIMIT_REFITS

    def _fit_past_body(self, request: Request) -> None:
        """Fits a batch whose body is past the ``max_body_bytes`` in force before it is sent, as a 413 naming it
        would (``_fit_to_limits``), without sending the body first: one written before the service told its
        limits (spooled by an earlier process, or while it was down). The other limits need the body read to
        check, so a body within this one is sent, and fitted to the limit its 413 names."""
        if request.kind != "batch" or request.limit_refits >= MAX_LIMIT_REFITS:
            return
        size = request.entry.size if request.entry is not None else len(request.payload(self.spool))
        if size > self.limits.max_body_bytes:
            why = f"is {size} bytes, past the service's max_body_bytes={self.limits.max_body_bytes}; sent"
            self._fit_to_limits(request, why)  # else sent as it is: the service says why it refuses it

    def _fit_to_limit(self, request: Request, outcome: Outcome, limit: str, allowed: int, got: int) -> None:
        """Fits a batch refused for a batch limit to it (and every other limit in force); it is sent again next.

        The limit stays in force for every later batch. A body this client did not write, or one that fitting
        leaves as it is (nothing left to cut), is refused as it is.
        """
        self.limits = self.limits.told({limit: allowed})
        why = f"was refused by the service: {limit} is {allowed} there, the batch had {got}; sent again"
        if not self._fit_to_limits(request, why):
            self._refused(request, outcome)

    def _fit_to_limits(self, request: Request, why: str) -> bool:
        """Fits a batch to every limit in force (``refit_to_limits``), its spooled copy replaced in place; False for
        a body this client did not write, or one that fitting leaves as it is (nothing left to cut)."""
        described = request.describe()
        request.limit_refits += 1
        body = request.payload(self.spool)
        try:
            request.key, fitted, fit = refit_to_limits(self.run, body, self.limits)
        except (ValueError, KeyError, TypeError) as e:  # not a body this client wrote
            logger.error("collapse-monitor: the %s cannot be fitted to the service's limits: %r", described, e)
            return False
        if fitted == body:
            return False
        if request.entry is not None:
            request.entry = self.spool.replace(request.entry, fitted)  # on disk before the unfitted body is gone
        request.body = fitted
        self.count("refitted")
        self.count("rows_left_out", sum(fit.left_out.values()))
        logger.warning(
            "collapse-monitor: the %s %s as %s, fitted to the service's limits (%s)%s",
            described,
            why,
            request.key,
            ", ".join(f"{name}={getattr(self.limits, name)}" for name in LIMIT_NAMES),
            f"; {fit.describe_left_out()} left out" if fit.left_out else "",
        )
        return True

    def _refit(self, request: Request, outcome: Outcome, cost: int, limit: int) -> None:
        """Cuts a batch refused for its scoring cost to the limit the refusal named; it is sent again next."""
        refused = request.describe()
        keys = PROMPT_KEYS if request.refits else CUT_KEYS
        request.refits += 1
        try:
            request.key, body = refit(self.run, request.payload(self.spool), REFIT_MARGIN * limit / max(cost, 1), keys)
        except (ValueError, KeyError, TypeError) as e:  # not a body this client wrote: refused as it is
            logger.error("collapse-monitor: the %s cannot be refitted: %r", refused, e)
            self._refused(request, outcome)
            return
        if request.entry is not None:
            request.entry = self.spool.replace(request.entry, body)
        request.body = body
        self.count("refitted")
        logger.warning(
            "collapse-monitor: the service refused the %s: its scoring would cost about %d tokens, more than its "
            "max_scoring_cost=%d; sent again as %s, its longest %s cut to %.0f%% of that",
            refused,
            cost,
            limit,
            request.key,
            "prompts" if keys == PROMPT_KEYS else "texts and token ids",
            100 * REFIT_MARGIN,
        )

    def _delivered(self, request: Request, outcome: Outcome) -> None:
        answer = outcome.answer if isinstance(outcome.answer, dict) else {}
        warnings = answer.get("warnings") or []
        for warning in warnings:
            logger.warning("collapse-monitor, %s: %s", request.describe(), warning)
        self._remove(request)
        with self._cond:
            if request.kind != "batch":
                self._counts.add(COUNTS[request.kind][0])
            else:
                self._counts.add("sent")
                self._counts.add("replayed", int(bool(answer.get("replayed"))))
                self._counts.add("server_warnings", len(warnings))
                self._counts.set("last_step_sent", request.step)
            self._cond.notify_all()
        self._on_reachable()

    def _refused(self, request: Request, outcome: Outcome) -> None:
        size = request.entry.size if request.entry is not None else len(request.payload(self.spool))
        reason = {"request": request.describe(), "bytes": size, **outcome.error}
        # A body refused for its size (up to what the client could build) is no use to read back: its reason is.
        keep_body = outcome.status != 413
        if request.entry is not None:
            where = self.spool.reject(request.entry, reason, keep_body)
        else:
            body = request.payload(self.spool) if keep_body else None
            where = self.spool.reject_body(request.kind, request.step, body, reason)
            self._remove(request)
        message = f"the service refused the {request.describe()}: {outcome.detail}"
        logger.error("collapse-monitor: %s; kept in %s", message, where)
        with self._cond:
            self._counts.add(COUNTS[request.kind][1])
            self._counts.set("last_error", message)
            self._cond.notify_all()
        self._record_failure(message)

    def _remove(self, request: Request) -> None:
        if request.entry is not None:
            self.spool.remove(request.entry)
        with self._cond:
            if self._memory and self._memory[0] is request:
                self._memory.popleft()
            if self._current is request:
                self._current = None

    def _back_off(self, outcome: Outcome, at_least: float = 0.0) -> None:
        with self._cond:
            self._failures += 1
            self._attempts_failed += 1
            self._counts.add("retries")
            self._counts.set("last_error", outcome.detail)
            was_reachable = self._counts.values["service_reachable"] is not False
            self._counts.set("service_reachable", False)
            delay = max(at_least, backoff_delay(self._failures, self.backoff_seconds, self.max_backoff_seconds))
            self._resume_at = time.monotonic() + delay
            if outcome.retry_after is not None:
                # The service said when: come back then (plus a little jitter), never earlier.
                delay = outcome.retry_after * random.uniform(1.0, 1.1)
                self._not_before = self._resume_at = time.monotonic() + max(at_least, delay)
            self._cond.notify_all()
        if was_reachable:
            logger.warning(
                "collapse-monitor at %s: %s; keeping batches in %s and retrying with backoff",
                self.transport.url,
                outcome.detail,
                self.spool.folder,
            )
        self.spill()

    def _on_reachable(self) -> None:
        with self._cond:
            recovered = self._counts.values["service_reachable"] is False
            self._counts.set("service_reachable", True)
            self._failures = 0
            self._resume_at = self._not_before = 0.0
        if recovered:
            logger.warning(
                "collapse-monitor at %s reachable again; %d spooled requests to replay",
                self.transport.url,
                self.spool.pending,
            )

    def _record_failure(self, message: str) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = message


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d] for d = min(cap, base * 2^(failures-1)).

    Half the delay is fixed so that retries do not come back sooner than the schedule, and half is
    random so that many trainers cut off by the same outage do not return in lockstep.
    """
    delay = min(cap, base * 2.0 ** max(0, failures - 1))
    return delay / 2 + random.uniform(0, delay / 2)
