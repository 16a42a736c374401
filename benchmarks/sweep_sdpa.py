"""Time PyTorch's fused attention backends on the engine's two dense attention shapes (run by hand
on the GPU):

* a cold prompt's self-attention (``ops.self_attention``): 1,662 tokens, 32 query / 8 KV heads,
  head_dim 128, causal, bf16 (8B shape), against the paged prefill kernel over FP8 and bf16 pages;
* the vision encoder's: 8 images x 784 patches, 16 heads, head_dim 72, bf16 (8B vision tower).

    python benchmarks/sweep_sdpa.py

Each is timed inside a CUDA graph (``bench_gpu.graph_time``) and reported with its rate (causal:
``2 * T^2 * head_dim * heads`` FLOPs; full: twice that).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_time  # noqa: E402
from sweep_prefill import setup  # noqa: E402

from ops import triton_kernels as tk  # noqa: E402
from ops.self_attention import causal_self_attention  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def report(name: str, fn, flops: float) -> None:
    try:
        with warnings.catch_warnings():  # a backend that refuses the shape warns before it raises
            warnings.simplefilter("ignore", UserWarning)
            ms = graph_time(fn)
    except Exception as exc:  # a backend that does not take the shape
        print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
        return
    print(f"  {name}: {ms * 1e3:.1f} us ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)


def prompt_case(tokens: int = 1662) -> None:
    print(f"\ncold prompt, {tokens} tokens, 32/8 heads, d 128, causal:")
    flops = 2 * tokens * tokens * 128 * 32
    for kv in ("fp8_e4m3", "auto"):
        q, cache, meta = setup(1, tokens, kv)
        report(f"paged prefill kernel over {kv} pages", lambda q=q, c=cache, m=meta: tk.paged_attention(q, c, m), flops)
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    report("ops.self_attention (engine default)", lambda: causal_self_attention(q, k, v, meta), flops)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    for name, backend in BACKENDS.items():
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        report(f"SDPA {name}", run, flops)


def vision_case(images: int = 8, patches: int = 784) -> None:
    print(f"\nvision encoder, {images} x {patches} patches, 16 heads, d 72, full:")
    flops = 4 * images * patches * patches * 72 * 16
    q, k, v = (torch.randn(images, 16, patches, 72, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    for name, backend in BACKENDS.items():
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)
        report(f"SDPA {name}", run, flops)
    pad = torch.nn.functional.pad  # head_dim 72 -> 80 / 128: what a padded call would cost
    for d in (80, 128):
        qp, kp, vp = (pad(t, (0, d - 72)) for t in (q, k, v))
        def run_padded(qp=qp, kp=kp, vp=vp):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qp, kp, vp, scale=72**-0.5)
        report(f"SDPA flash, padded to d {d} (pre-padded inputs)", run_padded, flops)


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__)
    prompt_case()
    vision_case()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
