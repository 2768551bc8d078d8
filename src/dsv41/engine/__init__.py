"""The engine side of serving: an async request interface, keyed sampling, grammar masks."""

from .interface import (
    Engine,
    EngineClosed,
    EngineFailure,
    EngineRejected,
    EngineOverloaded,
    EngineStats,
    FinishEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    RequestStream,
    TokenEvent,
)
from .params import SamplingParams

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineFailure",
    "EngineRejected",
    "EngineOverloaded",
    "EngineStats",
    "FinishEvent",
    "GenerationRequest",
    "PromptLogprobsEvent",
    "RequestStream",
    "SamplingParams",
    "TokenEvent",
]
