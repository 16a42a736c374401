"""Tensor parallelism across the GPUs of one host (one process per rank; see docs/SCALING.md).

``sharding.py`` splits the decoder Megatron-style, ``group.py`` starts the worker processes and
carries rank 0's step plans to them, ``worker.py`` is a worker's side (it executes each plan: its
KV data moves, then its share of the forward), ``runner.py`` is rank 0's runner, which sends every
step plan to the workers before running its own share. Compaction's token scores come from the vision encoder, which
only rank 0 runs, so rank 0 alone selects the kept tokens (docs/SCALING.md). Nothing outside
this wing (but :class:`engine.Engine`) knows it exists: with ``tensor_parallel_size=1`` none of it
is imported.
"""
