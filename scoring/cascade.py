"""Cascade attention: many short query sequences attend to long shared key/value segments, uncopied.

In cross-scoring every reasoning row attends to the same prompt keys and values as every other row
scored against that prompt, and every prompt to the same system-prompt prefix. A KV cache would
copy those shared keys once per sequence (and again, per query head, under a padding mask). Here
each shared segment is attended to by all its sequences in one batched matmul, the sequence's own
tokens causally, and the partial softmaxes are merged exactly by their log-sum-exp:

    out = (sum_s exp(m_s - m) * P_s V_s) / (sum_s exp(m_s - m) * l_s),  m = max_s m_s

(m_s, l_s: row max and sum of exp(scores - m_s) within segment s). Naive equivalent: softmax
attention over the concatenation [segment_1 ; ... ; own tokens].

On CUDA a plan is ``packed``: every layer runs one FlexAttention call instead of one call per
segment. The batch's queries are packed into one sequence, the keys are [segment_1 ; ... ; every
sequence's own tokens], and a block mask built from block indices (never from a dense token mask)
lists, for each block of queries, the key blocks it may see; within those blocks ``mask_mod`` says
which keys each query sees: the segments listing its row, and its own row's tokens up to itself.
Launches per layer no longer grow with the number of segments (prompts, tree nodes).

The attention function is registered with transformers under ``collapse_monitor_cascade_<base>``
and, when a forward carries no ``cascade`` plan, runs the model's own sdpa or eager attention, so
the model behaves exactly as before for ordinary forwards. Must not import service/.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "collapse_monitor_cascade_"
_BASES = ("sdpa", "eager")
# From this many queries per sequence a segment is attended to by the queries in place; below it,
# by the queries folded into one sequence per kv head. On SmolLM2 (CPU, flash kernel) the fold
# was ~20% faster at 64 queries and ~40% slower at 965 (the copies grow with the queries, the
# kernel's short-block overhead does not).
FOLD_BELOW_QUERIES = 256


class UnsupportedAttention(ValueError):
    """The model's attention has a feature cascade attention does not reproduce."""


@dataclass
class Segment:
    """Keys and values shared by some rows of a batch: per layer [kv_heads, length, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: torch.Tensor | slice | None = None  # [n] batch rows attending to it, or a range of them; None: every row


@dataclass
class CascadePlan:
    """What one forward's attention layers see besides each sequence's own tokens.

    With ``record`` set, each layer's new keys and values [B, kv_heads, Q, head_dim] are kept in
    ``recorded`` so that they can serve as segments of later forwards. ``check``, when given, is
    called at every layer; an exception it raises abandons the forward (a deadline, a shutdown).
    """

    segments: list[Segment]
    record: bool = False
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    check: Callable[[], None] | None = None
    packed: bool = False  # one FlexAttention call per layer (``packed_attention``)
    block_size: int = 128
    masks: dict[tuple[int, int], Any] = field(default_factory=dict)  # (B, Q) -> block mask, shared by the layers


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
        if cascade.check is not None:
            # Per layer, not per forward: one forward of max_batch_tokens can take a minute on a CPU.
            cascade.check()
        layer = int(module.layer_idx)  # type: ignore[arg-type]  # set on every HF attention module
        if cascade.record:
            cascade.recorded[layer] = (key, value)
        if cascade.packed:
            shape = (query.shape[0], query.shape[2])
            if shape not in cascade.masks:
                cascade.masks[shape] = block_mask(cascade.segments, *shape, query.device, cascade.block_size)
            mask = cascade.masks[shape]
            return packed_attention(query, key, value, cascade.segments, layer, kwargs.get("scaling"), mask), None
        return cascade_attention(query, key, value, cascade.segments, layer, kwargs.get("scaling")), None

    return attention


def cascade_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[Segment],
    layer: int,
    scaling: float | None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens, plus full attention over its segments.

    Args:
        query: [B, heads, Q, D] (rotary embeddings applied).
        key, value: [B, kv_heads, Q, D], the sequences' own tokens.
        segments: shared keys/values; a sequence sees every segment listing its row.
        layer: which layer's keys/values to take from each segment.
        scaling: softmax scale (default 1/sqrt(D)).
        fused: use torch's fused CPU flash kernel (default: on CPU); otherwise explicit matmuls.

    Returns:
        [B, Q, heads, D] in the query's dtype, the layout transformers' attention functions return
        (a transposed view, not contiguous).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    fused = query.device.type == "cpu" if fused is None else fused
    # Half-precision inputs: softmax statistics and the merge run in float32.
    work = torch.promote_types(query.dtype, torch.float32)
    q = query.to(work)
    # Query heads h = k * groups + j share kv head k: seen as [B * kv, groups, Q, D] the queries are a
    # view and the own keys broadcast over the groups (stride 0), never repeated per head.
    own_k = key.to(work).reshape(batch * kv_heads, 1, q_len, dim).expand(-1, groups, -1, -1)
    own_v = value.to(work).reshape(batch * kv_heads, 1, q_len, dim).expand(-1, groups, -1, -1)
    out, lse = _attend(q.reshape(batch * kv_heads, groups, q_len, dim), own_k, own_v, scale, causal=True, fused=fused)
    out = out.reshape(batch, heads, q_len, dim)
    lse = lse.reshape(batch, heads, q_len)
    for segment in segments:
        # A range of rows is a view: no gather of the queries, and the merge writes in place.
        rows = segment.rows if segment.rows is not None else slice(None)
        q_seg = q[rows]  # [n, heads, Q, D]
        n = q_seg.shape[0]
        seg_k, seg_v = segment.keys[layer].to(work), segment.values[layer].to(work)  # [kv, S, D]
        if q_len >= FOLD_BELOW_QUERIES:
            # The queries as they are, the segment's keys per query head broadcast over the rows
            # (stride 0): [n, heads, S, D]. Nothing the size of the queries is copied.
            seg_k = seg_k.repeat_interleave(groups, dim=0)[None].expand(n, -1, -1, -1)
            seg_v = seg_v.repeat_interleave(groups, dim=0)[None].expand(n, -1, -1, -1)
            seg_out, seg_lse = _attend(q_seg, seg_k, seg_v, scale, False, fused)
        else:
            # Short queries: every row's queries of a kv head folded into one long sequence, the
            # segment's keys read once (a copy of the queries, cheaper than many short blocks).
            folded = q_seg.reshape(n, kv_heads, groups * q_len, dim).transpose(0, 1)
            seg_out, seg_lse = _attend(
                folded.reshape(1, kv_heads, n * groups * q_len, dim), seg_k[None], seg_v[None], scale, False, fused
            )
            seg_out = seg_out.reshape(kv_heads, n, groups * q_len, dim).transpose(0, 1).reshape(n, heads, q_len, dim)
            seg_lse = seg_lse.reshape(kv_heads, n, groups * q_len).transpose(0, 1).reshape(n, heads, q_len)
        # out <- w out + (1 - w) seg_out with w = exp(lse - merged) = sigmoid(lse - seg_lse).
        kept = torch.sigmoid(lse[rows] - seg_lse)[..., None]
        if isinstance(rows, slice):
            torch.lerp(seg_out, out[rows], kept, out=out[rows])
        else:
            out[rows] = torch.lerp(seg_out, out[rows], kept)
        lse[rows] = torch.logaddexp(lse[rows], seg_lse)
    # A view: the caller gathers its valid positions (or reshapes) from it, one pass, not two.
    return out.transpose(1, 2).to(query.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [.., Q, D] and its log-sum-exp [.., Q] (causal: top-left aligned, Q == K)."""
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        position = torch.arange(q.shape[-2], device=q.device)
        scores.masked_fill_(position[None, :] > position[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def block_mask(segments: list[Segment], batch: int, q_len: int, device: torch.device, block_size: int = 128) -> Any:
    """The FlexAttention block mask of a packed forward (see ``packed_attention`` for the layout).

    Built from block indices: for each block of packed queries (rows b_lo..b_hi), the key blocks
    overlapping a segment one of those rows sees, and those overlapping the rows' own tokens up
    to the block's last query. Within them, ``mask_mod`` decides token by token.
    """
    from torch.nn.attention.flex_attention import BlockMask

    lengths = [int(s.keys[0].shape[1]) for s in segments]
    shared = sum(lengths)
    n_seg = len(segments)
    queries, keys = batch * q_len, shared + batch * q_len
    # seg_of_key has one extra entry, the dummy segment n_seg that no row sees, for own keys.
    seg_of_key = torch.repeat_interleave(
        torch.arange(n_seg + 1, device=device), torch.tensor([*lengths, 1], device=device)
    )
    member = torch.zeros(batch, n_seg + 1, dtype=torch.bool, device=device)
    for i, s in enumerate(segments):
        member[s.rows if s.rows is not None else slice(None), i] = True
    # Tensors, not ints, so that one compiled kernel serves every forward's sizes.
    q_len_t = torch.tensor(q_len, device=device)
    shared_t = torch.tensor(shared, device=device)
    last_row = torch.tensor(batch - 1, device=device)

    def mask_mod(_b: Any, _h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Clamped lookups: a kernel may evaluate the mask past the ends, in its last partial block.
        row = (q_idx // q_len_t).clamp(max=last_row)
        own = kv_idx - shared_t
        in_segment = member[row, seg_of_key[kv_idx.clamp(max=shared_t)]]
        in_own = (own >= 0) & (own // q_len_t == row) & (own % q_len_t <= q_idx % q_len_t)
        return in_segment | in_own

    n_qb, n_kb = -(-queries // block_size), -(-keys // block_size)
    q_start = torch.arange(n_qb, device=device) * block_size
    q_end = torch.clamp(q_start + block_size, max=queries)  # exclusive
    b_lo, b_hi = q_start // q_len, (q_end - 1) // q_len
    rows_seen = torch.cat([torch.zeros(1, n_seg + 1, dtype=torch.long, device=device), member.long().cumsum(0)])
    seen = (rows_seen[b_hi + 1] - rows_seen[b_lo]) > 0  # [n_qb, n_seg + 1]: a row of the block sees it
    k_start = torch.arange(n_kb, device=device) * block_size
    k_last = torch.clamp(k_start + block_size, max=keys) - 1
    s_lo, s_hi = seg_of_key[k_start.clamp(max=shared)], seg_of_key[k_last.clamp(max=shared)]
    seen_upto = torch.cat([torch.zeros(n_qb, 1, dtype=torch.long, device=device), seen.long().cumsum(1)], dim=1)
    visible = (seen_upto[:, s_hi + 1] - seen_upto[:, s_lo]) > 0  # [n_qb, n_kb]: through segments
    own_first, own_last = shared + b_lo * q_len, shared + q_end - 1
    visible |= (k_start[None, :] <= own_last[:, None]) & (k_last[None, :] >= own_first[:, None])
    counts = visible.sum(1, dtype=torch.int32)
    indices = torch.sort((~visible).to(torch.int8), dim=1, stable=True).indices.to(torch.int32)
    return BlockMask.from_kv_blocks(
        counts[None, None], indices[None, None], BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(queries, keys)
    )


_COMPILED: dict[str, Any] = {}


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[Segment],
    layer: int,
    scaling: float | None,
    mask: Any,
) -> torch.Tensor:
    """``cascade_attention``'s result from one FlexAttention call over the packed batch.

    Packed queries: row b's position i at b * Q + i. Packed keys: the segments' keys in order, then
    row b's own key i at shared + b * Q + i. ``mask`` is ``block_mask`` of the same segments.
    Compiled on CUDA (softmax statistics in float32 whatever the dtype); eager elsewhere, where it
    materialises the scores and serves to test the mask on small shapes.
    """
    from torch.nn.attention.flex_attention import flex_attention

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    own_k = key.transpose(0, 1).reshape(kv_heads, batch * q_len, dim)
    own_v = value.transpose(0, 1).reshape(kv_heads, batch * q_len, dim)
    k = torch.cat([*(s.keys[layer].to(key.dtype) for s in segments), own_k], dim=1)[None]
    v = torch.cat([*(s.values[layer].to(value.dtype) for s in segments), own_v], dim=1)[None]
    q = query.transpose(0, 1).reshape(1, heads, batch * q_len, dim)
    if query.is_cuda:
        attend = _COMPILED.setdefault("flex", torch.compile(flex_attention, dynamic=True))
        out = attend(q, k, v, block_mask=mask, scale=scaling, enable_gqa=kv_heads != heads)
    else:
        with warnings.catch_warnings():  # eager is the point here: it checks the mask, not speed
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=kv_heads != heads)
    result: torch.Tensor = out.reshape(heads, batch, q_len, dim).permute(1, 2, 0, 3).contiguous()
    return result
