"""Render the systemd units from `systemd/*.in` (the only placeholder is @PREFIX@, the dsv41 profile).

`nix/appliance.nix` renders the same templates with `builtins.replaceStrings`; tests check both give the same text.
Going through the stable profile path (not a /nix/store path) means a rollback or garbage collection never
leaves a unit pointing at a missing file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dsv41.errors import ConfigError
from dsv41.ops.knobs import PROFILE

PLACEHOLDER = "@PREFIX@"


def templates_dir() -> Path:
    """The repo's systemd/ in a checkout; <out>/share/dsv41/systemd when installed by the Nix package."""
    here = Path(__file__).resolve()
    candidates = [p / sub for p in here.parents for sub in ("systemd", "share/dsv41/systemd")]
    candidates.append(Path(sys.prefix) / "share" / "dsv41" / "systemd")
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.in")):
            return candidate
    raise ConfigError("systemd unit templates (*.in) not found in systemd/ or share/dsv41/systemd above " + str(here))


def render_units(prefix: str = PROFILE, source: Path | None = None) -> dict[str, str]:
    """unit file name -> text, for every `<name>.in` template."""
    if not prefix.startswith("/") or prefix.endswith("/") and prefix != "/":
        raise ConfigError(f"--prefix {prefix!r}: expected an absolute path without a trailing slash")
    source = source or templates_dir()
    return {t.name[: -len(".in")]: t.read_text().replace(PLACEHOLDER, prefix) for t in sorted(source.glob("*.in"))}


def support_file(name: str) -> str:
    """A file next to the unit templates that deploy installs as it is (dsv41.sysusers, dsv41.rules)."""
    path = templates_dir() / name
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None


def write_units(out_dir: Path, prefix: str = PROFILE, source: Path | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_units(prefix, source).items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written
