"""Tensor parallelism across the GPUs of one host (one process per rank; see docs/SCALING.md).

``sharding.py`` splits the decoder Megatron-style, ``group.py`` starts the worker processes and
carries rank 0's step plans to them, ``worker.py`` is a worker's side, ``runner.py`` and
``pool.py`` are rank 0's runner and KV pool that send every forward and every KV data move to the
workers before doing it themselves. Compaction's token scores come from the vision encoder, which
only rank 0 runs, so rank 0 alone selects the kept tokens (docs/SCALING.md). Nothing outside
this wing (but :class:`engine.Engine`) knows it exists: with ``tensor_parallel_size=1`` none of it
is imported.
"""
