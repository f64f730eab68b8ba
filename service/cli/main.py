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

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from scoring.config import CACHE_DIR, Dtype
from scoring.window import DEFAULT_MAX_REASONING_TOKENS
from service.cli.admin import (
    run_dashboards_push,
    run_demo,
    run_purge,
    run_tokens_create,
    run_tokens_list,
    run_tokens_revoke,
)
from service.cli.flags import Parser, UsageError, database_flags, service_flags
from service.cli.offline import SCORING, run_filter, run_metrics, run_score
from service.cli.server import run_migrate, run_serve, run_worker

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        result = args.command(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result is not None:
        print(json.dumps(result))
    return 0


def build_parser() -> Parser:
    parser = Parser(prog="collapse-monitor", description="Template-collapse diagnostics for agentic RL.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND", parser_class=Parser)

    metrics = commands.add_parser("metrics", help="diagnostics of cross-scoring matrices (JSON)")
    metrics.add_argument("--input", required=True, help="JSON file, or - for stdin")
    metrics.set_defaults(command=run_metrics)

    filt = commands.add_parser("filter", help="SNR-aware filter advice (JSON)")
    filt.add_argument("--input", required=True, help="JSON file, or - for stdin")
    filt.set_defaults(command=run_filter)

    score = commands.add_parser("score", help="score a dumped batch with a model (JSONL rows)")
    score.add_argument("--model", required=True, help="tiny-random, smollm2-135m, a model folder or a .gguf file")
    score.add_argument("--input", required=True, help="JSONL file, one row per line, or - for stdin")
    score.add_argument("--device", default=SCORING.device, help=f"auto, cpu, cuda or cuda:N (default {SCORING.device})")
    score.add_argument("--dtype", default=SCORING.dtype, choices=list(get_args(Dtype)))
    score.add_argument(
        "--temperature",
        type=float,
        default=SCORING.temperature,
        help=f"scoring temperature (default {SCORING.temperature})",
    )
    score.add_argument(
        "--max-batch-tokens", type=int, default=SCORING.max_batch_tokens, help="token budget of every forward"
    )
    score.add_argument(
        "--max-reasoning-tokens",
        type=int,
        default=DEFAULT_MAX_REASONING_TOKENS,
        help=f"reasoning window: longer reasoning is scored on its opening (default {DEFAULT_MAX_REASONING_TOKENS}; "
        "0 scores whole reasonings up to the model's context)",
    )
    score.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="converted GGUF models")
    score.set_defaults(command=run_score)

    serve = commands.add_parser("serve", help="run the HTTP service (settings also from COLLAPSE_MONITOR_* and .env)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    service_flags(serve)
    serve.add_argument("--no-worker", action="store_true", help="do not score in this process")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serve.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="serve a non-loopback --host although no API token exists (anyone reaching the port can write)",
    )
    serve.set_defaults(command=run_serve)

    worker = commands.add_parser("worker", help="run a scoring worker against the shared database")
    service_flags(worker)
    worker.set_defaults(command=run_worker)

    migrate = commands.add_parser("migrate", help="bring the database schema to a revision (default head), then exit")
    migrate.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data folder)")
    migrate.add_argument("--data-dir", type=Path, help="folder of the embedded SQLite database (default ./data)")
    migrate.add_argument("--revision", default="head", help="head (default), base, or a revision id to go back to")
    migrate.set_defaults(command=run_migrate)

    tokens = commands.add_parser("tokens", help="API tokens: create, list, revoke")
    token_commands = tokens.add_subparsers(required=True, metavar="ACTION", parser_class=Parser)
    create = token_commands.add_parser("create", help="create a token and print it (once: only its hash is kept)")
    create.add_argument("--scope", required=True, choices=["ingest", "read", "admin"], help="what it may do")
    create.add_argument(
        "--run-prefix",
        default="",
        help="ingest: the runs it may write: named this, or starting with it and a separator (- _ .); default any",
    )
    create.add_argument("--name", help="who or what holds it (shown by list)")
    database_flags(create)
    create.set_defaults(command=run_tokens_create)
    listing = token_commands.add_parser(
        "list", help="every token, revoked ones included, with the runs it created (never the secrets)"
    )
    database_flags(listing)
    listing.set_defaults(command=run_tokens_list)
    revoke = token_commands.add_parser("revoke", help="revoke a token (API processes notice within seconds)")
    revoke.add_argument("id", type=int, help="the token's id (tokens list)")
    revoke.add_argument(
        "--force", action="store_true", help="revoke the last unrevoked admin token too (then no one can delete runs)"
    )
    database_flags(revoke)
    revoke.set_defaults(command=run_tokens_revoke)

    purge = commands.add_parser("purge", help="purge stored payloads of finished batches older than N days")
    purge.add_argument(
        "--older-than-days", type=float, help="age in days (default: the payload_retention_days setting)"
    )
    database_flags(purge)
    purge.set_defaults(command=run_purge)

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
    demo.set_defaults(command=run_demo)

    dashboards = commands.add_parser("dashboards", help="Grafana dashboards")
    dashboard_commands = dashboards.add_subparsers(required=True, metavar="ACTION", parser_class=Parser)
    push = dashboard_commands.add_parser("push", help="upload the dashboards to a Grafana (needs grafana-client)")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--token", required=True, help="a Grafana service-account token allowed to write dashboards")
    push.add_argument("--folder", type=Path, help="folder of dashboard JSON files (default: the bundled ones)")
    push.add_argument("--folder-title", default="collapse-monitor", help="Grafana folder to put them in")
    push.set_defaults(command=run_dashboards_push)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
