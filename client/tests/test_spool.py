"""The spool: atomic files, logged order kept across restarts, refused requests set aside."""

from __future__ import annotations

import json

from collapse_monitor.spool import Spool


def test_requests_come_back_in_the_order_written_also_from_a_new_process(tmp_path):
    spool = Spool(tmp_path / "run")
    spool.open()
    first = spool.put("batch", 7, b'{"step": 7}')
    spool.put("checkpoint", None, b'{"path": "/ckpt"}')
    spool.put("batch", 3, b'{"step": 3}')  # a resumed trainer: logged later, at an earlier step
    assert spool.pending == 3
    assert spool.pending_bytes == 11 + 17 + 11

    reopened = Spool(tmp_path / "run")
    reopened.open()
    # the sequence continues after the files left, so what a new process logs is sent after them
    assert reopened.put("batch", 1, b"{}").sequence == 3
    order = []
    while (entry := reopened.head()) is not None:
        order.append((entry.kind, entry.step, reopened.read(entry)))
        reopened.remove(entry)
    assert order == [
        ("batch", 7, b'{"step": 7}'),
        ("checkpoint", None, b'{"path": "/ckpt"}'),
        ("batch", 3, b'{"step": 3}'),
        ("batch", 1, b"{}"),
    ]
    assert not first.path.exists()


def test_half_written_files_are_discarded_when_the_spool_opens(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".000000000000-batch-1.json.123.tmp").write_bytes(b'{"ste')
    spool = Spool(folder)
    spool.open()
    assert spool.pending == 0
    assert list(folder.iterdir()) == []


def test_a_refused_request_is_kept_with_its_reason_and_leaves_the_queue(tmp_path):
    spool = Spool(tmp_path / "run")
    spool.open()
    entry = spool.put("batch", 4, b'{"step": 4}')
    kept = spool.reject(entry, {"status": 422, "detail": "bad field"})
    assert spool.pending == 0
    assert spool.head() is None
    assert kept.read_bytes() == b'{"step": 4}'
    assert json.loads(kept.with_suffix(".error.json").read_text())["detail"] == "bad field"

    never_spooled = spool.reject_body("batch", 5, b'{"step": 5}', {"status": 413})
    assert never_spooled.name.startswith("000000000001-batch-5")
    reopened = Spool(tmp_path / "run")
    reopened.open()
    assert reopened.put("batch", 6, b"{}").sequence == 2  # rejected files keep their numbers
