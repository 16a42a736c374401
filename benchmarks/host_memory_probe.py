"""What the host-memory tier's default is chosen from (issue 33): this host's memory as
``engine.cache.host_memory`` reads it, what pinning host memory costs per chunk size, and the
copy rates between pinned (and pageable) host memory and the GPU.

``python benchmarks/host_memory_probe.py [--chunks-gib 0.25,1,4] [--copy-gib 1] > out.json``

Prints one JSON object. Without CUDA only the memory readings are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _memory() -> dict:
    from engine.cache import host_memory

    gib = 2**30
    return {
        "mem_total_gib": host_memory.host_memory_bytes() / gib,
        "mem_available_gib": host_memory.available_bytes() / gib,
        "cgroup_limit_gib": (lambda v: None if v is None else v / gib)(host_memory.cgroup_limit_bytes()),
        "headroom_gib": host_memory.headroom_bytes(host_memory.host_memory_bytes()) / gib,
        "default_share": host_memory.DEFAULT_SHARE,
        "default_gib": host_memory.HostLedger().default_bytes() / gib,
        "cpus": os.cpu_count(),
    }


def _pin_costs(chunks_gib: list[float]) -> list[dict]:
    """Seconds to allocate (and first touch) one pinned chunk of each size, then free it."""
    import torch

    out = []
    for size in chunks_gib:
        n = int(size * 2**30)
        t0 = time.perf_counter()
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        t1 = time.perf_counter()
        buf.fill_(1)  # first touch: the pages are already resident once pinned; this says whether it costs more
        t2 = time.perf_counter()
        del buf
        torch.cuda.synchronize()
        out.append({"chunk_gib": size, "pin_s": t1 - t0, "touch_s": t2 - t1,
                    "pin_gib_per_s": size / (t1 - t0)})
    return out


def _copy_rates(gib: float, repeats: int = 5) -> dict:
    """GB/s (10^9 bytes per second) of host -> GPU and GPU -> host copies, best of ``repeats``."""
    import torch

    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = {}
    for kind, host in (("pinned", torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(n, dtype=torch.uint8))):
        host.fill_(1)
        for direction in ("h2d", "d2h"):
            best = float("inf")
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if direction == "h2d":
                    dev.copy_(host, non_blocking=kind == "pinned")
                else:
                    host.copy_(dev, non_blocking=kind == "pinned")
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            rates[f"{kind}_{direction}_gb_per_s"] = n / best / 1e9
    # one prefix of eight photos of the 8B shape in FP8 pages (~1.7k tokens, ~74 kB each) restored
    prefix = 125_000_000
    host, dev = torch.empty(prefix, dtype=torch.uint8, pin_memory=True), dev[:prefix]
    best = float("inf")
    for _ in range(2 * repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    rates["restore_125mb_ms"] = best * 1e3
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks-gib", default="0.25,1,4", help="pinned chunk sizes to time, GiB, comma separated")
    p.add_argument("--copy-gib", type=float, default=1.0, help="bytes per timed copy, GiB")
    args = p.parse_args()
    report = {"memory": _memory()}
    import torch

    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name()
        report["pin"] = _pin_costs([float(x) for x in args.chunks_gib.split(",")])
        report["copy"] = _copy_rates(args.copy_gib)
        report["memory_after"] = _memory()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
