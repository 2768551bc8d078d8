"""The step kernels' A/B switches: environment variables read at each launch (no restart to flip one), on unless
set to one of the spellings of off."""

from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")


def switched_on(env: str, default: bool = True) -> bool:
    """Whether the switch `env` is on (unset or empty: `default`, on unless a switch says otherwise)."""
    value = os.environ.get(env, "").strip().lower()
    return default if not value else value not in OFF
