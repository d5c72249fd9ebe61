"""Scale to zero and the memory budget: idle models unload and load again on their next request;
loads that would pass the server's memory budget evict the least recently used idle models.

Kept import-free: `fulcrum.config` reads `lifecycle.settings`, and the manager imports config.
"""
