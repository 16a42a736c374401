"""Rank 0's side of a tensor-parallel group: it starts one worker process per other rank, joins
the ``torch.distributed`` group with them (NCCL on CUDA, gloo on the CPU) and carries its step
plans to them.

Transport. The plan of each step (what to run, on which slots and block tables) goes down one
``multiprocessing`` pipe per worker, pickled: a pipe reports a peer that died (``BrokenPipeError``
here, ``EOFError`` in the worker) and never times out while the engine is idle. Tensors that live
on the model device (vision features) follow as ``torch.distributed`` broadcasts from rank 0, and
the decoder's all-reduces run on the same group.

Failure. A watchdog thread waits on the workers' process sentinels. A worker that exits, a pipe
that breaks, a collective that fails (gloo reports a closed peer at once; every collective has the
group's ``timeout_s``) or rank 0 failing between a plan's send and its end (the ranks would be out
of step) sets :attr:`TensorParallelGroup.error`; from then on every step raises that
:class:`TensorParallelError`, so every waiting caller gets it instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import TensorParallelError
from ..model.qwen3_vl import Qwen3VL
from ..model.vision import VisionFeatures
from .sharding import shard_decoder

log = logging.getLogger(__name__)


__all__ = ["Collectives", "TensorParallelError", "TensorParallelGroup", "WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to load its shard.

    Attributes:
        folder: the checkpoint folder (str path).
        device: rank 0's device (``"cpu"`` or ``"cuda:i"``); rank ``r`` uses ``cuda:i + r``.
        dtype: the model dtype.
        timeout_s: timeout of every collective, seconds.
        host, port: rank 0's TCP store (the rendezvous).
        world: ranks in the group.
    """

    folder: str
    device: str
    dtype: torch.dtype
    timeout_s: float
    host: str
    port: int
    world: int

    def device_of(self, rank: int) -> torch.device:
        dev = torch.device(self.device)
        return dev if dev.type != "cuda" else torch.device("cuda", (dev.index or 0) + rank)

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"


class Collectives:
    """This rank's process group of one tensor-parallel engine: gloo on the CPU, NCCL on CUDA,
    rendezvous through rank 0's TCP store. An explicit group, not ``torch.distributed``'s default
    one, so one process may hold several tensor-parallel engines (tests, benchmarks).

    Every collective waits at most ``spec.timeout_s``.
    """

    def __init__(self, spec: WorkerSpec, rank: int, store: dist.TCPStore | None = None):
        timeout = timedelta(seconds=spec.timeout_s)
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.world, False, timeout=timeout)
        self.store = store  # rank 0 serves it: keep it alive
        self.backend = spec.backend
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.device_of(rank))
            self.group = dist.ProcessGroupNCCL(store, rank, spec.world)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, spec.world, timeout)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """``partial`` summed over every rank, in place (the row-parallel projections' reduce)."""
        self.group.allreduce([partial]).wait()
        return partial

    def broadcast(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes rank 0's on every rank (in place)."""
        self.group.broadcast(tensor, 0).wait()

    def abort(self) -> None:
        """Unblock collectives waiting on a dead peer (NCCL; gloo's fail by themselves).
        Untested on GPU (no two-GPU machine was lent); best effort."""
        abort = getattr(self.group, "abort", None) if self.backend == "nccl" else None
        if abort is not None:
            try:
                abort()
            except Exception:  # an older torch: the collective's timeout ends it instead
                log.warning("aborting the tensor-parallel group failed", exc_info=True)


def feature_shape(features: VisionFeatures) -> tuple:
    """What a worker needs to receive ``features``: ``(rows, hidden, dtype, deepstack depth)``."""
    return (*features.embeds.shape, features.embeds.dtype, len(features.deepstack))


def broadcast_features(collectives: Collectives, features: VisionFeatures) -> None:
    """Send ``features`` (rank 0's) to every rank: embeds, then each DeepStack tap."""
    for tensor in (features.embeds, *features.deepstack):
        collectives.broadcast(tensor.contiguous())


def receive_features(collectives: Collectives, shape: tuple, device: torch.device) -> VisionFeatures:
    """A worker's copy of the features rank 0 broadcasts (see :func:`feature_shape`)."""
    rows, hidden, dtype, depth = shape
    parts = [torch.empty(rows, hidden, dtype=dtype, device=device) for _ in range(depth + 1)]
    for tensor in parts:
        collectives.broadcast(tensor)
    return VisionFeatures(parts[0], parts[1:])


class TensorParallelGroup:
    """Rank 0 of ``world`` ranks; build it with :meth:`launch`.

    Attributes:
        world: ranks in the group (this process is rank 0).
        spec: the :class:`WorkerSpec` the workers started from.
        error: the :class:`TensorParallelError` the group failed with, or None while it works.
    """

    def __init__(self, spec: WorkerSpec, collectives: Collectives, processes: list, conns: list):
        self.spec, self.world, self.collectives = spec, spec.world, collectives
        self._processes, self._conns = processes, conns
        self.error: TensorParallelError | None = None
        self._send_lock = threading.Lock()  # plans, data moves and counter queries keep one order
        self._recv_lock = threading.Lock()  # answers are read by one thread at a time
        self._fail_lock = threading.Lock()  # the watchdog and the loop may both see the failure
        self._last_words: dict[int, str] = {}  # rank -> the error a dead worker sent, see _ended
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="prism-tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def launch(cls, world: int, folder, device: torch.device, dtype: torch.dtype,
               timeout_s: float) -> TensorParallelGroup:
        """Start ranks ``1 .. world - 1`` (each loads the checkpoint and shards it) and join them.

        Raises:
            TensorParallelError: a worker failed to start, or the rendezvous timed out.
        """
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        spec = WorkerSpec(str(folder), str(device), dtype, float(timeout_s), "127.0.0.1", store.port, world)
        from .worker import worker_main  # the spawned process imports it by name

        ctx = mp.get_context("spawn")
        processes, conns = [], []
        for rank in range(1, world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, theirs), name=f"prism-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            processes.append(proc)
            conns.append(mine)
        try:
            collectives = Collectives(spec, 0, store)
        except Exception as exc:
            for proc in processes:
                proc.kill()
            raise TensorParallelError(f"tensor-parallel ranks did not join: {exc}") from exc
        return cls(spec, collectives, processes, conns)

    # ------------------------------------------------------------------ setup
    def shard(self, model: Qwen3VL) -> None:
        """Shard rank 0's model (see :func:`~engine.parallel.sharding.shard_decoder`)."""
        shard_decoder(model, 0, self.world, self.collectives.all_reduce)

    def start_workers(self, pool_spec: dict, graphs: dict | None) -> None:
        """Tell every worker its KV pool (``pool_spec``: :class:`~engine.cache.kv_pool.PagePool`
        keyword arguments, rank 0's page count, and ``host_pages``: the host tier's pages, 0 for
        none) and the step graphs to capture (``graphs``:
        :func:`~engine.graphs.capture.capture_step_graphs` keywords, or None), in the order rank 0
        captures them, so their collectives pair up."""
        self.send(("init", pool_spec, graphs))

    def wait_ready(self) -> list[int]:
        """Wait for every worker to be ready to run steps; their process ids.

        Raises:
            TensorParallelError: a worker failed or did not answer in ``timeout_s``.
        """
        return [self._reply(rank, "ready")[1] for rank in range(1, self.world)]

    # ------------------------------------------------------------------ steps
    def check(self) -> None:
        """Raises: TensorParallelError: the group has failed (a fresh copy of :attr:`error` for
        each caller: one exception object raised in many threads would share its traceback)."""
        if self.error is not None:
            raise TensorParallelError(str(self.error)) from self.error.__cause__

    def send(self, message: tuple) -> None:
        """Send one plan message to every worker.

        Raises:
            TensorParallelError: the group has failed, or a worker's pipe is broken.
        """
        self.check()
        with self._send_lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    conn.send(message)
                except (OSError, EOFError) as exc:
                    raise self._fail(f"tensor-parallel rank {rank} died ({self._ended(rank)})", exc) from exc

    def step(self, message: tuple, features: VisionFeatures | None, run: Callable[[], object]):
        """Send a step's plan, broadcast its vision features, then run rank 0's share (``run()``,
        whose collectives the workers pair). Returns what ``run`` returns.

        Raises:
            TensorParallelError: the group has failed, or fails now (a dead worker, a failed
                collective, or any error of rank 0's share: the ranks are then out of step).
        """
        self.send(message)
        try:
            if features is not None:
                broadcast_features(self.collectives, features)
            return run()
        except Exception as exc:
            dead = self._dead_rank(wait_s=2.0)
            if dead is not None:
                reason = f"tensor-parallel rank {dead} died during a step ({self._ended(dead)})"
                raise self._fail(reason, exc) from exc
            raise self._fail(f"tensor-parallel step failed on rank 0, the ranks are out of step: {exc!r}", exc) from exc

    def counters(self) -> list[dict]:
        """Every rank's counters, rank 0 first (rank 0's are ``{}`` here; the engine fills them):
        ``vision_images_encoded`` (images the rank's vision tower encoded), ``steps`` (forwards),
        ``page_copies`` (copy-on-write copies applied), ``slot_moves`` (compaction moves applied),
        ``value_merges`` (merging compactions' V rewrites applied to the rank's own KV heads).

        Raises:
            TensorParallelError: the group has failed or a worker did not answer.
        """
        self.send(("counters",))
        return [{}] + [self._reply(rank, "counters")[1] for rank in range(1, self.world)]

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Stop the workers (kill any that does not stop within 10 s) and leave the group."""
        self._closing = True
        if self.error is None:
            try:
                self.send(("stop",))
            except TensorParallelError:
                pass
        deadline = time.monotonic() + 10
        for proc in self._processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self.collectives = None  # its peers are gone; dropping it closes the connections

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank 1 first."""
        return [proc.pid for proc in self._processes]

    # ------------------------------------------------------------------ internals
    def _reply(self, rank: int, kind: str) -> tuple:
        conn = self._conns[rank - 1]
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            try:
                with self._recv_lock:
                    message = conn.recv() if conn.poll(0.1) else None
                if message is not None:
                    break
            except (OSError, EOFError) as exc:
                raise self._fail(f"tensor-parallel rank {rank} died ({self._ended(rank)})", exc) from exc
            self.check()
            if time.monotonic() > deadline:
                raise self._fail(f"tensor-parallel rank {rank} did not answer in {self.spec.timeout_s:g} s", None)
        if message[0] == "error":
            raise self._fail(f"tensor-parallel rank {rank} failed: {message[1]}", None)
        if message[0] != kind:
            raise self._fail(f"tensor-parallel rank {rank} answered {message[0]!r}, expected {kind!r}", None)
        return message

    def _fail(self, reason: str, cause: BaseException | None) -> TensorParallelError:
        """Mark the group failed (the first reason wins) and return a fresh copy of its error."""
        with self._fail_lock:
            first = self.error is None
            if first:
                self.error = TensorParallelError(f"{reason}; the engine cannot run requests any more, restart it")
                self.error.__cause__ = cause
        if first:
            log.error("%s", self.error)
            if self.collectives is not None:
                self.collectives.abort()
        copy = TensorParallelError(str(self.error))
        copy.__cause__ = cause
        return copy

    def _exit_of(self, rank: int) -> str:
        proc = self._processes[rank - 1]
        proc.join(1.0)
        return "still running" if proc.exitcode is None else f"exit code {proc.exitcode}"

    def _dead_rank(self, wait_s: float) -> int | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._processes, start=1):
                if not proc.is_alive():
                    return rank
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._processes, start=1)}
        while sentinels and not self._closing:
            for sentinel in wait_any(list(sentinels), timeout=0.5):
                rank = sentinels.pop(sentinel)
                if not self._closing:
                    self._fail(f"tensor-parallel rank {rank} died ({self._ended(rank)})", None)

    def _ended(self, rank: int) -> str:
        """How a dead worker ended: its exit code, its pid and the error it sent before it exited
        (its traceback's last line), read once and kept, since several threads may ask."""
        with self._recv_lock:
            if rank not in self._last_words:
                conn, words = self._conns[rank - 1], ""
                try:
                    message = conn.recv() if conn.poll(0.5) else None
                    if message is not None and message[0] == "error":
                        words = ": " + message[1].strip().splitlines()[-1]
                except (OSError, EOFError):
                    pass
                self._last_words[rank] = words
        return f"{self._exit_of(rank)}, pid {self._processes[rank - 1].pid}{self._last_words[rank]}"
