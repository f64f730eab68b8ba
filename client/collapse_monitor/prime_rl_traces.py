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
* **reward**: verifiers' ``Trace.reward``, the sum of ``score * weight`` over the rewards that ran;
  null (missing) when none did.
* **group**: the episode's ``group.id`` (else its task's ``key``), per agent name.

Must not import httpx or the monitor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from collapse_monitor.conversations import Render, message_text


def is_episode_record(row: Mapping[str, Any]) -> bool:
    return "traces" in row and "task" in row


def episode_trajectories(record: Mapping[str, Any], render: Render) -> list[dict[str, Any]]:
    """The trajectories of one episode record (see the module docstring); raises KeyError or TypeError."""
    group = (record.get("group") or {}).get("id") or record["task"].get("key") or record["task"].get("hash")
    out = []
    for trace in record["traces"]:
        if not (trace.get("agent") or {}).get("trainable", True):
            continue
        turns = _turns(trace["nodes"], render)
        if turns:
            agent = (trace.get("agent") or {}).get("name", "agent")
            out.append({"group_id": f"{group}/{agent}", "reward": _reward(trace.get("rewards") or {}), "turns": turns})
    return out


def _turns(nodes: Sequence[Mapping[str, Any]], render: Render) -> list[dict[str, Any]]:
    turns = []
    for node in nodes:
        message = node["message"]
        if not node.get("sampled") or message.get("role") != "assistant":
            continue
        prompt = render([_chat_message(nodes[i]["message"]) for i in _ancestors(nodes, node)])
        reasoning = message.get("reasoning_content")
        if reasoning:
            turns.append({"prompt": prompt, "reasoning": str(reasoning)})
        else:
            turns.append({"prompt": prompt, "response": _assistant_text(message)})
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
