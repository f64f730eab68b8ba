"""The Monitor: the one object a training loop holds.

``log()`` normalises and samples the trajectories and queues them: it never waits on the network.
A background thread (``sender.py``) creates the run, delivers batches in order, retries and
spools; the disk spool (``spool.py``) keeps batches across outages and restarts. By default
nothing here raises into the training loop: failures are logged (logger ``collapse_monitor``) and
counted in ``stats()``; ``strict=True`` raises instead. Must not import the integrations, torch
or numpy.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import operator
import os
import re
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from collapse_monitor.alerts import STATES, AlertActions, AlertEvent, AlertWatcher, check_filters
from collapse_monitor.batches import (
    BatchLimits,
    TrajectoryError,
    encode,
    normalize,
    sample_indices,
    sendable_figures,
)
from collapse_monitor.sender import Request, Sender, Stats
from collapse_monitor.spool import Spool
from collapse_monitor.transport import Transport

logger = logging.getLogger("collapse_monitor")

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class MonitorError(Exception):
    """A strict monitor's failure: the service refused or could not be reached in time."""


def default_spool_dir() -> Path:
    """``$COLLAPSE_MONITOR_SPOOL_DIR``, else ``$XDG_CACHE_HOME/collapse-monitor/spool`` (``~/.cache``)."""
    configured = os.environ.get("COLLAPSE_MONITOR_SPOOL_DIR")
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "collapse-monitor" / "spool"


class Monitor:
    """Sends one run's rollouts to a collapse-monitor service without slowing the training loop.

    Example:
        >>> monitor = Monitor("http://127.0.0.1:8000", "grpo-math-3", schedule={"every": 5})
        >>> monitor.log(step, [{"group_id": g, "reward": r, "prompt": p, "response": c}, ...])
        >>> monitor.close()  # also done at interpreter exit

    Args:
        url: The service, e.g. ``http://127.0.0.1:8000``.
        run: The run name (letters, digits, ``._-``; at most 128). Logging again under an existing
            name attaches to that run (a resumed trainer).
        project, metadata, schedule, sampler, scorer, scorer_mode, temperature, filter, alerts: Run
            settings, as ``POST /v1/runs`` takes them (docs/api.md); only those given are sent.
        run_settings: Further run settings, sent as given: fields newer than this client work too.
        max_groups: Send at most this many prompt groups per step (drawn with ``seed``).
        max_rows: Send at most this many trajectories per step, keeping whole groups.
        limits: Batch limits to fit each step to (``BatchLimits``), kept where smaller than the service's.
            Default: the service's own, told when the run is created (its defaults until it answers); a
            batch refused for one it did not tell (413 naming it) is fitted to it and sent again. A step
            past them is sent as the whole groups that fit, the others left out (and counted).
        seed: Seed of the client-side draw; the same step always keeps the same rows.
        spool_dir: Where batches wait while the service is unreachable; this run uses
            ``spool_dir/run``. Default: ``default_spool_dir()``.
        max_queue: Batches held in memory before they go to the spool.
        max_spool_bytes: Disk the spool may use; beyond it new batches are dropped (and counted).
        durable: Write every batch to the spool before ``log()`` returns (command-line tools). The run is
            created at once (one try, then in the background), so batches are fitted to the limits it tells.
        strict: Raise ``MonitorError`` (and ``TrajectoryError`` from ``log()``) instead of logging.
        enabled: A disabled monitor does nothing: pass ``is_main_process`` on multi-process trainers.
        timeout: Seconds per HTTP request.
        exit_timeout: At interpreter exit, how long to wait for delivery before leaving the rest in
            the spool for the next start (not waited when the service is unreachable).
        headers: Extra HTTP headers (for example an authorization header of a proxy).
        token: The service's API token (``collapse-monitor tokens create``), sent as
            ``Authorization: Bearer``; default ``$COLLAPSE_MONITOR_TOKEN``. An ingest token writes
            (and reads) the runs whose names start with its prefix. A refused token (401/403) keeps
            the batches in the spool, for the next monitor of the run with a valid token.
    """

    def __init__(
        self,
        url: str,
        run: str,
        *,
        project: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        schedule: Mapping[str, Any] | None = None,
        sampler: Mapping[str, Any] | None = None,
        scorer: str | None = None,
        scorer_mode: str | None = None,
        temperature: float | None = None,
        filter: Mapping[str, Any] | None = None,
        alerts: Mapping[str, Any] | None = None,
        run_settings: Mapping[str, Any] | None = None,
        max_groups: int | None = None,
        max_rows: int | None = None,
        limits: BatchLimits | None = None,
        seed: int = 0,
        spool_dir: str | os.PathLike[str] | None = None,
        max_queue: int = 64,
        max_spool_bytes: int = 1 << 30,
        durable: bool = False,
        strict: bool = False,
        enabled: bool = True,
        timeout: float = 30.0,
        exit_timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
    ) -> None:
        if not RUN_NAME.match(run):
            raise ValueError(f"run must match {RUN_NAME.pattern} (at most 128 characters), got {run!r}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        for name, value in (("max_groups", max_groups), ("max_rows", max_rows)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {value}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        given = {
            "project": project,
            "metadata": dict(metadata) if metadata is not None else None,
            "schedule": dict(schedule) if schedule is not None else None,
            "sampler": dict(sampler) if sampler is not None else None,
            "scorer": scorer,
            "scorer_mode": scorer_mode,
            "temperature": temperature,
            "filter": dict(filter) if filter is not None else None,
            "alerts": dict(alerts) if alerts is not None else None,
        }
        self.url = url.rstrip("/")
        self.run = run
        self.run_settings: dict[str, Any] = {
            "name": run,
            **{k: v for k, v in given.items() if v is not None},
            **dict(run_settings or {}),
        }
        self.max_groups = max_groups
        self.max_rows = max_rows
        self.seed = seed
        self.strict = strict
        self.enabled = enabled
        self.exit_timeout = exit_timeout
        self.spool_folder = Path(spool_dir if spool_dir is not None else default_spool_dir()).expanduser() / run
        self._timeout = timeout
        token = token if token is not None else os.environ.get("COLLAPSE_MONITOR_TOKEN") or None
        self._headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **dict(headers or {})}
        self._sender = Sender(
            Transport(self.url, timeout, self._headers),
            Spool(self.spool_folder),
            run,
            json.dumps(self.run_settings).encode(),
            max_queue=max_queue,
            max_spool_bytes=max_spool_bytes,
            durable=durable,
            given_limits=limits,
        )
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._pid = os.getpid()
        self._warned: set[str] = set()
        self._watcher: AlertWatcher | None = None  # the one alert subscription: every on_alert reads it
        self._actions: AlertActions | None = None
        self._last_step: int | None = None
        self._exit_hook = functools.partial(_close_at_exit, self)
        # Strict: a run the service refuses raises here. Durable: batches are fitted as they are logged, and files
        # read to the limits the service tells (``limits``), so the run is created (the limits told) first.
        if (strict or durable) and enabled:
            try:
                self._start()
            except MonitorError:
                self._sender.transport.close()  # the caller never gets this monitor to close
                raise

    def __repr__(self) -> str:
        return f"Monitor(url={self.url!r}, run={self.run!r})"

    @property
    def limits(self) -> BatchLimits:
        """The batch limits each step is fitted to now: the service's once it told them (the smaller of each
        where ``limits`` were given), else those given or the defaults."""
        return self._sender.limits

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Sending --------------------------------------------------------------------------------

    def log(
        self,
        step: int,
        trajectories: Sequence[Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
        figures: Mapping[str, Any] | None = None,
        rows_sampled_out: int = 0,
        rows_cut: int = 0,
        rows_left_out: int = 0,
    ) -> None:
        """Queues one training step's trajectories; returns at once.

        See ``collapse_monitor.batches.normalize`` for the trajectory format. ``idempotency_key``
        overrides the content-derived idempotency key (rarely needed). ``figures``: numbers the
        trainer computed for this step (its SNR filter's, say), stored as series of sampler
        ``trainer``; see ``figures()`` for those known only after the step. ``rows_sampled_out``:
        rows the caller left out by its own draw (``sample_indices``) before reading them, counted
        with those ``log`` leaves out (``stats().rows_sampled_out``). ``rows_cut``, ``rows_left_out``: rows the
        caller cut or left out to fit the service's limits before logging them (a reader of step files,
        ``formats.Step``), counted with those ``log`` cuts or leaves out (``stats().rows_cut``, ``rows_left_out``).
        """
        if not self._is_active("log"):
            return
        self._raise_failure()
        try:
            step = _step(step)
            rows = normalize(trajectories)
        except TrajectoryError as e:
            self.invalid(step, str(e), e)
            return
        self._last_step = step
        kept = sample_indices(
            [r["group_id"] for r in rows], max_groups=self.max_groups, max_rows=self.max_rows, seed=self.seed, step=step
        )
        left_out = len(rows) - len(kept)
        if left_out:
            rows = [rows[i] for i in kept]
        sendable = self._sendable(step, figures or {})
        self._start().submit(
            Request("batch", step, encode=functools.partial(self._encode, step, rows, idempotency_key, sendable)),
            {"rows_sampled_out": left_out + rows_sampled_out, "rows_cut": rows_cut, "rows_left_out": rows_left_out},
        )

    def _encode(
        self, step: int, rows: list[dict[str, Any]], idempotency_key: str | None, figures: Mapping[str, float]
    ) -> tuple[str, bytes]:
        """A batch's key and body, fitted to the service's limits (on the sender's thread; durable: the caller's)."""
        limits = self.limits
        key, body, fit = encode(self.run, step, rows, idempotency_key, figures, limits)
        if fit.n_cut:
            self._sender.count("rows_cut", fit.n_cut)
            logger.warning(
                "collapse-monitor: step %d: %d trajectories sent with their texts or token ids cut to the service's "
                "limits (%d characters a text, %d ids a list, a trajectory within one batch of %d bytes)",
                step,
                fit.n_cut,
                limits.max_text_chars,
                limits.max_token_ids,
                limits.max_body_bytes,
            )
        if fit.left_out:
            self._sender.count("rows_left_out", sum(fit.left_out.values()))
            logger.warning(
                "collapse-monitor: step %d: %s left out to fit the service's limits of one batch (%d bytes, %d "
                "trajectories); a step is scored as one batch, so they are not sent",
                step,
                fit.describe_left_out(),
                limits.max_body_bytes,
                limits.max_trajectories,
            )
        return key, body

    def figures(self, step: int, figures: Mapping[str, Any]) -> None:
        """Queues figures of a step whose batch was logged already; returns at once.

        For what a trainer knows only after the step (TRL and verl log losses and the policy's
        entropy once the step's batch is gone): stored beside that step's batch as series of
        sampler ``trainer`` (``GET /v1/runs/{run}/metrics?sampler=trainer``), in order with the
        batches. Figures the service would refuse (not a finite number, a name it does not take,
        past 256) are left out, counted in ``stats().figures_left_out`` and logged once per name.
        """
        if not self._is_active("figures"):
            return
        self._raise_failure()
        try:
            step = _step(step)
        except TrajectoryError as e:
            self.invalid(step, str(e), e)
            return
        sendable = self._sendable(step, figures)
        if sendable:
            body = json.dumps({"step": step, "figures": sendable}, allow_nan=False).encode()
            self._start().submit(Request("figures", step, body=body))

    def _sendable(self, step: int, figures: Mapping[str, Any]) -> dict[str, float]:
        kept, left_out = sendable_figures(figures)
        if left_out:
            self._sender.count("figures_left_out", len(left_out))
            for name, reason in left_out.items():
                self._warn_once(
                    f"figure-{name}", f"collapse-monitor: figure {name!r} of step {step} not sent: {reason}"
                )
        return kept

    def invalid(self, step: Any, reason: str, error: Exception | None = None) -> None:
        """Records a batch that could not be built (integrations): counted, logged; raised when strict."""
        self._sender.count("invalid")
        self._sender.note_error(f"step {step}: {reason}")
        if self.strict:
            if error is not None:
                raise error
            raise TrajectoryError(reason)
        logger.error("collapse-monitor ignored the batch of step %s: %s", step, reason)

    def sample_indices(self, step: int, group_ids: Sequence[Any]) -> list[int]:
        """The rows ``log()`` would keep at ``step`` for these group ids (integrations pick before decoding)."""
        return sample_indices(group_ids, max_groups=self.max_groups, max_rows=self.max_rows, seed=self.seed, step=step)

    def checkpoint(self, path: str | os.PathLike[str], *, step: int | None = None, kind: str = "full") -> None:
        """Announces a saved policy checkpoint (``kind`` ``full`` or ``lora``), in order with the batches.

        Batches logged afterwards are scored with it when the run's ``scorer_mode`` is ``policy``.
        The path must be readable by the service, under its ``checkpoint_root``.
        """
        if not self._is_active("checkpoint"):
            return
        self._raise_failure()
        step = None if step is None else _step(step)
        body = json.dumps({"path": os.path.abspath(os.fspath(path)), "kind": kind, "step": step}).encode()
        self._start().submit(Request("checkpoint", step, body=body))

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until everything logged so far is delivered or refused; False when time ran out.

        Retries at once even while backing off. A strict monitor raises ``MonitorError`` instead of
        returning False, and when a batch was refused.
        """
        if not self._is_active("flush", warn=False):
            stats = self._sender.stats()
            return stats.queued == 0 and stats.spooled == 0
        delivered = self._start().flush(timeout)
        self._raise_failure()
        if not delivered and self.strict:
            raise MonitorError(self._undelivered_message(timeout))
        return delivered

    def close(self, timeout: float = 30.0) -> bool:
        """Flushes for at most ``timeout`` seconds, then stops; what is left stays in the spool.

        Batches left in the spool are sent by the next monitor of this run (also after a restart).
        Returns whether everything was delivered. Idempotent; also called at interpreter exit.
        """
        return self._close(timeout, at_exit=False)

    def _close(self, timeout: float, at_exit: bool) -> bool:
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return True
            self._closed = True
        atexit.unregister(self._exit_hook)
        if self._watcher is not None:
            self._watcher.stop(grace_seconds=0.5)
        delivered = True
        if self._started:
            delivered = self._sender.flush(timeout, give_up_when_unreachable=at_exit)
            self._sender.stop(grace_seconds=1.0)
            if not delivered:
                logger.warning("collapse-monitor: %s", self._undelivered_message(timeout))
        if self.strict and not at_exit:
            self._raise_failure()
            if not delivered:
                raise MonitorError(self._undelivered_message(timeout))
        return delivered

    def stats(self) -> Stats:
        """Counts of what was logged, sent, replayed, refused, spooled and dropped (see ``Stats``)."""
        return self._sender.stats()

    # Acting on alerts -----------------------------------------------------------------------

    def on_alert(
        self,
        callback: Callable[[AlertEvent], object],
        *,
        rules: Iterable[str] | None = None,
        states: Iterable[str] = ("pending", "firing"),
        interval: float = 10.0,
    ) -> AlertWatcher | None:
        """Calls ``callback(event)`` from a background thread once per new state change of the run's alerts.

        The monitor's one alert watcher, started by the first call, polls the run's alerts every
        ``interval`` seconds (the shortest asked; ``GET /v1/runs/{run}/alerts``, with backoff while the
        service is unreachable); each state change of a rule in ``rules`` (None: every rule) into one of
        ``states`` (pending, firing, resolved, dropped) is delivered once, as an ``AlertEvent``, also
        across outages. Alerts open at the callback's first poll are delivered once (``is_open_at_start``
        when they began before this monitor delivered a batch: a restarted job); closed ones are not.
        Never blocks ``log()``; callbacks run in turn on the watcher's thread, and one that raises is
        logged and counted (``stats().alert_callback_errors``). Stopped by ``close()`` (or the returned
        watcher's ``stop()``, which ends every callback's). Returns None, starting nothing, on a disabled
        monitor or in a forked process. See ``collapse_monitor.alerts``.
        """
        wanted_rules, wanted_states = check_filters(rules, states)
        if not wanted_states:
            raise ValueError(f"states must name at least one of {', '.join(STATES)}")
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval}")
        if not self._is_active("on_alert"):
            return None
        with self._lock:
            if self._closed:
                return None
            watcher, is_new = self._watcher, self._watcher is None
            if watcher is None:
                watcher = self._watcher = AlertWatcher(
                    Transport(self.url, self._timeout, self._headers),
                    self.run,
                    interval=interval,
                    count=self._sender.count,
                    has_delivered=lambda: self._sender.stats().sent > 0,
                )
                if not self._started:
                    atexit.register(
                        self._exit_hook
                    )  # close() stops the watcher; _start() registers it again harmlessly
            watcher.interval = min(watcher.interval, interval)
            watcher.subscribe(callback, wanted_rules, wanted_states)
        if is_new:
            watcher.start()
        return watcher

    def act_on_alerts(
        self,
        *,
        save_on: Collection[str] = ("pending",),
        stop_on: Collection[str] = ("firing",),
        rules: Iterable[str] | None = ("TemplateCollapse",),
        interval: float = 10.0,
    ) -> AlertActions:
        """Says which alerts ``should_save()`` and ``should_stop()`` answer for, and starts watching them.

        Optional: the first ``should_stop()`` or ``should_save()`` starts watching with these
        defaults (TemplateCollapse: save when it becomes pending, stop when it fires). Returns the
        ``AlertActions`` (its ``history`` holds every decision); called again with other settings,
        raises ValueError.
        """
        actions = AlertActions(save_on=save_on, stop_on=stop_on, rules=rules)
        with self._lock:
            if self._actions is not None:
                same = (self._actions.rules, self._actions.save_on, self._actions.stop_on)
                if same != (actions.rules, actions.save_on, actions.stop_on):
                    raise ValueError("this monitor already acts on other alerts; call act_on_alerts() once, first")
                return self._actions
            self._actions = actions
        if actions.states:
            self.on_alert(actions, rules=actions.rules, states=actions.states, interval=interval)
        return actions

    def should_stop(self, step: int | None = None) -> bool:
        """Whether an alert asked the training loop to stop (default: TemplateCollapse fired); stays asked.

        For loops without callbacks (verl's ``RayPPOTrainer.fit``), next to ``log_batch``::

            is_last_step = is_last_step or monitor.should_stop()

        Reads what the background watcher queued: never a network call, a few microseconds. The
        first call starts the watcher (``act_on_alerts`` sets what it watches), so an alert becomes
        visible within its poll interval of being scored. ``step`` (default: the last step logged)
        goes into the log line that records the decision. A disabled monitor never asks.
        """
        return self.act_on_alerts().should_stop(self._step_now(step))

    def should_save(self, step: int | None = None) -> bool:
        """Whether an alert asked for a checkpoint (default: TemplateCollapse became pending) since the last True."""
        return self.act_on_alerts().should_save(self._step_now(step))

    def _step_now(self, step: int | None) -> int:
        if step is not None:
            return step
        return self._last_step if self._last_step is not None else -1

    # Reading back ---------------------------------------------------------------------------

    def alerts(self, *, state: str | None = None, rule: str | None = None) -> list[dict[str, Any]]:
        """The run's alerts, oldest first (``state``: pending, firing or resolved)."""
        answer = self._read(f"/v1/runs/{self.run}/alerts", {"state": state, "rule": rule})
        return answer if isinstance(answer, list) else []

    def metrics(
        self,
        names: Sequence[str] | None = None,
        *,
        sampler: str | None = None,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> list[dict[str, Any]]:
        """Stored metric points ``{step, sampler, name, value, ...}`` of the run, ordered by step."""
        params = {
            "names": ",".join(names) if names else None,
            "sampler": sampler,
            "from_step": from_step,
            "to_step": to_step,
        }
        answer = self._read(f"/v1/runs/{self.run}/metrics", params)
        return list(answer.get("points", [])) if isinstance(answer, dict) else []

    def run_info(self) -> dict[str, Any]:
        """The run as the service holds it: settings, last step, batches per status."""
        answer = self._read(f"/v1/runs/{self.run}", {})
        return answer if isinstance(answer, dict) else {}

    # Internals ------------------------------------------------------------------------------

    def _start(self) -> Sender:
        with self._lock:
            if self._started:
                return self._sender
            try:
                self._sender.spool.open()
            except OSError as e:
                if self.strict:
                    raise MonitorError(f"cannot open the spool at {self.spool_folder}: {e}") from e
                logger.error("collapse-monitor cannot open its spool at %s: %s", self.spool_folder, e)
            if self.strict:
                self._create_run_now()
            elif self._sender.durable:
                self._sender.create_run()  # one try: the sender thread tries again, after its backoff
            pending = self._sender.spool.pending
            if pending:
                logger.warning(
                    "collapse-monitor: %d requests spooled by an earlier process in %s will be sent first",
                    pending,
                    self.spool_folder,
                )
            self._sender.start()
            atexit.register(self._exit_hook)
            self._started = True
            return self._sender

    def _create_run_now(self) -> None:
        outcome = self._sender.transport.post("/v1/runs", self._sender.run_body)
        if outcome.kind != "ok":
            raise MonitorError(f"cannot create run {self.run!r} at {self.url}: {outcome.detail}")
        self._sender.learn_limits(outcome.answer)
        self._sender.run_ready = True

    def _is_active(self, what: str, warn: bool = True) -> bool:
        if not self.enabled:
            return False
        if os.getpid() != self._pid:
            self._warn_once("fork", "collapse-monitor: a forked process cannot use its parent's monitor; ignored")
            return False
        if self._closed:
            if warn:
                self._warn_once(f"closed-{what}", f"collapse-monitor: {what}() after close() is ignored")
                if what == "log":
                    self._sender.count("dropped")
            return False
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def _raise_failure(self) -> None:
        if self.strict and self._sender.failure is not None:
            failure, self._sender.failure = self._sender.failure, None
            raise MonitorError(failure)

    def _undelivered_message(self, timeout: float) -> str:
        stats = self._sender.stats()
        return (
            f"{stats.queued + stats.spooled} requests not delivered after {timeout:g}s; they stay in "
            f"{self.spool_folder} and are sent by the next monitor of run {self.run!r}"
        )

    def _read(self, path: str, params: dict[str, Any]) -> Any:
        # A connection per read: reads are rare, and nothing is left open for a monitor never closed.
        reader = Transport(self.url, self._timeout, self._headers)
        try:
            return reader.get(path, params)
        except (httpx.HTTPError, ValueError) as e:
            self._sender.count("read_errors")
            if self.strict:
                raise MonitorError(f"GET {path} failed: {e}") from e
            logger.warning("collapse-monitor: GET %s failed: %s", path, e)
            return None
        finally:
            reader.close()


def _step(step: Any) -> int:
    try:
        value = operator.index(step)
    except TypeError as e:
        raise TrajectoryError(f"step must be an integer, got {step!r}") from e
    if value < 0:
        raise TrajectoryError(f"step must be at least 0, got {value}")
    return value


def _close_at_exit(monitor: Monitor) -> None:
    try:
        monitor._close(monitor.exit_timeout, at_exit=True)
    except Exception:  # at exit, a failure to deliver must not turn into a crash report
        logger.exception("collapse-monitor: closing at exit failed")
