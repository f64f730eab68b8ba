"""The prefix tree holds every distinct token prefix of the prompts exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.prefix_tree import build


def distinct_prefixes(prompts):
    return {tuple(p[:n]) for p in prompts for n in range(1, len(p) + 1)}


def trajectory_prompts(rng, trajectories=3, turns=4):
    """Each trajectory's turn t prompt extends its turn t - 1 prompt; all share a system prompt."""
    system = [int(t) for t in rng.integers(0, 50, 6)]
    prompts = []
    for _ in range(trajectories):
        history = list(system)
        for _ in range(turns):
            history = history + [int(t) for t in rng.integers(0, 50, rng.integers(1, 5))]
            prompts.append(tuple(history))
    return list(dict.fromkeys(prompts))


@pytest.mark.parametrize("seed", range(20))
def test_every_distinct_prefix_is_one_node_position_and_every_prompt_ends_at_a_node_end(seed):
    rng = np.random.default_rng(seed)
    prompts = (
        trajectory_prompts(rng)
        if seed % 2
        else list(dict.fromkeys(tuple(int(t) for t in rng.integers(0, 3, rng.integers(1, 7))) for _ in range(12)))
    )
    tree = build(prompts)
    assert tree.tokens == len(distinct_prefixes(prompts))
    spelled: set[tuple[int, ...]] = set()
    for i, node in enumerate(tree.nodes):
        assert node.tokens, "no empty node"
        assert all(a < i for a in node.path), "ancestors come first (depth-first preorder)"
        before = tuple(t for a in node.path for t in tree.nodes[a].tokens)
        assert len(before) == node.start
        spelled.update(before + node.tokens[:n] for n in range(1, len(node.tokens) + 1))
    assert spelled == distinct_prefixes(prompts)
    for u, prompt in enumerate(prompts):
        assert tuple(t for n in tree.path(u) for t in tree.nodes[n].tokens) == prompt
        assert u in tree.nodes[tree.node_of_prompt[u]].ends


def test_a_trajectory_history_is_one_chain_shared_by_its_later_turns():
    system, a1, a2, b1 = (1, 2, 3), (4, 5), (6,), (7, 8)
    prompts = [system + a1, system + a1 + a2, system + b1]
    tree = build(prompts)
    assert [n.tokens for n in tree.nodes] == [system, a1, a2, b1]
    assert [tree.path(u) for u in range(3)] == [(0, 1), (0, 1, 2), (0, 3)]


def test_prompts_differing_at_the_first_token_have_no_common_root():
    tree = build([(1, 2), (3, 4)])
    assert [n.path for n in tree.nodes] == [(), ()]
