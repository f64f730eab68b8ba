"""verl: real ``DataProto`` batches laid out as verl's PPO trainer, its agent loop and RAGEN build them.

verl is installed without its GPU stack (``pip install --no-deps verl`` plus ray, tensordict and
omegaconf, which ``verl.protocol`` imports); see scripts/setup.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch
import verl

from collapse_monitor import Monitor
from collapse_monitor.integrations.verl import log_batch, trajectories

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from scoring.models import build_tiny_random

    _, tok = build_tiny_random(seed=2)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_text(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def pad_rows(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    padded = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
    mask = [([0] * (width - len(r)) + [1] * len(r)) if left else ([1] * len(r) + [0] * (width - len(r))) for r in rows]
    return torch.tensor(padded), torch.tensor(mask)


def objects(values: list) -> Any:
    """A 1-D object array, as verl keeps non-tensor columns (ragged lists stay lists)."""
    out: Any = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def grpo_batch(tokenizer, n_prompts: int = 2, n: int = 3, with_response_mask: bool = True):
    """verl's GRPO layout: left-padded prompts, right-padded responses ending in EOS, uid per prompt."""
    eos = tokenizer.eos_token_id
    questions = [f"Is {p} a prime number?" for p in range(n_prompts) for _ in range(n)]
    answers = [
        f"<think>Check the divisors of {i // n}, try {i % n}.</think>{'yes' if i % 2 else 'no'}"
        for i in range(len(questions))
    ]
    prompts, prompt_mask = pad_rows([ids(tokenizer, prompt_text(tokenizer, q)) for q in questions], eos, left=True)
    responses, response_mask = pad_rows([[*ids(tokenizer, a), eos] for a in answers], eos, left=False)
    scores = torch.zeros(responses.shape)
    rewards = [float(i % 2) for i in range(len(questions))]
    scores[torch.arange(len(rewards)), response_mask.sum(-1) - 1] = torch.tensor(rewards)
    uids = [str(uuid.uuid4()) for _ in range(n_prompts)]
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "token_level_scores": scores,
    }
    if with_response_mask:
        tensors["response_mask"] = response_mask
    batch = verl.DataProto.from_dict(
        tensors=tensors, non_tensors={"uid": objects([uids[i // n] for i in range(len(questions))])}
    )
    return batch, questions, answers, rewards, uids


@pytest.mark.parametrize("with_response_mask", [True, False])
def test_a_grpo_batch_becomes_grouped_single_turn_text(tokenizer, with_response_mask):
    batch, questions, answers, rewards, uids = grpo_batch(tokenizer, with_response_mask=with_response_mask)
    sent = trajectories(batch, tokenizer)
    assert [t["group_id"] for t in sent] == [uids[0]] * 3 + [uids[1]] * 3
    assert [t["reward"] for t in sent] == rewards
    for t, question, answer in zip(sent, questions, answers):
        # chat-template markers and think tags survive; the padding and the final EOS do not
        assert t["turns"] == [{"prompt": prompt_text(tokenizer, question), "response": answer}]


def test_token_ids_are_sent_as_the_policy_saw_them(tokenizer):
    batch, questions, answers, _, _ = grpo_batch(tokenizer)
    sent = trajectories(batch, tokenizer, token_ids=True)  # the tokenizer only names EOS and padding here
    for t, question, answer in zip(sent, questions, answers):
        assert t["turns"] == [
            {
                "prompt_token_ids": ids(tokenizer, prompt_text(tokenizer, question)),
                "reasoning_token_ids": ids(tokenizer, answer),
            }
        ]


def test_agent_loop_responses_split_into_turns_at_the_model_token_runs(tokenizer):
    # verl's agent loop: responses = model tokens | tool tokens | model tokens | padding, response_mask 1/0/1/0
    eos = tokenizer.eos_token_id
    prompt = ids(tokenizer, prompt_text(tokenizer, "Find the key."))
    first, tool, second = (
        ids(tokenizer, "<think>Look left.</think>left"),
        ids(tokenizer, "\nYou see a key.\n"),
        ids(tokenizer, "<think>Take it.</think>take"),
    )
    response = first + tool + second + [eos]
    model = [1] * len(first) + [0] * len(tool) + [1] * (len(second) + 1)
    width = len(response) + 3
    batch = verl.DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt]),
            "responses": torch.tensor([response + [eos] * 3]),
            "response_mask": torch.tensor([model + [0] * 3]),
            "attention_mask": torch.tensor([[1] * len(prompt) + [1] * len(response) + [0] * 3]),
            "rm_scores": torch.tensor([[0.0] * (width - 4) + [2.0] + [0.0] * 3]),
        },
        non_tensors={"uid": objects(["task-0"])},
    )
    [sent] = trajectories(batch, tokenizer)
    assert sent["reward"] == 2.0
    assert sent["turns"] == [
        {"prompt": tokenizer.decode(prompt), "response": "<think>Look left.</think>left"},
        {"prompt": tokenizer.decode(prompt + first + tool), "response": "<think>Take it.</think>take"},
    ]


def ragen_batch(tokenizer, with_collapse_ids: bool):
    """RAGEN's full-context layout: whole conversations, responses = input_ids[:, 1:], loss_mask on the
    assistant turns, rm_scores at the last assistant token, group_ids (no uid before its trainer sets it)."""
    conversations, masks, xs, zs = [], [], [], []
    for env in range(4):
        tokens: list[int] = []
        mask: list[int] = []
        env_x, env_z = [], []
        messages = [
            {"role": "system", "content": "You play Sokoban."},
            {"role": "user", "content": f"Level {env // 2}."},
        ]
        for turn in range(2):
            head = ids(tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
            reasoning = f"Push {'up' if (env + turn) % 2 else 'down'} at turn {turn}."
            answer = ids(tokenizer, f"<think>{reasoning}</think><answer>Up</answer>")
            mask += [0] * (len(head) - len(tokens)) + [1] * len(answer)
            tokens = head + answer
            env_x.append(head + ids(tokenizer, "<think>"))
            env_z.append(ids(tokenizer, reasoning))
            messages += [
                {"role": "assistant", "content": f"<think>{reasoning}</think><answer>Up</answer>"},
                {"role": "user", "content": "Reward: 0"},
            ]
        conversations.append(tokens)
        masks.append(mask)
        xs.append(env_x)
        zs.append(env_z)
    input_ids, attention = pad_rows(conversations, tokenizer.eos_token_id, left=True)
    loss_mask, _ = pad_rows(masks, 0, left=True)
    rm_scores = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
    rm_scores[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    non_tensors = {"group_ids": np.array([0, 0, 1, 1]), "env_ids": np.arange(4)}
    if with_collapse_ids:
        non_tensors |= {"all_turns_prompt_ids": objects(xs), "all_turns_reasoning_ids": objects(zs)}
    batch = verl.DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention,
            "responses": input_ids[:, 1:],
            "loss_mask": loss_mask[:, 1:],
            "rm_scores": rm_scores,
        },
        non_tensors=non_tensors,
    )
    return batch, xs, zs


def test_a_ragen_batch_is_read_turn_by_turn_from_its_loss_mask(tokenizer):
    batch, xs, _ = ragen_batch(tokenizer, with_collapse_ids=False)
    sent = trajectories(batch, tokenizer)
    assert [t["group_id"] for t in sent] == [0, 0, 1, 1]
    assert [t["reward"] for t in sent] == [1.0, 0.0, 0.5, 0.5]
    for t, env_x in zip(sent, xs):
        assert len(t["turns"]) == 2
        for turn, x in zip(t["turns"], env_x):
            assert turn["prompt"] == tokenizer.decode(x[: -len(ids(tokenizer, "<think>"))])
            assert turn["response"].startswith("<think>Push ")
            assert turn["response"].endswith("</think><answer>Up</answer>")


def test_ragens_own_collapse_ids_are_sent_as_the_reasoning_it_scores(tokenizer):
    batch, xs, zs = ragen_batch(tokenizer, with_collapse_ids=True)
    sent = trajectories(batch, token_ids=True)
    assert [[(turn["prompt_token_ids"], turn["reasoning_token_ids"]) for turn in t["turns"]] for t in sent] == [
        list(zip(x, z)) for x, z in zip(xs, zs)
    ]
    as_text = trajectories(batch, tokenizer)
    assert as_text[0]["turns"][0] == {"prompt": tokenizer.decode(xs[0][0]), "reasoning": tokenizer.decode(zs[0][0])}


def test_a_batch_without_rewards_is_named(tokenizer):
    batch, *_ = grpo_batch(tokenizer)
    batch.batch.pop("token_level_scores")
    with pytest.raises(KeyError, match="holds no rewards"):
        trajectories(batch, tokenizer)
    with pytest.raises(ValueError, match="pass the tokenizer"):
        trajectories(grpo_batch(tokenizer)[0])


def test_log_batch_samples_before_decoding_and_the_service_receives_the_text(service, run_name, tmp_path, tokenizer):
    batch, questions, answers, rewards, _ = grpo_batch(tokenizer, n_prompts=4, n=2)
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, max_groups=2, strict=True)
    log_batch(monitor, 12, batch, tokenizer)
    assert monitor.close()
    [payload] = service.payloads(run_name)
    assert payload["step"] == 12
    sent = payload["trajectories"]
    assert len(sent) == 4
    assert len({t["group_id"] for t in sent}) == 2
    expected = {(prompt_text(tokenizer, q), a, r) for q, a, r in zip(questions, answers, rewards)}
    assert {(t["turns"][0]["prompt"], t["turns"][0]["response"], t["reward"]) for t in sent} <= expected
    assert monitor.stats().rows_sampled_out == 4  # drawn in log_batch, before decoding, and counted


def test_an_unreadable_batch_is_counted_and_never_raises_by_default(service, run_name, tmp_path, tokenizer):
    batch, *_ = grpo_batch(tokenizer)
    batch.batch.pop("token_level_scores")
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path)
    log_batch(monitor, 1, batch, tokenizer)
    assert monitor.stats().invalid == 1
    assert "holds no rewards" in (monitor.stats().last_error or "")
    monitor.close()
