"""Which engine process takes a new request (`num_engine_processes > 1`): the least loaded, unless
the process that last took a prompt with the same first KV block (and cache salt) is within
`slack` requests of it, so that prefix caching keeps finding the shared prefix. Pure: told each
process's load, it keeps only the affinity table (bounded, least recently used out first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Affinity keys remembered; one per distinct first block seen, oldest dropped first. Bounds the
# router's memory whatever the prompts; a forgotten key costs at most one prefix-cache miss.
MAX_AFFINITY_KEYS = 16384
# The affine process may hold this share of a full batch (max_num_seqs) more requests than the
# least loaded one: enough that a shared prefix stays on one process under balanced load, small
# enough that a hot prefix never piles requests onto one process while another idles.
AFFINITY_SLACK_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class ChildLoad:
    """One engine process's outstanding work: requests admitted to it and not yet finished."""

    num_requests: int
    num_prompt_tokens: int


def affinity_slack(max_num_seqs: int) -> int:
    """Requests by which the affine process may exceed the least loaded one."""
    return max(1, int(max_num_seqs * AFFINITY_SLACK_SHARE))


class Router:
    """Least outstanding requests (then prompt tokens, then index), with prefix affinity."""

    def __init__(self, block_size: int, slack: int, *, max_keys: int = MAX_AFFINITY_KEYS) -> None:
        if block_size < 1 or slack < 0 or max_keys < 1:
            raise ValueError("block_size and max_keys must be >= 1, slack >= 0")
        self.block_size = block_size
        self.slack = slack
        self.max_keys = max_keys
        self._affinity: OrderedDict[tuple[str | None, tuple[int, ...]], int] = OrderedDict()

    def route(
        self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[ChildLoad | None]
    ) -> int | None:
        """The process for a new request; loads[i] is None for a process that is down. None:
        every process is down."""
        least = least_loaded(loads)
        if least is None:
            return None
        key = self._key(token_ids, cache_salt)
        if key is None:  # shorter than a block: nothing the prefix cache could share
            return least
        chosen = least
        affine = self._affinity.get(key)
        if affine is not None and affine < len(loads):
            load = loads[affine]
            least_load = loads[least]
            assert least_load is not None  # least_loaded picks a live process
            if load is not None and load.num_requests - least_load.num_requests <= self.slack:
                chosen = affine
        self._remember(key, chosen)
        return chosen

    def forget_child(self, index: int) -> None:
        """The process restarted with an empty prefix cache: its affinities lead nowhere."""
        for key in [k for k, v in self._affinity.items() if v == index]:
            del self._affinity[key]

    @property
    def num_keys(self) -> int:
        return len(self._affinity)

    def _key(
        self, token_ids: Sequence[int], cache_salt: str | None
    ) -> tuple[str | None, tuple[int, ...]] | None:
        # The prefix cache shares only whole blocks, and only within one cache salt.
        if len(token_ids) < self.block_size:
            return None
        return cache_salt, tuple(token_ids[: self.block_size])

    def _remember(self, key: tuple[str | None, tuple[int, ...]], index: int) -> None:
        self._affinity[key] = index
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_keys:
            self._affinity.popitem(last=False)


def least_loaded(loads: Sequence[ChildLoad | None]) -> int | None:
    """The live process with the fewest outstanding requests, then prompt tokens, then index."""
    best: int | None = None
    best_key: tuple[int, int] | None = None
    for index, load in enumerate(loads):
        if load is None:
            continue
        key = (load.num_requests, load.num_prompt_tokens)
        if best_key is None or key < best_key:
            best, best_key = index, key
    return best
