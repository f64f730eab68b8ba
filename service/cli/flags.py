"""What the commands share: the usage error, the parser raising it, database and service flags, their Settings."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from service.errors import field_path


class UsageError(Exception):
    """Bad input or arguments: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def database_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data folder)")
    parser.add_argument("--data-dir", type=Path, help="folder of the embedded SQLite database (default ./data)")


def service_flags(parser: argparse.ArgumentParser) -> None:
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


def format_validation_error(error: ValidationError) -> str:
    """All of pydantic's errors on one line, each as ``path: message`` (``steps[1].L_seq[2]: ...``)."""
    return "; ".join(f"{field_path(item['loc']) or 'input'}: {item['msg']}" for item in error.errors())
