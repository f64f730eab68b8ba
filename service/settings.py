"""Settings: the one place the environment (prefix ``COLLAPSE_MONITOR_``) and ``.env`` are read.

Every ``collapse-monitor serve`` / ``worker`` flag maps to a field here; ``create_app(settings)``
and the worker take a built ``Settings`` and never read the environment themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scoring.config import CACHE_DIR, ScoringConfig
from scoring.dependence import DEFAULT_HEAD_TOKENS
from scoring.window import DEFAULT_MAX_REASONING_TOKENS

# The embedded CPU scorer's step budget (docs/scoring.md, Budget, for the measurement behind it).
DEFAULT_SCORING_BUDGET_SECONDS = 60.0

_SCORING = ScoringConfig()  # scoring's defaults; the settings reuse them
WILDCARD_BINDS = ("0.0.0.0", "::", "")  # every interface: clients reach it under names it cannot know
VLLM_SCHEMES = ("vllm+http", "vllm+https")


@dataclass(frozen=True)
class VllmEndpoint:
    """Where a vLLM scorer is served, parsed from its ``Settings.scorers`` value.

    Attributes:
        url: the server's base URL (``http://host:port``), the API under ``/v1``.
        model: the served model name (``--served-model-name``).
        tokenizer: a model name ``scoring.models.load_model`` takes, whose tokenizer is the served model's;
            checked against the server's ``/tokenize`` at load.
        dtype: the precision the server was started with (``--dtype``), recorded with every scored batch.
    """

    url: str
    model: str
    tokenizer: str
    dtype: str

    @classmethod
    def parse(cls, spec: str) -> VllmEndpoint | None:
        """The endpoint ``spec`` names, or None when ``spec`` is not a vLLM scorer (a model for our kernel)."""
        parts = urlsplit(spec)
        if parts.scheme not in VLLM_SCHEMES:
            return None
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        missing = [key for key in ("model", "tokenizer") if not query.get(key)]
        if missing or not parts.netloc:
            raise ValueError(
                f"a vLLM scorer must be vllm+http://host:port?model=<served name>&tokenizer=<model>[&dtype=<dtype>], "
                f"got {spec!r} (missing: {', '.join(missing) or 'host'})"
            )
        unknown = sorted(set(query) - {"model", "tokenizer", "dtype"})
        if unknown:
            raise ValueError(f"a vLLM scorer takes model, tokenizer and dtype, got {', '.join(unknown)} in {spec!r}")
        base = f"{parts.scheme.removeprefix('vllm+')}://{parts.netloc}{parts.path.rstrip('/')}"
        return cls(url=base, model=query["model"], tokenizer=query["tokenizer"], dtype=query.get("dtype", "auto"))


# A request of max_batch_tokens (8k) prompt tokens answers ~1 MB; 64x that is room, not a 1 GB answer held whole.
VLLM_MAX_ANSWER_BYTES = 64 * 2**20


@dataclass(frozen=True)
class VllmClientSettings:
    """How requests are sent: at most ``concurrency`` at a time, each of at most ``request_tokens`` prompt
    tokens, given ``timeout_seconds`` in all and ``max_answer_bytes`` of answer, tried ``retries`` more
    times when the server does not answer."""

    timeout_seconds: float
    concurrency: int
    retries: int
    request_tokens: int
    max_answer_bytes: int = VLLM_MAX_ANSWER_BYTES


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COLLAPSE_MONITOR_", env_file=".env", extra="forbid")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server binds.")
    data_dir: Path = Field(Path("data"), description="Folder of the embedded SQLite database.")
    database_url: str = Field(
        "",
        description="SQLAlchemy URL; empty means SQLite at <data_dir>/collapse-monitor.db. "
        "Production: postgresql+psycopg://user@host/db.",
    )
    auto_migrate: bool = Field(True, description="Apply database migrations at startup.")
    database_connect_timeout_seconds: int = Field(
        3,
        ge=2,
        description="Postgres: longest wait for a new connection, and for a free pooled one (libpq counts whole "
        "seconds, at least 2). Past it the API answers 503 database_unavailable with Retry-After.",
    )
    database_statement_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Longest one statement may run (Postgres statement_timeout; the client stops waiting for a "
        "hung server a second later) or wait for another writer's lock (SQLite busy timeout). Past it: 503.",
    )

    default_scorer: str = Field("smollm2-135m", description="Scorer of runs that name none.")
    scorers: dict[str, str] = Field(
        default_factory=lambda: {"smollm2-135m": "smollm2-135m", "tiny-random": "tiny-random"},
        description="Named scorers: name -> built-in model, local model folder or .gguf file (scored by our kernel "
        "in this process), or a vLLM server: vllm+http://host:port?model=<served name>&tokenizer=<model>&dtype=<dtype> "
        "(docs/deploy.md, Scoring backends). Clients pick a name, never a path.",
    )
    vllm_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="vLLM scorers: the whole time one request may take, connecting to the last byte of its answer "
        "(a total deadline, not a per-read one: an answer dripped a byte at a time fails at it), before it is tried "
        "again.",
    )
    vllm_max_answer_bytes: int = Field(
        VLLM_MAX_ANSWER_BYTES,
        ge=2**16,
        description="vLLM scorers: the largest answer read, as sent and once decompressed; a larger one is refused "
        "before it is read further (a request of max_batch_tokens prompt tokens answers ~100 bytes a token).",
    )
    vllm_concurrency: int = Field(
        4,
        ge=1,
        description="vLLM scorers: requests in flight at once per scoring worker (each up to max_batch_tokens).",
    )
    vllm_retries: int = Field(
        3,
        ge=0,
        description="vLLM scorers: tries after the first of a request the server does not answer (refused, timed out, "
        "5xx); then the batch goes back to the queue, uncounted, the worker claims none of the scorer's batches "
        "until a probe (GET /v1/models) finds the server answering, and scores it then.",
    )
    scorer_outage_seconds: float = Field(
        600.0,
        gt=0,
        description="vLLM scorers: how long a scorer's server may stay down (as the worker that found it down "
        "measures, from its first failed request) before the batches waiting for it fail with its last error; "
        "until then they wait, so a server restart of a few minutes fails nothing. While it stays down past "
        "this, its runs' new batches fail at once, until a probe finds it answering.",
    )
    checkpoint_root: Path | None = Field(
        None, description="Policy checkpoints announced by trainers must lie under this folder; none when unset."
    )
    cache_dir: Path = Field(CACHE_DIR, description="Converted GGUF models are cached here.")
    device: str = Field(_SCORING.device, description="auto (CUDA when present), cpu, cuda or cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Scorer precision.")
    max_batch_tokens: int = Field(_SCORING.max_batch_tokens, ge=1, description="Token budget of every scoring forward.")
    max_loaded_scorers: int = Field(2, ge=1, description="Scorers (base models and checkpoints) kept in memory.")
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads of the scoring process (torch.set_num_threads); default: torch's, one per core. "
        "Next to a trainer on the same machine, cap it: at the default the scorer doubled a TRL step's time.",
    )

    embedded_worker: bool = Field(True, description="Score batches in a thread of the server process.")
    worker_poll_seconds: float = Field(0.5, gt=0, description="Idle wait between queue polls.")
    lease_seconds: float = Field(
        60.0, gt=0, description="A claimed batch whose worker stops renewing this lease is scored again."
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Scorings of a batch interrupted by a worker's crash before the batch is marked failed (a "
        "shutdown, a database outage or a scorer's server that does not answer does not count: "
        "scorer_outage_seconds bounds that; a batch that cannot be scored fails at once).",
    )
    max_scoring_seconds: float = Field(
        600.0,
        gt=0,
        description="Scoring time limit of one batch, counted from its claim (a model load included): past it the "
        "batch is stopped at its next layer and marked failed with a reason naming this limit, and the worker goes "
        "on with the next batch.",
    )
    worker_name: str = Field(
        "",
        max_length=80,
        pattern=r"^[^#]*$",
        description="A worker's name, kept across restarts so that a restarted worker re-claims at once the "
        "batch it was scoring; must differ between living workers. Empty: <host>:<slot>, the lowest slot free "
        "under <data_dir>/worker-slots (workers of one host sharing a data folder never collide).",
    )
    scoring_paused: bool = Field(
        False,
        description="Accept batches but score none (maintenance, benchmarks): no embedded worker; a `worker` "
        "process stays up and takes no batch.",
    )

    max_exported_series: int = Field(
        20_000,
        ge=1,
        description="Diagnostic series one /metrics scrape exports at most (whole runs, the most recently updated "
        "first); the rest is counted in collapse_monitor_series_dropped.",
    )
    metrics_cache_seconds: float = Field(
        5.0,
        ge=0,
        description="How long one /metrics snapshot (aggregates over whole tables) is served before the database is "
        "read again; concurrent scrapes share one read. Prometheus scrapes every 15 s. 0 reads at every scrape.",
    )
    rate_limit_per_second: float = Field(
        50.0,
        ge=0,
        description="Requests per second one client (its issued token, else its address) may send, on every path but "
        "/healthz and /readyz (/metrics counts in a bucket of its own); beyond it 429 with Retry-After. 0 turns the "
        "limit off.",
    )
    rate_limit_burst: int = Field(200, ge=1, description="Requests a client may send at once above that rate.")
    max_queue_depth: int = Field(1000, ge=1, description="Queued batches (all runs) beyond which ingest answers 503.")
    max_queued_per_run: int = Field(
        200,
        ge=1,
        description="Queued batches of one run beyond which its ingest answers 429, so that one run cannot fill "
        "the queue everyone shares.",
    )
    max_queued_per_token: int = Field(
        500,
        ge=1,
        description="Queued batches of the runs one token created beyond which their ingest answers 429, so that "
        "one token cannot fill the queue through many runs (workers also take turns across tokens before runs). "
        "Runs created without a token (open mode) share only max_queue_depth.",
    )
    max_scoring_cost: int = Field(
        16_000_000,
        ge=1,
        description="Largest scoring cost of one batch, in tokens a naive scorer would run (rows x columns x "
        "tokens per pair, summed over the run's samplers; text counted at 3 characters a token); beyond it "
        "ingest answers 413. A GPU scorer can take more.",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted; the server holds a body and its parsed form at once (a 27 MB "
        "batch of token ids peaked at ~7x its size; max_parsing_bytes bounds several at once).",
    )
    max_parsing_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Request body bytes read and parsed at once, all requests together (a body counts from its "
        "first byte, by its Content-Length, else as max_body_bytes): parsing holds up to ~9x a body's "
        "size, so this bounds what concurrent large bodies hold. A body past it waits up to 20 s for its turn, "
        "then answers 503 parsing_busy with Retry-After; one larger than this is parsed alone.",
    )
    head_tokens: int = Field(
        DEFAULT_HEAD_TOKENS,
        ge=1,
        description="Head budget k of the length-robust signals (mi_head_estimate, mi_head_excess, "
        "conditional_entropy_head_est): input dependence measured on each reasoning's first k tokens only, so "
        "text appended after an answer cannot move it. Free: the kernel sums these log-probs in the same pass.",
    )
    max_reasoning_tokens: int = Field(
        DEFAULT_MAX_REASONING_TOKENS,
        ge=0,
        description="Reasoning window: a longer reasoning is scored on its first this many tokens (its opening, "
        "written in answer to the prompt), and a prompt that still does not fit the scorer's context keeps its "
        "last tokens; what was cut is reported per sampler (truncated_reasoning_ratio). Cost grows with it "
        "linearly (docs/scoring.md, Windows); 0 scores whole reasonings up to the scorer's context.",
    )

    scoring_budget_seconds: float = Field(
        DEFAULT_SCORING_BUDGET_SECONDS,
        ge=0,
        description="Kernel seconds a scheduled step may take, all its samplers together (a run may set its own: "
        "schedule.budget_seconds). The worker predicts each sampler's seconds from its scorer's measured tokens "
        "per second and, past the budget, scores fewer rows, then a shorter reasoning window, never below their "
        "floors (docs/scoring.md, Budget); what it planned is in each sampler's `plan`. Never fails a step, unlike "
        "max_scoring_seconds. 0: no budget.",
    )

    max_trajectories: int = Field(4096, ge=1, description="Trajectories per batch.")
    max_turns: int = Field(256, ge=1, description="Turns per trajectory.")
    max_text_chars: int = Field(400_000, ge=1, description="Characters per prompt or response text.")
    max_token_ids: int = Field(65536, ge=1, description="Token ids per prompt or reasoning.")
    max_matrix_cells: int = Field(4_000_000, ge=1, description="R x N cells of an uploaded matrix.")
    max_matrix_rows: int = Field(
        16_384,
        ge=2,
        description="Rows (R, reasoning traces) of an uploaded matrix; beyond it 413, before any numerical work. "
        "The bootstrap resamples R rows 1000 times (~1 s at this limit on one busy core); the cell limit alone "
        "admitted 2M rows of 2 columns.",
    )
    max_matrix_columns: int = Field(
        4096, ge=2, description="Columns (N, distinct prompt groups) of an uploaded matrix; beyond it 413."
    )
    max_filter_groups: int = Field(
        10_000,
        ge=1,
        description="Reward groups of one POST /v1/filter (open to any reader); beyond it 413. 10,000 groups "
        "take ~0.1 s of one core.",
    )
    max_filter_rewards: int = Field(
        1_000_000, ge=1, description="Rewards (all groups together) of one POST /v1/filter; beyond it 413."
    )

    auth: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether writes (and deleting runs) need a token. on: always; off: never (open mode, even with "
        "tokens; `serve` refuses it on a non-loopback host without allow_insecure_bind); auto: on once a token was "
        "ever issued on this database (revoking every token keeps it on) or when binding a non-loopback host "
        "without allow_insecure_bind, else open. Decided per request.",
    )
    require_token_for_reads: bool = Field(
        False,
        description="Reads (/v1 GETs, the web pages' data) need a read or admin token (an ingest token reads its own "
        "runs). Whether writes need one is the auth setting.",
    )
    require_token_for_metrics: bool = Field(False, description="/metrics needs a read or admin token.")
    allow_insecure_bind: bool = Field(
        False,
        description="Let `serve` bind a non-loopback address although no API token exists (or with auth off), so "
        "that, until a token is issued, anyone who reaches the port can write (a container whose port is published "
        "on loopback only, a trusted network).",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header names the service answers to besides the loopback names and the bound host (a DNS "
        "name pointed at this machine must be listed, so that a page that rebinds its own name to this address is "
        "refused, 400 untrusted_host); '*.example.com' covers subdomains, '*' any host. Empty while binding every "
        "interface (0.0.0.0, ::): any host. /healthz and /readyz answer any host.",
    )
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description="Addresses of the proxies in front whose X-Forwarded-For and X-Forwarded-Proto `serve` trusts "
        "(uvicorn's forwarded_allow_ips; '*' any). Empty: no proxy headers are read, so the rate limiter keys on "
        "the address that connected (uvicorn's own default trusts them from 127.0.0.1, where a local client could "
        "then rotate its address at will).",
    )
    max_connections: int = Field(
        500,
        ge=1,
        description="Connections (and requests being handled) `serve` holds at once; a request beyond it answers "
        "503 at once (uvicorn's limit_concurrency). Keep it below the process's descriptor limit (ulimit -n).",
    )
    keep_alive_seconds: int = Field(
        5, ge=1, description="How long `serve` keeps an idle connection open between requests."
    )
    request_head_seconds: float = Field(
        10.0,
        gt=0,
        description="Time a client has to send a request's line and headers, from the connection's opening or the "
        "end of the previous answer; then `serve` closes the connection (one sending nothing, or a byte a second).",
    )
    request_body_seconds: float = Field(
        120.0,
        gt=0,
        description="Time a client has to send a request's whole body once its headers are in (a 32 MiB body then "
        "needs ~0.3 MB/s); then `serve` closes the connection.",
    )
    response_stall_seconds: float = Field(
        60.0,
        gt=0,
        description="Time an answer may stall because its client reads nothing of it (the socket's buffers full, so "
        "the client must read ~48 KB in that time); then `serve` drops the connection and the rest of the answer.",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins (scheme://host[:port]) besides the service's own that may send POST, PUT, PATCH "
        "and DELETE; a request from any other Origin is refused (403 foreign_origin). Requests without an Origin "
        "header (not sent by a browser) are not affected.",
    )
    token_cache_seconds: float = Field(
        2.0,
        ge=0,
        description="How long an API process keeps a token lookup; a revoked token stops working within this time.",
    )
    max_runs_without_token: int = Field(
        1000,
        ge=0,
        description="Runs that requests without a token (open mode) may create, all together (403 beyond; "
        "concurrent creations may pass it by a few); 0 turns the limit off.",
    )
    max_stored_bytes_per_run: int = Field(
        10 * 2**30,
        ge=0,
        description="Bytes of batch payloads one run may hold stored (accepted and not yet purged by "
        "payload_retention_days); a batch or matrix beyond it is refused, 413 storage_quota. 0 turns it off.",
    )
    max_runs_per_token: int = Field(
        1000, ge=0, description="Runs one ingest token may create (403 beyond); 0 turns the limit off."
    )
    payload_retention_days: float | None = Field(
        None,
        gt=0,
        description="Stored payloads (batch bodies, cross-scoring matrices) of finished batches older than this are "
        "purged by the server in the background; metric points, results and alerts stay. Unset: kept forever.",
    )

    alert_webhooks: list[str] = Field(
        default_factory=list, description="URLs receiving alert events as generic JSON (firing and resolved)."
    )
    alert_slack_webhooks: list[str] = Field(
        default_factory=list, description="Slack-compatible incoming-webhook URLs receiving alert events."
    )
    alertmanager_url: str | None = Field(
        None, description="Alertmanager base URL (e.g. http://alertmanager:9093); alerts go to /api/v2/alerts."
    )
    public_url: str = Field("", description="This service's external URL, linked from alerts (generatorURL).")
    delivery_max_attempts: int = Field(
        12, ge=1, description="Tries per notification before it is marked failed (kept and counted, not dropped)."
    )
    delivery_backoff_seconds: float = Field(1.0, gt=0, description="First retry delay; doubles per failed try.")
    delivery_backoff_max_seconds: float = Field(300.0, gt=0, description="Cap of the retry delay.")

    @field_validator("scorers")
    @classmethod
    def _some_scorer(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("at least one named scorer is needed")
        for spec in value.values():
            VllmEndpoint.parse(spec)  # raises, naming what is missing, for a malformed vLLM scorer
        return value

    @model_validator(mode="after")
    def _default_scorer_is_named(self) -> Settings:
        if self.default_scorer not in self.scorers:
            raise ValueError(
                f"default_scorer {self.default_scorer!r} must be one of the named scorers: {', '.join(self.scorers)}"
            )
        return self

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if "*" in pattern[1:] or (pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
                raise ValueError(f"a host pattern is a name, '*.example.com' or '*', got {pattern!r}")
        return [pattern.lower() for pattern in value]

    @field_validator("max_reasoning_tokens")
    @classmethod
    def _a_window_scores_a_token(cls, value: int) -> int:
        if value == 1:
            raise ValueError("a window of 1 token scores nothing: 0 (whole reasonings) or at least 2")
        return value

    @property
    def reasoning_window(self) -> int | None:
        """``max_reasoning_tokens`` as ``scoring.window`` takes it: None for whole reasonings."""
        return self.max_reasoning_tokens or None

    @property
    def trusted_hosts(self) -> list[str]:
        """Host names the service answers to: loopback, the bound host, ``allowed_hosts`` ('*' binding everything)."""
        if not self.allowed_hosts and self.host in WILDCARD_BINDS:
            return ["*"]
        names = ["localhost", "127.0.0.1", "[::1]", *self.allowed_hosts]
        if self.host not in WILDCARD_BINDS:
            names.append(f"[{self.host}]" if ":" in self.host else self.host.lower())
        return names

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'collapse-monitor.db').resolve()}"

    @property
    def database_timeouts(self) -> dict[str, Any]:
        """make_engine's keyword arguments: the service's bounds on every wait for the database."""
        return {
            "connect_timeout_seconds": self.database_connect_timeout_seconds,
            "statement_timeout_seconds": self.database_statement_timeout_seconds,
        }

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")

    @property
    def vllm_client(self) -> VllmClientSettings:
        """How the worker talks to vLLM scorers: each request holds up to ``max_batch_tokens`` prompt tokens."""
        return VllmClientSettings(
            timeout_seconds=self.vllm_timeout_seconds,
            concurrency=self.vllm_concurrency,
            retries=self.vllm_retries,
            request_tokens=self.max_batch_tokens,
            max_answer_bytes=self.vllm_max_answer_bytes,
        )

    def scoring_config(self, model: str, temperature: float = 1.0) -> ScoringConfig:
        """The ScoringConfig of one scorer: the only place settings become scoring settings."""
        return ScoringConfig(
            model=model,
            device=self.device,
            dtype=self.dtype,
            temperature=temperature,
            max_batch_tokens=self.max_batch_tokens,
            head_tokens=(self.head_tokens,),
        )


def _default_text(value: Any) -> str:
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        return "~" + text[len(home) :] if text.startswith(home + "/") else text
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "unset"
    if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    if value == "" or value == [] or value == {}:
        return "empty"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return str(value)


def settings_markdown() -> str:
    """docs/settings.md: every setting, its environment variable, default and description, from ``Settings``."""
    lines = [
        "# Settings",
        "",
        "Generated from `service/settings.py` (`Settings`):",
        "`.venv/bin/python -m service.settings > docs/settings.md` regenerates it.",
        "",
        "Each setting comes from its flag (`collapse-monitor serve --help`, `worker --help`), the environment",
        "(`COLLAPSE_MONITOR_<NAME>`; lists and maps as JSON) or `.env`: a flag wins over the environment, the",
        "environment over `.env`.",
        "",
        "| setting | environment | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    prefix = Settings.model_config.get("env_prefix", "")
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | `{prefix}{name.upper()}` | {_default_text(default)} | {description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(settings_markdown())
