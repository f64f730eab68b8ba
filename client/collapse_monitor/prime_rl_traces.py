"""prime-rl's episode traces: one verifiers ``Episode.to_record()`` per line, read back as trajectories.

prime-rl's file monitor (on by default) appends every episode of a training step to
``OUTPUT_DIR/rollouts/step_{N}/{train,eval}/{all,effective}/traces.jsonl``: ``all`` as each
episode arrives, ``effective`` (the traces the step trained on) when the step is shipped. A
record holds the episode's ``group`` (the rollout group: one task sampled several times), its
``task`` and its ``traces``, one per agent; a trace holds its message graph as ``nodes`` (each
with its ``message``, its ``parent`` node, absent for a root, and ``sampled`` for a message the
model generated), its ``rewards`` (``{name: {"score", "weight"}}``, null when scoring did not
run) and its agent (``trainable``).

What becomes of them:

* **trajectories**: one per trace of a trainable agent that holds a sampled assistant message;
  traces of other agents and traces the model never spoke in carry nothing to score.
* **turns**: one per sampled assistant message; its prompt is the conversation on the path to it
  (its ancestors in the graph, so compaction and sub-agent branches give each turn its own
  context), rendered by ``render``; its response is the message's text and tool calls, or, when
  the server split the reasoning off (``reasoning_content``), that reasoning, sent as such.
* **bounds**: a turn's prompt repeats the whole conversation before it, so a trace of n turns
  expands to ~n/2 times its size (a 1 MB trace of 1,000 turns: 330 MB). A trace keeps its first
  ``max_turns`` turns (the service's limit); each prompt keeps the *last* characters of the
  conversation (a scorer keeps a prompt's last tokens too), at most ``max_text_chars``, and fewer
  when the trace would pass its share of one body (``share_bytes``: turn by turn, each prompt is
  given an even part of what the turns before it left), never below ``MIN_PROMPT_CHARS``; a
  response keeps its first ``max_text_chars``. The turn that would pass the share even so ends the
  trace: its first turns are sent. What was cut is logged.
* **reward**: verifiers' ``Trace.reward``, the sum of ``score * weight`` over the rewards that ran;
  null (missing) when none did.
* **group**: the episode's ``group.id`` (else its task's ``key``), per agent name.

Must not import httpx or the monitor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from collapse_monitor.batches import BatchLimits, json_bytes
from collapse_monitor.conversations import Render, message_text

logger = logging.getLogger("collapse_monitor")

# A prompt is cut to its trace's share of a body down to this, never below: ~2,700 tokens of its latest context.
MIN_PROMPT_CHARS = 8192
TRAJECTORY_OVERHEAD_BYTES = 1024  # a trajectory's own fields around its turns (group id, reward), generously


def is_episode_record(row: Mapping[str, Any]) -> bool:
    return "traces" in row and "task" in row


def episode_trajectories(
    record: Mapping[str, Any], render: Render, limits: BatchLimits | None = None, share_bytes: int | None = None
) -> list[dict[str, Any]]:
    """The trajectories of one episode record (see the module docstring); raises KeyError or TypeError.

    ``share_bytes``: what the record's trajectories may take of one body together (default: all of it).
    """
    limits = limits or BatchLimits()
    share = limits.trajectory_bytes if share_bytes is None else share_bytes
    group = (record.get("group") or {}).get("id") or record["task"].get("key") or record["task"].get("hash")
    trainable = [trace for trace in record["traces"] if (trace.get("agent") or {}).get("trainable", True)]
    out = []
    for trace in trainable:
        agent = (trace.get("agent") or {}).get("name", "agent")
        turns = _turns(trace["nodes"], render, limits, share // len(trainable) - TRAJECTORY_OVERHEAD_BYTES)
        if turns:
            out.append({"group_id": f"{group}/{agent}", "reward": _reward(trace.get("rewards") or {}), "turns": turns})
    return out


def _turns(
    nodes: Sequence[Mapping[str, Any]], render: Render, limits: BatchLimits, share_bytes: int
) -> list[dict[str, Any]]:
    sampled = [n for n in nodes if n.get("sampled") and n["message"].get("role") == "assistant"]
    kept = sampled[: limits.max_turns]
    left = share_bytes
    turns: list[dict[str, Any]] = []
    n_cut = 0
    for k, node in enumerate(kept):
        message = node["message"]
        reasoning = message.get("reasoning_content")
        output = ("reasoning", str(reasoning)) if reasoning else ("response", _assistant_text(message))
        answer = output[1][: limits.max_text_chars]
        # An even part of what the turns before left: early prompts are short, so later ones get more.
        room = left // (len(kept) - k) - len(answer.encode("utf-8", "replace")) - 32  # 32: the turn's keys
        n_chars = min(limits.max_text_chars, max(MIN_PROMPT_CHARS, room))
        prompt = render([_chat_message(nodes[i]["message"]) for i in _ancestors(nodes, node)])
        turn = {"prompt": prompt[-n_chars:], output[0]: answer}
        size = len(json_bytes(turn))
        if turns and size > left:
            break  # past the trace's share even at the shortest prompt: its first turns are sent
        n_cut += len(prompt) > n_chars
        left -= size
        turns.append(turn)
    if n_cut or len(turns) < len(sampled):
        logger.warning(
            "collapse-monitor: a trace of %d turns is sent as its first %d, %d prompts cut to their last characters "
            "(%d to %d), so that it fits its share of one batch (%d bytes) and the service's limits",
            len(sampled),
            len(turns),
            n_cut,
            min(MIN_PROMPT_CHARS, limits.max_text_chars),
            limits.max_text_chars,
            share_bytes,
        )
    return turns


def _ancestors(nodes: Sequence[Mapping[str, Any]], node: Mapping[str, Any]) -> list[int]:
    """Indices of the nodes before ``node`` on its path from the root, root first."""
    path: list[int] = []
    parent = node.get("parent")
    while parent is not None:
        if len(path) >= len(nodes) or not 0 <= parent < len(nodes):
            raise ValueError(f"node parent {parent} is not an earlier node of the trace (or the graph has a cycle)")
        path.append(parent)
        parent = nodes[parent].get("parent")
    return path[::-1]


def _assistant_text(message: Mapping[str, Any]) -> str:
    """The message's text, then its tool calls as the model wrote them out: both are its output."""
    calls = [f"[tool_call {c.get('name')}({c.get('arguments')})]" for c in message.get("tool_calls") or []]
    return "\n".join(part for part in (message_text(message.get("content")), *calls) if part)


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A verifiers message as a chat-template message: tool calls in the OpenAI layout templates expect."""
    out: dict[str, Any] = {"role": message.get("role", ""), "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "id": c.get("id"),
                "function": {"name": c.get("name"), "arguments": c.get("arguments")},
            }
            for c in message["tool_calls"]
        ]
    if message.get("role") == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _reward(rewards: Mapping[str, Any]) -> float | None:
    values = [float(r["score"]) * float(r.get("weight", 1.0)) for r in rewards.values() if r is not None]
    total = sum(values)
    return total if values and math.isfinite(total) else None
