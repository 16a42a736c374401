"""Streaming through ``/v1`` over HTTP vs the engine API in-process, side by side in one run.

Run by hand (not a test)::

    python benchmarks/bench_http.py --quick --repeats 3 --out docs/cpu/bench_http_v1.json   # CPU, tiny demo
    python benchmarks/bench_http.py --device cuda --shape 8b --out bench_http_8b.json   # H200, 8B shape
    python benchmarks/bench_http.py --device cuda --shape 8b --engine in_process process   # both cores

Two phases on the same machine, one after the other (never both loaded at once, so each has the
whole device): first the engine API in this process (:meth:`engine.Engine.submit`, each stream read
with ``async for`` over its :class:`~engine.RequestHandle` on one event loop), then the same
requests through a server started as a subprocess, ``python launch.py --ui off``, read by an httpx
client streaming server-sent events from this process. ``--engine`` is passed through to
``launch.py`` when given (the option exists once the engine-client work of issue 32.4 has landed);
given several values (``--engine in_process process``), the HTTP phase runs once per value, in the
same run, so the two cores are compared on the same machine and load. Both build the engine from the
same checkpoint folder with the same options (:meth:`app.settings.Settings.engine_options` of the
same arguments).

At each concurrency level (1, 8 and 32 streams by default) every round starts all its streams at
once; each asks about the same image (a prefix cached by a warm-up request: every measured request
is a prefix **hit**, its telemetry says so) with a question of its own, greedy, ``--max-tokens``.
Per request, timed by the client: **TTFT**, from sending the request to its first text delta (the
hit's time to first token), and **TPOT**, from the first delta to the last over the tokens
generated after the first (the completion's own count). Reported per level: the p50 of each over
every request of every round (of every ``--repeats``: the two phases alternate that many times),
for both paths, and their ratios HTTP / engine API (issue 32.5's goal: within 1.10 at 32 streams).
The JSON also holds the engines' own telemetry p50s, the token counts and each repeat's own
summary (``runs``).

``--shape 8b`` writes a random-weight checkpoint at Qwen3-VL-8B's shapes (:mod:`benchmarks.shapes`)
once under ``--workdir`` (16 GB, bfloat16); ``--model demo`` (the default) builds the tiny demo
checkpoint.

Wheels it needs besides the engine's own (torch, transformers, tokenizers, safetensors,
huggingface_hub, jinja2, tqdm, pillow; the H200 image has those, but maybe not the web stack):
``fastapi`` (with ``starlette``, ``pydantic``, ``pydantic-core``, ``annotated-types``,
``annotated-doc``, ``typing-inspection``, ``anyio``, ``sniffio``, ``idna``), ``uvicorn`` (with
``h11``, ``click``), ``httpx`` (with ``httpcore``, ``certifi``), ``python-multipart``,
``prometheus-client``, ``sqlite-utils`` (with ``sqlite-fts4``, ``tabulate``,
``click-default-group``, ``pluggy``, ``python-dateutil``, ``six``: the server's session store) and
``platformdirs``; for ``--model demo`` and ``--shape``, ``dashscope``'s tokenizer ranks
(:mod:`engine.tiny`). Not needed: Gradio (the server runs with ``--ui off``), ``markdown-it-py``
(the chat pages only) and ``av`` (video only).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pathlib
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMAGE = ROOT / "tests" / "media" / "astronaut.png"
LEVELS = (1, 8, 32)
CACHE_KEY = "bench-http"  # the HTTP side's prompt_cache_key: every request shares one salt, so hits


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------


def engine_messages(image: bytes, question: str) -> list[dict]:
    from engine import media_first_messages

    return media_first_messages([image], question)


def openai_messages(messages: list[dict]) -> list[dict]:
    """The same messages in OpenAI's shape (the server converts them back part for part)."""
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, list):
            content = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                       {"type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(p["image"]).decode()}}
                       for p in content]
        out.append({"role": msg["role"], "content": content})
    return out


def question(round_: int, stream: int) -> str:
    """A question of its own per request: after the shared image prefix, nothing else is reused."""
    return f"Question {round_}.{stream}: what is in this picture, and what colours stand out?"


# ------------------------------------------------------------------------------------------------
# the two clients
# ------------------------------------------------------------------------------------------------


async def engine_request(engine, image: bytes, text: str, max_tokens: int) -> dict:
    """One request through the engine API, timed as a library user sees it."""
    from engine import Completion, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    sent = time.perf_counter()
    handle = await asyncio.to_thread(engine.submit, engine_messages(image, text), sampling, cache_salt=CACHE_KEY)
    first = last = None
    async for item in handle:
        if isinstance(item, Completion):
            return _record(sent, first, last, item.telemetry.generated_tokens, item.telemetry.to_dict())
        if item:
            last = time.perf_counter()
            first = first or last
    raise RuntimeError("no completion")  # pragma: no cover


async def stream_chat(client, body: dict, on_first=None) -> tuple[float, list[float], dict]:
    """POST ``body`` (with ``"stream": true``) to ``/v1/chat/completions`` and read its events:
    ``(sent, deltas, telemetry)``, the ``perf_counter`` seconds it was sent, of each text delta,
    and the final event's Prism telemetry. ``on_first()`` is called at the first text delta.

    Raises:
        RuntimeError: a status other than 200, an error event, or no ``finish_reason``.
    """
    sent = time.perf_counter()
    deltas: list[float] = []
    telemetry = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            choice = event["choices"][0]
            if choice["delta"].get("content"):
                deltas.append(time.perf_counter())
                if len(deltas) == 1 and on_first is not None:
                    on_first()
            if choice.get("finish_reason"):
                telemetry = event["prism"]["telemetry"]
    if telemetry is None:
        raise RuntimeError("the stream ended without a finish_reason")
    return sent, deltas, telemetry


async def http_request(client, image: bytes, text: str, max_tokens: int) -> dict:
    """One streaming request through ``/v1/chat/completions``, timed by the HTTP client."""
    body = {"messages": openai_messages(engine_messages(image, text)), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "prompt_cache_key": CACHE_KEY}
    sent, deltas, telemetry = await stream_chat(client, body)
    first, last = (deltas[0], deltas[-1]) if deltas else (None, None)
    return _record(sent, first, last, telemetry["generated_tokens"], telemetry)


def _record(sent: float, first: float | None, last: float | None, generated: int, telemetry: dict) -> dict:
    tpot = (last - first) / (generated - 1) if first is not None and generated > 1 else None
    return {"ttft_ms": (first - sent) * 1e3 if first is not None else None,
            "tpot_ms": tpot * 1e3 if tpot is not None else None, "generated": generated,
            "prefix_cache": telemetry.get("prefix_cache"), "engine_ttft_ms": telemetry.get("ttft_ms"),
            "engine_tpot_ms": telemetry.get("tpot_ms")}


async def run_levels(send, image: bytes, levels, rounds: int, max_tokens: int) -> dict:
    """``send(image, text, max_tokens)`` for every level: a warm-up miss caches the prefix, a warm
    hit runs the hit path once, then ``rounds`` rounds of ``n`` concurrent streams per level.
    Returns each level's per-request records."""
    from concurrent.futures import ThreadPoolExecutor

    # submissions (prompt building) run in worker threads, as the server's run_in_threadpool does
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=max(levels) + 4))
    await send(image, "Warm-up: describe the picture.", max_tokens)
    await send(image, "Warm-up again: describe the picture.", max_tokens)
    out = {}
    for n in levels:
        records = []
        for r in range(rounds):
            records += await asyncio.gather(*(send(image, question(r, i), max_tokens) for i in range(n)))
        out[str(n)] = records
        summary = summarise(records)
        print(f"  {n:>3} streams: TTFT p50 {summary['ttft_ms_p50']:.1f} ms, "
              f"TPOT p50 {summary['tpot_ms_p50']:.2f} ms ({len(records)} requests)", flush=True)
    return out


def summarise(records: list[dict]) -> dict:
    def p50(key):
        values = [r[key] for r in records if r[key] is not None]
        return statistics.median(values) if values else None

    return {"requests": len(records), "hits": sum(r["prefix_cache"] == "hit" for r in records),
            "ttft_ms_p50": p50("ttft_ms"), "tpot_ms_p50": p50("tpot_ms"),
            "engine_ttft_ms_p50": p50("engine_ttft_ms"), "engine_tpot_ms_p50": p50("engine_tpot_ms"),
            "generated_p50": p50("generated")}


# ------------------------------------------------------------------------------------------------
# the two phases
# ------------------------------------------------------------------------------------------------


def engine_phase(folder: pathlib.Path, settings, image: bytes, args) -> dict:
    from engine import Engine

    print("engine API, in-process:", flush=True)
    with Engine.from_pretrained(folder, device=settings.device, progress=False, **settings.engine_options()) as engine:
        async def send(image, text, max_tokens):
            return await engine_request(engine, image, text, max_tokens)

        return asyncio.run(run_levels(send, image, args.levels, args.rounds, args.max_tokens))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_phase(server_argv: list[str], data_dir: pathlib.Path, image: bytes, args) -> dict:
    import httpx

    port = free_port()
    argv = [sys.executable, str(ROOT / "launch.py"), *server_argv, "--port", str(port), "--data-dir", str(data_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_")}  # only what we pass
    print(f"/v1 over HTTP: {' '.join(argv[1:])}", flush=True)
    log = open(data_dir / "server.log", "w")  # noqa: SIM115 - closed after the server below
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base, data_dir / "server.log", args.load_timeout_s)

        async def main():
            limits = httpx.Limits(max_connections=max(args.levels) + 4, max_keepalive_connections=max(args.levels) + 4)
            async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0), limits=limits) as client:
                async def send(image, text, max_tokens):
                    return await http_request(client, image, text, max_tokens)

                return await run_levels(send, image, args.levels, args.rounds, args.max_tokens)

        return asyncio.run(main())
    finally:
        server.send_signal(signal.SIGINT)  # a clean stop: answers cancelled, the store closed
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def wait_healthy(server: subprocess.Popen, base: str, log: pathlib.Path, timeout_s: float) -> None:
    """Return once ``/healthz`` answers 200 (the model is loaded), else raise with the log's tail."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # a model load takes seconds to minutes: checking twice a second is plenty
    raise RuntimeError(f"the server was not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


# ------------------------------------------------------------------------------------------------
# checkpoints, report
# ------------------------------------------------------------------------------------------------


def checkpoint(args, workdir: pathlib.Path) -> pathlib.Path:
    """The checkpoint folder both phases load."""
    if args.shape:
        return shape_checkpoint(args.shape, workdir, args.device)
    if args.model == "demo":
        from engine.model.tiny import build_tiny_checkpoint

        return build_tiny_checkpoint(workdir / "tiny-demo", "demo", seed=0)
    from engine.model.hub import resolve_checkpoint

    return pathlib.Path(resolve_checkpoint(args.model))


def shape_checkpoint(shape: str, workdir: pathlib.Path, device: str) -> pathlib.Path:
    """A random-weight checkpoint at ``shape`` written once under ``workdir`` (bfloat16): the
    weights of :func:`benchmarks.shapes.random_model`, drawn on ``device``, named as a checkpoint."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import shapes

    from engine.model.qwen3_vl import _checkpoint_name

    folder = shapes.make_folder(shape, workdir)
    weights = folder / "model.safetensors"
    if not weights.exists():
        print(f"writing random {shape} weights to {weights} (once) ...", flush=True)
        dev = torch.device("cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        model = shapes.random_model(folder, dev, torch.bfloat16)
        tensors = {_checkpoint_name(name, False): p.detach().to("cpu").contiguous()
                   for name, p in model.named_parameters()}
        del model
        save_file(tensors, str(weights), metadata={"format": "pt"})
        del tensors
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return folder


def ratio(a, b):
    return a / b if a is not None and b else None


def report(engine: dict, http: dict, levels) -> tuple[dict, str]:
    """Ratios HTTP / engine API per server ``--engine`` and level, and the markdown table.
    ``http``: ``{engine label: {level: summary}}``."""
    ratios, lines = {}, ["| streams | server | TPOT p50 engine API | TPOT p50 /v1 HTTP | HTTP / API "
                         "| hit TTFT p50 engine API | hit TTFT p50 /v1 HTTP | HTTP / API |",
                         "|---|---|---|---|---|---|---|---|"]
    for label, levels_of in http.items():
        ratios[label] = {}
        for n in map(str, levels):
            e, h = engine[n], levels_of[n]
            row = ratios[label][n] = {"tpot_ratio": ratio(h["tpot_ms_p50"], e["tpot_ms_p50"]),
                                      "ttft_ratio": ratio(h["ttft_ms_p50"], e["ttft_ms_p50"])}
            lines.append(f"| {n} | {label} | {e['tpot_ms_p50']:.2f} ms | {h['tpot_ms_p50']:.2f} ms "
                         f"| {row['tpot_ratio']:.2f}x | {e['ttft_ms_p50']:.1f} ms | {h['ttft_ms_p50']:.1f} ms "
                         f"| {row['ttft_ratio']:.2f}x |")
    return ratios, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="demo", help="checkpoint folder or Hub id; 'demo': the tiny demo model")
    p.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes instead")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--engine", nargs="+", metavar="VALUE",
                   help="launch.py's --engine for the server (in_process, process), once the option exists; "
                        "several values: one HTTP phase for each, in the same run (default: launch.py's default)")
    p.add_argument("--kv-cache-bytes", help="passed to both engines (launch.py's --kv-cache-bytes)")
    p.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrent streams")
    p.add_argument("--rounds", type=int, default=5, help="rounds per level (each starts all its streams at once)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the pair of phases this many times, alternating (engine API, HTTP, engine API, ...): "
                        "on a shared machine the load drifts between phases; the p50s pool every repeat")
    p.add_argument("--quick", action="store_true", help="2 rounds of 24 tokens (the CPU record)")
    p.add_argument("--workdir", type=pathlib.Path, help="where checkpoints and the server's data dir go")
    p.add_argument("--load-timeout-s", type=float, default=1800.0)
    p.add_argument("--out", type=pathlib.Path, help="write the results here as JSON (and a .md table beside it)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens = 2, 24

    from app.settings import parse_settings

    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="prism-bench-http-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder = checkpoint(args, workdir)
    server_argv = ["--ui", "off", "--model", str(folder), "--device", args.device]
    if args.kv_cache_bytes:
        server_argv += ["--kv-cache-bytes", args.kv_cache_bytes]
    settings = parse_settings(server_argv, {})  # the server's own options, for the in-process engine too
    servers = {value or "default": server_argv + (["--engine", value] if value else [])
               for value in args.engine or [None]}
    image = IMAGE.read_bytes()
    data_dir = workdir / "server-data"
    data_dir.mkdir(exist_ok=True)

    def summaries(records_of: dict) -> dict:
        return {n: summarise(records) for n, records in records_of.items()}

    pooled_engine = {str(n): [] for n in args.levels}
    pooled_http = {label: {str(n): [] for n in args.levels} for label in servers}
    runs = []
    for k in range(args.repeats):
        print(f"repeat {k + 1} of {args.repeats}", flush=True)
        engine_run = engine_phase(folder, settings, image, args)
        http_run = {label: http_phase(argv, data_dir, image, args) for label, argv in servers.items()}
        for n, records in engine_run.items():
            pooled_engine[n] += records
        for label, levels_of in http_run.items():
            for n, records in levels_of.items():
                pooled_http[label][n] += records
        engine_summary = summaries(engine_run)
        http_summary = {label: summaries(levels_of) for label, levels_of in http_run.items()}
        runs.append({"engine_api": engine_summary, "http": http_summary,
                     "ratios_http_over_engine_api": report(engine_summary, http_summary, args.levels)[0]})
    engine = summaries(pooled_engine)
    http = {label: summaries(levels_of) for label, levels_of in pooled_http.items()}
    ratios, table = report(engine, http, args.levels)
    import torch

    result = {
        "what": "streaming through /v1 over HTTP (launch.py --ui off, a subprocess) vs the engine API in-process",
        "model": args.shape and f"random {args.shape} shape" or args.model, "device": args.device,
        "servers": {label: argv for label, argv in servers.items()},
        "rounds": args.rounds, "max_tokens": args.max_tokens, "levels": args.levels, "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "engine_api": engine, "http": http, "ratios_http_over_engine_api": ratios, "runs": runs,
    }
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
