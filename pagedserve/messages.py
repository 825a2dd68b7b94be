"""The engine-core wire types: what goes in (EngineCoreRequest) and comes out (EngineCoreOutput) of an
engine, and the typed messages a client and the engine-core loop (``engine/core_loop.py``) exchange.

A leaf module (it imports only ``pagedserve.outputs``, ``pagedserve.sampling_params`` and the standard
library), so the scheduler, the engines, the clients and the front ends can all import it.
Token ids only; text (and the tokenizer) lives in the front end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.outputs import FinishReason, TokenLogprob
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized request. ``n`` samples come back as outputs with ``index`` 0..n-1."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic()
    priority: int = 0  # lower runs first under the priority policy
    # empty: the model's own (ModelInfo.eos_token_ids); the front end fills in its tokenizer's EOS
    # when the model has none (pagedserve.tokenizer.eos_token_ids)
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # prefix-cache isolation: hits only among requests with the same salt


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one sample since the previous step; ``finish_reason`` set on the last one."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, with the first token
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # monotonic; sent with the first output
    # the request ended with this error instead of a finish reason (its grammar did not compile in the core, or
    # every replica of a cluster tried failed)
    error: str | None = None


ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the scheduler and KV cache for metrics and logs (counters are cumulative)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use by live requests, 0..1
    num_blocks: int = 0
    kv_capacity_tokens: int = 0  # the tokens the KV cache holds: num_blocks times the block size
    num_free_blocks: int = 0  # of num_blocks; cached ones included
    num_cached_free_blocks: int = 0  # of the free blocks, those still in the prefix cache
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (excludes cache hits)
    num_generation_tokens: int = 0
    num_steps: int = 0
    # steps by tokens computed: counts per bucket of ITERATION_TOKEN_BUCKETS (upper bounds), the last one
    # past them all; and the tokens of all steps (vLLM's iteration_tokens_total histogram)
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    busy_seconds: float = 0.0  # wall time with requests in flight, step start to step start (paged engine)
    model_forward_seconds: float = 0.0  # of it, in the model forward and logits (paged engine)
    model_forward_cpu_seconds: float = 0.0  # CPU time of the engine's process meanwhile, all threads (paged engine)
    engine_cpu_seconds: float = 0.0  # CPU time of the process the engine runs in, all threads (paged engine)
    # speculative decoding: verifications run (a request's drafts in one step), draft tokens verified,
    # of them accepted, and accepted per draft position (vLLM's spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@dataclass(slots=True)
class ModelInfo:
    """What the front end needs to know about the served model (no tokenizer: the front end loads its own)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # from config.json / generation_config.json / GGUF metadata; may be empty
    dtype: str  # "float32", "bfloat16", "float16"
    generation_config: dict = field(default_factory=dict)
    num_kv_blocks: int = 0  # 0 for engines without a paged cache
    block_size: int = 0
    engine_name: str = "paged"  # "paged" | "hf"
    num_threads: int = 0  # torch intra-op threads of the engine (0: not reported)
    threads_reason: str = ""  # where that count comes from (host_resources.CpuBudget.reason)
    kv_cache_bytes: int = 0  # the paged KV cache's size (0 for engines without one)
    kv_cache_reason: str = ""  # how that size was chosen (engine.kv_cache_sizing.KVCacheSize.reason)
    tensor_parallel_size: int = 1  # processes the model is split over


@dataclass(slots=True)
class ReplicaStatus:
    """One engine replica behind a served name: where it runs and its latest stats (admin API, metrics)."""

    replica_id: str  # "0" for the single-process server's engine; Ray Serve's replica id on a cluster
    pid: int
    node: str  # host name (single process) or Ray node id
    stats: SchedulerStats


# --------------------------------------------------------------------------- client -> engine-core loop
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request (checked by the front end; the engine only asserts its invariants). No reply."""

    request: EngineCoreRequest


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort whole requests (every sample); applied after every message sent before it."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopSamples:
    """Finish single samples ``(request_id, index)`` (e.g. a stop string matched in the front end)."""

    samples: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Warmup:
    """Run the engine's warm-up; answered with ``WarmupDone``."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the loop; messages after it are not applied."""


ClientMessage = AddRequest | AbortRequests | StopSamples | Warmup | Shutdown


# --------------------------------------------------------------------------- engine-core loop -> client
@dataclass(frozen=True, slots=True)
class CoreReady:
    """The engine is built (process core: the first message)."""

    model_info: ModelInfo


@dataclass(frozen=True, slots=True)
class CoreOutputs:
    """One step's outputs (possibly empty) and, at most every STATS_INTERVAL_S, a stats snapshot."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


@dataclass(frozen=True, slots=True)
class CoreStats:
    """A stats snapshot sent on going idle."""

    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class WarmupDone:
    """The answer to ``Warmup``."""


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The engine failed (at start-up or in a step); sent once, the loop has ended."""

    error: str  # one line, for EngineDeadError / RuntimeError messages
    details: str = ""  # the traceback, for the log


CoreMessage = CoreReady | CoreOutputs | CoreStats | WarmupDone | CoreFailed
