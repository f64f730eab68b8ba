"""The ``collapse-monitor`` command line: a fixed interface that other tools depend on.

    collapse-monitor metrics --input FILE        RAGEN-2 diagnostics of cross-scoring matrices
    collapse-monitor filter  --input FILE        SNR-aware filter advice (RAGEN's rollout filter)
    collapse-monitor score   --model M --input FILE.jsonl
                                                 score a dumped batch: metrics, breakdown and L
    collapse-monitor serve   [--host H] [--port P] [--database-url URL] [--scorer NAME_OR_PATH] [--threads N]
                                                 the HTTP service (with an embedded worker)
    collapse-monitor worker  [--database-url URL] [--threads N]
                                                 a scoring worker process sharing the database
    collapse-monitor migrate [--database-url URL] [--revision REV]
                                                 bring the database schema to REV (default head), then exit
    collapse-monitor tokens  create --scope ingest|read|admin [--run-prefix P] [--name N] | list | revoke ID [--force]
                                                 API tokens (create prints the secret once)
    collapse-monitor purge   [--older-than-days N] [--database-url URL]
                                                 purge stored payloads of finished batches older than N days
    collapse-monitor demo    [--url URL] [--steps N] [--token TOKEN]
                                                 feed a running server a simulated run that collapses
    collapse-monitor dashboards push --url URL --token TOKEN
                                                 upload the Grafana dashboards

FILE may be ``-`` for stdin. Results go to stdout as one JSON document. Bad input exits with
code 2 and one line on stderr naming the field and what was wrong; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from scoring.config import Dtype, ScoringConfig
from service.errors import field_path
from service.schemas import (
    FilterRequest,
    FilterResponse,
    InputError,
    MatrixInput,
    MatrixSteps,
    SamplerResult,
    ScoreRowIn,
)

EXIT_BAD_INPUT = 2
_SCORING = ScoringConfig()  # the scoring defaults the `score` flags show
DEFAULT_CACHE_DIR = Path("~/.cache/collapse-monitor").expanduser()
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class UsageError(Exception):
    """Bad input or arguments: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        result = args.command(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result is not None:
        print(json.dumps(result))
    return 0


def _build_parser() -> _Parser:
    parser = _Parser(prog="collapse-monitor", description="Template-collapse diagnostics for agentic RL.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND", parser_class=_Parser)

    metrics = commands.add_parser("metrics", help="diagnostics of cross-scoring matrices (JSON)")
    metrics.add_argument("--input", required=True, help="JSON file, or - for stdin")
    metrics.set_defaults(command=_run_metrics)

    filt = commands.add_parser("filter", help="SNR-aware filter advice (JSON)")
    filt.add_argument("--input", required=True, help="JSON file, or - for stdin")
    filt.set_defaults(command=_run_filter)

    score = commands.add_parser("score", help="score a dumped batch with a model (JSONL rows)")
    score.add_argument("--model", required=True, help="tiny-random, smollm2-135m, a model folder or a .gguf file")
    score.add_argument("--input", required=True, help="JSONL file, one row per line, or - for stdin")
    score.add_argument(
        "--device", default=_SCORING.device, help=f"auto, cpu, cuda or cuda:N (default {_SCORING.device})"
    )
    score.add_argument("--dtype", default=_SCORING.dtype, choices=list(get_args(Dtype)))
    score.add_argument(
        "--temperature",
        type=float,
        default=_SCORING.temperature,
        help=f"scoring temperature (default {_SCORING.temperature})",
    )
    score.add_argument(
        "--max-batch-tokens", type=int, default=_SCORING.max_batch_tokens, help="token budget of every forward"
    )
    score.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="converted GGUF models")
    score.set_defaults(command=_run_score)

    serve = commands.add_parser("serve", help="run the HTTP service (settings also from COLLAPSE_MONITOR_* and .env)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    _service_flags(serve)
    serve.add_argument("--no-worker", action="store_true", help="do not score in this process")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serve.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="serve a non-loopback --host although no API token exists (anyone reaching the port can write)",
    )
    serve.set_defaults(command=_run_serve)

    worker = commands.add_parser("worker", help="run a scoring worker against the shared database")
    _service_flags(worker)
    worker.set_defaults(command=_run_worker)

    migrate = commands.add_parser("migrate", help="bring the database schema to a revision (default head), then exit")
    migrate.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data folder)")
    migrate.add_argument("--data-dir", type=Path, help="folder of the embedded SQLite database (default ./data)")
    migrate.add_argument("--revision", default="head", help="head (default), base, or a revision id to go back to")
    migrate.set_defaults(command=_run_migrate)

    tokens = commands.add_parser("tokens", help="API tokens: create, list, revoke")
    token_commands = tokens.add_subparsers(required=True, metavar="ACTION", parser_class=_Parser)
    create = token_commands.add_parser("create", help="create a token and print it (once: only its hash is kept)")
    create.add_argument("--scope", required=True, choices=["ingest", "read", "admin"], help="what it may do")
    create.add_argument(
        "--run-prefix",
        default="",
        help="ingest: the runs it may write: named this, or starting with it and a separator (- _ .); default any",
    )
    create.add_argument("--name", help="who or what holds it (shown by list)")
    _database_flags(create)
    create.set_defaults(command=_run_tokens_create)
    listing = token_commands.add_parser(
        "list", help="every token, revoked ones included, with the runs it created (never the secrets)"
    )
    _database_flags(listing)
    listing.set_defaults(command=_run_tokens_list)
    revoke = token_commands.add_parser("revoke", help="revoke a token (API processes notice within seconds)")
    revoke.add_argument("id", type=int, help="the token's id (tokens list)")
    revoke.add_argument(
        "--force", action="store_true", help="revoke the last unrevoked admin token too (then no one can delete runs)"
    )
    _database_flags(revoke)
    revoke.set_defaults(command=_run_tokens_revoke)

    purge = commands.add_parser("purge", help="purge stored payloads of finished batches older than N days")
    purge.add_argument(
        "--older-than-days", type=float, help="age in days (default: the payload_retention_days setting)"
    )
    _database_flags(purge)
    purge.set_defaults(command=_run_purge)

    demo = commands.add_parser("demo", help="feed a running server a simulated RL run that falls into collapse")
    demo.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    demo.add_argument("--run", default="demo-sokoban", help="run name (default demo-sokoban)")
    demo.add_argument("--steps", type=int, default=24, help="training steps to send (default 24)")
    demo.add_argument("--collapse-start", type=int, default=10, help="step where collapse sets in (default 10)")
    demo.add_argument(
        "--token",
        default=os.environ.get("COLLAPSE_MONITOR_TOKEN"),
        help="an API token that may write the run, once the server has tokens (default: $COLLAPSE_MONITOR_TOKEN)",
    )
    demo.set_defaults(command=_run_demo)

    dashboards = commands.add_parser("dashboards", help="Grafana dashboards")
    dashboard_commands = dashboards.add_subparsers(required=True, metavar="ACTION", parser_class=_Parser)
    push = dashboard_commands.add_parser("push", help="upload the dashboards to a Grafana (needs grafana-client)")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--token", required=True, help="a Grafana service-account token allowed to write dashboards")
    push.add_argument("--folder", type=Path, help="folder of dashboard JSON files (default: the bundled ones)")
    push.add_argument("--folder-title", default="collapse-monitor", help="Grafana folder to put them in")
    push.set_defaults(command=_run_dashboards_push)
    return parser


def _run_dashboards_push(args: argparse.Namespace) -> Any:
    try:
        from service.dashboards import DASHBOARDS_DIR, DashboardPushError, push_dashboards
    except ImportError as e:
        raise UsageError(f"dashboards push needs grafana-client: pip install 'collapse-monitor[grafana]' ({e})") from e
    try:
        return push_dashboards(args.url, args.token, args.folder or DASHBOARDS_DIR, args.folder_title)
    except DashboardPushError as e:
        raise UsageError(f"dashboards push: {e}") from e


def _run_demo(args: argparse.Namespace) -> Any:
    from service.demo import run_demo

    try:
        run_demo(args.url.rstrip("/"), args.run, args.steps, args.collapse_start, report=print, token=args.token)
    except (OSError, RuntimeError) as e:
        raise UsageError(f"demo: {e}") from e
    return None


def _database_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data folder)")
    parser.add_argument("--data-dir", type=Path, help="folder of the embedded SQLite database (default ./data)")


@contextmanager
def _sessions(args: argparse.Namespace) -> Iterator[Any]:
    """Sessions of the database the flags and settings name, migrated first when auto_migrate is on."""
    from service.storage.database import make_engine, make_sessions, migrate

    settings = service_settings(args)
    if settings.auto_migrate:
        migrate(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    try:
        yield make_sessions(engine)
    finally:
        engine.dispose()


def _token_document(token: Any) -> dict[str, Any]:
    from service.storage.tables import iso_time

    return {
        "id": token.id,
        "name": token.name,
        "scope": token.scope,
        "run_prefix": token.run_prefix,
        "hint": token.hint,
        "created_at": iso_time(token.created_at),
        "revoked_at": iso_time(token.revoked_at),
    }


def _run_tokens_create(args: argparse.Namespace) -> Any:
    from service.access import check_run_prefix, issue_token

    if args.run_prefix and args.scope != "ingest":
        raise UsageError(f"--run-prefix: only ingest tokens are limited to a run prefix, not {args.scope} tokens")
    try:
        check_run_prefix(args.scope, args.run_prefix)
    except ValueError as e:
        raise UsageError(f"--run-prefix: {e}") from e
    with _sessions(args) as sessions, sessions.begin() as session:
        issued = issue_token(session, args.scope, args.run_prefix, args.name)
    print("Keep this token now: it is not shown again (only its hash is stored).", file=sys.stderr)
    if args.scope == "ingest" and not args.run_prefix:
        print(
            "warning: this ingest token may write every run (no --run-prefix); give each trainer a token for its "
            "own runs (--run-prefix team-a) unless one trainer owns the whole service",
            file=sys.stderr,
        )
    return {
        "id": issued.token.id,
        "name": issued.token.name,
        "scope": issued.token.scope,
        "run_prefix": issued.token.run_prefix,
        "token": issued.secret,
    }


def _run_tokens_list(args: argparse.Namespace) -> Any:
    from service.storage import tokens

    with _sessions(args) as sessions, sessions() as session:
        return [
            {**_token_document(t), "runs_created": tokens.runs_created_by(session, t.id)}
            for t in tokens.list_tokens(session)
        ]


def _run_tokens_revoke(args: argparse.Namespace) -> Any:
    from service.storage import tokens

    settings = service_settings(args)
    with _sessions(args) as sessions, sessions.begin() as session:
        if tokens.is_last_admin(session, args.id) and not args.force:
            raise UsageError(
                f"tokens revoke: token {args.id} is the last unrevoked admin token: without one no one can delete "
                "runs through the API; create its successor first (collapse-monitor tokens create --scope admin), "
                "or pass --force"
            )
        token = tokens.revoke_token(session, args.id)
        if token is None:
            raise UsageError(f"tokens revoke: no token has id {args.id} (see `collapse-monitor tokens list`)")
        document = _token_document(token)
        left = tokens.active_token_count(session)
    if left == 0 and settings.auth != "off":
        print(
            "warning: no unrevoked token is left: writes stay refused (auth keeps needing a token once one was "
            "issued) until a new token is created with `collapse-monitor tokens create`",
            file=sys.stderr,
        )
    return document


def _run_purge(args: argparse.Namespace) -> Any:
    from service.jobs.retention import purge

    settings = service_settings(args)
    days = args.older_than_days if args.older_than_days is not None else settings.payload_retention_days
    if days is None:
        raise UsageError("purge: give --older-than-days N, or set payload_retention_days")
    if days < 0:
        raise UsageError(f"--older-than-days must be at least 0, got {days:g}")
    with _sessions(args) as sessions:
        purged = purge(sessions, days)
    return {"batches": purged.batches, "matrices": purged.matrices, "created_before": purged.before.isoformat()}


def _service_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data folder)")
    parser.add_argument(
        "--scorer",
        help="default scorer: a named scorer, a built-in model, a model folder or a .gguf file (default smollm2-135m)",
    )
    parser.add_argument("--data-dir", type=Path, help="folder of the embedded SQLite database (default ./data)")
    parser.add_argument(
        "--threads", type=int, help="CPU threads for scoring (default: one per core; cap it next to a trainer)"
    )


def service_settings(args: argparse.Namespace) -> Any:
    """Settings from the environment and .env, with the flags given on the command line on top."""
    from service.settings import Settings

    overrides: dict[str, Any] = {}
    for flag in ("host", "port", "database_url", "data_dir", "threads"):
        if getattr(args, flag, None) is not None:
            overrides[flag] = getattr(args, flag)
    if getattr(args, "no_worker", False):
        overrides["embedded_worker"] = False
    if getattr(args, "allow_insecure_bind", False):
        overrides["allow_insecure_bind"] = True
    try:
        settings = Settings(**overrides)
        scorer = getattr(args, "scorer", None)
        if scorer is not None:
            scorers = dict(settings.scorers)
            scorers.setdefault(scorer, scorer)
            settings = Settings(**overrides, scorers=scorers, default_scorer=scorer)
    except ValidationError as e:
        raise UsageError(f"settings: {format_validation_error(e)}") from e
    return settings


def _run_serve(args: argparse.Namespace) -> Any:
    import uvicorn

    from service.app import create_app

    settings = service_settings(args)
    _configure_logging()
    _check_bind(settings)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_config=None, access_log=args.access_log
    )
    return None


def _check_bind(settings: Any) -> None:
    """Refuses a non-loopback address while no API token exists or with auth off, unless the operator said it
    is fine. Whether a request needs a token is decided again per request (service.access)."""
    import logging

    from sqlalchemy.exc import SQLAlchemyError

    from service.access import is_loopback
    from service.storage import tokens
    from service.storage.database import make_engine, make_sessions, migrate

    if is_loopback(settings.host):
        return
    if settings.auth == "off":
        if not settings.allow_insecure_bind:
            raise UsageError(
                f"--host {settings.host} is not a loopback address and auth is off, so anyone who reaches the port "
                "could write into any run; set auth to auto or on, or pass --allow-insecure-bind on a network you trust"
            )
        logging.getLogger("collapse_monitor").warning(
            "serving %s with auth off (--allow-insecure-bind): anyone who reaches the port can write", settings.host
        )
        return
    url = settings.resolved_database_url
    try:
        if settings.auto_migrate:
            migrate(url)
        engine = make_engine(url)
        with make_sessions(engine)() as session:
            active = tokens.active_token_count(session)
        engine.dispose()
    except SQLAlchemyError as e:
        raise UsageError(f"--host {settings.host}: cannot count the API tokens in the database: {e}") from e
    if active:
        return
    if settings.allow_insecure_bind:
        logging.getLogger("collapse_monitor").warning(
            "serving %s without any API token (--allow-insecure-bind): anyone who reaches the port can write",
            settings.host,
        )
        return
    raise UsageError(
        f"--host {settings.host} is not a loopback address and no API token exists, so anyone who reaches the "
        "port could write into any run and read it; create a token first (collapse-monitor tokens create "
        "--scope admin), or pass --allow-insecure-bind (COLLAPSE_MONITOR_ALLOW_INSECURE_BIND=true) on a "
        "network you trust"
    )


def _run_worker(args: argparse.Namespace) -> Any:
    import signal
    import threading

    import httpx

    from service.alerts.dispatcher import Dispatcher
    from service.background import start_in_thread
    from service.jobs.interrupts import leave_if_loading
    from service.jobs.scorers import ScorerPool
    from service.jobs.worker import Worker
    from service.storage.database import make_engine, make_sessions, migrate

    settings = service_settings(args)
    if settings.is_sqlite:
        raise UsageError(
            "--database-url: a separate worker needs Postgres; with SQLite the server's embedded worker scores"
        )
    _configure_logging()
    if settings.auto_migrate:
        migrate(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url, **settings.database_timeouts)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sessions = make_sessions(engine)
    with httpx.Client() as http:
        dispatcher, dispatcher_stop = start_in_thread(
            Dispatcher(sessions, settings, http).run, "collapse-monitor-alerts"
        )
        Worker(sessions, settings, ScorerPool(settings)).run(stop)
        dispatcher_stop.set()
        dispatcher.join(timeout=30)
    engine.dispose()
    leave_if_loading()
    return None


def _run_migrate(args: argparse.Namespace) -> Any:
    from alembic.util import CommandError

    from service.storage.database import current_revision, migrate

    url = service_settings(args).resolved_database_url
    before = current_revision(url)
    try:
        migrate(url, args.revision)
    except CommandError as e:
        raise UsageError(f"--revision: {e}") from e
    return {"from_revision": before, "revision": current_revision(url)}


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _read(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--input: cannot read {path!r}: {e.strerror}") from e


def _parse_json(text: str, where: str = "input") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e


def _validate(model: type[M], data: Any, where: str = "") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"{where}{format_validation_error(e)}") from e


def format_validation_error(error: ValidationError) -> str:
    """All of pydantic's errors on one line, each as ``path: message`` (``steps[1].L_seq[2]: ...``)."""
    return "; ".join(f"{field_path(item['loc']) or 'input'}: {item['msg']}" for item in error.errors())


def _guard(action: Callable[[], T], prefix: str = "") -> T:
    """Turns the scoring package's input errors into one-line usage errors."""
    try:
        return action()
    except InputError as e:
        raise UsageError(f"{prefix}{e}") from e
    except ValueError as e:  # BatchError, MatrixError, ScoringError, ModelLoadError are ValueErrors
        raise UsageError(f"{prefix}{e}") from e


def _run_metrics(args: argparse.Namespace) -> Any:
    from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics

    data = _parse_json(_read(args.input))
    steps = _validate(MatrixSteps, data).steps if isinstance(data, dict) and "steps" in data else None
    inputs = steps if steps is not None else [_validate(MatrixInput, data)]
    ema = EmaState()
    results = []
    for i, step in enumerate(inputs):
        prefix = f"steps[{i}]." if steps is not None else ""
        L_tok, L_seq, cols = _guard(step.arrays, prefix)
        config = EstimatorConfig(std_eps=step.config.std_eps, ema_decay=step.config.ema_decay, bootstrap_samples=0)
        diagnostics, ema = compute_diagnostics(L_tok, L_seq, cols, step.column_prompt_tokens, ema, config)
        if diagnostics.skipped_reason:
            print(f"note: {prefix}{diagnostics.skipped_reason}", file=sys.stderr)
        results.append(diagnostics.metrics)
    return results if steps is not None else results[0]


def _run_filter(args: argparse.Namespace) -> Any:
    from scoring.snr_filter import filter_groups

    request = _validate(FilterRequest, _parse_json(_read(args.input)))
    return FilterResponse(**vars(filter_groups(request.rewards, request.filter_config()))).model_dump(mode="json")


def _run_score(args: argparse.Namespace) -> Any:
    from scoring import ScoringBatch, load_scorer, score_batch
    from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats

    rows = []
    for number, line in enumerate(_read(args.input).splitlines(), start=1):
        if line.strip():
            rows.append((number, _validate(ScoreRowIn, _parse_json(line, f"line {number}"), f"line {number}: ")))
    if not rows:
        raise UsageError("--input: no rows (expected one JSON object per line)")
    config: ScoringConfig = _guard(
        lambda: ScoringConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            temperature=args.temperature,
            max_batch_tokens=args.max_batch_tokens,
        ),
        "--",
    )
    scorer = _guard(lambda: load_scorer(config, args.cache_dir), "--model: ")
    kept, prompts, reasonings, groups, dropped = [], [], [], [], []
    for number, row in rows:
        x, z = _guard(partial(_turn_ids, scorer.encode, row), f"line {number}: ")
        if not z:
            dropped.append(number)  # RAGEN never scores empty reasoning
            continue
        kept.append(number)
        prompts.append(x)
        reasonings.append(z)
        groups.append(row.group_id)
    if not kept:
        raise UsageError("--input: every row has empty reasoning; nothing to score")
    batch = _guard(lambda: ScoringBatch.from_rows(prompts, reasonings, groups))
    scores = _guard(lambda: score_batch(scorer, batch, config))
    diagnostics, _ = compute_diagnostics(
        scores.L_tok,
        scores.L_seq,
        batch.column_of_row,
        batch.column_prompts,
        EmaState(),
        EstimatorConfig(),
        batch.column_group_ids,
    )
    result = SamplerResult.of(diagnostics, batch.n_rows, batch.n_columns, token_entropy_stats(scores.token_entropy))
    return {
        "model": args.model,
        **result.model_dump(mode="json"),
        "line_of_row": kept,
        "dropped_empty_reasoning_lines": dropped,
        "column_group_ids": list(batch.column_group_ids),
        "reasoning_lengths": scores.reasoning_lengths.tolist(),
        "L_seq": scores.L_seq.tolist(),
        "L_tok": scores.L_tok.tolist(),
    }


def _turn_ids(encode: Callable[[str], tuple[int, ...]], row: ScoreRowIn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from scoring.partition import turn_token_ids

    return turn_token_ids(
        encode,
        prompt=row.prompt,
        prompt_ids=row.prompt_token_ids,
        response=row.response,
        reasoning=row.reasoning,
        reasoning_ids=row.reasoning_token_ids,
    )


if __name__ == "__main__":
    raise SystemExit(main())
