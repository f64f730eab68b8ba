"""``collapse-monitor migrate``: the compose stack's one-shot migration, on SQLite and Postgres."""

from __future__ import annotations

import json
import os

import pytest
from alembic.script import ScriptDirectory

from service.cli import main
from service.storage.database import alembic_config, current_revision

pytestmark = pytest.mark.integration


def test_migrate_goes_to_head_then_to_a_named_revision_and_refuses_an_unknown_one(
    empty_database_url, capsys, monkeypatch
):
    for key in [k for k in os.environ if k.startswith("COLLAPSE_MONITOR_")]:
        monkeypatch.delenv(key)
    script = ScriptDirectory.from_config(alembic_config(empty_database_url))
    head = script.get_current_head()
    assert head is not None
    previous = script.get_revision(head).down_revision
    assert isinstance(previous, str)

    assert main(["migrate", "--database-url", empty_database_url]) == 0
    assert json.loads(capsys.readouterr().out) == {"from_revision": None, "revision": head}
    assert main(["migrate", "--database-url", empty_database_url]) == 0  # nothing to do: same answer, no error
    assert json.loads(capsys.readouterr().out) == {"from_revision": head, "revision": head}

    assert main(["migrate", "--database-url", empty_database_url, "--revision", previous]) == 0
    assert json.loads(capsys.readouterr().out) == {"from_revision": head, "revision": previous}
    assert current_revision(empty_database_url) == previous

    assert main(["migrate", "--database-url", empty_database_url, "--revision", "nope"]) == 2
    assert capsys.readouterr().err == "error: --revision: Can't locate revision identified by 'nope'\n"
    assert current_revision(empty_database_url) == previous
