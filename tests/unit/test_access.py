"""The pure parts of access: loopback addresses, what a token may write, token digests."""

from __future__ import annotations

import hashlib

import pytest

from service.access import Token, check_run_prefix, covers, digest, is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("monitor.internal", False),  # a name may resolve to anything
        ("", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def token(scope: str, prefix: str = "") -> Token:
    return Token(id=1, scope=scope, run_prefix=prefix, name=None, hint="cm_abcde", is_revoked=False)


def test_an_ingest_token_writes_the_runs_of_its_prefix_and_an_admin_any():
    assert token("ingest", "team-a-").may_write("team-a-grpo")
    assert not token("ingest", "team-a-").may_write("team-b-grpo")
    assert token("ingest").may_write("anything")
    assert token("admin").may_write("anything")
    assert not token("read").may_write("anything")


@pytest.mark.parametrize(
    ("prefix", "run", "covered"),
    [
        ("team-a", "team-a", True),
        ("team-a", "team-a-grpo", True),
        ("team-a", "team-a_ppo", True),
        ("team-a", "team-a.7", True),
        ("team-a", "team-admin-x", False),  # the raw startswith of issue 17
        ("team-a", "team-ab", False),
        ("team-a", "team-", False),
        ("team-a-", "team-a-grpo", True),
        ("team-a-", "team-a-", True),
        ("team-a-", "team-a", False),
        ("team-a.", "team-a.x", True),
        ("", "anything", True),
    ],
)
def test_a_prefix_covers_whole_name_segments_only(prefix, run, covered):
    assert covers(prefix, run) is covered
    assert token("ingest", prefix).may_write(run) is covered


@pytest.mark.parametrize("prefix", ["-team", "team a", "team/a", "t" * 129, "\u00e9quipe"])
def test_a_prefix_no_run_name_can_start_with_is_refused(prefix):
    with pytest.raises(ValueError, match="a run prefix is the start of run names"):
        check_run_prefix("ingest", prefix)


def test_only_ingest_tokens_take_a_prefix():
    check_run_prefix("ingest", "team-a")
    check_run_prefix("admin", "")
    with pytest.raises(ValueError, match="a run prefix limits ingest tokens only; a read token cannot have one"):
        check_run_prefix("read", "team-a")


def test_the_digest_is_the_sha256_of_the_token():
    assert digest("cm_x") == hashlib.sha256(b"cm_x").hexdigest()
