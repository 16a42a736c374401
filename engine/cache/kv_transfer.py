"""KV copies between the GPU pool and the host tier: the orders and their executor.

An :class:`Offload` copies GPU pages to host pages, a :class:`Restore` host pages back to GPU
pages, every layer's K, V and scales, bit for bit. The policy side decides them (which prefix,
which pages) and hands them to :class:`KVTransfers`, which runs them and reports each one finished
(:class:`TransferDone`) in submit order.

On CUDA the copies run on a dedicated copy stream (a restore's scatters into the pool on a second,
high-priority one), beside the compute stream, through one GPU
staging buffer laid out as host planes (:class:`~.host_pool.PageLayout`): the pool is layer-major
and a page's rows are scattered over it, so they are first gathered (page-major,
:meth:`PagePool.rows`) into staging, and only then moved over PCIe as one contiguous copy per run
of host pages and layer group (:meth:`HostPool.runs`); a restore is the same backwards, its PCIe
copies and its scatters pipelined over two staging slots (an event per slot says when it may be
refilled). A copy goes layer group by layer group, each group in rounds of what staging holds; an
offload's rounds are ordered on the copy stream, and every transfer's copy stream first waits for
the scatters before it, so staging is never reused under a read. Nothing in
:meth:`KVTransfers.submit` waits for the GPU. On the CPU the copies run at once, straight between
the pool and the host chunks.

A restore the step being planned reads (a host hit's first prefill chunk rides the plan that orders
its restore) records :class:`LayerGates` as each layer group lands, and the forward waits for group
``g``'s gate just before its first layer of that group (:meth:`LayerGates.wait`, captured in the
decode graphs as an external event wait): the first layers run while the later groups are still on
the bus, instead of the whole forward waiting for the whole copy (2.3-2.5 ms for an 8-photo prefix
at the 8B shape; docs/PERFORMANCE.md, host tier, v9).

Every copy moves bits: each buffer's rows are viewed as integer words (int64 wherever the row
sizes and offsets allow), so FP8 bytes, NaN payloads and bf16 values come back exactly as they
left, and the per-element gather/scatter kernels do an eighth of the work of a byte view.

Measured on one H200 (``benchmarks/bench_host_copy.py``, ``docs/gpu/host_copy_*_v1.json``, before
layer groups): a 103-page FP8 prefix of the 8B shape (125 MB) offloads and restores at 0.82-0.87x of
a plain pinned copy of the same bytes (~55 GB/s) with the default 64 MiB staging, 0.79-0.83x with
16 MiB; bf16 pages 0.88-0.91x. The gather and the PCIe copy do not overlap (one stream): most of
the rest.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .host_pool import HostPool
from .kv_pool import PageCopy, PagePool

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element width (same shape): copies of it are
    bit-exact whatever the float format."""
    return t.view(_BITS[t.element_size()])


def words(t: torch.Tensor, keep: int, width: int) -> torch.Tensor:
    """``t``'s dims past the first ``keep`` merged into one row of ``width``-byte integers (the
    same bytes; they must be contiguous within the row and ``width``-aligned). The gather/scatter
    and strided copies run per element: a 16 KiB FP8 row is 2048 int64 words, not 16384 bytes."""
    return t.flatten(keep).view(torch.uint8).view(_BITS[width])


def _word_width(*byte_counts: int) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) dividing every byte count and offset given."""
    return next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in byte_counts))


@dataclass(frozen=True)
class Offload:
    """Copy GPU page ``pages[i]`` to host page ``host_pages[i]``: every layer, K/V and scales.

    ``xfer`` is the caller's id for the transfer (reported back in :class:`TransferDone`)."""

    xfer: int
    pages: tuple[int, ...]
    host_pages: tuple[int, ...]


@dataclass(frozen=True)
class Restore:
    """Copy host page ``host_pages[i]`` to GPU page ``pages[i]``: every layer, K/V and scales."""

    xfer: int
    host_pages: tuple[int, ...]
    pages: tuple[int, ...]


Transfer = Offload | Restore


@dataclass(frozen=True)
class TransferDone:
    """A transfer finished.

    Attributes:
        xfer: the order's id.
        kind: ``"offload"`` or ``"restore"``.
        pages: pages copied (the order's length).
        nbytes: bytes copied (``pages * page_bytes``).
        ms: the copy's own duration in milliseconds (CUDA events on CUDA, ``perf_counter`` on the
            CPU; 0 for a failed or empty transfer).
        error: why the copy failed; then the destination pages hold garbage and must not be used.
    """

    xfer: int
    kind: str
    pages: int
    nbytes: int
    ms: float
    error: str | None = None


def fold_page_copies(orders: list) -> list:
    """``orders`` with each copy-on-write :class:`~.kv_pool.PageCopy` of a page a :class:`Restore`
    of the same list writes folded into that restore: the restore also copies the page's host page
    to the copy's destination (same bits as copying the restored page). A host hit whose prefix ends
    inside a page forks that page for its question; as a page copy on the compute stream it would
    read every layer of the restored page before the forward starts, and so wait for the whole
    restore, where the folded copy lands with each layer group (:class:`LayerGates`).

    Only a copy that follows its restore with nothing but restores and page copies in between is
    folded (nothing else can have written the page since). The list is not changed; the restore's
    ``xfer`` is kept. Returns a new list."""
    out: list = []
    restored: dict[int, int] = {}  # GPU page -> index in out of the restore writing it
    for order in orders:
        if isinstance(order, Restore):
            restored.update((p, len(out)) for p in order.pages)
        elif isinstance(order, PageCopy) and order.src in restored:
            i = restored[order.src]
            r = out[i]
            host = r.host_pages[r.pages.index(order.src)]
            out[i] = Restore(r.xfer, (*r.host_pages, host), (*r.pages, order.dst))
            restored[order.dst] = i
            continue
        elif not isinstance(order, PageCopy):
            restored.clear()
        out.append(order)
    return out


class LayerGates:
    """One CUDA event a layer group: the compute stream's gate on each group of a restore it reads.

    :meth:`KVTransfers.submit` records group ``g``'s event on its scatter stream once that group's
    pages landed; the forward calls :meth:`wait` before each layer's attention, which waits for
    the group's event before the group's first layer (an eager step queues the wait, a decode graph
    holds it as an external event wait node captured once). When no restore is read, every event
    stands recorded in the past and the waits cost nothing. The events are external
    (``torch.cuda.Event(external=True)``): a capture holds the wait, not a copy of the dependency.

    A gate is recorded again only once every forward queued before has passed its waits
    (:meth:`reopen` blocks the host on :meth:`forward_queued`'s event, normally long done: steps
    that sample synchronise): a replay still queued must never meet a record made after it.

    Args:
        num_layers: the decoder's layers.
        groups: layer groups (they must divide ``num_layers``; the host pool's planes).
        device: the CUDA device.
    """

    def __init__(self, num_layers: int, groups: int, device: torch.device):
        if num_layers % groups:
            raise ValueError(f"{groups} layer groups do not divide {num_layers} layers")
        self.groups, self.per_group, self.device = groups, num_layers // groups, device
        self.events = [torch.cuda.Event(external=True) for _ in range(groups)]
        self._passed = torch.cuda.Event()
        stream = torch.cuda.current_stream(device)
        for event in self.events:
            event.record(stream)
        self._passed.record(stream)

    def wait(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s group, when ``layer`` is its first layer."""
        if layer % self.per_group == 0:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer // self.per_group])

    def reopen(self) -> None:
        """Block the host until every forward queued so far passed its waits, before new records."""
        self._passed.synchronize()

    def record(self, group: int, stream: torch.cuda.Stream) -> None:
        """Group ``group`` lands when ``stream``'s work queued so far has run."""
        self.events[group].record(stream)

    def forward_queued(self) -> None:
        """A forward that waits on the gates was queued on the current stream (see :meth:`reopen`)."""
        self._passed.record(torch.cuda.current_stream(self.device))


@dataclass
class _Pending:
    order: Transfer
    kind: str
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    keep: list | None = None  # tensors the GPU may still read (index rows), alive until done
    ms: float = 0.0
    error: str | None = None

    def done(self) -> bool:
        return self.end is None or self.end.query()

    def report(self, page_bytes: int) -> TransferDone:
        n = len(self.order.pages)
        ms = self.ms
        if self.end is not None and self.error is None:
            ms = self.start.elapsed_time(self.end)
        return TransferDone(self.order.xfer, self.kind, n, n * page_bytes, ms, self.error)


class KVTransfers:
    """Runs :class:`Offload` / :class:`Restore` orders between ``pool`` and ``host``.

    Args:
        pool: the KV pool (CPU or CUDA).
        host: its host tier (pinned, on CUDA, for asynchronous copies).
        staging_bytes: the GPU staging buffer (CUDA only), rounded down to whole pages, at least one
            page; allocated here, for the executor's life.

    Attributes:
        fault: test hook, called with each order before its copy starts; an exception it raises
            makes that transfer fail (reported, with ``error``, like any failure in :meth:`submit`).
        staging_pages: pages one round moves (CUDA; 0 on the CPU): of one layer group, as copies go
            group by group.
        gates: the :class:`LayerGates` a restore read by the step being planned records (CUDA;
            None on the CPU, where copies are done when :meth:`submit` returns).
    """

    def __init__(self, pool: PagePool, host: HostPool, *, staging_bytes: int = 64 << 20):
        if host.page_bytes != pool.page_bytes or host.num_layers != pool.num_layers:
            raise ValueError("the host pool was made for another KV pool's geometry")
        self.pool, self.host = pool, host
        self.page_bytes = pool.page_bytes
        self.fault: Callable[[Transfer], None] | None = None
        bufs = [b for b in pool.buffers() if b is not None]
        layout = host.layout
        # per buffer, the word every view of it (pool rows, host and staging planes) is copied in
        self._widths = [_word_width(b[0].numel() * b.element_size(), offset, layout.plane_bytes)
                        for b, (offset, _, _) in zip(bufs, layout.fields, strict=True)]
        self._buffers = tuple(words(b, 1, w) for b, w in zip(bufs, self._widths, strict=True))  # [L * N, W]
        self.device = self._buffers[0].device
        self.cuda = self.device.type == "cuda"
        self._pending: deque[_Pending] = deque()
        self._by_xfer: dict[int, _Pending] = {}
        self._closed = False
        self.staging_pages = 0
        self.gates: LayerGates | None = None
        if self.cuda:
            # one GPU buffer laid out as one host plane (a layer group's rows), reused group by group
            self.staging_pages = max(1, staging_bytes // layout.plane_bytes)
            self._stream = torch.cuda.Stream(device=self.device)
            # a restore's scatters into the pool: the forward that reads them waits for them
            self._scatter = torch.cuda.Stream(device=self.device, priority=-8)
            self._staging_raw = torch.empty((self.staging_pages, layout.plane_bytes), dtype=torch.uint8,
                                            device=self.device)
            self._staging_views = self._page_words(layout.views(self._staging_raw))
            self.gates = LayerGates(pool.num_layers, layout.groups, self.device)

    # ------------------------------------------------------------------ the interface
    def submit(self, order: Transfer, after: torch.cuda.Event | None = None, *, gated: bool = False) -> None:
        """Start ``order`` (on the CPU: run it to the end). Never raises: a failure (a bad order,
        the :attr:`fault` hook, a copy that raised) is reported by the next :meth:`poll` as a
        :class:`TransferDone` with ``error`` set. On CUDA the copy stream first waits for the work
        the current stream queued so far, so the copy sees every write decided before it; with
        ``after`` (an event recorded on the current stream) only for the work queued before that
        event: a restore into free pages started while a step's forward runs need not wait for
        the forward, which touches no free page (:meth:`ModelRunner.start_transfers
        <engine.serving.runner.ModelRunner.start_transfers>`). With ``gated`` (a restore the next
        forward reads) :attr:`gates` record each layer group's landing (after
        :meth:`LayerGates.reopen`); that forward waits for them layer group by layer group instead
        of calling :meth:`wait`."""
        kind = "offload" if isinstance(order, Offload) else "restore"
        entry = _Pending(order, kind)
        try:
            self._check(order)
            if self.fault is not None:
                self.fault(order)
            if self.cuda:
                if order.pages:  # an empty order queues nothing: done at once
                    self._run_cuda(order, entry, after, gated and isinstance(order, Restore))
            else:
                t = time.perf_counter()
                self._run_cpu(order)
                entry.ms = (time.perf_counter() - t) * 1e3
        except Exception as exc:  # every failure of one transfer is that transfer's report
            entry.error = f"{type(exc).__name__}: {exc}"
            self._fence_failed(entry)
        self._pending.append(entry)
        if entry.end is not None:
            self._by_xfer[order.xfer] = entry

    def _fence_failed(self, entry: _Pending) -> None:
        """A CUDA transfer that failed part way may have queued copies: it is reported (and its
        index rows freed, :meth:`wait` satisfied) only once those finished."""
        if entry.end is None:
            return
        try:
            self._stream.wait_stream(self._scatter)
            entry.end.record(self._stream)
        except Exception:  # noqa: BLE001 - nothing queued can be fenced; report it now
            entry.start = entry.end = entry.keep = None

    def poll(self) -> list[TransferDone]:
        """The transfers finished since the last poll, in submit order (a finished transfer
        behind an unfinished one waits for it). Never blocks."""
        out = []
        while self._pending and self._pending[0].done():
            entry = self._pending.popleft()
            out.append(entry.report(self.page_bytes))
            if self._by_xfer.get(entry.order.xfer) is entry:
                del self._by_xfer[entry.order.xfer]
        return out

    def in_flight(self) -> int:
        """Transfers submitted and not yet reported by :meth:`poll` (finished or not)."""
        return len(self._pending)

    def wait(self, xfers: Iterable[int]) -> None:
        """Make the current CUDA stream wait, on the GPU (the host does not block), for the
        transfers ``xfers``: call it before a forward that reads restored pages or writes pages
        being offloaded. No-op on the CPU and for ids done or unknown."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for x in xfers:
            entry = self._by_xfer.get(x)
            if entry is not None:
                stream.wait_event(entry.end)

    def synchronize(self) -> None:
        """Block until every submitted transfer finished (they are still reported by :meth:`poll`)."""
        if self.cuda and not self._closed:
            self._stream.synchronize()
            self._scatter.synchronize()

    def close(self) -> None:
        """Wait for every transfer, then free the staging buffer and the events; idempotent.
        Transfers submitted after it fail (reported as errors)."""
        if self._closed:
            return
        self.synchronize()
        for entry in self._pending:  # all finished: read their times, drop their events
            entry.ms = entry.report(self.page_bytes).ms
            entry.start = entry.end = entry.keep = None
        self._by_xfer.clear()
        self._staging_raw = self._staging_views = None
        self._closed = True

    # ------------------------------------------------------------------ the copies
    def _check(self, order: Transfer) -> None:
        if self._closed:
            raise RuntimeError("the transfer executor is closed")
        if not isinstance(order, (Offload, Restore)):
            raise TypeError(f"not a transfer order: {order!r}")
        if len(order.pages) != len(order.host_pages):
            raise ValueError(f"{len(order.pages)} GPU pages for {len(order.host_pages)} host pages")
        bad = [p for p in order.pages if not 0 <= p < self.pool.num_pages]
        if bad:
            raise ValueError(f"GPU pages out of range: {bad[:8]}")
        dest = order.pages if isinstance(order, Restore) else order.host_pages
        if len(set(dest)) != len(dest):
            raise ValueError("a destination page appears twice")  # the copy would race with itself
        # host pages in range, their chunks there (a tensor-parallel worker's tier mirrors rank 0's
        # bookkeeping without running it, so its chunks come with the first copy to them)
        self.host.materialize(order.host_pages)

    def _run_cpu(self, order: Transfer) -> None:
        restore = isinstance(order, Restore)
        for run in self.host.runs(order.host_pages):
            n = run.stop - run.start
            rows = self._group_rows(self.pool.rows(list(order.pages[run.index:run.index + n])), n)
            for g, plane in enumerate(self.host.chunk(run.chunk).planes):
                held = self._page_words(plane)
                for pool_buf, host_buf in zip(self._buffers, held, strict=True):
                    _move(pool_buf, rows[g], host_buf[run.start:run.stop], restore)

    def _group_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`PagePool.rows` of ``n`` pages (``[n * layers]``, page-major) as ``[groups, n *
        layers_per_group]``: each group's rows, page-major, as its plane holds them."""
        groups = self.host.layout.groups
        return rows.view(n, groups, -1).transpose(0, 1).reshape(groups, -1)

    def _run_cuda(self, order: Transfer, entry: _Pending, after: torch.cuda.Event | None = None,
                  gated: bool = False) -> None:
        restore = isinstance(order, Restore)
        stream = self._stream
        entry.start = torch.cuda.Event(enable_timing=True)
        entry.end = torch.cuda.Event(enable_timing=True)
        n_all = len(order.pages)
        per_group = self.host.layout.layers_per_group
        # the index rows go up from pinned memory: a pageable upload would make the host wait for
        # the copy stream, and so for the compute work it waits on (submit must not block)
        rows_host = self._group_rows(self.pool.rows(list(order.pages), device="cpu"), n_all).pin_memory()
        if gated:
            self.gates.reopen()
        with torch.cuda.device(self.device):
            if after is None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                stream.wait_event(after)
            stream.wait_stream(self._scatter)  # staging is free of the last restore's scatters
            with torch.cuda.stream(stream):  # temporaries made here are freed in this stream's order
                entry.start.record(stream)
                rows_all = rows_host.to(self.device, non_blocking=True)
                entry.keep = [rows_host, rows_all]  # alive until reported: the GPU reads them
                if restore:
                    self._restore_pipelined(order, rows_all, per_group, gated)
                    entry.end.record(self._scatter)
                    return
                for g in range(self.host.layout.groups):
                    for first in range(0, n_all, self.staging_pages):
                        self._round(order, g, first, rows_all[g], per_group)
                entry.end.record(stream)

    def _restore_pipelined(self, order: Restore, rows_all: torch.Tensor, per_group: int, gated: bool) -> None:
        """A restore as units (a layer group's pages, as many as half the staging holds): the copy
        stream moves unit ``i`` over PCIe into staging slot ``i % slots`` (2, or 1 when staging holds
        one plane row) while the scatter stream (high
        priority, so its kernels get SMs between the forward's) scatters unit ``i - 1`` from the
        other slot into the pool; a slot is refilled only after its last scatter. With ``gated``
        each group's gate is recorded after its last scatter. On one stream the bus idled during
        every scatter (H200, docs/PERFORMANCE.md host tier v8: restores 3.0 ms p50 against 2.4
        before layer groups; v9, with this pipeline, 3.3: the extra copies of scattered host pages,
        not the scatters, are what costs)."""
        slot = max(1, self.staging_pages // 2)
        slots = self.staging_pages // slot
        units = [(g, first) for g in range(self.host.layout.groups) for first in range(0, len(order.pages), slot)]
        scattered: list[torch.cuda.Event] = []
        for i, (g, first) in enumerate(units):
            n = min(slot, len(order.pages) - first)
            base = (i % slots) * slot
            if i >= slots:
                self._stream.wait_event(scattered[i - slots])
            for run in self.host.runs(order.host_pages[first:first + n]):
                held = self.host.chunk(run.chunk).raw[g, run.start:run.stop]
                self._staging_raw[base + run.index:base + run.index + run.stop - run.start].copy_(
                    held, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
            self._scatter.wait_event(copied)
            rows = rows_all[g][first * per_group:(first + n) * per_group]
            with torch.cuda.stream(self._scatter):
                for pool_buf, stage in zip(self._buffers, self._staging_views, strict=True):
                    _move(pool_buf, rows, stage[base:base + n], restore=True)
                done = torch.cuda.Event()
                done.record(self._scatter)
                scattered.append(done)
                if gated and (i + 1 == len(units) or units[i + 1][0] != g):
                    self.gates.record(g, self._scatter)

    def _round(self, order: Offload, group: int, first: int, rows_all: torch.Tensor, per_group: int) -> None:
        """Layer group ``group`` of an offload's pages ``first ..`` (as many as staging holds), on
        the copy stream: gather into staging, then copy to the host."""
        n = min(self.staging_pages, len(order.pages) - first)
        rows = rows_all[first * per_group:(first + n) * per_group]
        for pool_buf, stage in zip(self._buffers, self._staging_views, strict=True):
            _move(pool_buf, rows, stage[:n], restore=False)
        for run in self.host.runs(order.host_pages[first:first + n]):
            held = self.host.chunk(run.chunk).raw[group, run.start:run.stop]
            held.copy_(self._staging_raw[run.index:run.index + run.stop - run.start], non_blocking=True)

    def _page_words(self, views) -> list[torch.Tensor]:
        return [words(v, 2, w) for v, w in zip(views, self._widths, strict=True)]


def _move(pool_buf: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, restore: bool) -> None:
    """Copy between the pool's merged rows ``rows`` (``[n * layers]``, one group's layers) of
    ``pool_buf`` (``[L * N, W]``) and ``pages``, a page-major (strided) view ``[n, layers, W]`` of the
    same dtype: into the pool when ``restore``."""
    flat = (pages.shape[0] * pages.shape[1], pages.shape[2])
    if restore:
        pool_buf.index_copy_(0, rows, pages.reshape(flat))
    else:
        pages.copy_(pool_buf.index_select(0, rows).view(pages.shape))
