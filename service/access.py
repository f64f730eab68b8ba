"""Who may do what: API tokens (issued, hashed, looked up through a short cache) and the access rules.

    ingest  writes runs whose name starts with its run prefix ("" = any run); reads those runs
    read    reads everything (when reads need a token)
    admin   everything, deleting runs included

Writes need a token once any unrevoked token exists; reads and ``/metrics`` only when
``require_token_for_reads`` / ``require_token_for_metrics`` say so. A token is looked up only
when a rule needs one: where nothing is needed, an ``Authorization`` header is ignored.
Must not import fastapi.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from sqlalchemy.orm import Session, sessionmaker

from service.errors import Forbidden, InvalidToken, RevokedToken, Unauthorized
from service.settings import Settings
from service.storage import tokens as stored
from service.storage.tables import ApiToken

Scope = Literal["ingest", "read", "admin"]
SCOPES: tuple[str, ...] = get_args(Scope)
PREFIX = "cm_"  # every token starts with it: recognisable in a leaked log or a secret scanner
HINT_CHARS = 8  # the first characters of a token shown by `tokens list`


@dataclass(frozen=True)
class Token:
    id: int
    scope: str
    run_prefix: str
    name: str | None
    hint: str
    is_revoked: bool

    def may_write(self, run: str) -> bool:
        return self.scope == "admin" or (self.scope == "ingest" and run.startswith(self.run_prefix))


@dataclass(frozen=True)
class IssuedToken:
    token: Token
    secret: str  # shown once; only its digest is stored


def digest(secret: str) -> str:
    """SHA-256 of a token. A fast hash is enough: secrets are 256 random bits, never guessable words."""
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_token(session: Session, scope: str, run_prefix: str = "", name: str | None = None) -> IssuedToken:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if run_prefix and scope != "ingest":
        raise ValueError(f"a run prefix limits ingest tokens only; a {scope} token cannot have one")
    secret = PREFIX + secrets.token_urlsafe(32)
    row = stored.add_token(session, scope, run_prefix, name, digest(secret), secret[:HINT_CHARS])
    return IssuedToken(_detached(row), secret)


def _detached(row: ApiToken) -> Token:
    return Token(row.id, row.scope, row.run_prefix, row.name, row.hint, row.revoked_at is not None)


class TokenCache:
    """Token lookups of the request path, each kept ``ttl_seconds``: a revocation takes effect within it.

    Keyed by digest, never by secret; unknown digests are cached too (at most ``max_entries``,
    least recently used dropped), so a client sending a made-up token costs no query per request.
    """

    def __init__(self, sessions: sessionmaker[Session], ttl_seconds: float, max_entries: int = 10_000) -> None:
        self.sessions = sessions
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._tokens: OrderedDict[str, tuple[float, Token | None]] = OrderedDict()
        self._any_active: tuple[float, bool] | None = None
        self._lock = threading.Lock()

    def any_active(self) -> bool:
        """Whether any unrevoked token exists (then every write needs one)."""
        now = time.monotonic()
        with self._lock:
            if self._any_active is not None and now - self._any_active[0] < self.ttl_seconds:
                return self._any_active[1]
        with self.sessions() as session:
            found = stored.active_token_count(session) > 0
        with self._lock:
            self._any_active = (now, found)
        return found

    def known(self, secret: str) -> bool:
        """Whether ``secret`` was looked up as an issued token (expired entries too; never a query)."""
        with self._lock:
            cached = self._tokens.get(digest(secret))
        return cached is not None and cached[1] is not None

    def lookup(self, secret: str) -> Token | None:
        key = digest(secret)
        now = time.monotonic()
        with self._lock:
            cached = self._tokens.get(key)
            if cached is not None and now - cached[0] < self.ttl_seconds:
                self._tokens.move_to_end(key)
                return cached[1]
        with self.sessions() as session:
            row = stored.token_by_digest(session, key)
            token = _detached(row) if row is not None else None
        with self._lock:
            self._tokens[key] = (now, token)
            self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_entries:
                self._tokens.popitem(last=False)
        return token


class Access:
    """What one request may do, decided from its bearer token (``secret``, None when it sent none)."""

    def __init__(self, cache: TokenCache, secret: str | None, settings: Settings) -> None:
        self.cache = cache
        self.secret = secret
        self.settings = settings

    def write(self, run: str | None, field: str = "run") -> Token | None:
        """A write to ``run`` (None: to some run, checked again once the name is known)."""
        if not self.cache.any_active():
            return None
        token = self.token()
        if token.scope not in ("ingest", "admin"):
            raise Forbidden(
                f"a {token.scope} token may not write; writes need an ingest token (for the run's name prefix) "
                "or an admin token"
            )
        if run is not None and not token.may_write(run):
            raise Forbidden(
                f"this ingest token may write runs whose name starts with {token.run_prefix!r}, not {run!r}",
                field=field,
            )
        return token

    def admin(self, what: str) -> None:
        if not self.cache.any_active():
            return
        token = self.token()
        if token.scope != "admin":
            raise Forbidden(f"{what} needs an admin token, got a {token.scope} token")

    def read(self, runs: Sequence[str] | None) -> None:
        """A read of ``runs``' data (None: of every run; empty: of no run's data, such as the catalogue).

        Read and admin tokens read everything; an ingest token reads the runs it may write.
        """
        if not self.settings.require_token_for_reads:
            return
        token = self.token()
        if token.scope in ("read", "admin") or (runs is not None and all(token.may_write(r) for r in runs)):
            return
        where = "every run" if runs is None else f"run {next(r for r in runs if not token.may_write(r))!r}"
        raise Forbidden(
            f"this {token.scope} token may not read {where}; reads need a read or admin token "
            f"(an ingest token reads the runs starting with its prefix {token.run_prefix!r})"
        )

    def metrics(self) -> None:
        if not self.settings.require_token_for_metrics:
            return
        token = self.token()
        if token.scope not in ("read", "admin"):
            raise Forbidden(f"/metrics needs a read or admin token, got an {token.scope} token")

    def token(self) -> Token:
        """The valid token of this request, or 401."""
        if self.secret is None:
            raise Unauthorized(
                "this request needs an API token: send the header Authorization: Bearer <token> "
                "(an operator creates one with `collapse-monitor tokens create`)"
            )
        token = self.cache.lookup(self.secret)
        if token is None:
            raise InvalidToken("the bearer token is not one this service issued (or it was mistyped)")
        if token.is_revoked:
            raise RevokedToken(f"the bearer token {token.hint}... was revoked; ask an operator for a new one")
        return token


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
