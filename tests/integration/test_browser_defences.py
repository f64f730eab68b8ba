"""What a browser page of another origin can do: nothing. Host allow-list, Origin check, the pages' headers,
/docs from the vendored Swagger UI, /static limited to the pages' assets."""

from __future__ import annotations

import re

import pytest

from service.storage.tables import Run
from tests.fixtures import error_body, row_count
from tests.integration.test_tokens import rejections

pytestmark = pytest.mark.integration


@pytest.fixture
def client(tmp_path, client_for):
    """The default hosts (loopback names, the bound host); requests go to localhost unless they name a host."""
    client = client_for(f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, allowed_hosts=[])
    client.base_url = "http://localhost"
    return client


def test_a_rebound_host_name_is_refused_before_any_read_or_write(client):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 reaches the open mode."""
    for method, path in (("GET", "/v1/runs"), ("POST", "/v1/runs"), ("DELETE", "/v1/runs/r"), ("GET", "/")):
        refused = client.request(method, f"http://evil.example:8000{path}", json={"name": "r"})
        assert refused.status_code == 400, path
        assert refused.json() == error_body(
            "untrusted_host",
            "this service does not answer to the host 'evil.example'; an operator lists the names clients "
            "use in allowed_hosts",
            field="Host",
        )
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert client.get(f"http://{host}/v1/runs").status_code == 200, host
    assert client.get("http://evil.example/healthz").status_code == 200  # probes answer any host
    assert client.get("http://evil.example/readyz").status_code == 200
    assert rejections(client)["untrusted_host"] == 4


def test_a_host_with_a_made_up_port_is_refused_as_a_whole(client):
    refused = client.get("/v1/runs", headers={"host": "localhost:1@evil.example"})
    assert refused.status_code == 400
    assert refused.json()["field"] == "Host"
    assert "'localhost:1@evil.example'" in refused.json()["detail"]


def test_a_repeated_authorization_or_host_header_is_refused_400_naming_it(client):
    for name, value in (("authorization", "Bearer a"), ("host", "localhost")):
        refused = client.get("/v1/runs", headers=[(name, value), (name, value)])
        assert refused.status_code == 400, name
        assert refused.json() == error_body(
            "invalid_request", f"the {name.title()} header must be sent once, got 2", field=name.title()
        )


def test_allowed_hosts_add_names_and_a_wildcard_bind_answers_any(tmp_path, client_for):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    named = client_for(url, scoring_paused=True, allowed_hosts=["monitor.example.org", "*.internal"])
    assert named.get("http://monitor.example.org/v1/runs").status_code == 200
    assert named.get("http://Monitor.Example.org:443/v1/runs").status_code == 200
    assert named.get("http://api.team.internal/v1/runs").status_code == 200
    assert named.get("http://example.org/v1/runs").status_code == 400
    exposed = client_for(url, scoring_paused=True, allowed_hosts=[], host="0.0.0.0", allow_insecure_bind=True)
    assert exposed.get("http://whatever.example/v1/runs").status_code == 200


def test_a_page_of_another_origin_cannot_write_or_delete(tmp_path, client_for):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    client = client_for(url, scoring_paused=True, allowed_hosts=[], allowed_origins=["https://grafana.example.org"])
    client.base_url = "http://127.0.0.1:8000"
    local = {"host": "127.0.0.1:8000"}
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "http://localhost:8000"):
        refused = client.post("/v1/runs", json={"name": "r"}, headers=local | {"origin": origin})
        assert refused.status_code == 403, origin
        assert refused.json() == error_body(
            "foreign_origin",
            f"POST from a page of another origin ({origin!r}) is refused; an operator lists the origins "
            "allowed to write in allowed_origins",
        )
    assert row_count(url, Run) == 0
    assert client.delete("/v1/runs/r", headers=local | {"origin": "http://evil.example"}).status_code == 403
    assert client.get("/v1/runs", headers=local | {"origin": "http://evil.example"}).status_code == 200  # no CORS
    same = client.post("/v1/runs", json={"name": "r"}, headers=local | {"origin": "http://127.0.0.1:8000"})
    assert same.status_code == 201
    listed = client.post("/v1/runs", json={"name": "s"}, headers=local | {"origin": "https://grafana.example.org"})
    assert listed.status_code == 201
    assert client.post("/v1/runs", json={"name": "t"}, headers=local).status_code == 201  # no Origin: not a browser
    behind_tls = client.post(
        "/v1/runs", json={"name": "u"}, headers={"host": "localhost", "origin": "https://localhost"}
    )
    assert behind_tls.status_code == 201
    assert rejections(client)["foreign_origin"] == 5


def test_every_answer_carries_the_browser_headers_and_the_pages_need_no_inline_script(client):
    for path in ("/", "/runs/r", "/compare", "/docs", "/v1/runs", "/nope"):
        answer = client.get(path)
        csp = answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp
        assert "script-src 'self';" in csp
        assert "unsafe-eval" not in csp
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
        if path.startswith("/v1") or path == "/nope":
            continue
        html = answer.text
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), f"{path} has an inline script"
        assert not re.search(r"\bon[a-z]+=", html), f"{path} has an inline event handler"
        assert not re.search(r"(src|href)=\"(https?:)?//", html), f"{path} loads from another origin"


def test_docs_come_from_the_vendored_swagger_ui_and_redoc_is_gone(client):
    page = client.get("/docs").text
    assert '<script src="/static/vendor/swagger-ui/swagger-ui-bundle.js" defer></script>' in page
    bundle = client.get("/static/vendor/swagger-ui/swagger-ui-bundle.js")
    assert bundle.status_code == 200
    assert "SwaggerUIBundle" in bundle.text[:2000] or "SwaggerUIBundle" in bundle.text
    assert client.get("/static/docs.js").status_code == 200
    assert client.get("/static/vendor/swagger-ui/swagger-ui.css").status_code == 200
    assert client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200


def test_static_serves_the_pages_scripts_and_styles_only(client):
    for path in (
        "/static/api.js",
        "/static/style.css",
        "/static/vendor/uplot/uPlot.iife.min.js",
        "/static/vendor/uplot/LICENSE",
        "/static/vendor/swagger-ui/NOTICE",
    ):
        assert client.get(path).status_code == 200, path
    for path in (
        "/static/__init__.py",
        "/static/runs.html",
        "/static/vendor/uplot/README.md",
        "/static/LICENSE",
        "/static/vendor/",
        "/static/",
        "/static/../app.py",
        "/static/%2e%2e/app.py",
    ):
        refused = client.get(path)
        assert refused.status_code == 404, path
        assert refused.json()["error"] == "not_found", path
