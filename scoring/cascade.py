"""Cascade attention: many short query sequences attend to long shared key/value segments, uncopied.

In cross-scoring every reasoning row attends to the same prompt keys and values as every other row
scored against that prompt, and every prompt to the same system-prompt prefix. A KV cache would
copy those shared keys once per sequence (and again, per query head, under a padding mask). Here
each shared segment is attended to by all its sequences in one batched matmul, the sequence's own
tokens causally, and the partial softmaxes are merged exactly by their log-sum-exp:

    out = (sum_s exp(m_s - m) * P_s V_s) / (sum_s exp(m_s - m) * l_s),  m = max_s m_s

(m_s, l_s: row max and sum of exp(scores - m_s) within segment s). Naive equivalent: softmax
attention over the concatenation [segment_1 ; ... ; own tokens].

The attention function is registered with transformers under ``collapse_monitor_cascade_<base>``
and, when a forward carries no ``cascade`` plan, runs the model's own sdpa or eager attention, so
the model behaves exactly as before for ordinary forwards. Must not import service/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "collapse_monitor_cascade_"
_BASES = ("sdpa", "eager")


class UnsupportedAttention(ValueError):
    """The model's attention has a feature cascade attention does not reproduce."""


@dataclass
class Segment:
    """Keys and values shared by some rows of a batch: per layer [kv_heads, length, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: torch.Tensor | None = None  # [n] batch rows attending to it; None: every row


@dataclass
class CascadePlan:
    """What one forward's attention layers see besides each sequence's own tokens.

    With ``record`` set, each layer's new keys and values [B, kv_heads, Q, head_dim] are kept in
    ``recorded`` so that they can serve as segments of later forwards.
    """

    segments: list[Segment]
    record: bool = False
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def install(model: Any) -> None:
    """Points ``model`` at cascade attention (idempotent); ordinary forwards are unchanged."""
    current = model.config._attn_implementation
    if isinstance(current, str) and current.startswith(PREFIX):
        return
    base = current or "eager"
    if base not in _BASES:
        raise UnsupportedAttention(f"attention {base!r} is not supported; load the model with sdpa or eager")
    if not model._can_set_attn_implementation():
        raise UnsupportedAttention(f"{type(model).__name__} does not route attention through transformers' interface")
    _register()
    model.set_attn_implementation(PREFIX + base)


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if PREFIX + "sdpa" in ALL_ATTENTION_FUNCTIONS:
        return
    for base, attention, mask in (
        ("sdpa", sdpa_attention_forward, sdpa_mask),
        ("eager", eager_attention_forward, eager_mask),
    ):
        AttentionInterface.register(PREFIX + base, _cascade_or(attention))
        AttentionMaskInterface.register(PREFIX + base, mask)


def _cascade_or(fallback: Any) -> Any:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        cascade: CascadePlan | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if cascade is None:
            out: tuple[torch.Tensor, None] = fallback(module, query, key, value, attention_mask, **kwargs)
            return out
        for feature in ("softcap", "sliding_window", "s_aux", "position_bias"):
            if kwargs.get(feature) is not None:
                raise UnsupportedAttention(f"cascade attention does not implement {feature}")
        layer = int(module.layer_idx)  # type: ignore[arg-type]  # set on every HF attention module
        if cascade.record:
            cascade.recorded[layer] = (key, value)
        return cascade_attention(query, key, value, cascade.segments, layer, kwargs.get("scaling")), None

    return attention


def cascade_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[Segment],
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens, plus full attention over its segments.

    Args:
        query: [B, heads, Q, D] (rotary embeddings applied).
        key, value: [B, kv_heads, Q, D], the sequences' own tokens.
        segments: shared keys/values; a sequence sees every segment listing its row.
        layer: which layer's keys/values to take from each segment.
        scaling: softmax scale (default 1/sqrt(D)).

    Returns:
        [B, Q, heads, D] in the query's dtype, the layout transformers' attention functions return.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    # Half-precision inputs: softmax statistics and products run in float32.
    work = torch.promote_types(query.dtype, torch.float32)
    # Query heads h = k * groups + j share kv head k: fold the groups into the query length.
    q = query.to(work).reshape(batch, kv_heads, groups * q_len, dim)

    scores = torch.matmul(q, key.to(work).transpose(-1, -2)) * scale  # [B, kv, g*Q, Q]
    position = torch.arange(q_len, device=query.device)
    future = (position[None, :] > position[:, None]).repeat(groups, 1)  # [g*Q, Q]
    scores.masked_fill_(future, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, value.to(work))  # [B, kv, g*Q, D], unnormalized

    for segment in segments:
        seg_k = segment.keys[layer].to(work)  # [kv, S, D]
        seg_v = segment.values[layer].to(work)
        q_seg = q if segment.rows is None else q[segment.rows]  # [n, kv, g*Q, D]
        n = q_seg.shape[0]
        folded = q_seg.transpose(0, 1).reshape(kv_heads, n * groups * q_len, dim)
        s = torch.bmm(folded, seg_k.transpose(1, 2)) * scale  # [kv, n*g*Q, S]
        m_s = s.amax(dim=-1, keepdim=True)
        p_s = torch.exp(s - m_s)
        stats = (m_s, p_s.sum(dim=-1, keepdim=True), torch.bmm(p_s, seg_v))

        def unfold(t: torch.Tensor, n: int = n) -> torch.Tensor:
            return t.reshape(kv_heads, n, groups * q_len, t.shape[-1]).transpose(0, 1)

        m_s, l_s, o_s = (unfold(t) for t in stats)
        rows = segment.rows if segment.rows is not None else slice(None)
        m_r, l_r, o_r = m[rows], l[rows], o[rows]
        m_new = torch.maximum(m_r, m_s)
        a, b = torch.exp(m_r - m_new), torch.exp(m_s - m_new)
        m[rows], l[rows], o[rows] = m_new, l_r * a + l_s * b, o_r * a + o_s * b

    out = (o / l).reshape(batch, heads, q_len, dim)
    return out.transpose(1, 2).contiguous().to(query.dtype)
