"""The rendered units: the directives issue 4 requires, and `systemd-analyze verify` with no output at all."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv41.ops.knobs import PROFILE, parse_env_file
from dsv41.ops.units import render_units, write_units

REPO = Path(__file__).resolve().parents[1]
EXPECTED_UNITS = {"dsv41@.service", "dsv41-warm@.service", "dsv41-watchdog.service", "dsv41-watchdog.timer",
                  "dsv41-boot.service"}


def directives(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (repeated keys such as Environment= keep every value)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def seconds(span: str) -> float:
    """systemd time span (60s, 5min, 2min 30s) in seconds."""
    units = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit or "s"]
    return total


@pytest.fixture(scope="module")
def units() -> dict[str, dict[str, dict[str, list[str]]]]:
    return {name: directives(text) for name, text in render_units(PROFILE).items()}


def test_exactly_the_issue_units(units):
    assert set(units) == EXPECTED_UNITS


def test_rank_service(units):
    unit = units["dsv41@.service"]
    service = unit["Service"]
    one = {k: v[-1] for k, v in service.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert "/etc/dsv41/dsv41.env" in service["EnvironmentFile"]
    assert one["ExecStart"] == f"{PROFILE}/bin/dsv41 launch %i"
    assert one["Restart"] == "on-failure" and one["KillMode"] == "mixed"
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["CacheDirectory"] == "dsv41/%i" and one["StateDirectory"] == "dsv41"
    assert one["SyslogIdentifier"] == "dsv41-%i" and one["LogExtraFields"] == "RANK=%i"
    assert one["RestartPreventExitStatus"] == "70"  # fail-fast: the watchdog restarts the pair together
    assert 60 <= seconds(one["TimeoutStartSec"]) <= 600  # modest; extended by EXTEND_TIMEOUT_USEC while loading
    assert 10 <= seconds(one["WatchdogSec"]) <= 300
    drain = float(parse_env_file(REPO / "config" / "dsv41.env.example")["DSV41_DRAIN_TIMEOUT_S"])
    assert seconds(one["TimeoutStopSec"]) >= drain + 30  # drain, then HTTP grace and engine teardown
    env = dict(value.split("=", 1) for value in service["Environment"])
    assert env["CC"] == f"{PROFILE}/libexec/dsv41/cc"
    assert env["TRITON_LIBCUDA_PATH"] == "/run/opengl-driver/lib"
    assert env["TRITON_CACHE_DIR"].startswith("%C/dsv41/%i")
    assert int(unit["Unit"]["StartLimitBurst"][-1]) >= 2 and unit["Unit"]["StartLimitIntervalSec"]
    assert "dsv41-warm@%i.service" in unit["Unit"]["After"][-1].split()


def test_warm_watchdog_boot(units):
    warm = units["dsv41-warm@.service"]
    assert warm["Service"]["Type"] == ["oneshot"]
    assert warm["Unit"]["Before"] == ["dsv41@%i.service"]
    assert warm["Service"]["ExecStart"] == [f"{PROFILE}/bin/dsv41 warm %i"]
    timer = units["dsv41-watchdog.timer"]["Timer"]
    assert seconds(timer["OnUnitActiveSec"][0]) == 60 and seconds(timer["AccuracySec"][0]) == 5
    assert units["dsv41-watchdog.service"]["Service"]["ExecStart"] == [f"{PROFILE}/bin/dsv41 watchdog --once"]
    assert units["dsv41-boot.service"]["Service"]["ExecStart"] == [f"{PROFILE}/bin/dsv41 boot"]
    assert units["dsv41-boot.service"]["Install"]["WantedBy"] == ["multi-user.target"]


def test_no_template_placeholder_left():
    for name, text in render_units("/opt/dsv41").items():
        assert "@PREFIX@" not in text, name
        assert "/opt/dsv41/" in text, name


def analyze_or_skip() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        reason = "systemd-analyze not installed (apt-get install systemd)"
        print(reason)
        pytest.skip(reason)
    return path


def verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([analyze_or_skip(), "verify", *map(str, paths)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def rendered(tmp_path) -> Path:
    """Units rendered with a prefix whose bin/dsv41 is an existing executable (verify checks ExecStart)."""
    prefix = tmp_path / "profile"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "libexec" / "dsv41").mkdir(parents=True)
    shutil.copy("/bin/true", prefix / "bin" / "dsv41")
    out = tmp_path / "units"
    write_units(out, str(prefix))
    return out


def test_systemd_analyze_verify_is_silent(rendered):
    result = verify(sorted(rendered.iterdir()))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


def test_instances_verify_silently(rendered, tmp_path):
    instances = tmp_path / "instances"
    instances.mkdir()
    for template, instance in (("dsv41@.service", "dsv41@rank0.service"), ("dsv41@.service", "dsv41@rank1.service"),
                               ("dsv41-warm@.service", "dsv41-warm@rank0.service")):
        shutil.copy(rendered / template, instances / instance)
    result = verify(sorted(instances.iterdir()))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_verify_catches_a_bad_directive(rendered):
    """The check above can fail: one typo in a value gives a warning on stderr (while rc stays 0)."""
    unit = rendered / "dsv41@.service"
    unit.write_text(unit.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    result = verify([unit])
    assert "mixd" in result.stderr


def test_verify_catches_missing_executable(tmp_path):
    out = tmp_path / "units"
    write_units(out, str(tmp_path / "nowhere"))
    result = verify([out / "dsv41-boot.service"])
    assert result.returncode != 0 or result.stderr


def test_render_units_cli(tmp_path):
    """`dsv41 render-units` writes the same files the library renders."""
    from dsv41.ops.cli import main

    assert main(["render-units", "--prefix", "/opt/x", "--out", str(tmp_path)]) == 0
    expected = render_units("/opt/x")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == expected
