"""slime and miles: every rollout's samples go to collapse-monitor, by one flag and no code.

    --custom-rollout-log-function-path collapse_monitor.integrations.slime.log_rollout

slime (slime/observability/rollout_metrics.py ``log_rollout_data``) and miles
(miles/ray/rollout/metrics.py) call the named function after each rollout with
``(rollout_id, args, samples, rollout_extra_metrics, rollout_time)``, on the rollout manager (one
Ray actor), before the samples become training data. ``log_rollout`` turns the samples into
trajectories (``slime_samples``: groups by ``group_index``, rewards, turns) and queues them on a
monitor as step ``rollout_id``; delivery, retries and spooling happen on the monitor's own thread,
so the rollout loop never waits on the network. It returns False, so the trainer's own rollout
logging still runs.

Configured by environment variables, which must reach the rollout manager's Ray worker (pass them
in the job's runtime environment, ``ray job submit --runtime-env-json '{"env_vars": {...}}'``, or
export them before ``ray start``):

* ``COLLAPSE_MONITOR_URL``: the service (required; without it nothing is sent, which is logged once).
* ``COLLAPSE_MONITOR_RUN``: the run name; default the trainer's ``--wandb-group``, else the name of
  its ``--save`` folder.
* ``COLLAPSE_MONITOR_TOKEN``: an ingest token, when the service has tokens.
* ``COLLAPSE_MONITOR_SETTINGS``: run settings as JSON (``{"schedule": {"every": 5}}``).
* ``COLLAPSE_MONITOR_MAX_GROUPS``, ``COLLAPSE_MONITOR_MAX_ROWS``: send at most this much per rollout
  (default: at most ``MAX_ROWS`` samples, whole prompt groups drawn at random).
* ``COLLAPSE_MONITOR_TOKEN_IDS=1``: send token ids instead of text (a scorer sharing the policy's
  tokenizer). Text is the default; multi-turn samples are decoded with the tokenizer of
  ``--hf-checkpoint``, loaded once.
* ``COLLAPSE_MONITOR_SPOOL_DIR``: where undelivered rollouts wait (default the user's cache).

Rewards are read at ``--reward-key`` when samples carry dict rewards. A rollout that cannot be
read is counted as invalid and logged, never raised into the trainer.

With ``--use-wandb``, the scored figures also go into slime's W&B run, under ``collapse/``
(``collapse/<sampler>/mi_estimate``, ..., the alert states; ``trackers``): a thread polls the
service every ``COLLAPSE_MONITOR_WANDB_POLL_SECONDS`` (default 10), and each ``log_rollout`` call
writes the steps scored since the last one, each in a row of its own plotted against
``collapse/step``: the step slime's own figures of that rollout have (``rollout/step``:
``rollout_id``, or the train step under ``--wandb-always-use-train-step``). Scoring lags the
rollouts, so a rollout's figures arrive with a later rollout's call (the last rollouts' stay in the
service). The run written is the rollout manager's: slime's secondary W&B run
(``init_tracking(args, primary=False)``, slime/ray/rollout.py). ``COLLAPSE_MONITOR_WANDB=0`` turns
this off. While the service is down nothing is fetched or written, and a failed write is logged
once: slime's own logging goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent import futures
from typing import Any

from collapse_monitor.completion_files import MissingExtraError
from collapse_monitor.monitor import Monitor
from collapse_monitor.slime_samples import MAX_SAMPLE_TOKEN_IDS, Decode, field, tokenizer_decode, trajectories
from collapse_monitor.trackers import ScoredFigures, write_wandb

logger = logging.getLogger("collapse_monitor")

# What one rollout sends at most. The service takes at most 4096 trajectories a batch (max_trajectories) and
# scores sampler.num_samples rows of them (64 by default); 4096 rows of whole groups keep those rows spread
# over as many groups as the whole rollout would (64 draws from 512 groups of 8 meet ~60 groups). Drawn
# before anything is read, so a 100,000-sample rollout costs what a 4096-sample one does.
MAX_ROWS = 4096
# The token ids of a rollout's kept turns, shared among its samples (each at most MAX_SAMPLE_TOKEN_IDS): a
# batch of 4M ids is ~24 MB of JSON, within the service's 32 MB max_body_bytes.
ROLLOUT_TOKEN_IDS = 1 << 22

# One monitor (and one tokenizer) per process: slime loads this function anew each rollout, but the
# module, and so these, live as long as the rollout manager.
_monitors: dict[tuple[str, str], Monitor] = {}
_decoders: dict[str, Decode] = {}
_warned: set[str] = set()
# One thread reads every rollout's samples, in order, off the rollout loop; its queue is joined at exit
# before the monitors flush (threading's exit hooks run before atexit's).
_conversions = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="collapse-monitor-slime")
_pending: list[futures.Future[None]] = []
_feeds: dict[tuple[str, str], ScoredFigures] = {}  # the scored figures each run's W&B feed polls


def log_rollout(
    rollout_id: int,
    args: Any,
    samples: Sequence[Any],
    rollout_extra_metrics: Any = None,  # noqa: ARG001  # slime's signature; the service computes its own figures
    rollout_time: float | None = None,  # noqa: ARG001
) -> bool:
    """Queues one rollout's samples on the run's monitor; returns False (the trainer still logs its own metrics).

    Returns at once: reading the samples (and decoding, and serialising) happens on this module's
    conversion thread, in rollout order, since inline it blocked the rollout loop for seconds (100,000
    samples: 5.8 s). Nothing raises into the trainer: an odd argument or sample is counted and logged.
    """
    try:
        monitor = _monitor(args)
        if monitor is None:
            return False
        token_ids = os.environ.get("COLLAPSE_MONITOR_TOKEN_IDS", "").lower() in ("1", "true", "yes")
        # list(): a shallow copy, so a trainer reusing its list does not change what is read later
        work = (monitor, rollout_id, list(samples), getattr(args, "reward_key", None), token_ids, _decoder(args))
        _pending[:] = [future for future in _pending if not future.done()]
        _pending.append(_conversions.submit(_convert, *work))
        if (
            isinstance(rollout_id, int)
            and getattr(args, "use_wandb", False)
            and os.environ.get("COLLAPSE_MONITOR_WANDB", "1") not in ("0", "false")
        ):
            _feed_wandb(monitor, args, rollout_id)
    except Exception:  # the trainer's boundary: whatever slime hands us, its rollout loop goes on
        logger.exception("collapse-monitor: rollout %s not queued", rollout_id)
    return False


def wait_for_conversions(timeout: float | None = None) -> bool:
    """Whether every rollout queued so far has been read and handed to its monitor within ``timeout`` seconds."""
    done, not_done = futures.wait(list(_pending), timeout=timeout)
    for future in done:
        _pending.remove(future)
    return not not_done


def _convert(
    monitor: Monitor, rollout_id: Any, samples: list[Any], reward_key: Any, token_ids: bool, decode: Decode | None
) -> None:
    try:
        # Drawn from group indices alone (slime sets group_index on every sample it generates), then read.
        kept = monitor.sample_indices(rollout_id, [_group(sample) for sample in samples])
        share = min(MAX_SAMPLE_TOKEN_IDS, ROLLOUT_TOKEN_IDS // max(len(kept), 1))
        chosen = [samples[i] for i in kept]
        rows = trajectories(chosen, reward_key=reward_key, token_ids=token_ids, decode=decode, max_token_ids=share)
    except (ValueError, TypeError, AttributeError, OSError, MissingExtraError) as e:
        monitor.invalid(rollout_id, f"cannot read slime's samples: {e}", e)
        return
    except Exception as e:  # odd objects (KeyError, RecursionError, a property that raises): counted, never raised
        monitor.invalid(rollout_id, f"cannot read slime's samples: {type(e).__name__}: {e}", e)
        return
    try:
        if rows:
            monitor.log(rollout_id, rows, rows_sampled_out=len(samples) - len(kept))
        else:
            monitor.invalid(rollout_id, f"none of the {len(samples)} samples holds a model token")
    except Exception as e:  # a strict monitor raises what it counts; here no trainer is there to catch it
        logger.error("collapse-monitor: rollout %s not sent: %s", rollout_id, e)


def _feed_wandb(monitor: Monitor, args: Any, rollout_id: int) -> None:
    """Writes the steps scored since the last rollout into slime's W&B run; the first call starts the polling.

    Written here, on the rollout manager's thread, rather than on the polling thread: W&B's run is
    slime's, which it finishes at its end, and a write from a thread of ours could race that.
    """
    figures = _feeds.get((monitor.url, monitor.run))
    if figures is None:
        seconds = float(os.environ.get("COLLAPSE_MONITOR_WANDB_POLL_SECONDS") or 10.0)
        # A resumed trainer starts past its checkpoint: the steps before were written by the process that made them.
        _feeds[(monitor.url, monitor.run)] = ScoredFigures(monitor, seconds, next_step=rollout_id).start()
        return
    for step, new in figures.take().items():  # in step order
        try:
            write_wandb(_wandb_step(args, step), new)
        except Exception as e:  # W&B's failure must not reach slime, nor fill its log
            _warn_once("wandb", f"collapse-monitor: scored figures not written to W&B ({e}); later failures not logged")


def _wandb_step(args: Any, rollout_id: int) -> int:
    """The W&B step slime gives a rollout's figures (``compute_rollout_step``, slime/observability/metric_utils.py)."""
    if getattr(args, "wandb_always_use_train_step", False):
        return int(rollout_id * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size)
    return rollout_id


def _group(sample: Any) -> Any:
    group = field(sample, "group_index")
    return group if isinstance(group, int) else repr(group)  # only a group's equality matters here


def _monitor(args: Any) -> Monitor | None:
    url = os.environ.get("COLLAPSE_MONITOR_URL")
    if not url:
        _warn_once("url", "collapse-monitor: COLLAPSE_MONITOR_URL is not set for the rollout manager; nothing is sent")
        return None
    run = os.environ.get("COLLAPSE_MONITOR_RUN") or _default_run(args)
    if run is None:
        _warn_once("run", "collapse-monitor: set COLLAPSE_MONITOR_RUN (no --wandb-group or --save to name the run)")
        return None
    monitor = _monitors.get((url, run))
    if monitor is None:
        try:
            settings = json.loads(os.environ.get("COLLAPSE_MONITOR_SETTINGS") or "{}")
            monitor = Monitor(
                url,
                run,
                run_settings=settings,
                max_groups=_positive("COLLAPSE_MONITOR_MAX_GROUPS"),
                max_rows=_positive("COLLAPSE_MONITOR_MAX_ROWS") or MAX_ROWS,
            )
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            _warn_once("config", f"collapse-monitor: cannot start: {e}; nothing is sent")
            return None
        _monitors[(url, run)] = monitor
    return monitor


def _default_run(args: Any) -> str | None:
    for name in (
        getattr(args, "wandb_group", None),
        os.path.basename(str(getattr(args, "save", "") or "").rstrip("/")),
    ):
        if name:
            cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-._")[:128]
            if cleaned:
                return cleaned
    return None


def _decoder(args: Any) -> Decode | None:
    """The policy tokenizer's decoding, loaded on first use (only multi-turn samples need it)."""
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return None
    path = str(path)

    def decode(ids: list[int]) -> str:
        if path not in _decoders:
            _decoders[path] = tokenizer_decode(path)
        return _decoders[path](ids)

    return decode


def _positive(variable: str) -> int | None:
    value = os.environ.get(variable)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{variable} must be a whole number of at least 1, got {value!r}")
    return int(value)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.error(message)
