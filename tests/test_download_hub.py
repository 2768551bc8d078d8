"""`dsv41 download` against a local stand-in of the Hub's HTTP endpoints (tests/hub_standin.py): the real CLI in a
child process pointed at it by HF_ENDPOINT, or `download(..., endpoint=)` in this process (a process start costs
~4 s here); huggingface_hub does the HTTP either way, nothing goes beyond 127.0.0.1.

Resume after a cut connection (within a run, and across runs after the run stopped), a wrong checksum refused
and the file removed, a missing revision or repository a one-line error, patterns, a second run that fetches
nothing, the Engram source (only the shards holding the tables), and the free-space check.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hub_standin import HubStandIn

REPO = Path(__file__).resolve().parents[1]
COMMIT = "1234567890abcdef1234567890abcdef12345678"
BIG = "model-00001-of-00002.safetensors"
MIB = 1 << 20
CUT = 12 * MIB  # huggingface_hub writes (and resumes) in 10 MiB chunks: a cut after one of them


def _bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


FILES = {"config.json": b'{"model_type": "deepseek_v41"}\n', "README.md": b"# pack\n",
         BIG: _bytes(24 * MIB + 17, 1), "model-00002-of-00002.safetensors": _bytes(MIB // 2, 2)}
LFS = {BIG, "model-00002-of-00002.safetensors"}


@pytest.fixture()
def hub():
    with HubStandIn() as stand_in:
        stand_in.add_repo("org/pack", FILES, LFS, COMMIT, {"main": COMMIT, "v1": COMMIT})
        yield stand_in


def download(hub: HubStandIn, dest: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(dest.parent / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=str(REPO / "src"), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    return subprocess.run([sys.executable, "-m", "dsv41.cli", "download", "--dir", str(dest), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def fetch(hub: HubStandIn, dest: Path, repo: str, revision: str, patterns=None, engram=False):
    """`download` in this process; a DSV41Error's one line, or None."""
    from dsv41.errors import DSV41Error
    from dsv41.hub.download import download as run, download_engram_source

    try:
        if engram:
            download_engram_source(repo, revision, dest, log=lambda line: None, endpoint=hub.url)
        else:
            run(repo, revision, dest, patterns, log=lambda line: None, endpoint=hub.url)
    except DSV41Error as exc:
        return str(exc)
    return None


def _error_line(res: subprocess.CompletedProcess) -> str:
    return res.stderr.strip().splitlines()[-1]


def _gets(hub: HubStandIn, name: str) -> list[str | None]:
    return [rng for method, file, rng in hub.requests if file == name]


def test_download_resumes_a_cut_connection_and_verifies(hub, tmp_path):
    hub.cut[BIG] = CUT  # the connection drops after 12 MiB of the first GET
    dest = tmp_path / "pack"
    res = download(hub, dest, "--repo", "org/pack", "--revision", "main", "--include", "*.safetensors", "*.json")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".")) == sorted(
        ["config.json", BIG, "model-00002-of-00002.safetensors"])  # README.md not matched
    for name in ("config.json", BIG, "model-00002-of-00002.safetensors"):
        assert (dest / name).read_bytes() == FILES[name], name
    first, resumed = _gets(hub, BIG)  # one GET cut, one GET from where it stopped, nothing more
    assert first is None and resumed.startswith("bytes=") and 0 < int(resumed[6:-1]) <= CUT
    record = json.loads((dest / ".dsv41-download.json").read_text())
    assert record["repo"] == "org/pack" and record["revision"] == COMMIT and record["requested_revision"] == "main"
    assert record["sha256"][BIG] == hashlib.sha256(FILES[BIG]).hexdigest()
    assert "complete and verified" in res.stderr

    hub.requests.clear()
    again = download(hub, dest, "--repo", "org/pack", "--revision", "main", "--include", "*.safetensors", "*.json")
    assert again.returncode == 0 and "3 already verified, 0 to fetch" in again.stderr
    assert hub.requests == []  # nothing fetched twice


def test_a_stopped_run_resumes_in_the_next(hub, tmp_path):
    hub.cut[BIG], hub.refuse_after_cut = CUT, True  # cut, then 503: this run stops
    dest = tmp_path / "pack"
    error = fetch(hub, dest, "org/pack", COMMIT, [BIG])
    kept = (dest / ".dsv41-partial" / (BIG + ".part")).stat().st_size
    assert error.startswith(f"{BIG}: download interrupted (") and error.endswith(
        f"{kept} bytes kept, run the same command again to resume it")
    assert not (dest / BIG).exists() and 0 < kept <= CUT
    hub.refuse_after_cut = False
    hub.requests.clear()
    assert fetch(hub, dest, "org/pack", COMMIT, [BIG]) is None
    (rng,) = _gets(hub, BIG)
    assert rng == f"bytes={kept}-"  # the part the stopped run kept is continued, not fetched again
    assert (dest / BIG).read_bytes() == FILES[BIG]


def test_a_wrong_checksum_is_refused_and_the_file_removed(hub, tmp_path):
    hub.corrupt.add(BIG)
    dest = tmp_path / "pack"
    error = fetch(hub, dest, "org/pack", "v1", [BIG])
    want = hashlib.sha256(FILES[BIG]).hexdigest()
    bad = hashlib.sha256(bytes([FILES[BIG][0] ^ 0xFF]) + FILES[BIG][1:]).hexdigest()
    assert error == (f"{BIG}: checksum {bad} differs from the Hub's {want} (file removed; run the same command "
                     f"again to fetch it anew)")
    assert not (dest / BIG).exists() and not (dest / ".dsv41-partial" / (BIG + ".part")).exists()
    assert not (dest / ".dsv41-download.json").exists()  # nothing was verified
    hub.corrupt.clear()
    assert fetch(hub, dest, "org/pack", "v1", [BIG]) is None
    assert (dest / BIG).read_bytes() == FILES[BIG]


def test_missing_revision_and_repository_are_one_line_errors(hub, tmp_path):
    res = download(hub, tmp_path / "a", "--repo", "org/pack", "--revision", "no-such-tag")
    assert res.returncode == 2 and res.stderr.strip() == (f"dsv41: error: revision no-such-tag not found in org/pack "
                                                          f"(at {hub.url})")
    assert fetch(hub, tmp_path / "b", "org/nothing", "main") == (f"repository org/nothing not found at {hub.url} "
                                                                 f"(check the name; a private or gated repository "
                                                                 f"needs HF_TOKEN)")
    assert fetch(hub, tmp_path / "c", "org/pack", "main", ["*.gguf"]) == "no file of org/pack@main matches *.gguf"


def test_engram_source_fetches_only_the_table_shards(hub, tmp_path, tiny_model_dir):
    from dsv41.config import ModelConfig

    config = (tiny_model_dir / "config.json").read_bytes()
    layers = ModelConfig.from_file(tiny_model_dir).engram_layer_ids
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weight_map = {"embed.weight": shards[0], "head.weight": shards[2]}
    for L in layers:
        weight_map.update({f"layers.{L}.engram.embed.weight": shards[1], f"layers.{L}.engram.embed.scale": shards[1]})
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    files = {"config.json": config, "model.safetensors.index.json": index,
             **{s: _bytes(64 << 10, i) for i, s in enumerate(shards)}}
    hub.add_repo("org/release", files, set(shards), COMMIT, {"main": COMMIT})
    dest = tmp_path / "orig"
    assert fetch(hub, dest, "org/release", "main", engram=True) is None
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".")) == sorted(
        ["config.json", "model.safetensors.index.json", shards[1]])
    assert {f for _, f, _ in hub.requests} == {"config.json", "model.safetensors.index.json", shards[1]}


def test_too_little_disk_space_is_refused_before_downloading(tmp_path):
    from dsv41.hub.download import DownloadError, RemoteFile, check_space

    files = [RemoteFile("a.safetensors", 50 << 30, "0" * 64, None), RemoteFile("b.json", 10, None, "0" * 40)]
    with pytest.raises(DownloadError) as info:
        check_space(tmp_path, files, free=20 << 30)
    assert str(info.value) == f"{tmp_path}: 2 file(s) need 50.00 GiB more (+ 1 GiB margin), only 20.00 GiB free"
    check_space(tmp_path, files, free=52 << 30)
