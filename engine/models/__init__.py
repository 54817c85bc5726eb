"""Models: config, checkpoint IO, transformer, MoE block, KV cache, batching, feature heads, expert predictor."""
