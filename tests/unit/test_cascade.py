"""Cascade attention equals softmax attention over the concatenated keys, fused kernel or not."""

from __future__ import annotations

import shutil

import pytest
import torch

from scoring.cascade import Segment, block_mask, cascade_attention, packed_attention


def naive(query, key, value, segments, scale):
    """Each row attends to [its segments ; its own tokens, causally], written out plainly."""
    batch, heads, q_len, _dim = query.shape
    groups = heads // key.shape[1]
    outputs = []
    for b in range(batch):
        keys, values = [], []
        for segment in segments:
            rows = segment.rows
            if rows is None or b in (range(batch)[rows] if isinstance(rows, slice) else rows.tolist()):
                keys.append(segment.keys[0])
                values.append(segment.values[0])
        shared = sum(k.shape[1] for k in keys)
        k_all = torch.cat([*keys, key[b]], dim=1).repeat_interleave(groups, dim=0)  # [heads, S + Q, D]
        v_all = torch.cat([*values, value[b]], dim=1).repeat_interleave(groups, dim=0)
        scores = query[b] @ k_all.transpose(-1, -2) * scale  # [heads, Q, S + Q]
        future = torch.arange(shared + q_len)[None, :] > (shared + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ v_all)
    return torch.stack(outputs).transpose(1, 2)


def random_attention(seed, batch, heads, kv_heads, q_len, dim, segments, dtype=torch.float64):
    """Random query, key and value of a batch, and a random segment of each (length, rows) in ``segments``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    query, key, value = (
        rand(batch, heads, q_len, dim),
        rand(batch, kv_heads, q_len, dim),
        rand(batch, kv_heads, q_len, dim),
    )
    shared = [
        Segment(keys=[rand(kv_heads, n, dim)], values=[rand(kv_heads, n, dim)], rows=rows) for n, rows in segments
    ]
    return query, key, value, shared


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_cascade_attention_equals_attention_over_the_concatenation(fused, heads, kv_heads):
    segments = [(7, None), (4, torch.tensor([0, 2])), (9, torch.tensor([1])), (5, slice(1, 3))]  # slice: a range
    query, key, value, segments = random_attention(0, 3, heads, kv_heads, 5, 8, segments)
    got = cascade_attention(query, key, value, segments, layer=0, scaling=0.3, fused=fused)
    torch.testing.assert_close(got, naive(query, key, value, segments, 0.3), atol=1e-12, rtol=0)


def test_without_segments_it_is_plain_causal_attention():
    query, key, value = (torch.randn(2, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(cascade_attention(query, key, value, [], 0, None, fused=False), expected)


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_packed_flex_attention_equals_attention_over_the_concatenation(block_size, heads, kv_heads):
    batch, q_len = 4, 5
    segments = [
        (7, None),
        (4, torch.tensor([0, 2])),
        (9, torch.tensor([1])),
        (3, torch.tensor([1, 3])),
        (6, slice(1, 3)),  # a range
    ]
    query, key, value, segments = random_attention(1, batch, heads, kv_heads, q_len, 8, segments)
    mask = block_mask(segments, batch, q_len, torch.device("cpu"), block_size)
    got = packed_attention(query, key, value, segments, layer=0, scaling=0.3, mask=mask)
    torch.testing.assert_close(got, naive(query, key, value, segments, 0.3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_the_block_mask_lists_every_block_holding_a_visible_key_and_only_those(block_size):
    """Block indices, built without a dense mask, agree with the token-level mask_mod."""
    kv = 1
    segments = [
        Segment(keys=[torch.zeros(kv, 5, 2)], values=[torch.zeros(kv, 5, 2)]),
        Segment(keys=[torch.zeros(kv, 6, 2)], values=[torch.zeros(kv, 6, 2)], rows=torch.tensor([1])),
        Segment(keys=[torch.zeros(kv, 3, 2)], values=[torch.zeros(kv, 3, 2)], rows=torch.tensor([0, 2])),
    ]
    batch, q_len = 3, 7
    mask = block_mask(segments, batch, q_len, torch.device("cpu"), block_size)
    queries, keys = batch * q_len, 14 + batch * q_len
    q_idx, kv_idx = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    dense = mask.mask_mod(0, 0, q_idx, kv_idx)
    # The same visibility written out: segment membership, then own row causally.
    row, own = q_idx // q_len, kv_idx - 14
    expected = (
        (kv_idx < 5)
        | ((kv_idx >= 5) & (kv_idx < 11) & (row == 1))
        | ((kv_idx >= 11) & (kv_idx < 14) & ((row == 0) | (row == 2)))
        | ((own >= 0) & (own // q_len == row) & (own % q_len <= q_idx % q_len))
    )
    torch.testing.assert_close(dense, expected)
    listed = torch.zeros(-(-queries // block_size), -(-keys // block_size), dtype=torch.bool)
    counts, indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for qb in range(listed.shape[0]):
        listed[qb, indices[qb, : counts[qb]].long()] = True
    padded = torch.zeros(listed.shape[0] * block_size, listed.shape[1] * block_size, dtype=torch.bool)
    padded[:queries, :keys] = dense
    holds_visible = padded.reshape(listed.shape[0], block_size, listed.shape[1], block_size).any(3).any(1)
    assert torch.equal(listed, holds_visible)


@pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)  # torch.compile's own import
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="compiling needs a C compiler")
def test_compiled_flex_attention_skips_blocks_by_the_block_indices_and_stays_exact():
    """Eager FlexAttention reads only mask_mod; compiled, it visits only the listed blocks (as on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch, heads, kv_heads, q_len, dim = 4, 6, 2, 40, 16
    segments = [(70, None), (30, torch.tensor([0, 3])), (50, slice(1, 3))]
    query, key, value, segments = random_attention(2, batch, heads, kv_heads, q_len, dim, segments, torch.float32)
    mask = block_mask(segments, batch, q_len, torch.device("cpu"), 128)
    k = torch.cat([*(s.keys[0] for s in segments), key.transpose(0, 1).reshape(kv_heads, -1, dim)], 1)[None]
    v = torch.cat([*(s.values[0] for s in segments), value.transpose(0, 1).reshape(kv_heads, -1, dim)], 1)[None]
    q = query.transpose(0, 1).reshape(1, heads, batch * q_len, dim)
    out = torch.compile(flex_attention, dynamic=True)(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
    got = out.reshape(heads, batch, q_len, dim).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, naive(query, key, value, segments, 0.25), atol=1e-5, rtol=0)
