"""Engram row reads from a shard file on this machine's disk, against the same disk's sequential ceilings.

    python bench/engram_read.py [--dir DIR] [--gib 4] [--threads 32] [--steps 2000] [--chunks 20]
                                [--pack-gib 1] [--out bench/results/engram_read_<host>.json]

1. Writes a shard file of `--gib` GiB (a valid header, rows of random bytes) into `--dir` with O_DIRECT: the
   sequential write ceiling. (`--dir` should be the disk the real shard files go on; the default is ./bench-tmp.)
2. Reads it back sequentially with O_DIRECT, 4 MiB requests, on 1 thread and on `--threads`: the read ceiling.
3. Reads rows at uniformly random positions (the worst case: real rows are Zipfian, top 100 M cover 92.7 %)
   through the engine's reader (`dsv41.engram.reader`, O_DIRECT pread on its thread pool):
   - a decode step: 2 layers × 12 rows (this rank's hash columns), both submitted, then both waited for;
   - a 2,048-token prompt chunk: 2 × 2,048 × 12 = 49,152 rows;
   latency p50 / p99 from submit to the reads done (`io`) and to the rows dequantised on the device (`total`:
   CUDA when there is one; else the CPU with one torch thread, as the intra-op pool only adds wake-ups for these
   small tensors), rows/s, and GB/s (row bytes, and bytes actually read).
4. With `--pack-gib G > 0`: a synthetic original-checkpoint shard of G GiB of table in the release's safetensors
   layout, packed by `dsv41.engram.pack` into the same folder: the pack rate against the write ceiling.

Files are removed afterwards (`--keep` keeps them). One JSON object goes to `--out` and to stdout.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dsv41.engram.reader import ReadPool, ShardRows  # noqa: E402
from dsv41.engram.shards import SHARD_HEADER_BYTES, shard_header  # noqa: E402

ROW = 264
BLOCK = 4 << 20  # sequential request size
GIB = 2 ** 30


def aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)


def write_sequential(path: Path, nbytes: int, first: bytes = b"") -> float:
    """Write `nbytes` (a multiple of 4096) with O_DIRECT, random content starting with `first`; returns bytes/s."""
    buf = aligned(BLOCK)
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        start, done = time.perf_counter(), 0
        while done < nbytes:
            n = min(BLOCK, nbytes - done)
            if done == 0 and first:
                buf[:len(first)] = first
            os.pwrite(fd, memoryview(buf)[:n], done)
            if done == 0 and first:
                np.frombuffer(buf, dtype=np.uint8)[:len(first)] = 7
            done += n
        os.fsync(fd)
        return nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)


def read_sequential(path: Path, nbytes: int, threads: int) -> float:
    """Read the first `nbytes` with O_DIRECT in 4 MiB requests spread over `threads`; returns bytes/s."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    blocks = list(range(0, nbytes - BLOCK + 1, BLOCK))
    lock, cursor = threading.Lock(), [0]

    def worker() -> None:
        buf = aligned(BLOCK)
        while True:
            with lock:
                if cursor[0] >= len(blocks):
                    return
                offset = blocks[cursor[0]]
                cursor[0] += 1
            os.preadv(fd, [buf], offset)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(worker) for _ in range(threads)]:
                f.result()
        return len(blocks) * BLOCK / (time.perf_counter() - start)
    finally:
        os.close(fd)


def percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "mean": statistics.fmean(s)}


def random_reads(rows: ShardRows, n_rows: int, per_layer: int, repeats: int, rng, device: str) -> dict:
    """`repeats` steps of 2 submits of `per_layer` random rows each, then both waits: the latency until the reads
    are done (`io`) and until the rows are dequantised on `device` (`total`), rows/s and GB/s of the reads."""
    io, total, read_bytes = [], [], 0
    for _ in range(repeats):
        ids = [rng.integers(0, n_rows, per_layer) for _ in range(2)]
        start = time.perf_counter()
        pending = [rows.submit(i) for i in ids]
        for p in pending:
            p.wait_io()
        io.append(time.perf_counter() - start)
        for p in pending:
            read_bytes += p._plan.total
            out = p.wait(device)
        if device != "cpu":
            torch.cuda.synchronize()
        del out
        total.append(time.perf_counter() - start)
    n = 2 * per_layer * repeats
    return {"rows": 2 * per_layer, "repeats": repeats, "io_latency_s": percentiles(io),
            "total_latency_s": percentiles(total), "rows_per_s_io": n / sum(io), "rows_per_s": n / sum(total),
            "row_gb_s_io": n * ROW / sum(io) / 1e9, "read_gb_s_io": read_bytes / sum(io) / 1e9,
            "read_bytes_per_row": read_bytes / n}


def pack_bench(folder: Path, gib: float) -> dict:
    """Pack a synthetic `gib`-GiB original table (release layout) with `dsv41.engram.pack` in `folder`."""
    from types import SimpleNamespace

    from dsv41.engram.hashing import engram_primes
    from dsv41.engram.pack import pack_rank
    from dsv41.tiny.model import TINY_TEXT_CONFIG

    vocab = max(1000, int(gib * GIB / ROW / 24))
    fields = dict(engram_layer_ids=[1], engram_max_ngram_size=4, engram_vocab_size=vocab, engram_n_heads=8,
                  engram_head_dim=256)
    n = int(engram_primes(SimpleNamespace(**fields)).sum())
    text = {**TINY_TEXT_CONFIG, **fields, "engram_num_embeddings": [n], "engram_compressed_vocab_size": 436,
            "dspark_noise_token_id": 500}
    src = folder / "original"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": text}))
    shard = "model-00001-of-00001.safetensors"
    header = {"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": [n, 256], "data_offsets": [0, n * 256]},
              "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [n, 8],
                                              "data_offsets": [n * 256, n * 264]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)  # data from a 4 KiB boundary, as O_DIRECT writes need
    data = n * ROW
    write_sequential(src / shard, 8 + len(raw) + data + (-data % 4096), len(raw).to_bytes(8, "little") + raw)
    os.truncate(src / shard, 8 + len(raw) + data)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in header}}))
    report = pack_rank(src, folder / "packed", 0, 2, progress=False)
    return {"table_gib": data / GIB, "rank_gib": report.bytes_written / GIB, "seconds": report.seconds,
            "rate_gb_s": report.rate / 1e9, "buffer_mib": report.buffer_bytes / 2 ** 20,
            "peak_rss_growth_mib": (report.peak_rss - report.start_rss) / 2 ** 20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(REPO / "bench-tmp"), help="a folder on the disk to measure")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the shard file read (GiB)")
    ap.add_argument("--threads", type=int, default=32, help="reader pool size (the queue depth)")
    ap.add_argument("--steps", type=int, default=2000, help="decode steps timed")
    ap.add_argument("--chunks", type=int, default=20, help="2,048-token prompt chunks timed")
    ap.add_argument("--pack-gib", type=float, default=1.0, help="table size for the pack rate (0: skip)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/engram_read_<host>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    args = ap.parse_args()

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "engram-l1-r0of1.bin"
    n_rows = int(args.gib * GIB / ROW) // 512 * 512  # whole 4 KiB blocks: O_DIRECT writes the file end to end
    size = SHARD_HEADER_BYTES + n_rows * ROW
    result = {"host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "dir": str(folder.resolve()),
              "machine": platform.machine(), "cpus": os.cpu_count(), "file_gib": size / GIB, "rows": n_rows,
              "threads": args.threads, "load_average_before": os.getloadavg()}
    try:
        result["sequential_write_gb_s"] = write_sequential(path, size, shard_header(1, 0, n_rows, n_rows, ROW)) / 1e9
        result["sequential_read_gb_s"] = {"1 thread": read_sequential(path, size, 1) / 1e9,
                                          f"{args.threads} threads": read_sequential(path, size, args.threads) / 1e9}
        ceiling = max(result["sequential_read_gb_s"].values())
        pool = ReadPool(args.threads)
        rows = ShardRows(path, n_rows, ROW, 256, pool=pool)
        result["direct"], result["align"] = rows.direct, rows.align
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(1)
        result["device"] = device
        rng = np.random.default_rng(1)
        random_reads(rows, n_rows, 12, 50, rng, device)  # warm the pool and the buffers
        result["decode_step"] = random_reads(rows, n_rows, 12, args.steps, rng, device)
        result["prompt_chunk_2048"] = random_reads(rows, n_rows, 2048 * 12, args.chunks, rng, device)
        for key in ("decode_step", "prompt_chunk_2048"):
            result[key]["read_vs_sequential"] = result[key]["read_gb_s_io"] / ceiling
        rows.close()
        pool.close()
        if args.pack_gib > 0:
            result["pack"] = pack_bench(folder, args.pack_gib)
            result["pack"]["vs_sequential_write"] = result["pack"]["rate_gb_s"] / result["sequential_write_gb_s"]
    finally:
        if not args.keep:
            import shutil

            path.unlink(missing_ok=True)
            for sub in ("original", "packed"):
                shutil.rmtree(folder / sub, ignore_errors=True)
            if folder == REPO / "bench-tmp" and not any(folder.iterdir()):
                folder.rmdir()
    result["load_average_after"] = os.getloadavg()
    out = Path(args.out or REPO / "bench" / "results" / f"engram_read_{result['host']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
