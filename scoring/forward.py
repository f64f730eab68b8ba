"""The kernel's own decoder forward for Llama-family models, over packed tokens.

transformers' forward runs every sequence of a batch right-padded to the longest, and a layer as
some twenty tensor operations on [B, L, H], each one pass over memory (and, on a CPU, one
synchronisation of the threads). Here a forward runs only the batch's real tokens, packed into
one [T, H] matrix: the linear layers, norms and the MLP never see padding, the residual stream
is updated in place, RMSNorm is one fused call and the rotary embedding is applied to the keys
and queries with two fewer passes. Only attention sees the batch padded, as cascade attention
takes it ([B, heads, Q, D]): its queries and keys are scattered there and its output gathered
back. The weights are the model's own modules; nothing is copied.

Naive equivalent: ``model.base_model(input_ids, position_ids=...)`` with cascade attention, each
sequence's hidden states taken at its valid positions (tested to float rounding). Families:
``llama`` and ``qwen2`` with SiLU MLPs and no sliding window (SmolLM2, Qwen2.5, Llama 3); any
other model runs transformers' forward. Must not import service/.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scoring import cascade
from scoring.cascade import CascadePlan

FAMILIES = ("llama", "qwen2")
# At most this many bytes per chunk of a CPU scorer's large temporaries allocated afresh at every chunk
# (the MLP's [rows, intermediate] activations here, the entropy's [rows, V] in ``cross_scores``). glibc's
# malloc hands out a block over its mmap threshold (at most 32 MiB) as fresh pages and unmaps it on free,
# so a larger chunk is page-faulted and zeroed by the kernel again at every chunk and layer: on SmolLM2
# 512-row vocabulary chunks allocated per chunk spent 13-19% of the CPU seconds of long-reasoning --quick
# in page faults (the vocabulary chunks now share one buffer, ``cross_scores.LOGITS_BYTES``).
CHUNK_BYTES = 24 * 2**20


def supports(model: Any) -> bool:
    """Whether ``model`` (a causal LM) is a family this forward reproduces exactly."""
    config = model.config
    if config.model_type not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return False
    layers = model.base_model.layers
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)


def packed_forward(
    base: Any, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, plan: CascadePlan
) -> torch.Tensor:
    """Final hidden states [T, H] of the valid tokens.

    Args:
        base: the causal LM's base model (``model.base_model``).
        ids: [T] token ids, the batch's valid tokens in row order.
        positions: [T] their positions.
        valid: [B, Q] bool, where each row's tokens sit in the padded layout attention takes.
        plan: shared keys and values (``scoring.cascade``); with ``record`` each layer's padded keys
            and values [B, kv_heads, Q, D] are kept, as the cascade attention function keeps them.
    """
    config = base.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hidden = base.embed_tokens(ids)  # [T, H]
    cos, sin = (t[0, :, None, :] for t in base.rotary_emb(hidden[None], positions[None]))  # [T, 1, D]
    for layer in base.layers:
        if plan.check is not None:
            plan.check()
        attn = layer.self_attn
        dim = attn.head_dim
        x = _rms_norm(hidden, layer.input_layernorm)
        q = _rotate(attn.q_proj(x).view(-1, heads, dim), cos, sin)  # [T, heads, D]
        k = _rotate(attn.k_proj(x).view(-1, kv_heads, dim), cos, sin)
        v = attn.v_proj(x).view(-1, kv_heads, dim)
        q_pad, k_pad, v_pad = (_scatter(t, valid) for t in (q, k, v))  # [B, heads or kv_heads, Q, D]
        if plan.record:
            plan.recorded[attn.layer_idx] = (k_pad, v_pad)
        out = cascade.cascade_attention(
            q_pad, k_pad, v_pad, plan.segments, attn.layer_idx, attn.scaling
        )  # [B, Q, heads, D]
        hidden += attn.o_proj(out[valid].view(-1, heads * dim))
        x = _rms_norm(hidden, layer.post_attention_layernorm)
        mlp = layer.mlp
        # Token by token, so in chunks of at most CHUNK_BYTES of activations.
        rows = max(1, CHUNK_BYTES // (mlp.gate_proj.out_features * x.element_size()))
        for start in range(0, x.shape[0], rows):
            part = x[start : start + rows]
            hidden[start : start + rows] += mlp.down_proj(
                F.silu(mlp.gate_proj(part), inplace=True).mul_(mlp.up_proj(part))
            )
    return _rms_norm(hidden, base.norm)


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in float32, cast back, then scaled by the weight."""
    weight: torch.Tensor = norm.weight
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, norm.variance_epsilon)
    return weight * F.rms_norm(x.float(), weight.shape, None, norm.variance_epsilon).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention: x * cos + rotate_half(x) * sin ([T, heads, D]).

    Written half by half into one output (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2): no
    rotated copy of x and no [T, heads, D] temporaries.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=first).addcmul_(x2, sin[..., :half], value=-1)
    torch.mul(x2, cos[..., half:], out=second).addcmul_(x1, sin[..., half:])
    return out


def _scatter(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Packed [T, h, D] -> [B, h, Q, D], zeros at padding (never attended to: causal, right-padded)."""
    batch, width = valid.shape
    out = x.new_zeros(batch, x.shape[1], width, x.shape[2])
    out.transpose(1, 2)[valid] = x
    return out
