"""Fulcrum's generative engine: continuous batching over a paged KV cache with prefix caching."""
