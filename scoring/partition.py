"""The partition of an agent turn into conditioning context X and reasoning Z (text level).

Three ways to find the reasoning in a response (a run's ``reasoning_extraction``):

* ``think_tags`` (RAGEN): X is everything the model saw before it started reasoning, up to and
  including the literal ``<think>``; Z is the content of the first ``<think>...</think>`` block
  with the format tokens removed and surrounding whitespace stripped (RAGEN ``ctx_manager``). A
  block that was opened and never closed (the generation hit its length limit) gives no Z.
* ``whole_response``: X is the prompt, Z the whole response (format tokens removed, stripped):
  for models trained on plain completions, which write no think tags.
* ``auto``: the tags when the turn has them: a complete block as ``think_tags``, an unclosed one
  as the reasoning it holds, cut where the generation stopped; the whole response otherwise.
  Cross-scoring needs one X per prompt group, and X differs between the two readings (RAGEN's
  ends with ``<think>``), so the service applies ``auto`` per group: the tags when every turn of
  the group has them, the whole response for all of its turns otherwise (``has_think_tags``).

Tokenization is the caller's: RAGEN tokenizes X and Z separately without special tokens, which
can differ at the boundary from tokenizing X + Z together; we do the same so that our numbers
match RAGEN's. Must not import service/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from scoring.batch import Tokens

Extraction = Literal["auto", "think_tags", "whole_response"]
EXTRACTIONS: tuple[Extraction, ...] = ("auto", "think_tags", "whole_response")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# RAGEN's ctx_manager strips these from the reasoning text, the chat-template markers included.
FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")


def clean_reasoning(text: str) -> str:
    """Removes the format tokens from reasoning text and strips surrounding whitespace."""
    for token in FORMAT_TOKENS:
        text = text.replace(token, "")
    return text.strip()


def split_turn(prompt: str, response: str) -> tuple[str, str]:
    """Splits one turn into (X, Z) text.

    Args:
        prompt: everything the model was given (chat template applied), possibly already
            ending in ``<think>`` when the generation prompt opens the think block.
        response: the full assistant text as generated.

    Returns:
        ``(x, z)``. When the response opens a think block, X is the prompt plus the response up
        to and including its first ``<think>``. When it does not, the think block is taken to
        have been opened by the prompt (RAGEN prepends ``<think>`` to generations), and X is the
        prompt with ``<think>`` appended unless it already ends with it. Z is empty when the
        response has no complete think block.
    """
    start = response.find(THINK_OPEN)
    if start >= 0:
        x = prompt + response[: start + len(THINK_OPEN)]
        body = response[start:]
    else:
        x = prompt if prompt.rstrip().endswith(THINK_OPEN) else prompt + THINK_OPEN
        body = THINK_OPEN + response
    # The block is what RAGEN's regex ``<think>(.*?)</think>`` (DOTALL) finds, found with two
    # str.find calls: the regex retries its lazy scan from every later ``<think>`` when no close
    # follows, quadratic in the text (20,000 tags in 560k characters took 58 s). ``body`` opens
    # with the tag, and no ``</think>`` can follow a later ``<think>`` when none follows the first.
    end = body.find(THINK_CLOSE, len(THINK_OPEN))
    return x, clean_reasoning(body[len(THINK_OPEN) : end]) if end >= 0 else ""


@dataclass(frozen=True)
class Partition:
    """One response split into (X, Z), with how the reasoning was found."""

    x: str
    z: str
    mode: Literal["think_tags", "whole_response"]  # what the extraction used for this turn
    is_truncated: bool  # a think block was opened (in the response or by the prompt) and never closed


def has_think_tags(prompt: str, response: str) -> bool:
    """Whether a turn writes think tags: the response opens or closes a block, or the prompt opened one."""
    return THINK_OPEN in response or THINK_CLOSE in response or prompt.rstrip().endswith(THINK_OPEN)


def partition_turn(prompt: str, response: str, extraction: Extraction = "think_tags") -> Partition:
    """Splits one turn into X and Z text under ``extraction`` (see the module docstring)."""
    opened = response.find(THINK_OPEN)
    prompt_opens = prompt.rstrip().endswith(THINK_OPEN)
    is_open = opened >= 0 or prompt_opens
    body_start = opened + len(THINK_OPEN) if opened >= 0 else 0
    is_truncated = is_open and response.find(THINK_CLOSE, body_start) < 0
    if extraction == "whole_response" or (extraction == "auto" and not has_think_tags(prompt, response)):
        return Partition(prompt, clean_reasoning(response), "whole_response", is_truncated)
    x, z = split_turn(prompt, response)
    if extraction == "auto" and is_truncated:
        z = clean_reasoning(response[body_start:])  # the reasoning as far as it got
    return Partition(x, z, "think_tags", is_truncated)


def turn_token_ids(
    encode: Callable[[str], Tokens],
    *,
    prompt: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    response: str | None = None,
    reasoning: str | None = None,
    reasoning_ids: Sequence[int] | None = None,
    extraction: Extraction = "think_tags",
) -> tuple[Tokens, Tokens]:
    """(X ids, Z ids) of one turn given as text and/or token ids.

    Token ids are used as they are. A ``response`` is split with ``partition_turn``: with a text
    prompt, X is the prompt plus (under think tags) the response up to its ``<think>``; with prompt
    ids, X is those ids and only Z comes from the response. A ``reasoning`` text is tokenized as sent.
    """
    x_text, z_text = prompt or "", reasoning or ""
    if response is not None:
        part = partition_turn(x_text, response, extraction)
        x_text, z_text = part.x, part.z
    x = tuple(prompt_ids) if prompt_ids is not None else encode(x_text)
    if reasoning_ids is not None:
        return x, tuple(reasoning_ids)
    return x, encode(z_text) if z_text else ()
