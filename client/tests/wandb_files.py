"""An offline W&B run read back from its ``.wandb`` file, with W&B's own protobuf records (tracker tests)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run's ``.wandb`` file, parsed with W&B's own protobuf ``Record``.

    The file is a LevelDB log (as wandb-core writes it): a 7-byte header (``:W&B``, magic, version),
    then 32 KiB blocks of chunks, each a 4-byte checksum, a 2-byte little-endian length and a type
    (1 a whole record, 2-4 its first, middle and last pieces); a block's last 6 bytes or fewer are padding.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, at, pending, records = run_file.read_bytes(), 32768, 7, b"", []
    while at + 7 <= len(data):
        if block - at % block < 7:
            at += block - at % block
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path, timeout: float = 60.0) -> tuple[list[dict], dict[str, str]]:
    """An offline W&B run's history rows, as logged, and each defined metric's step axis (``{name: step_metric}``).

    Waits (``timeout``, generous) for the run's ``exit`` record: after another run in the same process,
    wandb-core was seen to finish writing the file after ``wandb.finish()`` returned.
    """
    deadline = time.monotonic() + timeout
    records = wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout} s"
        time.sleep(0.2)
        records = wandb_records(run_file)
    history, axes = [], {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif record.WhichOneof("record_type") == "metric" and record.metric.step_metric:
            axes[record.metric.name or record.metric.glob_name] = record.metric.step_metric
    return history, axes
