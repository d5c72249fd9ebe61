"""Torch intra-op threads per engine. In torch's OpenMP builds the count a matmul uses is the
CALLING thread's (`omp_set_num_threads` sets a per-thread value), so an engine that pins its own
stepping thread never changes what another model's thread uses. (A native-pool build has one
count per process: there the last engine to pin wins; `PER_THREAD` says which build runs.)"""

from __future__ import annotations

import torch

# torch's count as this module was first imported (before any engine pinned one): what an engine
# with `num_threads = 0` keeps, rather than whatever the last engine set process-wide.
DEFAULT_NUM_THREADS = torch.get_num_threads()
PER_THREAD = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def pin_num_threads(num_threads: int) -> None:
    """Give the calling thread `num_threads` intra-op threads (0: torch's default)."""
    wanted = num_threads or DEFAULT_NUM_THREADS
    # get_num_threads first also runs torch's lazy per-thread init: a thread that sets its
    # count before that init has it overwritten by the process-wide value on its first op.
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
