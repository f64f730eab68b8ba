"""Valid but expensive requests against a real server: time and peak memory against request size (issue 17).

    python bench/abuse.py [--vectors think_tags,matrix_rows,...] [--sizes small|full] [--pythonpath OLD]

Each measurement starts a fresh ``collapse-monitor serve`` (tiny-random scorer, SQLite in a
throwaway folder; the embedded worker only where the vector involves it), warms it up with a
small request of the same kind, resets the server's peak RSS (``/proc/<pid>/clear_refs``), sends
the request and reads ``VmHWM`` against the ``VmRSS`` before it. Three sizes per vector: cost
linear in size shows as a constant ``seconds_per_unit`` and ``rss_mb_per_unit``; a refused size
shows its status and answer time. Prints one JSON object per vector.

Vectors: think_tags (a batch whose 4 responses repeat ``<think>``; the POST, the longest concurrent
GET, and the embedded worker's turn at it), matrix_rows, filter_groups, methods (made-up HTTP
methods, then the size of /metrics), series_read (GET /v1/runs/{run}/metrics of N points),
metrics_scrape (N runs' latest values; the first scrape and the cached ones), alert_step (a
matrix step after N stored steps: the first, which replays the history once, and the next ones),
large_body (a rollouts batch of N MB of text), token_ids (one ~27 MB batch of token ids, scoring
paused: the server's growth over the body, its answer and the longest concurrent ``GET /v1/runs``;
then N such bodies at once, a 503 ``parsing_busy`` retried after ``Retry-After``) and
anonymous_body (an N MB malformed body sent without a token to a server that has one: the answer
and its time), empty_trajectories (a batch of N ``{}`` trajectories: the 422/413's size and time,
the growth, the longest concurrent ``GET /v1/runs``). Issue 29's other findings: filter_trues and unknown_keys
(N errors in a filter or a run; the same measures), unread_series (K clients that never read a long
series: what the server still holds after 30 s, its memory, others' waits), slow_clients (K silent,
slow-head and slow-body connections: what the server holds after its deadlines), many_runs (N runs
created without a token: the first page of ``GET /v1/runs``, ``/v1/overview``, the answer past the
limit), forwarded_for (a rotating ``X-Forwarded-For`` against the rate limiter) and storage_quota
(off-schedule batches past ``max_stored_bytes_per_run``). ``--pythonpath`` runs the server from another
checkout (``git archive <commit> | tar -x -C /tmp/old``) to compare in one session.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from peak import run_measured
from serving import Memory, database, issue_token, post_at_once, served_process, service_env, token_ids_body
from sqlalchemy import create_engine, insert, select, update

from service.storage.tables import Batch, LatestMetric, MetricPoint, Run

JSON = {"content-type": "application/json"}


PYTHONPATH: dict[str, str] = {}  # {"PYTHONPATH": OLD} under --pythonpath: the server runs from that checkout


@dataclass
class Server:
    base: str
    memory: Memory
    url: str  # its database


@contextmanager
def server(worker: bool = False, admin_token: bool = False, **settings: str) -> Iterator[Server]:
    """A fresh server on a throwaway SQLite database; ``admin_token``: one issued first (anonymous requests refused)."""
    with tempfile.TemporaryDirectory() as folder, database("sqlite", folder) as url:
        env = {
            "DATABASE_URL": url,
            "DATA_DIR": folder,
            "DEFAULT_SCORER": "tiny-random",
            "EMBEDDED_WORKER": "true" if worker else "false",
            "RATE_LIMIT_PER_SECOND": "0",  # measure the server's work, not the limiter
            "WORKER_POLL_SECONDS": "0.05",
        } | settings
        if admin_token:
            issue_token(service_env(env, **PYTHONPATH), "--scope", "admin")
        with served_process(env, **PYTHONPATH) as (base, process):
            yield Server(base, Memory(process.pid), url)


def measured(srv: Server, request: Callable[[], httpx.Response]) -> dict[str, float | int]:
    """One request's status, wall time and the server's peak RSS growth while it ran."""
    before = srv.memory.reset()
    start = time.perf_counter()
    response = request()
    seconds = time.perf_counter() - start
    return {
        "status": response.status_code,
        "seconds": round(seconds, 3),
        "rss_growth_mb": round((srv.memory.peak() - before) / 2**20, 1),
    }


def post(srv: Server, path: str, body: bytes) -> Callable[[], httpx.Response]:
    return lambda: httpx.post(srv.base + path, content=body, headers=JSON, timeout=600)


def think_tags_batch(tags: int) -> bytes:
    response = "<think>" * tags + " and then" * (tags // 20)
    trajectories = [
        {"group_id": g, "reward": float(g), "turns": [{"prompt": f"Task {g}", "response": response}]} for g in range(4)
    ]
    return json.dumps({"step": 1, "trajectories": trajectories}).encode()


@contextmanager
def others_polling(srv: Server, timeout: float, pause: float = 0.0) -> Iterator[list[float]]:
    """Another client polling ``GET /v1/runs`` meanwhile; yields the seconds each of its requests took
    (complete once the block exits)."""
    waits: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=srv.base, timeout=timeout) as other:
            while not done.is_set():
                start = time.perf_counter()
                other.get("/v1/runs")
                waits.append(time.perf_counter() - start)
                time.sleep(pause)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield waits
    finally:
        done.set()
        poller.join()


def think_tags(tags: int) -> dict:
    body = think_tags_batch(tags)
    with server(worker=True) as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "warm"})
        httpx.post(srv.base + "/v1/runs/warm/batches", content=think_tags_batch(10), headers=JSON)
        httpx.post(srv.base + "/v1/runs", json={"name": "tags"})
        with others_polling(srv, timeout=600) as waits:
            result = measured(srv, post(srv, "/v1/runs/tags/batches", body))
            start, status = time.perf_counter(), {}
            while time.perf_counter() - start < 600:  # the embedded worker's turn at it (it fails: past the context)
                status = _batch_of(srv, "tags")
                if status.get("status") in ("done", "failed"):
                    break
                time.sleep(0.05)
            worker_seconds = time.perf_counter() - start
    return result | {
        "bytes": len(body),
        "longest_concurrent_get_seconds": round(max(waits), 3),
        "worker_seconds_after_answer": round(worker_seconds, 2),
        "worker_outcome": status.get("status"),
    }


def _batch_of(srv: Server, run: str) -> dict:
    engine = create_engine(srv.url)
    try:
        with engine.connect() as connection:
            row = connection.execute(
                select(Batch.status).join(Run, Run.id == Batch.run_id).where(Run.name == run)
            ).first()
    finally:
        engine.dispose()
    return {"status": row[0]} if row else {}


def matrix_body(rows: int, columns: int = 2, step: int = 1) -> bytes:
    rng = np.random.default_rng(rows)
    own = np.arange(rows) % columns
    L = rng.normal(-20.0, 1.0, (rows, columns))
    L[np.arange(rows), own] += 5.0
    return json.dumps(
        {"step": step, "row_group_ids": own.tolist(), "reasoning_lengths": [10] * rows, "L_seq": L.round(3).tolist()}
    ).encode()


def matrix_rows(rows: int) -> dict:
    body = matrix_body(rows)
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "m"})
        httpx.post(srv.base + "/v1/runs/m/matrices", content=matrix_body(64, step=0), headers=JSON)
        return measured(srv, post(srv, "/v1/runs/m/matrices", body)) | {"bytes": len(body)}


def filter_body(groups: int) -> bytes:
    rng = np.random.default_rng(groups)
    return json.dumps({"rewards": rng.random((groups, 4)).round(3).tolist()}).encode()


def filter_groups(groups: int) -> dict:
    body = filter_body(groups)
    with server() as srv:
        httpx.post(srv.base + "/v1/filter", content=filter_body(10), headers=JSON)
        return measured(srv, post(srv, "/v1/filter", body)) | {"bytes": len(body)}


def refused(srv: Server, path: str, body: bytes) -> dict:
    """``body`` posted to ``path`` while another client polls ``GET /v1/runs``: the answer's status, size
    (and error code), time, the server's growth and the other client's longest wait and statuses (0: its
    connection failed)."""
    answer: list[httpx.Response] = []

    def send() -> httpx.Response:
        answer.append(httpx.post(srv.base + path, content=body, headers=JSON, timeout=600))
        return answer[0]

    with others_reading(srv, ["/v1/runs"], pause=0.05) as seen:
        point = measured(srv, send)
    error = answer[0].json().get("error") if answer[0].headers.get("content-type") == "application/json" else None
    polls = seen["/v1/runs"]
    return point | {
        "error": error,
        "bytes": len(body),
        "answer_bytes": len(answer[0].content),
        "others_max_seconds": round(max((seconds for seconds, _ in polls), default=0.0), 3),
        "others_statuses": dict(Counter(status for _, status in polls)),
    }


def empty_trajectories(trajectories: int) -> dict:
    """A batch of ``trajectories`` empty objects (3 errors each): the answer's size and time, the growth, and
    the longest ``GET /v1/runs`` meanwhile (issue 29: 333,333 made a 126 MB 422 and +1.4 GB)."""
    body = b'{"step": 1, "trajectories": [' + b",".join([b"{}"] * trajectories) + b"]}"
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "r"}, timeout=60)
        return refused(srv, "/v1/runs/r/batches", body)


def filter_trues(rewards: int) -> dict:
    """``POST /v1/filter`` (open to any reader) whose rewards are ``rewards`` times ``true``, one error each
    (issue 29: 1M, 5 MB, made a 126 MB 422 and +1.4 GB; two at once peaked at 3.1 GB). In groups of 100,
    so that 1M stays within both max_filter_groups (10,000) and max_filter_rewards (1M): a flat list of
    1M is refused for its group count before validation."""
    group = b"[" + b",".join([b"true"] * 100) + b"]"
    body = b'{"rewards": [' + b",".join([group] * (rewards // 100)) + b"]}"
    with server() as srv:
        httpx.post(srv.base + "/v1/filter", content=filter_body(10), headers=JSON, timeout=60)
        return refused(srv, "/v1/filter", body)


def empty_turns(turns: int) -> dict:
    """A batch of ``turns`` empty ``{}`` turns, 256 a trajectory (max_turns), so 1M stays within max_trajectories
    (4,096): each turn is an error that no count checked before validation refuses."""
    trajectory = b'{"group_id": 0, "reward": 0, "turns": [' + b",".join([b"{}"] * 256) + b"]}"
    body = b'{"step": 1, "trajectories": [' + b",".join([trajectory] * (turns // 256)) + b"]}"
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "r"}, timeout=60)
        return refused(srv, "/v1/runs/r/batches", body)


def unknown_keys(keys: int) -> dict:
    """``POST /v1/runs`` with ``keys`` unknown keys besides the name, one error each (issue 29: 1M)."""
    body = b'{"name": "k", ' + b",".join(b'"k%d": 0' % k for k in range(keys)) + b"}"
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "warm"}, timeout=60)
        return refused(srv, "/v1/runs", body)


def nested_items(where: str) -> Callable[[int], dict]:
    """A body whose one nested field holds ``items`` bad items, one error each (issue 38: 1M stalled every
    request 8-17 s and cost ~1 GB): a step's figures posted after its batch, a batch's figures, one turn's
    prompt_token_ids (``true`` for a token id), a trajectory's unknown keys; or ``items`` valid one-key turns."""

    def measure(items: int) -> dict:
        # Until issue 38 item 2's second round both figures bodies lacked their last brace: the before figures
        # of that round are of these bodies made whole (the same parse, then a 422 or 413 instead of a
        # json_invalid one).
        figures = b'"figures": {' + b",".join(b'"f%d": true' % i for i in range(items)) + b"}}"
        trues = b",".join([b"true"] * items)
        turn = b'{"prompt_token_ids": [' + trues + b'], "response": "r"}'
        one_turn = b'{"group_id": 0, "reward": 0, "turns": [{"prompt": "p", "response": "r"}]}'
        step1 = b'{"step": 1, "trajectories": [' + one_turn + b"]"
        small_turn = b'{"prompt":"p","response":"r"}'
        small_turns = b'{"group_id": 0, "reward": 0, "turns": [' + b",".join([small_turn] * 256) + b"]}"
        bodies = {
            "figures_post": (b'{"step": 1, ' + figures, "/v1/runs/r/figures"),
            "batch_figures": (step1 + b", " + figures, "/v1/runs/r/batches"),
            "trajectory_keys": (
                b'{"step": 2, "trajectories": [{"group_id": 0, "reward": 0, "turns": [{"prompt": "p"}], '
                + b",".join(b'"k%d": 0' % i for i in range(items))
                + b"}]}",
                "/v1/runs/r/batches",
            ),
            "small_turns": (  # valid: items // 256 trajectories of 256 small turns (4,096 x 256: 31 MB)
                b'{"step": 2, "trajectories": [' + b",".join([small_turns] * (items // 256)) + b"]}",
                "/v1/runs/r/batches",
            ),
            "token_ids": (
                b'{"step": 2, "trajectories": [{"group_id": 0, "reward": 0, "turns": [' + turn + b"]}]}",
                "/v1/runs/r/batches",
            ),
        }
        for kind, item in QUIET_ITEMS.items():  # in one turn's prompt_token_ids: refused after the parse (422)
            quiet = b",".join([item] * items)
            bodies[f"list_{kind}"] = (
                b'{"step": 2, "trajectories": [{"group_id": 0, "reward": 0, "turns": [{'
                b'"prompt_token_ids": [' + quiet + b'], "response": "r"}]}]}',
                "/v1/runs/r/batches",
            )
        bodies["long_string"] = (  # items escaped newlines in one prompt: a string is read with no callback either
            b'{"step": 2, "trajectories": [{"group_id": 0, "reward": 0, "turns": [{"response": "r", "prompt": "'
            + b"\\n" * items
            + b'"}]}]}',
            "/v1/runs/r/batches",
        )
        body, path = bodies[where]
        with server() as srv:
            httpx.post(srv.base + "/v1/runs", json={"name": "r"}, timeout=60)
            httpx.post(srv.base + "/v1/runs/r/batches", content=step1 + b"}", headers=JSON, timeout=60)
            return refused(srv, path, body)

    return measure


# Items json.loads reads without calling back into Python (no number, no object end between them): until issue
# 38 item 2's third round, a run of them held the GIL for its whole parse.
QUIET_ITEMS = {"trues": b"true", "strings": b'"a"', "empty_lists": b"[]"}


def answered(srv: Server, request: Callable[[], httpx.Response]) -> dict:
    """``measured``, plus the answer's size."""
    answer: list[httpx.Response] = []
    point = measured(srv, lambda: answer.append(request()) or answer[0])
    return point | {"answer_bytes": len(answer[0].content)}


def raw_connection(base: str) -> socket.socket:
    """A loopback connection to ``base`` with a 4 KB receive buffer, so an unread answer stalls the server soon."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return sock


def held_by_server(base: str, sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server still holds: its end of the connection ESTABLISHED in /proc/net/tcp.

    Read on the server's side because a client cannot tell a close from silence while its own receive
    buffer is full (the server's FIN waits behind the data), and because a server that closes a socket
    with an answer still buffered in asyncio keeps it open until that buffer drains.
    """
    port = int(base.rsplit(":", 1)[1])
    clients = {sock.getsockname()[1] for sock in sockets}
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) in clients and state == "01":
            held += 1
    return held


@contextmanager
def others_reading(srv: Server, paths: list[str], pause: float = 0.2) -> Iterator[dict[str, list[tuple[float, int]]]]:
    """A client per path polling it meanwhile; yields each path's (seconds, status) (0: no answer in 60 s)."""
    seen: dict[str, list[tuple[float, int]]] = {path: [] for path in paths}
    done = threading.Event()

    def poll(path: str) -> None:
        with httpx.Client(base_url=srv.base, timeout=60) as other:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    status = other.get(path).status_code
                except httpx.HTTPError:
                    status = 0
                seen[path].append((time.perf_counter() - start, status))
                time.sleep(pause)

    pollers = [threading.Thread(target=poll, args=(path,)) for path in paths]
    for poller in pollers:
        poller.start()
    try:
        yield seen
    finally:
        done.set()
        for poller in pollers:
            poller.join()


def waits_of(seen: dict[str, list[tuple[float, int]]]) -> dict:
    """Per polled path: requests, their statuses, and the longest wait."""
    return {
        path: {
            "requests": len(polls),
            "statuses": dict(Counter(status for _, status in polls)),
            "max_seconds": round(max(seconds for seconds, _ in polls), 3),
        }
        for path, polls in seen.items()
    }


UNREAD_POINTS = 50_000  # a ~7 MB answer, far past the socket buffers (4 KB asked by the client, 4 MB at most sent)
UNREAD_SECONDS = 30
UNREAD_STALL_SECONDS = 10  # response_stall_seconds lowered from its 60 s, so that the drop shows within UNREAD_SECONDS


def unread_series(clients: int) -> dict:
    """``clients`` connections that ask for a long series and never read the answer, for ``UNREAD_SECONDS``:
    how many the server still holds then, the answers' statuses, the server's growth, and meanwhile
    ``/readyz``, a short series read and ``GET /v1/runs`` of other clients (issue 29: 16 such clients held
    the pool, every database request answered 503 after the pool timeout, none closed in 60 s)."""
    request = b"GET /v1/runs/s/metrics?limit=1000000&segments=all HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with server(RESPONSE_STALL_SECONDS=str(UNREAD_STALL_SECONDS)) as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "s"}, timeout=60)
        seed(srv.url, "s", UNREAD_POINTS // 10, [f"m{k}" for k in range(10)])
        answer_bytes = len(httpx.get(srv.base + "/v1/runs/s/metrics?limit=1000000&segments=all", timeout=120).content)
        before = srv.memory.reset()
        paths = ["/readyz", "/v1/runs/s/metrics?limit=100", "/v1/runs"]
        with others_reading(srv, paths) as seen:
            sockets = [raw_connection(srv.base) for _ in range(clients)]
            for sock in sockets:
                sock.sendall(request)
            time.sleep(UNREAD_SECONDS)
        held = held_by_server(srv.base, sockets)
        growth, growth_held = srv.memory.peak() - before, srv.memory.rss() - before
        statuses = Counter(_status_line(sock) for sock in sockets)
        for sock in sockets:
            sock.close()
        start = time.perf_counter()
        after = httpx.get(srv.base + "/v1/runs/s/metrics", params={"limit": 100}, timeout=60).status_code
        after_seconds = time.perf_counter() - start
        time.sleep(2)  # the server has seen the connections go
        growth_after = srv.memory.rss() - before
    return {
        "answer_bytes": answer_bytes,
        "held_by_server_after_seconds": {UNREAD_SECONDS: held},
        "unread_statuses": dict(statuses),
        "rss_growth_mb": round(growth / 2**20, 1),
        "rss_growth_still_held_mb": round(growth_held / 2**20, 1),
        "others": waits_of(seen),
        "after_closing": {
            "status": after,
            "seconds": round(after_seconds, 3),
            "rss_growth_still_held_mb": round(growth_after / 2**20, 1),
        },
    }


def _status_line(sock: socket.socket) -> int:
    """The status of the answer waiting in ``sock``, read without taking it (0: none yet)."""
    try:
        head = sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/") else 0


SLOW_SECONDS = 15  # past request_head_seconds (10 s by default) and request_body_seconds (set to 10 s here)


def slow_clients(per_kind: int) -> dict:
    """``per_kind`` connections of each kind: silent (sends nothing), slow head (a header a byte a second),
    slow body (a body a byte a second, ``request_body_seconds`` lowered from its 120 s to 10 s); after
    ``SLOW_SECONDS`` how many the server still holds, and other clients' waits meanwhile (issue 29: 0 of 50
    closed after 60-120 s)."""
    opening = {
        "silent": b"",
        "slow_head": b"GET /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
        "slow_body": b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{",
    }
    with server(REQUEST_BODY_SECONDS="10") as srv:
        kinds = {kind: [raw_connection(srv.base) for _ in range(per_kind)] for kind in opening}
        for kind, sockets in kinds.items():
            for sock in sockets:
                sock.sendall(opening[kind])
        refused: Counter[str] = Counter()  # sends that failed: the server had closed
        done = threading.Event()

        def trickle() -> None:
            alive = [sock for kind in ("slow_head", "slow_body") for sock in kinds[kind]]
            while not done.wait(1.0):
                for sock in list(alive):
                    try:
                        sock.send(b"a" if sock in kinds["slow_head"] else b" ")
                    except OSError:
                        alive.remove(sock)
                        refused["slow_head" if sock in kinds["slow_head"] else "slow_body"] += 1

        sender = threading.Thread(target=trickle)
        sender.start()
        with others_reading(srv, ["/readyz", "/v1/runs"]) as seen:
            time.sleep(SLOW_SECONDS)
        held = {kind: held_by_server(srv.base, sockets) for kind, sockets in kinds.items()}
        done.set()
        sender.join()
        for sockets in kinds.values():
            for sock in sockets:
                sock.close()
    return {
        "connections": per_kind * len(opening),
        "held_by_server_after_seconds": {SLOW_SECONDS: held},
        "sends_refused": dict(refused),
        "others": waits_of(seen),
    }


def many_runs(runs: int) -> dict:
    """``runs`` runs created without a token (``max_runs_without_token`` set to ``runs``), then one more; each
    given 10 scored steps of the overview's figures; then ``GET /v1/runs`` (its first page) and the runs
    page's poll ``GET /v1/overview?points=60`` (issue 29: at 10,000 runs 12-28 s and 10.7 MB, and 2-2.6 s
    and 5 MB)."""
    with server(MAX_RUNS_WITHOUT_TOKEN=str(runs)) as srv, httpx.Client(base_url=srv.base, timeout=600) as http:
        start = time.perf_counter()
        created = Counter(http.post("/v1/runs", json={"name": f"run-{r}"}).status_code for r in range(runs))
        create_seconds = time.perf_counter() - start
        past = http.post("/v1/runs", json={"name": "one-more"})
        _seed_overview(srv.url, steps=10)
        pages: list[httpx.Response] = []
        first_page = answered(srv, lambda: pages.append(http.get("/v1/runs")) or pages[0])
        overview = answered(srv, lambda: http.get("/v1/overview", params={"points": 60}))
    return {
        "created": dict(created),
        "create_seconds_per_run": round(create_seconds / runs, 4),
        "past_the_limit": f"{past.status_code} {past.json().get('error')}",
        "runs_first_page": first_page
        | {"runs": len(pages[0].json()), "next": "next" in pages[0].headers.get("link", "")},
        "overview": overview,
    }


def _seed_overview(url: str, steps: int) -> None:
    """``steps`` scored steps of every run: a batch each, the sparkline's points and the latest values."""
    engine = create_engine(url)
    rng = np.random.default_rng(steps)
    try:
        with engine.begin() as connection:
            ids = connection.execute(select(Run.id)).scalars().all()
            batches = [{"run_id": r, "step": k, "id": uuid.uuid4().hex} for r in ids for k in range(steps)]
            done = {"kind": "matrix", "payload": "", "payload_sha256": "", "status": "done"}
            connection.execute(insert(Batch), [b | done for b in batches])
            names = ("mi_estimate", "retrieval_accuracy", "retrieval_chance_level", "retrieval_above_chance")
            points = [
                {"run_id": b["run_id"], "batch_id": b["id"], "step": b["step"], "sampler": "matrix", "name": name}
                | {"value": float(rng.random()), "scorer": "tiny-random"}
                for b in batches
                for name in names
            ]
            connection.execute(insert(MetricPoint), points)
            latest = [
                {"run_id": r, "sampler": "matrix", "name": n, "step": steps - 1, "value": 0.5}
                for r in ids
                for n in names
            ]
            connection.execute(insert(LatestMetric), latest)
    finally:
        engine.dispose()


def forwarded_for(requests: int) -> dict:
    """``requests`` quick ``GET /v1/runs`` from 8 threads, each with another ``X-Forwarded-For``: counted
    against loopback unless a proxy is configured (issue 29: 600 x 200, uvicorn trusted the header from
    loopback; without it 229 x 200 + 371 x 429). The limit is lowered from 50/s (bursts of 200) to 10/s
    (bursts of 100): this client sends ~100 requests a second on a busy machine, within the default."""
    cases = {
        "rotating X-Forwarded-For": ({}, True),
        "no X-Forwarded-For": ({}, False),
        "rotating, 127.0.0.1 configured as the proxy": ({"FORWARDED_ALLOW_IPS": '["127.0.0.1"]'}, True),
    }
    out = {}
    for case, (settings, rotate) in cases.items():
        with server(RATE_LIMIT_PER_SECOND="10", RATE_LIMIT_BURST="100", **settings) as srv:
            start = time.perf_counter()
            statuses = _burst(srv.base, requests, rotate)
            seconds = time.perf_counter() - start
        out[case] = {"statuses": dict(statuses), "seconds": round(seconds, 2), "allowed": round(100 + 10 * seconds)}
    return out


def _burst(base: str, requests: int, rotate: bool) -> Counter[int]:
    """``requests`` ``GET /v1/runs`` from 8 threads; with ``rotate`` each names another X-Forwarded-For."""
    statuses: Counter[int] = Counter()

    def send(first: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            for i in range(first, requests, 8):
                headers = {"x-forwarded-for": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"} if rotate else {}
                statuses[http.get("/v1/runs", headers=headers).status_code] += 1

    senders = [threading.Thread(target=send, args=(first,)) for first in range(8)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    return statuses


QUOTA_BYTES = 16 * 2**20  # max_stored_bytes_per_run lowered from its 10 GiB so that a few batches pass it


def storage_quota(batches: int) -> dict:
    """``batches`` off-schedule batches of ~3.1 MB of text (a run scoring every 1000th step, scoring paused)
    from two clients, against ``max_stored_bytes_per_run`` of 16 MiB: the answers, the first refusal, the
    run's stored bytes and the database's growth (issue 29: 100 such batches all 202, +382 MB, nothing bounded
    a run's storage)."""
    turn = {"prompt": "Board: the box is left of the goal. " * 20, "response": "<think>" + "plan " * 200 + "</think>Up"}
    trajectories = json.dumps([{"group_id": t % 64, "reward": 1.0, "turns": [turn]} for t in range(1800)]).encode()
    settings = {"MAX_STORED_BYTES_PER_RUN": str(QUOTA_BYTES), "SCORING_PAUSED": "true", "MAX_SCORING_COST": str(10**12)}
    with server(**settings) as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "q", "schedule": {"every": 1000}}, timeout=60)
        database = Path(srv.url.removeprefix("sqlite:///"))
        size_before = sum(f.stat().st_size for f in database.parent.glob(database.name + "*"))
        answers: list[httpx.Response] = []

        def send(first: int) -> None:
            with httpx.Client(base_url=srv.base, timeout=600) as http:
                for step in range(2 + first, 2 + batches, 2):  # steps 2..: off the schedule (1, 1000, 2000, ...)
                    body = b'{"step": %d, "trajectories": ' % step + trajectories + b"}"
                    answers.append(http.post("/v1/runs/q/batches", content=body, headers=JSON))

        start = time.perf_counter()
        clients = [threading.Thread(target=send, args=(first,)) for first in range(2)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        seconds = time.perf_counter() - start
        size_after = sum(f.stat().st_size for f in database.parent.glob(database.name + "*"))
        engine = create_engine(srv.url)
        with engine.connect() as connection:
            stored = connection.execute(select(Run.payload_bytes).where(Run.name == "q")).scalar_one()
        engine.dispose()
    over = [a for a in answers if a.status_code != 202]
    return {
        "batch_bytes": len(trajectories) + 30,
        "statuses": dict(Counter(a.status_code for a in answers)),
        "first_refusal": f"{over[0].status_code} {over[0].json()['error']}: {over[0].json()['detail']}"
        if over
        else None,
        "seconds": round(seconds, 2),
        "run_payload_bytes": stored,
        "database_growth_mb": round((size_after - size_before) / 2**20, 1),
    }


def methods(requests: int) -> dict:
    with server() as srv, httpx.Client(base_url=srv.base, timeout=60) as http:
        before = len(http.get("/metrics").content)
        start = time.perf_counter()
        for i in range(requests):
            http.request(f"X{i:05d}", "/nope")
        seconds = time.perf_counter() - start
        after = len(http.get("/metrics").content)
    return {"seconds": round(seconds, 3), "metrics_bytes_before": before, "metrics_bytes_after": after}


def seed(url: str, run: str, n_steps: int, names: list[str], sampler: str = "matrix") -> None:
    """``n_steps`` stored steps of ``names`` for ``run`` (one batch each), written in bulk."""
    engine = create_engine(url)
    rng = np.random.default_rng(n_steps)
    try:
        with engine.begin() as connection:
            run_id = connection.execute(select(Run.id).where(Run.name == run)).scalar_one()
            ids = [uuid.uuid4().hex for _ in range(n_steps)]
            rows = {"run_id": run_id, "kind": "matrix", "payload": "", "payload_sha256": "", "status": "done"}
            connection.execute(insert(Batch), [rows | {"id": ids[k], "step": k} for k in range(n_steps)])
            for start in range(0, n_steps, 5000):
                points = [
                    {"run_id": run_id, "batch_id": ids[k], "step": k, "sampler": sampler, "name": name}
                    | {"value": float(0.5 + rng.normal(0, 0.05)), "scorer": "tiny-random"}
                    for k in range(start, min(start + 5000, n_steps))
                    for name in names
                ]
                connection.execute(insert(MetricPoint), points)
            connection.execute(update(Run).where(Run.id == run_id).values(claimed_step=n_steps - 1))
    finally:
        engine.dispose()


def series_read(points: int) -> dict:
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "s"})
        seed(srv.url, "s", points // 10, [f"m{k}" for k in range(10)])
        httpx.get(srv.base + "/v1/runs/s/metrics", params={"limit": 100})
        sizes: list[int] = []

        def read() -> httpx.Response:
            response = httpx.get(srv.base + "/v1/runs/s/metrics", params={"limit": 1_000_000}, timeout=600)
            sizes.append(len(response.content))
            return response

        return measured(srv, read) | {"bytes": sizes[0]}


def metrics_scrape(runs: int) -> dict:
    names = [f"metric_{k}" for k in range(20)]
    with server(METRICS_CACHE_SECONDS="5") as srv:
        engine = create_engine(srv.url)
        with engine.begin() as connection:
            run = {"scorer": "tiny-random", "scorer_mode": "reference", "samplers": []}
            connection.execute(insert(Run), [run | {"name": f"run-{r}"} for r in range(runs)])
            ids = connection.execute(select(Run.id)).scalars().all()
            latest = [
                {"run_id": i, "sampler": "matrix", "name": n, "step": 1, "value": 0.5} for i in ids for n in names
            ]
            connection.execute(insert(LatestMetric), latest)
        engine.dispose()
        with httpx.Client(base_url=srv.base, timeout=60) as http:
            first = measured(srv, lambda: http.get("/metrics"))
            cached = []
            for _ in range(20):
                start = time.perf_counter()
                http.get("/metrics")
                cached.append(time.perf_counter() - start)
    return first | {"cached_scrape_seconds_median": round(statistics.median(cached), 4)}


def alert_step(steps: int) -> dict:
    names = ["mi_estimate", "mi_estimate_se", "mi_estimate_ci_high", "conditional_entropy_est"]
    names += ["retrieval_above_chance", "marginal_std", "rows", "columns"]
    with server() as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "a"})
        seed(srv.url, "a", steps, names)
        timings = [
            measured(srv, post(srv, "/v1/runs/a/matrices", matrix_body(24, 4, step=steps + k))) for k in range(6)
        ]
    return {
        "status": timings[0]["status"],
        "first_step_seconds": timings[0]["seconds"],  # replays the stored history once, writes the checkpoint
        "seconds": statistics.median(t["seconds"] for t in timings[1:]),  # resumed from the checkpoint
        "rss_growth_mb": max(t["rss_growth_mb"] for t in timings[1:]),
    }


def large_body(megabytes: int) -> dict:
    turn = {"prompt": "Board: the box is left of the goal. " * 20, "response": "<think>" + "plan " * 200 + "</think>Up"}
    per_trajectory = len(json.dumps(turn))
    n = megabytes * 2**20 // per_trajectory
    batch = {"step": 1, "trajectories": [{"group_id": t % 64, "reward": 1.0, "turns": [turn]} for t in range(n)]}
    body = json.dumps(batch).encode()
    with server(MAX_TRAJECTORIES=str(n), MAX_SCORING_COST=str(10**12)) as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "b"})
        small = {"step": 0, "trajectories": batch["trajectories"][:8]}
        httpx.post(srv.base + "/v1/runs/b/batches", json=small)
        return measured(srv, post(srv, "/v1/runs/b/batches", body)) | {"bytes": len(body)}


def token_ids(concurrent: int) -> dict:
    """One ~27 MB token-id batch while another client polls ``GET /v1/runs``, then ``concurrent`` such at once."""
    payloads = [token_ids_body(step, seed=step) for step in range(1, concurrent + 2)]
    size = len(payloads[0])
    with server(SCORING_PAUSED="true", MAX_SCORING_COST=str(10**12)) as srv:
        httpx.post(srv.base + "/v1/runs", json={"name": "r", "sampler": {"num_samples": 2}}).raise_for_status()
        httpx.post(srv.base + "/v1/runs/r/batches", content=payloads[0][:2048], headers=JSON)  # lazy imports
        with others_polling(srv, timeout=300, pause=0.02) as waits:
            time.sleep(0.3)
            one = measured(srv, post(srv, "/v1/runs/r/batches", payloads[0]))

        before = srv.memory.reset()
        start = time.perf_counter()
        statuses = post_at_once(srv.base + "/v1/runs/r/batches", payloads[1:], timeout=300)
        growth = srv.memory.peak() - before
    return {
        "body_mb": round(size / 1e6, 1),
        "one_status": one["status"],
        "one_seconds": one["seconds"],
        "one_growth_over_body": round(one["rss_growth_mb"] * 2**20 / size, 2),
        "concurrent_get_max_wait_seconds": round(max(waits), 2),
        "concurrent_statuses": statuses,
        "concurrent_seconds": round(time.perf_counter() - start, 2),
        "concurrent_growth_mb": round(growth / 1e6),
        "concurrent_growth_over_one_body": round(growth / size, 2),
    }


def anonymous_body(megabytes: int) -> dict:
    """A malformed body (its error at its very end) without a token, to a server that has one."""
    body = b'{"step": 1, "trajectories": [' + b"7," * (megabytes * 2**20 // 2)
    with server(admin_token=True, SCORING_PAUSED="true") as srv, httpx.Client(base_url=srv.base, timeout=300) as http:
        start = time.perf_counter()
        answer = http.post("/v1/runs/r/batches", content=body, headers=JSON)
        return {
            "bytes": len(body),
            "answer": f"{answer.status_code} {answer.json()['error']}",
            "answer_seconds": round(time.perf_counter() - start, 2),
        }


# Issue 38, items 1, 2 and 5 (the service side). One vector: a vLLM scorer that hangs.
def _scored_pace(srv: Server, run: str, batches: int, first_step: int = 1) -> float:
    """Batches of ``run`` scored a second: ``batches`` posted at once, timed until the last is done."""
    ids = [
        httpx.post(srv.base + f"/v1/runs/{run}/batches", json=_trajectories_batch(step), timeout=60).json()["batch_id"]
        for step in range(first_step, first_step + batches)
    ]
    start = time.perf_counter()
    for batch_id in ids:
        while httpx.get(srv.base + f"/v1/batches/{batch_id}", timeout=60).json()["status"] not in ("done", "failed"):
            time.sleep(0.05)
    return batches / (time.perf_counter() - start)


def _trajectories_batch(step: int) -> dict:
    groups = [
        {"group_id": g, "reward": float(i), "turns": [{"prompt": f"question {g}", "response": f"answer {g} {i}"}]}
        for g in range(4)
        for i in range(3)
    ]
    return {"step": step, "trajectories": groups}


def hanging_scorer(batches: int) -> dict:
    """Another run's scoring pace on one worker while a vLLM scorer hangs (every request to its deadline)."""
    from tests.misbehaving_vllm import misbehaving_server

    with misbehaving_server("hang") as hung:
        spec = f"vllm+http://127.0.0.1:{hung.server_address[1]}?model=m&tokenizer=tiny-random"
        settings = {
            "SCORERS": json.dumps({"tiny-random": "tiny-random", "stuck": spec}),
            "VLLM_TIMEOUT_SECONDS": "2",
            "VLLM_RETRIES": "1",
        }
        paces = {}
        for stuck_batches in (0, 1):
            with server(worker=True, **settings) as srv:
                httpx.post(srv.base + "/v1/runs", json={"name": "warm"}, timeout=60)
                _scored_pace(srv, "warm", 1)  # loads the scorer
                httpx.post(srv.base + "/v1/runs", json={"name": "ok"}, timeout=60)
                if stuck_batches:
                    httpx.post(srv.base + "/v1/runs", json={"name": "stuck", "scorer": "stuck"}, timeout=60)
                    stuck_id = httpx.post(
                        srv.base + "/v1/runs/stuck/batches", json=_trajectories_batch(1), timeout=60
                    ).json()["batch_id"]
                paces[stuck_batches] = _scored_pace(srv, "ok", batches)
                if stuck_batches:
                    # Again, the breaker open from the start: the pace while the scorer stays down, without the
                    # one hold of the worker by the try that found it down (``connect``: one probe deadline).
                    paces[2] = _scored_pace(srv, "ok", batches, first_step=batches + 1)
                    stuck = httpx.get(srv.base + f"/v1/batches/{stuck_id}", timeout=60).json()
        return {
            "alone_batches_per_second": round(paces[0], 2),
            "beside_hanging_scorer_batches_per_second": round(paces[1], 2),
            "pace_ratio": round(paces[1] / paces[0], 2),
            "beside_open_breaker_batches_per_second": round(paces[2], 2),
            "open_breaker_pace_ratio": round(paces[2] / paces[0], 2),
            "hung_requests": hung.tries,
            "stuck_batch": {"status": stuck["status"], "error": (stuck["error"] or "")[:200]},
        }


# Issue 38, client side: hostile files under a followed folder, and the slime hook's time in the trainer.


def followed(files: dict[str, Callable[[Path], None]]) -> dict:
    """``collapse-monitor-client follow --once`` over a folder of ``files`` (name: writer) and a later good
    step: its time, its own peak RSS (``bench/peak.py``) and the steps it sent."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "rollouts"
        folder.mkdir()
        for name, write in files.items():
            write(folder / name)
        time.sleep(0.02)
        good = {"step": 9, "trajectories": [{"group_id": 0, "reward": 1.0, "prompt": "p", "response": "r"}] * 2}
        (folder / "9.jsonl").write_text(json.dumps(good) + "\n")
        cli = Path(sys.executable).parent / "collapse-monitor-client"
        command = [str(cli), "follow", str(folder), "--run", "r", "--url", "http://127.0.0.1:9", "--once"]
        start = time.perf_counter()
        with tempfile.TemporaryFile() as out:
            code, peak_mb = run_measured(
                [*command, "--settle", "0", "--spool-dir", f"{tmp}/spool"], stdout=out, stderr=subprocess.DEVNULL
            )
            out.seek(0)
            steps = json.loads(out.read() or b"{}").get("steps")
        return {"exit": code, "seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": peak_mb, "steps": steps}


def follow_nuls(megabytes: int) -> dict:
    """A step file of ``megabytes`` MB of NULs (sparse), no newline (issue 38: 2 GB cost 4.1 GB)."""

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(megabytes * 2**20)

    return {"bytes": megabytes * 2**20} | followed({"2.jsonl": write})


def follow_deep_json(depth: int) -> dict:
    """A step file of one JSON array nested ``depth`` deep (issue 38: 100,000 crash-looped follow)."""
    return {"bytes": 2 * depth + 1} | followed({"2.jsonl": lambda p: p.write_text("[" * depth + "]" * depth + "\n")})


def follow_unreadable(copies: int) -> dict:
    """``copies`` each of a symlink loop, a folder, a FIFO and a bad UTF-8 byte named like step files."""
    import os

    files: dict[str, Callable[[Path], None]] = {}
    for i in range(copies):
        base = 100 + 4 * i
        files[f"{base}.jsonl"] = lambda p: os.symlink(p.name, p)
        files[f"{base + 1}.jsonl"] = lambda p: p.mkdir()
        files[f"{base + 2}.jsonl"] = lambda p: os.mkfifo(p)
        files[f"{base + 3}.jsonl"] = lambda p: p.write_bytes(b'{"step": 1, "x": "\xff"}\n')
    return followed(files)


def slime_rollout(rollout: list[dict]) -> dict:
    """``log_rollout`` with ``rollout`` (slime sample dicts, token-id mode, nothing listening), three times, each
    after the last is converted (a real rollout takes minutes): the time the trainer's call takes (median,
    max), the conversion thread's, the serialising at close, and what the first rollout's batch holds."""
    import os
    from types import SimpleNamespace

    from collapse_monitor.integrations import slime

    os.environ.update(COLLAPSE_MONITOR_URL="http://127.0.0.1:9", COLLAPSE_MONITOR_RUN="bench-slime")
    os.environ["COLLAPSE_MONITOR_TOKEN_IDS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["COLLAPSE_MONITOR_SPOOL_DIR"] = tmp
        args = SimpleNamespace(hf_checkpoint=None, save=None, wandb_group=None, reward_key=None)
        slime.log_rollout(0, args, [])  # the first call starts the run's monitor (its thread, its spool)
        slime.wait_for_conversions(60)
        hooks, conversions = [], []
        for rollout_id in (1, 2, 3):
            start = time.perf_counter()
            slime.log_rollout(rollout_id, args, rollout)
            hooks.append(time.perf_counter() - start)
            slime.wait_for_conversions(600)
            conversions.append(time.perf_counter() - start)
        start = time.perf_counter()
        for monitor in slime._monitors.values():
            monitor.close(timeout=0)  # nothing listens: the batches are serialised into the spool
        serialised = (time.perf_counter() - start) / 3
        slime._monitors.clear()
        (first,) = Path(tmp, "bench-slime").glob("*-batch-1.json")
        body = json.loads(first.read_bytes())
        sent = {
            "sent_trajectories": len(body["trajectories"]),
            "sent_turns_max": max(len(t["turns"]) for t in body["trajectories"]),
            "body_mb": round(first.stat().st_size / 2**20, 1),
        }
    return {
        "hook_ms": round(statistics.median(hooks) * 1000, 2),
        "hook_ms_max": round(max(hooks) * 1000, 2),
        "converted_seconds": round(statistics.median(conversions), 2),
        "serialised_seconds": round(serialised, 2),
    } | sent


def slime_hook(samples: int) -> dict:
    """A rollout of ``samples`` samples, 8 a prompt, 96 tokens each (issue 38: 100,000 blocked the trainer
    5.8 s, and the batch was then refused: past the service's 4096 trajectories)."""
    return slime_rollout(
        [
            {
                "group_index": i // 8,
                "index": i,
                "tokens": list(range(96)),
                "response_length": 32,
                "reward": float(i % 2),
            }
            for i in range(samples)
        ]
    )


def slime_tool_turns(turns: int) -> dict:
    """A rollout of 4 samples (1 prompt) of ``turns`` tool turns each: 8 model tokens, then 8 tool tokens
    (issue 38: 2,000 blocked the trainer 3.3 s; each turn's prompt is every token before it)."""
    mask = ([1] * 8 + [0] * 8) * turns
    return slime_rollout(
        [
            {
                "group_index": 0,
                "index": i,
                "tokens": list(range(64)) + [(i + k) % 500 for k in range(len(mask))],
                "response_length": len(mask),
                "loss_mask": mask,
                "reward": float(i % 2),
            }
            for i in range(4)
        ]
    )


def long_token_turn(millions: int) -> dict:
    """One trajectory of one turn of ``millions`` million reasoning token ids, logged into the spool with nothing
    listening (issue 38, client side: encoded whole, a 5M-id turn made a ~38 MB body the service refuses, and
    past one body alone it was sent as it was): the seconds ``log`` takes (durable: encoding included), the
    body's size and the ids it keeps."""
    from collapse_monitor.monitor import Monitor

    ids = list(range(millions * 1_000_000))
    with tempfile.TemporaryDirectory() as tmp:
        monitor = Monitor("http://127.0.0.1:9", "bench-ids", spool_dir=tmp, durable=True, exit_timeout=0)
        start = time.perf_counter()
        monitor.log(1, [{"group_id": 0, "reward": 1.0, "prompt_token_ids": [1, 2, 3], "reasoning_token_ids": ids}])
        seconds = time.perf_counter() - start
        monitor.close(timeout=0)
        (path,) = Path(tmp, "bench-ids").glob("*-batch-1.json")
        [turn] = json.loads(path.read_bytes())["trajectories"][0]["turns"]
        return {
            "seconds": round(seconds, 2),
            "body_mb": round(path.stat().st_size / 2**20, 2),
            "reasoning_ids_sent": len(turn["reasoning_token_ids"]),
        }


VECTORS: dict[str, tuple[str, Callable[[int], dict], list[int], list[int], int | None]] = {
    # name: (unit, measure, sizes, small sizes, a size the service refuses)
    "think_tags": ("<think> per response", think_tags, [5000, 10_000, 20_000], [1000, 2000, 4000], None),
    "matrix_rows": ("rows (2 columns)", matrix_rows, [4096, 8192, 16_384], [1024, 2048, 4096], 200_000),
    "filter_groups": ("groups of 4 rewards", filter_groups, [2500, 5000, 10_000], [1000, 2000, 4000], 200_000),
    "methods": ("made-up methods", methods, [100, 250, 500], [50, 100, 200], None),
    "series_read": ("points", series_read, [25_000, 50_000, 100_000], [5000, 10_000, 20_000], None),
    "metrics_scrape": ("runs of 20 series", metrics_scrape, [10, 100, 1000], [10, 30, 100], None),
    "alert_step": ("stored steps", alert_step, [100, 1000, 10_000], [100, 300, 1000], None),
    "large_body": ("MB of rollouts", large_body, [2, 4, 8], [1, 2, 4], None),
    "token_ids": ("27 MB token-id batches at once", token_ids, [4], [2], None),
    "anonymous_body": ("MB of malformed JSON", anonymous_body, [30], [8], None),
    "empty_trajectories": ("{} trajectories", empty_trajectories, [4096, 100_000, 333_333], [1000, 4096, 20_000], None),
    # Issue 29, one vector per finding. Row 3 (resumed runs) is a correctness test, not a cost. Row 8 (many
    # large token-id bodies at once) is token_ids above: its bodies in flight count against max_parsing_bytes.
    # Row 9 (a full disk) is not here: a full volume needs a size-capped filesystem (a loop mount or tmpfs),
    # which needs root; tests/ cover what the service says then.
    "filter_trues": ("true rewards", filter_trues, [10_000, 100_000, 1_000_000], [1000, 10_000, 100_000], None),
    "empty_turns": ("{} turns", empty_turns, [10_240, 102_400, 1_000_192], [1024, 10_240, 102_400], None),
    "unknown_keys": ("unknown keys", unknown_keys, [10_000, 100_000, 1_000_000], [1000, 10_000, 100_000], None),
    "unread_series": ("clients not reading", unread_series, [8, 16, 32], [2, 4, 8], None),
    "slow_clients": ("connections of each kind", slow_clients, [16, 32, 64], [4, 8, 16], None),
    "many_runs": ("runs", many_runs, [100, 1000, 3000], [30, 100, 300], None),
    "forwarded_for": ("requests", forwarded_for, [600], [300], None),
    "storage_quota": ("3.1 MB batches", storage_quota, [8, 16, 32], [4, 8, 12], None),
    # Issue 38 (service side): a hanging vLLM scorer beside a healthy run on one worker.
    "hanging_scorer": ("batches of the healthy run", hanging_scorer, [40], [15], None),
    # Issue 38 item 2: a million bad items nested in one field of a body within every size limit.
    "figures_post_trues": ("bad figures", nested_items("figures_post"), [10_000, 1_000_000], [1000, 100_000], None),
    "batch_figures_trues": ("bad figures", nested_items("batch_figures"), [10_000, 1_000_000], [1000, 100_000], None),
    "token_id_trues": ("bad token ids", nested_items("token_ids"), [10_000, 1_000_000], [1000, 100_000], None),
    # Item 2's second round: a million keys of one object (not a model's: refused on the bytes), and a valid batch
    # of a million small turns (accepted; the parse lets others in at each object's end).
    "trajectory_keys": ("unknown keys", nested_items("trajectory_keys"), [10_000, 1_000_000], [1000, 100_000], None),
    "small_turns": ("small turns", nested_items("small_turns"), [1024, 262_144, 1_048_576], [1024, 102_400], None),
    # Item 2's third round: a run of items with no callback between them, up to max_body_bytes (30 MB of each).
    "batch_list_trues": ("true items", nested_items("list_trues"), [1_000_000, 6_000_000], [100_000], None),
    "batch_list_strings": ("string items", nested_items("list_strings"), [1_000_000, 7_000_000], [100_000], None),
    "batch_list_empty_lists": (
        "[] items",
        nested_items("list_empty_lists"),
        [1_000_000, 10_000_000],
        [100_000],
        None,
    ),
    "batch_long_string": (
        "escaped newlines in one prompt",
        nested_items("long_string"),
        [15_000_000],
        [1_000_000],
        None,
    ),
    # Issue 38, client side (follow and the slime hook; no server).
    "follow_nuls": ("MB of NULs", follow_nuls, [64, 512, 2048], [8, 64, 128], None),
    "follow_deep_json": ("levels of nesting", follow_deep_json, [1000, 10_000, 100_000], [1000, 10_000], None),
    "follow_unreadable": ("copies of 4 unreadable files", follow_unreadable, [1, 10, 100], [1, 10], None),
    "slime_hook": ("samples", slime_hook, [1000, 10_000, 100_000], [1000, 10_000], None),
    "slime_tool_turns": ("tool turns a sample", slime_tool_turns, [20, 200, 2000], [20, 200], None),
    "long_token_turn": ("million reasoning ids in one turn", long_token_turn, [1, 5], [1], None),
}


def run_vector(name: str, small: bool) -> dict:
    unit, measure, sizes, small_sizes, refused = VECTORS[name]
    points = []
    for size in small_sizes if small else sizes:
        point = {"size": size} | measure(size)
        if "seconds" in point:
            point["seconds_per_unit"] = float(f"{point['seconds'] / size:.3g}")
        if "rss_growth_mb" in point:
            point["rss_mb_per_unit"] = float(f"{point['rss_growth_mb'] / size:.3g}")
        if "bytes" in point and "rss_growth_mb" in point:
            point["rss_over_body"] = round(point["rss_growth_mb"] * 2**20 / point["bytes"], 2)
        points.append(point)
    out: dict = {"vector": name, "unit": unit, "points": points}
    if refused is not None:
        out["refused"] = {"size": refused} | measure(refused)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", default=",".join(VECTORS), help="comma-separated: " + ", ".join(VECTORS))
    parser.add_argument("--sizes", choices=["full", "small"], default="full", help="small: a quick smoke run")
    parser.add_argument("--pythonpath", help="run the server from this checkout instead (PYTHONPATH)")
    args = parser.parse_args()
    if args.pythonpath:
        PYTHONPATH["PYTHONPATH"] = args.pythonpath
    for name in args.vectors.split(","):
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(json.dumps(run_vector(name, args.sizes == "small") | {"load_average": " ".join(load)}), flush=True)


if __name__ == "__main__":
    main()
