"""Compiler view of the fused EXL3 matmul (registers, spills, shared memory, SASS opcode mix) for one config.

Costs seconds of device time, no timing: what METHOD.md calls reading what costs no device time.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsv41.kernels.exl3 import matmul as exl3_matmul  # noqa: E402
from dsv41.kernels.exl3.matmul import MatmulConfig, fused_matmul  # noqa: E402
from dsv41.kernels.exl3.layout import Exl3Tensor  # noqa: E402


def main(out_dir: str) -> None:
    k, n, K = 5120, 2304, 3
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int32, device="cuda")
    w = Exl3Tensor.from_group(trellis.to(torch.int16), torch.ones(k).half().cuda(), torch.ones(n).half().cuda(), "mul1")
    x = torch.randn(1, k, device="cuda").half()
    for cfg in (MatmulConfig(7, 64, 8), MatmulConfig(15, 32, 4), MatmulConfig(7, 32, 8, prerotate=True)):
        fused_matmul(x, w, config=cfg)
    kernel = exl3_matmul._exl3_matmul_kernel
    for key, compiled in list(kernel.device_caches[0][0].items()):
        meta = compiled.metadata
        try:
            sass = compiled.asm["sass"]
        except Exception as exc:  # the disassembler may be missing; registers and spills still print
            sass = f"no sass: {exc}"
        ops = collections.Counter(
            m.group(1).split(".")[0] for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)", sass, re.M)
        )
        print(f"num_warps={meta.num_warps} regs={compiled.n_regs} spills={compiled.n_spills} shared={meta.shared}")
        print("  total SASS instructions", sum(ops.values()), "top:", ops.most_common(28))
        name = f"matmul_w{meta.num_warps}_{len(sass)}"
        Path(out_dir, name + ".sass").write_text(sass)
        Path(out_dir, name + ".ttgir").write_text(compiled.asm.get("ttgir", ""))


if __name__ == "__main__":
    main(sys.argv[1])
