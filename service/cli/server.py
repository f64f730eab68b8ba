"""Server commands: serve (the HTTP service, with an embedded worker), worker (a scoring process), migrate."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli.flags import UsageError, service_settings


def run_serve(args: argparse.Namespace) -> Any:
    import uvicorn

    from service.app import create_app
    from service.cli.connections import ConnectionLimits, log_once_per_kind

    settings = service_settings(args)
    _configure_logging()
    log_once_per_kind()
    _check_bind(settings)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=args.access_log,
        **ConnectionLimits.of(settings).uvicorn_options(),
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


def run_worker(args: argparse.Namespace) -> Any:
    import logging
    import signal
    import threading

    from service.jobs.interrupts import leave_if_loading
    from service.jobs.scorers import ScorerPool
    from service.jobs.worker import Worker
    from service.runtime import Background
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
    # The worker scores in the foreground; payload retention is the server's (its purger), not this process's.
    with Background(sessions, settings, worker=None, purge=False, join_seconds=30):
        if settings.scoring_paused:  # as the server's embedded worker: up (alerts still go out), scoring nothing
            logging.getLogger("collapse_monitor").warning(
                "scoring is paused (COLLAPSE_MONITOR_SCORING_PAUSED): this worker takes no batch until it is "
                "restarted without it"
            )
            stop.wait()
        else:
            Worker(sessions, settings, ScorerPool(settings)).run(stop)
    engine.dispose()
    leave_if_loading()
    return None


def run_migrate(args: argparse.Namespace) -> Any:
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
