"""The prefix tree of a batch's distinct prompts: every distinct token prefix appears exactly once.

A node is a run of tokens shared by exactly the same set of prompts; it ends where the prompts
sharing it diverge or where one of them ends, so every prompt ends at the last token of a node.
A node's keys and values, computed once, serve every prompt below it: the system prompt shared
by all prompts, a trajectory's history shared by its later turns, and so on, at any depth.
Must not import service/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scoring.batch import Tokens


@dataclass(frozen=True)
class Node:
    """One run of tokens of the tree.

    Attributes:
        tokens: the run, at positions ``start .. start + len(tokens) - 1``.
        start: positions before it, the total length of its ancestors.
        path: its ancestors' node indices, root first.
        ends: distinct prompts ending at its last token.
    """

    tokens: Tokens
    start: int
    path: tuple[int, ...]
    ends: tuple[int, ...]


@dataclass(frozen=True)
class PrefixTree:
    """Nodes in depth-first preorder (an ancestor always before its descendants).

    Attributes:
        nodes: the runs.
        node_of_prompt: per distinct prompt, the node it ends at.
    """

    nodes: tuple[Node, ...]
    node_of_prompt: tuple[int, ...]

    def path(self, prompt: int) -> tuple[int, ...]:
        """Nodes the prompt consists of, root first, its own last node included."""
        node = self.node_of_prompt[prompt]
        return (*self.nodes[node].path, node)

    @property
    def tokens(self) -> int:
        """Distinct prefixes of the prompts: the tokens an exact scorer must run for them."""
        return sum(len(n.tokens) for n in self.nodes)


def build(prompts: Sequence[Tokens]) -> PrefixTree:
    """The tree of distinct, non-empty ``prompts`` (prompt i keeps its index)."""
    nodes: list[Node] = []
    node_of_prompt = [0] * len(prompts)
    # (prompts sharing tokens [:depth], depth, ancestors); popped last-in-first-out with children
    # pushed in reverse, so nodes come out in depth-first preorder.
    stack: list[tuple[list[int], int, tuple[int, ...]]] = [(list(range(len(prompts))), 0, ())]
    while stack:
        members, depth, path = stack.pop()
        end = _run_end([prompts[u] for u in members], depth)
        if end > depth:
            ends = tuple(u for u in members if len(prompts[u]) == end)
            nodes.append(Node(tokens=prompts[members[0]][depth:end], start=depth, path=path, ends=ends))
            for u in ends:
                node_of_prompt[u] = len(nodes) - 1
            path = (*path, len(nodes) - 1)
        children: dict[int, list[int]] = {}
        for u in members:
            if len(prompts[u]) > end:
                children.setdefault(prompts[u][end], []).append(u)
        stack.extend((group, end, path) for group in reversed(list(children.values())))
    return PrefixTree(nodes=tuple(nodes), node_of_prompt=tuple(node_of_prompt))


def _run_end(prompts: Sequence[Tokens], depth: int) -> int:
    """Where the run from ``depth`` ends: the first position where a prompt ends or they differ."""
    if len(prompts) == 1:
        return len(prompts[0])
    limit = min(len(p) for p in prompts)
    first = prompts[0]
    end = depth
    while end < limit and all(p[end] == first[end] for p in prompts):
        end += 1
    return end
