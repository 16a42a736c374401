"""Attention metadata and the per-layer paged KV store, shared by the reference ops and the kernels.

KV pool layout (one layer):

* ``k_cache``, ``v_cache``: ``[num_pages, num_kv_heads, page_size, head_dim]`` (head-major pages:
  one head's keys of one page are ``page_size * head_dim`` contiguous elements, 2 KiB in FP8 at
  16 x 128, so attention reads whole 2 KiB runs instead of 128-byte rows 1 KiB apart), dtype
  ``torch.float8_e4m3fn`` ("fp8" mode) or the model dtype ("auto" mode).
* ``k_scale``, ``v_scale``: float32 ``[num_pages, num_kv_heads, page_size]`` in fp8 mode, ``None`` in
  auto mode. One scale per token and KV head (see :func:`ops.reference.quantize_fp8`).
* A token's *slot* is ``page_index * page_size + offset_in_page``; slot ``-1`` means "padding". The
  element of slot ``s``, head ``h``, dim ``d`` is at
  ``((s // page_size * num_kv_heads + h) * page_size + s % page_size) * head_dim + d``.

The step's attention inputs travel in one :class:`AttentionMetadata`, with kernel-shaped tensors (flat
slot mapping, cumulative query starts, sequence lengths, padded block tables) plus a few host ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: dtype of the FP8 KV payload.
FP8_DTYPE = torch.float8_e4m3fn

#: dtype of the per-token, per-head FP8 scales.
SCALE_DTYPE = torch.float32

#: Names accepted for the KV cache dtype setting.
KV_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_dtype(kv_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Map the KV dtype setting to the storage dtype of the K/V payload.

    Args:
        kv_dtype: ``"auto"`` (store in ``model_dtype``), ``"fp8"`` / ``"fp8_e4m3"`` (Scaled-FP8,
            ``torch.float8_e4m3fn``), or a torch dtype (``torch.float8_e4m3fn`` or a float dtype).
        model_dtype: the model's activation dtype (float32, bfloat16 or float16).

    Returns:
        The payload dtype.

    Raises:
        ValueError: unknown name, or a dtype that is neither FP8 E4M3 nor a floating point dtype.
    """
    if isinstance(kv_dtype, str):
        name = kv_dtype.lower()
        if name == "auto":
            return model_dtype
        if name in ("fp8", "fp8_e4m3"):
            return FP8_DTYPE
        raise ValueError(f"unknown kv cache dtype {kv_dtype!r}; expected one of {KV_DTYPE_NAMES}")
    if kv_dtype == FP8_DTYPE or (kv_dtype.is_floating_point and kv_dtype.itemsize >= 2):
        return kv_dtype
    raise ValueError(f"unsupported kv cache dtype {kv_dtype}")


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, kv_dtype: str | torch.dtype, model_dtype: torch.dtype) -> int:
    """Bytes one token occupies in one layer's KV pool (K and V, payload plus scales).

    FP8: ``2 * (num_kv_heads * head_dim * 1 + num_kv_heads * 4)`` (the float32 scales included);
    auto: ``2 * num_kv_heads * head_dim * itemsize(model_dtype)``. For 8 KV heads of 128 that is
    2112 bytes (FP8) versus 4096 bytes (bfloat16), 1.94x more tokens per byte.

    Raises:
        ValueError: as :func:`resolve_kv_dtype`.
    """
    dtype = resolve_kv_dtype(kv_dtype, model_dtype)
    per_head = head_dim * dtype.itemsize
    if dtype == FP8_DTYPE:
        per_head += SCALE_DTYPE.itemsize
    return 2 * num_kv_heads * per_head


@dataclass
class KVLayerCache:
    """One decoder layer's paged K/V pool (views into the engine's pool; the ops write in place).

    Attributes:
        k_cache: ``[num_pages, num_kv_heads, page_size, head_dim]`` keys, ``torch.float8_e4m3fn``
            (fp8 mode) or the model dtype (auto mode).
        v_cache: values, same shape and dtype as ``k_cache``.
        k_scale: float32 ``[num_pages, num_kv_heads, page_size]`` key scales (fp8 mode), else ``None``.
        v_scale: float32 ``[num_pages, num_kv_heads, page_size]`` value scales (fp8 mode), else ``None``.

    Raises:
        ValueError: (on construction) shapes or dtypes disagree, or scales are missing in fp8 mode /
            present in auto mode.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.k_cache.dim() != 4:
            raise ValueError(
                f"k_cache must be [num_pages, num_kv_heads, page_size, head_dim], got {tuple(self.k_cache.shape)}"
            )
        if self.v_cache.shape != self.k_cache.shape or self.v_cache.dtype != self.k_cache.dtype:
            raise ValueError("k_cache and v_cache must have the same shape and dtype")
        if self.is_fp8:
            for name, s in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
                if s is None:
                    raise ValueError(f"{name} is required when the cache is float8_e4m3fn")
                if s.shape != self.k_cache.shape[:3] or s.dtype != SCALE_DTYPE:
                    raise ValueError(
                        f"{name} must be float32 {tuple(self.k_cache.shape[:3])}, got {s.dtype} {tuple(s.shape)}"
                    )
        elif self.k_scale is not None or self.v_scale is not None:
            raise ValueError("k_scale / v_scale must be None when the cache is not FP8")

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str | torch.dtype,
        model_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVLayerCache:
        """A zero-filled pool (scales set to 1.0 in fp8 mode). ``kv_dtype`` as :func:`resolve_kv_dtype`."""
        dtype = resolve_kv_dtype(kv_dtype, model_dtype)
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        if dtype != FP8_DTYPE:
            return cls(k, v)
        ks = torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device)
        vs = torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device)
        return cls(k, v, ks, vs)

    @property
    def is_fp8(self) -> bool:
        """True when the payload is Scaled-FP8 (``torch.float8_e4m3fn`` with float32 scales)."""
        return self.k_cache.dtype == FP8_DTYPE

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def num_slots(self) -> int:
        """``num_pages * page_size``; valid slots are ``0 .. num_slots - 1``."""
        return self.num_pages * self.page_size


@dataclass
class AttentionMetadata:
    """Everything the attention ops need about one forward step over a flat batch of B sequences.

    The step's T new tokens are laid out sequence after sequence: sequence ``b`` owns rows
    ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of ``q`` / ``k`` / ``v`` / ``slot_mapping``.
    Its new tokens are the *last* ``query_len_b`` of its ``seq_lens[b]`` tokens. Rows after
    ``query_start_loc[B]`` (if any) are padding: their slot must be -1 and their output is zero.

    Attributes:
        slot_mapping: int64 ``[T]``; slot (``page * page_size + offset``) where each new token's K/V is
            stored, ``-1`` for padding rows (not stored).
        query_start_loc: int32 (or int64) ``[B + 1]``; cumulative new-token counts, ``query_start_loc[0]
            == 0``, ``query_len_b = query_start_loc[b + 1] - query_start_loc[b]``.
        seq_lens: int32 (or int64) ``[B]``; total KV length of each sequence *after* this step's tokens
            are stored (cached + new). ``seq_lens[b] >= query_len_b``.
        block_tables: int32 (or int64) ``[B, max_pages_per_seq]``; page indices of each sequence in
            logical order (entry ``i`` holds positions ``i * page_size .. (i + 1) * page_size - 1``),
            padded with -1 beyond ``ceil(seq_lens[b] / page_size)`` pages.
        max_query_len: host int, ``max_b query_len_b``.
        max_seq_len: host int, ``max_b seq_lens[b]``.
        scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
        fresh: host bool, True when no sequence has cached context (``query_len_b == seq_len_b``
            for every ``b``): each sequence's keys are exactly the step's own new tokens, so the
            step may attend to its own K/V (:func:`ops.self_attention.causal_self_attention`).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float | None = None
    fresh: bool = False

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the step."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """T, the number of rows of the flat batch (``slot_mapping`` length, padding included)."""
        return self.slot_mapping.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence has exactly one new token (``max_query_len == 1`` and ``T == B``).

        Host-only check (no device sync); assumes ``T == query_start_loc[B]`` as :meth:`build` makes it.
        """
        return self.max_query_len == 1 and self.num_tokens == self.num_seqs

    def softmax_scale(self, head_dim: int) -> float:
        """``scale`` or, when it is ``None``, ``head_dim ** -0.5``."""
        return head_dim**-0.5 if self.scale is None else self.scale

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
        scale: float | None = None,
    ) -> AttentionMetadata:
        """Make the tensors from host lists.

        Args:
            query_lens: new tokens per sequence (``[B]``).
            seq_lens: total KV length per sequence after the step (``[B]``).
            block_tables: page indices per sequence (ragged; padded here with -1 to the longest).
            slot_mapping: slot per new token, ``sum(query_lens)`` entries (-1 for tokens not stored).
            device: where the tensors go.
            scale: softmax scale (``None`` -> ``head_dim ** -0.5``).

        Returns:
            Metadata with int64 ``slot_mapping`` and int32 ``query_start_loc`` / ``seq_lens`` /
            ``block_tables``; ``fresh`` when ``query_lens == seq_lens`` (and ``B > 0``).

        Raises:
            ValueError: list lengths disagree, a length is negative, ``query_len > seq_len``, or the slot
                mapping does not have ``sum(query_lens)`` entries.
        """
        b = len(query_lens)
        if len(seq_lens) != b or len(block_tables) != b:
            raise ValueError(
                f"query_lens ({b}), seq_lens ({len(seq_lens)}) and block_tables ({len(block_tables)}) "
                "must have one entry per sequence"
            )
        for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if ql < 0 or sl < 0 or ql > sl:
                raise ValueError(f"sequence {i}: need 0 <= query_len ({ql}) <= seq_len ({sl})")
        if len(slot_mapping) != sum(query_lens):
            raise ValueError(
                f"slot_mapping has {len(slot_mapping)} entries, expected sum(query_lens) = {sum(query_lens)}"
            )
        width = max((len(t) for t in block_tables), default=0)
        table = torch.full((b, width), -1, dtype=torch.int32)
        for i, pages in enumerate(block_tables):
            if pages:
                table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        starts = [0]
        for ql in query_lens:
            starts.append(starts[-1] + ql)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            scale=scale,
            fresh=b > 0 and list(query_lens) == list(seq_lens),
        )
