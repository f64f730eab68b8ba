"""Where a batch's reasoning is: each turn split under the run's ``reasoning_extraction``, counted.

``auto`` is resolved per prompt group (``group_extractions``): cross-scoring needs one X per
group, and X differs between the think-tag and whole-response readings of a turn.

Ingest uses it to warn, in its 202 answer, about a batch that will score nothing; the worker
stores the same counts with the batch's results and figures, and the reasoning excerpts the run
page shows per prompt. Text level only (no tokenizer), so it must not import torch or fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence

from scoring.partition import Extraction, Partition, has_think_tags, partition_turn
from scoring.samplers import Trajectory, Turn
from service.schemas.alerts import PROMPTS_TO_SEE
from service.schemas.inputs import BatchIn, TurnWithEntropy
from service.schemas.results import ReasoningSummary


def turn_partition(turn: TurnWithEntropy, extraction: Extraction) -> Partition | None:
    """How ``extraction`` splits a turn sent as a ``response``; None for reasoning sent as such."""
    if turn.response is None:
        return None
    return partition_turn(turn.prompt or "", turn.response, extraction)


def group_extractions(payload: BatchIn, extraction: Extraction) -> dict[int, Extraction]:
    """The extraction each prompt group is read with: the run's, with ``auto`` settled per group.

    Under ``auto`` a group keeps ``auto`` (think tags, unclosed blocks read as far as they got)
    when every turn of its trajectories sent as a response writes think tags, and is read as
    ``whole_response`` otherwise, so that all of its turns share one X.
    """
    if extraction != "auto":
        return {t.group_id: extraction for t in payload.trajectories}
    tagged: dict[int, bool] = {}
    for trajectory in payload.trajectories:
        has_tags = all(
            has_think_tags(turn.prompt or "", turn.response) for turn in trajectory.turns if turn.response is not None
        )
        tagged[trajectory.group_id] = tagged.get(trajectory.group_id, True) and has_tags
    return {group: "auto" if has_tags else "whole_response" for group, has_tags in tagged.items()}


def reasoning_summary(payload: BatchIn, extraction: Extraction) -> tuple[ReasoningSummary, list[Trajectory]]:
    """How each turn's reasoning was found (text level, before any tokenizer), and stand-in
    trajectories whose turns only say whether they carry reasoning (for RAGEN's coverage figures)."""
    counts = {"think_tags": 0, "whole_response": 0, "as_sent": 0, "truncated_think": 0, "with_reasoning": 0}
    presence = []
    per_group = group_extractions(payload, extraction)
    for trajectory in payload.trajectories:
        marks = []
        for turn in trajectory.turns:
            part = turn_partition(turn, per_group[trajectory.group_id])
            if part is None:
                counts["as_sent"] += 1
                has_reasoning = bool(turn.reasoning_token_ids if turn.reasoning is None else turn.reasoning)
            else:
                counts[part.mode] += 1
                counts["truncated_think"] += part.is_truncated
                has_reasoning = bool(part.z)
            counts["with_reasoning"] += has_reasoning
            marks.append(Turn(prompt_ids=(0,), reasoning_ids=(0,) if has_reasoning else ()))
        presence.append(Trajectory(group_id=trajectory.group_id, turns=tuple(marks)))
    n_turns = sum(len(t.turns) for t in payload.trajectories)
    return ReasoningSummary(extraction=extraction, turns=n_turns, **counts), presence


Found = tuple[ReasoningSummary, list[Trajectory]]  # what ``reasoning_summary`` returns


def ingest_warnings(payload: BatchIn, extraction: Extraction, found: Found) -> list[str]:
    """What will keep a batch from being scored, said at ingest rather than found in its results.

    ``found``: the batch's ``reasoning_summary`` (splitting the turns is most of a post's pure work: once)."""
    summary, presence = found
    warnings = []
    with_reasoning = sum(1 for t in presence if any(turn.reasoning_ids for turn in t.turns))
    if summary.with_reasoning == 0:
        truncated = (
            f"; {summary.truncated_think} think blocks were opened and never closed" if summary.truncated_think else ""
        )
        advice = (
            " (send reasoning or set the run's reasoning_extraction to auto or whole_response)"
            if extraction == "think_tags"
            else ""
        )
        warnings.append(
            f"no turn carries reasoning to score under reasoning_extraction={extraction}: "
            f"0 of {summary.turns} turns{truncated}; the batch will not be cross-scored{advice}"
        )
    elif with_reasoning < 2:
        warnings.append(
            f"only {with_reasoning} trajectory carries reasoning; cross-scoring needs at least 2, so the batch "
            "will not be cross-scored"
        )
    else:
        prompts = len({t.group_id for t in presence if any(turn.reasoning_ids for turn in t.turns)})
        if prompts == 1:
            warnings.append(
                f"all {with_reasoning} trajectories carrying reasoning share one prompt (group_id): cross-scoring "
                "needs 2 or more prompts, so the batch has no chance-corrected retrieval and TemplateCollapse does not "
                "judge it"
            )
        elif prompts < PROMPTS_TO_SEE:
            # Scored, but with few columns retrieval moves in coarse steps (chance is 1/prompts) and MI's
            # ceiling is ln(prompts): only a near-total collapse stands out from a step's noise.
            warnings.append(
                f"the trajectories carrying reasoning come from {prompts} prompts (group_id); TemplateCollapse "
                f"sees a collapse before it is near-total only with {PROMPTS_TO_SEE} or more a step "
                "(docs/alerts.md, Enough rows to see)"
            )
    if all(t.reward is None for t in payload.trajectories):
        warnings.append(f"all {len(payload.trajectories)} rewards are missing (null): no reward figures")
    return warnings


EXCERPTS = 3  # reasoning texts the run page shows per prompt
EXCERPT_CHARS = 400


def reasoning_excerpts(
    payload: BatchIn,
    sources: Sequence[tuple[int, int]],
    column_of_row: Sequence[int],
    n_columns: int,
    extraction: Extraction,
) -> list[list[str]]:
    """[N] per column, the first ``EXCERPTS`` non-empty reasoning texts of its rows in scoring order,
    each cut at ``EXCERPT_CHARS``: the reasoning as the run's extraction read it (none from token ids).

    Cut when the batch is scored and stored with its matrix, so that reading the matrix never
    parses the payload again; only the turns shown are split.
    """
    per_group = group_extractions(payload, extraction)
    out: list[list[str]] = [[] for _ in range(n_columns)]
    for (m, k), column in zip(sources, column_of_row, strict=True):
        if len(out[column]) >= EXCERPTS:
            continue
        trajectory = payload.trajectories[m]
        turn = trajectory.turns[k]
        part = turn_partition(turn, per_group[trajectory.group_id])
        text = turn.reasoning if part is None else part.z
        if excerpt := (text or "")[:EXCERPT_CHARS].strip():
            out[column].append(excerpt)
    return out
