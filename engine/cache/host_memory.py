"""How much host memory the host-memory tier of the prefix cache may take, and who holds it.

The tier keeps idle prefixes' KV in host RAM (pinned on CUDA) and copies it back on a hit. Its
size is ``EngineOptions.host_cache_bytes`` or, by default, :data:`DEFAULT_SHARE` of this host's
memory; this module reads the host's memory (``/proc/meminfo``, capped by the cgroup the process
runs in) and keeps the process-wide ledger (:func:`reserve`) through which every engine of this
process takes its share, so that engines of one process share the host's memory instead of each
taking the default of all of it.

**Why 25 % of the host, kept below what is available minus a headroom.** Pinned pages cannot be
swapped or reclaimed, so whatever the tier takes is gone for everything else on the host: the OS
and its page cache (which holds the checkpoint's files for a restart of the engine core: 16 GB
for the 8B model in bf16), the web app, the engine core's own process and one process per
tensor-parallel worker (each a few GiB of CUDA libraries and context), images being decoded. A
quarter of the memory leaves three quarters for them. Beyond a share of the total, the default
is capped by what is available now (``MemAvailable``) minus :func:`headroom_bytes` (an eighth of
the memory, at least 4 GiB) for the OS and the app: a host already busy gets a smaller tier
instead of one that pushes it into swap or the OOM killer. Measured on the H200 machine
(``benchmarks/host_memory_probe.py``, docs/PERFORMANCE.md, "Host memory"): 125.85 GiB of RAM, so
the default is 31.5 GiB, which holds some 250 prefixes of eight photos of the 8B model (about
1.7k tokens at about 74 kB per token in FP8 pages, ~125 MB each); copying one such prefix back
at the 55 GB/s of pinned copies took 2.28 ms, against ~51 ms to prefill it again. Not measured:
how the hit rate grows with the share (that needs the tier itself); the share bounds what the
tier takes from the host first.

**Per host, not per engine or per rank.** The budget is the engine's whole tier: under tensor
parallelism each rank holds ``1 / N`` of every page, so the ranks together hold the budget, not
``N`` times it. It is decided once, by the process that builds the engine (rank 0), and split
among the ranks. Several engines of one process reserve from one ledger: the second engine's
default is :data:`DEFAULT_SHARE` of what the first left, and explicit sizes together may not
exceed what the host can give.

Not promised: separate engine processes on one host (two ``launch.py`` servers; the engine core
runs in a child process of the app, so a core and an engine built in the app's own process are
two processes) do not see each other's reservations: each process reserves from its own ledger,
measured against the memory available when it asks. Nor does a reservation allocate anything:
the tier allocates its chunks lazily, and memory another program takes meanwhile is not checked
again.

This module imports only the standard library (no torch, nothing else of the engine).
"""

from __future__ import annotations

import os
import re
import threading
from fractions import Fraction

GIB = 2**30

#: The default tier is this fraction of the host's memory (of what other engines of this
#: process left of it), capped by what is available minus :func:`headroom_bytes`. See the module
#: docstring for why.
DEFAULT_SHARE = 0.25

#: The headroom left for the OS and the app: this fraction of the host's memory ...
HEADROOM_SHARE = 0.125
#: ... and at least this many bytes (a small host still needs its OS, Python and torch).
MIN_HEADROOM_BYTES = 4 * GIB

#: How to lower the size, named in every refusal.
HOW_TO_LOWER = ("lower EngineOptions.host_cache_bytes (launch.py --host-cache-bytes, env PRISM_HOST_CACHE_BYTES; "
                "0 turns the host tier off)")

MEMINFO = "/proc/meminfo"
_CGROUP_V2 = "/sys/fs/cgroup"
_CGROUP_V1 = "/sys/fs/cgroup/memory"
_MEMINFO_LINE = re.compile(r"^(\w+):\s+(\d+)(?:\s+kB)?\s*$")
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


#: Sizes as launch.py's byte options take them (app/settings.py's ``parse_bytes``, kept apart so
#: that ``--help`` imports nothing of the engine; tests/test_host_memory.py holds them equal).
_SIZE = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``"0"``, ``"536870912"``, ``"512M"``, ``"512MiB"``, ``"1.5G"`` -> bytes (binary units,
    rounded down to a whole byte).

    Raises:
        ValueError: not such a size, or a size above 0 that rounds to 0 bytes (``"0.5"``).
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size in bytes: {str(text)[:40]!r} (examples: 0, 536870912, 512M, 2G)")
    exact = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
    if 0 < exact < 1:
        raise ValueError(f"a size must be 0 or at least 1 byte, got {text!r}")
    return int(exact)


def read_meminfo(path: str = MEMINFO) -> dict[str, int]:
    """The fields of ``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``);
    ``{}`` where the file cannot be read (not Linux). Lines it does not understand are skipped."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        match = _MEMINFO_LINE.match(line)
        if match:
            out[match.group(1)] = int(match.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def read_cgroup() -> tuple[int, int] | None:
    """This process's cgroup memory limit and the bytes it cannot get back from it, or None
    without a limit. Reclaimable file cache (``inactive_file``) is not counted as used: the
    kernel drops it before it refuses memory. cgroup v2 first, then v1."""
    for folder, limit_file, usage_file, inactive in (
            (_CGROUP_V2, "memory.max", "memory.current", "inactive_file"),
            (_CGROUP_V1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        limit = _read_int(os.path.join(folder, limit_file))  # "max" (no limit) reads as None
        if limit is not None and limit < _NO_LIMIT:
            usage = _read_int(os.path.join(folder, usage_file)) or 0
            used = max(0, usage - _read_stat(os.path.join(folder, "memory.stat"), inactive))
            return limit, used
    return None


def cgroup_limit_bytes() -> int | None:
    """This process's cgroup memory limit in bytes, or None without one."""
    cgroup = read_cgroup()
    return None if cgroup is None else cgroup[0]


def _sysconf_pages(name: str) -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(name)
    except (ValueError, OSError, AttributeError):  # not a POSIX host, or the name is unknown
        return 0


def host_memory_bytes() -> int:
    """Bytes of physical memory this process may use: ``MemTotal`` (``os.sysconf`` where there
    is no ``/proc/meminfo``), capped by the cgroup's limit. 0 if nothing can be read."""
    total = read_meminfo().get("MemTotal") or _sysconf_pages("SC_PHYS_PAGES")
    cgroup = read_cgroup()
    if cgroup is not None:
        total = min(total, cgroup[0]) if total else cgroup[0]
    return total


def available_bytes() -> int:
    """Bytes that can be allocated now without swapping: ``MemAvailable`` (free pages where it
    is missing), capped by what is left of the cgroup's limit."""
    info = read_meminfo()
    available = info.get("MemAvailable", info.get("MemFree")) or _sysconf_pages("SC_AVPHYS_PAGES")
    cgroup = read_cgroup()
    if cgroup is not None:
        available = min(available, max(0, cgroup[0] - cgroup[1]))
    return available


def headroom_bytes(total: int) -> int:
    """Bytes never given to the tier on a host of ``total`` bytes: :data:`HEADROOM_SHARE` of it,
    at least :data:`MIN_HEADROOM_BYTES`."""
    return max(MIN_HEADROOM_BYTES, int(total * HEADROOM_SHARE))


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


class Reservation:
    """Bytes of host memory one engine's tier holds on its process's :class:`HostLedger`.

    ``nbytes`` is the tier's whole size (all tensor-parallel ranks together). Released by
    :meth:`release` (``Engine.close``); releasing twice does nothing.
    """

    def __init__(self, ledger: HostLedger, nbytes: int):
        self.nbytes = nbytes
        self._ledger = ledger
        self._allocated = 0
        self.released = False

    @property
    def allocated(self) -> int:
        """Bytes of this reservation the tier has allocated so far (see :meth:`record_allocated`)."""
        return self._allocated

    def record_allocated(self, nbytes: int) -> None:
        """Tell the ledger the tier now holds ``nbytes`` more of its reservation in memory (a
        chunk was allocated). Optional: memory allocated this way is no longer counted twice
        (once as reserved, once as missing from ``MemAvailable``) when the next engine asks.

        Raises:
            ValueError: ``nbytes`` negative, more than the reservation, or after release.
        """
        self._ledger._record(self, nbytes)

    def release(self) -> None:
        """Give the bytes back to the ledger; idempotent."""
        self._ledger._release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self._allocated} allocated"
        return f"Reservation({self.nbytes} bytes, {state})"


class HostLedger:
    """The host-memory reservations of one process (:data:`LEDGER` is the process's).

    What a new reservation may take (:meth:`room`): what is available now, plus what this
    ledger's tiers have allocated already (they are in the used memory and in the reservations;
    counted once), minus the headroom, minus every live reservation. Thread-safe.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._live: list[Reservation] = []

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by live reservations."""
        with self._lock:
            return sum(r.nbytes for r in self._live)

    @property
    def holders(self) -> int:
        """Live reservations of more than 0 bytes (engines with a host tier)."""
        with self._lock:
            return sum(1 for r in self._live if r.nbytes)

    def _room(self, total: int, available: int) -> int:
        reserved = sum(r.nbytes for r in self._live)
        allocated = sum(r.allocated for r in self._live)
        return max(0, min(total, available + allocated) - headroom_bytes(total) - reserved)

    def room(self) -> int:
        """Bytes a new reservation may take now (see the class docstring)."""
        with self._lock:
            return self._room(host_memory_bytes(), available_bytes())

    def default_bytes(self) -> int:
        """The default tier of a new engine: :data:`DEFAULT_SHARE` of the host's memory less what
        live reservations hold, capped by :meth:`room`."""
        with self._lock:
            total = host_memory_bytes()
            reserved = sum(r.nbytes for r in self._live)
            share = int(DEFAULT_SHARE * max(0, total - reserved))
            return min(share, self._room(total, available_bytes()))

    def check(self, nbytes: int) -> None:
        """Raises ValueError, with how much the host has and what holds it, if a reservation of
        ``nbytes`` would not be granted now (negative, or more than :meth:`room`)."""
        with self._lock:
            self._check(nbytes)

    def _check(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"host_cache_bytes must be an integer >= 0 (0: no host tier), got {nbytes!r}")
        total, available = host_memory_bytes(), available_bytes()
        room = self._room(total, available)
        if nbytes <= room:
            return
        reserved = sum(r.nbytes for r in self._live)
        holders = sum(1 for r in self._live if r.nbytes)
        raise ValueError(
            f"host_cache_bytes={nbytes} ({_gib(nbytes)}) is more than this host can give its host-memory "
            f"tier: it has {_gib(total)} of memory, {_gib(available)} available now, "
            f"{_gib(headroom_bytes(total))} kept for the OS and the app, and {_gib(reserved)} already "
            f"reserved by {holders} other engine(s) of this process: at most {room} bytes ({_gib(room)}) "
            f"can be given; {HOW_TO_LOWER}")

    def reserve(self, nbytes: int) -> Reservation:
        """Reserve ``nbytes`` (an engine's whole tier, all ranks together; 0 for none).

        Raises:
            ValueError: as :meth:`check` (the check and the reservation are one step, so two
                engines built at once cannot both take the last of the memory).
        """
        with self._lock:
            self._check(nbytes)
            reservation = Reservation(self, nbytes)
            self._live.append(reservation)
            return reservation

    def _record(self, reservation: Reservation, nbytes: int) -> None:
        with self._lock:
            if reservation.released:
                raise ValueError("the reservation was released")
            if nbytes < 0 or reservation._allocated + nbytes > reservation.nbytes:
                raise ValueError(f"cannot record {nbytes} more bytes: {reservation._allocated} of "
                                 f"{reservation.nbytes} are allocated already")
            reservation._allocated += nbytes

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.released:
                reservation.released = True
                self._live.remove(reservation)


#: The ledger of this process.
LEDGER = HostLedger()


def default_bytes() -> int:
    """:meth:`HostLedger.default_bytes` of this process's :data:`LEDGER`."""
    return LEDGER.default_bytes()


def reserve(nbytes: int) -> Reservation:
    """:meth:`HostLedger.reserve` on this process's :data:`LEDGER`.

    Raises:
        ValueError: ``nbytes`` negative, or more than the host can give (the message says how much
            it has, how much other engines of this process hold, and how to lower the size).
    """
    return LEDGER.reserve(nbytes)


def per_rank(total: int, ranks: int) -> int:
    """Bytes of an engine's tier of ``total`` bytes that each of its ``ranks`` tensor-parallel
    ranks holds (each holds ``1 / ranks`` of every page).

    Raises:
        ValueError: ``ranks`` below 1.
    """
    if ranks < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {ranks}")
    return total // ranks
