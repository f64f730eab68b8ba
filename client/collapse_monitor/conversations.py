"""Chat conversations as the service's turns: one turn per assistant message, its prompt the conversation before it.

Shared by the TRL integration (which renders with the trainer's own chat template) and TRL's
completion files (rendered with a model's template when given, else as plain ``role: content``
lines). Must not import transformers, httpx or the monitor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Render = Callable[[list[Any]], str]  # a conversation (generation prompt appended) -> prompt text


def is_conversation(value: Any) -> bool:
    """A list of chat messages (mappings with a role), as TRL passes conversational prompts."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def message_text(content: Any) -> str:
    """A message's text: a string as is, content parts joined (their text parts only), None empty."""
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def assistant_turns(prompt: Sequence[Any], completion: Any, render: Render) -> list[dict[str, Any]]:
    """The turns of one conversational completion.

    ``completion`` is a list of messages (assistant, and tool results between assistant messages
    when the policy called tools) or a plain string (one assistant message). Turn k's prompt is
    ``render(prompt + messages before the k-th assistant message)``, its response that message's text.
    """
    messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    return [
        {"prompt": render([*prompt, *messages[:k]]), "response": message_text(message.get("content"))}
        for k, message in enumerate(messages)
        if isinstance(message, dict) and message.get("role") == "assistant"
    ]


def render_plain(conversation: Sequence[Any]) -> str:
    """A conversation as ``role: text`` lines and an ``assistant:`` cue, for want of the policy's chat template.

    What is lost against the template: its special tokens (``<|im_start|>`` ...), the system prompt
    it adds by itself, and tool declarations. Every prompt loses the same, so which prompt a
    completion belongs to stays readable to the scorer.
    """
    lines = [f"{message.get('role', '')}: {message_text(message.get('content'))}" for message in conversation]
    return "\n".join([*lines, "assistant:"])
