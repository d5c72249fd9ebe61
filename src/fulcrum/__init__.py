"""Fulcrum: an inference server that finds and holds the balance between latency and throughput."""

__version__ = "0.1.0"
