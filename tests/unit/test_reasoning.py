"""service/jobs/reasoning.py: how a batch's turns carry reasoning, and what ingest warns about."""

from __future__ import annotations

import pytest

from service.jobs.reasoning import group_extractions, ingest_warnings, reasoning_summary
from service.schemas.inputs import BatchIn


def warnings_of(payload, extraction):
    return ingest_warnings(payload, extraction, reasoning_summary(payload, extraction))


def batch(responses: list[str], rewards: list[float | None] | None = None, **turn: object) -> BatchIn:
    return BatchIn.model_validate(
        {
            "step": 1,
            "trajectories": [
                {
                    "group_id": i // 2,
                    "reward": 1.0 if rewards is None else rewards[i],
                    "turns": [{"prompt": f"<|im_start|>user\nQuestion {i // 2}<|im_end|>\n", "response": r, **turn}],
                }
                for i, r in enumerate(responses)
            ],
        }
    )


# What a plain GRPO run of SmolLM2 sends: no tags, or a think block cut by max_completion_length.
PLAIN = ["The answer is 4.", "Let me see: 2 + 2 = 4.", "<think>First add the two numbers and", "It is 4."]


@pytest.mark.parametrize(
    ("extraction", "counts"),
    [
        ("think_tags", {"think_tags": 4, "whole_response": 0, "with_reasoning": 0}),
        # every group has a turn without tags: auto reads all of their turns as whole responses
        ("auto", {"think_tags": 0, "whole_response": 4, "with_reasoning": 4}),
        ("whole_response", {"think_tags": 0, "whole_response": 4, "with_reasoning": 4}),
    ],
)
def test_each_turn_is_counted_by_how_its_reasoning_was_found(extraction, counts):
    summary, presence = reasoning_summary(batch(PLAIN), extraction)
    assert summary.model_dump() == {
        "extraction": extraction,
        "turns": 4,
        "as_sent": 0,
        "truncated_think": 1,
        **counts,
    }
    assert sum(bool(t.turns[0].reasoning_ids) for t in presence) == counts["with_reasoning"]


def test_auto_keeps_the_tags_of_groups_whose_every_turn_writes_them():
    tagged = ["<think>add</think>4", "<think>two and two", "no tags", "<think>sum</think>4"]
    assert group_extractions(batch(tagged), "auto") == {0: "auto", 1: "whole_response"}
    summary, _ = reasoning_summary(batch(tagged), "auto")
    assert (summary.think_tags, summary.whole_response, summary.truncated_think) == (2, 2, 1)
    assert group_extractions(batch(tagged), "think_tags") == {0: "think_tags", 1: "think_tags"}


def test_reasoning_sent_as_such_is_counted_as_sent():
    payload = BatchIn.model_validate(
        {
            "step": 1,
            "trajectories": [
                {"group_id": 0, "reward": 0.0, "turns": [{"prompt": "p", "reasoning": "r"}]},
                {"group_id": 1, "reward": 0.0, "turns": [{"prompt_token_ids": [1], "reasoning_token_ids": []}]},
            ],
        }
    )
    summary, _ = reasoning_summary(payload, "think_tags")
    assert (summary.as_sent, summary.with_reasoning) == (2, 1)


def test_a_batch_that_will_score_nothing_is_answered_with_a_warning_naming_the_fix():
    [warning] = warnings_of(batch(PLAIN), "think_tags")
    assert warning == (
        "no turn carries reasoning to score under reasoning_extraction=think_tags: 0 of 4 turns; 1 think blocks "
        "were opened and never closed; the batch will not be cross-scored (send reasoning or set the run's "
        "reasoning_extraction to auto or whole_response)"
    )
    assert warnings_of(batch(PLAIN * 2), "auto") == []  # 4 prompts: scored, and enough to see


def test_a_batch_of_too_few_prompts_to_see_a_collapse_is_answered_with_a_warning():
    two = "the trajectories carrying reasoning come from 2 prompts (group_id); TemplateCollapse sees a collapse"
    assert warnings_of(batch(PLAIN), "auto")[0].startswith(two)
    assert "3 prompts" in warnings_of(batch(PLAIN + PLAIN[:2]), "auto")[0]
    assert warnings_of(batch(PLAIN[:2]), "auto") == [
        "all 2 trajectories carrying reasoning share one prompt (group_id): cross-scoring needs 2 or more prompts, "
        "so the batch has no chance-corrected retrieval and TemplateCollapse does not judge it"
    ]
    # Prompts count only with reasoning: 4 groups, of which 3 carry it
    assert "3 prompts" in warnings_of(batch(["<think>a</think>"] * 6 + ["none"] * 2), "think_tags")[0]


def test_one_trajectory_with_reasoning_is_not_enough_and_missing_rewards_are_named():
    assert warnings_of(batch(["<think>a</think>", "none"]), "think_tags") == [
        "only 1 trajectory carries reasoning; cross-scoring needs at least 2, so the batch will not be cross-scored"
    ]
    four_prompts = ["<think>a</think>", "<think>b</think>"] * 4
    assert warnings_of(batch(four_prompts, rewards=[None] * 8), "auto") == [
        "all 8 rewards are missing (null): no reward figures"
    ]
