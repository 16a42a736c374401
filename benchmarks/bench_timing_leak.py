"""Can a client tell from its time to first token that someone else sent an image? (run by hand)

    python launch.py --model demo --data-dir /tmp/prism-leak --port 7861 &
    python benchmarks/bench_timing_leak.py --url http://127.0.0.1:7861
    python benchmarks/bench_timing_leak.py --url http://127.0.0.1:7861 --api-key KEY --out leak.json
    python launch.py --model demo --data-dir /tmp/prism-leak --port 7862 --kv-cache-bytes 8M &   # host tier on
    python benchmarks/bench_timing_leak.py --url http://127.0.0.1:7862 --flush 40 --out leak_host.json

The attack of issue 16, measured from outside through the OpenAI-compatible API:

1. A *victim* sends image X and ``--seen`` (10) other images of X's size, one request each, each
   under an identity of its own (``Authorization: Bearer victim-<random>`` without ``--api-key``,
   and a random ``prompt_cache_key``). ``--victim none`` skips this, for an X that someone
   already sent through the web page (give its file with ``--image``; ``--seen`` is then 0).
2. The *prober* sends X, the victim's other images and ``--fresh`` (20) fresh images of the same
   size, ``--rounds`` (2) times each, all in one random order. The images are X with a random 4x4
   block of pixels changed, all encoded the same way, so decoding and processing cost the same.
   Every probe has an identity of its own (a fresh bearer token without ``--api-key``, a fresh
   ``prompt_cache_key`` always), so a probe can be sped up only by what *another* identity left
   behind.

Each probe asks for one token (``max_tokens`` 1, not streamed), so its round trip is its time to
first token seen from outside; the server's ``ttft_ms`` and ``preprocess_ms`` telemetry are
compared too. The statistic is a one-sided Mann-Whitney U (alternative: the first group is
faster), stratified by occurrence: the k-th probes of all images form stratum k (in a random order
the k-th occurrences of any two images are exchangeable, whereas a second probe always comes after
a first one, so comparing them would mistake a drift of the machine's speed for a leak); U is
summed over strata and its p-value comes from 20,000 random relabellings within the strata
(seeded).
Two comparisons:

* **X vs fresh**: X against the fresh images (the issue's question: is an image someone else
  sent recognisable?);
* **victim's vs fresh**: X and the victim's other images against the fresh ones (the same
  question with more samples).

**The host-tier case** (``--flush N``, issue 33): the victim's prefixes are pushed out of the KV
pool into the host-memory tier before the probes, so a probe of X meets X's KV on the host, not
on the GPU. Start the server with a KV pool of a few prefixes (``--kv-cache-bytes``) and its host
tier on (the engine's default); after the victim, ``N`` requests about further fresh images, each
under an identity of its own, fill the pool so that the victim's entries are offloaded. The
victim sends X twice, under two identities: copy B first (before its other images), copy A last.
Before the probes, copy A asks X again: its telemetry's ``prefix_tier`` says where its prefix
was (``host``: offloaded; A's restore brings back only A's copy); B, older, was offloaded no later
than A. After the probes copy B asks again: ``host`` means B's copy stayed on the host through the
whole probe phase (only B's own hit restores it; a host eviction would make it a miss). Then
every probe of X must be a miss (another identity's host entry is never found), and X's TTFT
must not differ from the fresh images' (the same comparisons). The server's counters
(``/healthz``: offloads, restores, host entries, hits on the host) are read before and after
each phase and reported as differences.

A p-value far below 0.05 with a median ratio well under 1 means the side channel is open; with
the fix (issue 16) the p-values should be unremarkable (roughly uniform between 0 and 1) and the
ratios near 1. Timings are noisy: run it on an otherwise idle machine, and more than once. The
server's processed-image cache holds about 256 MiB (10 one-megapixel images): on a server from
before issue 16 a large X with many images shows the leak diluted, as entries are evicted before
they are probed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import pathlib
import random
import secrets
import statistics
import sys
import time
import urllib.error
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from media import MEDIA_DIR  # noqa: E402

PERMUTATIONS = 20_000


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ images
def encode_like(image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_images(path: pathlib.Path, fresh: int, rng: random.Random, long_side: int = 0
                ) -> tuple[bytes, list[bytes], str, tuple]:
    """X re-encoded (resized first so that its long side is ``long_side`` pixels, when given), and
    ``fresh`` variants of it with one random 4x4 block changed, in the same format."""
    from PIL import Image

    with Image.open(path) as im:
        fmt = "JPEG" if im.format == "JPEG" else "PNG"
        base = im.convert("RGB")
    if long_side:
        scale = long_side / max(base.size)
        base = base.resize((round(base.width * scale), round(base.height * scale)), Image.Resampling.BICUBIC)
    x = encode_like(base, fmt)
    variants = []
    w, h = base.size
    for _ in range(fresh):
        im = base.copy()
        left, top = rng.randrange(max(1, w - 4)), rng.randrange(max(1, h - 4))
        colour = tuple(rng.randrange(256) for _ in range(3))
        im.paste(colour, (left, top, min(w, left + 4), min(h, top + 4)))
        variants.append(encode_like(im, fmt))
    return x, variants, fmt, base.size


# ------------------------------------------------------------------------------------ requests
def ask(url: str, image: bytes, fmt: str, *, bearer: str | None, cache_key: str | None,
        timeout: float) -> dict:
    """One non-streamed request for one token about ``image``; its round trip and telemetry."""
    mime = "image/jpeg" if fmt == "JPEG" else "image/png"
    body = {
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(image).decode()}"}},
            {"type": "text", "text": "What is in the picture?"}]}],
        "max_tokens": 1, "temperature": 0,
    }
    if cache_key is not None:
        body["prompt_cache_key"] = cache_key
    headers = {"Content-Type": "application/json"}
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"error: the server answered {exc.code}: {exc.read()[:300]!r}") from None
    elapsed = (time.perf_counter() - start) * 1e3
    tel = payload.get("prism", {}).get("telemetry", {})
    usage = payload.get("usage", {})
    return {"round_trip_ms": elapsed, "ttft_ms": tel.get("ttft_ms"), "preprocess_ms": tel.get("preprocess_ms"),
            "prefix_cache": tel.get("prefix_cache"), "prefix_tier": tel.get("prefix_tier"),
            "restore_ms": tel.get("restore_ms"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def identity(api_key: str | None, role: str) -> tuple[str | None, str]:
    """(bearer token, prompt_cache_key) of a new identity: without keys a random bearer token is a
    salt of its own on servers from before issue 16 (which keyed salts by any bearer token) and is
    ignored by later ones (which give each request its own salt)."""
    cache_key = f"{role}-{secrets.token_hex(8)}"
    return (api_key if api_key else f"{role}-{secrets.token_hex(8)}"), cache_key


#: Engine counters of ``/healthz`` reported per phase (those of the host tier, issue 33, appear
#: only on a server that has it).
COUNTERS = ("cache_hits", "cache_misses", "cache_prefix_evictions", "cache_offloads", "cache_restores",
            "cache_host_evictions", "cache_hits_host", "cache_host_entries", "host_pages_used")


def engine_counters(url: str, timeout: float) -> dict | None:
    """The engine's :data:`COUNTERS` from the server's ``/healthz`` (None when it does not say)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout) as response:
            engine = json.loads(response.read()).get("engine") or {}
    except (urllib.error.URLError, ValueError, OSError):
        return None
    return {k: engine[k] for k in COUNTERS if k in engine}


def counter_changes(before: dict | None, after: dict | None) -> dict | None:
    """``after - before`` per counter both have (None when either is unknown)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after if k in before}


def states_by_kind(samples: list[dict]) -> dict:
    """Probe outcomes (``prefix_cache``) counted per image kind: ``{"x": {"miss": 4}, ...}``."""
    out: dict[str, dict] = {}
    for r in samples:
        kinds = out.setdefault(r["kind"], {})
        kinds[r["prefix_cache"]] = kinds.get(r["prefix_cache"], 0) + 1
    return out


# ------------------------------------------------------------------------------------ statistics
def midranks(values: list[float]) -> np.ndarray:
    """Ranks 1..n of ``values`` in ascending order, ties sharing their mean rank."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    for value in np.unique(v):
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def stratified_p(strata: list[tuple[list[float], list[float]]], seed: int, n: int = PERMUTATIONS) -> float:
    """One-sided p-value of the stratified Mann-Whitney U test (alternative: the first group of
    each stratum ``(a, b)`` is faster). Within a stratum, U counting pairs where the ``a`` value is
    smaller is ``len(a) * len(b) + len(a) * (len(a) + 1) / 2 - R_a`` (``R_a`` the rank sum of
    ``a`` in the pooled values, Mann and Whitney 1947), so a large total U is a small total rank
    sum; p = P(total rank sum <= observed) when labels are permuted within strata, the observed
    labelling counted as one of ``n + 1``."""
    rng = np.random.default_rng(seed)
    strata = [(a, b) for a, b in strata if a and b]
    observed, draws = 0.0, np.zeros(n)
    for a, b in strata:
        ranks = midranks(a + b)
        observed += ranks[: len(a)].sum()
        picks = np.argsort(rng.random((n, len(ranks))), axis=1)[:, : len(a)]
        draws += ranks[picks].sum(axis=1)
    return (1 + int((draws <= observed + 1e-9).sum())) / (n + 1)


def compare(name: str, samples: list[dict], group, control, rounds: int, seed: int) -> dict:
    """``group`` vs ``control`` samples (predicates on a sample), stratified by occurrence."""
    out = {"comparison": name}
    for metric in ("round_trip_ms", "ttft_ms", "preprocess_ms"):
        strata = []
        for k in range(rounds):
            rows = [r for r in samples if r["occurrence"] == k and r[metric] is not None]
            strata.append(([r[metric] for r in rows if group(r)], [r[metric] for r in rows if control(r)]))
        a = [v for s, _ in strata for v in s]
        b = [v for _, s in strata for v in s]
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        out["n"] = [len(a), len(b)]
        out[metric] = {"median": [round(ma, 2), round(mb, 2)], "ratio": round(ma / mb, 3) if mb else None,
                       "p_one_sided": round(stratified_p(strata, seed), 5)}
    return out


# ------------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7860", help="the running Prism server")
    parser.add_argument("--image", type=pathlib.Path, default=MEDIA_DIR / "astronaut.png", help="image X")
    parser.add_argument("--long-side", type=int, default=0,
                        help="resize X so that its long side has this many pixels (0: as it is)")
    parser.add_argument("--fresh", type=int, default=20, help="fresh images of X's size")
    parser.add_argument("--seen", type=int, default=10, help="other images the victim sends besides X")
    parser.add_argument("--rounds", type=int, default=2, help="times each image is probed")
    parser.add_argument("--victim", choices=("api", "none"), default="api",
                        help="api: send X (and --seen others) first under other identities; "
                             "none: X was sent by someone else")
    parser.add_argument("--api-key", help="the server's API key, when it has keys configured")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests with other images first")
    parser.add_argument("--flush", type=int, default=0,
                        help="the host-tier case: this many requests about other fresh images after the victim, "
                             "to push its prefixes into the host tier of a server with a small KV pool (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=pathlib.Path, help="write the samples and results as JSON")
    args = parser.parse_args()
    if args.victim == "none":
        args.seen = 0
    if args.fresh < 2 or args.rounds < 1 or args.seen < 0 or args.flush < 0:
        parser.error("--fresh must be at least 2, --rounds at least 1, --seen and --flush at least 0")
    if args.flush and args.victim == "none":
        parser.error("--flush needs --victim api (the victim's own identities check where its prefix is)")
    if not args.image.is_file():
        parser.error(f"no image at {args.image}")
    rng = random.Random(args.seed)
    x, others, fmt, size = make_images(args.image, args.warmup + args.seen + args.fresh + args.flush, rng,
                                       args.long_side)
    warm, seen = others[: args.warmup], others[args.warmup: args.warmup + args.seen]
    fresh = others[args.warmup + args.seen: args.warmup + args.seen + args.fresh]
    flush = others[args.warmup + args.seen + args.fresh:]
    images = {("x", 0): x, **{("seen", i): im for i, im in enumerate(seen)},
              **{("fresh", i): im for i, im in enumerate(fresh)}}

    def probe(image: bytes, role: str, who: tuple[str | None, str] | None = None) -> dict:
        bearer, cache_key = who or identity(args.api_key, role)
        return ask(args.url, image, fmt, bearer=bearer, cache_key=cache_key, timeout=args.timeout)

    copies = {"A": identity(args.api_key, "victim"), "B": identity(args.api_key, "victim")}
    counters = {"start": engine_counters(args.url, args.timeout)}
    host_case: dict = {"flush": args.flush}

    log(f"X: {args.image.name} as {fmt}, {size[0]}x{size[1]}; the victim sends X and {args.seen} others; "
        f"{args.fresh} fresh images; {args.rounds} rounds")
    for image in warm:
        probe(image, "warmup")
    if args.victim == "api":
        if args.flush:  # copy B of X first, the oldest of the victim's entries
            probe(x, "victim", copies["B"])
        for name in [n for n in images if n[0] == "seen"] + [("x", 0)]:
            done = probe(images[name], "victim", copies["A"] if args.flush and name[0] == "x" else None)
        log(f"victim sent X: TTFT {done['ttft_ms']:.0f} ms, prefix {done['prefix_cache']}")
    counters["victim"] = engine_counters(args.url, args.timeout)
    if args.flush:
        for image in flush:
            probe(image, "flush")
        counters["flush"] = engine_counters(args.url, args.timeout)
        before = host_case["copy_a_before_probes"] = probe(x, "victim", copies["A"])
        log(f"flushed with {args.flush} requests; X's copy A: prefix {before['prefix_cache']}, tier "
            f"{before['prefix_tier']}, restore {before['restore_ms']} ms; counters "
            f"{counter_changes(counters['victim'], counters['flush'])}")
        if before["prefix_tier"] != "host":
            log("note: X's copy A was not on the host before the probes (no tier, a pool large enough to keep it, "
                "or evicted from the host too): raise --flush or shrink the server's --kv-cache-bytes")
    order = [name for name in images for _ in range(args.rounds)]
    rng.shuffle(order)
    samples, occurrences = [], {}
    for n, name in enumerate(order, 1):
        k = occurrences[name] = occurrences.get(name, -1) + 1
        row = {"kind": name[0], "image": name[1], "occurrence": k, **probe(images[name], "probe")}
        samples.append(row)
        log(f"{n:3d}/{len(order)} {name[0]:5s} #{k + 1} round trip {row['round_trip_ms']:7.1f} ms  "
            f"ttft {row['ttft_ms'] or 0:7.1f}  preprocess {row['preprocess_ms'] or 0:6.1f}  "
            f"prefix {row['prefix_cache']}  cached {row['cached_tokens']}")
    counters["probes"] = engine_counters(args.url, args.timeout)
    if args.flush:
        after = host_case["copy_b_after_probes"] = probe(x, "victim", copies["B"])
        log(f"X's copy B after the probes: prefix {after['prefix_cache']}, tier {after['prefix_tier']}")
        host_case["held"] = before["prefix_tier"] == "host" and after["prefix_tier"] == "host"
    host_case["probe_states"] = states_by_kind(samples)
    host_case["x_probes_all_misses"] = all(r["prefix_cache"] == "miss" for r in samples if r["kind"] == "x")
    phases = list(counters)
    host_case["counter_changes"] = {f"{a} -> {b}": counter_changes(counters[a], counters[b])
                                    for a, b in zip(phases, phases[1:], strict=False)}
    results = [compare("X vs fresh", samples, lambda r: r["kind"] == "x", lambda r: r["kind"] == "fresh",
                       args.rounds, args.seed)]
    if args.seen:
        results.append(compare("victim's (X and others) vs fresh", samples, lambda r: r["kind"] in ("x", "seen"),
                               lambda r: r["kind"] == "fresh", args.rounds, args.seed))
    for res in results:
        print(f"{res['comparison']} (n = {res['n'][0]} vs {res['n'][1]}, stratified by occurrence):")
        for metric in ("round_trip_ms", "ttft_ms", "preprocess_ms"):
            if metric in res:
                m = res[metric]
                print(f"  {metric:14s} median {m['median'][0]:8.1f} vs {m['median'][1]:8.1f} ms  "
                      f"ratio {m['ratio']}  one-sided Mann-Whitney p = {m['p_one_sided']}")
    if any(r["cached_tokens"] for r in samples):
        print("note: some probes reused cached tokens (a prefix hit across identities)")
    print(f"probe outcomes by kind: {host_case['probe_states']}; every probe of X a miss: "
          f"{host_case['x_probes_all_misses']}")
    if args.flush:
        print(f"host-tier case: X's victim copies on the host before and after the probes: {host_case['held']} "
              f"(A before: {before['prefix_cache']} / {before['prefix_tier']}, B after: {after['prefix_cache']} / "
              f"{after['prefix_tier']}); counter changes {host_case['counter_changes']}")
    if args.out:
        args.out.write_text(json.dumps({"url": args.url, "image": args.image.name, "size": size, "format": fmt,
                                        "fresh": args.fresh, "seen": args.seen, "rounds": args.rounds,
                                        "victim": args.victim, "seed": args.seed, "results": results,
                                        "host_case": host_case, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
