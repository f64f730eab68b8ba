"""Run by test_trl under torchrun (2 processes, gloo, CPU): GRPO with the integration attached, until an alert stops it.

Reads OUT, URL and RUN from the environment; writes how many batches this rank's monitor sent, the
step it stopped at and whether its SNR filter was engaged. The run's TemplateCollapse is pending at step
1 and fires at step 2 (the settings of tiny_trainer.FIRE_AT_ONCE); only the main process watches the
alerts, and both ranks must engage the filter for step 2, save at step 2 and stop at step 3 together (a
rank left behind would hang in the next collective). Each rank holds one of the two groups, so the
filter (keeping one) masks all of one rank's rows.
"""

from __future__ import annotations

import os
import sys

from tiny_trainer import FIRE_AT_ONCE, grpo_config, paced_trainer

from collapse_monitor import Monitor, SNRFilter
from collapse_monitor.integrations.trl import attach


def main() -> None:
    # per process: 2 rows per micro-step, 2 micro-steps per generation -> 8 rows, 2 groups of 4, per step
    args = grpo_config(
        os.environ["OUT"],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=6,
        save_strategy="no",  # the only checkpoint is the one the pending alert asks for
    )
    prompts = [[{"role": "user", "content": f"Room {i}: which door leads out?"}] for i in range(16)]
    monitor = Monitor(
        os.environ["URL"], os.environ["RUN"], spool_dir=os.path.join(os.environ["OUT"], "spool"), alerts=FIRE_AT_ONCE
    )
    trainer = paced_trainer(monitor, args, prompts)
    # engaged at pending (the default waits for firing): the ranks must follow the main one a step before they stop
    snr_filter = SNRFilter(strategy="top_k_abs", value=1, engage="on_alert", states=("pending",))
    callback = attach(
        trainer, monitor, save_on=("pending",), stop_on=("firing",), alert_poll_seconds=0.1, snr_filter=snr_filter
    )
    trainer.train()
    monitor.close()
    rank = trainer.accelerator.process_index
    assert callback.snr_filter is not None
    engaged = callback.snr_filter.engagement.engaged
    sys.stdout.write(
        f"rank {rank} sent {monitor.stats().sent} stopped at {trainer.state.global_step} engaged {engaged}\n"
    )


if __name__ == "__main__":
    main()
