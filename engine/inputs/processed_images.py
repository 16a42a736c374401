"""Opening, processing and hashing a prompt's images (side by side in a worker pool), and the
processed-image cache.

The cache is keyed by the cache salt as well as by the image, like every cache of the engine: an
image another session sent is processed again, so neither the prompt nor its timing
(``preprocess_ms``, the time to first token) shows what other sessions sent. A claimed digest
(an image part's ``sha256``) is checked against the bytes whenever the image is processed, but for
an image the same salt processed before it is taken on trust.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from PIL import Image as PILImage

from ..errors import ImageDigestMismatchError, InvalidImageError
from .images import ImageOptions, bytes_sha256, check_image_size, image_sha256, open_image, read_image_bytes
from .uploads import UPLOADS

#: Image sources that are encoded bytes: read once, hashed, and decoded from what was read.
BYTE_SOURCES = (str, os.PathLike, bytes, bytearray, memoryview)
#: Hashes and processes a request's images side by side: SHA-256, Pillow's resampling and numpy's
#: array work release the GIL. On a prefix hit hashing is the largest part of the host's work
#: (8 photos: ~2.7 of 6.4 ms one after another on one core); on a miss the pixel processing is.
_IMAGE_WORKERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="prism-images")
#: Runs deferred processing (:class:`DeferredPixels`) off the engine loop's thread; a thread of its
#: own, because the work it starts goes to the image pool and waits there (a pool thread waiting on
#: its own pool can deadlock it).
_DEFERRED_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prism-deferred-images")


def _side_by_side(fn, items: list) -> list:
    """``[fn(x) for x in items]``, in the image worker pool when there are several."""
    return list(_IMAGE_WORKERS.map(fn, items)) if len(items) > 1 else [fn(x) for x in items]


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the processor left it: the SHA-256 of its decoded RGB pixels
    (:func:`engine.inputs.images.image_sha256`), patch grid ``(t, h, w)``, patches
    ``[t*h*w, C*T*P*P]`` (None while deferred: see :class:`DeferredPixels`) and the RGB image's
    ``(width, height)`` in pixels."""

    sha256: str
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None
    size: tuple[int, int] = (0, 0)

    @property
    def nbytes(self) -> int:
        return 0 if self.pixels is None else self.pixels.numel() * self.pixels.element_size()

    def without_pixels(self) -> ProcessedImage:
        """The same image with its patches left out (what the known-image index keeps)."""
        return ProcessedImage(self.sha256, self.grid, None, self.size)


@dataclass
class Source:
    """One image part as given: the source, the digest claimed for it, its content key (None: it
    is processed every time) and, for a PIL image, the image as the model sees it (oriented,
    transparency composited, RGB; opened once, to take the key) with its pixels' SHA-256."""

    src: object
    claim: str | None
    key: str | None
    opened: PILImage.Image | None = None
    opened_sha: str | None = None


class ProcessedImages:
    """Images opened, processed and hashed, side by side, and the per-session LRU of processed
    images.

    Processed images are kept in a bounded LRU keyed by the cache salt and the image: the SHA-256
    of a file's or bytes' content, or, for a PIL image, of the RGB pixels the model sees (after
    EXIF orientation and compositing transparency, so two palette images with the same indices
    but other colours, or the same pixels with another orientation, are different images). Asking
    again in the same session about the same images then skips decoding and pixel processing. A
    cached PIL image is used only when its size and patch grid match what the processor gives the
    image at hand (a mismatch re-processes).

    Args:
        image_processor: the checkpoint's transformers image processor.
        size: its resize bounds (``shortest_edge`` / ``longest_edge``, in pixels).
        image_options: our image-opening rules.
        pixel_dtype: dtype images' patches are kept in (the vision encoder's; None keeps the
            processor's float32). Rounding here gives the same values as rounding on the device,
            and half the bytes to cache and to copy there in bfloat16.
        cache_bytes: bound of the cache (patch tensor bytes).

    Concurrent requests about the same image of one salt (eight first questions sent at once, or a
    question beside the app's warm at upload) process it once: the first processes it, the others
    wait for its result (an error included) instead of processing it again.

    Beside the pixels, a much longer index keeps what a prompt and its prefix key need of every
    image a salt sent (SHA-256, grid, size: ~200 bytes, ``known_entries`` of them), after its
    patches have left the cache. A prompt built with ``defer=True`` takes such an image without
    processing it again: the prefix key needs only the hashes and the token count, and a prefix hit
    (on the GPU or in the host tier) never runs the vision encoder; the scheduler has the patches
    processed (:class:`DeferredPixels`, off the engine loop's thread) only for a prompt that
    computes its prefix after all.

    Counters: ``cache_hits`` (images taken from the cache, or from another request's processing of
    it in flight), ``cache_mismatches`` (cached PIL images refused because their size or grid did
    not match the image given), ``processed`` (images opened and processed), ``deferred`` (images
    taken from the index without their patches), ``deferred_processed`` (of them, processed later
    because their prompt computed its prefix).
    """

    def __init__(self, image_processor, *, size: dict, image_options: ImageOptions,
                 pixel_dtype: torch.dtype | None = None, cache_bytes: int = 256 << 20,
                 known_entries: int = 1 << 16):
        self.image_processor = image_processor
        self.size = size
        self.image_options = image_options
        self.pixel_dtype = pixel_dtype
        self.cache_bytes = cache_bytes
        self.known_entries = known_entries
        self._processed: OrderedDict[tuple[str, str], ProcessedImage] = OrderedDict()
        self._known: OrderedDict[tuple[str, str], ProcessedImage] = OrderedDict()  # patches left out
        self._cached_bytes = 0
        self.cache_hits = 0
        self.cache_mismatches = 0
        self.processed = 0
        self.deferred = 0
        self.deferred_processed = 0
        self._lock = threading.Lock()  # prompts are built in every caller's thread
        self._in_flight: dict[tuple[str, str], Future] = {}  # (salt, key) being processed by some thread

    @property
    def cache_entries(self) -> int:
        """Images in the cache (one per salt and image)."""
        return len(self._processed)

    def clear(self) -> None:
        """Forget every processed image and the index of known ones (benchmarks measure
        processing this way)."""
        with self._lock:
            self._processed.clear()
            self._known.clear()
            self._cached_bytes = 0

    def forget(self, salt: str) -> int:
        """Drop the salt's processed images and its entries in the index of known images;
        returns how many images went (each counted once)."""
        with self._lock:
            gone = [k for k in self._processed if k[0] == salt]
            for key in gone:
                self._cached_bytes -= self._processed.pop(key).nbytes
            known = [k for k in self._known if k[0] == salt]
            for key in known:
                del self._known[key]
            return len(set(gone) | set(known))

    def sources(self, images: list, claims: list[str | None]) -> list[Source]:
        """Each image part with its cache key: its claimed digest, else :meth:`_source` (side by
        side; an object given twice is read once: a lazily decoded PIL image must not be decoded
        by two threads at once)."""
        pairs = list(zip(images, claims, strict=True))
        distinct = list({id(src): src for src, claim in pairs if claim is None}.values())
        made = dict(zip(map(id, distinct), _side_by_side(self._source, distinct), strict=True))
        return [Source(src, claim, claim) if claim else made[id(src)] for src, claim in pairs]

    def _source(self, src) -> Source:
        """An image source with its key: the SHA-256 of a file's or bytes' content, ``"pil:"`` and
        the SHA-256 of a PIL image's pixels as the model sees them, or None (opened every time).

        Raises:
            InvalidImageError: a PIL image that cannot be used (as :func:`engine.inputs.images.open_image`).
        """
        if isinstance(src, PILImage.Image):
            opened = open_image(src, self.image_options)
            sha = image_sha256(opened)
            return Source(src, None, "pil:" + sha, opened, sha)
        if isinstance(src, (bytes, bytearray, memoryview)):
            return Source(src, None, bytes_sha256(src))
        if isinstance(src, (str, os.PathLike)):
            try:
                return Source(src, None, bytes_sha256(read_image_bytes(src, self.image_options)))
            except InvalidImageError:
                return Source(src, None, None)  # opening it again gives the user the message
        return Source(src, None, None)

    def get(self, sources: list[Source], salt: str, *, defer: bool = False) -> list[ProcessedImage]:
        """Each image from the salt's cache, or opened, processed and hashed on its own, side by
        side (the processor treats the images of a batch one by one, so the patches are the
        same); an object given twice is processed once. With ``defer``, an image whose patches
        have left the cache but which the salt's index still knows comes without them
        (``pixels`` None; see :class:`DeferredPixels`).

        Raises:
            InvalidImageError: as :func:`engine.inputs.images.open_image`.
            InvalidRequestError: a claimed digest does not match the image's bytes.
        """
        found = [self._cached(salt, s) or (self._known_image(salt, s) if defer else None) for s in sources]
        todo: dict[tuple[int, str | None], Source] = {}
        for source, item in zip(sources, found, strict=True):
            if item is None:
                todo.setdefault((id(source.src), source.claim), source)
        done = dict(zip(todo, _side_by_side(lambda source: self._process_once(source, salt), list(todo.values())),
                        strict=True))
        return [item or done[(id(s.src), s.claim)] for s, item in zip(sources, found, strict=True)]

    def _process_once(self, source: Source, salt: str) -> ProcessedImage:
        """:meth:`_process`, or the result of the thread processing the same image of the same salt
        now. An image without a key is processed every time. When the other thread fails (its
        bytes did not match the digest it claimed, say), this one processes its own image: one
        request's bad input never fails another's."""
        if source.key is None:
            return self._process(source, salt)
        key = (salt, source.key if source.claim is None else "claim:" + source.claim)
        with self._lock:
            running = self._in_flight.get(key)
            if running is None:
                mine = self._in_flight[key] = Future()
        if running is not None:
            try:
                item = running.result()
            except Exception:
                return self._process(source, salt)
            with self._lock:
                self.cache_hits += 1
            return item
        try:
            # another thread may have processed and cached it between our cache miss and now
            item = self._cached(salt, source) or self._process(source, salt)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(item)
            return item
        finally:
            with self._lock:
                del self._in_flight[key]

    def _cached(self, salt: str, source: Source) -> ProcessedImage | None:
        """The salt's processed image for ``source``, or None. A PIL image's entry must match its
        size and patch grid (else it is dropped and the image processed again)."""
        if source.key is None:
            return None
        key = (salt, source.key)
        with self._lock:
            item = self._processed.get(key)
            if item is None:
                return None
            if source.opened is not None and not self._matches(item, source.opened):
                self.cache_mismatches += 1
                del self._processed[key]
                self._cached_bytes -= item.nbytes
                return None
            self._processed.move_to_end(key)
            self.cache_hits += 1
            return item

    def count_deferred_processed(self, n: int) -> None:
        """Count ``n`` deferred images processed after all (:class:`DeferredPixels`)."""
        with self._lock:
            self.deferred_processed += n

    def _known_image(self, salt: str, source: Source) -> ProcessedImage | None:
        """The salt's index entry for ``source`` (no patches), or None; a PIL image's entry must
        match its size and patch grid."""
        if source.key is None:
            return None
        key = (salt, source.key)
        with self._lock:
            item = self._known.get(key)
            if item is None or (source.opened is not None and not self._matches(item, source.opened)):
                return None
            self._known.move_to_end(key)
            self.deferred += 1
            return item

    def _matches(self, item: ProcessedImage, image: PILImage.Image) -> bool:
        """Whether a processed image (or an index entry) fits ``image``: same size, the grid the
        processor gives that size, and one row of patches per grid cell."""
        grid = self.grid_for(image.size)
        rows_match = item.pixels is None or item.pixels.shape[0] == grid[0] * grid[1] * grid[2]
        return item.size == image.size and item.grid == grid and rows_match

    def grid_for(self, size: tuple[int, int]) -> tuple[int, int, int]:
        """The patch grid ``(1, h, w)`` the processor gives an image of ``size`` = (width, height)
        pixels: transformers' ``smart_resize`` (of the Qwen2-VL image processor, which Qwen3-VL's
        uses) to multiples of patch x merge pixels within these pixel bounds."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        ip = self.image_processor
        patch = ip.patch_size
        height, width = smart_resize(size[1], size[0], factor=patch * ip.merge_size,
                                     min_pixels=self.size["shortest_edge"], max_pixels=self.size["longest_edge"])
        return (1, height // patch, width // patch)

    def open(self, source: Source, salt: str | None = None) -> tuple[PILImage.Image, str | None, str]:
        """``source`` opened, the key to cache its processed pixels under, and its pixels'
        SHA-256. A file or bytes is read once (bounded) and the key is the digest of exactly the
        bytes decoded, so a file changed since its key was taken cannot put other pixels under
        that key. With ``salt``, an image the salt's upload validation decoded from bytes of that
        digest (:mod:`engine.inputs.uploads`) is taken instead of decoding them again, once this
        engine's limits are checked against it.

        Raises:
            InvalidImageError: as :func:`engine.inputs.images.open_image`.
            ImageDigestMismatchError: the bytes do not hash to the claimed digest.
        """
        if source.opened is not None:
            return source.opened, source.key, source.opened_sha
        src, key = source.src, None
        if isinstance(src, BYTE_SOURCES):
            src = read_image_bytes(src, self.image_options)
            key = bytes_sha256(src)
            if source.claim is not None and key != source.claim:
                raise ImageDigestMismatchError(
                    "an image's sha256 does not match its bytes; send the image without it"
                )
            if salt is not None and (image := UPLOADS.take(salt, key, self.image_options.namespace())) is not None:
                check_image_size(image.size, self.image_options)
                return image, key, image_sha256(image)
        image = open_image(src, self.image_options)
        return image, key, image_sha256(image)

    def _process(self, source: Source, salt: str) -> ProcessedImage:
        with self._lock:
            self.processed += 1
        image, key, sha = self.open(source, salt)
        out = self.image_processor(images=[image], size=self.size, return_tensors="pt")
        grid = tuple(out["image_grid_thw"][0].tolist())
        item = ProcessedImage(sha, grid, self.keep(out["pixel_values"]), image.size)
        self.remember(salt, key, item)
        return item

    def keep(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` (a processor's patches) in the dtype images are kept in."""
        return pixels if self.pixel_dtype is None else pixels.to(self.pixel_dtype)

    def remember(self, salt: str, key: str | None, item: ProcessedImage) -> None:
        """Cache ``item`` under ``(salt, key)`` (nothing for a None key, an item larger than the
        bound, or a key already there), dropping the least recently used beyond the bound; the
        index of known images keeps it without its patches (up to ``known_entries``)."""
        if key is None:
            return
        with self._lock:
            self._known[salt, key] = item.without_pixels()
            self._known.move_to_end((salt, key))
            while len(self._known) > self.known_entries:
                self._known.popitem(last=False)
            if (salt, key) in self._processed or item.nbytes > self.cache_bytes:
                return
            self._processed[salt, key] = item
            self._cached_bytes += item.nbytes
            while self._cached_bytes > self.cache_bytes:
                _, old = self._processed.popitem(last=False)
                self._cached_bytes -= old.nbytes


class DeferredPixels:
    """The patches of a prompt's images that were built without them (``defer=True``), processed
    when the scheduler finds the prompt must compute its prefix (a miss, a stale match, a
    preempted request whose prefix has gone).

    :meth:`poll` starts the processing on a worker thread the first time it is called and never
    blocks: the engine loop asks again on its next steps, admitting other requests meanwhile.

    Args:
        process: ``sources -> processed images`` (the prompt builder's, under its decode bound).
        pending: ``(index in the prompt, source, the index entry the prompt was built from)``.
        pixels: the prompt's ``image_pixels`` list; its None items are filled in place.

    Attributes:
        ms: wall time of the processing in ms, once :meth:`poll` returned True.
    """

    def __init__(self, process, pending: list[tuple[int, Source, ProcessedImage]], pixels: list):
        self.process, self.pending, self.pixels = process, pending, pixels
        self.ms = 0.0
        self._future: Future | None = None
        self._started = 0.0

    def poll(self) -> bool:
        """Whether the patches are in the prompt; starts their processing on the first call.

        Raises:
            InvalidImageError, ImageDigestMismatchError: as :meth:`ProcessedImages.get`, for the
                source as it reads now (a file changed or removed since the prompt was built).
        """
        if self._future is None:
            self._started = time.perf_counter()
            self._future = _DEFERRED_WORKER.submit(self._process)
        if not self._future.done():
            return False
        for (index, _, _), item in zip(self.pending, self._future.result(), strict=True):
            self.pixels[index] = item.pixels
        return True

    def _process(self) -> list[ProcessedImage]:
        items = self.process([source for _, source, _ in self.pending])
        for (_, _, known), item in zip(self.pending, items, strict=True):
            if (item.sha256, item.grid) != (known.sha256, known.grid):
                # the prefix key was taken from the index: other pixels must not compute under it
                raise InvalidImageError("an image changed while its request waited; send it again")
        self.ms = (time.perf_counter() - self._started) * 1e3
        return items
