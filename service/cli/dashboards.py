"""Uploads the generated Grafana dashboards (dashboards/grafana/*.json) through Grafana's HTTP API.

The alternative to file provisioning (dashboards/provisioning/) for a Grafana that you can reach
but cannot mount files into. Talks to Grafana through grafana-client; must not import fastapi.

    DashboardPushError (ValueError)   Grafana refused, or could not be reached; names the file
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from grafana_client.api import GrafanaApi
from grafana_client.client import GrafanaException, TokenAuth
from niquests.exceptions import RequestException

# The JSON lives in the source tree, next to the provisioning files; a wheel does not carry it.
DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "dashboards" / "grafana"
TIMEOUT_SECONDS = 10.0

_HINTS = {
    401: "the token must be a valid Grafana service account token",
    403: "the token's service account needs the Editor role, or write access to the folder",
    412: "a different dashboard with the same title may already exist in the folder",
}


class DashboardPushError(ValueError):
    """Grafana refused to store a dashboard or its folder, or could not be reached."""

    def __init__(self, target: str, status: int | None, message: str, hint: str | None = None) -> None:
        self.target = target
        self.status = status
        self.message = message
        answer = f"HTTP {status}: {message}" if status else message
        super().__init__(f"Grafana refused {target}: {answer}" + (f" ({hint})" if hint else ""))


def push_dashboards(
    url: str, token: str, folder: Path = DASHBOARDS_DIR, folder_title: str = "collapse-monitor"
) -> list[dict[str, Any]]:
    """Finds or creates the Grafana folder ``folder_title`` and saves every ``*.json`` of ``folder`` in it.

    Each dashboard is saved under its own uid with ``overwrite: true``, so pushing again replaces
    the previous version. All files are read before anything is sent: a broken file uploads none.

    Args:
        url: Grafana's base URL, e.g. ``http://grafana:3000`` or ``https://example.org/grafana``.
        token: a Grafana service account token (sent as ``Authorization: Bearer <token>``).
        folder: the folder holding the dashboards' JSON (default: dashboards/grafana of this tree).
        folder_title: the Grafana folder to save them in; found by title, created when missing.

    Returns:
        Grafana's answer for each dashboard, in file-name order: ``{id, uid, url, status, version, slug}``.

    Raises:
        DashboardPushError: Grafana refused the folder or a dashboard (the message names the file,
            Grafana's status and message), or could not be reached.
        ValueError: a bad ``url`` or ``token``, or a folder without readable dashboard JSON.
    """
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise ValueError(f"folder must hold the dashboards' *.json files, found none in {folder}")
    dashboards = [(path, _read(path)) for path in paths]
    api = _connect(url, token)
    folder_uid = _folder_uid(api, folder_title)
    answers = []
    for path, board in dashboards:
        payload = {
            "dashboard": {**board, "id": None},  # saved by uid; an id would tie it to one Grafana
            "folderUid": folder_uid,
            "overwrite": True,
            "message": f"collapse-monitor: {path.name}",
        }
        answers.append(_ask(f"dashboard {path.name}", partial(api.dashboard.update_dashboard, payload)))
    return answers


def _read(path: Path) -> dict[str, Any]:
    try:
        board = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} must be a dashboard's JSON: {e}") from e
    if not isinstance(board, dict) or not board.get("uid"):
        raise ValueError(f"{path} must be a dashboard object with a uid, got {type(board).__name__} without one")
    return board


def _connect(url: str, token: str) -> GrafanaApi:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be Grafana's base URL such as http://grafana:3000, got {url!r}")
    if not token:
        raise ValueError("token must be a Grafana service account token, got an empty string")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    prefix = parts.path.strip("/")
    return GrafanaApi(
        auth=TokenAuth(token),  # type: ignore[no-untyped-call]  # grafana-client leaves __init__ unannotated
        host=host,
        port=parts.port,
        # grafana-client appends "api" to the prefix as is: a sub-path needs its trailing slash.
        url_path_prefix=f"{prefix}/" if prefix else "",
        protocol=parts.scheme,
        timeout=TIMEOUT_SECONDS,
    )


def _folder_uid(api: GrafanaApi, title: str) -> str:
    target = f"folder {title!r}"
    folders = _ask(target, api.folder.get_all_folders, list)
    for found in folders:
        if isinstance(found, dict) and found.get("title") == title:
            return str(found["uid"])
    # The uid the file provisioning (dashboards.yml) gives its folder, when the titles match.
    uid = re.sub(r"[^A-Za-z0-9_-]+", "-", title).strip("-")[:40] or None
    created = _ask(target, partial(api.folder.create_folder, title, uid=uid))
    return str(created["uid"])


def _ask(target: str, request: Callable[[], Any], expected: type = dict) -> Any:
    """Runs one request to Grafana; its refusals become DashboardPushError naming ``target``."""
    try:
        answer = request()
    except GrafanaException as e:
        message = _message(e)
        hint = _HINTS.get(e.status_code)
        if e.status_code == 400 and "provisioned" in message.lower():
            hint = "it is provisioned from files in that Grafana: change the mounted JSON instead"
        raise DashboardPushError(target, e.status_code or None, message, hint) from e
    except RequestException as e:  # connection refused, DNS, TLS: grafana-client lets these through
        raise DashboardPushError(target, None, str(e), "is Grafana reachable at that URL?") from e
    if not isinstance(answer, expected):
        raise DashboardPushError(target, None, f"expected a JSON {expected.__name__} in the answer, got {answer!r}")
    return answer


def _message(error: GrafanaException) -> str:
    """Grafana's own message: its JSON answer carries {"message": ...}."""
    response = error.response
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    if isinstance(response, str) and response:
        return response
    return str(error.message)
