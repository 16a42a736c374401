"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

The kernels that take it: the GEMV (:mod:`ops.linear`), add + RMSNorm and Q/K norm + rotary
(:mod:`ops.fused`), the KV store and the split decode attention with its merge
(:mod:`ops.triton_kernels`). Kernels that run between cuBLAS products or outside decode (the
SwiGLU gate where the GEMV does not take it, the vision rotary, prefill attention, slot moves)
launch plainly: PDL only pays between two kernels that both take part.

A decode step at batch 1 (8B shape) is ~330 short kernels in a row, each depending on the one
before. Without PDL a kernel's programs are scheduled only once the previous kernel has fully
finished, so every boundary costs the launch latency on top of the previous kernel's tail. With PDL
(CUDA 11.8+, on Hopper and later GPUs, CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization") the next kernel is launched as soon as every program of the running one has
signalled ``griddepcontrol.launch_dependents``; its programs then block in ``griddepcontrol.wait``
until the previous kernel has completed and its memory writes are visible (PTX ISA,
"griddepcontrol").

Each kernel here calls :func:`pdl_sync` first: it waits before touching any memory (so it can
neither read unfinished inputs nor overwrite what the previous kernel still reads), then lets the
next kernel launch, whose programs become resident while this one runs. Since every PDL kernel waits
for its predecessor, and completes only after its own wait, the order of effects in the stream is
that of plain launches. Kernels launched without the attribute (PyTorch's, cuBLAS) keep the ordinary
full dependency on both sides. CUDA graphs capture the launch attribute as a programmatic edge.

Measured on the H200 (8B shape, ``docs/PERFORMANCE.md``, v9): TPOT at batch 1 4.96 -> 4.83 ms and
5.06 -> 4.94 ms in two A/B runs. Two variants lost and were dropped: launching dependents before the
wait (batch 1 5.40 ms: chains of waiting programs crowd the GPU) and the GEMV asking L2 for the
start of its weights before its wait (``cp.async.bulk.prefetch.L2``; 5.10 ms with 16 MiB, 5.17 ms
with 32 MiB).

``PRISM_PDL=0`` turns it off (to measure it, or if a driver misbehaves); it is also off on the CPU,
under the Triton interpreter, on GPUs before compute capability 9.0, and with a Triton whose
launcher lacks the ``launch_pdl`` option.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - Triton is optional on CPU-only installs
    triton = None


@functools.cache
def _triton_can_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no NVIDIA backend in this Triton
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _device_can_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _interpreting() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on tensor ``t``'s device launch with PDL (see the module docstring)."""
    if triton is None or not t.is_cuda or os.environ.get("PRISM_PDL") == "0":
        return False
    if not _triton_can_launch_pdl() or _interpreting():
        return False
    return _device_can_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    :func:`pdl_sync`: ``{"PDL": True, "launch_pdl": True}`` where :func:`enabled`, else
    ``{"PDL": False}``."""
    if enabled(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:

    @triton.jit
    def pdl_launch_dependents(PDL: tl.constexpr):
        """Let the next kernel in the stream launch (its programs wait in :func:`pdl_wait`)."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Block until the previous kernel in the stream has completed and its writes are visible."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def pdl_sync(PDL: tl.constexpr):
        """First statement of a PDL kernel: wait for the previous kernel, then let the next one
        launch. Compiles to nothing when ``PDL`` is False."""
        pdl_wait(PDL)
        pdl_launch_dependents(PDL)
