"""Engine replicas on Ray Serve, measured on the CPU: session affinity against round-robin, and
what the Ray hop adds to a prefix hit's TTFT.

1. **Hit rate.** ``--sessions`` chat sessions, one photo each (noise images), each asks
   ``--rounds`` questions; every round asks each session once, in a fresh random order. Two
   routings over the same N replicas (N = each of ``--replicas``): *affinity*
   (``ReplicaClient``'s own: consistent hashing with bounded loads on the salt) and
   *round-robin* (each request to the next replica in turn, as a balancer without affinity does).
   Reported: the share of the questions after a session's first that hit the prefix cache, read
   from each answer's telemetry (``prefix_cache == "hit"``).
2. **TTFT on a hit.** ``--ttft-sessions`` sessions ask a first question (a miss) and then a
   second (a hit: the photo's prefix is cached); the second's TTFT, as the caller sees it (from
   the ``submit`` call to the first text delta), over the replicas of the smallest N (Ray) against
   an engine in this process (``InProcessClient``) and the engine core in a child process
   (``ProcessClient``, the app's default), all with one torch thread (what Ray gives a replica of
   less than one CPU). The three are alive at once and measured side by side: each session's
   questions go to the three in turn (the order rotating from one session to the next), so a
   burst of other work on a shared machine falls on all three alike (the in-process engine then
   shares the host with Ray's idle processes: ~10 % of a core on the 2-core box). Reported:
   medians and p90 in milliseconds, the engine's own TTFT (telemetry) beside them.

    python benchmarks/bench_replicas.py [--checkpoint FOLDER] [--replicas 2 4] [--json out.json]

Without ``--checkpoint`` the tiny "test" checkpoint is built in a temporary folder. Ray runs
locally (loopback, no dashboard), with ``--replica-cpus`` each (0.5: four replicas on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PRISM_HOST_CACHE_BYTES", "0")
os.environ["OMP_NUM_THREADS"] = "1"  # the engines of this process and its children: one thread, as a replica

QUESTIONS = ["What is in the picture?", "Which colours do you see?", "Is there any text?", "Describe the corners."]


def noise_png(seed: int, size=(96, 72)) -> bytes:
    """A random-noise PNG (every session's own photo)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class _RoundRobin:
    """Wraps a ReplicaClient's routing: every request to the next replica in turn, whatever its
    salt (the balancer without affinity the hit rate is compared with)."""

    def __init__(self, client):
        self.client, self.turn = client, itertools.count()
        self.real = client._route

    def __enter__(self):
        names = list(self.client._replicas)
        self.client._route = lambda *a, **k: self.client._replicas[names[next(self.turn) % len(names)]]
        return self

    def __exit__(self, *exc):
        self.client._route = self.real


def hit_rate(client, *, sessions: int, rounds: int, seed: int, tag: str) -> dict:
    """Ask every session ``rounds`` questions (a round: each session once, shuffled); the share of
    questions after each session's first that hit, and the per-replica placement."""
    from engine import SamplingParams, media_first_messages

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    rng = random.Random(seed)
    photos = {f"{tag}-{i}": noise_png(seed * 1000 + i) for i in range(sessions)}
    later, hits = 0, 0
    for r in range(rounds):
        order = list(photos)
        rng.shuffle(order)
        for salt in order:
            messages = media_first_messages([photos[salt]], QUESTIONS[r % len(QUESTIONS)])
            done = client.generate(messages, greedy, cache_salt=salt)
            if r > 0:
                later += 1
                hits += done.telemetry.prefix_cache == "hit"
    return {"sessions": sessions, "rounds": rounds, "later_questions": later, "hits": hits,
            "hit_rate": hits / later if later else 0.0}


def hit_ttft(clients: dict, *, sessions: int, seed: int) -> dict:
    """The second question's (a hit's) TTFT on each of ``clients`` (name: client), side by side:
    from ``submit`` to the first delta, and the engine's own."""
    from engine import Completion, SamplingParams, media_first_messages

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    names = list(clients)
    seen = {n: [] for n in names}
    engine_ms = {n: [] for n in names}
    results = {n: [] for n in names}
    for i in range(sessions):
        photo = noise_png(seed * 1000 + i)
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:  # the misses first, so that each hit follows the others' alike
            clients[name].generate(media_first_messages([photo], QUESTIONS[0]), greedy, cache_salt=f"{name}-{i}")
        for name in order:
            started = time.perf_counter()
            handle = clients[name].submit(media_first_messages([photo], QUESTIONS[1]), greedy, cache_salt=f"{name}-{i}")
            first = None
            for item in handle:
                if first is None:
                    first = time.perf_counter()
                if isinstance(item, Completion):
                    results[name].append(item.telemetry.prefix_cache)
                    engine_ms[name].append(item.telemetry.ttft_ms)
            seen[name].append((first - started) * 1e3)
    return {n: {"hits": results[n].count("hit"), "of": len(results[n]), **_summary("caller_ms", seen[n]),
                **_summary("engine_ms", engine_ms[n])} for n in names}


def _summary(name: str, values: list[float]) -> dict:
    ordered = sorted(values)
    return {f"{name}_median": round(statistics.median(ordered), 2),
            f"{name}_p90": round(ordered[int(0.9 * (len(ordered) - 1))], 2)}


def side_by_side(replicas, folder, options: dict, *, sessions: int, seed: int) -> dict:
    """:func:`hit_ttft` over ``replicas``, an in-process engine and a child-process core, alive at once."""
    import torch

    from engine.client import InProcessClient, ProcessClient

    torch.set_num_threads(1)
    local = InProcessClient.from_pretrained(folder, **options)
    child = ProcessClient(folder, **options)
    try:
        return hit_ttft({"ray_replica": replicas, "in_process": local, "process": child}, sessions=sessions,
                        seed=seed)
    finally:
        child.close()
        local.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttft-sessions", type=int, default=20)
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from engine.replicas import ReplicaClient

    folder = args.checkpoint
    if folder is None:
        from engine.tiny import build_tiny_checkpoint

        folder = build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="prism-bench-")), "test", seed=0)
    options = dict(device="cpu", progress=False, kv_cache_bytes=64 << 20)
    out = {"checkpoint": str(folder), "replica_cpus": args.replica_cpus, "hit_rate": [], "ttft": {}}
    for n in args.replicas:
        started = time.perf_counter()
        client = ReplicaClient(folder, replicas=n, replica_cpus=args.replica_cpus, num_cpus=os.cpu_count(), **options)
        print(f"N={n}: {n} replicas ready in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            affinity = hit_rate(client, sessions=args.sessions, rounds=args.rounds, seed=args.seed, tag=f"a{n}")
            with _RoundRobin(client):
                robin = hit_rate(client, sessions=args.sessions, rounds=args.rounds, seed=args.seed + 1, tag=f"r{n}")
            placed = {r["id"]: r["sessions"] for r in client.replica_status()}
            out["hit_rate"].append({"replicas": n, "affinity": affinity, "round_robin": robin,
                                    "sessions_per_replica": placed})
            print(f"N={n}: hit rate affinity {affinity['hit_rate']:.1%} ({affinity['hits']}/"
                  f"{affinity['later_questions']}), round-robin {robin['hit_rate']:.1%} ({robin['hits']}/"
                  f"{robin['later_questions']}); sessions per replica {placed}", flush=True)
            if n == min(args.replicas):
                out["ttft"] = side_by_side(client, folder, options, sessions=args.ttft_sessions, seed=args.seed + 7)
        finally:
            client.close()
    base = out["ttft"]["in_process"]["caller_ms_median"]
    for name, row in out["ttft"].items():
        row["vs_in_process"] = round(row["caller_ms_median"] / base, 3)
        print(f"hit TTFT {name}: caller median {row['caller_ms_median']} ms (p90 {row['caller_ms_p90']}), "
              f"engine median {row['engine_ms_median']} ms; {row['vs_in_process']:.2f}x in-process; "
              f"{row['hits']}/{row['of']} hits", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
