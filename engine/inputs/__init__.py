"""The inputs wing: chat messages to prompts (token ids, M-RoPE positions, visual spans), opening
images safely, the processed-image cache, and the vision-feature lookup for a prompt."""
