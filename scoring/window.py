"""Windows: what of a long (prompt, reasoning) pair is scored, so that no batch fails for its length.

Every row is scored under every column's prompt, so a batch needs, in one sequence,
``longest prompt + longest reasoning - 1`` positions. Past the scorer's context (or the
forward budget) the batch is windowed rather than refused:

- the reasoning keeps its first ``max_reasoning_tokens`` tokens. log p(z_1..z_n | x) is then
  exactly the likelihood of the reasoning's opening, the part written in answer to the prompt
  (and where a template shows first); a later window would need the earlier reasoning as context
  and cost as much as the whole;
- a prompt that still does not fit keeps its last tokens: the current turn, the observation and
  the chat template's assistant header, which the reasoning reads last. What goes is the head,
  typically a system prompt shared by every column, which carries no information on which input
  a reasoning answers (two prompts that differed only there become one input, and say so through
  ``merged_columns``).

Must not import service/.
"""

from __future__ import annotations

from dataclasses import dataclass

from scoring.batch import ScoringBatch, Tokens

# The default reasoning window (service setting and ``collapse-monitor score``): a pair then costs at most
# ~512 tokens beyond its prompt, so a step's cost no longer grows with how long the policy reasons.
DEFAULT_MAX_REASONING_TOKENS = 512


@dataclass(frozen=True)
class WindowCut:
    """What windowing removed from one batch.

    Attributes:
        rows_cut: rows whose reasoning lost tokens.
        rows_with_reasoning: rows whose reasoning has at least 2 tokens (the scored ones).
        reasoning_tokens_cut: reasoning tokens removed, over all rows.
        prompts_cut: distinct column prompts that lost their head.
        prompt_tokens_cut: prompt tokens removed, over the distinct column prompts.
        merged_columns: columns whose windowed prompt equals another column's.
        max_reasoning_tokens: the reasoning window used (after fitting it to the context).
    """

    rows_cut: int
    rows_with_reasoning: int
    reasoning_tokens_cut: int
    prompts_cut: int
    prompt_tokens_cut: int
    merged_columns: int
    max_reasoning_tokens: int | None

    @property
    def truncated_reasoning_ratio(self) -> float:
        """Share of the scored rows whose reasoning was cut (0 when none has reasoning)."""
        return self.rows_cut / self.rows_with_reasoning if self.rows_with_reasoning else 0.0


def sequence_limit(max_positions: int | None, max_batch_tokens: int) -> int:
    """The most one (prompt, reasoning) sequence may hold: the scorer's context, or one forward's budget."""
    return max_batch_tokens if max_positions is None else min(max_positions, max_batch_tokens)


def fit_window(
    batch: ScoringBatch, max_reasoning_tokens: int | None, max_positions: int | None
) -> tuple[ScoringBatch, WindowCut]:
    """``batch`` with reasonings cut to ``max_reasoning_tokens`` and prompts to what then fits.

    ``max_positions`` is the most one sequence may hold: the scorer's context, or the forward
    budget when smaller; None for no limit. The reasoning window is narrowed further when even the
    shortest useful prompt would not fit beside it: a prompt always keeps at least
    ``min(its length, max_positions // 2)`` tokens. A batch that fits is returned as it is.
    """
    if max_reasoning_tokens is not None and max_reasoning_tokens < 2:
        raise ValueError(f"max_reasoning_tokens must be >= 2 (one scored token), got {max_reasoning_tokens}")
    if max_positions is not None and max_positions < 2:
        raise ValueError(f"max_positions must be >= 2, got {max_positions}")
    window = max_reasoning_tokens
    longest_prompt = max(len(p) for p in batch.column_prompts)
    if max_positions is not None:
        prompt_floor = min(longest_prompt, max_positions // 2)
        fitting = max_positions - prompt_floor + 1  # need = prompt + reasoning - 1
        window = fitting if window is None else min(window, fitting)
    reasonings = tuple(z if window is None or len(z) <= window else z[:window] for z in batch.reasonings)
    longest_reasoning = max(len(z) for z in reasonings)
    keep = None if max_positions is None else max_positions - max(longest_reasoning - 1, 0)
    windowed_prompt: dict[Tokens, Tokens] = {
        p: p if keep is None or len(p) <= keep else p[len(p) - keep :] for p in batch.column_prompts
    }
    scored = [len(z) >= 2 for z in batch.reasonings]
    cut = WindowCut(
        rows_cut=sum(len(a) != len(b) for a, b in zip(batch.reasonings, reasonings, strict=True)),
        rows_with_reasoning=sum(scored),
        reasoning_tokens_cut=sum(len(a) - len(b) for a, b in zip(batch.reasonings, reasonings, strict=True)),
        prompts_cut=sum(len(p) != len(w) for p, w in windowed_prompt.items()),
        prompt_tokens_cut=sum(len(p) - len(w) for p, w in windowed_prompt.items()),
        merged_columns=len(batch.column_prompts) - len({windowed_prompt[p] for p in batch.column_prompts}),
        max_reasoning_tokens=window,
    )
    if cut.rows_cut == 0 and cut.prompts_cut == 0:
        return batch, cut
    windowed = ScoringBatch.from_rows([windowed_prompt[p] for p in batch.prompts], reasonings, batch.group_ids)
    return windowed, cut
