"""Writes a real Trackio project the way verl and TRL write their rollout traces, in a process of its own.

    python trackio_writers.py verl|trl PROJECT STEP [STEP ...]   (TRACKIO_DIR says where)

* verl 0.9.1: ``RolloutTraceConfig.init(..., backend="trackio", token2text=True)``, then each
  rollout is an agent loop's ``run`` decorated with ``rollout_trace_op`` inside
  ``rollout_trace_attr(step, sample_index, rollout_n, validate)``, as
  ``verl/experimental/agent_loop/agent_loop.py`` ``_run_agent_loop`` does; its output carries
  ``prompt_ids``/``response_ids`` (decoded by the loop's tokenizer) and ``reward_score``.
* TRL's async GRPO: ``log_rollout_traces(samples, step=version, report_to=["trackio"])`` from
  ``trl/experimental/async_grpo/async_grpo_trainer.py``, with its own ``RolloutSample``.

Both libraries' code runs unchanged; only the model is replaced by fixed texts. Each process is
one trainer run (a restart is a second process), and ``trackio.finish()`` flushes its writes.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import trackio

N_PROMPTS = 3
N_ROLLOUTS = 2


def prompt_of(p: int, step: int) -> str:
    return f"What is {p} + {step}?"


def answer_of(p: int, step: int, k: int) -> str:
    return f"{p} plus {step}, attempt {k}: {p + step + k}"


class _Chars:
    """A tokenizer whose ids are characters: verl decodes the ids it traces with the loop's tokenizer."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(map(chr, ids))


def write_verl(project: str, steps: list[int]) -> None:
    from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

    RolloutTraceConfig.init(project, "verl-run", backend="trackio", token2text=True)

    class Loop:
        tokenizer = _Chars()

        @rollout_trace_op  # type: ignore[untyped-decorator]  # verl's decorator carries no types
        async def run(self, _sampling_params: dict, **kwargs) -> dict:
            text, answer = kwargs["raw_prompt"][-1]["content"], kwargs["answer"]
            return {"prompt_ids": [ord(c) for c in text], "response_ids": [ord(c) for c in answer], **kwargs["out"]}

    async def rollouts(step: int, validate: bool) -> None:
        for p in range(N_PROMPTS):
            for k in range(N_ROLLOUTS):
                with rollout_trace_attr(step=step, sample_index=p, rollout_n=k, validate=validate):
                    raw = [{"role": "user", "content": prompt_of(p, step)}]
                    out = {"reward_score": float(k == 0)}
                    await Loop().run({}, raw_prompt=raw, answer=answer_of(p, step, k), out=out)

    for step in steps:
        asyncio.run(rollouts(step, validate=False))
    asyncio.run(rollouts(steps[-1], validate=True))  # a validation pass: not training
    trackio.finish()


def write_trl(project: str, steps: list[int]) -> None:
    from trl.experimental.async_grpo.async_grpo_trainer import log_rollout_traces
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    trackio.init(project=project, name="trl-run")
    for step in steps:
        samples = [
            RolloutSample(
                prompt=[{"role": "user", "content": prompt_of(p, step)}],
                completion=[{"role": "assistant", "content": answer_of(p, step, k)}],
                input_ids=np.arange(10),
                completion_mask=np.array([0] * 6 + [1] * 4),
                old_log_probs=np.zeros(10),
                advantage=0.5 - (k != 0),
                model_version=step,
                group_id=p,
                metrics={"reward": float(k == 0)},
            )
            for p in range(N_PROMPTS)
            for k in range(N_ROLLOUTS)
        ]
        log_rollout_traces(samples, step=step, report_to=["trackio"])
    trackio.finish()


if __name__ == "__main__":
    trainer, name, *numbers = sys.argv[1:]
    {"verl": write_verl, "trl": write_trl}[trainer](name, [int(n) for n in numbers])
