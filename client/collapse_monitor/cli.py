"""The ``collapse-monitor-client`` command line: send dumped rollouts, or follow a trainer's output folder.

    collapse-monitor-client send FILE --run NAME [--url URL] [--step N] [--format F]
        send the batches of one step file: JSONL (batches, trajectories with a step, verl, AReaL,
        ROLL or prime-rl lines), a TRL completion file (.parquet), a slime dump (.pt) or a Trackio
        project (.db, or its name with --format trackio: every step of its rollout traces)
    collapse-monitor-client follow DIR --run NAME [--url URL] [--state FILE] [--once] [--format F]
        send each new step a trainer writes under DIR (formats.py: verl, TRL, prime-rl, AReaL,
        ROLL, slime; DIR a Trackio project .db or, with --format trackio, its name: verl's and TRL's
        rollout traces); --stop-file / --on-alert act on the run's alerts

``--url`` defaults to ``$COLLAPSE_MONITOR_URL`` or http://127.0.0.1:8000, ``--token`` to
``$COLLAPSE_MONITOR_TOKEN``. Batches that cannot be
delivered stay in the spool and are sent by the next command (or monitor) of the same run. The
result is one JSON document on stdout; bad arguments or input exit with 2, undelivered or refused
batches with 1. Progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from collapse_monitor.alerts import STATES
from collapse_monitor.batches import BatchLimits
from collapse_monitor.completion_files import CompletionFileError, MissingExtraError, chat_template_from, parse_weights
from collapse_monitor.dumps import DumpError
from collapse_monitor.follow import AlertHook, Follower, default_state_path
from collapse_monitor.formats import (
    FORMATS,
    PRIME_RL_TRACES,
    Reading,
    StepUnit,
    UntrustedDumpError,
    file_format,
    read_unit,
    step_of_file,
    units,
)
from collapse_monitor.monitor import Monitor
from collapse_monitor.slime_samples import tokenizer_decode
from collapse_monitor.trackio_traces import is_trackio_database, project_database
from collapse_monitor.version import __version__

EXIT_NOT_DELIVERED = 1
EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad arguments or input: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
        result: dict[str, Any]
        code: int
        result, code = args.command(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result))
    return code


def _build_parser() -> _Parser:
    parser = _Parser(prog="collapse-monitor-client", description="Feed a collapse-monitor service.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND", parser_class=_Parser)

    send = commands.add_parser("send", help="send the batches of one step file")
    send.add_argument(
        "file",
        type=Path,
        help="JSONL (batches, trajectories with a step, verl, AReaL, ROLL or prime-rl lines), a TRL "
        "completions_*.parquet or a slime {rollout_id}.pt",
    )
    send.add_argument("--step", type=int, help="step of lines that carry none (default: what the file's place names)")
    send.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for delivery (default 60)")
    send.add_argument(
        "--format", choices=("auto", *FORMATS), default="auto", help="the trainer (default: from the path)"
    )
    _common(send)
    _reading_options(send)
    send.set_defaults(command=_run_send)

    follow = commands.add_parser("follow", help="send each new step a trainer writes under a folder")
    follow.add_argument(
        "folder",
        type=Path,
        help="the trainer's output folder (docs/client.md: your trainer -> what to do); may appear later",
    )
    follow.add_argument(
        "--format", choices=("auto", *FORMATS), default="auto", help="the trainer (default: from the folder's layout)"
    )
    follow.add_argument("--state", type=Path, help="progress file (default: DIR/.collapse-monitor-RUN.state.json)")
    follow.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the folder (default 2)")
    follow.add_argument("--settle", type=float, default=5.0, help="seconds a last file must rest (default 5)")
    follow.add_argument("--once", action="store_true", help="send what is complete now, then exit")
    follow.add_argument(
        "--traces",
        choices=PRIME_RL_TRACES,
        default="train/effective",
        help="prime-rl: which trace files (default train/effective: the episodes each step trained on)",
    )
    alerts = follow.add_argument_group("acting on alerts (the trainer itself cannot be told)")
    alerts.add_argument("--stop-file", type=Path, help="write this file (the alert's description) on an alert")
    alerts.add_argument(
        "--on-alert",
        metavar="COMMAND",
        help="run this shell command on an alert, with COLLAPSE_MONITOR_RULE, _STATE, _STEP, ... set",
    )
    alerts.add_argument(
        "--alert-states", default="firing", help=f"comma-separated among {', '.join(STATES)} (default firing)"
    )
    alerts.add_argument(
        "--alert-rules",
        default="TemplateCollapse",
        help="comma-separated rules that act, or 'all' (default TemplateCollapse)",
    )
    alerts.add_argument(
        "--alert-poll", type=float, default=10.0, help="seconds between looks at the alerts (default 10)"
    )
    _common(follow)
    _reading_options(follow)
    follow.set_defaults(command=_run_follow)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run name")
    parser.add_argument(
        "--url",
        default=os.environ.get("COLLAPSE_MONITOR_URL", "http://127.0.0.1:8000"),
        help="the service (default: $COLLAPSE_MONITOR_URL or http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("COLLAPSE_MONITOR_TOKEN"),
        help="the service's API token (default: $COLLAPSE_MONITOR_TOKEN)",
    )
    parser.add_argument("--settings", help='run settings as JSON, e.g. \'{"schedule": {"every": 5}}\'')
    parser.add_argument("--max-groups", type=int, help="send at most this many prompt groups per step")
    parser.add_argument("--max-rows", type=int, help="send at most this many trajectories per step")
    limits = parser.add_argument_group(
        "batch limits",
        "default: the service's own, told when the run is created (until then its defaults: "
        f"{BatchLimits.max_body_bytes}, {BatchLimits.max_text_chars}, {BatchLimits.max_token_ids}); a limit given "
        "is kept where it is smaller than the service's",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        help="a step is read and sent up to this many bytes a batch, in whole groups",
    )
    limits.add_argument(
        "--max-text-chars",
        type=int,
        help="a prompt keeps at most its last this many characters, a response its first (long agent traces: "
        "see docs/client.md)",
    )
    limits.add_argument(
        "--max-token-ids",
        type=int,
        help="a prompt's token ids keep at most their last this many, a reasoning's (and its log-probs) their first",
    )
    parser.add_argument("--spool-dir", type=Path, help="where undelivered batches wait (default: user cache)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


def _reading_options(parser: argparse.ArgumentParser) -> None:
    reading = parser.add_argument_group("reading the files")
    reading.add_argument(
        "--reward-weights",
        metavar="WEIGHTS",
        help="TRL: the trainer's reward_weights: one per reward column in order (1,0.5) or by name "
        "(accuracy=1,format=0.5, which also picks the columns); default: the plain sum",
    )
    reading.add_argument(
        "--chat-template-from",
        metavar="MODEL_DIR",
        help="TRL, ROLL, prime-rl: render conversational prompts with this model's chat template (needs "
        "transformers); default: plain 'role: text' lines",
    )
    reading.add_argument(
        "--trust-pickle",
        action="store_true",
        help="slime: the folder is trusted; its .pt dumps are pickles, which run code when read (needs torch)",
    )
    reading.add_argument("--reward-key", help="slime: the key of dict rewards (the trainer's --reward-key)")
    reading.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help="slime: the policy's tokenizer, to decode multi-turn samples turn by turn (needs transformers)",
    )


def _reading(args: argparse.Namespace) -> Reading:
    try:
        return Reading(
            reward_weights=parse_weights(args.reward_weights) if args.reward_weights else None,
            render=chat_template_from(args.chat_template_from) if args.chat_template_from else None,
            trust_pickle=args.trust_pickle,
            reward_key=args.reward_key,
            decode=tokenizer_decode(args.tokenizer) if args.tokenizer else None,
            limits=_limits(args) or BatchLimits(),
        )
    except (ValueError, OSError, MissingExtraError) as e:
        raise UsageError(str(e)) from e


def _limits(args: argparse.Namespace) -> BatchLimits | None:
    """The limits given (None: none, the service's are used), the others at their defaults."""
    given = {name: getattr(args, name) for name in ("max_body_bytes", "max_text_chars", "max_token_ids")}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        return BatchLimits(**given) if given else None
    except ValueError as e:
        raise UsageError(str(e)) from e


def _monitor(args: argparse.Namespace) -> Monitor:
    settings: Any = {}
    if args.settings:
        try:
            settings = json.loads(args.settings)
        except json.JSONDecodeError as e:
            raise UsageError(f"--settings: not JSON: {e}") from e
        if not isinstance(settings, dict):
            raise UsageError("--settings: expected a JSON object")
    try:
        return Monitor(
            args.url,
            args.run,
            run_settings=settings,
            max_groups=args.max_groups,
            max_rows=args.max_rows,
            limits=_limits(args),
            spool_dir=args.spool_dir,
            durable=True,  # a batch is on disk before the file that held it counts as sent
            token=args.token,
        )
    except ValueError as e:
        raise UsageError(str(e)) from e


def _run_send(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    reading = _reading(args)
    monitor = _monitor(args)
    reading = replace(reading, limits=monitor.limits)  # the service's, told as the monitor started
    if args.format == "trackio":
        args.file = project_database(str(args.file))
    fmt = file_format(args.file) if args.format == "auto" else args.format
    step = args.step if args.step is not None else step_of_file(args.file, fmt)
    kind = {"trl": "parquet", "slime": "pt"}.get(fmt, "jsonl")
    if not args.file.is_file():  # a FIFO would block the open until a writer comes; a folder cannot be read
        monitor.close(timeout=0)
        raise UsageError(f"{args.file} is not a regular file (a folder, a FIFO, a missing or looping symlink)")
    try:
        if fmt == "trackio":  # a project holds every step: all are sent
            batches = {s: t for unit in units(args.file, fmt) for s, t in read_unit(unit, reading).items()}
        else:
            batches = read_unit(StepUnit(args.file.name, step, (args.file,), kind), reading)
    except OSError as e:
        raise UsageError(f"cannot read {args.file}: {e}") from e
    except (DumpError, CompletionFileError, MissingExtraError, UntrustedDumpError) as e:
        raise UsageError(str(e)) from e
    except (ValueError, RecursionError) as e:  # a reader's own decoding error; nesting past what Python parses
        raise UsageError(f"cannot read {args.file}: {e or type(e).__name__}") from e
    batches = {s: read for s, read in batches.items() if read.trajectories}
    if not batches:
        raise UsageError(f"{args.file}: no batch in it")
    for batch_step, read in batches.items():
        monitor.log(batch_step, read.trajectories, rows_cut=read.n_cut, rows_left_out=read.n_left_out)
    delivered = monitor.close(timeout=args.timeout)
    stats = monitor.stats()
    code = 0 if delivered and not (stats.rejected or stats.invalid or stats.dropped) else EXIT_NOT_DELIVERED
    return {"run": args.run, "steps": list(batches), "delivered": delivered, "stats": stats.as_dict()}, code


def _run_follow(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if args.format == "trackio":
        args.folder = project_database(str(args.folder))
    if args.folder.exists() and not args.folder.is_dir() and not is_trackio_database(args.folder):
        raise UsageError(f"{args.folder} is not a folder")
    if not args.folder.exists():
        logging.getLogger("collapse_monitor").warning(
            "collapse-monitor: %s does not exist yet; waiting for the trainer to create it", args.folder
        )
    reading = _reading(args)
    monitor = _monitor(args)
    try:
        follower = Follower(
            args.folder,
            monitor,
            args.state or default_state_path(args.folder, args.run),
            args.settle,
            reading,
            format=args.format,
            traces=args.traces,
        )
        if args.stop_file is not None or args.on_alert is not None:
            rules = None if args.alert_rules == "all" else [r.strip() for r in args.alert_rules.split(",") if r.strip()]
            states = [s.strip() for s in args.alert_states.split(",") if s.strip()]
            hook = AlertHook(args.run, stop_file=args.stop_file, command=args.on_alert)
            monitor.on_alert(hook, rules=rules, states=states, interval=args.alert_poll)
    except ValueError as e:
        monitor.close(timeout=0)
        raise UsageError(str(e)) from e
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sent = follower.follow(args.poll, once=args.once, stop=stop)
    except (MissingExtraError, UntrustedDumpError) as e:
        monitor.close(timeout=30.0)
        raise UsageError(str(e)) from e
    delivered = monitor.close(timeout=30.0)
    stats = monitor.stats()
    code = 0 if delivered and not (stats.rejected or stats.invalid or stats.dropped) else EXIT_NOT_DELIVERED
    return {"run": args.run, "steps": sent, "delivered": delivered, "stats": stats.as_dict()}, code
