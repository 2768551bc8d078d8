"""The development lock (requirements/dev.lock) against the flake's pins and pyproject.toml.

Where the lock and nix/python/wheels.nix (or the overlay) name the same package, they name the same version; every
requirement in pyproject.toml (dependencies, the serve/test/kernels extras, the build system) is in the lock at a
version it admits; torch, which is kept out of the lock, is pinned in the Makefile at the flake's version, and the
metadata the lock was compiled with (requirements/uv.toml) is what the installed torch declares. docs/DEPENDENCIES.md.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "dev.lock"
UV_CONFIG = REPO / "requirements" / "uv.toml"
# the extras `make` installs, and the kernels extra (a subset of test)
LOCKED_EXTRAS = ("serve", "test", "kernels")
# CPython 3.11 on both Linux architectures the lock is compiled for
PLATFORMS = ("x86_64", "aarch64")


def _load_nix_pins():
    spec = importlib.util.spec_from_file_location("nix_pins", REPO / "requirements" / "nix_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nix_pins_module = _load_nix_pins()


def parse_lock(text: str) -> dict[str, tuple[Version, list[str]]]:
    """{canonical name: (version, [sha256, ...])} from a `--generate-hashes` requirements file."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    # join the backslash continuations, drop comments
    logical = re.sub(r"\\\n", " ", text)
    for line in logical.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if not line:
            continue
        head, *options = re.split(r"\s+(?=--)", line)
        req = Requirement(head)
        (spec,) = req.specifier
        assert spec.operator == "==", f"not an exact pin: {head}"
        hashes = [o.split(":", 1)[1] for o in options if o.startswith("--hash=sha256:")]
        name = canonicalize_name(req.name)
        assert name not in entries, f"{name} locked twice"
        entries[name] = (Version(spec.version), hashes)
    return entries


@pytest.fixture(scope="module")
def lock() -> dict[str, tuple[Version, list[str]]]:
    return parse_lock(LOCK.read_text())


@pytest.fixture(scope="module")
def nix() -> dict[str, Version]:
    return {canonicalize_name(n): Version(v) for n, v in nix_pins_module.nix_pins(REPO).items()}


def makefile_torch() -> Version:
    m = re.search(r"^TORCH_SPEC\s*\?=\s*torch==(\S+)\s*$", (REPO / "Makefile").read_text(), re.M)
    assert m, "Makefile: TORCH_SPEC ?= torch==<version> not found"
    return Version(m.group(1))


def uv_torch_metadata() -> dict:
    (entry,) = [e for e in tomllib.loads(UV_CONFIG.read_text())["dependency-metadata"] if e["name"] == "torch"]
    return entry


def linux_environments(extra: str = "") -> list[dict[str, str]]:
    envs = []
    for machine in PLATFORMS:
        env = default_environment()
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=machine,
                   python_version="3.11", python_full_version="3.11.7", implementation_name="cpython",
                   platform_python_implementation="CPython", extra=extra)
        envs.append(env)
    return envs


def applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or any(req.marker.evaluate(env) for env in linux_environments(extra))


def test_lock_parses_and_every_entry_is_hashed(lock):
    assert len(lock) > 30
    for name, (version, hashes) in lock.items():
        assert hashes, f"{name}=={version} has no --hash"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name


def test_torch_and_cuda_wheels_stay_out_of_the_lock(lock):
    assert "torch" not in lock, "torch is installed by the Makefile (TORCH_SPEC), not from the lock"
    cuda = sorted(n for n in lock if n.startswith(("nvidia-", "cuda-")))
    assert not cuda, f"the CPU development lock pulls CUDA wheels: {cuda}"


def test_the_nix_parser_reads_pins():
    text = """{ a = { version = "1.0"; x86_64-linux = { url = "u"; }; };  # b = { version = "9"; };
      c = wheel { pname = "C-pkg"; pin = pins.c; }; d = f { pname = "d"; version = "2.0"; src = "${x}/y"; }; }"""
    assert nix_pins_module.literal_versions(text) == {"a": "1.0", "d": "2.0"}


def test_nix_pins_are_found(nix):
    # the wheels the flake pins by hand (a parser that finds nothing would make the comparison below vacuous)
    assert {"torch", "triton", "xgrammar", "apache-tvm-ffi"} <= set(nix)


def test_lock_agrees_with_the_flake(lock, nix):
    both = sorted(set(lock) & set(nix))
    assert both, "the lock and the flake name no package in common"
    mismatched = {n: (str(lock[n][0]), str(nix[n])) for n in both if lock[n][0] != nix[n]}
    assert not mismatched, f"lock vs nix/python/wheels.nix (lock, nix): {mismatched}; run `make lock`"
    # everything the flake pins is in the lock, except torch (kept out on purpose, checked below)
    assert set(nix) - set(lock) <= {"torch"}, f"pinned by the flake, missing from the lock: {set(nix) - set(lock)}"


def test_torch_pin_agrees_everywhere(nix):
    assert makefile_torch() == nix["torch"], "Makefile TORCH_SPEC vs nix/python/wheels.nix"
    assert Version(uv_torch_metadata()["version"]) == nix["torch"], "requirements/uv.toml vs nix/python/wheels.nix"


def test_nix_pins_constraints_file_is_current(nix):
    written = {}
    for line in (REPO / "requirements" / "nix-pins.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            written[canonicalize_name(req.name)] = Version(next(iter(req.specifier)).version)
    assert written == nix, "requirements/nix-pins.txt is stale; run `make lock`"


def pyproject_requirements() -> list[tuple[str, Requirement]]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [("dependencies", Requirement(r)) for r in data["project"]["dependencies"]]
    for extra in LOCKED_EXTRAS:
        reqs += [(f"[{extra}]", Requirement(r)) for r in data["project"]["optional-dependencies"][extra]]
    reqs += [("build-system", Requirement(r)) for r in data["build-system"]["requires"]]
    return reqs


def test_pyproject_bounds_are_satisfied_by_the_lock(lock):
    problems = []
    for where, req in pyproject_requirements():
        if not applies(req):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            version = makefile_torch()
        elif name in lock:
            version = lock[name][0]
        else:
            problems.append(f"{where}: {req} is not in the lock (run `make lock`)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{where}: {req} does not admit the locked {name}=={version}")
    assert not problems, "\n".join(problems)


def _installed_torch_requirements() -> set[str]:
    try:
        requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed")
    reqs = set()
    for line in requires:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        # the CUDA build adds its CUDA wheels and triton (locked from the test extra); extras are not installed
        if name.startswith(("nvidia-", "cuda-")) or name == "triton" or not applies(req):
            continue
        reqs.add(f"{name}{req.specifier}")
    return reqs


def test_torch_metadata_used_for_the_lock_is_the_installed_torchs(nix):
    installed = Version(importlib.metadata.version("torch"))
    assert Version(installed.base_version) == nix["torch"], f"installed torch {installed}, flake pins {nix['torch']}"
    declared = {f"{canonicalize_name(Requirement(r).name)}{Requirement(r).specifier}"
                for r in uv_torch_metadata()["requires-dist"]}
    assert declared == _installed_torch_requirements(), "requirements/uv.toml's torch requires-dist is stale"


def test_torch_dependencies_are_locked(lock):
    for line in uv_torch_metadata()["requires-dist"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in lock, f"torch needs {req}, not in the lock"
        assert req.specifier.contains(lock[name][0], prereleases=True), f"torch needs {req}, lock has {lock[name][0]}"


def test_installed_versions_are_the_locked_ones(lock):
    """In a venv that `make install` made from this lock, every locked package is installed at its version."""
    marker = Path(sys.prefix) / "bin" / ".installed"
    if not marker.exists() or marker.stat().st_mtime < LOCK.stat().st_mtime:
        pytest.skip(f"{sys.prefix} was not installed by `make install` from the current lock")
    wrong = {}
    for name, (version, _) in lock.items():
        try:
            got = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            got = None
        if got != version:
            wrong[name] = (str(version), str(got))
    assert not wrong, f"(locked, installed): {wrong}"
