"""Lanes: a model's requests split over several batchers (each a variant with its own instances,
threads and batch policy), routed by name or deadline with spill-over and failover.

`settings` (config, L1: the config's validation imports it), `choice` (the pure decision),
`group` (a version's lanes over one variant) and `router` (the service's default `Router`);
imported by module, so validating a config loads no batcher.
"""
