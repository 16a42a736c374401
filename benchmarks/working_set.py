"""The working-set protocol (issue 18): chat sessions over more media than the KV pool holds.

Prism's claim is that a compact prefix keeps more media resident in the same KV memory, so fewer
questions pay for the vision encoder and the prefill again. This module holds the protocol that
measures it; ``benchmarks/bench_working_set.py`` is its command line.

* **Groups** (:func:`make_group`): group ``g`` is one chat session (its own cache salt) about 2-9
  photos from ``tests/media``, each a seeded crop of a source photo resized to a seeded size,
  saved as a JPEG file and passed as ``{"image": path, "sha256": digest}`` (as the app does), with
  its own rotation of :data:`QUESTIONS` in the media-first layout.
* **Dense pages** (:func:`measure_dense_pages`): one cold request per group (compaction off, one
  output token) on an engine of its own; its telemetry's ``prefix_pages_dense``.
* **Worksets** (:func:`choose_worksets`): the KV budget is a number of bytes; ``B`` is how many
  Scaled-FP8 pages of the engine's page size those bytes hold. fit = the longest leading run of
  groups whose dense pages are <= 0.7 B, knee = the first run > B, pressure = the first run
  >= 1.5 B, deep = the first run >= 3 B (each: or all groups).
* **Traffic** (:func:`make_trace`, seeded, the same for every variant): a population phase (one
  closed-loop request per group, question 0), then N measured requests: the group drawn by Zipf
  (alpha = 1) over the group order, the group's next question (round-robin from index 1, so never
  the one it was just asked), Poisson arrivals (4 req/s), greedy, ``ignore_eos``, 16 tokens.
* **Variants** (:data:`VARIANTS`): name -> :class:`engine.EngineOptions` overrides, every one on
  the same KV bytes and the same vision-feature cache size. A later policy is one more line. A
  host-tier size is a multiple of B's bytes (:class:`TimesB`), resolved per run
  (:func:`variant_options`); every other variant says ``host_cache_bytes=0``.
* **Metrics** (:func:`run_variant`): TTFT and E2E from the planned arrival, recomputed prompt
  tokens, hit / miss / stale counts, resident prefixes, prefix and extension evictions apart,
  resident prefix pages against their dense equivalent, on-pressure compactions and the pages they
  freed, hits on a dense and on a compact prefix, peak GPU memory, output tokens/s, a hash of the
  request trace each variant actually sent and one of its outputs (token ids in trace order);
  the host tier's (issue 33): hits by tier, the share of answers on a dense prefix, restore ms
  p50 / p99, host pages used (peak and end), offloads / restores / host evictions, the effective
  restore bandwidth against a copy floor measured in the same run (:func:`copy_floor`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import random
import threading
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TimesB:
    """A size given as a multiple of the run's KV budget B in bytes (``TimesB(4)``: four times the
    KV bytes every variant gets), resolved to bytes per run by :func:`variant_options`."""

    k: float

    def bytes(self, budget_bytes: int) -> int:
        """``k`` times ``budget_bytes``, rounded to a whole byte."""
        return round(self.k * budget_bytes)

    def __str__(self) -> str:
        return f"{self.k:g} x B"


#: The fields the host-memory tier (issue 33) adds to EngineOptions, each with the value that
#: means the engine of before the tier: no host pages, and the reclaim order it had.
HOST_TIER_OFF: dict[str, object] = {"host_cache_bytes": 0, "reclaim_order": "offload_first"}

#: Variants compared, each on the same KV bytes: name -> EngineOptions overrides over
#: :func:`base_options`. ``on_pressure`` (issue 19) caches prefixes dense and compacts them to 0.6
#: only when pages run short; ``on_pressure_steps`` compacts in two steps, 0.6 then 0.4. Every
#: variant names its host tier: ``host_cache_bytes=0`` is none (the engine's default, None, would
#: take a share of host RAM), ``_hostKx`` variants get K x B host bytes (issue 33), the engine's
#: default policy (offload first, then compact) unless ``compact_first`` says otherwise.
VARIANTS: dict[str, dict] = {
    "compact_fp8": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                    "compaction_mode": "always", "host_cache_bytes": 0},
    "on_pressure": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                    "compaction_mode": "on_pressure", "host_cache_bytes": 0},
    "on_pressure_steps": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                          "compaction_mode": "on_pressure", "pressure_keep_ratios": (0.6, 0.4),
                          "host_cache_bytes": 0},
    # the quality issue's recommendation (docs/QUALITY.md: keep 0.8; attention), on pressure
    "on_pressure_keep08": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.8,
                           "compaction_mode": "on_pressure", "host_cache_bytes": 0},
    "on_pressure_attention08": {"kv_cache_dtype": "fp8_e4m3", "compaction": "attention", "keep_ratio": 0.8,
                                "compaction_mode": "on_pressure", "host_cache_bytes": 0},
    "dense_fp8": {"kv_cache_dtype": "fp8_e4m3", "compaction": None, "host_cache_bytes": 0},
    # KV in the model dtype (bf16 by default)
    "dense_bf16": {"kv_cache_dtype": "auto", "compaction": None, "host_cache_bytes": 0},
    # the vision-feature cache only
    "vision_only": {"kv_cache_dtype": "fp8_e4m3", "prefix_cache": False, "host_cache_bytes": 0},
    # the host tier (issue 33): the engine's default policy (compaction on pressure, idle prefixes
    # offloaded to the host before any is compacted), host = 1 x B and 4 x B
    "on_pressure_host1x": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                           "compaction_mode": "on_pressure", "host_cache_bytes": TimesB(1)},
    "on_pressure_host4x": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                           "compaction_mode": "on_pressure", "host_cache_bytes": TimesB(4)},
    # the tier alone: never compacted, offloaded and restored whole
    "dense_host4x": {"kv_cache_dtype": "fp8_e4m3", "compaction": None, "host_cache_bytes": TimesB(4)},
    # the policy alternative: compact on the GPU first, then offload (the host gets compacted copies)
    "compact_first_host1x": {"kv_cache_dtype": "fp8_e4m3", "compaction": "uniform", "keep_ratio": 0.6,
                             "compaction_mode": "on_pressure", "host_cache_bytes": TimesB(1),
                             "reclaim_order": "compact_first"},
}

WORKSETS = ("fit", "knee", "pressure", "deep")
#: Workset thresholds as multiples of B: fit <= 0.7 B (longest run), knee > B, pressure >= 1.5 B,
#: deep >= 3 B (first runs).
FIT, KNEE, PRESSURE, DEEP = 0.7, 1.0, 1.5, 3.0

QUESTIONS = (
    "What do these pictures show? Answer briefly.",
    "Which picture has the most vivid colours, and why?",
    "Is there any readable text in the pictures? Quote it.",
    "Count the people in each picture.",
    "Which two pictures look most alike?",
    "Describe the lighting in the last picture.",
    "What would you title this set of photos?",
    "List three objects you can see, with the picture each is in.",
)


# --------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
    """One chat session of the working set.

    Attributes:
        index: position in the group order (Zipf rank).
        salt: its cache salt.
        images: ``{"image": path, "sha256": hex}`` per photo, in order.
        sizes: ``(width, height)`` in pixels per photo.
        questions: its questions, in the order they are asked (question 0 in the population phase).
        dense_pages: KV pages of its public prefix without compaction (None until measured).
        prompt_tokens: tokens of its first prompt (set with ``dense_pages``).
        visual_tokens: visual tokens of its prompt (set with ``dense_pages``).
    """

    index: int
    salt: str
    images: list[dict]
    sizes: list[tuple[int, int]]
    questions: list[str]
    dense_pages: int | None = None
    prompt_tokens: int | None = None
    visual_tokens: int | None = None

    @property
    def digest(self) -> str:
        """SHA-256 hex over the group's ordered photo digests (its content, for the trace hash)."""
        return hashlib.sha256("".join(i["sha256"] for i in self.images).encode()).hexdigest()

    def question(self, index: int) -> str:
        """Question ``index`` of the group (cyclic: ``index`` counts the questions asked so far)."""
        return self.questions[index % len(self.questions)]

    def messages(self, question: int) -> list[dict]:
        """Chat messages asking :meth:`question` ``question`` in the media-first layout."""
        from engine.inputs.prompts import media_first_messages

        return media_first_messages(self.images, self.question(question))

    def describe(self) -> dict:
        """The group for the JSON report."""
        return {"index": self.index, "photos": len(self.images), "sizes": [list(s) for s in self.sizes],
                "sha256": self.digest, "dense_pages": self.dense_pages, "prompt_tokens": self.prompt_tokens,
                "visual_tokens": self.visual_tokens}


@functools.lru_cache(maxsize=16)
def _source_photo(path: pathlib.Path):
    """A source photo decoded once as RGB (groups crop it many times)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def make_group(index: int, seed: int, out_dir: pathlib.Path, *, media_dir: pathlib.Path, photos: tuple[str, ...],
               sides: tuple[int, int], count: tuple[int, int] = (2, 9)) -> Group:
    """Group ``index``: ``count`` photos (inclusive range), each a crop of a source photo (50-100 %
    of its shorter side, at a random place, in the target's aspect ratio) resized to a random
    width and height in ``sides`` (pixels, inclusive), saved as JPEG (quality 90) in ``out_dir``.
    Everything is drawn from a generator seeded by ``(seed, index)``, so a group is the same in
    every run and every variant, and two groups differ.

    Raises:
        FileNotFoundError: a source photo is missing.
    """
    from PIL import Image

    rng = random.Random(f"working-set-{seed}-{index}")
    out_dir.mkdir(parents=True, exist_ok=True)
    images, sizes = [], []
    for j in range(rng.randint(*count)):
        source = rng.choice(photos)
        w, h = rng.randint(*sides), rng.randint(*sides)
        im = _source_photo(media_dir / source)
        side = min(im.width, im.height) * rng.uniform(0.5, 1.0)
        cw, ch = (side, side * h / w) if w >= h else (side * w / h, side)
        x, y = rng.uniform(0, im.width - cw), rng.uniform(0, im.height - ch)
        photo = im.crop((round(x), round(y), round(x + cw), round(y + ch))).resize((w, h), Image.Resampling.BICUBIC)
        path = out_dir / f"group{index:03d}-{j}.jpg"
        photo.save(path, format="JPEG", quality=90)
        images.append({"image": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
        sizes.append((w, h))
    shift = index % len(QUESTIONS)
    questions = list(QUESTIONS[shift:] + QUESTIONS[:shift])
    return Group(index, f"working-set-{seed}-group-{index}", images, sizes, questions)


def measure_dense_pages(engine, group: Group) -> None:
    """Set ``group.dense_pages`` (and its prompt and visual token counts) from one cold request
    with one output token on ``engine``, which must run without compaction and with a fresh salt
    space (its own engine): the telemetry's ``prefix_pages_dense``.

    Raises:
        RuntimeError: the request was not a cold prefix-cache miss (the engine was not fresh).
    """
    from engine import SamplingParams

    tel = engine.generate(group.messages(0), SamplingParams(max_tokens=1, ignore_eos=True),
                          cache_salt=f"measure-{group.salt}").telemetry
    if tel.prefix_cache != "miss":
        raise RuntimeError(f"group {group.index}: the measurement was a {tel.prefix_cache!r}, not a cold miss")
    group.dense_pages, group.prompt_tokens, group.visual_tokens = (
        tel.prefix_pages_dense, tel.prompt_tokens, tel.visual_tokens)


# --------------------------------------------------------------------------------------------
# worksets
# --------------------------------------------------------------------------------------------


def choose_worksets(dense_pages: list[int], budget_pages: int) -> dict[str, int]:
    """How many leading groups each workset takes, from the groups' dense prefix pages (in group
    order) and ``B = budget_pages``: fit = the longest run with a sum <= 0.7 B (at least one
    group), knee = the first run with a sum > B, pressure = the first run with a sum >= 1.5 B,
    deep = the first run with a sum >= 3 B. A run the groups do not reach is all of them.

    >>> choose_worksets([10, 10, 10, 10, 10], 20)
    {'fit': 1, 'knee': 3, 'pressure': 3, 'deep': 5}
    """
    total, runs = 0, {}
    for n, pages in enumerate(dense_pages, 1):
        total += pages
        if total <= FIT * budget_pages:
            runs["fit"] = n
        if total > KNEE * budget_pages:
            runs.setdefault("knee", n)
        if total >= PRESSURE * budget_pages:
            runs.setdefault("pressure", n)
        if total >= DEEP * budget_pages:
            runs.setdefault("deep", n)
    all_groups = len(dense_pages)
    return {"fit": runs.get("fit", min(1, all_groups)), "knee": runs.get("knee", all_groups),
            "pressure": runs.get("pressure", all_groups), "deep": runs.get("deep", all_groups)}


def enough_groups(dense_pages: list[int], budget_pages: int, worksets: list[str]) -> bool:
    """Whether the groups measured so far (their dense pages, in order) decide every workset in
    ``worksets``: fit once their sum passes 0.7 B (the run that no longer fits is known), knee once
    it passes B, pressure once it reaches 1.5 B, deep once it reaches 3 B."""
    total = sum(dense_pages)
    crossed = {"fit": total > FIT * budget_pages, "knee": total > KNEE * budget_pages,
               "pressure": total >= PRESSURE * budget_pages, "deep": total >= DEEP * budget_pages}
    return all(crossed[w] for w in worksets)


# --------------------------------------------------------------------------------------------
# traffic
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request of a trace: the group (index into the workset), the question index, and the
    planned arrival in seconds after the measured phase starts (None: the population phase,
    closed loop)."""

    group: int
    question: int
    at_s: float | None


def make_trace(num_groups: int, requests: int, seed: int, *, rate: float = 4.0, alpha: float = 1.0) -> list[Arrival]:
    """The population phase (one request per group, question 0, in group order) then ``requests``
    measured ones: group ``i`` drawn with probability proportional to ``1 / (i + 1) ** alpha``
    (Zipf over the group order), each group's questions round-robin from index 1, arrival times
    a Poisson process of ``rate`` requests per second. Seeded: the same arguments give the same
    trace."""
    rng = random.Random(f"working-set-trace-{seed}-{num_groups}-{requests}")
    weights = [1 / (i + 1) ** alpha for i in range(num_groups)]
    trace = [Arrival(g, 0, None) for g in range(num_groups)]
    asked = [0] * num_groups
    t = 0.0
    for g in rng.choices(range(num_groups), weights=weights, k=requests):
        t += rng.expovariate(rate)
        asked[g] += 1
        trace.append(Arrival(g, asked[g], t))
    return trace


def trace_row(groups: list[Group], arrival: Arrival) -> tuple[str, str, float | None]:
    """What :func:`trace_hash` covers of one request: the group's content digest, the question
    text and the planned arrival."""
    group = groups[arrival.group]
    return group.digest, group.question(arrival.question), arrival.at_s


def trace_hash(records: list[tuple[str, str, float | None]]) -> str:
    """SHA-256 hex of a request log: ``(group digest, question text, planned arrival s)`` per
    request, in the order they were planned (arrivals rounded to the microsecond)."""
    rows = [[d, q, None if t is None else round(t, 6)] for d, q, t in records]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# variants
# --------------------------------------------------------------------------------------------


def base_options(budget_bytes: int, vision_cache_bytes: int, page_size: int) -> dict:
    """The options every variant shares: the KV bytes, the vision-feature cache size, the page size."""
    return {"kv_cache_bytes": budget_bytes, "vision_cache_bytes": vision_cache_bytes, "page_size": page_size,
            "progress": False}


def variant_options(name: str, budget_bytes: int, vision_cache_bytes: int, page_size: int,
                    variants: dict[str, dict] = VARIANTS) -> dict:
    """The EngineOptions keyword arguments of variant ``name`` in a run whose KV budget is
    ``budget_bytes`` (B): :func:`base_options` under the variant's overrides, every
    :class:`TimesB` resolved to bytes (``host_cache_bytes=TimesB(4)`` is ``4 * budget_bytes``).

    Raises:
        KeyError: an unknown variant.
    """
    overrides = {k: v.bytes(budget_bytes) if isinstance(v, TimesB) else v for k, v in variants[name].items()}
    return {**base_options(budget_bytes, vision_cache_bytes, page_size), **overrides}


def describe_variant(overrides: dict) -> dict:
    """A variant's overrides for the JSON report: a :class:`TimesB` as its text (``"4 x B"``),
    tuples as lists."""
    return {k: str(v) if isinstance(v, TimesB) else list(v) if isinstance(v, tuple) else v
            for k, v in overrides.items()}


def uses_host_tier(overrides: dict) -> bool:
    """Whether a variant (its overrides, or resolved options) runs with a host tier:
    ``host_cache_bytes`` other than 0 (None is the engine's default share of host RAM)."""
    return overrides.get("host_cache_bytes", HOST_TIER_OFF["host_cache_bytes"]) != 0


def fit_to_engine(options: dict, fields: set[str]) -> dict:
    """``options`` for an EngineOptions with ``fields``: a host-tier field (:data:`HOST_TIER_OFF`)
    the engine lacks is dropped when it asks for what that engine does anyway (no tier, the old
    reclaim order), so the variants run on an engine from before the tier.

    Raises:
        ValueError: a variant asks for a host-tier setting the engine lacks.
    """
    out = dict(options)
    for key, off in HOST_TIER_OFF.items():
        if key in out and key not in fields:
            if out[key] != off:
                raise ValueError(f"this engine has no host-memory tier (EngineOptions.{key}); "
                                 f"the variant asks for {key}={out[key]!r}")
            del out[key]
    return out


def check_variants(names: list[str], variants: dict[str, dict] = VARIANTS) -> None:
    """Raises: ValueError: an unknown variant name, or a variant setting a field EngineOptions
    lacks (but the host tier's, :data:`HOST_TIER_OFF`: those fail the variant alone, at its run,
    on an engine without the tier; see :func:`fit_to_engine`)."""
    from engine import EngineOptions

    fields = {f.name for f in dataclasses.fields(EngineOptions)} | set(HOST_TIER_OFF)
    for name in names:
        if name not in variants:
            raise ValueError(f"unknown variant {name!r}; choose from {sorted(variants)}")
        unknown = set(variants[name]) - fields
        if unknown:
            raise ValueError(f"variant {name!r} sets unknown EngineOptions fields {sorted(unknown)}")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def run_variant(engine, groups: list[Group], trace: list[Arrival], *, max_tokens: int = 16,
                time_scale: float = 1.0, workers: int = 64, log: Callable[[str], None] = print) -> dict:
    """Send ``trace`` to ``engine`` (a fresh one) and measure it.

    The population phase runs closed loop, then the engine's counters are read (the measured
    phase reports differences from them) and the peak GPU memory statistic is reset. Measured
    requests are sent at ``at_s * time_scale`` seconds after the phase starts, each from a client
    thread (prompt building happens there, as in the app); ``time_scale=0`` sends them closed loop
    instead, one after another in trace order, which makes the cache behaviour independent of the
    machine's speed (tests).

    Times in ms: TTFT and E2E count from the planned arrival (with ``time_scale=0``, from the
    moment the previous request finished), so queueing and preprocessing are included.

    Returns:
        the metrics of the measured phase (:func:`summarise`), its trace hash, the phases' seconds.

    Raises:
        RuntimeError: a population request failed (measured requests that fail are counted).
    """
    from engine import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sent: list[tuple[str, str, float | None]] = []  # the trace as actually sent, for its hash

    def send(arrival: Arrival, planned: float) -> dict:
        delay = planned - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return ask(engine, groups[arrival.group], arrival, sampling, planned)

    population = [a for a in trace if a.at_s is None]
    measured = [a for a in trace if a.at_s is not None]
    t = time.perf_counter()
    for a in population:
        sent.append(trace_row(groups, a))
        out = send(a, time.perf_counter())
        if "error" in out:
            raise RuntimeError(f"population request for group {a.group} failed: {out['error']}")
    population_s = time.perf_counter() - t
    log(f"  population: {len(population)} requests in {population_s:.1f} s")
    before = engine.stats()
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    # the host tier's pages are polled only where the engine has some: a variant without the tier
    # must not pay for reads (each holds the loop between two steps) that its rivals do not
    has_tier = bool(before.get("host_pages_total"))
    poller = StatsPoller(engine, "host_pages_used") if has_tier else contextlib.nullcontext()
    start = time.perf_counter()
    with poller:
        if time_scale == 0:
            results = []
            for a in measured:
                sent.append(trace_row(groups, a))
                results.append(send(a, time.perf_counter()))
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as clients:
                futures = []
                for a in measured:
                    sent.append(trace_row(groups, a))
                    futures.append(clients.submit(send, a, start + a.at_s * time_scale))
                results = [f.result() for f in futures]
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    after = engine.stats()
    metrics = summarise(results, before, after, start)
    metrics |= pool_description(engine)
    if isinstance(poller, StatsPoller):
        poller.sample(before)
        poller.sample(after)
    metrics["host_pages_used_peak"] = poller.peak if isinstance(poller, StatsPoller) else None
    metrics |= restore_metrics(results, metrics["kv_page_bytes"], groups, engine.device, has_tier=has_tier)
    metrics |= {"population_requests": len(population), "trace_hash": trace_hash(sent),
                "population_s": population_s,
                "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(engine.device)
                if engine.device.type == "cuda" else None}
    return metrics


def restore_metrics(results: list[dict], page_bytes: int, groups: list[Group], device: torch.device, *,
                    has_tier: bool) -> dict:
    """The restores' effective bandwidth (:func:`restore_bandwidth`, bytes/s) and, for an engine
    with a host tier, the copy floor measured now at a typical restore's size (:func:`copy_floor`)
    and their ratio (``restore_bandwidth_ratio``); None where there is nothing to measure."""
    out = {"restore_bytes_per_s": restore_bandwidth(results, page_bytes), "copy_floor_bytes": None,
           "copy_floor_bytes_per_s": None, "copy_floor_kind": None, "restore_bandwidth_ratio": None}
    if has_tier:
        out |= copy_floor(restore_size(results, page_bytes, groups), device)
        if out["restore_bytes_per_s"] and out["copy_floor_bytes_per_s"]:
            out["restore_bandwidth_ratio"] = out["restore_bytes_per_s"] / out["copy_floor_bytes_per_s"]
    return out


def ask(engine, group: Group, arrival: Arrival, sampling, planned: float) -> dict:
    """One request now (``planned``: when it should have been sent, ``time.perf_counter()``
    seconds): its outcome as a dict, or ``{"group", "error"}`` when the engine refused or failed."""
    called = time.perf_counter()
    try:
        done = engine.generate(group.messages(arrival.question), sampling, cache_salt=group.salt)
    except Exception as exc:  # noqa: BLE001  (a benchmark counts failures; it does not stop at one)
        return {"group": arrival.group, "error": f"{type(exc).__name__}: {exc}"}
    tel = done.telemetry
    late_ms = (called - planned) * 1e3  # the engine's clock starts at the call
    return {"group": arrival.group, "question": arrival.question, "state": tel.prefix_cache,
            "ttft_ms": late_ms + tel.ttft_ms, "e2e_ms": late_ms + tel.e2e_ms,
            "finished": called + tel.e2e_ms / 1e3, "prompt_tokens": tel.prompt_tokens,
            "computed_tokens": tel.computed_tokens, "generated_tokens": tel.generated_tokens,
            "encoder_ran": tel.vision_encoder_ran, "preempted": tel.preempted, "prefix_form": tel.prefix_form,
            "prefix_tier": getattr(tel, "prefix_tier", None), "restore_ms": getattr(tel, "restore_ms", 0.0),
            "restored_pages": getattr(tel, "restored_pages", 0), "token_ids": list(done.token_ids),
            "planned": planned, "late_ms": late_ms, "queue_ms": tel.queue_ms, "preprocess_ms": tel.preprocess_ms,
            "vision_ms": tel.vision_ms, "prefill_ms": tel.prefill_ms}


def summarise(results: list[dict], before: dict, after: dict, start: float) -> dict:
    """The measured phase's metrics from its requests' outcomes (:func:`ask`) and the engine's
    counters before and after it (``Engine.stats()``); ``start``: when it began (perf_counter s).

    Times in ms; ``output_tokens_per_s`` = generated tokens / (last finish - start);
    ``recomputed_prompt_tokens`` = prompt tokens prefilled (telemetry ``computed_tokens``);
    evictions are counted during the phase, resident prefixes and their pages at its end.
    """
    ok = [r for r in results if "error" not in r]
    states = [r["state"] for r in ok]
    ttft, e2e = [r["ttft_ms"] for r in ok], [r["e2e_ms"] for r in ok]
    generated = sum(r["generated_tokens"] for r in ok)
    end = max((r["finished"] for r in ok), default=start)

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_messages": sorted({r["error"] for r in results if "error" in r})[:5],
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "e2e_ms_p50": percentile(e2e, 50), "e2e_ms_p99": percentile(e2e, 99),
        "ttft_ms": sorted(ttft),
        "recomputed_prompt_tokens": sum(r["computed_tokens"] for r in ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "hits": states.count("hit"), "misses": states.count("miss"), "stale": states.count("stale"),
        "off": states.count("off"),
        "encoder_runs": sum(r["encoder_ran"] for r in ok),
        "preemptions": sum(r["preempted"] for r in ok),
        "resident_prefixes": int(after.get("cache_prefixes", 0)),
        "resident_entries": int(after.get("cache_entries", 0)),
        "prefix_evictions": delta("cache_prefix_evictions"),
        "pressure_compactions": delta("cache_pressure_compactions"),
        "pressure_pages_freed": delta("cache_pressure_pages_freed"),
        "dense_hits": sum(r["state"] == "hit" and r.get("prefix_form") == "dense" for r in ok),
        "compact_hits": sum(r["state"] == "hit" and r.get("prefix_form") == "compact" for r in ok),
        "outputs_sha256": outputs_hash(results),
        "extension_evictions": delta("cache_extension_evictions"),
        "prefix_pages": int(after.get("cache_prefix_pages", 0)),
        "prefix_pages_dense_equivalent": int(after.get("cache_prefix_pages_dense", 0)),
        "cache_pages": int(after.get("cache_pages", 0)),
        "output_tokens_per_s": generated / (end - start) if end > start else None,
        "generated_tokens": generated,
        "measured_s": end - start,
        "measured_start": start,
        **tier_metrics(ok),
        **host_counters(before, after),
        # where each request's TTFT went (the tail's causes): its arrival after the phase began
        # (``at_ms``), how late the client sent it, the engine's queue / preprocessing / prefill
        "per_request": [{k: r.get(k) for k in ("group", "question", "state", "ttft_ms", "computed_tokens",
                                               "prefix_tier", "restore_ms", "late_ms", "queue_ms",
                                               "preprocess_ms", "vision_ms", "prefill_ms", "error")}
                        | {"at_ms": (r["planned"] - start) * 1e3 if "planned" in r else None}
                        for r in results],
    }


def tier_metrics(ok: list[dict]) -> dict:
    """Hits by tier and the dense share, from answered requests' outcomes (:func:`ask`).

    ``hits_gpu`` / ``hits_host``: hits whose entry was in the KV pool / the host tier at lookup
    (telemetry ``prefix_tier``); ``hits_tier_unreported``: hits of an engine that does not report
    a tier (from before the host tier: all in the pool). ``dense_hit_share``: dense hits / hits;
    ``dense_answer_share``: requests whose prefix kept every visual token (``prefix_form``
    ``"dense"``: the prefix a hit used or a miss cached) / answered requests; None without
    hits / requests. ``restore_ms_p50`` / ``_p99``: over host hits (None without one),
    ``restore_ms_total`` and ``restored_pages`` summed over them.
    """
    hits = [r for r in ok if r["state"] == "hit"]
    host = [r for r in hits if r.get("prefix_tier") == "host"]
    dense_hits = sum(r.get("prefix_form") == "dense" for r in hits)
    restore = [r.get("restore_ms", 0.0) for r in host]
    return {
        "hits_gpu": sum(r.get("prefix_tier") == "gpu" for r in hits), "hits_host": len(host),
        "hits_tier_unreported": sum(r.get("prefix_tier") is None for r in hits),
        "dense_hit_share": dense_hits / len(hits) if hits else None,
        "dense_answer_share": sum(r.get("prefix_form") == "dense" for r in ok) / len(ok) if ok else None,
        "restore_ms_p50": percentile(restore, 50), "restore_ms_p99": percentile(restore, 99),
        "restore_ms_total": sum(restore), "restored_pages": sum(r.get("restored_pages", 0) for r in host),
    }


#: Host-tier counters of ``Engine.stats()`` read at the end of the measured phase (pages, bytes,
#: entries) and those counted during it (differences).
HOST_LEVELS = ("host_pages_total", "host_pages_used", "host_bytes_allocated", "host_cache_bytes",
               "cache_host_entries")
HOST_COUNTS = ("cache_offloads", "cache_restores", "cache_host_evictions", "cache_hits_host", "cache_transfer_failures")


def host_counters(before: dict, after: dict) -> dict:
    """The host tier's counters from ``Engine.stats()`` before and after the measured phase:
    the levels at its end (``host_pages_used`` as ``host_pages_used_end``), the counts as
    differences; every value None on an engine without these counters (from before the tier)."""
    out = {("host_pages_used_end" if k == "host_pages_used" else k): after.get(k) for k in HOST_LEVELS}
    for k in HOST_COUNTS:
        out[k] = int(after[k]) - int(before.get(k, 0)) if k in after else None
    return out


def restore_bandwidth(results: list[dict], page_bytes: int) -> float | None:
    """The effective restore bandwidth in bytes per second: pages the host hits brought back times
    ``page_bytes`` (the KV pool's bytes per page, all layers, scales included), over the
    restores' summed ``restore_ms``. None without a host hit that took time."""
    host = [r for r in results if "error" not in r and r["state"] == "hit" and r.get("prefix_tier") == "host"]
    ms = sum(r.get("restore_ms", 0.0) for r in host)
    if ms <= 0:
        return None
    return sum(r.get("restored_pages", 0) for r in host) * page_bytes / (ms / 1e3)


def restore_size(results: list[dict], page_bytes: int, groups: list[Group]) -> int:
    """The bytes a typical restore moves: the median over host hits of ``restored_pages *
    page_bytes``, or without one the median group's dense prefix (``dense_pages * page_bytes``)."""
    sizes = [r.get("restored_pages", 0) * page_bytes for r in results
             if "error" not in r and r["state"] == "hit" and r.get("prefix_tier") == "host"]
    if not sizes:
        sizes = [(g.dense_pages or 0) * page_bytes for g in groups]
    return max(int(percentile(sizes, 50) or 0), page_bytes)


def copy_floor(nbytes: int, device: torch.device, *, repeats: int = 20) -> dict:
    """The bandwidth a restore of ``nbytes`` could reach: the median of ``repeats`` timed
    contiguous copies of ``nbytes`` bytes (after 3 untimed), from pinned host memory to
    ``device`` on CUDA (CUDA events), or one host buffer to another elsewhere (a plain memcpy,
    ``time.perf_counter``).

    Returns:
        ``copy_floor_bytes`` (int), ``copy_floor_bytes_per_s`` (float), ``copy_floor_kind``
        (``"pinned host -> cuda"`` or ``"host memcpy"``).
    """
    times = []
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for i in range(repeats + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) / 1e3)
        kind = "pinned host -> cuda"
    else:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        for i in range(repeats + 3):
            t = time.perf_counter()
            dst.copy_(src)
            if i >= 3:
                times.append(time.perf_counter() - t)
        kind = "host memcpy"
    seconds = percentile(times, 50)
    return {"copy_floor_bytes": nbytes, "copy_floor_bytes_per_s": nbytes / seconds if seconds else None,
            "copy_floor_kind": kind}


class StatsPoller:
    """Reads one counter of ``Engine.stats()`` every ``interval_s`` seconds from a thread while
    the measured phase runs, keeping its largest value (``peak``; None until read). Each read
    holds the engine loop between two steps for the time of a ``stats()`` call (microseconds), so
    the interval stays coarse.

    Use as a context manager: polling starts on entry and stops (joined) on exit.
    """

    def __init__(self, engine, key: str, interval_s: float = 0.25):
        self.engine, self.key, self.interval_s = engine, key, interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="working-set-stats", daemon=True)

    def sample(self, stats: dict) -> None:
        """Fold one ``stats()`` result into the peak."""
        if self.key in stats:
            value = int(stats[self.key])
            self.peak = value if self.peak is None else max(self.peak, value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample(self.engine.stats())
            except Exception:  # noqa: BLE001  (the engine closed under us: stop polling)
                return

    def __enter__(self) -> StatsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def outputs_hash(results: list[dict]) -> str:
    """SHA-256 hex of every measured request's output token ids, in trace order (a failed request
    counts as its error text), so two variants' outputs can be compared for equality."""
    rows = [r.get("token_ids", r.get("error")) for r in results]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def pool_description(engine) -> dict:
    """The engine's KV pool: bytes (scales included), pages, tokens, and the page format (the
    model dtype's name for ``"auto"``)."""
    from engine.cache.kv_pool import PagePool

    pool, t = engine.pool, engine.config.text
    page_bytes = PagePool.bytes_per_page(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads,
                                         head_dim=t.head_dim, page_size=pool.page_size,
                                         kv_cache_dtype=pool.kv_cache_dtype, model_dtype=engine.dtype)
    dtype = pool.kv_cache_dtype if pool.kv_cache_dtype != "auto" else str(engine.dtype).removeprefix("torch.")
    return {"kv_cache_bytes": pool.num_pages * page_bytes, "kv_page_bytes": page_bytes, "kv_pages": pool.num_pages,
            "kv_tokens": pool.capacity_tokens, "kv_cache_dtype": dtype}


class Deadline:
    """A wall-clock budget for a whole run (seconds; None: no limit): whether one more variant,
    taking about as long as the longest so far, still fits in it."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start, self.longest = seconds, time.perf_counter(), 0.0

    def record(self, seconds: float) -> None:
        """A variant took ``seconds``."""
        self.longest = max(self.longest, seconds)

    def allows_another(self) -> bool:
        if self.seconds is None:
            return True
        return time.perf_counter() - self.start + self.longest <= self.seconds
