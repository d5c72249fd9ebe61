"""Routing across arms and models, declared in a model's `[routing]` table: an A/B split between
variants or versions (`ab`), shadow traffic to a reference with live agreement (`shadow`,
`agreement`), and a two-model cascade (`cascade`; for LLMs over the OpenAI API,
`generation_cascade`); `settings` is the config (L1: the config's
validation imports it), `metrics` their Prometheus families and statistics. The A/B decision
picks the variant; the lane router then picks the lane.
"""
