"""The paged KV pool: fixed-size pages for all layers, reference-counted for sharing.

One pool holds, for every decoder layer, ``k`` and ``v`` pages ``[num_pages, Hkv, page_size, D]``
(head-major: one KV head's keys of a page are contiguous), stored as float8_e4m3fn with a float32
scale per token and KV head (``kv_cache_dtype="fp8_e4m3"``) or in the model dtype (``"auto"``). A
page index means the same page in every layer, so a sequence's block table (its list of page
indices) serves all layers.

Pages carry reference counts so that several sequences and cached prefixes can share them; a page
with more than one reference is never written. Writers that need to append to a shared, partly
filled last page first take a private copy (copy-on-write, :meth:`PagePool.fork_last`).

Bookkeeping and data are apart: the scheduling side allocates, shares and releases pages, and the
data moves it decides (a copy-on-write page copy, a compaction's slot moves, a merging
compaction's value rewrite) are recorded as orders (:class:`PageCopy`, :class:`SlotMove`,
:class:`ValueMerge`) instead of run at once. The scheduler hands them to
the runner in its step plan, which applies them (:meth:`PagePool.apply`) before that step's
forward, on every tensor-parallel rank alike. An order is applied before any forward that follows
its decision, so it reads the pool as it was when it was decided.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ops import KVLayerCache, kv_bytes_per_token
from ops.dispatch import copy_pages, move_slots
from ops.reference import quantize_fp8

from ..errors import PrismError

KV_DTYPES = ("fp8_e4m3", "auto")


class OutOfPagesError(PrismError):
    """The pool has fewer free pages than asked for."""


@dataclass(frozen=True)
class PageCopy:
    """Copy page ``src``'s K/V (and scales) onto page ``dst`` in every layer (copy-on-write)."""

    src: int
    dst: int


@dataclass(frozen=True)
class SlotMove:
    """Move the K/V (and scales) of slots ``src`` to slots ``dst`` in every layer (compaction);
    slot ``s`` is ``page * page_size + offset``; the two may overlap."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True)
class ValueMerge:
    """Replace the V (and, on FP8 pages, the V scale) of every slot in ``dst`` by the weighted sum
    ``sum_i weight[i] * V[src[i]]`` over the entries ``i`` with ``dst[i]`` equal to it, in every
    layer and for every KV head the pool holds (the merging compaction, issue 35.3). Keys and K
    scales are not touched. Every source is read before any slot is written; on FP8 pages the
    sources are dequantised, summed in float32 and the result quantised again with fresh
    per-(token, head) scales (:func:`ops.reference.quantize_fp8`). Under tensor parallelism each
    rank applies it to its own KV heads (the weights are per token, never per head): rank-local."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    weight: tuple[float, ...]


#: A data move of the pool, decided on the scheduling side and applied by the runner.
KVOrder = PageCopy | SlotMove | ValueMerge


class PagePool:
    """A pool of KV pages shared by all sequences.

    Args:
        num_layers, num_kv_heads, head_dim: decoder shape.
        num_pages: pages in the pool (each holds ``page_size`` tokens in every layer).
        page_size: tokens per page.
        kv_cache_dtype: ``"fp8_e4m3"`` or ``"auto"`` (the model dtype).
        model_dtype, device: of the model.

    Raises:
        ValueError: unknown ``kv_cache_dtype`` or fewer than one page.
    """

    MOVE_ROWS = 1 << 18  # most (layer, slot) rows one compaction launch moves

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_pages, page_size=16,
                 kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32, device="cpu"):
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {kv_cache_dtype!r}")
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page; raise kv_cache_bytes")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_cache_dtype = kv_cache_dtype
        fp8 = kv_cache_dtype == "fp8_e4m3"
        store = torch.float8_e4m3fn if fp8 else model_dtype
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)  # head-major pages (ops.metadata)
        self._k = torch.empty(shape, dtype=store, device=device)  # untouched pages cost no RAM
        self._v = torch.empty(shape, dtype=store, device=device)
        scale_shape = shape[:-1]
        self._ks = torch.empty(scale_shape, dtype=torch.float32, device=device) if fp8 else None
        self._vs = torch.empty(scale_shape, dtype=torch.float32, device=device) if fp8 else None
        self.layers = [
            KVLayerCache(self._k[i], self._v[i], self._ks[i] if fp8 else None, self._vs[i] if fp8 else None)
            for i in range(num_layers)
        ]
        # Every layer's pages as one layer of num_layers * num_pages pages (page p of layer l is page
        # l * num_pages + p): a copy-on-write or a compaction then takes one kernel launch per
        # buffer instead of one per layer (hundreds of launches, ~8 ms of host time per hit).
        merged = (num_layers * num_pages, num_kv_heads, page_size, head_dim)
        self._all = KVLayerCache(
            self._k.view(merged), self._v.view(merged),
            self._ks.view(merged[:3]) if fp8 else None, self._vs.view(merged[:3]) if fp8 else None,
        )
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low indices first
        self.orders: list[KVOrder] = []  # data moves decided, not yet handed to a step plan

    # ------------------------------------------------------------------ sizing
    @classmethod
    def sized(cls, budget_bytes: int, *, num_layers, num_kv_heads, head_dim, page_size, kv_cache_dtype,
              model_dtype, device) -> PagePool:
        """A pool of as many whole pages as ``budget_bytes`` holds (scales included).

        Raises:
            ValueError: as the constructor (the budget holds less than one page).
        """
        shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        per_page = cls.bytes_per_page(**shape, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                                      model_dtype=model_dtype)
        return cls(**shape, num_pages=budget_bytes // per_page, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                   model_dtype=model_dtype, device=device)

    @staticmethod
    def bytes_per_page(*, num_layers, num_kv_heads, head_dim, page_size, kv_cache_dtype, model_dtype) -> int:
        """Bytes one page takes across all layers, scales included."""
        per_token = kv_bytes_per_token(num_kv_heads, head_dim, kv_cache_dtype, model_dtype)
        return per_token * page_size * num_layers

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes over all layers, scales included (as :meth:`bytes_per_page`,
        read off this pool's own tensors)."""
        return self.num_layers * sum(b[0].numel() * b.element_size() for b in self.buffers() if b is not None)

    # ------------------------------------------------------------------ the data, for other modules
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every layer's pages as one merged layer (row ``l * num_pages + p`` is page ``p`` of
        layer ``l``): ``(k, v, k_scale, v_scale)``, K/V ``[num_layers * num_pages, kv_heads,
        page_size, head_dim]`` (float8_e4m3fn, or the model dtype under "auto"), scales
        ``[num_layers * num_pages, kv_heads, page_size]`` float32 (``None`` under "auto"). Views:
        writing them writes the pool."""
        a = self._all
        return a.k_cache, a.v_cache, a.k_scale, a.v_scale

    def rows(self, pages: list[int], device: torch.device | str | None = None) -> torch.Tensor:
        """Rows of :meth:`buffers` holding ``pages`` in every layer, page-major: int64
        ``[len(pages) * num_layers]`` on ``device`` (default: the pool's), row ``i * num_layers + l``
        = ``l * num_pages + pages[i]`` (so a gather of them is ``[pages, layers, ...]`` in memory)."""
        layer_base = torch.arange(self.num_layers, dtype=torch.int64) * self.num_pages
        rows = (torch.as_tensor(pages, dtype=torch.int64).reshape(-1, 1) + layer_base).reshape(-1)
        return rows.to(self._k.device if device is None else device)

    # ------------------------------------------------------------------ page arithmetic
    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens (0 for 0)."""
        return -(-num_tokens // self.page_size)

    def slot(self, block_table, phys: int) -> int:
        """Pool slot of physical token ``phys`` of a sequence whose pages are ``block_table``."""
        return block_table[phys // self.page_size] * self.page_size + phys % self.page_size

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def counters(self) -> dict:
        """The pool's part of :meth:`Engine.stats() <engine.Engine.stats>`: pages total, used and
        free, tokens per page, capacity in tokens, the page format."""
        return {
            "pages_total": self.num_pages,
            "pages_used": self.num_used,
            "pages_free": self.num_free,
            "page_size": self.page_size,
            "capacity_tokens": self.capacity_tokens,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with one reference.

        Raises:
            OutOfPagesError: fewer than ``n`` pages are free (nothing is taken).
        """
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (sharing it)."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.refcount[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching zero return to the free list."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"release of free page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def is_shared(self, page: int) -> bool:
        return self.refcount[page] > 1

    def fork_last(self, block_table: list[int]) -> None:
        """Copy-on-write: give ``block_table`` a private copy of its last page if it is shared
        (the page is replaced in the list; the data copy is recorded as a :class:`PageCopy` order).

        Raises:
            OutOfPagesError: no free page for the copy.
        """
        if not block_table or not self.is_shared(block_table[-1]):
            return
        (fresh,) = self.allocate(1)
        self.orders.append(PageCopy(block_table[-1], fresh))
        self.release([block_table[-1]])
        block_table[-1] = fresh

    def keep_slots(self, block_table: list[int], kept: list[int]) -> list[int]:
        """Compaction of one sequence's pages: physical tokens ``kept`` (increasing) move to the
        front (physical ``0 .. k - 1``, recorded as a :class:`SlotMove` order), the pages past the
        first ``pages_for(k)`` are released. Returns the pages kept (a new list; ``block_table``
        is not changed)."""
        k = len(kept)
        self.orders.append(SlotMove(tuple(self.slot(block_table, i) for i in kept),
                                    tuple(self.slot(block_table, i) for i in range(k))))
        keep = self.pages_for(k)
        self.release(block_table[keep:])
        return list(block_table[:keep])

    def merge_values(self, block_table: list[int], into: list[int], weight: list[float]) -> int:
        """Order the merging compaction's value rewrite of one sequence (a :class:`ValueMerge`),
        before its :meth:`keep_slots`: physical token ``i`` (``i < len(into)``) is folded, with
        weight ``weight[i]``, into physical token ``into[i]`` (``into[j] == j`` for a token that
        stays; the weights into one token sum to 1). Tokens that absorb nothing keep their V
        untouched (no requantisation). Returns how many tokens' V change (0: nothing ordered)."""
        groups = Counter(into)
        members = [i for i, j in enumerate(into) if groups[j] > 1]
        if not members:
            return 0
        self.orders.append(ValueMerge(tuple(self.slot(block_table, i) for i in members),
                                      tuple(self.slot(block_table, into[i]) for i in members),
                                      tuple(float(weight[i]) for i in members)))
        return sum(1 for n in groups.values() if n > 1)

    def take_orders(self, kinds: tuple[type, ...] | None = None) -> list[KVOrder]:
        """The data moves decided since the last call, in the order decided (the list is emptied).
        With ``kinds``, only the orders of those types; the others stay, in order, for the next
        call (the serving loop starts restores from the host tier while a step runs, and leaves
        the page copies they imply to the next plan)."""
        if kinds is None:
            orders, self.orders = self.orders, []
            return orders
        taken = [o for o in self.orders if isinstance(o, kinds)]
        self.orders = [o for o in self.orders if not isinstance(o, kinds)]
        return taken

    def apply(self, order: KVOrder) -> None:
        """Run one data move (:class:`PageCopy` or :class:`SlotMove`) on this pool's tensors."""
        if isinstance(order, PageCopy):
            self.copy_page(order.src, order.dst)
        elif isinstance(order, ValueMerge):
            self.merge_slot_values(list(order.src), list(order.dst), list(order.weight))
        else:
            self.move_slots(list(order.src), list(order.dst))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s K/V (and scales) onto page ``dst`` in every layer (data only: no
        reference count changes). Under tensor parallelism every rank's pool does the same copy
        (from the step plan's orders)."""
        layer_base = torch.arange(self.num_layers) * self.num_pages
        dev = self._k.device
        copy_pages(self._all, (layer_base + src).to(dev), (layer_base + dst).to(dev))

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Move the K/V (and scales) of slots ``src`` to slots ``dst`` in every layer, correct when
        the two overlap (compaction). Slot ``s`` is ``page * page_size + offset``."""
        if not src:
            return
        slots = self.num_pages * self.page_size
        dev = self._k.device
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        # a few layers a launch: the move gathers its rows into a temporary first (overlap-safe),
        # whose size is bounded by MOVE_ROWS rows (~256 MiB of FP8 K at 8 KV heads x 128 dims)
        step = max(1, self.MOVE_ROWS // len(src))
        for first in range(0, self.num_layers, step):
            base = (torch.arange(first, min(first + step, self.num_layers)) * slots)[:, None]
            move_slots(self._all, (base + src_t).flatten().to(dev), (base + dst_t).flatten().to(dev))

    def merge_slot_values(self, src: list[int], dst: list[int], weight: list[float]) -> None:
        """Run a :class:`ValueMerge` on this pool's tensors: the V of each distinct slot of ``dst``
        becomes ``sum_i weight[i] * V[src[i]]`` over its entries, in every layer and KV head held
        here, computed in float32 (FP8 V dequantised with its scales first, the result quantised
        again with fresh per-(token, head) scales; a 16-bit pool rounds the float32 mean to its
        dtype). K and K scales are untouched. A few layers a pass, like :meth:`move_slots`. Runs with
        torch operations (no kernel of its own): once per compaction, not per step."""
        if not src:
            return
        _, v_all, _, vs_all = self.buffers()
        dev, ps = self._k.device, self.page_size
        src_t = torch.tensor(src, dtype=torch.int64, device=dev)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=dev)
        w = torch.tensor(weight, dtype=torch.float32, device=dev)
        raw = v_all.view(torch.uint8) if vs_all is not None else v_all  # FP8 indexed as bytes (as ops does)
        out_slots, group = torch.unique(dst_t, return_inverse=True)
        sp, so, dp, do = src_t // ps, src_t % ps, out_slots // ps, out_slots % ps
        heads, dim = v_all.shape[1], v_all.shape[3]
        # float32 temporaries (4 bytes a value where a move's are 1 for FP8): a quarter of the rows,
        # ~256 MiB at 8 KV heads x 128 dims
        step = max(1, self.MOVE_ROWS // 4 // len(src))
        for first in range(0, self.num_layers, step):
            base = (torch.arange(first, min(first + step, self.num_layers), device=dev) * self.num_pages)[:, None]
            vals = raw[base + sp, :, so]  # [layers, N, H, D]
            vals = vals.view(v_all.dtype).float() if vs_all is not None else vals.float()
            if vs_all is not None:
                vals = vals * vs_all[base + sp, :, so].unsqueeze(-1)
            merged = torch.zeros((len(base), len(out_slots), heads, dim), dtype=torch.float32, device=dev)
            merged.index_add_(1, group, vals * w[None, :, None, None])
            if vs_all is not None:
                q, scale = quantize_fp8(merged.reshape(-1, heads, dim))
                raw[base + dp, :, do] = q.view(torch.uint8).view(merged.shape)
                vs_all[base + dp, :, do] = scale.view(merged.shape[:-1])
            else:
                v_all[base + dp, :, do] = merged.to(v_all.dtype)

    def check(self, holders: Iterable[Iterable[int]]) -> None:
        """Debug check: every page's reference count equals the number of holders listing it,
        and the free list holds exactly the unreferenced pages.

        Raises:
            AssertionError: describing the first inconsistency.
        """
        counts = Counter(p for pages in holders for p in pages)
        for p in range(self.num_pages):
            assert self.refcount[p] == counts.get(p, 0), (
                f"page {p}: refcount {self.refcount[p]} but {counts.get(p, 0)} holders"
            )
        free = sorted(self._free)
        assert free == sorted(set(free)), "a page is on the free list twice"
        assert free == [p for p in range(self.num_pages) if self.refcount[p] == 0], "free list out of sync"
