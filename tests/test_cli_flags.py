"""The CLI (issue 33, item 9): `--cpu-threads` on every command that runs the model, every numeric flag
range-checked with a one-line error, `score --out` into a missing folder, the docs' nix commands verbatim."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.cli import build_parser, main
from dsv41.server.cli import ENGINE_LIMITS

REPO = Path(__file__).resolve().parents[1]
MODEL_COMMANDS = ("generate", "score", "bench", "serve")
# serve's flags checked after parsing, before anything binds or loads (server/cli.check_limits, check_tp_args)
CHECKED_AT_START = {"--port", "--max-model-len", "--max-body-bytes", "--body-timeout", "--drain-timeout",
                    "--max-waiting", "--tp", "--rank", "--tp-deadline", "--tp-peer-timeout",
                    "--tp-collective-timeout", *(flag for _, flag, *_ in ENGINE_LIMITS)}


def subcommands() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


# engram's flags live on its own subcommands (`engram pack`): `test_engram_and_prepare_flags_are_range_checked`
OTHERS = {"engram"}


def numeric_flags() -> list[tuple[str, str]]:
    """(command, flag) for every option whose value is a number, in the commands this CLI defines."""
    found = []
    for command, parser in subcommands().items():
        if command in OTHERS:
            continue
        for action in parser._actions:
            kind = getattr(action.type, "__name__", None)
            if action.option_strings and kind in ("int", "float"):
                found.append((command, action.option_strings[-1]))
    return found


def one_line_refusal(argv: list[str], capsys) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, f"{argv}: rc {rc}\n{err}"
    assert "Traceback" not in err and err.count("\n") == 1, f"{argv}: not one line:\n{err}"
    return err.strip()


def test_cpu_threads_on_every_command_that_runs_the_model():
    commands = subcommands()
    for command in MODEL_COMMANDS:
        options = {o for a in commands[command]._actions for o in a.option_strings}
        assert "--cpu-threads" in options, command


def unchecked_flags() -> list[tuple[str, str]]:
    return [(command, flag) for command, flag in numeric_flags()
            if getattr(next(a for a in subcommands()[command]._actions if flag in a.option_strings).type,
                       "__module__", "") == "builtins"
            and not (command == "serve" and flag in CHECKED_AT_START)]


def test_every_numeric_flag_is_range_checked():
    """A numeric flag either parses through a range-checking type or is checked at serve's start."""
    assert not unchecked_flags(), unchecked_flags()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--parallel", "0"], "dsv41: error: --parallel must be an integer >= 1, got 0"),
    (["serve", "--page-tokens", "0"], "dsv41: error: --page-tokens must be an integer >= 1, got 0"),
    (["serve", "--prefill-share", "2"], "dsv41: error: --prefill-share must be a number > 0 and <= 1, got 2"),
    (["serve", "--expert-topp", "nan"], "dsv41: error: --expert-topp must be a number > 0 and <= 1, got nan"),
    (["serve", "--cpu-threads", "0"], "dsv41 serve: error: argument --cpu-threads: must be an integer >= 1, got 0"),
    (["generate", "--prompt", "x", "--max-tokens", "0"],
     "dsv41 generate: error: argument --max-tokens: must be an integer >= 1, got 0"),
    (["generate", "--prompt", "x", "--top-p", "1.5"],
     "dsv41 generate: error: argument --top-p: must be a number > 0 and <= 1, got 1.5"),
    (["bench", "--chunk", "x"], "dsv41 bench: error: argument --chunk: must be an integer >= 1, got 'x'"),
    (["canary", "--wait", "inf"], "dsv41 canary: error: argument --wait: must be a number >= 0, got inf"),
    (["deploy", "--head", "a", "--worker", "b", "--ready-timeout", "0"],
     "dsv41 deploy: error: argument --ready-timeout: must be a number > 0, got 0"),
])
def test_bad_numbers_are_one_line(argv, message, capsys):
    """`--parallel 0`, `--page-tokens 0`, `--prefill-share 2` ended in tracebacks."""
    assert one_line_refusal(argv, capsys) == message


def test_minus_one_is_refused_by_every_numeric_flag(capsys):
    """-1 is outside every flag's range: each refusal is one line, before anything loads."""
    required = {"generate": ["--prompt", "x"], "score": ["--model", "m", "--input", "i", "--out", "o"],
                "deploy": ["--head", "a", "--worker", "b"]}
    unchecked = unchecked_flags()  # reported by the test above; run here they could start a server for real
    for command, flag in numeric_flags():
        if (command, flag) in unchecked:
            continue
        err = one_line_refusal([command, *required.get(command, []), flag, "-1"], capsys)
        assert flag in err, err


def test_score_out_into_a_missing_folder_is_made(tmp_path):
    from dsv41.tiny.model import default_model_dir

    spec = tmp_path / "in.json"
    spec.write_text(json.dumps({"ids": [0, 5, 6, 7], "chunks": [2]}))
    out = tmp_path / "not" / "yet" / "logits.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-m", "dsv41.cli", "score", "--model", str(default_model_dir()),
                             "--input", str(spec), "--out", str(out), "--cpu-threads", "1"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert out.is_file() and "Traceback" not in result.stderr


def test_bench_uses_cpu_threads():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-m", "dsv41.cli", "bench", "--cpu-threads", "1", "--prompt-tokens",
                             "8", "--chunk", "8", "--tokens", "2"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["cpu_threads"] == 1


def test_docs_nix_commands_work_without_flakes_enabled():
    """Debian's Nix 2.8 (and a fresh install) has no `nix-command flakes`: `nix run .#deploy` as documented failed.
    Every nix command the docs give to run (code blocks) passes the flag itself."""
    new_style = re.compile(r"^\s*nix (run|build|flake|eval|copy|develop|shell|profile)\b")
    offenders = []
    for doc in [*(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        in_block = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
            elif in_block and new_style.match(line) and "--extra-experimental-features" not in line:
                offenders.append(f"{doc.name}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize("argv", [
    ["prepare", "--out", "x", "--tp", "0"], ["prepare", "--out", "x", "--rank", "-1"],
    ["engram", "pack", "--src", "x", "--tp", "0"], ["engram", "pack", "--src", "x", "--rank", "-2"],
    ["engram", "pack", "--src", "x", "--sample", "0"], ["engram", "pack", "--src", "x", "--max-mib-s", "nan"],
])
def test_engram_and_prepare_flags_are_range_checked(argv, capsys):
    err = one_line_refusal(argv, capsys)
    assert argv[-2] in err and "must be" in err, err
