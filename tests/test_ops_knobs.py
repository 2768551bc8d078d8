"""One source for knobs (issue 33, item 6): the knob table generates the example config and OPERATIONS.md's knob
section, and deploy, serve, preflight, status and the docs agree with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsv41.ops import knob_docs
from dsv41.ops.deploy import Deploy, Options
from dsv41.ops.host_commands import Result
from dsv41.ops.knobs import (DEVELOPER_SWITCHES, ENV_KNOBS, INTERNAL, OPS_KNOBS, PASSTHROUGH_EXAMPLES, SERVE_KNOBS,
                             UNIT_SET, knob_names, parse_env_file, tp_ranks, unknown_keys)
from dsv41.ops.units import render_units

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "dsv41"
NAME = re.compile(r"\bDSV41_[A-Z0-9_]*[A-Z0-9]\b")
# names the docs cite only as what deploy refuses
REFUSED_EXAMPLES = {"DSV41_PROT", "DSV41_PREPARED_DIR"}
# serve options that are no knob on purpose: the rank comes from the unit instance; fake quant off is diagnosis
SERVE_ONLY = {"--help", "--rank", "--no-fake-quant"}


def names_in(paths) -> dict[str, set[Path]]:
    found: dict[str, set[Path]] = {}
    for path in paths:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(path)
    return found


def test_generated_files_equal_the_knob_table():
    stale = [str(path) for path, text in knob_docs.targets(REPO).items() if path.read_text() != text]
    assert not stale, f"{stale} differ from src/dsv41/ops/knobs.py: run python -m dsv41.ops.knob_docs --write"
    assert knob_docs.main(["--check", "--repo", str(REPO)]) == 0


def test_check_mode_names_a_stale_file(tmp_path, capsys):
    (tmp_path / "config").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "config" / "dsv41.env.example").write_text(knob_docs.render_example().replace("=8000", "=8001"))
    (tmp_path / "docs" / "OPERATIONS.md").write_text((REPO / "docs" / "OPERATIONS.md").read_text())
    assert knob_docs.main(["--check", "--repo", str(tmp_path)]) == 1
    assert "dsv41.env.example: differs from the knob table" in capsys.readouterr().err
    assert knob_docs.main(["--write", "--repo", str(tmp_path)]) == 0
    assert knob_docs.main(["--check", "--repo", str(tmp_path)]) == 0


def serve_options() -> set[str]:
    from dsv41.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {a.option_strings[-1] for a in sub.choices["serve"]._actions if a.option_strings}


def test_serve_flags_and_serve_knobs_are_the_same_set():
    options = serve_options()
    flags = {knob.flag for knob in SERVE_KNOBS} | {knob.flag for knob in ENV_KNOBS if knob.flag}
    assert flags <= options, f"knobs for flags serve does not take: {flags - options}"
    assert options - SERVE_ONLY <= flags, f"serve flags without a knob: {options - SERVE_ONLY - flags}"


def test_deploy_accepts_every_documented_knob(tmp_path):
    """Deploy refused DSV41_GRAPHS_BOOT_S (documented) and GLOO_SOCKET_IFNAME (recommended)."""
    example = parse_env_file(REPO / "config" / "dsv41.env.example")
    assert unknown_keys(example) == []
    everything = {name: "1" for name in knob_names()} | {v.env: v.example for v in PASSTHROUGH_EXAMPLES}
    assert "DSV41_GRAPHS_BOOT_S" in everything and "GLOO_SOCKET_IFNAME" in everything
    config = tmp_path / "dsv41.env"
    config.write_text("".join(f"{k}={v}\n" for k, v in everything.items()))
    lines: list[str] = []
    opts = Options(head="root@a", worker="root@b", flake="/src", config=config, dry_run=True)
    assert Deploy(opts, run=lambda *a, **k: Result(0), out=lines.append).execute() == 0
    # what is not a knob stays refused
    for name in [*DEVELOPER_SWITCHES, *INTERNAL, *UNIT_SET, *REFUSED_EXAMPLES]:
        assert unknown_keys({name: "1"}) == [name], name


def test_every_dsv41_variable_in_the_code_is_classified():
    found = names_in(SRC.rglob("*.py"))
    classified = knob_names() | set(DEVELOPER_SWITCHES) | set(INTERNAL) | set(UNIT_SET) | REFUSED_EXAMPLES
    unknown = {name: sorted(str(p.relative_to(REPO)) for p in paths) for name, paths in found.items()
               if name not in classified}
    assert not unknown, f"DSV41_* names that are neither knobs nor listed as not-knobs in ops/knobs.py: {unknown}"
    # and the table has no knob nobody reads (the generic readers: serve_argv for serve knobs, the server's env)
    for knob in [*ENV_KNOBS]:
        readers = [p for p in found.get(knob.env, ()) if "ops" not in p.parts]
        assert readers, f"{knob.env}: no code outside ops/ reads it"


def test_ops_commands_read_only_knobs():
    """preflight, warm, status, watchdog, boot, canary, deploy: every DSV41_* name they read is in the table."""
    found = names_in(p for p in (SRC / "ops").glob("*.py") if p.name not in ("knobs.py", "knob_docs.py"))
    stray = {name for name in found if name not in knob_names() | set(UNIT_SET) | REFUSED_EXAMPLES}
    assert not stray, stray


def test_docs_name_only_knowable_variables():
    """Every DSV41_* name the docs mention is a knob, or listed as not one (kernel switches, unit-set, internal);
    every knob is in OPERATIONS.md (it omitted 17 that deploy accepted)."""
    docs = [*(REPO / "docs").rglob("*.md"), REPO / "README.md"]
    found = names_in(docs)
    known = knob_names() | set(DEVELOPER_SWITCHES) | set(INTERNAL) | set(UNIT_SET) | REFUSED_EXAMPLES
    stray = {name: sorted(str(p.relative_to(REPO)) for p in paths) for name, paths in found.items()
             if name not in known}
    assert not stray, stray
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    missing = sorted(name for name in knob_names() if f"`{name}`" not in operations)
    assert not missing, f"OPERATIONS.md omits {missing}"


def test_units_set_only_unit_variables():
    for name, text in render_units().items():
        for variable in re.findall(r"^Environment=(DSV41_\w+)=", text, re.M):
            assert variable in UNIT_SET, f"{name} sets {variable}"


# ------------------------------------------------------------------------------------------ DSV41_TP, Engram dir

def test_tp_ranks():
    assert tp_ranks({"DSV41_TP": "1"}) == ["rank0"]
    assert tp_ranks({"DSV41_TP": "2"}) == ["rank0", "rank1"]
    assert tp_ranks({}) == ["rank0", "rank1"]  # the appliance default: the two Sparks


def test_status_follows_dsv41_tp(tmp_path):
    """`dsv41 status` listed (and asked the worker about) rank 1 at DSV41_TP=1."""
    from dsv41.ops.status import collect_status, format_status

    asked = []

    def systemctl(argv, host=None, timeout=None, input=None):
        asked.append((host, argv[-1]))
        return Result(0, "ActiveState=active\nResult=success\n")

    env = {"DSV41_PORT": "1", "DSV41_WORKER_SSH": "dsv41@worker", "STATE_DIRECTORY": str(tmp_path), "DSV41_TP": "1"}
    status = collect_status(env, systemctl)
    assert list(status["ranks"]) == ["rank0"] and asked == [(None, "dsv41@rank0.service")]
    assert "rank1" not in format_status(status)
    asked.clear()
    status = collect_status({**env, "DSV41_TP": "2"}, systemctl)
    assert list(status["ranks"]) == ["rank0", "rank1"] and (("dsv41@worker", "dsv41@rank1.service") in asked)


def test_watchdog_follows_dsv41_tp(tmp_path):
    from dsv41.ops.watchdog import Watchdog
    from dsv41.ops.health import Reply

    asked = []

    def systemctl(argv, host=None, timeout=None, input=None):
        asked.append(host)
        return Result(0, "ActiveState=active\nResult=success\n")

    env = {"DSV41_TP": "1", "DSV41_WORKER_SSH": "dsv41@worker", "STATE_DIRECTORY": str(tmp_path)}
    tick = Watchdog(env, systemctl, probe=lambda url: Reply(200, {"status": "ok"}, "")).tick()
    assert tick.outcome == "ok" and asked == [None]


def test_preflight_follows_dsv41_tp(tmp_path):
    from dsv41.ops.preflight import run_preflight

    def never(*args, **kwargs):
        raise AssertionError("no worker at DSV41_TP=1")

    env = {"DSV41_TP": "1", "DSV41_WORKER_SSH": "dsv41@worker", "DSV41_MASTER": "127.0.0.1:1",
           "DSV41_PORT": "0", "DSV41_MODEL": ""}
    results = {c.name: c for c in run_preflight(env, run=never)}
    assert results["worker"].status == "skip" and "DSV41_TP=1" in results["worker"].detail
    assert "127.0.0.1:1" not in results["ports"].detail and ":1," not in results["ports"].detail


def test_preflight_takes_an_empty_engram_dir_as_serve_does():
    """preflight failed an empty DSV41_ENGRAM_DIR that serve runs fine without (the tables in the model folder)."""
    pytest.importorskip("torch", reason="the Engram shard format needs torch")
    from dsv41.ops.preflight import Node, check_engram
    from dsv41.server.cli import _engram_dir
    from dsv41.tiny.model import default_model_dir

    model = default_model_dir()  # has Engram layers 1 and 4, tables inside the folder
    check = check_engram(Node({"DSV41_MODEL": str(model), "DSV41_ENGRAM_DIR": "", "DSV41_TP": "2"}))
    assert check.status == "skip" and "model folder" in check.detail

    class Args:
        engram_dir = None

    import os
    saved = os.environ.pop("DSV41_ENGRAM_DIR", None)
    try:
        assert _engram_dir(Args()) is None  # serve: no shards folder, the model folder's tables
    finally:
        if saved is not None:
            os.environ["DSV41_ENGRAM_DIR"] = saved
