"""The replica router's ring (``engine.replicas.ring``): consistent hashing with bounded loads,
pure (no Ray, no engine). The properties the replicas rely on: a session never splits, no replica
takes a new session above ``ceil((1 + epsilon) * mean)``, a replica's death moves only its
sessions, adding one moves about ``1/N`` of them and only to it."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.replicas.ring import HashRing, SessionRouter, point

NODES = [f"replica-{i}" for i in range(4)]
keys = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=200, unique=True)


def test_points_are_stable_64_bit_digests():
    assert point("a") == point("a") != point("b")
    assert 0 <= point("x") < 2**64
    # pinned: a ring built by another process or release (another app front) places keys alike
    assert point("replica-0#0") == 0xEC8963B186885AE6


def test_the_home_does_not_depend_on_the_order_replicas_were_added():
    forward, backward = HashRing(NODES), HashRing(reversed(NODES))
    assert all(forward.home(f"k{i}") == backward.home(f"k{i}") for i in range(500))


def test_walk_yields_each_replica_once_home_first():
    ring = HashRing(NODES)
    for i in range(50):
        walk = list(ring.walk(f"k{i}"))
        assert sorted(walk) == sorted(NODES) and walk[0] == ring.home(f"k{i}")
    assert HashRing().home("k") is None and list(HashRing().walk("k")) == []


def test_homes_are_spread_evenly_over_four_replicas():
    ring = HashRing(NODES)
    share = Counter(ring.home(f"session-{i}") for i in range(20000))
    assert set(share) == set(NODES)
    assert all(abs(n / 20000 - 0.25) < 0.025 for n in share.values()), share


def test_removing_a_replica_moves_only_its_keys_and_adding_it_back_restores_them():
    ring = HashRing(NODES)
    before = {f"k{i}": ring.home(f"k{i}") for i in range(2000)}
    ring.remove("replica-2")
    after = {k: ring.home(k) for k in before}
    assert all(after[k] == v for k, v in before.items() if v != "replica-2")
    assert all(after[k] != "replica-2" for k in before)
    ring.add("replica-2")
    assert {k: ring.home(k) for k in before} == before


def test_a_replica_is_added_once():
    ring = HashRing(["a"])
    with pytest.raises(ValueError, match="already"):
        ring.add("a")
    with pytest.raises(ValueError):
        HashRing(vnodes=0)
    with pytest.raises(ValueError):
        SessionRouter(epsilon=0)


@settings(max_examples=60, deadline=None)
@given(keys, st.integers(1, 4), st.sampled_from([0.1, 0.25, 1.0]))
def test_a_session_never_splits_and_no_replica_passes_the_bound(sessions, n, epsilon):
    router = SessionRouter(NODES[:n], epsilon=epsilon)
    first = {}
    for i, key in enumerate(sessions):
        first[key] = router.route(key)
        placed = sum(router.load(node) for node in NODES[:n])
        assert placed == i + 1
        assert max(router.load(node) for node in NODES[:n]) <= math.ceil((1 + epsilon) * placed / n)
        # the sessions placed so far stay where they are, whatever came since
        probe = sessions[i // 2]
        assert router.route(probe) == first[probe]


@settings(max_examples=40, deadline=None)
@given(keys)
def test_a_down_replica_moves_only_its_sessions_and_they_stay_moved(sessions):
    router = SessionRouter(NODES[:2])
    before = {k: router.route(k) for k in sessions}
    router.set_up("replica-1", False)
    during = {k: router.route(k) for k in sessions}
    assert all(v == "replica-0" for v in during.values())
    assert all(during[k] == v for k, v in before.items() if v == "replica-0")
    router.set_up("replica-1", True)  # back (restarted, empty): the moved sessions stay moved
    assert {k: router.route(k) for k in sessions} == during


def test_with_no_replica_up_nothing_is_routed():
    router = SessionRouter(["a"])
    router.set_up("a", False)
    assert router.route("k") is None and router.capacity() == 0


def test_adding_a_replica_moves_about_a_quarter_of_the_sessions_all_to_it():
    router = SessionRouter(NODES[:3], epsilon=0.25)
    sessions = [f"s{i}" for i in range(3000)]
    before = {k: router.route(k) for k in sessions}
    moved = set(router.add("replica-3"))
    after = {k: router.route(k) for k in sessions}
    changed = {k for k in sessions if after[k] != before[k]}
    assert changed <= moved | {k for k in sessions if after[k] == "replica-3"}
    assert all(after[k] == "replica-3" for k in changed)
    assert 0.18 < len(changed) / len(sessions) < 0.32, len(changed)


def test_removing_a_replica_places_its_sessions_on_the_others():
    router = SessionRouter(NODES)
    before = {f"s{i}": router.route(f"s{i}") for i in range(400)}
    moved = set(router.remove("replica-0"))
    assert moved == {k for k, v in before.items() if v == "replica-0"}
    after = {k: router.route(k) for k in before}
    assert all(after[k] == v for k, v in before.items() if k not in moved)
    assert "replica-0" not in after.values()


def test_a_full_home_sends_new_sessions_on_and_keeps_old_ones():
    router = SessionRouter(["a", "b"], epsilon=0.25)
    homed_a = [k for k in (f"s{i}" for i in range(200)) if router.ring.home(k) == "a"][:8]
    placed = [router.route(k) for k in homed_a]
    # each new session is placed on "a" while it stays within ceil(1.25 * (S + 1) / 2)
    assert placed[:2] == ["a", "a"] and "b" in placed
    assert max(router.load("a"), router.load("b")) <= math.ceil(1.25 * 8 / 2)
    assert [router.route(k) for k in homed_a] == placed


def test_the_router_remembers_at_most_max_sessions_least_recent_first():
    router = SessionRouter(["a", "b"], max_sessions=3)
    for key in ("k1", "k2", "k3"):
        router.route(key)
    router.route("k1")  # k2 is now the least recent
    router.route("k4")
    assert router.placed("k2") is None and router.placed("k1") is not None
    assert router.load("a") + router.load("b") == 3


def test_unremembered_routes_place_nothing_and_forget_drops_the_load():
    router = SessionRouter(["a", "b"])
    assert router.route("anon", remember=False) in ("a", "b")
    assert router.placed("anon") is None and router.load("a") + router.load("b") == 0
    node = router.route("s")
    router.forget("s")
    assert router.load(node) == 0 and router.placed("s") is None
