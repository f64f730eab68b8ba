"""Batches: normalisation, client-side sampling and the content-derived idempotency key."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from collapse_monitor.batches import (
    HEAD_BYTES,
    BatchLimits,
    TrajectoryError,
    encode,
    normalize,
    refit,
    refit_to_limits,
    sample_indices,
)


class IdTensor:
    """Stands for a tensor or array: anything with tolist()."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def tolist(self) -> list[float]:
        return list(self.values)


def test_single_turn_shorthand_becomes_one_turn_and_unknown_keys_pass_through():
    [out] = normalize([{"group_id": 3, "reward": 1, "prompt": "p", "response": "r", "future_field": "x"}])
    assert out == {"group_id": 3, "reward": 1.0, "future_field": "x", "turns": [{"prompt": "p", "response": "r"}]}


def test_nul_characters_and_lone_surrogates_become_replacement_characters_paired_surrogates_join():
    [out] = normalize([{"group_id": 0, "reward": 1, "prompt": "a\x00b", "response": "x\ud800y \ud83d\ude00"}])
    assert out["turns"] == [{"prompt": "a\ufffdb", "response": "x\ufffdy \U0001f600"}]


def test_multi_turn_trajectories_keep_their_turns_in_order_with_token_ids_as_plain_lists():
    [out] = normalize(
        [
            {
                "group_id": 0,
                "reward": 0.5,
                "turns": [
                    {"prompt_token_ids": IdTensor([1, 2]), "reasoning_token_ids": (3, 4)},
                    {"prompt": "again", "reasoning": "think", "token_entropies": [0.5, 1]},
                ],
            }
        ]
    )
    assert out["turns"] == [
        {"prompt_token_ids": [1, 2], "reasoning_token_ids": [3, 4]},
        {"prompt": "again", "reasoning": "think", "token_entropies": [0.5, 1.0]},
    ]


def test_a_flat_trajectory_carries_the_trainers_logprobs_into_its_turn():
    rows = normalize(
        [
            {
                "group_id": 0,
                "reward": 1,
                "prompt_token_ids": [1],
                "reasoning_token_ids": [2, 3],
                "reasoning_logprobs": IdTensor([-1, -0.5]),
            }
        ]
    )
    assert rows[0]["turns"] == [
        {"prompt_token_ids": [1], "reasoning_token_ids": [2, 3], "reasoning_logprobs": [-1.0, -0.5]}
    ]


@pytest.mark.parametrize("missing", [None, math.nan, math.inf, -math.inf])
def test_missing_rewards_travel_as_null(missing):
    rows = normalize([{"group_id": 0, "reward": missing, "prompt": "p", "response": "r"}])
    assert rows[0]["reward"] is None
    assert json.loads(encode("run", 1, rows)[1])["trajectories"][0]["reward"] is None


def test_a_trajectory_without_a_reward_is_sent_with_a_missing_reward():
    assert normalize([{"group_id": 0, "prompt": "p", "response": "r"}])[0]["reward"] is None


def test_string_group_ids_are_numbered_in_order_of_first_appearance():
    rows = normalize([{"group_id": u, "reward": 0, "prompt": "p", "response": "r"} for u in ["b", "a", "b", "c"]])
    assert [r["group_id"] for r in rows] == [0, 1, 0, 2]


def test_without_group_ids_identical_prompts_form_one_group():
    rows = normalize([{"reward": 0, "prompt": p, "response": "r"} for p in ["x", "y", "x"]])
    assert [r["group_id"] for r in rows] == [0, 1, 0]


@pytest.mark.parametrize(
    ("trajectories", "message"),
    [
        ([], "at least one trajectory"),
        ({"group_id": 0}, "must be a sequence of mappings"),
        (["text"], r"trajectories\[0\] must be a mapping, got str"),
        ([{"group_id": 0, "reward": 0, "response": "r"}], r"trajectories\[0\]\.turns\[0\] needs a prompt"),
        ([{"group_id": 0, "reward": 0, "prompt": "p"}], r"turns\[0\] needs a response"),
        ([{"group_id": 0, "reward": 0, "turns": []}], r"trajectories\[0\]\.turns must be a non-empty list"),
        ([{"group_id": 0, "reward": "high", "prompt": "p", "response": "r"}], r"reward must be a number or None"),
        ([{"group_id": 0, "reward": 0, "prompt": 7, "response": "r"}], r"prompt must be a string, got int"),
        (
            [{"group_id": 0, "reward": 0, "prompt": "p", "reasoning_token_ids": ["a"]}],
            r"reasoning_token_ids must hold integers",
        ),
        ([{"group_id": 0, "reward": 0, "prompt_token_ids": [math.inf], "response": "r"}], r"must hold integers"),
        ([{"group_id": 0, "reward": 0, "prompt": "p", "response": "r", "token_entropies": "ab"}], r"must hold numbers"),
        (
            [{"group_id": 0, "reward": 0, "prompt": "p", "response": "r", "token_entropies": [10**400]}],
            r"token_entropies must hold numbers",
        ),
        (
            [{"group_id": 0, "reward": 0, "prompt": "p", "response": "r", "token_entropies": [math.nan]}],
            r"token_entropies must be finite",
        ),
        (
            [
                {
                    "group_id": 0,
                    "reward": 0,
                    "prompt": "p",
                    "reasoning_token_ids": [1],
                    "reasoning_logprobs": [-math.inf],
                }
            ],
            r"reasoning_logprobs must be finite",
        ),
    ],
)
def test_malformed_trajectories_are_named(trajectories, message):
    with pytest.raises(TrajectoryError, match=message):
        normalize(trajectories)


def test_the_batch_key_is_the_same_for_the_same_content_and_differs_for_other_content():
    rows = normalize([{"group_id": 0, "reward": 1, "prompt": "p", "response": "r"}])
    key, body, _ = encode("grpo-1", 7, rows)
    again, body_again, _ = encode("grpo-1", 7, normalize([{"response": "r", "prompt": "p", "reward": 1.0, "group": 0}]))
    other, _, _ = encode("grpo-1", 7, normalize([{"group_id": 0, "reward": 0, "prompt": "p", "response": "r"}]))
    assert key == again
    assert body == body_again
    assert key.startswith("grpo-1-7-")
    assert len(key) == len("grpo-1-7-") + 16
    assert other != key
    assert json.loads(body) == {"idempotency_key": key, "step": 7, "trajectories": rows}


def test_an_explicit_idempotency_key_overrides_the_content_key():
    key, body, _ = encode(
        "grpo-1", 7, normalize([{"group_id": 0, "reward": 1, "prompt": "p", "response": "r"}]), "mine"
    )
    assert key == "mine"
    assert json.loads(body)["idempotency_key"] == "mine"


def test_a_passed_through_field_that_utf8_cannot_hold_is_sent_as_a_json_escape():
    rows = normalize([{"group_id": 0, "reward": 1, "prompt": "p", "response": "r", "note": "caf\u00e9 \ud800"}])
    _, body, _ = encode("run", 1, rows)
    assert json.loads(body)["trajectories"][0]["note"] == "caf\u00e9 \ud800"


def groups(n_groups: int, per_group: int) -> list[int]:
    return [g for g in range(n_groups) for _ in range(per_group)]


def test_without_limits_every_row_is_kept():
    assert sample_indices(groups(5, 4), max_groups=None, max_rows=None, seed=0, step=3) == list(range(20))


def test_max_groups_keeps_whole_groups_and_is_the_same_draw_for_the_same_step():
    ids = groups(10, 4)
    kept = sample_indices(ids, max_groups=3, max_rows=None, seed=0, step=5)
    assert kept == sorted(kept)
    kept_groups = {ids[i] for i in kept}
    assert len(kept_groups) == 3
    assert kept == [i for i, g in enumerate(ids) if g in kept_groups]
    assert kept == sample_indices(ids, max_groups=3, max_rows=None, seed=0, step=5)
    draws = {tuple(sample_indices(ids, max_groups=3, max_rows=None, seed=0, step=s)) for s in range(20)}
    assert len(draws) > 1  # other steps draw other groups


def test_max_rows_keeps_whole_groups_that_fit():
    ids = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    for step in range(10):
        kept = sample_indices(ids, max_groups=None, max_rows=5, seed=1, step=step)
        assert len(kept) <= 5
        for g in {ids[i] for i in kept}:
            assert [i for i in kept if ids[i] == g] == [i for i, h in enumerate(ids) if h == g]


def test_a_group_larger_than_max_rows_is_subsampled():
    kept = sample_indices([0] * 10, max_groups=None, max_rows=4, seed=0, step=1)
    assert len(kept) == 4
    assert len(set(kept)) == 4


def sized(group: int, k: int, n_bytes: int) -> dict:
    return {"group_id": group, "reward": float(k % 2), "prompt": f"p{group}", "response": "x" * n_bytes}


SMALL = BatchLimits(max_body_bytes=2 * HEAD_BYTES)  # trajectories may take HEAD_BYTES (64 KiB) of it


def test_a_body_that_fits_is_the_canonical_json_of_the_whole_batch():
    rows = normalize([sized(g, k, 100) | {"note": "caf\u00e9"} for g in range(3) for k in range(2)])
    key, body, fit = encode("run", 4, rows, figures={"loss": 0.5})
    whole = json.dumps(
        {"step": 4, "trajectories": rows, "figures": {"loss": 0.5}},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    assert body == b'{"idempotency_key":' + json.dumps(key).encode() + b"," + whole[1:]
    assert key == f"run-4-{hashlib.sha256(whole).hexdigest()[:16]}"
    assert fit.left_out == {}


def test_a_step_past_the_body_is_sent_as_the_whole_groups_that_fit_in_order():
    # 4 groups of ~15 KB; group 0's 4th trajectory passes the body: the group goes, and group 4 then fits
    first = [sized(g, k, 5000) for g in range(4) for k in range(3)]
    rows = normalize([*first, sized(0, 3, 70_000), *(sized(4, k, 5000) for k in range(3))])
    _, body, fit = encode("run", 1, rows, limits=SMALL)
    sent = json.loads(body)["trajectories"]
    assert [t["group_id"] for t in sent] == [g for g in range(1, 5) for _ in range(3)]
    assert fit.left_out == {0: 4}
    assert len(body) <= SMALL.max_body_bytes


def test_the_trajectory_count_leaves_out_the_group_it_would_split():
    rows = normalize([sized(g, k, 10) for g in range(4) for k in range(3)])
    _, body, fit = encode("run", 1, rows, limits=BatchLimits(max_trajectories=7))
    assert [t["group_id"] for t in json.loads(body)["trajectories"]] == [0, 0, 0, 1, 1, 1]
    assert fit.left_out == {2: 3, 3: 3}


def test_a_group_larger_than_the_body_sends_its_trajectories_that_fit():
    rows = normalize([sized(0, k, 10_000) for k in range(10)])
    _, body, fit = encode("run", 1, rows, limits=SMALL)
    assert len(json.loads(body)["trajectories"]) == 6  # 64 KiB of ~10 KB trajectories
    assert fit.left_out == {0: 4}


def test_texts_and_token_lists_past_their_limits_keep_a_prompts_last_and_a_responses_first_entries():
    rows = normalize(
        [
            {"group_id": 0, "reward": 1.0, "prompt": "abcdefghij" * 3, "response": "0123456789" * 3},
            {
                "group_id": 0,
                "reward": 0.0,
                "prompt_token_ids": list(range(100)),
                "reasoning_token_ids": list(range(100, 200)),
                "reasoning_logprobs": [-0.5] * 100,
                "token_entropies": [0.5] * 100,
            },
        ]
    )
    _, body, fit = encode("run", 1, rows, limits=BatchLimits(max_text_chars=12, max_token_ids=10))
    text, ids = (t["turns"][0] for t in json.loads(body)["trajectories"])
    assert (text["prompt"], text["response"]) == ("abcdefghij"[-2:] + "abcdefghij", "0123456789" + "01")
    assert ids["prompt_token_ids"] == list(range(90, 100))
    assert ids["reasoning_token_ids"] == list(range(100, 110))
    assert len(ids["reasoning_logprobs"]) == len(ids["token_entropies"]) == 10  # still one per reasoning token
    assert fit.n_cut == 2
    assert fit.left_out == {}


def test_a_single_turn_past_the_body_alone_is_cut_longest_lists_first_into_one_body():
    # 200,000 reasoning ids are ~1.3 MB of JSON: sent as they were, the body was refused (a 5M-id turn: 35 MB)
    rows = normalize(
        [{"group_id": 0, "reward": 1.0, "prompt_token_ids": [1, 2, 3], "reasoning_token_ids": list(range(200_000))}]
    )
    _, body, fit = encode("run", 1, rows, limits=BatchLimits(max_body_bytes=2 * HEAD_BYTES, max_token_ids=10**6))
    assert len(body) <= 2 * HEAD_BYTES
    [turn] = [t["turns"][0] for t in json.loads(body)["trajectories"]]
    assert turn["prompt_token_ids"] == [1, 2, 3]  # short: whole
    assert 1000 < len(turn["reasoning_token_ids"]) < 200_000
    assert turn["reasoning_token_ids"] == list(range(len(turn["reasoning_token_ids"])))  # its first ids
    assert fit.n_cut == 1


def test_a_turn_count_past_the_limit_keeps_the_first_turns():
    turns = [{"prompt": f"p{k}", "response": f"r{k}"} for k in range(10)]
    _, body, fit = encode(
        "run", 1, normalize([{"group_id": 0, "reward": 1.0, "turns": turns}]), limits=BatchLimits(max_turns=4)
    )
    assert [t["prompt"] for t in json.loads(body)["trajectories"][0]["turns"]] == ["p0", "p1", "p2", "p3"]
    assert fit.n_cut == 1


def test_a_refit_cuts_the_longest_texts_to_the_fraction_asked_and_keys_the_new_content():
    prompts = ["short prompt", "m" * 4000, "l" * 20_000]
    rows = normalize([{"group_id": g, "reward": 1.0, "prompt": p, "response": "r" * 50} for g, p in enumerate(prompts)])
    key, body, _ = encode("run", 3, rows, figures={"loss": 0.5})
    new_key, new_body = refit("run", body, 0.25)
    batch = json.loads(new_body)
    sent = [t["turns"][0] for t in batch["trajectories"]]
    chars = sum(len(t["prompt"]) + len(t["response"]) for t in sent)
    before = sum(len(p) + 50 for p in prompts)
    assert 0.2 * before < chars <= 0.25 * before
    assert sent[0]["prompt"] == "short prompt"  # short texts stay whole
    assert len(sent[1]["prompt"]) == len(sent[2]["prompt"])  # the long ones cut to one length, their last chars
    assert (batch["step"], batch["figures"]) == (3, {"loss": 0.5})
    rest = json_without_key(new_body)
    assert new_key == batch["idempotency_key"] == f"run-3-{hashlib.sha256(rest).hexdigest()[:16]}" != key
    assert refit("run", body, 0.25) == (new_key, new_body)  # a refit replayed is the same batch


def json_without_key(body: bytes) -> bytes:
    batch = json.loads(body)
    del batch["idempotency_key"]
    return json.dumps(batch, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def test_limits_told_replace_the_defaults_and_lower_only_those_given():
    told = {"max_body_bytes": 200_000, "max_text_chars": 10**7, "max_turns": 4, "max_scoring_cost": 5, "extra": 1}
    assert BatchLimits().told(told, is_given=False) == BatchLimits(
        max_body_bytes=200_000, max_text_chars=10**7, max_turns=4
    )
    given = BatchLimits(max_text_chars=100, max_body_bytes=1 << 30)
    assert given.told(told) == BatchLimits(max_body_bytes=200_000, max_text_chars=100, max_turns=4)
    # what the client cannot take leaves a limit as it is: not an int, a bool, below what the service allows
    odd = {"max_turns": True, "max_token_ids": "7", "max_trajectories": 0, "max_body_bytes": 1023}
    assert BatchLimits().told(odd, is_given=False) == BatchLimits()
    assert BatchLimits().told(None) == BatchLimits()


def test_a_body_too_small_for_the_head_room_keeps_half_of_it_for_trajectories():
    assert BatchLimits(max_body_bytes=1024).trajectory_bytes == 512
    assert BatchLimits(max_body_bytes=2 * HEAD_BYTES).trajectory_bytes == HEAD_BYTES


def test_a_body_refused_for_a_limit_is_fitted_to_it_again_under_its_new_content_key():
    rows = normalize([sized(g, k, 1000) for g in range(4) for k in range(2)])
    _, body, _ = encode("run", 3, rows, idempotency_key="given", figures={"loss": 0.5})
    limits = BatchLimits(max_text_chars=10, max_trajectories=4)
    key, fitted, fit = refit_to_limits("run", body, limits)
    assert (key, fitted) == encode("run", 3, rows, figures={"loss": 0.5}, limits=limits)[:2]
    batch = json.loads(fitted)
    assert [t["group_id"] for t in batch["trajectories"]] == [0, 0, 1, 1]
    assert all(len(t["turns"][0]["response"]) == 10 for t in batch["trajectories"])
    assert batch["figures"] == {"loss": 0.5}
    assert fit.left_out == {2: 2, 3: 2}
    assert refit_to_limits("run", fitted, limits)[1] == fitted  # fitted already: left as it is
