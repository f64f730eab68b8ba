"""Step files written exactly as each trainer writes them: names, places, fields, types and nesting.

None of these trainers installs here (slime, miles, prime-rl and ROLL are not on the package index;
AReaL and verifiers pull dozens of packages, uvicorn among them), except verl, whose own writer is
used. Each writer below does what the cited source does, step by step; ``expected(step)`` is what
the service must receive for that step, as groups of (reward, turns) (``canonical``).

Sources, as read for this client (2026):

* verl 0.9.1 (installed): ``verl/trainer/ppo/v1/trainer_base.py``, ``PPOTrainer._log_rollout_data``
  (L1297-1345: TransferQueue keys ``{uid}_{session}_{index}`` sorted, texts decoded with
  ``skip_special_tokens=True``, ``rm_scores`` summed, ``uid`` as the extra column) and
  ``_write_generations`` (L1226-1260, compiled from the installed source and run as is);
  ``agent_loop_tq.py`` L177-193 (one key per agent-loop output, every output of a session sharing
  the final reward).
* prime-rl ``src/prime_rl/monitors/file.py`` ``FileMonitor.log_episodes`` (``rollouts/step_{step}/
  {kind}/{subset}/traces.jsonl``, appended, ``orjson.dumps(episode.to_record())`` + newline) and
  ``src/prime_rl/orchestrator/orchestrator.py`` L585-592 (each arriving episode to ``all`` at once),
  L680-684 (the shipped cohort to ``effective``); the record is verifiers 0.4.0's
  ``Episode.to_record()`` (``verifiers/v1/episode.py``, ``trace.py``, ``graph.py``: ``model_dump(
  mode="json", exclude_none=True)``), laid out here key for key as the real classes dump it.
* AReaL ``areal/infra/workflow_executor.py`` ``WorkflowExecutor._dump_trajectory`` (L834-921):
  ``{fileroot}/{experiment}/{trial}/rollout/{max(versions)}/{task_id}.jsonl``, appended, one row per
  sample with a completion: ``task_id, sample_idx, seqlen, prompt_len, head_version,
  tail_version, reward, prompt, completion``, decoded with ``skip_special_tokens=False``.
* ROLL ``roll/pipeline/rlvr/utils.py`` ``dump_rollout_to_specific_path`` and
  ``write_to_json_process`` (L19-72): the non-tensor columns, ``responses`` decoded with
  ``skip_special_tokens=True``, ``scores``, ``sampling_params``, ``global_step``, kept to
  ``COLUMMNS_CONFIG``'s names, one JSON line in ``rollout_dump_data.step_{global_step}.jsonl``; the
  dataset columns as ROLL's ``data/math_deepmath_deal.jsonl`` holds them (``messages`` a JSON string).
* slime ``slime/utils/types.py`` (``Sample``, ``Sample.to_dict``), ``slime/observability/
  rollout_data_utils.py`` ``save_debug_rollout_data`` (L140-152: ``torch.save({"rollout_id",
  "samples": [to_dict()]}, path)``, ``eval_{id}`` for evaluation), ``slime/utils/arguments.py``
  L1890-1892 (``--dump-details DIR`` -> ``DIR/rollout_data/{rollout_id}.pt``),
  ``examples/search-r1/generate_with_search.py`` L145-270 (a multi-turn sample: tool tokens masked 0).
"""

from __future__ import annotations

import ast
import enum
import functools
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

N_PROMPTS, N_SAMPLES = 3, 2


def canonical(trajectories: list[dict]) -> list[list[tuple]]:
    """The groups of a batch, each as its sorted (reward, turns) pairs; group ids themselves do not matter."""
    groups: dict[Any, list[tuple]] = {}
    for t in trajectories:
        groups.setdefault(t["group_id"], []).append((t["reward"], json.dumps(t["turns"], sort_keys=True)))
    return sorted(sorted(g, key=repr) for g in groups.values())


def question(p: int, step: int) -> str:
    return f"What is {p} + {step}?"


def answer(p: int, k: int, step: int) -> str:
    return f"<think>{p} plus {step}, try {k}</think>{p + step + k}"


def reward(p: int, k: int) -> float:
    return float((p + k) % 2)


# verl V1 ------------------------------------------------------------------------------------------


@functools.cache
def verl_v1_write_generations() -> Any:
    """verl V1's ``PPOTrainer._write_generations``, compiled from the installed source."""
    import verl

    source = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "trainer_base.py"
    tree = ast.parse(source.read_text())
    [trainer] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer"]
    [function] = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_write_generations"]
    function.decorator_list = []  # a @staticmethod in the class
    namespace: dict = {"os": os, "json": json, "np": np, "print": functools.partial(print, file=sys.stderr)}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(source), "exec"), namespace)
    return namespace["_write_generations"]


class VerlV1:
    """GRPO through verl V1's agent loop: prompt p's session k; prompt 0's sessions make two outputs (two turns)."""

    name = "verl"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def outputs(self, step: int) -> list[tuple[str, str, str, float]]:
        """(key, decoded prompt, decoded response, summed rm_scores) per agent-loop output."""
        out = []
        for p in range(N_PROMPTS):
            uid = f"{uuid.UUID(int=p)}-{step}"  # verl: str(uuid.uuid4()) per dataset prompt
            for k in range(N_SAMPLES):
                final = reward(p, k)  # every output of a session carries the session's final reward
                prompt = f"user\n{question(p, step)}\nassistant\n"
                if p == 0:
                    out.append((f"{uid}_{k}_0", prompt, f"<think>look up {k}</think>search({p})", final))
                    prompt = f"{prompt}search({p})\ntool\n{p}\nassistant\n"
                    out.append((f"{uid}_{k}_1", prompt, answer(p, k, step), final))
                else:
                    out.append((f"{uid}_{k}_0", prompt, answer(p, k, step), final))
        return out

    def write_step(self, step: int) -> None:
        outputs = self.outputs(step)[::-1]  # TransferQueue hands the keys back in any order

        def sort_key(key: str) -> tuple:  # _log_rollout_data: sorted by ({sample}, int rollout, int output)
            parts = key.rsplit("_", 2)
            return (parts[0], int(parts[1]), int(parts[2]))

        outputs.sort(key=lambda o: sort_key(o[0]))
        keys, inputs, responses, scores = (list(column) for column in zip(*outputs))
        verl_v1_write_generations()(
            inputs, responses, [None] * len(keys), scores, {"uid": keys}, str(self.folder), step
        )

    def expected(self, step: int) -> list[list[tuple]]:
        trajectories: dict[str, dict] = {}
        for key, prompt, response, score in self.outputs(step):
            uid, session, _ = key.rsplit("_", 2)
            t = trajectories.setdefault(f"{uid}_{session}", {"group_id": uid, "reward": score, "turns": []})
            t["turns"].append({"prompt": prompt, "response": response})
        return canonical(list(trajectories.values()))


# prime-rl -----------------------------------------------------------------------------------------


def episode_record(step: int, p: int, k: int, *, kind: str = "train") -> dict:
    """One ``Episode.to_record()`` as verifiers 0.4.0 dumps it: prompt p's k-th rollout, reasoning split off.

    Prompt 0 calls a tool first (two sampled assistant nodes); a second, non-trainable agent (a
    judge) adds a trace that must not be sent.
    """
    now = 1_790_000_000.0 + step
    task = {"type": "MathTask", "data": {"question": question(p, step), "answer": str(p + step)}, "key": f"t{p}"}
    system = {"role": "system", "content": "Answer briefly."}
    user = {"role": "user", "content": question(p, step)}
    nodes: list[dict] = [
        {"semantic_parents": [], "message": system, "sampled": False, "timestamp": now, "token_ids": [1, 2],
         "mask": [False, False], "is_content": [], "logprobs": []},
        {"parent": 0, "semantic_parents": [], "message": user, "sampled": False, "timestamp": now, "token_ids": [3],
         "mask": [False], "is_content": [], "logprobs": []},
    ]  # fmt: skip
    if p == 0:
        call = {"id": f"call_{k}", "name": "lookup", "arguments": json.dumps({"n": p})}
        nodes += [
            {"parent": 1, "semantic_parents": [], "message": {"role": "assistant", "content": f"checking {k}",
             "tool_calls": [call]}, "sampled": True, "timestamp": now, "token_ids": [4, 5], "mask": [False, True],
             "is_content": [], "logprobs": [-0.5]},
            {"parent": 2, "semantic_parents": [], "message": {"role": "tool", "tool_call_id": f"call_{k}",
             "content": str(p), "name": "lookup"}, "sampled": False, "timestamp": now, "token_ids": [6],
             "mask": [False], "is_content": [], "logprobs": []},
        ]  # fmt: skip
    final = {"role": "assistant", "content": str(p + step + k), "reasoning_content": f"{p} plus {step}, try {k}"}
    nodes.append(
        {"parent": len(nodes) - 1, "semantic_parents": [], "message": final, "sampled": True, "timestamp": now,
         "token_ids": [7, 8], "mask": [False, True], "is_content": [], "logprobs": [-0.25]}
    )  # fmt: skip
    trace = {
        "version": 1, "id": uuid.uuid4().hex, "verifiers": {"version": "0.4.0"}, "task": task,
        "agent": {"config": {"timeout": {}, "retries": {"max_retries": 0, "rules": []}, "network_notice": True},
                  "name": "solver", "trainable": True},
        "tools": [], "nodes": nodes, "calls": [], "mm_token_type_id_map": {}, "request_rewrites": [],
        "response_rewrites": [],
        "rewards": {"correct": {"score": reward(p, k), "weight": 1.0}, "format": {"score": 1.0, "weight": 0.25},
                    "judge": None},
        "metrics": {"turns": float(len(nodes))}, "info": {}, "extra_usage": [], "is_completed": True, "ok": True,
        "is_timeout": False, "stop_condition": "no_tools", "errors": [],
        "timing": {"start": now, "boot": {"start": 0.0, "end": 0.0}, "setup": {"start": 0.0, "end": 0.0},
                   "agent": {"start": now, "end": now + 1, "model": {"duration": 0.5}, "harness": {"duration": 0.5}},
                   "finalize": {"start": 0.0, "end": 0.0}, "scoring": {"start": 0.0, "end": 0.0}},
        "num_input_tokens": 3, "num_output_tokens": 2, "num_total_tokens": 5,
    }  # fmt: skip
    judge = {
        **trace,
        "id": uuid.uuid4().hex,
        "agent": {**cast("dict", trace["agent"]), "name": "judge", "trainable": False},
        "rewards": {"verdict": {"score": 0.0, "weight": 1.0}},
    }
    work = {"type": kind, "step": step - 1, "policy": {"start": step - 1, "end": step - 1}}
    return {
        "id": uuid.uuid4().hex, "env": {"id": "math", "name": "math"}, "task": task, "group": {"id": f"g{step}-{p}"},
        "run": {"type": "train", "id": "run-1", "work": work}, "ok": True, "is_timeout": False, "errors": [],
        "traces": [trace, judge], "num_input_tokens": 6, "num_output_tokens": 4, "num_total_tokens": 10,
    }  # fmt: skip


class PrimeRl:
    """prime-rl's orchestrator: each episode appended to ``all`` as it arrives, the shipped ones to ``effective``."""

    name = "prime-rl"

    def __init__(self, folder: Path) -> None:
        self.folder = folder  # the orchestrator's output_dir

    def log_episodes(self, episodes: list[dict], step: int, kind: str, subset: str) -> None:
        path = self.folder / "rollouts" / f"step_{step}" / kind / subset / "traces.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            for episode in episodes:  # orjson.dumps(..., option=OPT_APPEND_NEWLINE): compact JSON, one line
                f.write(json.dumps(episode, separators=(",", ":")).encode() + b"\n")

    def write_step(self, step: int) -> None:
        episodes = [episode_record(step, p, k) for p in range(N_PROMPTS) for k in range(N_SAMPLES)]
        for episode in episodes:
            self.log_episodes([episode], step, "train", "all")
        late = episode_record(step, N_PROMPTS, 0)  # arrived, but left out of the shipped cohort
        self.log_episodes([late], step, "train", "all")
        if step % 2 == 0:  # an evaluation every other step, under eval/: never sent by default
            self.log_episodes([episode_record(step, 9, 0, kind="eval")], step, "eval", "all")
            self.log_episodes([episode_record(step, 9, 0, kind="eval")], step, "eval", "effective")
        self.log_episodes(episodes, step, "train", "effective")

    def expected(self, step: int) -> list[list[tuple]]:
        out = []
        for p in range(N_PROMPTS):
            for k in range(N_SAMPLES):
                history = f"system: Answer briefly.\nuser: {question(p, step)}"
                turns = []
                if p == 0:
                    turns.append(
                        {
                            "prompt": f"{history}\nassistant:",
                            "response": f'checking {k}\n[tool_call lookup({{"n": {p}}})]',
                        }
                    )
                    history = f"{history}\nassistant: checking {k}\ntool: {p}"
                turns.append({"prompt": f"{history}\nassistant:", "reasoning": f"{p} plus {step}, try {k}"})
                out.append({"group_id": p, "reward": reward(p, k) + 0.25, "turns": turns})
        return canonical(out)


# AReaL --------------------------------------------------------------------------------------------


class AReaL:
    """AReaL's rollout workers: each task's samples appended to ``rollout/{version}/{task_id}.jsonl``."""

    name = "areal"

    def __init__(self, folder: Path, tokenizer: Any) -> None:
        self.folder = folder  # {fileroot}/{experiment_name}/{trial_name}
        self.tokenizer = tokenizer
        self.task_ids = iter(range(1_000_000))  # TaskIdGenerator: one id per submitted task

    def traj(self, step: int, p: int) -> tuple[dict, list[tuple[str, str, float]]]:
        """One task's batched trajectory dict (right-padded), as the RLVR workflow returns it."""
        prompt = f"<|endoftext|>user: {question(p, step)}\nassistant:"
        rows, expected = [], []
        for k in range(N_SAMPLES):
            p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            c_ids = [*self.tokenizer(answer(p, k, step), add_special_tokens=False)["input_ids"], 0]  # EOS
            rows.append((p_ids, c_ids, reward(p, k)))
            expected.append((self.tokenizer.decode(p_ids), self.tokenizer.decode(c_ids), reward(p, k)))
        width = max(len(p) + len(c) for p, c, _ in rows) + 3
        input_ids = torch.zeros((N_SAMPLES, width), dtype=torch.long)
        loss_mask = torch.zeros((N_SAMPLES, width), dtype=torch.long)
        attention_mask = torch.zeros((N_SAMPLES, width), dtype=torch.long)
        versions = torch.full((N_SAMPLES, width), -1, dtype=torch.long)
        for i, (p_ids, c_ids, _) in enumerate(rows):
            n = len(p_ids) + len(c_ids)
            input_ids[i, :n] = torch.tensor(p_ids + c_ids)
            loss_mask[i, len(p_ids) : n] = 1
            attention_mask[i, :n] = 1
            versions[i, len(p_ids) : n] = step  # generated under policy version `step`
        traj = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "attention_mask": attention_mask,
            "rewards": torch.tensor([r for _, _, r in rows], dtype=torch.float32),
            "versions": versions,
        }
        return traj, expected

    def dump_trajectory(self, traj: dict, task_id: int) -> None:
        """``_dump_trajectory``, step by step."""
        versions = traj["versions"].flatten().tolist()
        version_dir = self.folder / "rollout" / str(max(versions))
        version_dir.mkdir(parents=True, exist_ok=True)
        with open(version_dir / f"{task_id}.jsonl", "a") as f:
            for i in range(traj["input_ids"].shape[0]):
                seqlen = traj["attention_mask"][i].sum().item()
                if seqlen == 0:
                    continue
                ids = traj["input_ids"][i, :seqlen].tolist()
                mask = traj["loss_mask"][i, :seqlen].tolist()
                if mask[-1] != 1:
                    continue
                prompt_end = seqlen - sum(mask)
                record = {
                    "task_id": task_id,
                    "sample_idx": i,
                    "seqlen": seqlen,
                    "prompt_len": prompt_end,
                    "head_version": min(versions),
                    "tail_version": max(versions),
                    "reward": traj["rewards"][i].item(),
                    "prompt": self.tokenizer.decode(ids[:prompt_end], skip_special_tokens=False),
                    "completion": self.tokenizer.decode(ids[prompt_end:], skip_special_tokens=False),
                }
                f.write(json.dumps(record) + "\n")

    def write_step(self, step: int) -> None:
        self.expectations = getattr(self, "expectations", {})
        groups = []
        for p in range(N_PROMPTS):
            traj, expected = self.traj(step, p)
            self.dump_trajectory(traj, next(self.task_ids))
            groups.append(expected)
        self.expectations[step] = groups

    def expected(self, step: int) -> list[list[tuple]]:
        return canonical(
            [
                {"group_id": g, "reward": r, "turns": [{"prompt": p, "response": c}]}
                for g, group in enumerate(self.expectations[step])
                for p, c, r in group
            ]
        )


# ROLL ---------------------------------------------------------------------------------------------

ROLL_COLUMNS = [
    "global_step", "id", "source", "difficulty", "prompt", "messages", "ground_truth", "case_type",
    "test_case_function", "test_cases", "tag", "domain", "responses", "scores", "sampling_params",
]  # fmt: skip


class Roll:
    """ROLL's RLVR pipeline: the step's generate output dumped as one line of columns."""

    name = "roll"

    def __init__(self, folder: Path, tokenizer: Any) -> None:
        self.folder = folder  # rollout_dump_dir (an absolute path: ROLL's json_checker)
        self.tokenizer = tokenizer

    def system(self) -> str:
        return "Please reason step by step, and put your final answer within \\boxed{}."

    def conversation(self, p: int, step: int) -> list[dict]:
        return [{"role": "system", "content": self.system()}, {"role": "user", "content": question(p, step)}]

    def write_step(self, step: int) -> None:
        rows = self.rows()  # DataProto.repeat: each prompt num_return_sequences times in a row
        non_tensor = {
            "id": np.array([str(p + 10 * step) for p, _ in rows], dtype=object),
            "source": np.array(["deepmath_103k"] * len(rows), dtype=object),
            "prompt": np.array([question(p, step) for p, _ in rows], dtype=object),
            "messages": np.array([json.dumps(self.conversation(p, step)) for p, _ in rows], dtype=object),
            "ground_truth": np.array([str(p + step) for p, _ in rows], dtype=object),
            "tag": np.array(["deepmath_103k"] * len(rows), dtype=object),
            "domain": np.array(["math_rule"] * len(rows), dtype=object),
        }
        responses = self.responses(step)
        scores = torch.tensor([reward(p, k) for p, k in rows])
        write_data: dict[str, Any] = {k: v.copy() for k, v in non_tensor.items()}
        write_data["responses"] = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        write_data["scores"] = scores.tolist()
        write_data["sampling_params"] = [json.dumps({"generation_config": {"num_return_sequences": N_SAMPLES}})] * len(
            rows
        )
        write_data["global_step"] = [step] * len(rows)
        # write_to_json_process, in its own process in ROLL
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in write_data.items() if k in ROLL_COLUMNS}
        with open(
            self.folder / f"rollout_dump_data.step_{data.get('global_step', [0])[0]}.jsonl", "w", encoding="utf-8"
        ) as f:
            f.write(json.dumps(data, ensure_ascii=False) + "\n")

    def responses(self, step: int) -> torch.Tensor:
        """The generated ids, right-padded with the pad token, each ending with EOS."""
        ids = [self.tokenizer(answer(p, k, step), add_special_tokens=False)["input_ids"] + [0] for p, k in self.rows()]
        width = max(map(len, ids))
        return torch.tensor([r + [0] * (width - len(r)) for r in ids])

    def rows(self) -> list[tuple[int, int]]:
        return [(p, k) for p in range(N_PROMPTS) for k in range(N_SAMPLES)]

    def expected(self, step: int) -> list[list[tuple]]:
        prompt = "system: {}\nuser: {}\nassistant:"
        texts = self.tokenizer.batch_decode(self.responses(step), skip_special_tokens=True)
        return canonical(
            [
                {"group_id": p, "reward": reward(p, k),
                 "turns": [{"prompt": prompt.format(self.system(), question(p, step)), "response": text}]}
                for (p, k), text in zip(self.rows(), texts)
            ]
        )  # fmt: skip


# slime --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """slime's ``Sample`` (slime/utils/types.py): the fields a rollout fills, in its order, and ``to_dict``."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        value["spec_info"] = {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                              "completion_token_num": self.response_length}  # fmt: skip
        value["prefix_cache_info"] = {
            "cached_tokens": 0,
            "total_prompt_tokens": len(self.tokens) - self.response_length,
        }
        return value


class Slime:
    """slime's rollout manager: a GRPO rollout of Samples; prompt 0 is a search-r1 style multi-turn rollout."""

    name = "slime"

    def __init__(self, folder: Path, tokenizer: Any) -> None:
        self.folder = folder  # --dump-details
        self.tokenizer = tokenizer
        self.next_index = 0

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def samples(self, step: int) -> list[Sample]:
        out = []
        for p in range(N_PROMPTS):
            prompt = f"<|endoftext|>user\n{question(p, step)}\nassistant\n"  # --apply-chat-template: text
            for k in range(N_SAMPLES):
                if p == 0:  # model run, tool observation (loss_mask 0), model run
                    first, observation, last = (
                        f"<think>search {k}</think><search>{p}</search>",
                        f"<information>{p}</information>",
                        answer(p, k, step),
                    )
                    runs = [(self.ids(first), 1), (self.ids(observation), 0), ([*self.ids(last), 0], 1)]
                else:
                    runs = [([*self.ids(answer(p, k, step)), 0], 1)]
                response_ids = [t for ids, _ in runs for t in ids]
                sample = Sample(
                    group_index=step * 100 + p, index=self.next_index, prompt=prompt,
                    tokens=self.ids(prompt) + response_ids, response=self.tokenizer.decode(response_ids),
                    response_length=len(response_ids), label=str(p + step), reward={"acc": reward(p, k), "fmt": 1.0},
                    loss_mask=[m for ids, m in runs for _ in ids] if p == 0 else None,
                    rollout_log_probs=[-0.5] * len(response_ids), status=Sample.Status.COMPLETED,
                    rollout_routed_experts=np.zeros((len(response_ids), 2, 1), dtype=np.int32),
                )  # fmt: skip
                self.next_index += 1
                out.append(sample)
        return out

    def write_step(self, step: int) -> None:
        path = self.folder / "rollout_data" / f"{step}.pt"  # --dump-details DIR: save_debug_rollout_data
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": step, "samples": [s.to_dict() for s in self.samples(step)]}, path)
        if step == 2:  # an evaluation: eval_{rollout_id}.pt, never sent
            torch.save(
                {"rollout_id": step, "samples": [s.to_dict() for s in self.samples(99)]}, path.with_name("eval_2.pt")
            )

    def expected(self, step: int) -> list[list[tuple]]:
        self.next_index, saved = 0, self.next_index
        out = []
        for s in self.samples(step):
            if s.loss_mask is None:
                turns = [{"prompt": s.prompt, "response": s.response}]
            else:
                prompt_ids, response_ids = s.tokens[: -s.response_length], s.tokens[-s.response_length :]
                cut = [i for i in range(1, len(s.loss_mask)) if s.loss_mask[i] != s.loss_mask[i - 1]]
                a, b = cut  # model run [0, a), tool [a, b), model run [b, end)
                decode = self.tokenizer.decode
                turns = [
                    {"prompt": decode(prompt_ids), "response": decode(response_ids[:a])},
                    {"prompt": decode(prompt_ids + response_ids[:b]), "response": decode(response_ids[b:])},
                ]
            out.append({"group_id": s.group_index, "reward": cast("dict", s.reward)["acc"], "turns": turns})
        self.next_index = saved
        return canonical(out)


def wait_for(condition: Any, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
