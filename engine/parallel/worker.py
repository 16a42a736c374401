"""A tensor-parallel worker: rank ``r > 0``, one process, started by
:meth:`~engine.parallel.group.TensorParallelGroup.launch`.

It loads the checkpoint, keeps its shard (:mod:`engine.parallel.sharding`), builds its own KV pool
(its KV heads only, rank 0's page count) and then only executes the step plans rank 0 sends, in
order (:class:`~engine.serving.plan.StepPlan`, the same plan rank 0's runner executes, less the
runs whose encoding failed): the plan's data moves (copy-on-write page copies, compaction's slot
moves, a merging compaction's V rewrite of this rank's own KV heads), then the forward of its runs
(eager, or a replay of its own step graphs, chosen from the plan as rank 0 chooses). It decides
nothing: no scheduler, no prefix cache, no sampling, no vision encoder (rank 0 encodes each image
once and broadcasts the features the plan message names). Pages are only storage here; which page holds what is rank 0's
bookkeeping.

A worker exits when rank 0 says stop, when its pipe closes (rank 0 died) or when its parent
process is gone; an error of its own is sent to rank 0 and ends the process, which rank 0's
watchdog turns into a :class:`~engine.parallel.group.TensorParallelError`.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch

from ops.dispatch import warm_up as warm_up_kernels

from ..cache.host_pool import HostPool
from ..cache.kv_pool import PagePool
from ..cache.kv_transfer import KVTransfers
from ..graphs.capture import capture_step_graphs
from ..model.qwen3_vl import Qwen3VL, load_model
from ..model.vision import EncodeCounter
from ..serving.plan import Offload, PageCopy, Restore, SlotMove, StepPlan, ValueMerge
from ..serving.runner import ModelRunner
from .group import Collectives, WorkerSpec, receive_features
from .sharding import shard_decoder


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # rank 0 is gone: nobody will send a plan or pair a collective

    threading.Thread(target=watch, name="prism-tp-parent", daemon=True).start()


def worker_main(spec: WorkerSpec, rank: int, conn) -> None:
    """The worker process's entry point (see the module docstring)."""
    _exit_with_parent()
    try:
        device = spec.device_of(rank)
        collectives = Collectives(spec, rank)
        model = load_model(spec.folder, device=device, dtype=spec.dtype, progress=False)
        shard_decoder(model, rank, spec.world, collectives.all_reduce)
        counter = EncodeCounter(model.visual)
        runner = _start(model, conn.recv(), device)
        conn.send(("ready", os.getpid()))
        _serve(conn, runner, collectives, counter, device)
    except (EOFError, KeyboardInterrupt):  # rank 0 closed the pipe: leave quietly
        os._exit(0)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        finally:
            os._exit(1)  # a rank that failed mid-step cannot pair rank 0's collectives any more
    os._exit(0)


def _start(model: Qwen3VL, init: tuple, device: torch.device) -> ModelRunner:
    """The worker's pool and step graphs, captured as rank 0 captures its own (same sizes, same
    order), from rank 0's ``("init", pool keywords, graph keywords or None)``."""
    kind, pool_spec, graphs = init
    if kind != "init":
        raise RuntimeError(f"expected init, got {kind!r}")
    if device.type == "cuda":
        model.language_model.fuse_projections()
    pool_spec = dict(pool_spec)
    host_pages = pool_spec.pop("host_pages", 0)
    pool = PagePool(**pool_spec, device=device)
    # this rank's shard of every host-tier page; the page ids come in rank 0's orders
    transfers = KVTransfers(pool, HostPool(pool, host_pages)) if host_pages else None
    decode = prefill = None
    if graphs is not None:
        decode, prefill = capture_step_graphs(model, pool, **graphs,
                                              gates=transfers.gates if transfers is not None else None)
    warm_up_kernels(pool.layers[0], model.language_model.layers[0].self_attn.heads, model.dtype)
    return ModelRunner(model, pool, None, decode, prefill, transfers=transfers)


def _serve(conn, runner: ModelRunner, collectives: Collectives, counter: EncodeCounter,
           device: torch.device) -> None:
    steps = copies = moves = merges = offloads = restores = 0
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "plan":
            plan: StepPlan
            plan, named, shape = message[1]
            runner.take(plan)
            if runner.transfers is not None:
                runner.transfers.poll()  # rank 0 reports copies; here finished ones are only let go
            copies += sum(isinstance(order, PageCopy) for order in plan.kv_orders)
            moves += sum(isinstance(order, SlotMove) for order in plan.kv_orders)
            merges += sum(isinstance(order, ValueMerge) for order in plan.kv_orders)
            offloads += sum(isinstance(order, Offload) for order in plan.kv_orders)
            restores += sum(isinstance(order, Restore) for order in plan.kv_orders)
            features = {}
            if shape is not None:  # rank 0's features of the runs named, in that order
                received, first = receive_features(collectives, shape, device), 0
                for req_id, rows in named:
                    picked = torch.arange(first, first + len(rows), device=device)
                    features[req_id] = (torch.tensor(rows, dtype=torch.long), received.select(picked))
                    first += len(rows)
            try:
                if plan.runs:
                    runner.compute(plan.runs, features, head=False)
                    steps += 1
            finally:  # as rank 0's execute: every gated restore of the plan started and ordered
                runner.finish_forward()
        elif kind == "counters":
            conn.send(("counters", {"vision_images_encoded": counter.images, "steps": steps, "page_copies": copies,
                                 "slot_moves": moves, "value_merges": merges, "offloads": offloads,
                                 "restores": restores,
                                 "transfers_held": runner.transfers.in_flight() if runner.transfers else 0}))
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown plan message {kind!r}")
