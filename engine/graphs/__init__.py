"""The CUDA-graph wing: decode, prefill and vision-encoder graphs and their shared capture helper.
Graphs wrap the model and the pool from outside; nothing here is imported where Triton is absent."""
