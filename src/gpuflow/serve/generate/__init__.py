"""Text generation for causal language models: a KV cache allocated once, continuous
batching of decode steps, sampling, and text streamed as it is generated."""
