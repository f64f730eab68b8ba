"""Admin commands: API tokens, purging payloads, the demo run, pushing the Grafana dashboards."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.cli.flags import UsageError, service_settings


def run_dashboards_push(args: argparse.Namespace) -> Any:
    try:
        from service.cli.dashboards import DASHBOARDS_DIR, DashboardPushError, push_dashboards
    except ImportError as e:
        raise UsageError(f"dashboards push needs grafana-client: pip install 'collapse-monitor[grafana]' ({e})") from e
    try:
        return push_dashboards(args.url, args.token, args.folder or DASHBOARDS_DIR, args.folder_title)
    except DashboardPushError as e:
        raise UsageError(f"dashboards push: {e}") from e


def run_demo(args: argparse.Namespace) -> Any:
    from service.cli.demo import run_demo

    try:
        run_demo(args.url.rstrip("/"), args.run, args.steps, args.collapse_start, report=print, token=args.token)
    except (OSError, RuntimeError) as e:
        raise UsageError(f"demo: {e}") from e
    return None


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


def run_tokens_create(args: argparse.Namespace) -> Any:
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


def run_tokens_list(args: argparse.Namespace) -> Any:
    from service.storage import tokens

    with _sessions(args) as sessions, sessions() as session:
        return [
            {**_token_document(t), "runs_created": tokens.runs_created_by(session, t.id)}
            for t in tokens.list_tokens(session)
        ]


def run_tokens_revoke(args: argparse.Namespace) -> Any:
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


def run_purge(args: argparse.Namespace) -> Any:
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
