"""The transport between the app and the engine core process: 32 streams' tokens, one round trip
per engine step, over multiprocessing's Pipe with pickle (what ``engine.client`` uses) and over
ZeroMQ with msgspec (pyzmq and msgspec, when installed).

Each step the parent sends a small command (as a cancel or submit would be) and the child answers
with one message holding every stream's token: ``(request id, text delta)`` pairs, as
``engine.client`` batches a step's outputs. Reported: the median and p99 round trip per step, in
microseconds, and the same with one message per token (no batching). No engine runs: this is the
transport alone, whose cost is added to every decode step.

    python benchmarks/bench_core_channel.py [--streams 32] [--steps 3000]

With ``--checkpoint FOLDER`` it also runs the engine itself, in this process
(``InProcessClient``) and in a child (``ProcessClient``): ``--streams`` concurrent greedy text
streams of ``--tokens`` tokens each, every stream read by a thread of its own as the app reads
them; reported: the median TPOT (the engine's telemetry) and the tokens per second all streams
together, as the callers received them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import time

DELTA = " word"  # a typical one-token text delta


def _pipe_child(conn, streams: int, batched: bool) -> None:
    while True:
        command = conn.recv()
        if command is None:
            return
        tokens = [(rid, DELTA) for rid in range(streams)]
        if batched:
            conn.send(("out", tokens))
        else:
            for token in tokens:
                conn.send(("out", [token]))


def _zmq_child(address: str, streams: int, batched: bool) -> None:
    import msgspec
    import zmq

    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    socket = zmq.Context().socket(zmq.PAIR)
    socket.connect(address)
    while True:
        command = decode(socket.recv())
        if command is None:
            return
        tokens = [(rid, DELTA) for rid in range(streams)]
        if batched:
            socket.send(encode(("out", tokens)))
        else:
            for token in tokens:
                socket.send(encode(("out", [token])))


def _summary(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples) * 1e6, samples[int(0.99 * (len(samples) - 1))] * 1e6


def bench_pipe(streams: int, steps: int, batched: bool) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_pipe_child, args=(child, streams, batched))
    process.start()
    child.close()
    times = []
    command = ("cancel", 1, 7, False)
    for _ in range(steps):
        start = time.perf_counter()
        parent.send(command)
        got = 0
        while got < streams:
            got += len(parent.recv()[1])
        times.append(time.perf_counter() - start)
    parent.send(None)
    process.join()
    return _summary(times)


def bench_zmq(streams: int, steps: int, batched: bool) -> tuple[float, float]:
    import tempfile

    import msgspec
    import zmq

    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    address = f"ipc://{tempfile.mkdtemp()}/core"
    socket = zmq.Context().socket(zmq.PAIR)
    socket.bind(address)
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_zmq_child, args=(address, streams, batched))
    process.start()
    times = []
    command = ("cancel", 1, 7, False)
    for _ in range(steps):
        start = time.perf_counter()
        socket.send(encode(command))
        got = 0
        while got < streams:
            got += len(decode(socket.recv())[1])
        times.append(time.perf_counter() - start)
    socket.send(encode(None))
    process.join()
    return _summary(times)


def bench_engine(client, streams: int, tokens: int) -> tuple[float, float]:
    """(median TPOT in ms, tokens per second received) for ``streams`` concurrent streams."""
    import threading

    from engine import Completion, SamplingParams

    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    client.generate([{"role": "user", "content": "warm up"}], SamplingParams(max_tokens=4))
    done: list[Completion] = []

    def one(n: int) -> None:
        for item in client.stream([{"role": "user", "content": f"Story number {n}, please."}], sampling):
            if isinstance(item, Completion):
                done.append(item)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    received = sum(len(c.token_ids) for c in done)
    return statistics.median(c.telemetry.tpot_ms for c in done), received / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkpoint", default=None, help="also run this checkpoint's engine both ways (CPU)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    size = len(pickle.dumps(("out", [(rid, DELTA) for rid in range(args.streams)])))
    print(f"{args.streams} streams, {args.steps} steps; a step's batch pickles to {size} bytes")
    print("| transport | batching | median us/step | p99 us/step |")
    print("|---|---|---|---|")
    runs = [("Pipe + pickle", bench_pipe)]
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401

        runs.append(("ZeroMQ PAIR ipc + msgspec", bench_zmq))
    except ImportError:
        print("(pyzmq or msgspec not installed: ZeroMQ not measured)")
    for name, bench in runs:
        for batched in (True, False):
            median, p99 = bench(args.streams, args.steps, batched)
            print(f"| {name} | {'one message per step' if batched else 'one message per token'} "
                  f"| {median:.0f} | {p99:.0f} |")
    if args.checkpoint:
        from engine.client import InProcessClient, ProcessClient

        options = dict(device="cpu", progress=False, kv_cache_bytes=64 << 20)
        print(f"\n{args.streams} concurrent streams of {args.tokens} tokens, {args.checkpoint}")
        print("| engine | median TPOT ms | tokens/s received |")
        print("|---|---|---|")
        for name, make in (("in_process", InProcessClient.from_pretrained), ("process", ProcessClient)):
            with make(args.checkpoint, **options) as client:
                tpot, rate = bench_engine(client, args.streams, args.tokens)
            print(f"| {name} | {tpot:.1f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
