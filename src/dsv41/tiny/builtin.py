"""The built-in model: the trained tiny DeepSeek-V4.1 that ships inside the package (tiny/trained/).

`dsv41 train-tiny` made it on a GPU (docs/TINY_MODEL.md: data, steps, loss curve, measured quality); it is the
model of `make run`, `generate`, `serve`, `eval`, `bench` and `prepare` when no `--model` is given. The folder is
a plain checkpoint in the release's FP8 layout, read in place (nothing is generated or cached).

The random generator (tiny/model.py `make_tiny`, cached by `default_model_dir`) stays for the tests: it has the
built-in shapes that split at every TP degree and the EXL3 pack's layout.
"""

from __future__ import annotations

from pathlib import Path

from dsv41.errors import DSV41Error

TRAINED_DIR = Path(__file__).resolve().with_name("trained")


def builtin_model_dir() -> Path:
    """The shipped trained model's folder; a clear error if the install lost its weights."""
    index = TRAINED_DIR / "model.safetensors.index.json"
    if not index.is_file():
        raise DSV41Error(f"the built-in model is missing ({index} not found): the install did not include "
                         f"src/dsv41/tiny/trained/; pass --model DIR, or write a random one with `dsv41 make-tiny DIR`")
    return TRAINED_DIR
