"""Prometheus metrics of one app, served at ``GET /metrics`` in Prometheus' text format.

Names follow vLLM's where vLLM has the same quantity, under a ``prism:`` prefix instead of
``vllm:`` (a dashboard built for vLLM needs only the prefix changed, and nobody mistakes Prism's
series for a vLLM server's): ``prism:time_to_first_token_seconds``,
``prism:request_time_per_output_token_seconds``, ``prism:e2e_request_latency_seconds``,
``prism:request_success_total{finished_reason}``, ``prism:prompt_tokens_total``,
``prism:generation_tokens_total``, ``prism:prefix_cache_queries_total`` /
``prism:prefix_cache_hits_total`` (in tokens, as vLLM counts them), ``prism:num_requests_running``,
``prism:num_requests_waiting`` and ``prism:kv_cache_usage_perc`` (a fraction, 1 = full). Prism's
own quantities have their own names: ``prism:prefix_cache_lookups_total{result,tier}`` (requests
whose image prefix was a hit, a miss or stale; ``tier`` is where a hit's entry lived, ``gpu`` or
``host``, and ``none`` for a miss or stale), ``prism:prefix_cache_evictions_total{kind}`` (image
prefixes and conversation extensions apart; an entry moved to the host tier is not evicted),
``prism:prefix_cache_pressure_compactions_total`` and
``prism:prefix_cache_pressure_freed_pages_total`` (compactions made to free pages, and the pages they
freed, under ``--compaction-mode on_pressure``), ``prism:prefix_cache_entries{kind}``,
``prism:kv_cache_pages{state}`` and ``prism:vision_encoder_time_seconds``. The host-memory tier
under the prefix cache (idle prefixes' KV pages offloaded to host RAM, restored on a hit):
``prism:prefix_cache_offloads_total`` (entries moved GPU -> host),
``prism:prefix_cache_restores_total`` (host -> GPU), ``prism:prefix_cache_host_evictions_total``
(entries dropped from the host tier), ``prism:prefix_cache_host_pages{state}`` (``used``, ``free``;
both 0 when the tier is off) and ``prism:prefix_cache_restore_time_seconds`` (per request that hit
the host tier: the host-to-GPU copy, apart from the prefill). Prefixes built before their first
question (issue 34): ``prism:prefix_cache_warms_total{source}`` (warms the engine accepted, by why
they were started: ``upload``, a chat's images changed; ``restart``, recent chats after a start;
``api``, ``POST /v1/prefix_cache/warm``; counted by the app) and
``prism:prefix_cache_warm_results_total{result}`` (the engine's own count of how its warms ended:
``computed``, ``cached`` already when asked, ``cancelled``, ``dropped`` for lack of room).

Over engine replicas (``--replicas``) every engine series carries a ``replica`` label (``replica-0``,
...), one sample per replica that answered the scrape; the request series stay the app's own.

Two sources: each finished request (chat turn or API call) is observed once, by the code that
read its answer, into the request counters and histograms; the engine's own counters and gauges
(:meth:`engine.Engine.stats`) are read when ``/metrics`` is scraped. Only aggregates: no label
names a session, an owner, a key or a prompt.

Each :class:`Metrics` has its own :class:`~prometheus_client.CollectorRegistry`, so several apps
in one process (the tests build many) never share or double-register a series.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from engine import Completion

from .warming import SOURCES

# No "<name>_created" series beside each counter and histogram (vLLM turns them off too): they
# double the page and no dashboard reads them. A process-wide switch of prometheus_client.
prometheus_client.disable_created_metrics()

__all__ = ["FINISHED_REASONS", "WARM_SOURCES", "Metrics", "finished_reason"]

#: Values of ``prism:request_success_total``'s ``finished_reason`` label: vLLM's ``stop``,
#: ``length`` and ``abort`` (cancelled: the user's Stop, a client that went away, a shutdown),
#: and ``error`` (the request failed in the engine).
FINISHED_REASONS = ("stop", "length", "abort", "error")
#: Values of ``prism:prefix_cache_warms_total``'s ``source`` label.
WARM_SOURCES = SOURCES
# Seconds. TTFT spans a prefix hit on a GPU (~10 ms) to a cold multi-image prompt on a CPU (~1 min).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_VISION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Seconds. A restore is one prefix's pages copied host -> GPU, apart from the prefill: from a fraction
# of a millisecond (a small prefix) to about a second (a large one on a busy bus); finer than TTFT's.
_RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def finished_reason(completion: Completion) -> str:
    """The ``finished_reason`` label of a completion: ``stop``, ``length`` or ``abort``."""
    return {"stop": "stop", "length": "length"}.get(completion.finish_reason, "abort")


class Metrics:
    """The app's Prometheus series over ``loader`` (its ``engine`` attribute, None while loading).

    Call :meth:`observe` once per finished request and :meth:`observe_failure` for a request that
    ended without a :class:`~engine.Completion`; :meth:`exposition` renders everything.
    """

    def __init__(self, loader):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prism:request_success", "Requests finished, by finished_reason "
                                "(stop, length, abort: cancelled before the end, error: failed in the engine).",
                                ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:  # every outcome shows, 0 until it happens
            self.requests.labels(reason)
        self.rejected = Counter("prism:api_requests_rejected", "API requests refused before reaching the engine, "
                                "by HTTP status (400 bad input, 401 no or wrong key, 404 unknown model, 429 busy, "
                                "503 loading or shutting down).", ["status"], registry=r)
        self.ttft = Histogram("prism:time_to_first_token_seconds", "Time to first token (from submission).",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("prism:request_time_per_output_token_seconds", "Per request: mean time per output "
                              "token after the first (TPOT).", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("prism:e2e_request_latency_seconds", "Time from submission to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.vision = Histogram("prism:vision_encoder_time_seconds", "Per request whose vision encoder ran: time "
                                "spent in it (a prefix hit skips it).", buckets=_VISION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("prism:prompt_tokens", "Prompt tokens of finished requests (visual tokens "
                                     "included).", registry=r)
        self.generation_tokens = Counter("prism:generation_tokens", "Tokens generated by finished requests.",
                                         registry=r)
        self.prefix_queries = Counter("prism:prefix_cache_queries", "Prefix cache queries, in prompt tokens of "
                                      "finished requests (as vLLM counts them).", registry=r)
        self.prefix_hits = Counter("prism:prefix_cache_hits", "Prefix cache hits, in prompt tokens whose KV was "
                                   "reused (image prefix and conversation).", registry=r)
        self.restore = Histogram("prism:prefix_cache_restore_time_seconds", "Per request whose prefix hit was "
                                 "served from the host-memory tier: time copying its KV pages back to the GPU "
                                 "(not part of the prefill).", buckets=_RESTORE_BUCKETS, registry=r)
        self.warms = Counter("prism:prefix_cache_warms", "Prefix warms started (the engine accepted them), by "
                             "source: upload (a chat's images changed), restart (recent chats after a start), "
                             "api (POST /v1/prefix_cache/warm).", ["source"], registry=r)
        for source in WARM_SOURCES:
            self.warms.labels(source)
        r.register(_EngineCollector(loader))

    def observe(self, completion: Completion) -> None:
        """Count one finished request and its timings (seconds) and tokens."""
        tel = completion.telemetry
        self.requests.labels(finished_reason(completion)).inc()
        if tel.ttft_ms > 0:  # a request cancelled before its first token has none
            self.ttft.observe(tel.ttft_ms / 1e3)
        if tel.generated_tokens > 1:
            self.tpot.observe(tel.tpot_ms / 1e3)
        self.e2e.observe(tel.e2e_ms / 1e3)
        if tel.vision_encoder_ran:
            self.vision.observe(tel.vision_ms / 1e3)
        if tel.prefix_tier == "host":
            self.restore.observe(tel.restore_ms / 1e3)
        self.prompt_tokens.inc(tel.prompt_tokens)
        self.generation_tokens.inc(tel.generated_tokens)
        self.prefix_queries.inc(tel.prompt_tokens)
        self.prefix_hits.inc(tel.cached_tokens)

    def observe_failure(self, reason: str) -> None:
        """Count a request that ended without a completion: ``"error"`` (failed in the engine)
        or ``"abort"`` (its reader went away)."""
        self.requests.labels(reason if reason in FINISHED_REASONS else "error").inc()

    def observe_warm(self, source: str) -> None:
        """Count one warm the engine accepted, started for ``source`` (one of :data:`WARM_SOURCES`)."""
        self.warms.labels(source if source in WARM_SOURCES else "api").inc()

    def observe_rejected(self, status: int) -> None:
        """Count an API request refused with HTTP ``status`` before it reached the engine."""
        self.rejected.labels(str(int(status))).inc()

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """Every series, and the content type, in the format the scraper's ``Accept`` header asks
        for (prometheus_client's negotiation: Prometheus' text format unless it asks for
        OpenMetrics)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _EngineCollector:
    """The engine's counters and gauges, read from :meth:`engine.Engine.stats` at each scrape
    (nothing while the model loads or after the engine closed). Over replicas (``--replicas``)
    every series carries a ``replica`` label, one sample per replica that answered (the sums are
    the scraper's: ``sum without (replica)``)."""

    def __init__(self, loader):
        self.loader = loader

    def collect(self):
        engine = getattr(self.loader, "engine", None)
        try:
            samples = _samples(engine) if engine is not None else []
        except Exception:  # closed during shutdown
            samples = []
        if not samples:
            return
        f = _Families(["replica"] if hasattr(engine, "replica_status") else [], samples)
        yield f.gauge("prism:num_requests_running", "Requests in the engine's running batch.",
                      lambda s: s["running"])
        yield f.gauge("prism:num_requests_waiting", "Requests waiting for the engine.", lambda s: s["waiting"])
        yield f.gauge("prism:kv_cache_usage_perc", "KV pool pages in use, prefix-cache entries included, as a "
                      "fraction (1 = full).", lambda s: s["pages_used"] / (s["pages_total"] or 1))
        yield f.gauge("prism:kv_cache_pages", "KV pool pages: held by running requests only, held by prefix-cache "
                      "entries, free.", lambda s: [(["running"], max(0, s["pages_used"] - s.get("cache_pages", 0))),
                                                   (["cached"], s.get("cache_pages", 0)),
                                                   (["free"], s["pages_free"])], labels=["state"])
        f.samples = [(values, s) for values, s in samples if s.get("prefix_cache")]
        if not f.samples:
            return
        yield f.counter("prism:prefix_cache_lookups", "Requests with images, by what their image prefix was: hit "
                        "(reused), miss (computed and cached), stale (found, then evicted before the request ran: "
                        "computed again); and, for a hit, where the entry lived (gpu: the KV pool, host: the "
                        "host-memory tier, restored first; none for a miss or stale).", _lookups,
                        labels=["result", "tier"])
        yield f.counter("prism:prefix_cache_evictions", "Prefix-cache entries evicted: image prefixes, and "
                        "conversation extensions (finished turns kept for reuse).",
                        lambda s: [(["prefix"], s["cache_prefix_evictions"]),
                                   (["extension"], s["cache_extension_evictions"])], labels=["kind"])
        yield f.counter("prism:prefix_cache_pressure_compactions", "Image prefixes compacted one step to free KV "
                        "pages (compaction_mode on_pressure).", lambda s: s.get("cache_pressure_compactions", 0))
        yield f.counter("prism:prefix_cache_pressure_freed_pages", "KV pages freed by those compactions.",
                        lambda s: s.get("cache_pressure_pages_freed", 0))
        yield f.gauge("prism:prefix_cache_entries", "Prefix-cache entries held: image prefixes, conversation "
                      "extensions.", lambda s: [(["prefix"], s["cache_prefixes"]),
                                                (["extension"], s["cache_entries"] - s["cache_prefixes"])],
                      labels=["kind"])
        yield from _host_tier(f)
        yield f.counter("prism:prefix_cache_warm_results", "Prefix warms, by how they ended in the engine: "
                        "computed (built), cached (already cached when asked, or built meanwhile by another "
                        "request), cancelled, dropped (no room for it).",
                        lambda s: [([r], s.get(f"warms_{r}", 0)) for r in ("computed", "cached", "cancelled",
                                                                            "dropped")], labels=["result"])
        yield f.counter("prism:prefix_cache_warm_deferred_steps", "Engine steps in which a warm waited for "
                        "the warms' time budget (the share of the engine's time they may take while questions "
                        "run: EngineOptions.warm_time_share).", lambda s: s.get("warms_deferred_steps", 0))


def _samples(engine) -> list[tuple[list[str], dict]]:
    """``(replica label values, stats)`` per engine: one with no label, or one per replica that
    answered (:meth:`~engine.replicas.ReplicaClient.replica_status`)."""
    if hasattr(engine, "replica_status"):
        return [([r["id"]], r["stats"]) for r in engine.replica_status() if r.get("stats")]
    return [([], engine.stats())]


class _Families:
    """Metric families over ``samples`` (``(label values, stats)``), each family's labels
    prefixed with ``prefix`` (``["replica"]`` or none). A value function returns one number, or
    ``(label values, number)`` pairs for the family's own labels."""

    def __init__(self, prefix: list[str], samples: list[tuple[list[str], dict]]):
        self.prefix, self.samples = prefix, samples

    def gauge(self, name: str, documentation: str, value, labels=()):
        return self._fill(GaugeMetricFamily(name, documentation, labels=[*self.prefix, *labels]), value)

    def counter(self, name: str, documentation: str, value, labels=()):
        return self._fill(CounterMetricFamily(name, documentation, labels=[*self.prefix, *labels]), value)

    def _fill(self, family, value):
        for values, stats in self.samples:
            got = value(stats)
            for own, number in got if isinstance(got, list) else [([], got)]:
                family.add_metric([*values, *own], number)
        return family


def _lookups(s: dict) -> list[tuple[list[str], int]]:
    """``prism:prefix_cache_lookups_total{result,tier}`` from the engine's counters. Read from
    stats like the rest of this family always was (a request that never finished, or whose
    reader went away, was still looked up); a hit's tier is split out of ``cache_hits`` by
    ``cache_hits_host`` (0 on an engine without the tier: every hit a GPU one)."""
    host_hits = s.get("cache_hits_host", 0)
    return [(["hit", "gpu"], max(0, s["cache_hits"] - host_hits)), (["hit", "host"], host_hits),
            (["miss", "none"], s["cache_misses"]), (["stale", "none"], s["cache_stale"])]


def _host_tier(f: _Families):
    """The host-memory tier's counters and page gauge (all 0 when the tier is off or the engine
    predates it: the series stay, so a dashboard's query never goes empty)."""
    yield f.counter("prism:prefix_cache_offloads", "Prefix-cache entries moved from the KV pool to the host-memory "
                    "tier (their pages freed on the GPU).", lambda s: s.get("cache_offloads", 0))
    yield f.counter("prism:prefix_cache_restores", "Prefix-cache entries copied back from the host tier to the KV "
                    "pool for a hit.", lambda s: s.get("cache_restores", 0))
    yield f.counter("prism:prefix_cache_host_evictions", "Prefix-cache entries dropped from the host tier (gone "
                    "from the cache).", lambda s: s.get("cache_host_evictions", 0))
    yield f.gauge("prism:prefix_cache_host_pages", "Host-tier pages: used by offloaded entries, free (both 0 when "
                  "the tier is off).", lambda s: [(["used"], s.get("host_pages_used", 0)),
                                                 (["free"], max(0, s.get("host_pages_total", 0)
                                                                - s.get("host_pages_used", 0)))],
                  labels=["state"])
