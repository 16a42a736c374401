"""The host-memory tier's size (issue 33): the byte grammar, the host's memory as read, the
default share, the per-process ledger, ``EngineOptions.host_budget`` and ``--host-cache-bytes``.

No assertion reads this machine's real memory: every host here is a faked ``/proc/meminfo``.
"""

from __future__ import annotations

import argparse
import os

import pytest

from app.settings import parse_bytes, parse_settings
from engine.cache import host_memory
from engine.errors import InvalidRequestError
from engine.options import EngineOptions, host_cache_bytes_from_env

GIB = 2**30


@pytest.fixture
def host(monkeypatch):
    """Return ``fake(total, available, cgroup=None)``: this process sees a host of ``total``
    bytes with ``available`` bytes available (and the cgroup ``(limit, used)``, or none), and a
    fresh ledger; returns that ledger."""
    def fake(total: int, available: int, cgroup: tuple[int, int] | None = None) -> host_memory.HostLedger:
        info = {"MemTotal": total, "MemFree": available // 2, "MemAvailable": available}
        monkeypatch.setattr(host_memory, "read_meminfo", lambda path=host_memory.MEMINFO: dict(info))
        monkeypatch.setattr(host_memory, "read_cgroup", lambda: cgroup)
        ledger = host_memory.HostLedger()
        monkeypatch.setattr(host_memory, "LEDGER", ledger)
        return ledger

    monkeypatch.delenv("PRISM_HOST_CACHE_BYTES", raising=False)
    return fake


# ------------------------------------------------------------------------------ byte grammar
SIZES = [("0", 0), ("0B", 0), ("0.0", 0), ("1", 1), ("536870912", 512 << 20), ("512M", 512 << 20),
         ("512MiB", 512 << 20), ("512mb", 512 << 20), (" 2g ", 2 << 30), ("1.5G", 3 << 29), ("7k", 7 << 10),
         ("1T", 1 << 40), ("1.0000000001", 1), ("123456789012345678901234567890", 123456789012345678901234567890)]
JUNK = ["", " ", "-1", "abc", "1e9", "12X", "1.5.2", "0x10", "9" * 31, "0.5", "0.1k" + "b" * 3, "1 G B", "½", "1\n2"]


@pytest.mark.parametrize("text,expected", SIZES)
def test_both_byte_parsers_read_sizes_alike(text, expected):
    assert parse_bytes(text) == expected
    assert host_memory.parse_size(text) == expected


@pytest.mark.parametrize("text", JUNK)
def test_both_byte_parsers_refuse_junk_with_a_message(text):
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        parse_bytes(text)
    with pytest.raises(ValueError, match="size"):
        host_memory.parse_size(text)


def test_a_huge_number_of_digits_is_refused_not_a_crash():
    # a float of 400 nines is infinite, and int(inf) an OverflowError: the grammar caps the digits
    for parse in (parse_bytes, host_memory.parse_size):
        with pytest.raises((argparse.ArgumentTypeError, ValueError), match="not a size"):
            parse("9" * 400 + "G")


# ------------------------------------------------------------------------- launch settings
def test_host_cache_bytes_flows_from_the_command_line_and_the_environment():
    assert parse_settings([], {}).host_cache_bytes is None
    assert "host_cache_bytes" not in parse_settings([], {}).engine_options()  # the engine's default
    off = parse_settings(["--host-cache-bytes", "0"], {})
    assert off.host_cache_bytes == 0 and off.engine_options()["host_cache_bytes"] == 0
    env = {"PRISM_HOST_CACHE_BYTES": "8G"}
    assert parse_settings([], env).engine_options()["host_cache_bytes"] == 8 << 30
    assert parse_settings(["--host-cache-bytes", "512M"], env).host_cache_bytes == 512 << 20  # the command line wins
    assert parse_settings([], {"PRISM_HOST_CACHE_BYTES": "0"}).engine_options()["host_cache_bytes"] == 0


@pytest.mark.parametrize("argv,env", [(["--host-cache-bytes", "lots"], {}), (["--host-cache-bytes", "-4G"], {}),
                                      ([], {"PRISM_HOST_CACHE_BYTES": "4 gigs"}), (["--kv-cache-bytes", "0"], {}),
                                      ([], {"PRISM_KV_CACHE_BYTES": "0"})])
def test_bad_host_or_kv_sizes_exit_with_a_message(argv, env, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and ("size" in err)


def test_help_names_the_host_tier_option_and_its_variable(capsys):
    with pytest.raises(SystemExit):
        parse_settings(["--help"], {"PRISM_HOST_CACHE_BYTES": "0"})
    text = " ".join(capsys.readouterr().out.split())
    assert "--host-cache-bytes" in text and "PRISM_HOST_CACHE_BYTES; default 0" in text


def test_the_suite_runs_without_a_host_tier_unless_asked():
    # tests/conftest.py sets it for every engine the suite builds (a run may set another value)
    assert host_memory.parse_size(os.environ["PRISM_HOST_CACHE_BYTES"]) >= 0


# ----------------------------------------------------------------------- the host's memory
def test_meminfo_is_read_in_bytes(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24683568 kB\nMemFree:        19771288 kB\nMemAvailable:   22093648 kB\n"
                    "HugePages_Total:       3\nnot a line\n")
    info = host_memory.read_meminfo(str(path))
    assert info == {"MemTotal": 24683568 * 1024, "MemFree": 19771288 * 1024, "MemAvailable": 22093648 * 1024,
                    "HugePages_Total": 3}
    assert host_memory.read_meminfo(str(tmp_path / "absent")) == {}


def test_without_meminfo_the_host_is_read_from_sysconf(monkeypatch):
    monkeypatch.setattr(host_memory, "read_meminfo", lambda path=host_memory.MEMINFO: {})
    monkeypatch.setattr(host_memory, "read_cgroup", lambda: None)
    pages = {"SC_PHYS_PAGES": 64 * GIB, "SC_AVPHYS_PAGES": 40 * GIB}
    monkeypatch.setattr(host_memory, "_sysconf_pages", lambda name: pages[name])
    assert host_memory.host_memory_bytes() == 64 * GIB and host_memory.available_bytes() == 40 * GIB


def test_a_cgroup_limit_caps_the_host(host):
    host(128 * GIB, 120 * GIB, cgroup=(16 * GIB, 10 * GIB))
    assert host_memory.host_memory_bytes() == 16 * GIB
    assert host_memory.available_bytes() == 6 * GIB


def test_cgroup_files_are_read_without_reclaimable_cache(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{16 * GIB}\n")
    (v2 / "memory.current").write_text(f"{10 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon {6 * GIB}\ninactive_file {3 * GIB}\nactive_file {GIB}\n")
    monkeypatch.setattr(host_memory, "_CGROUP_V2", str(v2))
    monkeypatch.setattr(host_memory, "_CGROUP_V1", str(tmp_path / "absent"))
    assert host_memory.read_cgroup() == (16 * GIB, 7 * GIB)
    (v2 / "memory.max").write_text("max\n")  # no limit
    assert host_memory.read_cgroup() is None


# ------------------------------------------------------------------------ the default share
def test_the_default_is_a_share_of_the_host(host):
    ledger = host(128 * GIB, 120 * GIB)
    assert ledger.default_bytes() == int(host_memory.DEFAULT_SHARE * 128 * GIB)
    assert host_memory.headroom_bytes(128 * GIB) == 16 * GIB  # an eighth
    assert host_memory.headroom_bytes(8 * GIB) == 4 * GIB  # at least 4 GiB


def test_a_busy_host_gets_what_is_available_less_the_headroom(host):
    ledger = host(128 * GIB, 20 * GIB)
    assert ledger.default_bytes() == 4 * GIB  # 20 GiB available - 16 GiB headroom
    ledger = host(128 * GIB, 10 * GIB)
    assert ledger.default_bytes() == 0  # less available than the headroom: no tier, not a refusal
    ledger = host(6 * GIB, 6 * GIB)
    assert ledger.default_bytes() == int(host_memory.DEFAULT_SHARE * 6 * GIB)  # 1.5 < 6 - 4


# -------------------------------------------------------------------------------- the ledger
def test_engines_of_one_process_share_the_default(host):
    ledger = host(128 * GIB, 120 * GIB)
    first = ledger.reserve(ledger.default_bytes())
    assert first.nbytes == 32 * GIB and ledger.reserved_bytes == 32 * GIB
    second = ledger.reserve(ledger.default_bytes())
    assert second.nbytes == int(0.25 * 96 * GIB)  # the share of what the first left
    assert ledger.holders == 2
    first.release()
    assert ledger.reserved_bytes == second.nbytes and ledger.holders == 1
    first.release()  # idempotent: nothing given back twice
    assert ledger.reserved_bytes == second.nbytes and first.released
    second.release()
    assert ledger.reserved_bytes == 0 and ledger.default_bytes() == 32 * GIB


def test_explicit_sizes_together_are_checked_against_the_host(host):
    ledger = host(128 * GIB, 120 * GIB)
    big = ledger.reserve(60 * GIB)
    assert ledger.room() == 120 * GIB - 16 * GIB - 60 * GIB
    with pytest.raises(ValueError) as exc:
        ledger.reserve(50 * GIB)
    message = str(exc.value)
    for said in ("128.00 GiB of memory", "120.00 GiB available", "16.00 GiB kept", "60.00 GiB already reserved",
                 "1 other engine", "44.00 GiB", "host_cache_bytes", "--host-cache-bytes", "PRISM_HOST_CACHE_BYTES"):
        assert said in message, said
    assert ledger.reserved_bytes == 60 * GIB  # the refused one holds nothing
    ledger.reserve(44 * GIB).release()  # exactly the room is granted
    big.release()
    ledger.reserve(100 * GIB)


def test_allocated_chunks_are_not_counted_twice(host, monkeypatch):
    ledger = host(128 * GIB, 120 * GIB)
    tier = ledger.reserve(40 * GIB)
    room = ledger.room()
    # the tier pins 30 GiB: the host has 30 GiB less available, the ledger knows why
    info = {"MemTotal": 128 * GIB, "MemAvailable": 90 * GIB}
    monkeypatch.setattr(host_memory, "read_meminfo", lambda path=host_memory.MEMINFO: dict(info))
    assert ledger.room() == room - 30 * GIB  # unreported: counted as reserved and as used (safe side)
    tier.record_allocated(30 * GIB)
    assert ledger.room() == room and tier.allocated == 30 * GIB
    with pytest.raises(ValueError):
        tier.record_allocated(11 * GIB)  # more than reserved
    tier.release()
    with pytest.raises(ValueError):
        tier.record_allocated(1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G", None])
def test_the_ledger_refuses_what_is_not_a_size(host, bad):
    ledger = host(128 * GIB, 120 * GIB)
    with pytest.raises(ValueError, match=">= 0"):
        ledger.reserve(bad)
    assert ledger.reserved_bytes == 0


def test_the_module_functions_use_the_process_ledger(host):
    ledger = host(128 * GIB, 120 * GIB)
    tier = host_memory.reserve(8 * GIB)
    assert ledger.reserved_bytes == 8 * GIB and host_memory.default_bytes() == int(0.25 * 120 * GIB)
    tier.release()
    assert host_memory.reserve(0).nbytes == 0 and ledger.holders == 0  # no tier, no holder


# -------------------------------------------------------------------- EngineOptions.host_budget
def test_host_budget_settles_option_then_environment_then_default(host, monkeypatch):
    host(128 * GIB, 120 * GIB)
    assert EngineOptions().host_budget() == 32 * GIB
    assert EngineOptions(host_cache_bytes=3 * GIB).host_budget() == 3 * GIB
    monkeypatch.setenv("PRISM_HOST_CACHE_BYTES", "2G")
    assert EngineOptions().host_budget() == 2 * GIB
    assert EngineOptions(host_cache_bytes=3 * GIB).host_budget() == 3 * GIB  # the option wins
    assert EngineOptions(host_cache_bytes=0).host_budget() == 0  # 0 too: off, not "unset"
    monkeypatch.setenv("PRISM_HOST_CACHE_BYTES", "0")
    assert EngineOptions().host_budget() == 0
    monkeypatch.setenv("PRISM_HOST_CACHE_BYTES", "")  # empty: unset
    assert EngineOptions().host_budget() == 32 * GIB


def test_host_budget_refuses_with_what_the_host_has(host, monkeypatch):
    ledger = host(128 * GIB, 120 * GIB)
    ledger.reserve(10 * GIB)
    with pytest.raises(InvalidRequestError) as exc:
        EngineOptions(host_cache_bytes=500 * GIB).host_budget()
    assert isinstance(exc.value, ValueError)
    for said in ("500.00 GiB", "128.00 GiB of memory", "10.00 GiB already reserved", "--host-cache-bytes"):
        assert said in str(exc.value), said
    monkeypatch.setenv("PRISM_HOST_CACHE_BYTES", "500G")
    with pytest.raises(InvalidRequestError, match="more than this host can give"):
        EngineOptions().host_budget()
    with pytest.raises(InvalidRequestError, match=">= 0"):
        EngineOptions(host_cache_bytes=-1).host_budget()
    monkeypatch.setenv("PRISM_HOST_CACHE_BYTES", "plenty")
    with pytest.raises(InvalidRequestError, match="PRISM_HOST_CACHE_BYTES='plenty'"):
        EngineOptions().host_budget()
    assert ledger.reserved_bytes == 10 * GIB  # host_budget reserves nothing


def test_tensor_parallel_ranks_split_the_budget(host):
    host(128 * GIB, 120 * GIB)
    asked = 10 * GIB + 3
    for ranks in (1, 2, 3, 4, 8):
        total = EngineOptions(host_cache_bytes=asked).host_budget(tensor_parallel=ranks)
        assert asked - ranks < total <= asked and total % ranks == 0  # the whole engine's, not per rank
        assert host_memory.per_rank(total, ranks) * ranks == total
    assert EngineOptions().host_budget(tensor_parallel=4) == EngineOptions().host_budget() == 32 * GIB
    for bad in (0, -2, 1.0):
        with pytest.raises(InvalidRequestError, match="tensor_parallel"):
            EngineOptions().host_budget(tensor_parallel=bad)
    with pytest.raises(ValueError):
        host_memory.per_rank(GIB, 0)


def test_the_environment_reader_alone():
    assert host_cache_bytes_from_env({}) is None
    assert host_cache_bytes_from_env({"PRISM_HOST_CACHE_BYTES": " 64M "}) == 64 << 20
    with pytest.raises(InvalidRequestError, match="not a size"):
        host_cache_bytes_from_env({"PRISM_HOST_CACHE_BYTES": "-1"})


def test_launch_refuses_a_host_tier_larger_than_the_host_before_starting(tmp_path, capsys, monkeypatch):
    """A newcomer's finding: ``--host-cache-bytes 1T`` started the server, whose model load then
    failed (503 for ever). Now launch.py exits at once with the message (how much there is)."""
    import launch

    monkeypatch.delenv("PRISM_HOST_CACHE_BYTES", raising=False)
    code = launch.main(["--host-cache-bytes", str(1 << 60), "--data-dir", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == 2 and "host" in err and "GiB" in err
    assert not (tmp_path / "data").exists()  # nothing was started or written
