"""The knob table (ops/knobs.py) as text: config/dsv41.env.example and OPERATIONS.md's knob section.

    python -m dsv41.ops.knob_docs --check   # exit 1 naming each file that differs from the table
    python -m dsv41.ops.knob_docs --write   # rewrite both from the table

The table is the one source: deploy accepts exactly its names (plus the passthrough prefixes), `dsv41 launch`
turns its serve knobs into flags, and tests/test_ops_knobs.py fails when a checked-in file differs from this
text or when serve, preflight, deploy and the docs disagree with the table.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from dsv41.ops.knobs import ENV_KNOBS, OPS_KNOBS, PASSTHROUGH_EXAMPLES, PASSTHROUGH_PREFIXES, SERVE_KNOBS

WIDTH = 116
BEGIN = "<!-- knobs: generated from src/dsv41/ops/knobs.py by `python -m dsv41.ops.knob_docs --write`; do not edit -->"
END = "<!-- knobs: end -->"

EXAMPLE_HEAD = """\
# dsv41 appliance configuration: installed as /etc/dsv41/dsv41.env on BOTH Sparks by `nix run .#deploy`
# (owner dsv41, mode 0600). Generated from src/dsv41/ops/knobs.py (`python -m dsv41.ops.knob_docs --write`).
#
# systemd reads this file (EnvironmentFile=) for dsv41@rank0 / dsv41@rank1; `dsv41 launch rankN` turns the
# DSV41_* serve knobs into `dsv41 serve` flags, one knob = one flag. An empty or commented-out knob passes no
# flag, so the server's own default applies. Print the resulting command line with:
#     dsv41 launch rank0 --print --env-file /etc/dsv41/dsv41.env
# Syntax: KEY=VALUE per line, no spaces around '=', quotes optional, '#' starts a comment line.
"""


def _comment(text: str) -> list[str]:
    glue = "\0"  # "Empty = 30", "120 s" stay on one line
    text = text.replace(" = ", f"{glue}={glue}").replace(" s)", f"{glue}s)").replace(" s.", f"{glue}s.")
    lines = textwrap.wrap(text, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False,
                          break_long_words=False)
    return [line.replace(glue, " ") for line in lines]


def _sentence(doc: str, more: str = "") -> str:
    """`doc` as a sentence, then `more`."""
    text = doc.strip().rstrip(".") + "."
    return f"{text} {more.strip()}" if more.strip() else text


def _section(title: str) -> str:
    return f"# {'-' * 64} {title}"


def render_example() -> str:
    lines = [EXAMPLE_HEAD.rstrip("\n"), "", _section("serve knobs (-> dsv41 serve flags)")]
    for knob in SERVE_KNOBS:
        lines += ["", *_comment(_sentence(f"{knob.flag}: {knob.doc}", knob.more)), f"{knob.env}={knob.example}"]
    lines += ["", _section("read by dsv41 serve from its environment (never flags)")]
    for knob in ENV_KNOBS:
        lines += ["", *_comment(_sentence(knob.doc, knob.more)), f"{knob.env}={knob.example}"]
    lines += ["", _section("ops knobs (read by dsv41 watchdog/preflight/status/deploy)")]
    for knob in OPS_KNOBS:
        example = knob.default if knob.example is None else knob.example
        default = f" Default {knob.default}." if knob.default else ""
        lines += ["", *_comment(_sentence(knob.doc, knob.more) + default), f"{knob.env}={example}"]
    lines += ["", _section("passed to the server's environment untouched"), "",
              *_comment("Any variable starting with " + ", ".join(PASSTHROUGH_PREFIXES) + " goes to the server as it "
                        "is (NCCL, gloo, glibc, Triton, torch, CUDA read them).")]
    for var in PASSTHROUGH_EXAMPLES:
        lines += ["", *_comment(_sentence(f"{var.env}: {var.doc}")),
                  f"{'# ' if var.commented else ''}{var.env}={var.example}"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_operations_section() -> str:
    """The knob tables of OPERATIONS.md, between BEGIN and END."""
    lines = [BEGIN, "", "**Serve knobs** → `dsv41 serve` flags (one knob = one flag; empty = no flag, the server's "
             "default):", "", "| knob | flag | what |", "| --- | --- | --- |"]
    lines += [f"| `{k.env}` | `{k.flag}`{' (one per word)' if k.many else ''} | {_cell(_sentence(k.doc, k.more))} |"
              for k in SERVE_KNOBS]
    lines += ["", "**Read by `dsv41 serve` from its environment** (never flags):", "", "| knob | what |",
              "| --- | --- |"]
    lines += [f"| `{k.env}` | {_cell(_sentence(k.doc, k.more))} |" for k in ENV_KNOBS]
    lines += ["", "**Ops knobs** (watchdog, preflight, status, warm, boot, deploy; serve ignores them):", "",
              "| knob | default | what |", "| --- | --- | --- |"]
    lines += [f"| `{k.env}` | {('`' + k.default + '`') if k.default else 'empty'} | {_cell(_sentence(k.doc, k.more))} |"
              for k in OPS_KNOBS]
    lines += ["", "**Passed through** to the server's environment untouched: "
              + ", ".join(f"`{p}*`" for p in PASSTHROUGH_PREFIXES) + ". The example sets "
              + ", ".join(f"`{v.env}` ({v.doc})" for v in PASSTHROUGH_EXAMPLES) + ".", "", END]
    return "\n".join(lines)


def splice(document: str, section: str) -> str:
    """`document` with the text between BEGIN and END (inclusive) replaced by `section`."""
    try:
        start = document.index(BEGIN)
        end = document.index(END, start) + len(END)
    except ValueError:
        raise ValueError(f"the knob section markers are missing ({BEGIN!r} ... {END!r})") from None
    return document[:start] + section + document[end:]


def targets(repo: Path) -> dict[Path, str]:
    """Each generated file -> its text from the table."""
    operations = repo / "docs" / "OPERATIONS.md"
    return {repo / "config" / "dsv41.env.example": render_example(),
            operations: splice(operations.read_text(), render_operations_section())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.ops.knob_docs", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a file differs from the table")
    mode.add_argument("--write", action="store_true", help="rewrite the files from the table")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[3], help="repository root")
    args = p.parse_args(argv)
    stale = [path for path, text in targets(args.repo).items() if path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(targets(args.repo)[path])
            print(f"wrote {path}")
        return 0
    for path in stale:
        print(f"{path}: differs from the knob table (python -m dsv41.ops.knob_docs --write)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
