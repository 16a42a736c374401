"""Prism's inference engine for Qwen3-VL.

Public API: :class:`Engine`, :class:`SamplingParams`, :class:`RequestHandle` (what
``Engine.submit`` returns), :class:`WarmHandle` (what ``Engine.warm`` returns),
:class:`Completion`, :class:`Telemetry` and the :class:`PrismError` family.
"""

from .engine import Engine, EngineOptions, Forgotten
from .errors import (
    CheckpointError,
    EngineAbortedError,
    EngineOverloadedError,
    ImageDigestMismatchError,
    InvalidImageError,
    InvalidRequestError,
    InvalidVideoError,
    PrismError,
    RequestTooLargeError,
    TensorParallelError,
)
from .inputs.prompts import media_first_messages
from .serving.handle import RequestHandle, WarmHandle
from .serving.outputs import Completion, Telemetry
from .serving.sampling import SamplingParams

__all__ = [
    "CheckpointError",
    "Completion",
    "EngineAbortedError",
    "Engine",
    "EngineOptions",
    "EngineOverloadedError",
    "Forgotten",
    "ImageDigestMismatchError",
    "RequestTooLargeError",
    "InvalidImageError",
    "InvalidRequestError",
    "InvalidVideoError",
    "PrismError",
    "RequestHandle",
    "SamplingParams",
    "Telemetry",
    "TensorParallelError",
    "WarmHandle",
    "media_first_messages",
]
