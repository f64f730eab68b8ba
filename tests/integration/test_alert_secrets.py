"""A receiver's URL is a credential: after a real alert to receivers that echo it back, no read shows it."""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from service.alerts.notifications import redacted_error, redacted_url
from tests.fixtures import dependence_matrix

pytestmark = pytest.mark.integration

WEBHOOK_SECRET = "wh7Qx2LmN9pR4sT8vY1z"  # the secret path segment of a generic webhook
SLACK_SECRET = "T0ABC123/B0DEF456/xoxbQ8r2Tz5Kp9Lm3Nv7Wd1F"  # Slack's /services/T.../B.../token
ALERTMANAGER_PASSWORD = "am-pass-5f3c9e2a71"
SECRETS = (WEBHOOK_SECRET, *SLACK_SECRET.split("/"), ALERTMANAGER_PASSWORD)


class EchoingReceiver:
    """Refuses every notification with a body that repeats what it was sent: the path, the credentials."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                body = f"no route for POST {self.path} (authorization: {self.headers.get('authorization')})"
                self.send_response(404 if "hooks" in self.path else 500)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver():
    echo = EchoingReceiver()
    yield echo
    echo.server.shutdown()
    echo.server.server_close()


def read_everything(client, batch_id: str) -> dict[str, str]:
    """The body of every GET the service answers: the API's (from its own OpenAPI), the pages, their data."""
    paths = [p for p, operations in client.get("/openapi.json").json()["paths"].items() if "get" in operations]
    urls = [p.replace("{run}", "r").replace("{batch_id}", batch_id) for p in paths]
    urls += ["/", "/runs/r", "/compare", "/docs", "/openapi.json", "/v1/runs/r/metrics?format=csv&segments=all"]
    urls += ["/v1/runs/r/metrics?format=columns", "/v1/alerts?state=firing", "/v1/runs/r/matrix?sampler=matrix"]
    bodies = {}
    for url in urls:
        response = client.get(url)
        assert response.status_code < 500, (url, response.text)
        bodies[url] = response.text
    assert "/v1/alerts" in bodies
    return bodies


def test_no_read_anywhere_shows_a_receivers_secret(database_url, client_for, receiver, caplog):
    base = f"http://127.0.0.1:{receiver.port}"
    client = client_for(
        database_url,
        scoring_paused=True,
        alert_webhooks=[f"{base}/hooks/{WEBHOOK_SECRET}"],
        alert_slack_webhooks=[f"{base}/services/{SLACK_SECRET}"],
        alertmanager_url=f"http://am-user:{ALERTMANAGER_PASSWORD}@127.0.0.1:{receiver.port}",
        delivery_max_attempts=2,
        delivery_backoff_seconds=0.05,
    )
    client.post("/v1/runs", json={"name": "r"})
    caplog.set_level(logging.INFO)
    batch_id = ""
    for step, dependence in enumerate([2.0] * 6 + [0.0] * 5, start=1):
        response = client.post("/v1/runs/r/matrices", json=dependence_matrix(step, dependence))
        assert response.status_code == 201
        batch_id = response.json()["batch_id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        deliveries = [d for a in client.get("/v1/alerts").json() for d in a["deliveries"]]
        if deliveries and all(d["status"] == "failed" for d in deliveries):
            break
        time.sleep(0.1)
    assert all(d["status"] == "failed" and d["attempts"] == 2 for d in deliveries), deliveries
    shown = {(d["receiver"], d["url"], d["last_error"]) for d in deliveries}  # Alertmanager's: one per step firing
    assert shown == {
        ("webhook", f"{base}/…", "HTTP 404: no route for POST /hooks/… (authorization: None)"),
        ("slack", f"{base}/…", "HTTP 500: no route for POST /services/…/…/… (authorization: None)"),
        ("alertmanager", f"{base}/…", "HTTP 500: no route for POST /api/v2/alerts (authorization: Basic …)"),
    }
    for url, body in read_everything(client, batch_id).items():
        for secret in SECRETS:
            assert secret not in body, f"{url} shows {secret!r}"
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "failed for good" in logged
    for secret in SECRETS:
        assert secret not in logged


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T000/B000/XXXX", "https://hooks.slack.com/…"),
        ("http://user:pw@alertmanager:9093", "http://alertmanager:9093/…"),
        ("http://[::1]:8080/hook?token=abc", "http://[::1]:8080/…"),
        ("not a url", "…"),
    ],
)
def test_a_receiver_shows_as_its_scheme_and_host_only(url, shown):
    assert redacted_url(url) == shown


def test_an_error_keeps_its_status_and_reason_but_no_url_or_token():
    url = "https://example.com/hook/s3cr3t-path?key=k3y-value"
    error = (
        "HTTP 403: invalid key k3y-value for https://example.com/hook/s3cr3t-path; see https://docs.example.com/x "
        "(request ghp_16C7e42F292c6912E7710c838347Ae178B4a)\n\n" + "padding " * 50
    )
    redacted = redacted_error(error, url)
    assert redacted.startswith("HTTP 403: invalid key … for <url>; see <url> (request …) padding padding")
    assert len(redacted) == 200
    for secret in ("s3cr3t-path", "k3y-value", "example.com/hook", "ghp_16C7e42F", "docs.example.com"):
        assert secret not in redacted
    assert redacted_error("ConnectError: [Errno 111] Connection refused", url) == (
        "ConnectError: [Errno 111] Connection refused"
    )
