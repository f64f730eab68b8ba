"""docker/ checked without an engine: hadolint, Compose's own validation, and what the files name exists.

tests/docker runs the stack for real where an engine can start; these checks run everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from service.settings import Settings, VllmEndpoint

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent


def tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: the dev extras install it")
    return path


def compose_config(*files: str) -> dict:
    command = [str(tool("docker-compose"))]
    for file in files:
        command += ["--file", str(DOCKER / file)]
    result = subprocess.run(
        [*command, "--env-file", "/dev/null", "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    config: dict = yaml.safe_load(result.stdout)
    return config


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "test/Dockerfile"])
def test_hadolint_passes(dockerfile):
    result = subprocess.run(
        [str(tool("hadolint")), "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_the_cli_as_a_numeric_non_root_user():
    text = (DOCKER / "Dockerfile").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = re.search(r'^ENTRYPOINT \["(.+)"\]$', text, re.MULTILINE)
    assert entrypoint is not None
    assert entrypoint.group(1) in scripts
    (user,) = re.findall(r"^USER (.+)$", text, re.MULTILINE)
    uid = user.split(":")[0]
    assert uid.isdigit()
    assert int(uid) != 0
    assert re.search(r"^HEALTHCHECK .*/readyz", text, re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize(
    "files",
    [
        ("compose.yaml",),
        ("compose.yaml", "compose.gpu.yaml"),
        ("compose.yaml", "compose.test.yaml"),
        ("compose.yaml", "compose.vllm.yaml"),
    ],
    ids=["stack", "gpu", "test", "vllm"],
)
def test_compose_accepts_the_stack_and_every_file_it_mounts_exists(files):
    config = compose_config(*files)
    for name, service in config["services"].items():
        for mount in service.get("volumes", []):
            if mount["type"] == "bind":
                assert Path(mount["source"]).exists(), f"{name} mounts {mount['source']}, which does not exist"
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond loopback by default"


def test_the_gpu_override_reserves_an_nvidia_gpu_for_cuda_workers():
    worker = compose_config("compose.yaml", "compose.gpu.yaml")["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
    assert worker["build"]["args"] == {"VARIANT": "cuda"}
    assert worker["environment"]["COLLAPSE_MONITOR_DEVICE"] == "cuda"


def test_api_and_workers_share_one_database_and_one_alertmanager_and_skip_auto_migration():
    services = compose_config("compose.yaml")["services"]
    shared = ("COLLAPSE_MONITOR_DATABASE_URL", "COLLAPSE_MONITOR_ALERTMANAGER_URL", "COLLAPSE_MONITOR_PUBLIC_URL")
    envs = {name: services[name]["environment"] for name in ("migrate", "api", "worker")}
    for key in shared:
        assert len({env[key] for env in envs.values()}) == 1, key
    assert envs["api"]["COLLAPSE_MONITOR_ALERTMANAGER_URL"] == "http://alertmanager:9093"
    assert envs["api"]["COLLAPSE_MONITOR_DATABASE_URL"].split("@")[1].startswith("postgres:5432/")
    assert all(env["COLLAPSE_MONITOR_AUTO_MIGRATE"] == "false" for env in envs.values())
    assert services["migrate"]["command"] == ["migrate"]
    assert services["worker"]["command"] == ["worker"]
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_prometheus_loads_our_rules_and_scrapes_the_api():
    services = compose_config("compose.yaml")["services"]
    mounts = {m["target"]: Path(m["source"]) for m in services["prometheus"]["volumes"] if m["type"] == "bind"}
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (rule_file,) = config["rule_files"]
    assert mounts[rule_file] == ROOT / "dashboards" / "prometheus" / "collapse-rules.yml"
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert "api:8000" in targets
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    alertmanager = {m["target"]: Path(m["source"]) for m in services["alertmanager"]["volumes"] if m["type"] == "bind"}
    assert alertmanager["/etc/alertmanager/alertmanager.yml"] == ROOT / "dashboards" / "prometheus" / "alertmanager.yml"


def test_grafana_gets_every_variable_its_provisioning_reads_and_our_dashboards():
    grafana = compose_config("compose.yaml")["services"]["grafana"]
    mounts = {m["target"]: Path(m["source"]) for m in grafana["volumes"] if m["type"] == "bind"}
    provisioning = ROOT / "dashboards" / "provisioning"
    datasources = mounts["/etc/grafana/provisioning/datasources/collapse-monitor.yml"]
    assert datasources == provisioning / "datasources.yml"
    dashboards = mounts["/etc/grafana/provisioning/dashboards/collapse-monitor.yml"]
    assert dashboards == provisioning / "dashboards.yml"
    (provider,) = yaml.safe_load(dashboards.read_text())["providers"]
    assert mounts[provider["options"]["path"]] == ROOT / "dashboards" / "grafana"
    needed = set(re.findall(r"\$\{?(COLLAPSE_[A-Z_]+)", datasources.read_text()))
    assert needed <= set(grafana["environment"]), needed - set(grafana["environment"])
    postgres = compose_config("compose.yaml")["services"]["postgres"]["environment"]
    assert grafana["environment"]["COLLAPSE_POSTGRES_USER"] == postgres["GRAFANA_DB_USER"]
    assert grafana["environment"]["COLLAPSE_POSTGRES_DB"] == postgres["POSTGRES_DB"]


def test_the_env_example_lists_every_variable_the_compose_files_read_with_compose_defaults():
    example = dict(
        line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines() if line and line[0] != "#"
    )
    read: dict[str, str] = {}
    for name in ("compose.yaml", "compose.gpu.yaml", "compose.vllm.yaml"):
        read |= dict(re.findall(r"\$\{([A-Z_]+):-([^}]*)\}", (DOCKER / name).read_text()))
    assert example == read


def test_the_vllm_override_points_the_stacks_scorer_at_its_vllm_server_as_the_settings_parse_it(monkeypatch):
    services = compose_config("compose.yaml", "compose.vllm.yaml")["services"]
    vllm, worker = services["vllm"], services["worker"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert "ports" not in vllm  # reached on the stack's network only
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
    # The worker's environment, read as the container's Settings read it.
    for key in [key for key in os.environ if key.startswith("COLLAPSE_MONITOR_")]:
        monkeypatch.delenv(key)
    for key, value in worker["environment"].items():
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)
    endpoint = VllmEndpoint.parse(settings.scorers[settings.default_scorer])
    assert endpoint is not None
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in vllm["command"])
    assert endpoint == VllmEndpoint(
        url=f"http://vllm:{flags['port']}",
        model=flags["served-model-name"],
        tokenizer=flags["model"],
        dtype=flags["dtype"],
    )
    # The tokenizer the worker checks against the server is the served model's folder, from the same volume.
    assert {m["target"]: m["source"] for m in worker["volumes"]}["/models"] == vllm["volumes"][0]["source"]
    assert vllm["volumes"][0]["target"] == "/models"
    assert (
        services["api"]["environment"]["COLLAPSE_MONITOR_SCORERS"] == worker["environment"]["COLLAPSE_MONITOR_SCORERS"]
    )
    assert services["api"]["environment"]["COLLAPSE_MONITOR_ALLOW_INSECURE_BIND"] == "true"  # the base's, kept


def test_the_api_states_how_it_binds_without_tokens_and_prometheus_says_how_to_scrape_with_one():
    api = compose_config("compose.yaml")["services"]["api"]
    # The container binds 0.0.0.0, which `serve` refuses without tokens unless told: the stack says so
    # explicitly, and only because the port it publishes binds loopback by default.
    assert api["environment"]["COLLAPSE_MONITOR_ALLOW_INSECURE_BIND"] == "true"
    assert {port["host_ip"] for port in api["ports"]} == {"127.0.0.1"}
    commented = (DOCKER / "prometheus.yml").read_text()
    block = "\n".join(
        line.replace("# ", "", 1)
        for line in commented.splitlines()
        if "authorization" in line or "credentials_file" in line
    )
    assert yaml.safe_load(block.replace("    ", "", 1)) == {
        "authorization": {"credentials_file": "/etc/prometheus/collapse-monitor.token"}
    }
