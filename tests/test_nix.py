"""Nix checks that work offline with Debian's Nix 2.8 (PLATFORM.md §2): every .nix file parses, the builtins-only
part evaluates and agrees with the Python renderer, `nix flake check --no-build` passes with the offline nixpkgs
stub, and the offline unit check builds (it runs systemd-analyze verify inside a Nix build)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv41.ops.knobs import PROFILE
from dsv41.ops.units import render_units

REPO = Path(__file__).resolve().parents[1]
NIX_FLAGS = ["--extra-experimental-features", "nix-command flakes", "--option", "substituters", ""]
STUB = ["--no-write-lock-file", "--override-input", "nixpkgs", "path:./nix/stub-nixpkgs"]


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        reason = f"{tool} not installed (Debian: apt-get install nix-bin)"
        print(reason)
        pytest.skip(reason)
    return path


def nix_files() -> list[Path]:
    return sorted(p for p in [REPO / "flake.nix", *(REPO / "nix").rglob("*.nix")])


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_the_flake_files_exist():
    names = {p.relative_to(REPO).as_posix() for p in nix_files()}
    for required in ("flake.nix", "nix/appliance.nix", "nix/outputs.nix", "nix/package.nix", "nix/kernels.nix",
                     "nix/python/overlay.nix", "nix/python/wheel.nix", "nix/python/wheels.nix",
                     "nix/stub-nixpkgs/flake.nix"):
        assert required in names


@pytest.mark.parametrize("path", nix_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_parses(path):
    result = run([need("nix-instantiate"), "--parse", str(path)])
    assert result.returncode == 0, result.stderr


def test_parse_catches_errors(tmp_path):
    """The parse check can fail: a truncated file and an undefined variable are both rejected."""
    text = (REPO / "nix" / "appliance.nix").read_text()
    truncated = tmp_path / "truncated.nix"
    truncated.write_text(text[: len(text) // 2])
    assert run([need("nix-instantiate"), "--parse", str(truncated)]).returncode != 0
    undefined = tmp_path / "undefined.nix"
    undefined.write_text("{ a }: a + notDefinedAnywhere\n")
    result = run([need("nix-instantiate"), "--parse", str(undefined)])
    assert result.returncode != 0 and "notDefinedAnywhere" in result.stderr


def nix_eval(attr: str):
    result = run([need("nix-instantiate"), "--eval", "--strict", "--json", "nix/appliance.nix", "-A", attr])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_nix_units_equal_python_units():
    assert nix_eval("units") == render_units(PROFILE)
    assert nix_eval("profile") == PROFILE


def test_nix_render_with_other_prefix_equals_python():
    result = run([need("nix-instantiate"), "--eval", "--strict", "--json", "-E",
                  '(import ./nix/appliance.nix { }).renderUnits "/opt/dsv41"'])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == render_units("/opt/dsv41")


def test_env_example_and_deploy_script():
    assert nix_eval("envExample") == (REPO / "config" / "dsv41.env.example").read_text()
    result = run([need("nix-instantiate"), "--eval", "--strict", "--json", "-E",
                  '(import ./nix/appliance.nix { }).deployScript { python = "/py/bin/python3"; flake = "/src"; }'])
    assert result.returncode == 0, result.stderr
    script = json.loads(result.stdout)
    assert script.startswith("#!/bin/sh\n")
    assert 'exec /py/bin/python3 -m dsv41.ops.deploy --flake /src "$@"' in script
    assert "export PYTHONPATH=/src/src" in script


def test_cuda_capabilities():
    caps = nix_eval("cudaCapabilities")
    assert caps["aarch64-linux"] == ["12.1"]  # GB10 = sm_121
    assert "9.0" in caps["x86_64-linux"]


def flake_tracked() -> None:
    """Flakes in a git repo only see tracked files: skip (with the reason) when ours are not in the index."""
    result = run(["git", "ls-files", "--error-unmatch", "flake.nix", "flake.lock", "nix/appliance.nix",
                  "nix/stub-nixpkgs/flake.nix", "systemd", "config/dsv41.env.example"])
    if result.returncode != 0:
        reason = f"flake files are not tracked by git yet: {result.stderr.strip()}"
        print(reason)
        pytest.skip(reason)


def test_flake_check_no_build_offline():
    flake_tracked()
    result = run([need("nix"), *NIX_FLAGS, "flake", "check", "--no-build", *STUB])
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr.lower()


def test_flake_lib_evaluates_offline():
    flake_tracked()
    result = run([need("nix"), *NIX_FLAGS, "eval", "--json", *STUB, ".#lib.units"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == render_units(PROFILE)


def test_offline_unit_check_builds():
    """Builds checks.<system>.units-offline: renders the units in a Nix build and runs systemd-analyze verify."""
    flake_tracked()
    need("systemd-analyze")
    system = run([need("nix-instantiate"), "--eval", "--json", "-E", "builtins.currentSystem"])
    current = json.loads(system.stdout)
    result = run([need("nix"), *NIX_FLAGS, "build", "--no-link", "--json", *STUB,
                  f".#checks.{current}.units-offline"], timeout=600)
    assert result.returncode == 0, result.stderr
    out = Path(json.loads(result.stdout)[0]["outputs"]["out"])
    installed = {p.name: p.read_text() for p in (out / "lib" / "systemd" / "system").iterdir()}
    assert installed == render_units(PROFILE)
    assert (out / "verify.log").read_text() == ""


def test_flake_lock_pins_nixpkgs():
    lock = json.loads((REPO / "flake.lock").read_text())
    node = lock["nodes"]["nixpkgs"]["locked"]
    assert node["type"] == "github" and re.fullmatch(r"[0-9a-f]{40}", node["rev"])
    assert node["narHash"].startswith("sha256-")
    assert lock["nodes"]["root"]["inputs"] == {"nixpkgs": "nixpkgs"}


def test_wheel_pins_are_complete():
    pins = nix_eval_file("nix/python/wheels.nix")
    for name, pin in pins.items():
        for system, arch in (("aarch64-linux", "aarch64"), ("x86_64-linux", "x86_64")):
            wheel = pin[system]
            filename = wheel["url"].rsplit("/", 1)[1]
            assert re.fullmatch(r"[0-9a-f]{64}", wheel["sha256"]), (name, system)
            assert f"-{pin['version']}-" in filename and "cp313" in filename and arch in filename, filename
    # torch pins the triton it was built against
    assert pins["triton"]["version"] == "3.7.1" and pins["torch"]["version"] == "2.13.0"


def nix_eval_file(path: str):
    result = run([need("nix-instantiate"), "--eval", "--strict", "--json", path])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
