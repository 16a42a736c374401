"""Time the decode step's weight products at small batch (run by hand on the GPU): the GEMV of
``ops/linear.py`` over a grid of launch settings, against what it replaces (cuBLAS through
``F.linear``, after the separate norm or SwiGLU-gate kernel where the GEMV does it in its prologue).

    python benchmarks/sweep_gemv.py [--rows 1 8] [--shapes 8b 2b]

Matrices are the language model's (``benchmarks/shapes.py`` configs): QKV after the attention norm,
output projection, gate/up after the MLP norm, down after the SwiGLU gate, LM head. Each case is
timed inside a CUDA graph over several copies of its weight (more bytes than the L2 holds), so every
call streams its weight from HBM, as one layer after another does in a decode step. The rate is
weight bytes over time; the copy rate measured in the same run is the ceiling. The three fastest
settings of each case are printed, the first being what ``ops.linear.gemv_settings`` should pick.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import ceilings, graph_time  # noqa: E402

from ops import linear as lin  # noqa: E402
from ops.fused import add_rms_norm, silu_mul  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, kv heads, head_dim, vocab
    "8b": (4096, 12288, 32, 8, 128, 151936),
    "2b": (2048, 6144, 16, 8, 128, 151936),
}


def cases(shape: str):
    """(name, prologue, N, K) of one layer's products and the LM head."""
    h, inter, heads, kv, d, vocab = SHAPES[shape]
    return [("qkv", lin._ADD_RMS_NORM, (heads + 2 * kv) * d, h), ("o", lin._PLAIN, h, heads * d),
            ("gate_up", lin._ADD_RMS_NORM, 2 * inter, h), ("down", lin._SILU_MUL, h, inter),
            ("lm_head", lin._PLAIN, vocab, h)]


def settings_grid(rows: int):
    if rows == 1:
        return [(bn, bk, w, s) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) for s in (2, 4)
                if bn * bk <= 16384]
    return [(bn, bk, 4, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for s in (3, 4, 5)]


def timed(fn, weights) -> float:
    """Median ms per call, the calls cycling through ``weights``."""
    it = iter(range(10**9))
    return graph_time(lambda: fn(weights[next(it) % len(weights)]), calls=len(weights) * 4)


def run_case(shape, name, prologue, n, k, rows):
    nbytes = n * k * 2
    copies = max(2, -(-160 * 2**20 // nbytes))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    width = 2 * k if prologue == lin._SILU_MUL else k
    x = torch.randn(rows, width, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    nw = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    if prologue == lin._ADD_RMS_NORM:
        def unfused(w):
            return F.linear(add_rms_norm(x, res, nw, 1e-6)[0], w)

        def fused(w, c):
            return lin._launch(prologue, x, w, c, residual=res, norm_weight=nw, eps=1e-6)[0]
    elif prologue == lin._SILU_MUL:
        def unfused(w):
            return F.linear(silu_mul(*x.chunk(2, dim=-1)), w)

        def fused(w, c):
            return lin._launch(prologue, x, w, c)[0]
    else:
        def unfused(w):
            return F.linear(x, w)

        def fused(w, c):
            return lin._launch(prologue, x, w, c)[0]
    ref = unfused(weights[0]).float()
    base = timed(unfused, weights)
    found = []
    for c in settings_grid(rows):
        if n % c[0]:
            continue
        try:
            err = (fused(weights[0], c).float() - ref).abs().max().item()
            if err > 2e-2 * ref.abs().max().item() + 1e-3:
                print(f"  {shape} {name} M={rows} {c}: WRONG (max err {err:.3g})", flush=True)
                continue
            found.append((timed(lambda w, c=c: fused(w, c), weights), c))
        except Exception as exc:  # a setting that does not compile (registers, shared memory)
            print(f"  {shape} {name} M={rows} {c}: failed {type(exc).__name__}", flush=True)
    found.sort()
    pick = lin.gemv_settings(rows, prologue, n, k)
    picked = next((ms for ms, c in found if c == pick), None)
    top = "  ".join(f"{c} {ms * 1e3:.1f}us" for ms, c in found[:3])
    best = f"{found[0][0] * 1e3:7.1f} us {nbytes / found[0][0] / 1e9:4.2f} TB/s" if found else "none"
    print(f"{shape} {name:8s} M={rows}: unfused {base * 1e3:7.1f} us {nbytes / base / 1e9:4.2f} TB/s | best {best} | "
          f"picked {pick} {picked * 1e3 if picked else float('nan'):.1f} us | top {top}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", default=["8b", "2b"])
    args = p.parse_args(argv)
    print(f"copy {ceilings()['copy_tb_s']:.2f} TB/s", flush=True)
    for shape in args.shapes:
        for name, prologue, n, k in cases(shape):
            for rows in args.rows:
                run_case(shape, name, prologue, n, k, rows)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
