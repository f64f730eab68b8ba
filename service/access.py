"""Who may do what: API tokens (issued, hashed, looked up through a short cache) and the access rules.

    ingest  writes runs its run prefix covers ("" = any run, see ``covers``); reads those runs
    read    reads everything (when reads need a token)
    admin   everything, deleting runs included

Whether writes need a token is configuration (``auth``), never only the contents of the token
table: ``on`` always, ``off`` never, ``auto`` (the default) once a token was ever issued on this
database (a fact kept apart from the tokens, so revoking every token does not reopen writes) or
when the service binds a non-loopback address without ``allow_insecure_bind``. It is decided per
request. Reads and ``/metrics`` need one only when ``require_token_for_reads`` /
``require_token_for_metrics`` say so. A token is looked up only when a rule needs one: where
nothing is needed, an ``Authorization`` header is ignored. Must not import fastapi.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
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
# Where a run prefix may end inside a run name: a prefix covers whole name segments, so that
# `team-a` covers `team-a` and `team-a-grpo` but never `team-admin-x`.
SEPARATORS = "-_./:"
# A prefix is the start of a run name: the run names' own alphabet (service.schemas.inputs.RunName).
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def covers(prefix: str, run: str) -> bool:
    """Whether an ingest token's run ``prefix`` covers ``run``: whole name segments, never a part of one.

    ``""`` covers every run; otherwise the run is the prefix itself, or starts with it where a
    segment ends: the prefix ends with a separator (``team-a-``), or the run continues with one.
    """
    if not prefix:
        return True
    if not run.startswith(prefix):
        return False
    return len(run) == len(prefix) or prefix[-1] in SEPARATORS or run[len(prefix)] in SEPARATORS


def prefix_rule(prefix: str) -> str:
    """The runs ``prefix`` covers, in words for a refusal."""
    if not prefix or prefix[-1] in SEPARATORS:
        return f"whose name starts with {prefix!r}"
    return f"named {prefix!r} or starting with {prefix!r} and a separator ({' '.join(SEPARATORS)})"


def check_run_prefix(scope: str, run_prefix: str) -> None:
    """Refuses a prefix that could never cover a run, or a prefix on a token other than ingest."""
    if run_prefix and scope != "ingest":
        raise ValueError(f"a run prefix limits ingest tokens only; a {scope} token cannot have one")
    if run_prefix and not PREFIX_PATTERN.fullmatch(run_prefix):
        raise ValueError(
            "a run prefix is the start of run names: a letter or digit, then letters, digits, '.', '_' or '-' "
            f"(at most 128 characters), got {run_prefix!r}"
        )


@dataclass(frozen=True)
class Token:
    id: int
    scope: str
    run_prefix: str
    name: str | None
    hint: str
    is_revoked: bool

    def may_write(self, run: str) -> bool:
        return self.scope == "admin" or (self.scope == "ingest" and covers(self.run_prefix, run))


@dataclass(frozen=True)
class IssuedToken:
    token: Token
    secret: str  # shown once; only its digest is stored


def digest(secret: str) -> str:
    """SHA-256 of a token. A fast hash is enough: secrets are 256 random bits, never guessable words."""
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_token(session: Session, scope: str, run_prefix: str = "", name: str | None = None) -> IssuedToken:
    """Issues a token (its secret returned once) and records, for good, that this database issues tokens."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    check_run_prefix(scope, run_prefix)
    secret = PREFIX + secrets.token_urlsafe(32)
    row = stored.add_token(session, scope, run_prefix, name, digest(secret), secret[:HINT_CHARS])
    stored.record_tokens_issued(session)
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
        self._issued: tuple[float, bool] | None = None
        self._lock = threading.Lock()

    def tokens_issued(self) -> bool:
        """Whether a token was ever issued on this database (revoked since or not).

        A yes is kept for good (the fact never goes back); a no is asked again after ``ttl_seconds``,
        so that a token issued by ``collapse-monitor tokens create`` closes writes within that time.
        """
        now = time.monotonic()
        with self._lock:
            if self._issued is not None and (self._issued[1] or now - self._issued[0] < self.ttl_seconds):
                return self._issued[1]
        with self.sessions() as session:
            issued = stored.tokens_were_issued(session)
        with self._lock:
            self._issued = (now, issued)
        return issued

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

    def writes_need_token(self) -> bool:
        """The ``auth`` setting, decided now: ``auto`` is on once a token was issued, or on a non-loopback bind."""
        auth = self.settings.auth
        if auth != "auto":
            return auth == "on"
        if not is_loopback(self.settings.host) and not self.settings.allow_insecure_bind:
            return True
        return self.cache.tokens_issued()

    def write(self, run: str | None, field: str = "run") -> Token | None:
        """A write to ``run`` (None: to some run, checked again once the name is known)."""
        if not self.writes_need_token():
            return None
        token = self.token()
        if token.scope not in ("ingest", "admin"):
            raise Forbidden(
                f"a {token.scope} token may not write; writes need an ingest token (for the run's name prefix) "
                "or an admin token"
            )
        if run is not None and not token.may_write(run):
            raise Forbidden(
                f"this ingest token may write runs {prefix_rule(token.run_prefix)}, not {run!r}", field=field
            )
        return token

    def admin(self, what: str) -> None:
        if not self.writes_need_token():
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
            f"(an ingest token reads the runs {prefix_rule(token.run_prefix)})"
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
