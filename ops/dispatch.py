"""Backend choice for the KV-cache ops: Triton kernels for CUDA tensors, the PyTorch references
otherwise. ``PRISM_OPS=reference`` forces the references everywhere (the oracle on the GPU too);
``PRISM_OPS=triton`` forces the kernels (with ``TRITON_INTERPRET=1`` on CPU, for tests).

Decode attention over FP8 pages has three kernels: the current one, which widens every stored K/V
element to 16 bits (``"widen"``, :func:`ops.triton_kernels.paged_decode_attention`), and two on the
FP8 matrix units in their variants: the GQA group as the products' M dimension (``"mma_p8"``,
``"mma_p16"``, ``"mma_p8_q2"``, ``"mma_p16_q2"``, :mod:`ops.triton_kernels.fp8_decode`) and keys as
M (``"kam_*"`` likewise, :mod:`ops.triton_kernels.fp8_decode_kam`). :data:`DECODE_KERNEL_TABLE`
chooses kernel and launch settings per (page format, batch, context) (:func:`lookup_decode_table`);
``PRISM_FP8_DECODE`` overrides it for benchmarking. The choice is a :class:`DecodePlan`: eager steps
make one per step here, the captured decode graphs (``engine/graphs/decode.py``) one per batch
bucket at capture."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib

import torch

from . import reference
from .metadata import AttentionMetadata
from .self_attention import causal_self_attention

try:  # Triton is optional on CPU-only installs
    from . import triton_kernels
except Exception:  # pragma: no cover - depends on the install
    triton_kernels = None


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on tensor ``t`` run as Triton kernels."""
    return kernels_on(t.device)


def kernels_on(device: torch.device) -> bool:
    """Whether ops on tensors of ``device`` run as Triton kernels (:func:`use_triton` for a tensor there)."""
    mode = os.environ.get("PRISM_OPS", "auto")
    if triton_kernels is None or mode == "reference":
        return False
    return mode == "triton" or device.type == "cuda"


def _pick(name: str, t: torch.Tensor):
    return getattr(triton_kernels if use_triton(t) else reference, name)


def store_kv(k, v, cache, slot_mapping, out=None) -> None:
    """See :func:`ops.reference.store_kv`."""
    _pick("store_kv", k)(k, v, cache, slot_mapping, out)


def paged_attention(q, cache, meta):
    """See :func:`ops.reference.paged_attention`. GQA groups that are not a power of two use the reference."""
    group = q.shape[1] // cache.num_kv_heads
    if use_triton(q) and group & (group - 1) == 0:
        return triton_kernels.paged_attention(q, cache, meta)
    return reference.paged_attention(q, cache, meta)


#: Decode attention kernels by name: the current one (``"widen"``), the FP8-MMA variants with the GQA
#: group as M (``mma_*``, :data:`ops.triton_kernels.MMA_VARIANTS`) and with keys as M (``kam_*``,
#: :data:`ops.triton_kernels.KAM_VARIANTS`), each ``(p_fp8, q_terms)``.
MMA_KERNELS = {"mma_p8": (True, 1), "mma_p16": (False, 1), "mma_p8_q2": (True, 2), "mma_p16_q2": (False, 2)}
KAM_KERNELS = {"kam_p8": (True, 1), "kam_p16": (False, 1), "kam_p8_q2": (True, 2), "kam_p16_q2": (False, 2)}
DECODE_KERNELS = ("widen", *MMA_KERNELS, *KAM_KERNELS)

#: The launch settings a table entry may give each kernel family (any left out: the kernel's own
#: config, :data:`ops.triton_kernels.DECODE_CONFIG` / ``MMA_DECODE_CONFIG`` / ``KAM_DECODE_CONFIG``).
#: ``waves`` sets the context split (:func:`ops.triton_kernels.decode_splits`), the rest go to the launch.
DECODE_SETTINGS = {
    "widen": ("block_n", "num_warps", "num_stages", "rows", "waves"),
    "mma": ("block_n", "num_warps", "num_stages", "rows", "waves"),
    "kam": ("block_n", "num_warps", "num_stages", "pv_t", "waves"),
}

#: Batch and context (longest ``seq_len`` of the step) buckets of :data:`DECODE_KERNEL_TABLE`: a shape
#: belongs to the smallest bucket at least as large (the last bucket takes everything beyond).
DECODE_BATCH_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

#: Which decode kernel runs per shape, with which launch settings:
#: ``(page format, batch bucket, context bucket) -> (kernel name, settings)`` (page format as
#: :data:`ops.triton_kernels.DECODE_CONFIG` keys it: ``"fp8"`` or ``"bf16"``; settings a dict of
#: :data:`DECODE_SETTINGS`' keys). Looked up by :func:`lookup_decode_table`; a shape no entry covers
#: takes ``("widen", {})``, the current kernel with its config. Empty until the H200 measures the
#: FP8-MMA kernels (``benchmarks/bench_fp8_decode.py`` writes the entries, :func:`decode_table_from_bench`
#: reads them; issue 36): the current kernel runs everywhere. ``PRISM_DECODE_TABLE=path.json`` replaces
#: it at run time (for A/B runs).
DECODE_KERNEL_TABLE: dict[tuple[str, int, int], tuple[str, dict]] = {}

CURRENT_KERNEL = ("widen", {})


def _family(name: str) -> str:
    return "kam" if name in KAM_KERNELS else "mma" if name in MMA_KERNELS else "widen"


def _bucket_index(value: int, buckets: tuple[int, ...]) -> int:
    return next((i for i, b in enumerate(buckets) if value <= b), len(buckets) - 1)


def decode_buckets(batch: int, max_seq_len: int) -> tuple[int, int]:
    """``(batch bucket, context bucket)`` of a step: the smallest of :data:`DECODE_BATCH_BUCKETS` /
    :data:`DECODE_CONTEXT_BUCKETS` at least as large as ``batch`` / ``max_seq_len`` (the last bucket
    takes everything beyond)."""
    return (DECODE_BATCH_BUCKETS[_bucket_index(batch, DECODE_BATCH_BUCKETS)],
            DECODE_CONTEXT_BUCKETS[_bucket_index(max_seq_len, DECODE_CONTEXT_BUCKETS)])


def lookup_decode_table(table: dict, page_format: str, batch: int, max_seq_len: int) -> tuple[str, dict]:
    """The table's ``(kernel name, settings)`` for a step of ``batch`` sequences, the longest
    ``max_seq_len`` tokens, over pages of ``page_format``.

    Rules (the bench measures a few shapes, not every bucket): the step's buckets
    (:func:`decode_buckets`); the entry of exactly those buckets if there is one; else the nearest
    entry of the same page format that is at most one bucket away on each axis (distance: batch
    steps + context steps; on a tie the larger context, then the larger batch, whose measurement had
    at least the step's work); else :data:`CURRENT_KERNEL`. So an entry speaks for its neighbouring
    buckets only, and the bench writes ``"widen"`` entries where the current kernel wins, which keep
    a neighbour's win from spreading there.

    Args:
        table: as :data:`DECODE_KERNEL_TABLE`.
        page_format: ``"fp8"`` or ``"bf16"``.
        batch, max_seq_len: the step's (a graph's: its batch bucket, its longest context).

    Returns:
        ``(name, settings)``: a name of :data:`DECODE_KERNELS` and a dict (not a copy: do not mutate).
    """
    bb, cb = decode_buckets(batch, max_seq_len)
    if (page_format, bb, cb) in table:
        return table[page_format, bb, cb]
    bi, ci = _bucket_index(bb, DECODE_BATCH_BUCKETS), _bucket_index(cb, DECODE_CONTEXT_BUCKETS)
    near = []
    for (fmt, eb, ec), choice in table.items():
        if fmt != page_format or eb not in DECODE_BATCH_BUCKETS or ec not in DECODE_CONTEXT_BUCKETS:
            continue
        db = abs(DECODE_BATCH_BUCKETS.index(eb) - bi)
        dc = abs(DECODE_CONTEXT_BUCKETS.index(ec) - ci)
        if db <= 1 and dc <= 1:
            near.append((db + dc, -ec, -eb, choice))
    return min(near, key=lambda t: t[:3])[3] if near else CURRENT_KERNEL


def check_decode_choice(name: str, settings: dict) -> None:
    """Raises ValueError unless ``name`` is one of :data:`DECODE_KERNELS` and ``settings`` uses only
    its family's :data:`DECODE_SETTINGS`."""
    if name not in DECODE_KERNELS:
        raise ValueError(f"unknown decode kernel {name!r}: one of {DECODE_KERNELS}")
    unknown = set(settings) - set(DECODE_SETTINGS[_family(name)])
    if unknown:
        raise ValueError(f"decode kernel {name!r} takes no setting {sorted(unknown)}")


def decode_table_from_bench(result) -> dict[tuple[str, int, int], tuple[str, dict]]:
    """:data:`DECODE_KERNEL_TABLE` entries from ``benchmarks/bench_fp8_decode.py``'s JSON (a path or the
    parsed dict): its ``"table"`` list of ``{"page_format", "batch_bucket", "context_bucket", "kernel",
    "settings"}``, one per measured point (the fastest kernel that passed its accuracy check).

    Raises:
        ValueError: no ``"table"`` in it, an unknown kernel or setting, or a bucket not in
            :data:`DECODE_BATCH_BUCKETS` / :data:`DECODE_CONTEXT_BUCKETS`.
    """
    if not isinstance(result, dict):
        result = json.loads(pathlib.Path(result).read_text())
    if "table" not in result:
        raise ValueError("no 'table' in the bench result (benchmarks/bench_fp8_decode.py writes it)")
    out = {}
    for e in result["table"]:
        name, settings = e["kernel"], dict(e.get("settings", {}))
        check_decode_choice(name, settings)
        if e["batch_bucket"] not in DECODE_BATCH_BUCKETS or e["context_bucket"] not in DECODE_CONTEXT_BUCKETS:
            raise ValueError(f"not a table bucket: {e['batch_bucket']} x {e['context_bucket']}")
        out[e["page_format"], e["batch_bucket"], e["context_bucket"]] = (name, settings)
    return out


@functools.cache
def _table_file(path: str) -> dict:
    return decode_table_from_bench(path)


def _active_table() -> dict:
    path = os.environ.get("PRISM_DECODE_TABLE")
    return _table_file(path) if path else DECODE_KERNEL_TABLE


def decode_choice(fp8: bool, batch: int, max_seq_len: int, head_dim: int, device) -> tuple[str, dict]:
    """The decode attention kernel and its settings for a step: ``(name of DECODE_KERNELS, settings)``.

    ``PRISM_FP8_DECODE`` (a name of :data:`DECODE_KERNELS`, with the kernel's own settings, or
    ``auto``, the default: :func:`lookup_decode_table` over the active table, ``PRISM_DECODE_TABLE``'s
    file or :data:`DECODE_KERNEL_TABLE`) chooses for FP8 pages; 16/32-bit pages take the table's
    ``"widen"`` settings for ``"bf16"`` or :data:`CURRENT_KERNEL`. An FP8-MMA choice falls back to
    :data:`CURRENT_KERNEL` where it cannot run: no FP8 matrix units on ``device``
    (:func:`ops.triton_kernels.fp8_mma_supported`) or a head_dim that is not a multiple of 32.

    Args:
        fp8: the pages are FP8.
        batch: sequences in the step.
        max_seq_len: the longest ``seq_len`` of the step (a graph's: the longest it allows).
        head_dim: the attention head size.
        device: where the step runs.

    Raises:
        ValueError: ``PRISM_FP8_DECODE`` names no kernel; a table entry names an unknown kernel or setting.
    """
    if not fp8:
        name, settings = lookup_decode_table(_active_table(), "bf16", batch, max_seq_len)
        return (name, settings) if name == "widen" else CURRENT_KERNEL
    env = os.environ.get("PRISM_FP8_DECODE", "auto")
    if env == "auto":
        name, settings = lookup_decode_table(_active_table(), "fp8", batch, max_seq_len)
    elif env in DECODE_KERNELS:
        name, settings = env, {}
    else:
        raise ValueError(f"PRISM_FP8_DECODE must be auto or one of {DECODE_KERNELS}, not {env!r}")
    check_decode_choice(name, settings)
    if name != "widen" and (triton_kernels is None or head_dim % 32
                            or not triton_kernels.fp8_mma_supported(device)):
        return CURRENT_KERNEL
    return name, settings


def decode_kernel(fp8: bool, batch: int, max_seq_len: int, head_dim: int, device) -> str:
    """The name :func:`decode_choice` gives."""
    return decode_choice(fp8, batch, max_seq_len, head_dim, device)[0]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode attention launch, chosen: the Triton kernel ``kernel`` (a name of
    :data:`DECODE_KERNELS`) with ``settings`` and a fixed context split. Calling it runs the kernel
    directly (no backend choice, nothing read back), so CUDA graphs capture it; a graph makes its
    plan once, at capture, for its batch bucket and longest context (:func:`decode_plan`)."""

    kernel: str
    settings: dict
    num_splits: int

    def __call__(self, q: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:
        """``[B, Hq, D]`` decode attention of ``q`` over ``cache`` (see
        :func:`ops.triton_kernels.paged_decode_attention`)."""
        kw = {k: v for k, v in self.settings.items() if k != "waves"}
        if self.kernel == "widen":
            return triton_kernels.paged_decode_attention(q, cache, meta, num_splits=self.num_splits, **kw)
        family = _family(self.kernel)
        p_fp8, q_terms = (KAM_KERNELS if family == "kam" else MMA_KERNELS)[self.kernel]
        fn = (triton_kernels.paged_decode_attention_fp8_kam if family == "kam"
              else triton_kernels.paged_decode_attention_fp8_mma)
        return fn(q, cache, meta, self.num_splits, p_fp8=p_fp8, q_terms=q_terms, **kw)


def decode_splits_for(name: str, settings: dict, batch: int, num_kv_heads: int, max_seq_len: int,
                      fp8: bool) -> int:
    """Context chunks per (sequence, KV head) of kernel ``name`` under ``settings`` (its
    ``block_n`` / ``waves``, else its config's), at most :data:`ops.triton_kernels.MAX_DECODE_SPLITS`:
    for ``"widen"`` without either, exactly :func:`ops.triton_kernels.default_decode_splits`."""
    tk = triton_kernels
    bn, waves = settings.get("block_n"), settings.get("waves")
    family = _family(name)
    if family == "kam":
        return tk.kam_decode_splits(batch, num_kv_heads, max_seq_len, bn, waves)
    if family == "mma":
        return tk.mma_decode_splits(batch, num_kv_heads, max_seq_len, bn, waves)
    if bn is None and waves is None:
        return tk.default_decode_splits(batch, num_kv_heads, max_seq_len, fp8)
    cfg = tk.decode_config(fp8)
    return min(tk.MAX_DECODE_SPLITS, tk.decode_splits(batch, num_kv_heads, max_seq_len, bn or cfg["block_n"],
                                                      waves=waves or cfg["waves"]))


def decode_plan(fp8: bool, batch: int, max_seq_len: int, num_kv_heads: int, head_dim: int, device) -> DecodePlan:
    """The :class:`DecodePlan` of a decode step (or a graph's bucket) of ``batch`` sequences, the
    longest ``max_seq_len`` tokens: :func:`decode_choice`'s kernel, its split by
    :func:`decode_splits_for`. Needs Triton (raises RuntimeError without it)."""
    if triton_kernels is None:
        raise RuntimeError("decode plans launch Triton kernels: Triton is not installed")
    name, settings = decode_choice(fp8, batch, max_seq_len, head_dim, device)
    return DecodePlan(name, settings, decode_splits_for(name, settings, batch, num_kv_heads, max_seq_len, fp8))


def paged_decode_attention(q, cache, meta):
    """See :func:`ops.reference.paged_decode_attention`; where the Triton kernels run, the
    :func:`decode_plan` of the step (on FP8 pages the same output up to the chosen kernel's
    quantisation of Q and P)."""
    group = q.shape[1] // cache.num_kv_heads
    if use_triton(q) and group & (group - 1) == 0:
        plan = decode_plan(cache.is_fp8, q.shape[0], meta.max_seq_len, cache.num_kv_heads, cache.head_dim, q.device)
        return plan(q, cache, meta)
    return reference.paged_decode_attention(q, cache, meta)


def warm_up(cache, num_heads: int, dtype: torch.dtype) -> None:
    """Before the first request: compile the Triton kernels eager steps launch
    (:func:`ops.triton_kernels.startup.warm_up`) and load the fused attention a cold prompt uses
    (:mod:`ops.self_attention`). A no-op where the references run."""
    if not use_triton(cache.k_cache):
        return
    group = num_heads // cache.num_kv_heads
    if group & (group - 1) == 0:
        triton_kernels.warm_up(cache, num_heads, dtype)
    dev = cache.k_cache.device
    q = torch.zeros(16, num_heads, cache.head_dim, dtype=dtype, device=dev)
    kv = torch.zeros(16, cache.num_kv_heads, cache.head_dim, dtype=dtype, device=dev)
    for lens in ([16], [8, 8]):  # one prompt, and several together
        causal_self_attention(q, kv, kv, AttentionMetadata.build(lens, lens, [[0]] * len(lens), [-1] * 16, dev))


def move_slots(cache, src_slots, dst_slots) -> None:
    """See :func:`ops.reference.move_slots`."""
    _pick("move_slots", cache.k_cache)(cache, src_slots, dst_slots)


def copy_pages(cache, src_pages, dst_pages) -> None:
    """See :func:`ops.reference.copy_pages`."""
    _pick("copy_pages", cache.k_cache)(cache, src_pages, dst_pages)
