"""Loading never materialises more than the tensors asked for: a 240 MB sharded checkpoint is read tensor by
tensor, sliced and turned into Linears in a fresh subprocess whose peak resident set is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from dsv41.weights import ShardedWriter, write_linear

MB = 1024 * 1024
BIG_SHAPE = (2048, 4096)  # bf16: 16 MB each
BIG_COUNT = 14


def big_tensor(i: int) -> torch.Tensor:
    return (torch.randn(BIG_SHAPE, generator=torch.Generator().manual_seed(100 + i)) * 0.02).bfloat16()


def checksum(t: torch.Tensor) -> float:
    return sum(chunk.double().sum().item() for chunk in t.split(256))


# Runs in the subprocess. The peak resident set (VmHWM) is reset after imports so only loading counts.
CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from dsv41.weights import Checkpoint, Linear

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def checksum(t):
        return sum(chunk.double().sum().item() for chunk in t.split(256))

    folder, expected = sys.argv[1], json.loads(sys.argv[2])
    torch.zeros(4, 4) @ torch.zeros(4, 4)  # warm up the allocator and BLAS before measuring

    def reset_peak():
        # Reset the peak RSS to the current RSS; without /proc/self/clear_refs the process-lifetime peak
        # (ru_maxrss) can only over-state growth measured against the post-import RSS.
        try:
            open("/proc/self/clear_refs", "w").write("5")
            return lambda: status("VmHWM")
        except OSError:
            return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    peak = reset_peak()
    base = status("VmRSS")

    ckpt = Checkpoint(folder)
    sums = {}
    for name in ckpt.names():
        t = ckpt.get(name)
        if name.startswith("big."):
            sums[name] = checksum(t)
        del t
    sums["rows"] = checksum(ckpt.get_slice("big.3.weight", 0, 512, 1024))
    sums["cols"] = checksum(ckpt.get_slice("big.4.weight", 1, 1000, 1100))
    after_reads = status("VmRSS")
    read_peak = peak() - base

    peak = reset_peak()
    base = status("VmRSS")

    x = torch.randn(3, 4096).bfloat16()
    col = Linear.from_checkpoint(ckpt, "big.5", split="col", rank=1, world=2)
    sums["col_linear"] = checksum(col.materialize(torch.bfloat16))
    col(x)
    del col
    row = Linear.from_checkpoint(ckpt, "big.6", split="row", rank=0, world=2)
    sums["row_linear"] = checksum(row.materialize(torch.bfloat16))
    del row
    fp8 = Linear.from_checkpoint(ckpt, "q.fp8", expected_shape=(2048, 4096))
    fp8(x.float())
    del fp8
    ex = Linear.from_checkpoint(ckpt, "q.exl3", split="col", rank=0, world=2)
    ex(torch.randn(3, 2048))
    del ex
    print(json.dumps({"sums": sums, "read_peak": read_peak, "linear_peak": peak() - base,
                      "after_reads": after_reads - base}))
    """
)


def test_peak_rss_stays_far_below_the_checkpoint_size(tmp_path):
    expected = {}
    with ShardedWriter(tmp_path, max_shard_bytes=64 * MB) as writer:
        for i in range(BIG_COUNT):
            t = big_tensor(i)
            writer.add(f"big.{i}.weight", t)
            expected[f"big.{i}.weight"] = checksum(t)
            if i == 3:
                expected["rows"] = checksum(t[512:1024])
            if i == 4:
                expected["cols"] = checksum(t[:, 1000:1100])
            if i == 5:
                expected["col_linear"] = checksum(t[1024:])
            if i == 6:
                expected["row_linear"] = checksum(t[:, :2048])
        write_linear(writer, "q.fp8", torch.randn(2048, 4096) * 0.02, "fp8")
        write_linear(writer, "q.exl3", torch.randn(1024, 2048) * 0.02, "exl3", K=4)
        total = writer.total_size
    shards = list(tmp_path.glob("model-*.safetensors"))
    assert total >= 200 * MB and len(shards) >= 4

    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), json.dumps(expected)],
        capture_output=True, text=True, timeout=120,
        # A fixed mmap threshold makes glibc return freed large buffers at once instead of keeping them in
        # its heap, so the measured peak is what the loader holds, not what the allocator cached.
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for key, value in expected.items():
        assert abs(report["sums"][key] - value) <= 1e-9 * max(1.0, abs(value)), key

    largest_stored = 16 * MB  # a bf16 big.* tensor
    largest_dense = 32 * MB  # q.fp8 dequantised to fp32
    print(f"checkpoint {total / MB:.0f} MB in {len(shards)} shards; peak RSS growth: reading every tensor "
          f"{report['read_peak'] / MB:.1f} MB, building Linears {report['linear_peak'] / MB:.1f} MB; "
          f"RSS left after the reads {report['after_reads'] / MB:.1f} MB")
    # Reading tensor by tensor holds one tensor at a time: far below one 64 MB shard, let alone the checkpoint.
    assert report["read_peak"] < 1.5 * largest_stored + 16 * MB
    assert report["after_reads"] < largest_stored  # nothing read earlier stays resident (no lingering maps)
    assert report["linear_peak"] < 1.5 * largest_dense + 50 * MB
