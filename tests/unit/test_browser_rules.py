"""The pure parts of the browser defences: Host names, same origin, the hosts a service answers to."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.api.middleware import host_name, is_same_origin
from service.settings import Settings


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("localhost:8000", "localhost"),
        ("Example.ORG", "example.org"),
        ("[::1]:8000", "[::1]"),
        ("[::1]", "[::1]"),
        ("127.0.0.1", "127.0.0.1"),
        ("", ""),
        ("localhost:1@evil.example", "localhost:1@evil.example"),  # no port: the whole value is the name
        ("localhost:80x", "localhost:80x"),
        ("[::1]:8000@evil.example", "[::1]:8000@evil.example"),
    ],
)
def test_the_name_of_a_host_header_drops_its_port(host, name):
    assert host_name(host) == name


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("http://LOCALHOST:8000", "localhost:8000", True),
        ("https://monitor.example.org", "monitor.example.org", True),  # behind a TLS proxy
        ("https://monitor.example.org:443", "monitor.example.org", True),
        ("http://monitor.example.org", "monitor.example.org:80", True),
        ("http://[::1]:8000", "[::1]:8000", True),
        ("http://127.0.0.1:9999", "127.0.0.1:8000", False),
        ("http://evil.example", "127.0.0.1:8000", False),
        ("https://monitor.example.org", "monitor.example.org:8000", False),
        ("null", "127.0.0.1:8000", False),
        ("file://", "127.0.0.1:8000", False),
        ("http://127.0.0.1:8000/path", "127.0.0.1:8000", False),
    ],
)
def test_same_origin_means_the_host_and_port_the_request_was_sent_to(origin, host, same):
    assert is_same_origin(origin, host) is same


def test_a_service_answers_to_loopback_names_its_bound_host_and_the_listed_ones():
    assert Settings(_env_file=None).trusted_hosts == ["localhost", "127.0.0.1", "[::1]", "127.0.0.1"]
    assert Settings(_env_file=None, host="10.0.0.5", allowed_hosts=["Monitor.example.org"]).trusted_hosts == [
        "localhost",
        "127.0.0.1",
        "[::1]",
        "monitor.example.org",
        "10.0.0.5",
    ]
    assert Settings(_env_file=None, host="0.0.0.0").trusted_hosts == ["*"]  # its names are unknown to it
    assert "*" not in Settings(_env_file=None, host="0.0.0.0", allowed_hosts=["api"]).trusted_hosts
    with pytest.raises(ValidationError, match=r"a host pattern is a name, '\*.example.com' or '\*', got 'a\*b'"):
        Settings(_env_file=None, allowed_hosts=["a*b"])
