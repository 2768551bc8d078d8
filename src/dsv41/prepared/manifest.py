"""What a prepared folder claims, and the one-line reason a folder does not fit a start.

A folder is `manifest.json` + `data.bin`. The manifest records:
- `layout_version`: the folder format this code writes and reads (LAYOUT_VERSION; bumped when data.bin's or the
  skeleton's encoding changes);
- `tp`: world size and rank; `build`: compute dtype, fake quantisation, device type and the launch environment the
  kernels' launch records were resolved in (GPU name, capability and SM count, Triton interpreter, backend knobs);
- `source`: the checkpoint's identity (`source_identity`: repo and revision when `dsv41 download` fetched it,
  SHA-256 of config.json / tokenizer.json / the safetensors index, every shard's name, size, modification time and
  the SHA-256 of its first and last MiB) and, for the
  record, each shard's SHA-256 (from the download's verified record, else hashed at prepare);
- `code`: SHA-256 of the source of every module whose classes the skeleton holds and of the modules that decide
  what is stored (writer.BUILD_MODULES: builder, loader, slicing); a changed one refuses the folder, naming it;
  plus torch's version;
- `entries`: each stored byte range of data.bin (a tensor storage or a skeleton part): name, part, offset, nbytes,
  device type, dtype and shape of the tensor it was first seen as, SHA-256;
- `parts`: the skeleton's parts in order ("block.L" per layer, then "model"), each with its entry range;
- `complete`: false while `prepare` is still writing (the manifest is then its resume journal).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from dsv41.errors import DSV41Error

LAYOUT_VERSION = 2  # 2: the model part carries the DSpark drafter when the checkpoint has one
FORMAT = "dsv41-prepared"
MANIFEST = "manifest.json"
DATA = "data.bin"
ALIGN = 4096  # every entry starts on a page (O_DIRECT-able reads, page-aligned views)
DOWNLOAD_RECORD = ".dsv41-download.json"  # written by `dsv41 download` into the folder it fills
IDENTITY_FILES = ("config.json", "tokenizer.json", "model.safetensors.index.json")


class PreparedMismatch(DSV41Error):
    """A prepared folder that does not fit this start (the message is the one-line reason)."""


def rank_folder(root: str | Path, rank: int, world: int) -> Path:
    """The folder of one rank: `root` itself when it holds a manifest, else `root/rank{R}-of-{W}`."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    return root / f"rank{rank}-of-{world}"


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise DSV41Error(f"{index}: not a safetensors index (no weight_map)") from None
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _ends_sha256(path: Path, size: int, span: int = 1 << 20) -> str:
    """SHA-256 of a shard's first and last MiB: with size and mtime, tells a re-generated or replaced checkpoint of the
    same shapes from the one prepared, without reading ~100 GB at every start."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(span))
        handle.seek(max(size - span, 0))
        digest.update(handle.read(span))
    return digest.hexdigest()


def download_record(folder: Path) -> dict:
    """What `dsv41 download` recorded about the folder ({} when it did not fetch it)."""
    try:
        return json.loads((Path(folder) / DOWNLOAD_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def source_identity(folder: str | Path) -> dict:
    """The checkpoint's identity, cheap enough for every start: small files hashed, shards by name and size."""
    folder = Path(folder)
    record = download_record(folder)
    files = {}
    for name in IDENTITY_FILES:
        if (folder / name).is_file():
            files[name] = sha256_file(folder / name)
    shards = {}
    for shard in _shards(folder):
        try:
            st = shard.stat()
        except OSError:
            raise DSV41Error(f"{shard}: shard listed by the index is missing") from None
        shards[shard.name] = [st.st_size, st.st_mtime_ns, _ends_sha256(shard, st.st_size)]
    return {"kind": "checkpoint", "repo": record.get("repo"), "revision": record.get("revision"),
            "files_sha256": files, "shards": shards}


def shard_hashes(folder: str | Path, progress=None) -> dict:
    """Each shard's SHA-256 for the manifest's record: the download's verified values where it fetched them, else
    hashed here (once, at prepare)."""
    folder = Path(folder)
    known = download_record(folder).get("sha256", {})
    out = {}
    for shard in _shards(folder):
        out[shard.name] = known.get(shard.name) or sha256_file(shard)
        if progress:
            progress(shard.name)
    return out


def launch_environment(device) -> dict:
    """What the kernels' launch records (split counts, Triton configs) were resolved against: a folder prepared
    under another GPU or another kernel choice would launch with the wrong records."""
    import torch

    env = {"device": device.type,
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
           "exl3_backend": os.environ.get("DSV41_EXL3_BACKEND", "auto"),
           "exl3_group": os.environ.get("DSV41_EXL3_GROUP", "1") not in ("0", "")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    return env


def module_digests(modules) -> dict:
    """SHA-256 of each module's source file (modules named by the skeleton's classes)."""
    out = {}
    for name in sorted(modules):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None and spec.has_location else None
        out[name] = sha256_file(Path(path)) if path else None
    return out


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PreparedMismatch(f"{folder}: no {MANIFEST} (not a prepared folder; run `dsv41 prepare`)") from None
    except OSError as e:
        raise PreparedMismatch(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise PreparedMismatch(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreparedMismatch(f"{path}: not a {FORMAT} manifest")
    return manifest


def write_manifest(folder: Path, manifest: dict) -> None:
    """Atomically (a reader sees the old manifest or the new one, never half of one)."""
    tmp = folder / (MANIFEST + ".tmp")
    with tmp.open("w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST)


def _differs(what: str, have, want) -> str | None:
    return None if have == want else f"{what}: folder {have}, this start {want}"


def _source_reason(have: dict, want: dict) -> str | None:
    if have.get("kind") != want.get("kind"):
        return f"prepared from a {have.get('kind')} source, this start loads a {want.get('kind')}"
    if want.get("kind") == "synthetic":
        return _differs("synthetic rank", {k: have.get(k) for k in want}, want)
    for key in ("repo", "revision"):
        if have.get(key) and want.get(key) and have[key] != want[key]:
            return f"prepared from {key} {have[key]}, the checkpoint is {want[key]}"
    files_have, files_want = have.get("files_sha256", {}), want.get("files_sha256", {})
    for name in sorted(set(files_have) | set(files_want)):
        if files_have.get(name) != files_want.get(name):
            return f"prepared from another checkpoint: {name} differs"
    shards_have, shards_want = have.get("shards", {}), want.get("shards", {})
    for name in sorted(set(shards_have) | set(shards_want)):
        if shards_have.get(name) != shards_want.get(name):
            return (f"prepared from another checkpoint: shard {name} differs (present, size, modification time or "
                    f"content)")
    return None


def mismatch(manifest: dict, *, source: dict, world: int, rank: int, build: dict) -> str | None:
    """Why the folder does not fit (None when it does). Order: cheapest and most telling first."""
    if manifest.get("layout_version") != LAYOUT_VERSION:
        return (f"layout version {manifest.get('layout_version')}, this code reads {LAYOUT_VERSION}: "
                f"run `dsv41 prepare` again")
    if not manifest.get("complete"):
        return "incomplete (prepare was interrupted): run `dsv41 prepare` again to finish it"
    tp = manifest.get("tp", {})
    if (tp.get("world"), tp.get("rank")) != (world, rank):
        return f"prepared for rank {tp.get('rank')} of TP {tp.get('world')}, this process is rank {rank} of TP {world}"
    reason = _source_reason(manifest.get("source", {}), source)
    if reason:
        return reason
    have = manifest.get("build", {})
    for key in sorted(set(have) | set(build)):
        if have.get(key) != build.get(key):
            return f"prepared with {key} = {have.get(key)}, this start has {build.get(key)}"
    code = manifest.get("code", {})
    import torch

    if code.get("torch") != torch.__version__:
        return f"prepared under torch {code.get('torch')}, this is torch {torch.__version__}"
    now = module_digests(code.get("modules", {}))
    changed = [m for m, digest in code.get("modules", {}).items() if now.get(m) != digest]
    if changed:
        return f"the code that built it changed since ({changed[0]}{' and others' if len(changed) > 1 else ''})"
    return None


def folder_problems(root: str | Path, rank: int, world: int, model_dir: str | Path | None) -> tuple[list[str], dict]:
    """What `preflight` checks of one rank's folder without torch: manifest, layout, completeness, rank, data size,
    source checkpoint, code. (Build settings and the GPU are checked by the start itself.) -> (problems, summary)"""
    folder = rank_folder(root, rank, world)
    try:
        manifest = read_manifest(folder)
    except PreparedMismatch as exc:
        return [str(exc)], {}
    problems = []
    if manifest.get("layout_version") != LAYOUT_VERSION:
        problems.append(f"{folder}: layout version {manifest.get('layout_version')}, this code reads {LAYOUT_VERSION}")
    if not manifest.get("complete"):
        problems.append(f"{folder}: incomplete (prepare was interrupted)")
    tp = manifest.get("tp", {})
    if (tp.get("world"), tp.get("rank")) != (world, rank):
        problems.append(f"{folder}: prepared for rank {tp.get('rank')} of TP {tp.get('world')}, this node runs rank "
                        f"{rank} of TP {world}")
    data = folder / DATA
    size = data.stat().st_size if data.is_file() else None
    if size != manifest.get("data", {}).get("bytes"):
        problems.append(f"{data}: {size} bytes, the manifest says {manifest.get('data', {}).get('bytes')}")
    if model_dir:
        reason = _source_reason(manifest.get("source", {}), source_identity(model_dir))
        if reason:
            problems.append(f"{folder}: {reason}")
    modules = manifest.get("code", {}).get("modules", {})
    changed = [m for m, digest in module_digests(modules).items() if modules.get(m) != digest]
    if changed:
        problems.append(f"{folder}: the code that built it changed since ({', '.join(changed)})")
    summary = {"folder": str(folder), "bytes": manifest.get("data", {}).get("bytes"),
               "revision": manifest.get("source", {}).get("revision"), "build": manifest.get("build", {})}
    return problems, summary
