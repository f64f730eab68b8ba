"""``service.cli.dashboards.push_dashboards`` against an HTTP server on loopback that answers like Grafana's API."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.cli.dashboards import DashboardPushError, push_dashboards
from tests.integration.test_dashboards import dashboards

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_push_helper_does_not_import_fastapi():
    code = "import sys, service.cli.dashboards; print('fastapi' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "False"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeGrafana:
    """Answers folder lookup/creation and dashboard saves the way Grafana's HTTP API does."""

    folders: list[dict[str, Any]] = field(default_factory=list)
    refuse: tuple[str, int, dict[str, Any]] | None = None  # (path, status, body) answered instead
    prefix: str = ""
    requests: list[Recorded] = field(default_factory=list)

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        api = path.removeprefix(self.prefix).split("?", 1)[0]
        if self.refuse and api == self.refuse[0]:
            return self.refuse[1], self.refuse[2]
        if (method, api) == ("GET", "/api/folders"):
            return 200, self.folders
        if (method, api) == ("POST", "/api/folders"):
            folder = {"id": len(self.folders) + 1, "uid": body.get("uid") or "generated-uid", "title": body["title"]}
            self.folders.append(folder)
            return 200, folder
        if (method, api) == ("POST", "/api/dashboards/db"):
            uid = body["dashboard"]["uid"]
            slug = re.sub(r"[^a-z0-9]+", "-", body["dashboard"]["title"].lower()).strip("-")
            return 200, {
                "id": 10 + len(self.requests),
                "uid": uid,
                "url": f"/d/{uid}/{slug}",
                "status": "success",
                "version": 1,
                "slug": slug,
            }
        return 404, {"message": "Not found"}


@pytest.fixture
def grafana() -> Iterator[tuple[FakeGrafana, str]]:
    fake = FakeGrafana()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.handle_any()

        def do_POST(self) -> None:
            self.handle_any()

        def handle_any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            fake.requests.append(Recorded(self.command, self.path, dict(self.headers.items()), body))
            status, answer = fake.answer(self.command, self.path, body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_push_creates_the_folder_and_saves_every_dashboard_with_overwrite(grafana):
    fake, url = grafana
    answers = push_dashboards(url, "glsa_token")

    assert [(r.method, r.path) for r in fake.requests] == [
        ("GET", "/api/folders"),
        ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"),
        ("POST", "/api/dashboards/db"),
    ]
    assert all(r.headers["Authorization"] == "Bearer glsa_token" for r in fake.requests)
    assert fake.requests[1].body == {"title": "collapse-monitor", "uid": "collapse-monitor"}
    files = dashboards()
    uploads = [r.body for r in fake.requests[2:]]
    for upload, name in zip(uploads, ["fleet.json", "run.json"], strict=True):  # one per file, in name order
        assert upload["overwrite"] is True
        assert upload["folderUid"] == "collapse-monitor"
        assert upload["dashboard"] == {**files[name], "id": None}
    assert [a["uid"] for a in answers] == ["collapse-monitor-fleet", "collapse-monitor-run"]
    assert all(a["status"] == "success" for a in answers)


def test_push_reuses_an_existing_folder_found_by_title_under_a_sub_path(grafana):
    fake, url = grafana
    fake.prefix = "/grafana"
    fake.folders.append({"id": 3, "uid": "abc123", "title": "Training"})

    push_dashboards(f"{url}/grafana/", "t", folder_title="Training")

    assert [(r.method, r.path) for r in fake.requests] == [
        ("GET", "/grafana/api/folders"),
        ("POST", "/grafana/api/dashboards/db"),
        ("POST", "/grafana/api/dashboards/db"),
    ]
    assert {r.body["folderUid"] for r in fake.requests[1:]} == {"abc123"}


@pytest.mark.parametrize(
    ("refused", "status", "message", "expected"),
    [
        (
            "/api/dashboards/db",
            412,
            "A dashboard with the same name in the folder already exists",
            "Grafana refused dashboard fleet.json: HTTP 412: A dashboard with the same name in the folder already "
            "exists (a different dashboard with the same title may already exist in the folder)",
        ),
        (
            "/api/dashboards/db",
            400,
            "Cannot save provisioned dashboard",
            "Grafana refused dashboard fleet.json: HTTP 400: Cannot save provisioned dashboard (it is provisioned "
            "from files in that Grafana: change the mounted JSON instead)",
        ),
        (
            "/api/folders",
            401,
            "invalid API key",
            "Grafana refused folder 'collapse-monitor': HTTP 401: invalid API key (the token must be a valid Grafana "
            "service account token)",
        ),
    ],
)
def test_a_refusal_raises_an_error_naming_the_file_and_grafanas_status_and_message(
    grafana, refused, status, message, expected
):
    fake, url = grafana
    fake.refuse = (refused, status, {"message": message, "status": "refused"})

    with pytest.raises(DashboardPushError) as error:
        push_dashboards(url, "t")

    assert str(error.value) == expected
    assert isinstance(error.value, ValueError)
    assert error.value.status == status
    assert [r.path for r in fake.requests].count("/api/dashboards/db") <= 1  # stops at the first refusal


def test_an_unreachable_grafana_and_bad_arguments_are_clear_errors(tmp_path):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DashboardPushError, match=r"^Grafana refused folder 'collapse-monitor': .*is Grafana reachable"):
        push_dashboards(f"http://127.0.0.1:{port}", "t")
    with pytest.raises(
        ValueError, match=r"^url must be Grafana's base URL such as http://grafana:3000, got 'grafana'$"
    ):
        push_dashboards("grafana", "t")
    with pytest.raises(ValueError, match=r"^folder must hold the dashboards' \*\.json files, found none in "):
        push_dashboards("http://127.0.0.1:1", "t", folder=tmp_path)


def test_a_broken_dashboard_file_is_named_and_nothing_is_sent(grafana, tmp_path):
    fake, url = grafana
    (tmp_path / "a.json").write_text(json.dumps(dashboards()["run.json"]))
    (tmp_path / "b.json").write_text('{"title": "no closing brace"')

    with pytest.raises(ValueError, match=r"b\.json must be a dashboard's JSON: "):
        push_dashboards(url, "t", folder=tmp_path)

    assert fake.requests == []
