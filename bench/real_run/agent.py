"""Multi-turn agent RL for real (issue 36): a GRPO loop of our own over ``bench.real_run.envs``.

    python -m bench.real_run.agent --arm rooms-healthy-s0 --out DIR [--url URL] [--steps N] [--smoke]

The policy is SmolLM2-135M-Instruct with a LoRA (``--smoke``: the tiny random Llama), loaded as
``bench.real_run.train`` loads it. Each step draws ``prompts`` initial states of the arm's
environment and plays ``generations`` episodes from each (the GRPO group), turn by turn: every
active episode's conversation so far is one row of a batched ``generate`` (sampling at temperature
1), the reply goes to the environment, and its next observation is appended as a user turn. The
conversation is kept as token ids, so what is trained, recorded and sent to the service is exactly
what the policy read and wrote, with no re-tokenisation.

The update is TRL 1.16's default GRPO (``loss_type="dapo"``, ``scale_rewards="group"``, one update a
batch, so the importance ratio is 1 and clipping never acts): the episode's advantage is its reward
minus its group's mean over the group's standard deviation (ddof 1, + 1e-4), and the loss is
``-sum(A_e * log p(token)) / n_tokens`` over every token the policy wrote (environment tokens masked
out, as TRL's ``env_mask`` does), minus the arm's entropy bonus, in micro-batches whose gradients
add up to the whole batch's (one normaliser a step). AdamW at a constant learning rate, gradients
clipped at norm 1 (TRL's default).

Writes ``DIR/steps.jsonl``: per step the reward, task success, the policy's entropy, the words-only
retrieval per turn index and each episode whole (token ids with turn boundaries, replies,
observations), so the step can be scored later exactly as a live run would be
(``bench.real_run.zoo score``). With ``--url`` each step also goes live to the service through the
client (``Monitor.log``) as multi-turn trajectories sent as token ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from bench.real_run import envs
from scoring.config import CACHE_DIR
from scoring.dependence import chance_corrected

log = logging.getLogger("agent")


def end_of_turn(tokenizer: Any) -> int:
    """The token that closes an assistant turn: SmolLM2's ``<|im_end|>`` (the tiny model's end of text)."""
    token = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return int(token if token is not None else tokenizer.eos_token_id)


def rollout(
    model: Any,
    tokenizer: Any,
    starts: list[envs.Start],
    generations: int,
    max_new_tokens: int,
    reward: str = "task",
    greedy: bool = False,
) -> list[dict[str, Any]]:
    """Plays ``generations`` episodes from each start; per episode its group, ids, turn spans, texts and its
    reward under the arm's ``reward`` kind (``envs.episode_reward``)."""
    import torch

    eos = end_of_turn(tokenizer)
    episodes = [envs.Episode(start) for start in starts for _ in range(generations)]
    ids: list[list[int]] = []
    for episode in episodes:
        first = [{"role": "user", "content": episode.opening}]
        text = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    turns: list[list[dict[str, Any]]] = [[] for _ in episodes]
    observations = [[e.opening] for e in episodes]
    policy = [[0] * len(x) for x in ids]  # 1 where the policy wrote the token
    while active := [i for i, e in enumerate(episodes) if not e.done]:
        width = max(len(ids[i]) for i in active)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        batch = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in active])  # [A, width], left-padded
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in active])
        with torch.no_grad():
            out = model.generate(
                input_ids=batch,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=not greedy,
                temperature=1.0 if not greedy else None,
                top_k=0 if not greedy else None,
                top_p=1.0 if not greedy else None,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row, i in enumerate(active):
            written = out[row, width:].tolist()
            reply_ids = written[: written.index(eos)] if eos in written else written
            prompt_end = len(ids[i])
            ids[i] += [*reply_ids, eos]
            # The closing <|im_end|> is the policy's when it wrote one, the chat format's when the reply was cut.
            policy[i] += [1] * len(reply_ids) + [int(eos in written)]
            reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
            turns[i].append({"prompt_end": prompt_end, "reply_end": prompt_end + len(reply_ids), "reply": reply})
            observation = episodes[i].step(reply)
            if observation is not None:
                observations[i].append(observation)
                following = tokenizer.encode(
                    f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
                )
                ids[i] += following
                policy[i] += [0] * len(following)
    return [
        {
            "group": g // generations,
            "ids": ids[g],
            "policy_mask": policy[g],
            "turns": [
                {**turn, "observation": observations[g][k], "content": list(episodes[g].contents[k])}
                for k, turn in enumerate(turns[g])
            ],
            "correct": episodes[g].correct,
            "solved": episodes[g].is_solved,
            "task_reward": episodes[g].task_reward(),
            "reward": envs.episode_reward(reward, episodes[g], [t["reply"] for t in turns[g]]),
        }
        for g in range(len(episodes))
    ]


def grpo_step(
    model: Any,
    optimizer: Any,
    episodes: list[dict[str, Any]],
    rewards: list[float],
    generations: int,
    entropy_coef: float,
    scale_rewards: bool = True,
    kept_groups: set[int] | None = None,
) -> dict[str, float]:
    """One GRPO update on the episodes (module docstring); ``kept_groups``: train on these groups only (a filter).

    One episode a forward pass, the logits computed only where the next token is the policy's
    (``logits_to_keep``): a whole batch's [B, T, V] logits took 14 GB. Gradients add up over the episodes
    under one normaliser, the step's token count, so the update is the whole batch's.
    Returns the step's figures: the loss, the policy's mean token entropy over every token it wrote, and
    the number of tokens trained on."""
    import torch

    grouped = torch.tensor(rewards, dtype=torch.float64).view(-1, generations)  # [groups, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = (centred / (grouped.std(dim=1, keepdim=True) + 1e-4) if scale_rewards else centred).view(-1)
    trained = [e for e in range(len(episodes)) if kept_groups is None or episodes[e]["group"] in kept_groups]
    n_tokens = sum(sum(episodes[e]["policy_mask"]) for e in trained)
    figures = {"loss": 0.0, "entropy": 0.0, "trained_tokens": float(n_tokens)}
    if n_tokens == 0:
        return figures  # no group kept: no update (the caller counts a skipped step)
    optimizer.zero_grad(set_to_none=True)
    entropy_sum = 0.0
    for e in trained:
        ids = torch.tensor([episodes[e]["ids"]])  # [1, T]
        wrote = torch.tensor(episodes[e]["policy_mask"][1:], dtype=torch.bool)  # [T-1]: token t+1 is the policy's
        positions = torch.nonzero(wrote).view(-1)  # [n]: where the logits predict a policy token
        logits = model(input_ids=ids, logits_to_keep=positions).logits[0].float()  # [n, V]
        logp = torch.log_softmax(logits, dim=-1)
        token_logp = logp.gather(-1, ids[0, positions + 1][:, None]).squeeze(-1)  # [n]
        token_entropy = -(logp.exp() * logp).sum(-1)  # [n]
        policy_term = -float(advantages[e]) * token_logp.sum()
        entropy_term = token_entropy.sum()
        loss = (policy_term - entropy_coef * entropy_term) / n_tokens
        loss.backward()
        figures["loss"] += float(loss.detach())
        entropy_sum += float(entropy_term.detach())
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    figures["entropy"] = entropy_sum / n_tokens
    return figures


def step_figures(step: int, episodes: list[dict[str, Any]], rewards: list[float]) -> dict[str, Any]:
    """The step's words-only figures: per turn index the replies' retrieval of their own observation."""
    n = len(episodes)
    per_turn = []
    for k in range(max(len(e["turns"]) for e in episodes)):
        present = [e["turns"][k] for e in episodes if len(e["turns"]) > k]
        accuracy, chance = envs.turn_retrieval(
            [t["reply"] for t in present], [t["observation"] for t in present], [tuple(t["content"]) for t in present]
        )
        per_turn.append(
            {
                "turn": k + 1,
                "episodes": len(present),
                "word_retrieval": accuracy,
                "word_retrieval_chance": chance,
                "word_retrieval_above_chance": chance_corrected(accuracy, chance) if chance < 1 else None,
                "mean_words": sum(len(envs.words(t["reply"])) for t in present) / len(present),
            }
        )
    measured = [t["word_retrieval_above_chance"] for t in per_turn if t["word_retrieval_above_chance"] is not None]
    return {
        "step": step,
        "reward_mean": sum(rewards) / n,
        "task_success": sum(e["solved"] for e in episodes) / n,
        "task_reward_mean": sum(e["task_reward"] for e in episodes) / n,
        "turns_mean": sum(len(e["turns"]) for e in episodes) / n,
        # The ground truth of the step: the mean over turn indices of the per-turn retrieval above chance.
        "word_retrieval_above_chance": sum(measured) / len(measured) if measured else None,
        "per_turn": per_turn,
        "mean_words": sum(len(envs.words(t["reply"])) for e in episodes for t in e["turns"])
        / max(sum(len(e["turns"]) for e in episodes), 1),
        "example": [t["reply"] for t in episodes[0]["turns"]],
    }


def trajectories_of(episodes: list[dict[str, Any]], rewards: list[float]) -> list[dict[str, Any]]:
    """The step as the client sends it: multi-turn trajectories, each turn's prompt and reply as token ids."""
    return [
        {
            "group_id": e["group"],
            "reward": reward,
            "turns": [
                {
                    "prompt_token_ids": e["ids"][: t["prompt_end"]],
                    "reasoning_token_ids": e["ids"][t["prompt_end"] : t["reply_end"]],
                }
                for t in e["turns"]
            ],
        }
        for e, reward in zip(episodes, rewards, strict=True)
    ]


FILTERS = {  # the remedy trial's selections (envs.REMEDY_FILTERS), by the client's own SNRFilter
    "ragen-linear": {"strategy": "top_p", "value": 0.9, "top_p_prob_mode": "linear"},
    "ragen-softmax": {"strategy": "top_p", "value": 0.9, "top_p_prob_mode": "softmax"},
    # What docs/alerts.md advises (SNRFilter's defaults: linear). It was softmax until 2026-12-06, before any
    # on-alert arm was trained: remedy-ragen-softmax-s0 showed softmax top_p 0.9 keeps all 8 groups of a step
    # here (spreads of rewards in [0, 1] make it near uniform), so the arm would have tested nothing.
    "on-alert": {"strategy": "top_p", "value": 0.9, "top_p_prob_mode": "linear"},
    # DAPO's dynamic sampling, without refilling: every group kept but those whose rewards do not spread
    "dapo": {"variant": "upstream", "strategy": "top_p", "value": 1.0, "include_zero": False},
}
EVAL_EVERY = 5  # the remedy trial's held-out greedy evaluation: before training and every 5 steps
EVAL_PROMPTS = 64
EVAL_SEED = 9999  # one held-out prompt set for every arm and seed (visible words, never trained on)
SKIPS_TO_STOP = 5  # RAGEN stops after this many steps in a row whose filter kept no group


def arm_of(name: str) -> tuple[envs.AgentArm, str, int]:
    """(the arm's environment and reward, its filter, its seed) for a multi-turn or a remedy arm."""
    if name in envs.REMEDY_ARMS:
        remedy = envs.REMEDY_ARMS[name]
        return envs.REMEDY, remedy.filter, remedy.seed
    arm = envs.AGENT_ARMS[name]
    return arm, "none", arm.seed


def kept_groups(name: str, engaged: bool, episodes: list[dict[str, Any]], generations: int) -> set[int] | None:
    """The groups a step trains on under filter ``name`` (None: all of them)."""
    from collapse_monitor import SNRFilter

    if name not in FILTERS or not engaged:
        return None
    rewards = [[e["reward"] for e in episodes[g : g + generations]] for g in range(0, len(episodes), generations)]
    return set(SNRFilter(**FILTERS[name]).select(rewards).kept_groups)


def evaluate_policy(model: Any, tokenizer: Any, starts: list[envs.Start], max_new_tokens: int) -> dict[str, float]:
    """Greedy success and task reward on held-out starts, one episode each."""
    episodes = rollout(model, tokenizer, starts, 1, max_new_tokens, greedy=True)
    n = len(episodes)
    success = sum(e["solved"] for e in episodes) / n
    return {"success": success, "task_reward": sum(e["task_reward"] for e in episodes) / n}


class AlertWatch:
    """The service's own scoring and rules, in process, after every step: scoring that keeps pace.

    Each step is scored as a run with the defaults scores it (``zoo.run_snapshot``: the reference scorer,
    first_turn), and TemplateCollapse is replayed on the series so far with the run defaults."""

    def __init__(self, cache_dir: Path, smoke: bool) -> None:
        from bench.real_run import zoo
        from scoring import load_scorer

        self.settings = zoo.zoo_settings(cache_dir)
        self.scorer = load_scorer(self.settings.scoring_config("tiny-random" if smoke else "smollm2-135m"), cache_dir)
        self.run = zoo.run_snapshot("remedy", ("first_turn",), None)
        self.emas: dict[str, Any] = {}
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.states: list[str] = []  # TemplateCollapse's state after each step's scoring

    def latest(self) -> dict[str, Any]:
        """The last scored step's first_turn figures the rules read and TemplateCollapse's state then, kept in the
        step's record line (remedy-on-alert-s0 never fired, and its record could not say what the rule had seen)."""
        from service.alerts.rules import needed_series
        from service.schemas.alerts import AlertSettings

        figures = {name: self.series[name][-1][1] for name in needed_series(AlertSettings()) if self.series.get(name)}
        return {"figures": figures, "template_collapse": self.states[-1] if self.states else None}

    def fired(self, step: int, episodes: list[dict[str, Any]], rewards: list[float]) -> bool:
        from service.alerts.rules import evaluate
        from service.jobs.rollouts import score_rollouts
        from service.schemas.alerts import AlertSettings
        from service.schemas.inputs import BatchIn

        batch = BatchIn.model_validate({"step": step, "trajectories": trajectories_of(episodes, rewards)})
        scored = score_rollouts(batch, self.run, self.emas, lambda: self.scorer, self.settings)
        self.emas.update(scored.ema)
        for point in scored.points:
            if point.sampler == "first_turn":
                self.series.setdefault(point.name, []).append((step, point.value))
        episodes_ = [
            e for e in evaluate("remedy", "first_turn", self.series, AlertSettings()) if e.rule == "TemplateCollapse"
        ]
        now = [e for e in episodes_ if e.last_step == step]
        self.states.append(now[-1].state if now else "inactive")
        return any(e.fired_step is not None for e in episodes_)


def train(args: argparse.Namespace) -> None:
    import random

    import torch
    from peft import LoraConfig, get_peft_model

    from bench.real_run.train import load_policy

    arm, filter_name, seed = arm_of(args.arm)
    remedy = args.arm in envs.REMEDY_ARMS
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = load_policy(args.smoke, Path(args.cache_dir))
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, lora)
    # TRL's default optimizer: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) at a constant rate.
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate or arm.learning_rate, weight_decay=0.0
    )
    starts = envs.make_starts(arm.env, args.steps * args.prompts, seed=seed, hard=arm.hard)
    held_out = envs.make_starts(arm.env, EVAL_PROMPTS, seed=EVAL_SEED) if remedy else []
    watch = AlertWatch(Path(args.cache_dir), args.smoke) if filter_name == "on-alert" else None
    monitor = None
    if args.url:
        from collapse_monitor import Monitor

        monitor = Monitor(
            args.url,
            f"{args.run_prefix}-{args.arm}",
            strict=True,
            project="agents",
            metadata={
                "model": "tiny-random" if args.smoke else "SmolLM2-135M-Instruct",
                "algorithm": "GRPO (bench.real_run.agent, LoRA)",
                "environment": f"{arm.env}, {arm.reward} reward",
            },
            sampler={"samplers": ["first_turn", "trajectory", "per_turn"], "num_samples": None, "seed": 0},
            scorer="tiny-random" if args.smoke else "smollm2-135m",
            temperature=1.0,
        )
    path = out / "steps.jsonl"
    path.unlink(missing_ok=True)
    started = time.monotonic()
    engaged = filter_name in FILTERS and filter_name != "on-alert"  # on-alert: from the step after a firing
    skips = 0
    for step in range(1, args.steps + 1):
        evaluation = None
        if remedy and (step - 1) % EVAL_EVERY == 0:  # before the step's update: step 1 sees the base policy
            evaluation = evaluate_policy(model, tokenizer, held_out, args.max_new_tokens)
        chosen = starts[(step - 1) * args.prompts : step * args.prompts]
        episodes = rollout(model, tokenizer, chosen, args.generations, args.max_new_tokens, arm.reward)
        rewards = [e["reward"] for e in episodes]
        kept = kept_groups(filter_name, engaged, episodes, args.generations)
        update = grpo_step(
            model,
            optimizer,
            episodes,
            rewards,
            args.generations,
            arm.entropy_coef,
            scale_rewards=filter_name != "unscaled",
            kept_groups=kept,
        )
        skipped = update["trained_tokens"] == 0
        skips = skips + 1 if skipped else 0
        line = {
            **step_figures(step, episodes, rewards),
            "policy_entropy": update["entropy"],
            "loss": update["loss"],
            "filter": filter_name,
            "engaged": engaged,
            "kept_groups": None if kept is None else sorted(kept),
            "skipped": skipped,
            "eval": evaluation,
            "elapsed_seconds": round(time.monotonic() - started, 1),
            "episodes": episodes,
        }
        if watch is not None and not engaged:
            if watch.fired(step, episodes, rewards):
                engaged = True  # the alert arrived with this step's scoring: the next generation batch is filtered
                line["alert_fired"] = True
            line["watch"] = watch.latest()
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        log.info(
            "step %d: reward %.3f success %.2f retrieval %s entropy %.2f words %.1f kept %s eval %s (%r)",
            step,
            line["reward_mean"],
            line["task_success"],
            [round(t["word_retrieval_above_chance"] or 0, 2) for t in line["per_turn"]],
            update["entropy"],
            line["mean_words"],
            line["kept_groups"],
            evaluation,
            line["example"][:2],
        )
        if monitor is not None:
            monitor.log(step, trajectories_of(episodes, rewards), figures={"actor/entropy": update["entropy"]})
        if skips >= SKIPS_TO_STOP:
            log.warning("stopping: the filter kept no group %d steps in a row (RAGEN's rule)", skips)
            break
    if remedy:  # the final held-out evaluation, after the last update
        final = {"step": step, "eval": evaluate_policy(model, tokenizer, held_out, args.max_new_tokens)}
        with path.open("a") as f:
            f.write(json.dumps({"final": final}) + "\n")
    if monitor is not None:
        monitor.close(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=sorted({*envs.AGENT_ARMS, *envs.REMEDY_ARMS}), required=True)
    parser.add_argument("--out", required=True, help="this arm's folder: steps.jsonl")
    parser.add_argument("--url", default="", help="the service: each step goes live to run <prefix>-<arm>")
    parser.add_argument("--run-prefix", default="agent")
    parser.add_argument("--cache-dir", default=str(CACHE_DIR))
    parser.add_argument("--smoke", action="store_true", help="tiny random policy (the test suite's mode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--steps", type=int, default=None, help="14; the remedy trial 30")
    parser.add_argument("--prompts", type=int, default=8, help="initial states a step (the GRPO groups)")
    parser.add_argument("--generations", type=int, default=3, help="episodes per initial state")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per reply at most: 32; remedy 48")
    parser.add_argument("--learning-rate", type=float, default=None, help="unset: the arm's own")
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    remedy = args.arm in envs.REMEDY_ARMS
    args.steps = args.steps or (30 if remedy else 14)
    args.max_new_tokens = args.max_new_tokens or (48 if remedy else 32)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(args)


if __name__ == "__main__":
    main()
