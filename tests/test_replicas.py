"""Engine replicas on Ray Serve (``engine.replicas.ReplicaClient``): a real local Ray instance with
two replicas of the tiny "test" checkpoint, started once for the module (fractional CPUs: the CI
machine has two cores). ``-m "not replicas"`` leaves the module out; ``.ci/run`` runs it.

Requests take an authenticated connection to each replica (``engine.replicas.link``); Serve
places and restarts them. A second app front on the same Ray instance deploys replicas of its
own beside the first's.

The oracle is the single-engine app's engine (``ProcessClient``) with the same options and
threads: greedy answers equal token for token. What routing promises is read from each
replica's own counters: every session's second question is a hit on the replica that answered
its first, and a killed replica's sessions miss once on the other replica and then hit there,
while the other replica's sessions keep hitting. The killed replica's in-flight stream ends with
``EngineAbortedError`` well before any timeout, and Serve brings the replica back. The ring's own
properties are in tests/test_ring.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import TEST_DEVICE, noise_png

from engine import (
    EngineAbortedError,
    InvalidImageError,
    SamplingParams,
    media_first_messages,
)
from engine import client as engine_client
from engine.client import KeyLRU, ProcessClient  # noqa: E402

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[test]')")

from engine.replicas import ReplicaClient  # noqa: E402
from engine.replicas import link as replica_link  # noqa: E402

pytestmark = [pytest.mark.replicas, pytest.mark.timeout(300)]

OPTIONS = dict(device=TEST_DEVICE, progress=False, kv_cache_bytes=32 << 20)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    """The single-engine app's engine (its default, the core in a child process) with the thread
    count Ray gives a replica of less than one CPU (``OMP_NUM_THREADS=1``, read by torch at start):
    on the CPU another thread count sums in another order, and the tiny random model's near-ties
    then part after a few tokens (measured: token 8 of one of three prompts)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        engine = ProcessClient(tiny_ckpt, **OPTIONS)
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def replicas(tiny_ckpt):
    client = ReplicaClient(tiny_ckpt, replicas=2, replica_cpus=0.5, num_cpus=2, probe_interval_s=0.5, **OPTIONS)
    yield client
    client.close()


def counters(client) -> dict[str, dict]:
    return {r["id"]: r["stats"] for r in client.replica_status()}


def ask(client, salt: str, image: bytes, question: str = "What is in the picture?"):
    return client.generate(media_first_messages([image], question), GREEDY, cache_salt=salt)


def test_eight_sessions_spread_over_both_and_each_second_question_hits_its_own_replica(replicas, local):
    before = counters(replicas)
    images = {f"spread-{i}": noise_png(100 + i) for i in range(8)}
    first = {salt: ask(replicas, salt, image) for salt, image in images.items()}
    placed = {salt: replicas.replica_of(salt) for salt in images}
    assert set(placed.values()) == {"replica-0", "replica-1"}, placed
    second = {salt: ask(replicas, salt, image) for salt, image in images.items()}
    after = counters(replicas)
    assert all(replicas.replica_of(salt) == placed[salt] for salt in images)  # never split
    assert all(first[s].telemetry.prefix_cache == "miss" and second[s].telemetry.prefix_cache == "hit" for s in images)
    for name in ("replica-0", "replica-1"):
        mine = sum(1 for s in images if placed[s] == name)
        assert after[name]["cache_hits"] - before[name]["cache_hits"] == mine
        assert after[name]["cache_misses"] - before[name]["cache_misses"] == mine
    for salt, image in list(images.items())[:3]:  # greedy answers equal the single engine's
        theirs = local.generate(media_first_messages([image], "What is in the picture?"), GREEDY, cache_salt=salt)
        assert first[salt].token_ids == second[salt].token_ids == theirs.token_ids
        assert first[salt].text == theirs.text


def test_a_stream_yields_the_same_deltas_and_the_stats_are_the_sum(replicas, local):
    messages = [{"role": "user", "content": "Tell me a story."}]
    handle = replicas.submit(messages, GREEDY, cache_salt="deltas")
    ours = list(handle)
    theirs = list(local.stream(messages, GREEDY, cache_salt="deltas"))
    assert [d for d in ours if isinstance(d, str)] == [d for d in theirs if isinstance(d, str)]
    assert handle.prompt_tokens == len(theirs[-1].prompt_token_ids)
    each = counters(replicas)
    total = replicas.stats()
    assert total["pages_total"] == sum(s["pages_total"] for s in each.values())
    assert total["page_size"] == each["replica-0"]["page_size"] and total["replicas_ready"] == 2


def test_an_image_travels_once_per_replica_and_session(replicas, monkeypatch):
    sent = []
    real = engine_client.send_blobs

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        sent.append(sum(len(b) for b in out[1].values()))
        return out

    monkeypatch.setattr(engine_client, "send_blobs", recording)
    image = noise_png(7, size=(160, 120))
    ask(replicas, "once", image)
    ask(replicas, "once", image, "And now?")
    ask(replicas, "once-other", image)  # another session: the bytes go again (per session, as every cache)
    assert sent[0] == len(image) and sent[1] == 0 and sent[2] == len(image)


def test_a_path_is_read_and_sent_as_bytes_and_the_second_question_hits(replicas, tmp_path, monkeypatch):
    sent = []
    real = engine_client.send_blobs
    monkeypatch.setattr(engine_client, "send_blobs", lambda *a, **k: sent.append(real(*a, **k)) or sent[-1])
    path = tmp_path / "photo.png"
    path.write_bytes(noise_png(8))
    parts = [{"image": str(path)}]
    first = replicas.generate(media_first_messages(parts, "What?"), GREEDY, cache_salt="path")
    second = replicas.generate(media_first_messages(parts, "And?"), GREEDY, cache_salt="path")
    assert list(sent[0][1].values()) == [path.read_bytes()] and sent[1][1] == {}  # bytes, not the path
    assert (first.telemetry.prefix_cache, second.telemetry.prefix_cache) == ("miss", "hit")


def test_a_warm_routes_like_the_questions_and_makes_the_first_a_warmed_hit(replicas):
    image = noise_png(9)
    warm = replicas.warm([image], cache_salt="warmed")
    assert warm.result(120) == warm.prefix_tokens > 0
    first = ask(replicas, "warmed", image)
    assert (first.telemetry.prefix_cache, first.telemetry.warmed) == ("hit", True)


def test_input_errors_raise_at_submit_as_in_process(replicas, local):
    bad = media_first_messages([b"not an image"], "What?")
    with pytest.raises(InvalidImageError) as ours:
        replicas.submit(bad, GREEDY, cache_salt="bad")
    with pytest.raises(InvalidImageError) as theirs:
        local.submit(bad, GREEDY, cache_salt="bad")
    assert str(ours.value) == str(theirs.value)


def test_cancel_ends_the_stream_and_frees_the_replica(replicas):
    handle = replicas.submit([{"role": "user", "content": "Go on."}], SamplingParams(max_tokens=2000, temperature=0.0),
                             cache_salt="cancel")
    stream = iter(handle)
    assert isinstance(next(stream), str)
    handle.cancel(wait=True)
    assert list(stream)[-1].finish_reason == "cancelled"
    name = replicas.replica_of("cancel")
    assert counters(replicas)[name]["running"] == 0


def test_forget_reaches_every_replica_and_the_next_question_misses(replicas):
    image = noise_png(10)
    ask(replicas, "forgotten", image)
    done = replicas.forget("forgotten")
    assert done.sessions == 1 and done.cache_entries >= 1
    assert ask(replicas, "forgotten", image).telemetry.prefix_cache == "miss"


def test_healthz_lists_the_replicas_metrics_label_them_and_keys_guard_the_detail(replicas, tmp_path):
    from fastapi.testclient import TestClient

    from app.model_loader import ModelChoice, ModelLoader
    from app.server import create_app
    from app.settings import Settings
    from sessions import SessionStore

    store = SessionStore(tmp_path)
    choice = ModelChoice("tiny", "tiny", True, "test")
    try:
        for keys in ((), ("sekrit",)):
            settings = Settings(data_dir=tmp_path, api_keys=keys)
            app = create_app(settings, store, ModelLoader.ready(replicas, choice, settings), mount_ui=False)
            with TestClient(app) as http:
                health = http.get("/healthz")
                assert health.status_code == 200 and health.json()["status"] == "ok"
                entries = health.json()["replicas"]
                assert [(r["id"], r["state"]) for r in entries] == [("replica-0", "ready"), ("replica-1", "ready")]
                if keys:
                    assert all(set(r) == {"id", "state"} for r in entries)
                    entries = http.get("/healthz", headers={"Authorization": "Bearer sekrit"}).json()["replicas"]
                    metrics = http.get("/metrics", headers={"Authorization": "Bearer sekrit"}).text
                else:
                    metrics = http.get("/metrics").text
                assert all(r["pages_total"] > 0 and "cache_hits" in r and "sessions" in r for r in entries)
                assert health.json()["engine"]["pages_total"] == sum(r["pages_total"] for r in entries)
                for name in ("replica-0", "replica-1"):
                    assert f'prism:kv_cache_usage_perc{{replica="{name}"}}' in metrics
                    assert f'prism:prefix_cache_lookups_total{{replica="{name}",result="hit",tier="gpu"}}' in metrics
    finally:
        store.close()


def listening(pids: set[int]) -> dict[str, set[int]]:
    """The local addresses of the TCP sockets ``pids`` listen on (``/proc``: state 0A), each
    with the processes that listen there."""
    import ipaddress

    inodes: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                fields = row.split()
                if fields[3] != "0A":
                    continue
                raw = fields[1].split(":")[0]
                packed = bytes.fromhex(raw)  # each 32-bit word little-endian
                packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))
                address = ipaddress.ip_address(packed)
                inodes[fields[9]] = str(getattr(address, "ipv4_mapped", None) or address)
    found = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.setdefault(inodes[target[8:-1]], set()).add(pid)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def ray_pids() -> set[int]:
    """The local Ray instance's processes (GCS, raylet, agents, monitors) and their descendants
    (the workers: the replicas, Serve's controller), and this driver."""
    import ray

    roots = {info.process.pid for infos in ray._private.worker._global_node.all_processes.values()
             for info in infos if info.process is not None}
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    pids, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo.extend(children.get(pid, ()))
    return pids | {os.getpid()}


def test_the_request_path_listens_on_loopback_and_refuses_a_wrong_key(replicas):
    """The local instance's every Ray process (GCS, raylet, object manager, agents, workers, each
    replica's Serve gRPC server among them) listens on loopback only, and so does each replica's
    request port."""
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    pids = ray_pids()
    assert {replicas.replica_info(n)["pid"] for n in ("replica-0", "replica-1")} <= pids
    addresses = listening(pids)
    assert addresses and set(addresses) == {"127.0.0.1"}, {a: [_cmdline(p) for p in ps] for a, ps in
                                                          addresses.items()}
    info = replicas._replicas["replica-0"].info
    assert info["link"][0] == "127.0.0.1" and "authkey" not in replicas.replica_info("replica-0")
    with pytest.raises(PermissionError):
        replica_link.ReplicaLink(info["link"], bytes(32), keys=KeyLRU(1 << 20), aborted=EngineAbortedError,
                                 on_lost=lambda link: None, id_prefix="intruder", timeout=10)
    assert ask(replicas, "after-intruder", noise_png(11)).telemetry.prefix_cache == "miss"  # still serving


def test_two_app_fronts_on_one_cluster_deploy_their_own_replicas(replicas, tiny_ckpt):
    """A second front joining the same Ray instance deploys its replica under its own Serve
    application (``prism-<front>-replica-0``), not over the first front's; closing it deletes only its own."""
    from ray import serve

    from engine.replicas.cluster import app_name

    mine = {app_name(replicas.front_id, n) for n in ("replica-0", "replica-1")}
    other = ReplicaClient(tiny_ckpt, replicas=1, replica_cpus=0.5, probe_interval_s=0.5, **OPTIONS)
    theirs = app_name(other.front_id, "replica-0")
    try:
        assert other.front_id != replicas.front_id and theirs not in mine
        assert other.replica_info("replica-0")["link"][0] == "127.0.0.1"  # its node's address (joined)
        assert mine | {theirs} <= set(serve.status().applications)
        image = noise_png(12)
        assert [ask(other, "front-b", image).telemetry.prefix_cache for _ in range(2)] == ["miss", "hit"]
        assert other.replica_info("replica-0")["pid"] not in {replicas.replica_info(n)["pid"] for n in
                                                               ("replica-0", "replica-1")}
    finally:
        other.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and theirs in serve.status().applications:
        time.sleep(0.5)
    assert theirs not in serve.status().applications and mine <= set(serve.status().applications)
    assert all(r["state"] == "ready" for r in replicas.replica_status())
    image = noise_png(13)
    assert [ask(replicas, "front-a", image).telemetry.prefix_cache for _ in range(2)] == ["miss", "hit"]


def salts_by_home(nodes: list[str], target: str, want: int, others: int) -> tuple[list[str], list[str]]:
    """Session salts whose ring home among ``nodes`` is ``target`` (``want`` of them) and is not
    (``others``): the ring is deterministic, so which sessions an added replica takes is known."""
    from engine.replicas.client import _salt_key
    from engine.replicas.ring import HashRing

    ring, home, away = HashRing(nodes), [], []
    for i in range(1000):
        salt = f"resize-{i}"
        (home if ring.home(_salt_key(salt)) == target else away).append(salt)
    return home[:want], away[:others]


def test_a_replica_added_at_run_time_takes_its_home_sessions_and_a_removed_one_only_its_own(replicas, tmp_path):
    """``POST /admin/replicas`` (behind the API key) adds replica-2: exactly the sessions whose ring
    home it becomes move to it (a miss there, then hits), the others stay and hit. Removing it
    (``DELETE /admin/replicas/replica-2``) ends its stream in flight with the retryable error and
    moves only its sessions; the others keep their replica and their hits."""
    from fastapi.testclient import TestClient
    from ray import serve

    from app.model_loader import ModelChoice, ModelLoader
    from app.server import create_app
    from app.settings import Settings
    from engine.replicas.cluster import app_name
    from sessions import SessionStore

    movers, stayers = salts_by_home(["replica-0", "replica-1", "replica-2"], "replica-2", 2, 3)
    images = {salt: noise_png(300 + i) for i, salt in enumerate(movers + stayers)}
    for salt, image in images.items():
        ask(replicas, salt, image)
    placed = {salt: replicas.replica_of(salt) for salt in images}
    store = SessionStore(tmp_path)
    choice, key = ModelChoice("tiny", "tiny", True, "test"), {"Authorization": "Bearer sekrit"}
    try:
        open_app = create_app(Settings(data_dir=tmp_path), store, ModelLoader.ready(replicas, choice), mount_ui=False)
        with TestClient(open_app) as http:  # no API keys: no admin
            assert http.post("/admin/replicas").status_code == 403
        settings = Settings(data_dir=tmp_path, api_keys=("sekrit",))
        app = create_app(settings, store, ModelLoader.ready(replicas, choice, settings), mount_ui=False)
        with TestClient(app) as http:
            assert http.post("/admin/replicas").status_code == 401
            added = http.post("/admin/replicas", headers=key)
            assert added.status_code == 200, added.text
            assert added.json()["id"] == "replica-2"
            assert [(r["id"], r["state"]) for r in added.json()["replicas"]] == \
                [("replica-0", "ready"), ("replica-1", "ready"), ("replica-2", "ready")]
            assert all(replicas.replica_of(s) is None for s in movers)  # placed again at their next request
            assert all(replicas.replica_of(s) == placed[s] for s in stayers)
            for salt in movers:
                assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "miss"
                assert replicas.replica_of(salt) == "replica-2"
                assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "hit"
            for salt in stayers:
                assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "hit"
            stream = replicas.submit([{"role": "user", "content": "Go on."}],
                                     SamplingParams(max_tokens=4000, temperature=0.0), cache_salt=movers[0])
            items = iter(stream)
            assert isinstance(next(items), str)
            assert http.delete("/admin/replicas/replica-9", headers=key).status_code == 400
            removed = http.delete("/admin/replicas/replica-2", headers=key)
            assert removed.status_code == 200 and removed.json() == {"id": "replica-2", "sessions_moved": 2}
            with pytest.raises(EngineAbortedError, match="was removed"):
                for _ in items:
                    pass
    finally:
        store.close()
    assert app_name(replicas.front_id, "replica-2") not in serve.status().applications
    assert [r["id"] for r in replicas.replica_status()] == ["replica-0", "replica-1"]
    assert all(replicas.replica_of(s) == placed[s] for s in stayers)
    assert ask(replicas, stayers[0], images[stayers[0]]).telemetry.prefix_cache == "hit"
    assert ask(replicas, movers[1], images[movers[1]]).telemetry.prefix_cache in ("miss", "hit")
    assert replicas.replica_of(movers[1]) in ("replica-0", "replica-1")


def test_a_killed_replica_fails_its_stream_moves_its_sessions_once_and_comes_back(replicas):
    """Last in the module: it kills replica-0's actor."""
    images = {f"kill-{i}": noise_png(200 + i) for i in range(6)}
    for salt, image in images.items():
        ask(replicas, salt, image)
    placed = {salt: replicas.replica_of(salt) for salt in images}
    victim = placed["kill-0"]
    other = "replica-1" if victim == "replica-0" else "replica-0"
    victims = [s for s in images if placed[s] == victim]
    others = [s for s in images if placed[s] == other]
    assert victims and others, placed
    stream = replicas.submit([{"role": "user", "content": "Go on."}], SamplingParams(max_tokens=4000, temperature=0.0),
                             cache_salt="kill-0")
    items = iter(stream)
    assert isinstance(next(items), str)
    os.kill(replicas.replica_info(victim)["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineAbortedError, match="stopped unexpectedly"):
        for _ in items:
            pass
    assert time.monotonic() - started < 30  # no hang: the stream's end, not a timeout
    for salt in victims:  # one cold miss on the other replica, then hits there
        assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "miss"
        assert replicas.replica_of(salt) == other
        assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "hit"
    for salt in others:  # untouched
        assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "hit"
        assert replicas.replica_of(salt) == other
    deadline = time.monotonic() + 120  # Serve replaces the replica; the probe sees it ready
    while time.monotonic() < deadline and not all(r["state"] == "ready" for r in replicas.replica_status()):
        time.sleep(0.5)
    status = {r["id"]: r for r in replicas.replica_status()}
    assert status[victim]["state"] == "ready" and status[victim]["restarts"] == 1
    for salt in victims:  # moved sessions stay where their caches are now
        assert replicas.replica_of(salt) == other
        assert ask(replicas, salt, images[salt]).telemetry.prefix_cache == "hit"


def test_the_replica_options_parse_refuse_bad_values_and_split_the_host_tier():
    from app.model_loader import replica_options
    from app.settings import parse_settings

    settings = parse_settings(["--replicas", "4", "--ray-address", "ray://10.0.0.5:10001", "--replica-cpus", "0.5",
                               "--host-cache-bytes", "1G"], environ={})
    assert (settings.replicas, settings.ray_address, settings.replica_cpus) == (4, "ray://10.0.0.5:10001", 0.5)
    assert replica_options({"kv_cache_bytes": 1}, settings) == {"kv_cache_bytes": 1, "host_cache_bytes": 256 << 20}
    assert parse_settings([], environ={"PRISM_REPLICAS": "2"}).replicas == 2
    assert parse_settings([], environ={}).replicas == 0  # no Ray unless asked for
    for argv in (["--replicas", "-1"], ["--replicas", "65"], ["--replica-cpus", "0"],
                 ["--ray-address", "http://x:1/; rm -rf"], ["--ray-address", "no-port"]):
        with pytest.raises(SystemExit):
            parse_settings(argv, environ={})
