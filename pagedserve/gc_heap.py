"""Keeping CPython's full garbage collections short in long-running processes.

A full (generation 2) collection walks every container object the process tracks. After start-up
that is hundreds of thousands of them (torch, transformers, FastAPI, the model's modules), and one
full pass takes hundreds of milliseconds on a small CPU (docs/design/cpu-performance.md): a stall
of every stream in the process. The server front end, the engine core and the ``pagedserve bench``
client each call ``freeze_heap()`` once their start-up is done (the bench again after each load
point), as vLLM's ``freeze_gc_heap`` does: what is alive then moves to the permanent generation, so
later collections walk only what was allocated since. Freezing before a fork also keeps the
child's collector from writing to the inherited objects' headers, which would copy the parent's
pages into the child.

Only composition roots call this (it changes the whole process's collector), never library code.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_heap(owner: str) -> int:
    """Collect what is garbage now, then exempt every surviving object from later collections.

    Returns the number of frozen objects (every call so far, in this process). ``owner`` names the
    process in the log line.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects frozen out of the garbage collector's passes", owner, frozen)
    return frozen
