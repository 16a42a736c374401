"""Prism's inference engine for Qwen3-VL.

Public API: :class:`Engine`, :class:`SamplingParams`, :class:`Completion`, :class:`Telemetry` and
the :class:`PrismError` family.
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
    "SamplingParams",
    "Telemetry",
    "TensorParallelError",
    "media_first_messages",
]
