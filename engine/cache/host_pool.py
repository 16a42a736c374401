"""The host-memory tier's pages: KV pages of a :class:`PagePool` kept in (pinned) host memory.

A host page holds one GPU page over **all** layers, K, V and (FP8) scales, so an idle cached
prefix can leave the GPU whole and come back bit for bit. The layers are cut into equal **layer
groups** (:func:`layer_groups`: 6 of 6 layers at the 8B shape), and a chunk of host pages is one
**plane** per group: plane ``g`` holds every page's layers of group ``g`` as one contiguous row of
bytes a page (:class:`PageLayout`: the group's scales, then its K, then its V, page-major), unlike
the layer-major GPU pool. A run of consecutive host pages is then one contiguous block of bytes per
plane, and moving it over PCIe is one ``copy_`` per group (not one per buffer and layer: at the 8B
shape an FP8 scale block is 512 bytes a layer, and hundreds of tiny copies cost more in launches
than the bytes do). Groups let a restore land layer group by layer group, so a forward that reads
the restored pages starts its first layers while the later groups are still on the bus
(:class:`~.kv_transfer.LayerGates`).

Memory comes in large chunks, each allocated the first time one of its pages is handed out (a tier
sized at 100 GiB costs nothing until used; pinning is slow and pinned memory is scarce, so it is
never taken up front). Chunks are kept once allocated, until :meth:`HostPool.close`.

Pinning is slow, and the CUDA driver serialises it with the engine loop's kernel launches and
copies even when another thread pins. With ``prefetch`` (default: when pinned) one chunk is
allocated ahead of need, on a background thread: the first at construction, the next whenever a
chunk is first used; a chunk still being pinned when a copy needs it is waited for, never
allocated twice. How it pins matters more than where (``benchmarks/bench_pin_stall.py`` on the
H200, docs/PERFORMANCE.md "Pinning without stalls"): ``cudaHostAlloc`` (``torch.empty(...,
pin_memory=True)``) of 256 MiB took 147 ms, and the loop's steps (0.14 ms alone) took up to 562 ms
meanwhile, which put host hits' TTFT p99 at 181-253 ms on the working-set benchmark at ``deep``
while their copies took 2-10 ms. So a chunk is pageable memory first, every page touched on the
background thread (the page faults happen outside the driver), then registered with
``cudaHostRegister``: 35 ms a chunk, the loop's longest step 15 ms.

FP8 payloads are stored as ``uint8`` (their bytes): copies move bits, never values.

This module owns the memory and the bookkeeping only; the copies are in :mod:`.kv_transfer`.
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kv_pool import OutOfPagesError, PagePool

log = logging.getLogger(__name__)

#: Default chunk size: this many bytes' worth of whole pages (at least one page).
CHUNK_BYTES = 256 << 20


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a host page stores a pool buffer of ``dtype`` as: ``uint8`` for float8 (bytes,
    bit-exact), the dtype itself otherwise."""
    return torch.uint8 if dtype.itemsize == 1 else dtype


def layer_groups(num_layers: int, most: int = 6) -> int:
    """The layer groups a host page is cut into by default: the largest divisor of ``num_layers``
    up to ``most`` (6 groups of 6 layers at the 8B shape's 36; 4 of 7 at 28; 2 of 1 at 2). More
    groups hide more of a restore behind the forward reading it (the forward waits for the first
    group only), at the cost of more, smaller copies."""
    return max(g for g in range(1, min(most, num_layers) + 1) if num_layers % g == 0)


@dataclass(frozen=True)
class PageLayout:
    """Where each buffer of a :class:`PagePool` page sits in host memory: ``groups`` planes, each one
    row of ``plane_bytes`` bytes a page holding ``layers_per_group`` consecutive layers.

    Attributes:
        fields: per pool buffer, in :meth:`PagePool.buffers` order (``None`` ones left out):
            ``(byte offset in a plane's row, storage dtype, per-page shape within one group)``; the
            shape is ``(layers_per_group, kv_heads, page_size, head_dim)`` for K/V,
            ``(layers_per_group, kv_heads, page_size)`` for scales. Wider dtypes come first, so every
            field is aligned to its element size.
        groups: layer groups (planes); layer ``l`` is in group ``l // layers_per_group``.
        plane_bytes: bytes of one page's row in one plane (rounded up to 8 so rows stay aligned).
    """

    fields: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]
    groups: int
    plane_bytes: int

    @classmethod
    def of(cls, pool: PagePool, groups: int = 1) -> PageLayout:
        """The layout of ``pool``'s pages cut into ``groups`` layer groups.

        Raises:
            ValueError: ``groups`` does not divide the pool's layers.
        """
        if groups < 1 or pool.num_layers % groups:
            raise ValueError(f"{groups} layer groups do not divide {pool.num_layers} layers")
        bufs = [b for b in pool.buffers() if b is not None]
        shapes = [(pool.num_layers // groups, *b.shape[1:]) for b in bufs]
        dtypes = [storage_dtype(b.dtype) for b in bufs]
        offsets = [0] * len(bufs)
        at = 0
        for i in sorted(range(len(bufs)), key=lambda i: -dtypes[i].itemsize):
            offsets[i] = at
            at += math.prod(shapes[i]) * dtypes[i].itemsize
        return cls(tuple(zip(offsets, dtypes, shapes, strict=True)), groups, -(-at // 8) * 8)

    @property
    def layers_per_group(self) -> int:
        return self.fields[0][2][0]

    @property
    def row_bytes(self) -> int:
        """Host bytes of one page over all its planes."""
        return self.groups * self.plane_bytes

    def views(self, plane: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``plane`` (uint8 ``[pages, plane_bytes]``: one group's rows) as one view per field,
        ``[pages, *shape]`` of the field's dtype (strided: consecutive pages are ``plane_bytes``
        apart)."""
        out = []
        for offset, dtype, shape in self.fields:
            size = math.prod(shape) * dtype.itemsize
            out.append(plane[:, offset:offset + size].view(dtype).view(plane.shape[0], *shape))
        return tuple(out)


@dataclass(frozen=True)
class HostChunk:
    """One chunk of host pages: one plane a layer group, and views of each plane per buffer.

    Attributes:
        raw: uint8 ``[groups, pages, plane_bytes]``: host page ``i`` of the chunk is row ``i`` of
            every plane (:class:`PageLayout`).
        planes: per group, its views in :meth:`PagePool.buffers` order (``None`` ones left out):
            K/V ``[pages, layers_per_group, kv_heads, page_size, head_dim]``, ``uint8`` (the bytes of
            FP8) or the model dtype ("auto"); scales float32 ``[pages, layers_per_group, kv_heads,
            page_size]`` (none under "auto").
    """

    raw: torch.Tensor
    planes: tuple[tuple[torch.Tensor, ...], ...]

    def buffer(self, i: int) -> torch.Tensor:
        """Buffer ``i`` (:meth:`PagePool.buffers` order, ``None`` ones left out) over every layer,
        ``[pages, layers, ...]``: a view with one group, else a copy (for checks and debugging; the
        copies between tiers go plane by plane)."""
        parts = [views[i] for views in self.planes]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


class Run(NamedTuple):
    """Consecutive host pages of one chunk: chunk rows ``start .. stop - 1`` are the host pages
    at list positions ``index .. index + (stop - start) - 1`` of the list given to
    :meth:`HostPool.runs`."""

    chunk: int
    start: int
    stop: int
    index: int


class HostPool:
    """Host pages with the geometry of one page of ``pool`` over all its layers.

    Args:
        pool: the GPU (or CPU) pool whose pages this tier holds.
        num_pages: host pages (0 is legal: a tier that holds nothing).
        pin: allocate chunks in pinned (page-locked) memory; default: when ``pool`` is on CUDA.
            Pinned memory is what lets the copies run asynchronously at full PCIe bandwidth.
        chunk_pages: pages per chunk; default: as many whole pages as 256 MiB holds, at least
            one, at most ``num_pages``.
        prefetch: allocate one chunk ahead of need on a background thread (see the module
            docstring); default: when ``pin``.
        groups: layer groups of a host page (planes of a chunk, see the module docstring);
            default :func:`layer_groups` of the pool's layers.

    Raises:
        ValueError: ``num_pages < 0``, ``chunk_pages < 1``, or ``groups`` not dividing the layers.
        RuntimeError: (from :meth:`allocate`, when a chunk is first allocated) ``pin`` without a
            CUDA driver.
    """

    def __init__(self, pool: PagePool, num_pages: int, *, pin: bool | None = None, chunk_pages: int | None = None,
                 prefetch: bool | None = None, groups: int | None = None):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if chunk_pages is not None and chunk_pages < 1:
            raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
        self.num_pages = num_pages
        self.page_bytes = pool.page_bytes
        self.num_layers = pool.num_layers
        self.layout = PageLayout.of(pool, layer_groups(pool.num_layers) if groups is None else groups)
        self.pin = pool.buffers()[0].device.type == "cuda" if pin is None else pin
        self.chunk_pages = chunk_pages or max(1, min(num_pages, CHUNK_BYTES // self.page_bytes))
        self._chunks: list[HostChunk | None] = [None] * (-(-num_pages // self.chunk_pages))
        self._used = bytearray(num_pages)
        # free host pages as sorted disjoint [start, stop) ranges: allocation takes the lowest range
        # long enough (contiguous pages make few runs, so few copies), release merges neighbours
        self._free_starts = [0] if num_pages else []
        self._free_stops = [num_pages] if num_pages else []
        self._num_free = num_pages
        self._closed = False
        # chunks being allocated ahead of need, by index; one background thread pins them
        self._ahead: dict[int, Future] = {}
        self._ahead_lock = threading.Lock()
        self._pinner = None
        if (self.pin if prefetch is None else prefetch) and self._chunks:
            self._pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prism-host-pin")
            self._prefetch(0)

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def bytes_allocated(self) -> int:
        """Bytes of host memory the chunks allocated so far take."""
        return sum(c.nbytes for c in self._chunks if c is not None)

    def counters(self) -> dict:
        """The tier's part of the engine's stats: ``host_pages_total``, ``host_pages_used``,
        ``host_bytes_allocated`` (bytes)."""
        return {
            "host_pages_total": self.num_pages,
            "host_pages_used": self.num_used,
            "host_bytes_allocated": self.bytes_allocated,
        }

    # ------------------------------------------------------------------ bookkeeping
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free host pages, low ids first: one contiguous range when some free range
        holds ``n`` pages (the lowest such), else the lowest free pages. Allocates the chunks
        they sit in that are not yet allocated.

        Raises:
            OutOfPagesError: fewer than ``n`` pages free (nothing is taken).
            RuntimeError: the pool is closed, or allocating a chunk failed (nothing is taken).
        """
        self._check_open()
        if n < 0:
            raise ValueError(f"cannot allocate {n} host pages")
        if n > self._num_free:
            raise OutOfPagesError(f"asked for {n} host KV pages, {self._num_free} free")
        if n == 0:
            return []
        ranges = list(zip(self._free_starts, self._free_stops, strict=True))
        fit = next((a for a, b in ranges if b - a >= n), None)
        if fit is not None:
            pages = list(range(fit, fit + n))
        else:
            pages = []
            for a, b in ranges:
                pages.extend(range(a, min(b, a + n - len(pages))))
                if len(pages) == n:
                    break
        for c in sorted({p // self.chunk_pages for p in pages}):
            self._ensure_chunk(c)  # before any bookkeeping changes: a failure takes nothing
        for run_start, run_stop in _ranges(pages):
            self._take(run_start, run_stop)
        for p in pages:
            self._used[p] = 1
        self._num_free -= n
        return pages

    def release(self, pages: Iterable[int]) -> None:
        """Return host pages to the free list (their chunks stay allocated).

        Raises:
            RuntimeError: a page is not in use (double free; nothing is released), or the pool
                is closed.
            ValueError: a page id out of range (nothing is released).
        """
        self._check_open()
        pages = sorted(pages)
        for i, p in enumerate(pages):
            self._check_id(p)
            if not self._used[p] or (i and pages[i - 1] == p):
                raise RuntimeError(f"release of free host page {p}")
        for p in pages:
            self._used[p] = 0
        for run_start, run_stop in _ranges(pages):
            self._give(run_start, run_stop)
        self._num_free += len(pages)

    def is_used(self, page: int) -> bool:
        return bool(self._used[page])

    # ------------------------------------------------------------------ data
    def chunk(self, index: int) -> HostChunk:
        """Chunk ``index``'s tensors (host page ``p`` is row ``p % chunk_pages`` of chunk
        ``p // chunk_pages``).

        Raises:
            RuntimeError: the chunk is not allocated (no page of it was ever handed out), or the
                pool is closed.
        """
        self._check_open()
        c = self._chunks[index]
        if c is None:
            raise RuntimeError(f"host chunk {index} is not allocated")
        return c

    def runs(self, host_pages: list[int] | tuple[int, ...]) -> list[Run]:
        """``host_pages`` (in the order given) cut into runs of consecutive ids inside one chunk:
        a copy between them and a contiguous block of pages is one ``copy_`` per run and layer group.
        ``[5, 6, 7, 2]`` with 4 pages a chunk gives ``[Run(1, 1, 4, 0), Run(0, 2, 3, 3)]``.

        Ids are checked against the range only, not against this pool's bookkeeping: a
        tensor-parallel worker's pool mirrors rank 0's, which decides the ids (:meth:`materialize`).

        Raises:
            ValueError: an id out of range.
            RuntimeError: the pool is closed.
        """
        self._check_open()
        out: list[Run] = []
        for i, p in enumerate(host_pages):
            self._check_id(p)
            c, row = divmod(p, self.chunk_pages)
            last = out[-1] if out else None
            if last is not None and last.chunk == c and last.stop == row:
                out[-1] = last._replace(stop=row + 1)
            else:
                out.append(Run(c, row, row + 1, i))
        return out

    def materialize(self, host_pages: Iterable[int]) -> None:
        """Allocate the chunks holding ``host_pages`` that are not allocated yet (what
        :meth:`allocate` does for the pages it hands out). For a mirror that runs no bookkeeping of
        its own: a tensor-parallel worker copies to the host pages rank 0's pool handed out.

        Raises:
            ValueError: an id out of range.
            RuntimeError: the pool is closed, or allocating a chunk failed.
        """
        self._check_open()
        chunks = set()
        for p in host_pages:
            self._check_id(p)
            chunks.add(p // self.chunk_pages)
        for c in sorted(chunks):
            self._ensure_chunk(c)

    def close(self) -> None:
        """Free every chunk (pinned memory is given back to the OS: torch's cache of freed pinned
        blocks is emptied too); idempotent. The pool is unusable after."""
        if self._pinner is not None:
            self._pinner.shutdown(wait=True)  # a chunk being pinned is finished, then dropped
            self._pinner = None
        ahead = [f.result() for f in self._ahead.values() if f.exception() is None]
        self._ahead.clear()
        if self.pin:
            for chunk in [*self._chunks, *ahead]:
                if chunk is not None:
                    _unpin(chunk.raw)
        self._chunks = [None] * len(self._chunks)
        self._closed = True
        if self.pin and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self):
        # a pool dropped without close() (a test's, say) still unpins its chunks: their memory is
        # otherwise kept mapped for the process's life (see _unpin)
        if not getattr(self, "_closed", True) and self.pin:
            try:
                self.close()
            except Exception:  # noqa: BLE001  (interpreter shutdown: nothing left to give back)
                pass

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the host pool is closed")

    def _check_id(self, p: int) -> None:
        if not 0 <= p < self.num_pages:
            raise ValueError(f"host page {p} out of range (0 .. {self.num_pages - 1})")

    def _ensure_chunk(self, c: int) -> None:
        """Chunk ``c`` allocated (waiting for it if it is being allocated ahead), and the next one
        started ahead of need."""
        if self._chunks[c] is None:
            with self._ahead_lock:
                ahead = self._ahead.pop(c, None)
            self._chunks[c] = ahead.result() if ahead is not None else self._new_chunk(c)
        self._prefetch(c + 1)

    def _prefetch(self, c: int) -> None:
        """Start allocating chunk ``c`` on the background thread, unless it exists, is under way,
        or there is no such chunk (or no prefetching)."""
        if self._pinner is None or c >= len(self._chunks) or self._chunks[c] is not None:
            return
        with self._ahead_lock:
            if c not in self._ahead:
                self._ahead[c] = self._pinner.submit(self._new_chunk, c)

    def _new_chunk(self, c: int) -> HostChunk:
        """Allocate chunk ``c``'s memory and views (no shared state: runs on either thread)."""
        n = min(self.chunk_pages, self.num_pages - c * self.chunk_pages)
        shape = (self.layout.groups, n, self.layout.plane_bytes)
        raw = _pinned_empty(shape) if self.pin else torch.empty(shape, dtype=torch.uint8)
        return HostChunk(raw, tuple(self.layout.views(plane) for plane in raw))

    def _take(self, start: int, stop: int) -> None:
        """Remove ``[start, stop)`` (inside one free range) from the free ranges."""
        i = bisect.bisect_right(self._free_starts, start) - 1
        a, b = self._free_starts[i], self._free_stops[i]
        pieces = [(x, y) for x, y in ((a, start), (stop, b)) if y > x]
        self._free_starts[i:i + 1] = [x for x, _ in pieces]
        self._free_stops[i:i + 1] = [y for _, y in pieces]

    def _give(self, start: int, stop: int) -> None:
        """Add ``[start, stop)`` (all in use until now) to the free ranges, merging neighbours."""
        i = bisect.bisect_left(self._free_starts, start)
        if i and self._free_stops[i - 1] == start:
            i -= 1
            start = self._free_starts[i]
            del self._free_starts[i], self._free_stops[i]
        if i < len(self._free_starts) and self._free_starts[i] == stop:
            stop = self._free_stops[i]
            del self._free_starts[i], self._free_stops[i]
        self._free_starts.insert(i, start)
        self._free_stops.insert(i, stop)


def _pinned_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 host tensor of ``shape``, page-locked and registered with CUDA
    (``cudaHostRegister``), its pages faulted in first (see the module docstring for why not
    ``torch.empty(..., pin_memory=True)``). Released by :func:`_unpin` before it is freed.

    The memory is an anonymous mapping of its own (``mmap``), whole OS pages from its first byte:
    the driver locks whole pages and refuses one registered already
    (``cudaErrorHostMemoryAlreadyRegistered``), which two small heap allocations sharing a page
    ran into; and torch sees the tensor's storage as pinned (``is_pinned``) only when the storage
    starts where the registration does.

    Where registering fails, the chunk comes from torch's pinned allocator instead
    (:func:`_host_alloc`, logged once): slower to pin, as correct.

    Raises:
        RuntimeError: no pinned memory either way (no CUDA driver, or the host refused to lock it).
    """
    nbytes = math.prod(shape)
    if not nbytes:
        return torch.empty(shape, dtype=torch.uint8)
    span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    # private and anonymous, what the C allocator maps for a large block
    region = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive too
    raw.fill_(0)  # touch every page here, so the driver locks resident pages instead of faulting them
    err = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), span, 0))
    if err:
        global _FELL_BACK
        if not _FELL_BACK:
            _FELL_BACK = True
            log.warning("registering %d bytes of host memory with CUDA failed (cudaError %d): the host tier "
                        "pins its chunks with cudaHostAlloc instead (slower to pin, stalls the engine loop)", span, err)
        return _host_alloc(shape)
    with _REGISTERED_LOCK:
        _REGISTERED[raw.data_ptr()] = region
    return raw[:nbytes].view(shape)


def _host_alloc(shape: tuple[int, ...]) -> torch.Tensor:
    """Pinned memory from torch's allocator (``cudaHostAlloc``): the fallback of
    :func:`_pinned_empty`. Raises: RuntimeError: no CUDA driver, or the host refused."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


def _unpin(raw: torch.Tensor) -> None:
    """Undo :func:`_pinned_empty`'s registration, then let the mapping go with the last tensor
    that uses it (never before: memory unmapped while registered stays registered in the driver,
    and the next mapping at that address is refused as registered already). Idempotent."""
    with _REGISTERED_LOCK:
        region = _REGISTERED.pop(raw.data_ptr(), None)
    if region is not None:
        torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())


#: Pinned regions by address, each held here from its registration to its unregistration, so that
#: it is never unmapped while registered (see :func:`_unpin`).
_REGISTERED: dict[int, mmap.mmap] = {}
_REGISTERED_LOCK = threading.Lock()
_FELL_BACK = False  # logged the fallback to cudaHostAlloc once


def _ranges(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as ``[start, stop)`` ranges of consecutive ids."""
    out: list[tuple[int, int]] = []
    for p in sorted_ids:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
