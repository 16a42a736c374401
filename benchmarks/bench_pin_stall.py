"""How long pinning host memory on a background thread stalls the GPU work of the main thread (run by hand).

    python benchmarks/bench_pin_stall.py --out pin_stall.json          # the H200 (CUDA only)

The host tier (engine/cache/host_pool.py) pins its chunks lazily, one ahead of need, on a
background thread. The CUDA driver serialises pinning with other driver calls, so a chunk being
pinned can hold up the engine loop's kernel launches and copies even though the loop's thread
never pins. This script measures that, side by side in one run:

* the main thread runs "steps" like the engine loop's (``--matmuls`` bf16 matmuls of
  ``--dim`` squared, one 1 MiB pinned host -> GPU copy, a synchronize) and times each one;
* first with nothing else going on (the baseline), then while a background thread allocates
  ``--total-mib`` of host memory in chunks of each ``--chunk-mib`` size, by each method:

  - ``host_alloc``: ``torch.empty(pin_memory=True)`` (torch's pinned allocator,
    ``cudaHostAlloc``), what the tier does today;
  - ``register``: pageable ``torch.empty``, every page touched on the background thread
    (``fill_``: the page faults happen outside the driver), then ``cudaHostRegister``;
  - ``register_cold``: the same without touching the pages first (the driver faults them in).

Reported per method and chunk size: pin ms per chunk (median, max), and the steps that ran while
pinning went on: p50, p99 and max step ms, next to the baseline's p50 / p99 / max; ``stall_ms`` =
the longest step minus the baseline's p50, what one chunk costs the requests in flight.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import threading
import time

import torch


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Steps:
    """The main thread's stand-in for engine steps: kernels, a small H2D copy, a synchronize."""

    def __init__(self, dim: int, matmuls: int):
        self.a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
        self.src = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        self.matmuls = matmuls

    def one(self) -> float:
        t = time.perf_counter()
        x = self.a
        for _ in range(self.matmuls):
            x = x @ self.a
        self.dst.copy_(self.src, non_blocking=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def run_while(self, busy: threading.Event | None, n: int = 0) -> list[float]:
        """Steps until ``busy`` is cleared (or ``n`` steps with ``busy`` None)."""
        out = []
        while (busy.is_set() if busy is not None else len(out) < n):
            out.append(self.one())
        return out


def allocate(method: str, nbytes: int) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    if method == "host_alloc":
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if method == "register":
            buf.fill_(0)
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
    return buf, (time.perf_counter() - t) * 1e3


def release(method: str, bufs: list[torch.Tensor]) -> None:
    for b in bufs:
        if method != "host_alloc":
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    bufs.clear()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def one_case(steps: Steps, method: str, chunk_mib: int, total_mib: int) -> dict:
    bufs: list[torch.Tensor] = []
    pin_ms: list[float] = []
    busy = threading.Event()
    busy.set()
    errors: list[str] = []

    def background() -> None:
        try:
            for _ in range(max(1, total_mib // chunk_mib)):
                buf, ms = allocate(method, chunk_mib << 20)
                bufs.append(buf)
                pin_ms.append(ms)
        except Exception as exc:  # noqa: BLE001  (recorded)
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            busy.clear()

    thread = threading.Thread(target=background)
    thread.start()
    during = steps.run_while(busy)
    thread.join()
    torch.cuda.synchronize()
    release(method, bufs)
    return {"method": method, "chunk_mib": chunk_mib, "chunks": len(pin_ms), "error": errors[0] if errors else None,
            "pin_ms_median": statistics.median(pin_ms) if pin_ms else None, "pin_ms_max": max(pin_ms, default=None),
            "steps": len(during), "step_ms_p50": percentile(during, 50) if during else None,
            "step_ms_p99": percentile(during, 99) if during else None, "step_ms_max": max(during, default=None)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-mib", default="16,32,64,256")
    parser.add_argument("--methods", default="host_alloc,register,register_cold")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--matmuls", type=int, default=4)
    parser.add_argument("--out", default="pin_stall.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    steps = Steps(args.dim, args.matmuls)
    steps.run_while(None, 50)  # warm-up
    base = steps.run_while(None, 400)
    baseline = {"step_ms_p50": percentile(base, 50), "step_ms_p99": percentile(base, 99), "step_ms_max": max(base)}
    log(f"baseline: step p50 {baseline['step_ms_p50']:.3f} p99 {baseline['step_ms_p99']:.3f} "
        f"max {baseline['step_ms_max']:.3f} ms")
    cases = []
    for method in args.methods.split(","):
        for chunk in (int(c) for c in args.chunk_mib.split(",")):
            case = one_case(steps, method, chunk, args.total_mib)
            if case["step_ms_max"] is not None:
                case["stall_ms"] = case["step_ms_max"] - baseline["step_ms_p50"]
            cases.append(case)
            log(f"{method:14s} {chunk:4d} MiB x{case['chunks']}: pin {case['pin_ms_median']} ms/chunk; steps "
                f"p50 {case['step_ms_p50']} p99 {case['step_ms_p99']} max {case['step_ms_max']} "
                f"{case['error'] or ''}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
              "baseline": baseline, "cases": cases}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
