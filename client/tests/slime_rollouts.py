"""A slime rollout manager in one process: ``python slime_rollouts.py POLICY_DIR SAVE_DIR ROLLOUT_ID...``.

Calls ``log_rollout`` as slime's ``log_rollout_data`` calls the function named by
``--custom-rollout-log-function-path``, once per rollout, then exits (a trainer stopped midway, or
done); the monitor's exit hook delivers what is queued. Configured by the environment
(``COLLAPSE_MONITOR_URL``, ``COLLAPSE_MONITOR_SPOOL_DIR``); the run is named after ``SAVE_DIR``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer_writers import Slime
from transformers import AutoTokenizer

from collapse_monitor.integrations.slime import log_rollout


def main() -> None:
    policy_dir, save_dir, *rollout_ids = sys.argv[1:]
    trainer = Slime(Path(save_dir), AutoTokenizer.from_pretrained(policy_dir))
    args = argparse.Namespace(hf_checkpoint=policy_dir, save=save_dir, wandb_group=None, reward_key="acc")
    for rollout_id in map(int, rollout_ids):
        assert log_rollout(rollout_id, args, trainer.samples(rollout_id), {"rollout/raw_reward": 0.5}, 1.0) is False


if __name__ == "__main__":
    main()
