"""``GET /metrics``: Prometheus' text format, vLLM's names under ``prism:``, only aggregates,
behind the API key when keys are configured, and one registry per app."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from app.chat import ChatOptions
from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings
from sessions import SessionStore

OWNER = "m" * 43
#: Every label a Prism series may carry: outcomes, tiers, kinds, states and sources (why a warm started), never
#: a session, key or prompt.
ALLOWED_LABELS = {"finished_reason", "status", "result", "tier", "kind", "state", "source", "le"}


def make_app(tmp_path, engine, **settings):
    store = SessionStore(tmp_path / "data")
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"))
    app = create_app(Settings(data_dir=tmp_path / "data", **settings), store, loader, mount_ui=False)
    return app, store


def scrape(client, **headers) -> dict:
    """``/metrics`` parsed: {sample name: {frozenset(labels.items()): value}}."""
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")  # Prometheus' text format
    samples: dict = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return samples


def one(samples, name, **labels) -> float:
    return samples[name][frozenset(labels.items())]


@pytest.fixture
def engine(tiny_engine_factory):
    """A fresh engine per test: its counters start at zero."""
    return tiny_engine_factory(kv_cache_bytes=32 << 20)


@pytest.fixture(scope="module")
def photo(media_path):
    return media_path("coffee.png")


def test_requests_latencies_cache_and_pool_in_prometheus_format(tmp_path, engine, photo):
    """A chat answer about an image (a miss), a second one (a hit, the vision encoder skipped),
    an API answer, an API request for a model that is not served, and a stopped chat answer:
    each shows in its series, named as vLLM names them under ``prism:``, plus the engine's
    prefix-cache lookups, evictions apart by kind, and KV pool usage. (Without prefix warming,
    so the first answer is the miss; tests/test_app_warm.py counts the warms.)"""
    app, store = make_app(tmp_path, engine, warm="off")
    chat = app.state.chat
    with TestClient(app) as client:
        session, _ = chat.add_images(None, OWNER, [(photo.name, photo)])
        for question in ("What is this?", "And the colours?"):
            final = list(chat.ask(session.id, OWNER, question, ChatOptions(max_tokens=4, history=True)))[-1]
            assert final.status == "done"
        ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 3})
        assert ok.status_code == 200
        assert client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": []}).status_code == 404
        active = chat.ask(session.id, OWNER, "Talk for long", ChatOptions(max_tokens=1000))
        stream = iter(active)
        next(stream), next(stream)  # under way
        chat.stop(session.id, OWNER)
        assert list(stream)[-1].status == "cancelled"
        engine.clear_prefix_cache()
        m = scrape(client)
    store.close()
    finished = {r: one(m, "prism:request_success_total", finished_reason=r) for r in ("stop", "length", "abort",
                                                                                      "error")}
    assert finished["stop"] + finished["length"] == 3 and finished["abort"] == 1 and finished["error"] == 0
    assert one(m, "prism:api_requests_rejected_total", status="404") == 1
    assert one(m, "prism:time_to_first_token_seconds_count") == 4  # the stopped one had its first token
    assert one(m, "prism:request_time_per_output_token_seconds_count") >= 3
    assert one(m, "prism:e2e_request_latency_seconds_count") == 4
    assert one(m, "prism:vision_encoder_time_seconds_count") == 1  # only the miss ran the encoder
    assert one(m, "prism:time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert one(m, "prism:prefix_cache_lookups_total", result="miss", tier="none") == 1
    assert one(m, "prism:prefix_cache_lookups_total", result="hit", tier="gpu") == 2
    assert one(m, "prism:prefix_cache_lookups_total", result="hit", tier="host") == 0  # no host tier here
    assert one(m, "prism:prefix_cache_lookups_total", result="stale", tier="none") == 0
    assert one(m, "prism:prefix_cache_hits_total") > 0
    assert one(m, "prism:prefix_cache_queries_total") > one(m, "prism:prefix_cache_hits_total")
    assert one(m, "prism:prefix_cache_evictions_total", kind="prefix") == 1  # the clear
    assert one(m, "prism:prefix_cache_evictions_total", kind="extension") >= 1  # the turns kept for reuse
    assert one(m, "prism:prefix_cache_entries", kind="prefix") == 0
    # the app's default compaction mode is "always": nothing is compacted on pressure
    assert one(m, "prism:prefix_cache_pressure_compactions_total") == 0
    assert one(m, "prism:prefix_cache_pressure_freed_pages_total") == 0
    assert 0 <= one(m, "prism:kv_cache_usage_perc") <= 1
    assert one(m, "prism:num_requests_running") == 0 and one(m, "prism:num_requests_waiting") == 0
    assert one(m, "prism:kv_cache_pages", state="free") > 0
    assert one(m, "prism:prefix_cache_host_pages", state="used") == 0  # the tier is off: its series read 0
    assert one(m, "prism:prefix_cache_host_pages", state="free") == 0
    assert one(m, "prism:prefix_cache_offloads_total") == 0 and one(m, "prism:prefix_cache_restores_total") == 0
    assert one(m, "prism:prefix_cache_restore_time_seconds_count") == 0
    assert one(m, "prism:generation_tokens_total") > 0 and one(m, "prism:prompt_tokens_total") > 0


def test_metrics_name_no_session_owner_key_or_prompt(tmp_path, engine, photo):
    """Only aggregate series: after a chat session and keyed API requests, ``/metrics`` holds
    none of the session id, its cache salt, the owner key, the API key, the prompt_cache_key or
    the questions, and every label is an outcome, tier, kind or state (what an attacker scraping the
    page learns is how busy the server is, not who asked what)."""
    app, store = make_app(tmp_path, engine, api_keys=("secret-api-key-1",))
    chat = app.state.chat
    auth = {"Authorization": "Bearer secret-api-key-1"}
    with TestClient(app) as client:
        session, _ = chat.add_images(None, OWNER, [(photo.name, photo)])
        list(chat.ask(session.id, OWNER, "Question-about-my-cat?", ChatOptions(max_tokens=2)))
        png = base64.b64encode(photo.read_bytes()).decode()
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "text", "text": "Api-question-xyz?"}]}], "max_tokens": 2, "prompt_cache_key": "pck-7f3a9"}
        assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        text = client.get("/metrics", headers=auth).text
        families = list(text_string_to_metric_families(text))
    store.close()
    for secret in (session.id, session.cache_salt, OWNER, "secret-api-key-1", "pck-7f3a9", "Question-about-my-cat",
                   "Api-question-xyz"):
        assert secret not in text
    labels = {name for f in families for s in f.samples for name in s.labels}
    assert labels <= ALLOWED_LABELS, labels
    assert all(f.name.startswith("prism:") for f in families)


def test_metrics_need_the_api_key_when_keys_are_configured(tmp_path, engine):
    """With API keys configured, /metrics is an API like /v1: no key or a wrong one is OpenAI's
    401 and no metrics; without keys it is open, like /healthz."""
    keyed, store = make_app(tmp_path / "keyed", engine, api_keys=("k-one",))
    with TestClient(keyed) as client:
        for headers in ({}, {"Authorization": "Bearer k-two"}, {"Authorization": "k-one"}):
            r = client.get("/metrics", headers=headers)
            assert r.status_code == 401 and "prism:" not in r.text and r.json()["error"]["type"]
        assert "prism:request_success_total" in client.get("/metrics", headers={"Authorization": "Bearer k-one"}).text
    store.close()
    open_app, store = make_app(tmp_path / "open", engine)
    with TestClient(open_app) as client:
        assert "prism:request_success_total" in client.get("/metrics").text
    store.close()


def test_each_app_counts_into_its_own_registry(tmp_path, engine):
    """Tests (and any process) build many apps: each has its own registry, so a second app
    neither fails with "Duplicated timeseries" nor counts the first one's requests, and nothing
    goes to prometheus_client's global registry."""
    first, store_a = make_app(tmp_path / "a", engine)
    second, store_b = make_app(tmp_path / "b", engine)
    hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with TestClient(first) as a, TestClient(second) as b:
        assert a.post("/v1/chat/completions", json=hi).status_code == 200
        done = lambda m: sum(m["prism:request_success_total"].values())  # noqa: E731
        assert done(scrape(a)) == 1 and done(scrape(b)) == 0
    store_a.close(), store_b.close()
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("prism:")]


# ---------------------------------------------------------------------------------- issue 33: the host tier
#: An engine's stats with the host-memory tier on: 5 hits of which 2 from the host tier.
HOST_TIER_STATS = {
    "running": 1, "waiting": 0, "pages_total": 100, "pages_used": 40, "pages_free": 60, "cache_pages": 30,
    "prefix_cache": True, "cache_hits": 5, "cache_misses": 3, "cache_stale": 1, "cache_prefix_evictions": 1,
    "cache_extension_evictions": 2, "cache_prefixes": 2, "cache_entries": 4,
    "host_pages_total": 400, "host_pages_used": 103, "host_bytes_allocated": 103 << 16, "cache_offloads": 7,
    "cache_restores": 2, "cache_host_evictions": 4, "cache_hits_host": 2, "cache_host_entries": 3,
    "host_cache_bytes": 400 << 16,
}


class FakeEngine:
    """Only what the scrape reads: ``stats()``."""

    def __init__(self, stats: dict):
        self._stats = stats

    def stats(self) -> dict:
        return dict(self._stats)


def metrics_over(stats: dict):
    import types

    from app.metrics import Metrics

    return Metrics(types.SimpleNamespace(engine=FakeEngine(stats)))


def parse(metrics) -> dict:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain; version=")
    samples: dict = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return samples


def completion(**telemetry):
    from engine import Completion, Telemetry

    return Completion("ok", [1], [2, 3], "stop", Telemetry(prompt_tokens=2, generated_tokens=1, ttft_ms=5.0,
                                                           e2e_ms=6.0, **telemetry))


def test_host_tier_series_from_the_engine_stats():
    """Hits split by tier (``cache_hits`` includes the host hits: gpu = 5 - 2), miss and stale
    under ``tier="none"``, the tier's moves as counters and its pages used / free as a gauge."""
    m = parse(metrics_over(HOST_TIER_STATS))
    lookups = {dict(k)["result"] + "/" + dict(k)["tier"]: v for k, v in m["prism:prefix_cache_lookups_total"].items()}
    assert lookups == {"hit/gpu": 3, "hit/host": 2, "miss/none": 3, "stale/none": 1}
    assert one(m, "prism:prefix_cache_offloads_total") == 7
    assert one(m, "prism:prefix_cache_restores_total") == 2
    assert one(m, "prism:prefix_cache_host_evictions_total") == 4
    assert one(m, "prism:prefix_cache_host_pages", state="used") == 103
    assert one(m, "prism:prefix_cache_host_pages", state="free") == 297
    # a move to the host tier is not an eviction: evictions read the engine's own counts only
    assert one(m, "prism:prefix_cache_evictions_total", kind="prefix") == 1


def test_an_engine_without_the_host_tier_keys_reads_as_the_tier_off():
    """An older engine's stats lack every host key: every hit is a GPU one and the tier's series
    read 0 (never a KeyError that would drop the whole scrape)."""
    old = {k: v for k, v in HOST_TIER_STATS.items() if not (k.startswith("host_") or k in (
        "cache_offloads", "cache_restores", "cache_host_evictions", "cache_hits_host", "cache_host_entries"))}
    m = parse(metrics_over(old))
    assert one(m, "prism:prefix_cache_lookups_total", result="hit", tier="gpu") == 5
    assert one(m, "prism:prefix_cache_lookups_total", result="hit", tier="host") == 0
    for name in ("offloads", "restores", "host_evictions"):
        assert one(m, f"prism:prefix_cache_{name}_total") == 0
    assert one(m, "prism:prefix_cache_host_pages", state="used") == 0
    assert one(m, "prism:prefix_cache_host_pages", state="free") == 0


def test_restore_time_is_observed_per_host_hit_only():
    """``prism:prefix_cache_restore_time_seconds`` counts the requests whose hit came from the host
    tier, in seconds (2.6 ms lands in the 5 ms bucket, not the 2.5 ms one); a GPU hit and a miss
    add nothing to it."""
    metrics = metrics_over(HOST_TIER_STATS)
    metrics.observe(completion(prefix_cache="hit", prefix_tier="host", restore_ms=2.6, restored_pages=103))
    metrics.observe(completion(prefix_cache="hit", prefix_tier="host", restore_ms=40.0, restored_pages=900))
    metrics.observe(completion(prefix_cache="hit", prefix_tier="gpu"))
    metrics.observe(completion(prefix_cache="miss"))
    m = parse(metrics)
    assert one(m, "prism:prefix_cache_restore_time_seconds_count") == 2
    assert one(m, "prism:prefix_cache_restore_time_seconds_sum") == pytest.approx(0.0426)
    bucket = lambda le: one(m, "prism:prefix_cache_restore_time_seconds_bucket", le=le)  # noqa: E731
    assert bucket("0.0005") == 0 and bucket("0.0025") == 0 and bucket("0.005") == 1
    assert bucket("0.05") == 2 and bucket("1.0") == 2 and bucket("+Inf") == 2
    assert one(m, "prism:request_success_total", finished_reason="stop") == 4
