"""Exceptions raised by the Prism engine.

Every error a caller can act on derives from :class:`PrismError`, so the web app can catch one
family and show its message to the user.
"""


class PrismError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidImageError(PrismError, ValueError):
    """A user-supplied image cannot be used: not an image, truncated, too large, bad aspect ratio.

    The message is written for the person who uploaded the image and says what to do.
    """


class CheckpointError(PrismError, ValueError):
    """A checkpoint folder is missing, incomplete, or its config is inconsistent.

    The message names the folder, the field or the tensor names at fault.
    """


class InvalidRequestError(PrismError, ValueError):
    """A request is malformed (bad message format, bad sampling parameters)."""


class InvalidVideoError(InvalidRequestError):
    """A user-supplied video cannot be used: not a supported video, truncated, no frames, too long or
    too large to decode. The message is written for the uploader and says what to do."""


class ImageDigestMismatchError(InvalidRequestError):
    """An image part's ``sha256`` is not the SHA-256 of its bytes."""


class EngineOverloadedError(PrismError):
    """The engine's waiting queue is full; retry later."""


class RequestTooLargeError(InvalidRequestError):
    """Prompt + ``max_tokens`` cannot fit the model's context length or the whole KV pool."""


class RequestCancelledError(PrismError):
    """The request was cancelled before it finished."""


class TensorParallelError(PrismError):
    """A tensor-parallel rank failed or died (``engine.parallel``); the engine cannot run steps any
    more and must be restarted. The message names the rank and how it ended."""


class EngineAbortedError(PrismError):
    """The engine core stopped before the request finished: its process died (a crash, or killed)
    while the request was queued or running, or a request was sent to it after that. The app
    restarts the core (:mod:`engine.client`); asking again then works."""
