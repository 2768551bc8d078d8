"""Errors of the chat layer: each names what in the conversation, completion or request is wrong.

They subclass `ValueError` as well as `DSV41Error` so callers that only know the standard library (or the
reference encoder's habit of raising AssertionError/ValueError) can still catch them as bad input.
"""

from ..errors import DSV41Error


class ChatError(DSV41Error, ValueError):
    """Base class of the chat layer's input errors."""


class EncodingError(ChatError):
    """A conversation the official V4.1 encoder refuses (or would crash on)."""


class ParseError(ChatError):
    """A completion the official V4.1 parser refuses."""


class RequestError(ChatError):
    """An OpenAI request field that cannot be mapped to the encoder; `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
