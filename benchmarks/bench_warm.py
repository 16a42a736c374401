"""The first question after an upload, cold vs warmed, through the app's ``/v1`` over HTTP (issue 34).

Run by hand (not a test)::

    python benchmarks/bench_warm.py --out docs/cpu/warm_demo.json                         # CPU, tiny demo
    python benchmarks/bench_warm.py --device cuda --shape 8b --images 8 --out warm_8b.json  # H200, 8B shape
    python benchmarks/bench_warm.py --device cuda --shape 8b --images 8 --tpot-tokens 256 --out warm_8b.json

A server is started as a subprocess, ``python launch.py --ui off`` (the headless mode: ``/v1``,
``/metrics`` and ``/healthz``, no Gradio), on the tiny demo checkpoint (``--model demo``, the
default) or a random-weight checkpoint at a real model's shapes (``--shape 8b``, written once
under ``--workdir``, as :mod:`bench_http` writes it). An httpx client in this process drives it:
each round is a new "session" (a ``prompt_cache_key`` of its own, so a salt of its own: nothing is
shared between rounds or modes) asking about the same ``--images`` photos of tests/media in the
media-first layout the chat uses (:func:`engine.media_first_messages`), greedy, ``--max-tokens``:

* **cold**: the session's first question, nothing warmed (a miss: preprocessing, vision encoder,
  prefill of the whole prefix);
* **warmed**: ``POST /v1/prefix_cache/warm`` with the same messages (waiting for it: ``200``,
  cached), then the first question, which attaches the warmed prefix (telemetry ``warmed``);
* **hit**: that session's second question (an ordinary hit, the goal's reference);
* **joined**: the warm sent without waiting (``"wait": false``, ``202``), the first question at
  once after it: it joins the warm in progress (its TTFT includes what was left of the warm).

The modes alternate within each round (cold, warmed, hit, joined), so a drift of the machine's load
falls on all of them alike. Per request, timed by the client: TTFT (sending the request to its first
text delta); beside it, the engine's own telemetry (``ttft_ms``, ``prefix_cache``, ``warmed``).
Reported: each mode's p50 client TTFT and engine TTFT, the warm's own time (``POST`` to its
``200``), and the ratios warmed / hit (issue 34's goal: <= 1.2) and cold / warmed.

With ``--tpot-tokens N`` (the H200 goal: N = 256), a second phase measures what a warm costs a
running stream: a session with its prefix cached streams N tokens, alone, then again beside other
sessions' warms, started from its first token (``--tpot-warms continuous``, the default: each
waited for and the next started at once, until the stream ends; ``one``: a single warm). Reported
with and without, and their ratio (goal: <= 1.05): the p50 over rounds of each stream's TPOT (its
mean time per token after the first) and of the p50 gap between its text deltas.

With ``--step-trace PATH`` the server writes its step trace there (``PRISM_STEP_TRACE``,
:mod:`engine.serving.trace`) and the result gains, per TPOT stream, a summary of the engine's steps
during it (:mod:`step_trace_report`: steps carrying a warm's chunk against decode-only steps, which
forward ran, and the time outside the runner), so a slower stream says whether its steps ran longer
or the loop waited between them.

Wheels it needs: those of :mod:`bench_http` (the server's web stack, ``httpx``; not Gradio).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import mimetypes
import os
import pathlib
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for path in (ROOT, BENCH):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_http  # noqa: E402  (its checkpoints, free_port and wait_healthy)
import step_trace_report  # noqa: E402

#: The photos a session uploads, in order (``--images`` takes the first N).
PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "grace_hopper.jpg", "hubble_deep_field.jpg",
          "china.jpg", "coins.png")
MODES = ("cold", "warmed", "hit", "joined")


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------


def data_urls(count: int) -> list[str]:
    """The first ``count`` photos of :data:`PHOTOS` as base64 ``data:`` URLs."""
    if not 1 <= count <= len(PHOTOS):
        raise SystemExit(f"--images must be 1 to {len(PHOTOS)}")
    urls = []
    for name in PHOTOS[:count]:
        path = ROOT / "tests" / "media" / name
        mime = mimetypes.guess_type(path.name)[0] or "image/png"
        urls.append(f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode())
    return urls


def messages(urls: list[str], question: str | None) -> list[dict]:
    """A chat request's messages in the media-first layout, in OpenAI's shape (``question`` None:
    nothing after the last image, as a warm may send them)."""
    from engine import media_first_messages

    layout = media_first_messages(list(range(len(urls))), question or "")
    content = []
    for part in layout[-1]["content"]:
        if part["type"] == "image":
            content.append({"type": "image_url", "image_url": {"url": urls[part["image"]]}})
        elif question is not None or not part["text"].startswith("Question: "):
            content.append({"type": "text", "text": part["text"]})
    return [{"role": "user", "content": content}]


async def ask(client, urls: list[str], key: str, question: str, max_tokens: int,
              first_token: asyncio.Event | None = None) -> dict:
    """One streaming chat request; its client TTFT and TPOT (the mean after the first token, and
    the p50 of the gaps between text deltas) and the engine's telemetry. ``first_token`` is set
    when the first text delta arrives."""
    body = {"messages": messages(urls, question), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "prompt_cache_key": key}
    sent, deltas, telemetry = await bench_http.stream_chat(client, body, first_token.set if first_token else None)
    if not deltas:
        raise RuntimeError("the stream ended without text")
    first, last = deltas[0], deltas[-1]
    gaps = [(b - a) * 1e3 for a, b in zip(deltas, deltas[1:], strict=False)]
    generated = telemetry["generated_tokens"]
    return {"ttft_ms": (first - sent) * 1e3, "tpot_ms": (last - first) * 1e3 / (generated - 1) if generated > 1
            else None, "gap_ms_p50": statistics.median(gaps) if gaps else None, "generated": generated,
            "prefix_cache": telemetry.get("prefix_cache"),
            "warmed": bool(telemetry.get("warmed")), "engine_ttft_ms": telemetry.get("ttft_ms"),
            "engine_tpot_ms": telemetry.get("tpot_ms"), "cached_tokens": telemetry.get("cached_tokens"),
            "first_at": first, "last_at": last}


async def warm(client, urls: list[str], key: str, wait: bool = True) -> dict:
    """``POST /v1/prefix_cache/warm``; its answer and how long it took (ms)."""
    sent = time.perf_counter()
    r = await client.post("/v1/prefix_cache/warm", json={"prompt_cache_key": key, "messages": messages(urls, None),
                                                          "wait": wait})
    if r.status_code not in (200, 202):
        raise RuntimeError(f"warm: HTTP {r.status_code}: {r.text[:500]}")
    return {**r.json(), "http_status": r.status_code, "warm_ms": (time.perf_counter() - sent) * 1e3}


# ------------------------------------------------------------------------------------------------
# the phases
# ------------------------------------------------------------------------------------------------


async def first_questions(client, urls: list[str], rounds: int, max_tokens: int) -> dict:
    """``rounds`` rounds of the four :data:`MODES`, each round's sessions new; per-mode records."""
    nonce = secrets.token_hex(4)
    out: dict[str, list] = {mode: [] for mode in MODES}
    out["warm"] = []
    # one throwaway session first: the server's first request pays one-off costs (kernels, threads)
    await ask(client, urls, f"bench-warm-{nonce}-warmup", "Warm-up: describe the pictures.", max_tokens)
    for r in range(rounds):
        key = f"bench-warm-{nonce}-{r}"
        out["cold"].append(await ask(client, urls, key + "-cold", f"Round {r}: what is in these pictures?",
                                     max_tokens))
        out["warm"].append(await warm(client, urls, key + "-warmed"))
        out["warmed"].append(await ask(client, urls, key + "-warmed", f"Round {r}: what is in these pictures?",
                                       max_tokens))
        out["hit"].append(await ask(client, urls, key + "-warmed", f"Round {r}: and which colours stand out?",
                                    max_tokens))
        started = await warm(client, urls, key + "-joined", wait=False)
        joined = await ask(client, urls, key + "-joined", f"Round {r}: what is in these pictures?", max_tokens)
        out["joined"].append({**joined, "warm_status": started["status"]})
        row = {m: out[m][-1]["ttft_ms"] for m in MODES}
        print(f"  round {r + 1}/{rounds}: TTFT " + ", ".join(f"{m} {v:.1f} ms" for m, v in row.items())
              + f" (warm {out['warm'][-1]['warm_ms']:.1f} ms)", flush=True)
    return out


async def tpot_under_warms(client, urls: list[str], rounds: int, tokens: int, continuous: bool = True) -> dict:
    """Per round: one stream of ``tokens`` tokens about a cached prefix alone, then the same
    beside other sessions' warms: back to back until the stream ends (``continuous``), or one,
    started at the stream's first token. Returns both kinds of stream records and the warms."""
    nonce = secrets.token_hex(4)
    key = f"bench-warm-tpot-{nonce}"
    await ask(client, urls, key, "Cache the prefix.", 4)
    alone, beside, warms = [], [], []
    for r in range(rounds):
        alone.append(await ask(client, urls, key, f"Stream {r}: tell a long story about the pictures.", tokens))
        started = asyncio.Event()
        stream = asyncio.ensure_future(ask(client, urls, key, f"Stream {r}: tell a long story about them, again.",
                                           tokens, started))
        await started.wait()
        n = 0
        while not stream.done() and (continuous or n == 0):
            warms.append(await warm(client, urls, f"{key}-other-{r}-{n}"))
            n += 1
        beside.append({**await stream, "warms_during": n})
        print(f"  round {r + 1}/{rounds}: TPOT alone {alone[-1]['tpot_ms']:.2f} ms (gap p50 "
              f"{alone[-1]['gap_ms_p50']:.2f}), beside {n} warm(s) {beside[-1]['tpot_ms']:.2f} ms (gap p50 "
              f"{beside[-1]['gap_ms_p50']:.2f})", flush=True)
    return {"alone": alone, "beside_warms": beside, "warms": warms, "mode": "continuous" if continuous else "one"}


def p50(records: list[dict], key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def summarise(first: dict, tpot: dict | None) -> dict:
    modes = {m: {"requests": len(first[m]), "ttft_ms_p50": p50(first[m], "ttft_ms"),
                 "engine_ttft_ms_p50": p50(first[m], "engine_ttft_ms"),
                 "prefix_cache": sorted({r["prefix_cache"] for r in first[m]}),
                 "warmed": sum(r["warmed"] for r in first[m])} for m in MODES}
    out = {"modes": modes, "warm_ms_p50": p50(first["warm"], "warm_ms"),
           "prefix_tokens": sorted({w["prefix_tokens"] for w in first["warm"]}),
           "warmed_over_hit": ratio(modes["warmed"]["ttft_ms_p50"], modes["hit"]["ttft_ms_p50"]),
           "warmed_over_hit_engine": ratio(modes["warmed"]["engine_ttft_ms_p50"], modes["hit"]["engine_ttft_ms_p50"]),
           "cold_over_warmed": ratio(modes["cold"]["ttft_ms_p50"], modes["warmed"]["ttft_ms_p50"])}
    if tpot is not None:
        alone, beside = p50(tpot["alone"], "tpot_ms"), p50(tpot["beside_warms"], "tpot_ms")
        gap_alone, gap_beside = p50(tpot["alone"], "gap_ms_p50"), p50(tpot["beside_warms"], "gap_ms_p50")
        out["tpot"] = {"tokens": p50(tpot["alone"], "generated"), "warms": tpot["mode"],
                       "alone_ms_p50": alone, "beside_warms_ms_p50": beside, "ratio": ratio(beside, alone),
                       "gap_alone_ms_p50": gap_alone, "gap_beside_warms_ms_p50": gap_beside,
                       "gap_ratio": ratio(gap_beside, gap_alone),
                       "warms_during_p50": p50(tpot["beside_warms"], "warms_during")}
    return out


def trace_windows(tpot: dict, trace_path: pathlib.Path) -> dict:
    """Per TPOT stream (alone and beside warms), :func:`step_trace_report.summary` of the server's
    steps between its first and last text delta (both clocks are this host's perf_counter)."""
    records = step_trace_report.read(str(trace_path))
    return {side: [step_trace_report.summary(records, r["first_at"], r["last_at"]) for r in tpot[side]]
            for side in ("alone", "beside_warms")}


def table(summary: dict) -> str:
    lines = ["| first question | client TTFT p50 | engine TTFT p50 | prefix | warmed |", "|---|---|---|---|---|"]
    for mode, row in summary["modes"].items():
        lines.append(f"| {mode} | {row['ttft_ms_p50']:.1f} ms | {row['engine_ttft_ms_p50']:.1f} ms "
                     f"| {'/'.join(row['prefix_cache'])} | {row['warmed']} of {row['requests']} |")
    lines.append("")
    lines.append(f"warm (POST to 200, waited) p50 {summary['warm_ms_p50']:.1f} ms; prefix {summary['prefix_tokens']} "
                 f"tokens; warmed / hit {summary['warmed_over_hit']:.2f}x "
                 f"(engine {summary['warmed_over_hit_engine']:.2f}x"
                 f"; goal <= 1.2); cold / warmed {summary['cold_over_warmed']:.1f}x")
    if "tpot" in summary:
        t = summary["tpot"]
        lines.append(f"TPOT over {t['tokens']:.0f} tokens, p50 over streams of each stream's mean: alone "
                     f"{t['alone_ms_p50']:.2f} ms, beside {t['warms']} warm(s) of other sessions "
                     f"{t['beside_warms_ms_p50']:.2f} ms ({t['ratio']:.3f}x; goal <= 1.05); "
                     "of the gaps between deltas: "
                     f"{t['gap_alone_ms_p50']:.2f} vs {t['gap_beside_warms_ms_p50']:.2f} ms ({t['gap_ratio']:.3f}x)")
    return "\n".join(lines)


def serve(server_argv: list[str], data_dir: pathlib.Path, args) -> dict:
    """Start the server, run the phases over HTTP, stop it; the records and the engine's stats."""
    import httpx

    port = bench_http.free_port()
    argv = [sys.executable, str(ROOT / "launch.py"), *server_argv, "--port", str(port), "--data-dir", str(data_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_")}  # only what we pass
    if args.step_trace:
        env["PRISM_STEP_TRACE"] = str(args.step_trace.resolve())
    print(f"/v1 over HTTP: {' '.join(argv[1:])}", flush=True)
    log = open(data_dir / "server.log", "w")  # noqa: SIM115 - closed after the server below
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    urls = data_urls(args.images)
    try:
        bench_http.wait_healthy(server, base, data_dir / "server.log", args.load_timeout_s)

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as client:
                first = await first_questions(client, urls, args.rounds, args.max_tokens)
                tpot = (await tpot_under_warms(client, urls, args.tpot_rounds, args.tpot_tokens,
                                               args.tpot_warms == "continuous") if args.tpot_tokens else None)
                stats = (await client.get("/healthz")).json().get("engine", {})
                return first, tpot, stats

        return asyncio.run(main())
    finally:
        server.send_signal(signal.SIGINT)  # a clean stop: answers cancelled, the store closed
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="demo", help="checkpoint folder or Hub id; 'demo': the tiny demo model")
    p.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes instead")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--engine", help="launch.py's --engine for the server (in_process, process; default: its default)")
    p.add_argument("--kv-cache-bytes", help="launch.py's --kv-cache-bytes")
    p.add_argument("--images", type=int, default=1, help=f"photos per session (1 to {len(PHOTOS)})")
    p.add_argument("--rounds", type=int, default=5, help="sessions per mode")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tpot-tokens", type=int, default=0,
                   help="also measure a stream of this many tokens alone and beside other sessions' warms (0: not)")
    p.add_argument("--tpot-rounds", type=int, default=3)
    p.add_argument("--tpot-warms", choices=("continuous", "one"), default="continuous",
                   help="beside the stream: other sessions' warms back to back until it ends, or one warm started "
                        "at its first token")
    p.add_argument("--workdir", type=pathlib.Path, help="where checkpoints and the server's data dir go")
    p.add_argument("--load-timeout-s", type=float, default=1800.0)
    p.add_argument("--out", type=pathlib.Path, help="write the results here as JSON (and a .md table beside it)")
    p.add_argument("--step-trace", type=pathlib.Path,
                   help="the server writes its step trace here; the TPOT streams' steps are summarised from it")
    args = p.parse_args(argv)
    if args.step_trace and args.step_trace.exists():
        args.step_trace.unlink()  # the trace appends: one run per file

    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="prism-bench-warm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder = bench_http.checkpoint(args, workdir)
    server_argv = ["--ui", "off", "--model", str(folder), "--device", args.device]
    if args.kv_cache_bytes:
        server_argv += ["--kv-cache-bytes", args.kv_cache_bytes]
    if args.engine:
        server_argv += ["--engine", args.engine]
    data_dir = workdir / "server-data"
    data_dir.mkdir(exist_ok=True)
    first, tpot, stats = serve(server_argv, data_dir, args)
    summary = summarise(first, tpot)
    steps = trace_windows(tpot, args.step_trace) if tpot and args.step_trace else None
    import torch

    result = {
        "what": "first-question TTFT after an upload through /v1 over HTTP (launch.py --ui off, a subprocess): "
                "cold, warmed (POST /v1/prefix_cache/warm, waited), a hit, joined (warm not waited)",
        "model": args.shape and f"random {args.shape} shape" or args.model, "device": args.device,
        "server": server_argv, "images": list(PHOTOS[:args.images]), "rounds": args.rounds,
        "max_tokens": args.max_tokens, "tpot_tokens": args.tpot_tokens, "tpot_rounds": args.tpot_rounds,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "summary": summary, "records": {**first, **({"tpot": tpot} if tpot else {})},
        **({"tpot_steps": steps} if steps else {}),
        "engine_stats": {k: v for k, v in stats.items() if k.startswith(("warms", "cache_hits", "cache_misses"))},
    }
    text = table(summary)
    if steps:
        for side, windows in steps.items():
            for i, w in enumerate(windows):
                text += f"\n\nsteps during the {side} stream {i}: " + step_trace_report.text(w)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text + "\n")
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
