"""Host-tier KV copies against the bus's floor: Offload and Restore of a prefix (run by hand).

    python benchmarks/bench_host_copy.py --out host_copy.json                 # H200: 8B shape, 103 pages
    python benchmarks/bench_host_copy.py --device cpu --pages 8 --shape 2b    # the script itself, on the CPU

In one run, for the same bytes (``--pages`` pages of the ``--shape`` model's KV: its layers, KV
heads and head dim, ``--page-size`` tokens a page, FP8 with float32 scales by default):

* the floor: one plain contiguous copy pinned host -> GPU (and GPU -> host) of that many bytes,
  the best the bus does;
* Offload (GPU -> host) and Restore (host -> GPU) of those pages through
  :class:`engine.cache.kv_transfer.KVTransfers`, for each staging size (``--staging-mib``, default
  16, 64 and 256 MiB): the pages scattered over a pool of ``--pool-pages`` pages and the host pages
  over several host chunks: contiguous (``0 .. n - 1``, what a fresh tier's allocation gives) and
  scattered (a sorted random half of a tier of ``2 x --pages``: many short runs, a tier after
  churn).

Each figure is the median of ``--repeats`` timed copies after one warm-up, from the copy's own
CUDA events (``TransferDone.ms``) or ``perf_counter`` on the CPU. Reported: milliseconds, GB/s
(10^9 bytes a second), restore / floor and offload / floor as ratios of the matching direction's
floor bandwidth; each restore is also checked bit-exact against the pages offloaded. On the CPU
there is no staging buffer: ``staging_mib`` null.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import SHAPES  # noqa: E402
from engine.cache.host_pool import HostPool  # noqa: E402
from engine.cache.kv_pool import PagePool  # noqa: E402
from engine.cache.kv_transfer import KVTransfers, Offload, Restore, bits  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6) if ms > 0 else float("inf")


def timed_copy(dst: torch.Tensor, src: torch.Tensor, cuda: bool) -> float:
    """One ``dst.copy_(src)`` in ms (CUDA events around it on CUDA)."""
    if not cuda:
        t = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def floor(nbytes: int, device: torch.device, repeats: int) -> dict:
    """The plain contiguous copy of ``nbytes``, pinned host <-> device: median ms each way."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        timed_copy(dst, src, cuda)  # warm-up
        ms = statistics.median(timed_copy(dst, src, cuda) for _ in range(repeats))
        out[name] = {"ms": ms, "gbps": gbps(nbytes, ms)}
    return out


def random_bits(pool: PagePool, seed: int) -> None:
    gen = torch.Generator(device=pool.buffers()[0].device).manual_seed(seed)
    for b in pool.buffers():
        if b is not None:
            view = bits(b)
            view.copy_(torch.randint(-128, 127, view.shape, generator=gen, device=view.device).to(view.dtype))


def one(transfers: KVTransfers, order) -> float:
    transfers.submit(order)
    transfers.synchronize()
    (done,) = transfers.poll()
    if done.error:
        raise RuntimeError(f"{done.kind} failed: {done.error}")
    return done.ms


def bench_transfers(pool: PagePool, host: HostPool, staging_bytes: int | None, layout: str, args, seed: int) -> dict:
    """Median Offload / Restore ms of ``args.pages`` scattered pool pages through one executor, to
    host pages ``0 .. n - 1`` (``layout="contiguous"``, what one :meth:`HostPool.allocate` of a
    fresh tier gives) or a sorted random half of the tier (``"scattered"``: many short runs)."""
    n = args.pages
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pool.num_pages, generator=gen).tolist()
    src, dst = tuple(perm[:n]), tuple(perm[n:2 * n])  # distinct pages: the restore lands elsewhere
    hperm = torch.randperm(host.num_pages, generator=gen).tolist()
    host_pages = tuple(range(n)) if layout == "contiguous" else tuple(sorted(hperm[:n]))
    transfers = KVTransfers(pool, host, **({} if staging_bytes is None else {"staging_bytes": staging_bytes}))
    try:
        offload = [one(transfers, Offload(i, src, host_pages)) for i in range(args.repeats + 1)][1:]
        restore = [one(transfers, Restore(i, host_pages, dst)) for i in range(args.repeats + 1)][1:]
        rows_src, rows_dst = pool.rows(list(src)), pool.rows(list(dst))
        exact = all(torch.equal(bits(b).index_select(0, rows_src), bits(b).index_select(0, rows_dst))
                    for b in pool.buffers() if b is not None)
        staged = transfers.staging_pages
    finally:
        transfers.close()
    nbytes = n * pool.page_bytes
    return {
        "staging_mib": None if staging_bytes is None else staging_bytes >> 20,
        "host_pages": layout,
        "host_runs": len(host.runs(host_pages)),
        "staging_pages": staged,
        "offload": {"ms": statistics.median(offload), "gbps": gbps(nbytes, statistics.median(offload))},
        "restore": {"ms": statistics.median(restore), "gbps": gbps(nbytes, statistics.median(restore))},
        "bit_exact": exact,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (default 8b)")
    parser.add_argument("--pages", type=int, default=103, help="pages a transfer moves (default 103)")
    parser.add_argument("--pool-pages", type=int, help="GPU pool pages (default 4 x --pages)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens a page (default 16)")
    parser.add_argument("--kv-cache-dtype", choices=("fp8_e4m3", "auto"), default="fp8_e4m3")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="model dtype (for auto)")
    parser.add_argument("--staging-mib", default="16,64,256", help="staging sizes, comma-separated (CUDA)")
    parser.add_argument("--repeats", type=int, default=10, help="timed copies per figure; medians (default 10)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.pages < 1 or args.repeats < 1:
        parser.error("--pages and --repeats must be >= 1")
    pool_pages = args.pool_pages or 4 * args.pages
    if pool_pages < 2 * args.pages:
        parser.error("--pool-pages must be at least 2 x --pages (the restore lands on other pages)")
    device = torch.device(args.device)
    text = SHAPES[args.shape]["text"]
    pool = PagePool(num_layers=text["num_hidden_layers"], num_kv_heads=text["num_key_value_heads"],
                    head_dim=text["head_dim"], num_pages=pool_pages, page_size=args.page_size,
                    kv_cache_dtype=args.kv_cache_dtype, model_dtype=_DTYPES[args.dtype], device=device)
    random_bits(pool, seed=0)
    nbytes = args.pages * pool.page_bytes
    host = HostPool(pool, 2 * args.pages, chunk_pages=max(1, args.pages // 3))
    host.allocate(host.num_pages)
    log(f"{args.shape}: {pool.num_layers} layers, page {pool.page_bytes} B, {args.pages} pages = "
        f"{nbytes / 1e6:.1f} MB, {args.kv_cache_dtype}, {device}")
    base = floor(nbytes, device, args.repeats)
    log(f"floor: h2d {base['h2d']['gbps']:.2f} GB/s, d2h {base['d2h']['gbps']:.2f} GB/s")
    stagings = [int(s) << 20 for s in args.staging_mib.split(",") if s.strip()] if device.type == "cuda" else [None]
    rows = []
    for i, (staging, layout) in enumerate((s, h) for s in stagings for h in ("contiguous", "scattered")):
        row = bench_transfers(pool, host, staging, layout, args, seed=i + 1)
        row["restore_vs_floor"] = row["restore"]["gbps"] / base["h2d"]["gbps"]
        row["offload_vs_floor"] = row["offload"]["gbps"] / base["d2h"]["gbps"]
        rows.append(row)
        log(f"staging {row['staging_mib']} MiB, {layout} host pages ({row['host_runs']} runs): "
            f"offload {row['offload']['gbps']:.2f} GB/s "
            f"({row['offload_vs_floor']:.2f} x floor), restore {row['restore']['gbps']:.2f} GB/s "
            f"({row['restore_vs_floor']:.2f} x floor), bit-exact {row['bit_exact']}")
    host.close()
    result = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "kv_cache_dtype": args.kv_cache_dtype, "page_size": args.page_size,
        "page_bytes": pool.page_bytes, "pages": args.pages, "pool_pages": pool_pages, "bytes": nbytes,
        "repeats": args.repeats, "floor": base, "rows": rows,
    }
    text_out = json.dumps(result, indent=2)
    print(text_out)
    if args.out:
        pathlib.Path(args.out).write_text(text_out + "\n")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
