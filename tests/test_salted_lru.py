"""engine/cache/salted_lru.py: the byte bound, least recently used out first, one salt forgotten."""

from engine.cache.salted_lru import SaltedLRU


def test_the_least_recently_used_goes_first_once_the_bound_is_passed():
    lru = SaltedLRU(10)
    assert lru.put(("a", 1), "one", 4) and lru.put(("a", 2), "two", 4)
    assert lru.get(("a", 1)) == "one"  # now the most recently used: ("a", 2) goes first
    assert lru.put(("b", 3), "three", 4)
    assert (lru.get(("a", 2)), lru.get(("a", 1)), lru.get(("b", 3))) == (None, "one", "three")
    assert (lru.bytes, len(lru)) == (8, 2)


def test_a_value_larger_than_the_bound_is_never_kept_and_replace_is_a_choice():
    lru = SaltedLRU(10)
    assert not lru.put(("a", 1), "big", 11) and len(lru) == 0
    assert lru.put(("a", 1), "first", 3)
    assert not lru.put(("a", 1), "second", 5, replace=False) and lru.get(("a", 1)) == "first"
    assert lru.put(("a", 1), "second", 5) and (lru.get(("a", 1)), lru.bytes) == ("second", 5)


def test_forget_drops_one_salt_and_pop_takes_once():
    lru = SaltedLRU(100)
    for key in (("a", 1), ("a", 2), ("b", 1), ("ab", 1)):
        lru.put(key, key, 10)
    assert lru.forget("a") == 2
    assert [lru.get(k) for k in (("a", 1), ("a", 2), ("b", 1), ("ab", 1))] == [None, None, ("b", 1), ("ab", 1)]
    assert lru.pop(("b", 1)) == ("b", 1) and lru.pop(("b", 1)) is None
    assert lru.bytes == 10
    lru.clear()
    assert (len(lru), lru.bytes) == (0, 0)
