"""ScoringBatch: R rows (prompt ids x_r, reasoning ids z_r, group id g_r) and the columns they define.

Columns are the distinct group ids in ascending order; a column's prompt is the prompt of the
first row carrying that group id. Must not import service/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Tokens = tuple[int, ...]


class BatchError(ValueError):
    """The rows do not form a valid scoring batch; the message names the row or group."""


@dataclass(frozen=True)
class ScoringBatch:
    """Rows and columns of one cross-scoring matrix.

    Attributes:
        prompts: [R] prompt token ids per row.
        reasonings: [R] reasoning token ids per row (may be empty).
        group_ids: [R] group id per row.
        column_group_ids: [N] distinct group ids, ascending.
        column_prompts: [N] the prompt of each column.
        column_of_row: [R] index of each row's own column.
    """

    prompts: tuple[Tokens, ...]
    reasonings: tuple[Tokens, ...]
    group_ids: tuple[int, ...]
    column_group_ids: tuple[int, ...]
    column_prompts: tuple[Tokens, ...]
    column_of_row: tuple[int, ...]

    @classmethod
    def from_rows(
        cls,
        prompts: Sequence[Sequence[int]],
        reasonings: Sequence[Sequence[int]],
        group_ids: Sequence[int],
    ) -> ScoringBatch:
        if not len(prompts) == len(reasonings) == len(group_ids):
            raise BatchError(
                f"prompts, reasonings and group_ids must have one entry per row, got "
                f"{len(prompts)}, {len(reasonings)} and {len(group_ids)}"
            )
        if not prompts:
            raise BatchError("a scoring batch needs at least one row, got 0")
        prompt_rows = tuple(tuple(int(t) for t in p) for p in prompts)
        reasoning_rows = tuple(tuple(int(t) for t in z) for z in reasonings)
        gids = tuple(int(g) for g in group_ids)
        for r, (p, z) in enumerate(zip(prompt_rows, reasoning_rows, strict=True)):
            if not p:
                raise BatchError(f"row {r}: the prompt must contain at least 1 token, got 0")
            if min(p) < 0 or (z and min(z) < 0):
                raise BatchError(f"row {r}: token ids must be >= 0")

        first_row: dict[int, int] = {}
        for r, g in enumerate(gids):
            first = first_row.setdefault(g, r)
            if prompt_rows[r] != prompt_rows[first]:
                raise BatchError(
                    f"group {g}: rows {first} and {r} carry different prompts; "
                    "rows sharing a group id must carry identical prompts"
                )
        column_group_ids = tuple(sorted(first_row))
        column_index = {g: j for j, g in enumerate(column_group_ids)}
        return cls(
            prompts=prompt_rows,
            reasonings=reasoning_rows,
            group_ids=gids,
            column_group_ids=column_group_ids,
            column_prompts=tuple(prompt_rows[first_row[g]] for g in column_group_ids),
            column_of_row=tuple(column_index[g] for g in gids),
        )

    @property
    def n_rows(self) -> int:
        return len(self.group_ids)

    @property
    def n_columns(self) -> int:
        return len(self.column_group_ids)

    def distinct_reasonings(self) -> tuple[list[int], np.ndarray]:
        """(the first row of each distinct reasoning, [R] int64 each row's index among them).

        A reasoning repeated across rows (a trajectory sampler's repeated draw, a collapsed batch's identical
        answers) has one score under each prompt, so scorers score it once (``scoring.cross_scores``)."""
        index: dict[Tokens, int] = {}
        firsts: list[int] = []
        for r, z in enumerate(self.reasonings):
            if z not in index:
                index[z] = len(firsts)
                firsts.append(r)
        return firsts, np.array([index[z] for z in self.reasonings], dtype=np.int64)

    @property
    def reasoning_lengths(self) -> np.ndarray:
        """[R] int64 token counts T_r."""
        return np.array([len(z) for z in self.reasonings], dtype=np.int64)
