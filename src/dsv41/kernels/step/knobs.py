"""The step kernels' A/B switches: environment variables read at each launch (no restart to flip one), on unless
set to one of the spellings of off."""

from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")


def switched_on(env: str) -> bool:
    """Whether the switch `env` is on (unset: on)."""
    return os.environ.get(env, "1").strip().lower() not in OFF
