"""The RAGEN X/Z partition of a turn, and the rows -> columns rules of a scoring batch."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scoring.batch import BatchError, ScoringBatch
from scoring.partition import Partition, partition_turn, split_turn, turn_token_ids


@pytest.mark.parametrize(
    ("prompt", "response", "x", "z"),
    [
        ("P", "<think> step 1\nstep 2 </think><answer>Up</answer>", "P<think>", "step 1\nstep 2"),
        ("P", "Sure. <think>a</think>", "PSure. <think>", "a"),
        ("P<think>", "plan</think><answer>Left</answer>", "P<think>", "plan"),  # prompt opened the block
        ("P<think>\n", "plan</think>", "P<think>\n", "plan"),
        ("P", "<answer>Up</answer>", "P<think>", ""),  # no think block: empty reasoning
        ("P", "<think>unclosed", "P<think>", ""),
        ("P", "<think>a <answer>b</answer> <|im_end|></think><think>second</think>", "P<think>", "a b"),
    ],
)
def test_split_turn_follows_ragen(prompt, response, x, z):
    assert split_turn(prompt, response) == (x, z)


@pytest.mark.parametrize(
    ("prompt", "response", "extraction", "expected"),
    [
        ("P", "<think>a b</think>Up", "think_tags", Partition("P<think>", "a b", "think_tags", False)),
        ("P", "<think>a b</think>Up", "auto", Partition("P<think>", "a b", "think_tags", False)),
        ("P", "<think>a b</think>Up", "whole_response", Partition("P", "a bUp", "whole_response", False)),
        ("P", "I go up.", "think_tags", Partition("P<think>", "", "think_tags", False)),  # RAGEN: nothing
        ("P", "I go up.", "auto", Partition("P", "I go up.", "whole_response", False)),  # no tags: all of it
        ("P", "<think>cut by the len", "think_tags", Partition("P<think>", "", "think_tags", True)),
        ("P", "<think>cut by the len", "auto", Partition("P<think>", "cut by the len", "think_tags", True)),
        ("P", "<think>cut by the len", "whole_response", Partition("P", "cut by the len", "whole_response", True)),
        ("P<think>", "cut by the len", "auto", Partition("P<think>", "cut by the len", "think_tags", True)),
        ("P<think>", "plan</think>Up", "auto", Partition("P<think>", "plan", "think_tags", False)),
        ("P", "plan</think>Up", "auto", Partition("P<think>", "plan", "think_tags", False)),  # RAGEN-prefixed
    ],
)
def test_partition_turn_per_extraction(prompt, response, extraction, expected):
    assert partition_turn(prompt, response, extraction) == expected


_OLD_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)  # the regex split_turn used before


def old_split_turn(prompt, response):
    """The regex implementation split_turn replaced (quadratic on repeated opens), kept as the oracle."""
    start = response.find("<think>")
    if start >= 0:
        x, body = prompt + response[: start + len("<think>")], response[start:]
    else:
        x = prompt if prompt.rstrip().endswith("<think>") else prompt + "<think>"
        body = "<think>" + response
    match = _OLD_THINK_BLOCK.search(body)
    text = match.group(1) if match else ""
    for token in ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"):
        text = text.replace(token, "")
    return x, text.strip() if match else ""


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<think", "</", "<", ">", "think", "/", "a", " ", "\n", "<answer>"])
TAGGED_TEXT = st.lists(FRAGMENTS, max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(prompt=TAGGED_TEXT, response=TAGGED_TEXT)
def test_split_turn_matches_the_old_regex_on_tag_fragments(prompt, response):
    assert split_turn(prompt, response) == old_split_turn(prompt, response)


def test_split_turn_is_linear_in_repeated_opening_tags():
    # 20,000 opening tags and no close: the regex took ~58 s on this; find takes milliseconds.
    response = "<think>" * 20_000 + "x" * 420_000
    start = time.perf_counter()
    for extraction in ("think_tags", "auto", "whole_response"):
        partition_turn("P", response, extraction)
    assert time.perf_counter() - start < 2.0
    assert split_turn("P", response) == ("P<think>", "")


def test_think_tags_extraction_is_ragens_split():
    for prompt, response in [("P", "<think>a</think>b"), ("P<think>", "a</think>"), ("P", "none"), ("P", "<think>x")]:
        part = partition_turn(prompt, response, "think_tags")
        assert (part.x, part.z) == split_turn(prompt, response)


def fake_encode(text):
    return tuple(ord(c) for c in text)


def test_turn_token_ids_tokenizes_prompt_and_reasoning_separately():
    assert turn_token_ids(fake_encode, prompt="ab", response="<think>c</think>") == (
        fake_encode("ab<think>"),
        (ord("c"),),
    )
    assert turn_token_ids(fake_encode, prompt="ab", reasoning="  c ") == (fake_encode("ab"), fake_encode("  c "))
    assert turn_token_ids(fake_encode, prompt_ids=[1, 2], response="x<think>c</think>") == ((1, 2), (ord("c"),))
    assert turn_token_ids(fake_encode, prompt_ids=[1], reasoning_ids=[]) == ((1,), ())
    assert turn_token_ids(fake_encode, prompt="ab", response="cd", extraction="whole_response") == (
        fake_encode("ab"),
        fake_encode("cd"),
    )


def test_columns_are_ascending_group_ids_with_the_first_rows_prompt():
    batch = ScoringBatch.from_rows([[3], [1], [3], [2]], [[9], [8], [7], []], [30, 10, 30, 20])
    assert batch.column_group_ids == (10, 20, 30)
    assert batch.column_prompts == ((1,), (2,), (3,))
    np.testing.assert_array_equal(batch.column_of_row, [2, 0, 2, 1])
    np.testing.assert_array_equal(batch.reasoning_lengths, [1, 1, 1, 0])


@pytest.mark.parametrize(
    ("prompts", "reasonings", "groups", "message"),
    [
        ([[1], [2]], [[1], [1]], [5, 5], "group 5: rows 0 and 1 carry different prompts"),
        ([[]], [[1]], [0], "row 0: the prompt must contain at least 1 token, got 0"),
        ([[1]], [[-1]], [0], "row 0: token ids must be >= 0"),
        ([], [], [], "a scoring batch needs at least one row, got 0"),
        ([[1]], [[1], [2]], [0], "one entry per row, got 1, 2 and 1"),
    ],
)
def test_bad_rows_are_refused_naming_the_row_or_group(prompts, reasonings, groups, message):
    with pytest.raises(BatchError, match=message):
        ScoringBatch.from_rows(prompts, reasonings, groups)
