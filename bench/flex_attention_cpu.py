"""Does compiled FlexAttention pay on CPU? One packed shape, against the cascade's fused calls.

    python bench/flex_attention_cpu.py

16 sequences of 256 tokens after a shared 512-token prefix (9 query heads, 3 key/value heads,
head_dim 64, float32). Prints one JSON object: block_mask_seconds (create_block_mask, evaluated
densely), compile_first_call_seconds, compiled_call_seconds, sdpa_loop_seconds (one fused call
per sequence over [prefix ; own tokens]) and max_abs_diff between the two. Needs a C compiler.
"""

from __future__ import annotations

import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def main() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, docs, length, prefix = 9, 3, 64, 16, 256, 512
    total = docs * length
    doc = torch.arange(total) // length
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, prefix + total, dim), torch.randn(1, kv_heads, prefix + total, dim)

    def mask_mod(_b, _h, q_idx, kv_idx):
        own = kv_idx - prefix
        return (kv_idx < prefix) | ((own >= 0) & (doc[own.clamp(min=0)] == doc[q_idx]) & (own <= q_idx))

    result = {}
    start = time.perf_counter()
    mask = create_block_mask(mask_mod, 1, None, total, prefix + total, device="cpu")
    result["block_mask_seconds"] = time.perf_counter() - start
    compiled = torch.compile(flex_attention)
    start = time.perf_counter()
    compiled(q, k, v, block_mask=mask, enable_gqa=True)
    result["compile_first_call_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    out = compiled(q, k, v, block_mask=mask, enable_gqa=True)
    result["compiled_call_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    kk, vv = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    causal = torch.ones(length, prefix + length, dtype=torch.bool)
    causal[:, prefix:] = torch.ones(length, length, dtype=torch.bool).tril()
    parts = []
    for d in range(docs):
        own = slice(prefix + d * length, prefix + (d + 1) * length)
        keys = torch.cat([kk[:, :, :prefix], kk[:, :, own]], 2)
        values = torch.cat([vv[:, :, :prefix], vv[:, :, own]], 2)
        queries = q[:, :, d * length : (d + 1) * length]
        parts.append(torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=causal))
    reference = torch.cat(parts, 2)
    result["sdpa_loop_seconds"] = time.perf_counter() - start
    result["max_abs_diff"] = float((reference - out).abs().max())
    print(json.dumps({key: round(value, 4) if "seconds" in key else value for key, value in result.items()}))


if __name__ == "__main__":
    main()
