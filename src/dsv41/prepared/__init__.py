"""Prepared per-rank folders (docs/WEIGHTS.md "Prepared folders"): one rank's built FastModel stored as the bytes it
places on the device (`data.bin`) plus a JSON manifest, so a restart reads one file sequentially instead of parsing,
validating and laying out the checkpoint again.

- `manifest.py`: what a folder claims (source, build settings, code, TP rank) and why a folder does not fit a start.
- `skeleton.py`: the object tree around the tensors, pickled with every tensor and every per-process object as a
  reference (tensors -> entries of data.bin; device, comm, workspace, tokenizer, Engram tables -> the loader's).
- `writer.py`: `prepare(...)` (resumable, a block at a time) and `check_folder(...)` (`dsv41 prepare --check`).
- `reader.py`: `load_prepared(...)`: large sequential reads (pinned buffers and async copies on CUDA).
- `warm_kernels.py`: `dsv41 warm-kernels` (also at the end of `dsv41 prepare` on CUDA, and in deploy): the start
  run once in a child into the unit's TRITON_CACHE_DIR, so the service's next start compiles no Triton kernel.
- `cli.py`: `dsv41 prepare`, `dsv41 warm-kernels`; `start.py`: the `--prepared` options of `generate` and `serve`, the load with its
  checkpoint fallback.
"""
