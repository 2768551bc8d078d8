"""Errors that reach a user as one clear line.

Every failure caused by input we do not control (a config field, a checkpoint tensor, a shard file, a request)
is raised as a subclass of `DSV41Error` whose message names the offending thing. The CLI prints the message on
one line and exits non-zero instead of showing a traceback.
"""


class DSV41Error(Exception):
    """Base class: the message is complete and user-facing."""

    exit_code = 2


class ConfigError(DSV41Error):
    """A config.json field is missing, has the wrong type, or an impossible value."""


class CheckpointError(DSV41Error):
    """A tensor is missing, unexpected, mis-shaped, of the wrong dtype, or a shard file is damaged."""


class TokenizerError(DSV41Error):
    """tokenizer.json is missing or lacks a required special token."""
