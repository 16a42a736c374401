"""The model wing: the Qwen3-VL network (config, layers, M-RoPE, vision tower with DeepStack, text
decoder, LM head), checkpoint loading and lookup, the attention-context interface the decoder calls,
and the tiny test checkpoints with the rebuilt Qwen tokenizer. It imports no other wing."""
