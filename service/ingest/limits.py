"""What a batch may hold before it is queued: sizes, groups, scoring cost, token ids, queue depth.

The checks read ``IngestLimits``, the slice of Settings they need, built once with the app's state
(``service.app``), not the whole Settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from sqlalchemy import update
from sqlalchemy.orm import Session

from service.errors import InvalidRequest, RunQueueFull, StorageQuota, TokenQueueFull, TooLarge, Unavailable
from service.schemas.inputs import BatchIn, TurnWithEntropy
from service.settings import Settings
from service.snapshot import is_scheduled
from service.storage import queue
from service.storage.tables import Run, ScorerLimits


@dataclass(frozen=True)
class IngestLimits:
    """The slice of Settings that bounds what a body, batch or matrix may hold and what the queues take.

    Fields are named as in Settings (docs/settings.md says what each means): the 413s name them.
    """

    max_trajectories: int
    max_turns: int
    max_text_chars: int
    max_token_ids: int
    max_matrix_rows: int
    max_matrix_columns: int
    max_matrix_cells: int
    max_filter_groups: int
    max_filter_rewards: int
    max_scoring_cost: int
    reasoning_window: int | None  # max_reasoning_tokens as the cost estimate counts it (None: whole reasonings)
    max_queue_depth: int
    max_queued_per_run: int
    max_queued_per_token: int
    max_stored_bytes_per_run: int

    @classmethod
    def of(cls, settings: Settings) -> IngestLimits:
        """The slice of ``settings``: each field read from the Settings field (or property) of its name."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


def check_batch_limits(payload: BatchIn, limits: IngestLimits) -> None:
    """413 for a batch over the configured sizes, naming the first field past its limit and the setting
    (``limit``, ``allowed``, ``got``: a client refits the batch to it); nothing is truncated."""
    n_trajectories = len(payload.trajectories)
    check_size(
        n_trajectories, limits.max_trajectories, "a batch", "trajectories", "trajectories", setting="max_trajectories"
    )
    for t, trajectory in enumerate(payload.trajectories):
        where = f"trajectories[{t}]"
        check_size(
            len(trajectory.turns), limits.max_turns, "a trajectory", "turns", f"{where}.turns", t, setting="max_turns"
        )
        for k, turn in enumerate(trajectory.turns):
            for name in ("prompt", "response", "reasoning"):
                text = getattr(turn, name)
                if text is not None:
                    field = f"{where}.turns[{k}].{name}"
                    check_size(len(text), limits.max_text_chars, name, "characters", field, t, setting="max_text_chars")
            for name in ("prompt_token_ids", "reasoning_token_ids"):
                ids = getattr(turn, name)
                if ids is not None:
                    field = f"{where}.turns[{k}].{name}"
                    check_size(len(ids), limits.max_token_ids, name, "token ids", field, t, setting="max_token_ids")


def store_payload(session: Session, run_id: int, n_bytes: int, max_stored_bytes: int) -> None:
    """Counts a new batch's payload against its run's stored bytes; 413 past ``max_stored_bytes`` (0: no limit).

    One UPDATE of the run's row: concurrent ingests of a run queue on it (Postgres) or on the one
    writer (SQLite), so two cannot both pass the limit; a refusal rolls the count back with the rest.
    """
    stored = session.scalar(
        update(Run)
        .where(Run.id == run_id)
        .values(payload_bytes=Run.payload_bytes + n_bytes)
        .returning(Run.payload_bytes)
        .execution_options(synchronize_session=False)
    )
    if max_stored_bytes and stored is not None and stored > max_stored_bytes:
        raise StorageQuota(
            f"the run would hold {stored} bytes of stored payloads, at most {max_stored_bytes} "
            "(max_stored_bytes_per_run); payload_retention_days purges finished batches' payloads",
            field="run",
        )


def check_size(
    size: int, limit: int, what: str, unit: str, field: str, index: int | None = None, *, setting: str | None = None
) -> None:
    """413 when ``size`` passes ``limit``; ``setting`` (the Settings field of the limit) goes into the answer's
    ``limit``, with ``allowed`` and ``got``, where a client can act on it."""
    if size > limit:
        detail = f"{what} may hold at most {limit} {unit}, got {size}"
        raise TooLarge(detail, field=field, index=index, limit=setting, allowed=limit, got=size)


def check_groups(payload: BatchIn) -> None:
    """400 when trajectories of one group start from different prompts: a group is one prompt's rollouts."""
    first: dict[int, tuple[int, object]] = {}
    for t, trajectory in enumerate(payload.trajectories):
        turn = trajectory.turns[0]
        prompt = turn.prompt if turn.prompt is not None else turn.prompt_token_ids
        seen = first.setdefault(trajectory.group_id, (t, prompt))
        if seen[1] != prompt:
            raise InvalidRequest(
                f"trajectories {seen[0]} and {t} share group_id {trajectory.group_id} but start from different "
                "prompts; a group holds the rollouts of one prompt",
                field=f"trajectories[{t}].turns[0].prompt",
                index=t,
            )


def check_scoring_cost(payload: BatchIn, run: Run, limits: IngestLimits) -> None:
    """413 when scoring the batch would cost more than ``max_scoring_cost`` (see ``scoring_cost``)."""
    cost = scoring_cost(payload, run.samplers, run.num_samples, run.score_every, limits.reasoning_window)
    if cost > limits.max_scoring_cost:
        raise TooLarge(
            f"scoring this batch would cost about {cost} tokens (rows x columns x tokens per pair, summed over "
            f"the run's samplers), more than max_scoring_cost={limits.max_scoring_cost}; send fewer or shorter "
            "trajectories, or create the run with a smaller sampler.num_samples",
            field="trajectories",
            limit="max_scoring_cost",
            allowed=limits.max_scoring_cost,
            got=cost,
        )


def scoring_cost(
    payload: BatchIn, samplers: list[str], num_samples: int | None, every: int, window: int | None = None
) -> int:
    """Tokens a naive scorer would run for this batch: per sampler, rows x columns x tokens of a pair.

    An upper bound of the kernel's work (which shares prompts) that grows as its time does. Text is
    counted at ``CHARS_PER_TOKEN`` characters a token, reasoning up to the ``window`` scored; 0 on
    steps the schedule does not score.
    """
    if not is_scheduled(payload.step, every):
        return 0
    turns = [turn for trajectory in payload.trajectories for turn in trajectory.turns]
    tokens_per_pair = sum(_tokens(turn, window) for turn in turns) / len(turns)
    n_groups = len({trajectory.group_id for trajectory in payload.trajectories})
    cost = 0.0
    for sampler in samplers:
        usable = len(payload.trajectories) if sampler == "first_turn" else len(turns)
        rows = min(num_samples or usable, usable)
        columns = min(rows, n_groups) if sampler == "first_turn" else rows
        cost += rows * columns * tokens_per_pair
    return math.ceil(cost)


CHARS_PER_TOKEN = 3  # fewer than the ~4 of English BPE text, so that the estimate errs high


def _tokens(turn: TurnWithEntropy, window: int | None) -> float:
    prompt = (
        len(turn.prompt_token_ids) if turn.prompt_token_ids is not None else len(turn.prompt or "") / CHARS_PER_TOKEN
    )
    if turn.reasoning_token_ids is not None:
        reasoning = float(len(turn.reasoning_token_ids))
    else:
        reasoning = len(turn.response or turn.reasoning or "") / CHARS_PER_TOKEN
    return prompt + (reasoning if window is None else min(reasoning, window))


def check_token_ids(session: Session, payload: BatchIn, scorer: str) -> None:
    """400 for token ids the run's scorer cannot score: outside its vocabulary (a pair past its context is
    windowed by the worker, not refused).

    Known once a worker has loaded the scorer (it records its limits); text is tokenized, and
    checked, by the worker: a batch of text reads no limits.
    """
    turns = [turn for trajectory in payload.trajectories for turn in trajectory.turns]
    if not any(turn.prompt_token_ids or turn.reasoning_token_ids for turn in turns):
        return
    limits = session.get(ScorerLimits, scorer)
    if limits is None:
        return
    for t, trajectory in enumerate(payload.trajectories):
        for k, turn in enumerate(trajectory.turns):
            where = f"trajectories[{t}].turns[{k}]"
            for name in ("prompt_token_ids", "reasoning_token_ids"):
                ids = getattr(turn, name)
                if ids and max(ids) >= limits.vocab_size:
                    raise InvalidRequest(
                        f"token id {max(ids)} is outside the vocabulary of scorer {limits.name!r} "
                        f"({limits.vocab_size} tokens)",
                        field=f"{where}.{name}",
                        index=t,
                    )


def check_queues(session: Session, run: Run, limits: IngestLimits) -> None:
    """429 when this run, or its token's runs, have too many batches waiting (they alone slow down); 503 when
    everyone's queue is full."""
    queued = queue.queue_depth(session, run.id)
    if queued >= limits.max_queued_per_run:
        raise RunQueueFull(
            f"this run has {queued} batches waiting to be scored, its limit (max_queued_per_run); retry later",
            retry_after=5,
        )
    if run.created_by_token is not None:
        by_token = queue.token_queue_depth(session, run.created_by_token)
        if by_token >= limits.max_queued_per_token:
            raise TokenQueueFull(
                f"the runs of the token that created this run have {by_token} batches waiting to be scored, its "
                "share (max_queued_per_token); retry later",
                retry_after=5,
            )
    if queue.queue_depth(session) >= limits.max_queue_depth:
        raise Unavailable(
            f"the scoring queue holds {limits.max_queue_depth} batches, its limit; retry later", retry_after=5
        )
