"""A step trace for profiling: one JSON line per engine step, written where ``PRISM_STEP_TRACE`` names.

Off unless the environment variable is set (an operator's or a benchmark's switch, not an option
a client can reach). Each line describes one step of :class:`~engine.serving.loop.EngineLoop`:

- ``t``: when the step began, ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, so a
  benchmark in another process on the same host can cut the trace by its own clock readings);
- ``plan_ms``: intake, prefix lookups and scheduling, under the loop's lock; ``exec_ms``: the
  runner's execution (data moves, vision encoder, forward, sampling: the GPU sync is in it);
  ``apply_ms``: the scheduler's update, detokenisation and delivery; ``gap_ms``: from the end of
  the previous traced step to this one's start (the loop thread idle, waiting for work, or kept
  from running by other threads holding the GIL);
- ``runs``, ``tokens``, ``decode_rows``, ``prefill_tokens``, ``warm_tokens``: what the plan
  computed (a warm's chunks counted in ``prefill_tokens`` too);
- ``path``: which forward ran (``"graph"``: the decode CUDA graph, ``"prefill_graph"``,
  ``"eager"``, ``"none"``: no forward);
- ``vision_ms``: the encoder's time for the step's requests; ``restores`` / ``offloads``: host-tier
  copies the plan started; ``awaited``: copies of earlier plans this step's runs waited for;
  ``early_restores``: restores started while this step ran, for questions that arrived meanwhile
  (their first chunk is in the next step).

No request ids, salts or tokens are written: the trace says how the engine spent its time, not
whose work it was. Lines are buffered and flushed every :data:`FLUSH_EVERY` steps and at close.
"""

from __future__ import annotations

import json
import os
import threading
from typing import IO

#: Environment variable naming the trace file (appended to; created if missing).
ENV = "PRISM_STEP_TRACE"

#: Steps buffered between flushes.
FLUSH_EVERY = 64


class StepTrace:
    """Appends one JSON object per step to ``path`` (see the module docstring for the fields).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lines: list[str] = []
        self._last_end: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """The trace the environment asks for (``PRISM_STEP_TRACE``), or None when unset/empty."""
        path = os.environ.get(ENV, "")
        return cls(path) if path else None

    def record(self, start: float, planned: float, executed: float, end: float, fields: dict) -> None:
        """One step: its four ``perf_counter`` readings (seconds) and the plan's counts ``fields``."""
        gap = (start - self._last_end) * 1e3 if self._last_end is not None else None
        self._last_end = end
        line = {"t": round(start, 6), "gap_ms": None if gap is None else round(gap, 3),
                "plan_ms": round((planned - start) * 1e3, 3), "exec_ms": round((executed - planned) * 1e3, 3),
                "apply_ms": round((end - executed) * 1e3, 3), **fields}
        with self._lock:
            self._lines.append(json.dumps(line, separators=(",", ":")))
            if len(self._lines) >= FLUSH_EVERY:
                self._flush()

    def _flush(self) -> None:
        if self._file is not None and self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
        self._lines = []

    def close(self) -> None:
        """Write what is buffered and close the file; idempotent."""
        with self._lock:
            self._flush()
            if self._file is not None:
                self._file.close()
                self._file = None


def read(path: str) -> list[dict]:
    """The records of a trace file, in step order (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
