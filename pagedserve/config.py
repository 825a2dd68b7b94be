"""Engine configuration: frozen dataclasses built once in the composition root and passed down.

Derived values (number of KV blocks, EOS ids) are computed by their owners and passed on as
explicit arguments, never written back into a config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MiB``, ``1.5GB`` or ``1048576``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a Hugging Face directory or a ``.gguf`` file; None means the default model.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's own context length
    served_model_name: str | None = None
    seed: int = 0
    # weight storage: None (the default: `gguf` for a .gguf file, `none` otherwise) | none | int8 | int4 | gguf
    quantization: str | None = None
    quantization_group_size: int = 32  # int4: input features per scale (32, 64 or 128)
    quantization_symmetric: bool = False  # int4: no zero-points

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantization not in (None, "none", "int8", "int4", "gguf"):
            raise ValueError(f"quantization must be none, int8, int4 or gguf, not {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError("quantization_group_size must be 32, 64 or 128")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")


DEFAULT_BLOCK_SIZE_CPU = 128
DEFAULT_BLOCK_SIZE_ACCELERATOR = 16


DEFAULT_MEMORY_UTILIZATION_CPU = 0.5
DEFAULT_MEMORY_UTILIZATION_ACCELERATOR = 0.9


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size, size in bytes, prefix caching.

    ``block_size=None`` picks the device's default (``resolved_block_size``): 128 tokens on CPUs,
    as vLLM's CPU backend does (long runs of contiguous K/V keep the hardware prefetcher
    streaming, so decode attention at long contexts is faster than with 16; see
    docs/design/cpu-performance.md), 16 elsewhere.
    Prefix caching shares whole blocks only, so larger blocks share less of short prefixes.

    ``kv_cache_memory=None`` sizes the cache from the memory the engine may use
    (``engine/kv_cache_sizing.py``): ``memory_utilization`` of the machine's RAM or cgroup limit on CPUs
    (0.5 by default), of the device's memory on accelerators (0.9, as vLLM's ``gpu_memory_utilization``),
    for weights, activations and KV together, split evenly between the ``memory_shared_by`` engines
    that one server starts on the machine.
    """

    block_size: int | None = None
    kv_cache_memory: int | None = None  # bytes for K and V of all layers together; None: from memory_utilization
    memory_utilization: float | None = None  # None: the device's default
    memory_shared_by: int = 1  # engines (models x replicas) one server starts that split memory_utilization
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: force a tiny cache

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size <= 0 or self.block_size & (self.block_size - 1)):
            raise ValueError("block_size must be a positive power of two")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("memory_utilization must be > 0 and <= 1")
        if self.memory_shared_by < 1:
            raise ValueError("memory_shared_by must be at least 1")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError("num_blocks_override must be at least 2")

    def resolved_block_size(self, device_type: str) -> int:
        """The block size in tokens: the configured one, else the default for ``device_type``."""
        if self.block_size is not None:
            return self.block_size
        return DEFAULT_BLOCK_SIZE_CPU if device_type == "cpu" else DEFAULT_BLOCK_SIZE_ACCELERATOR

    def resolved_memory_utilization(self, device_type: str) -> float:
        """The share of memory the engine may use: the configured one, else the default for ``device_type``."""
        if self.memory_utilization is not None:
            return self.memory_utilization
        return DEFAULT_MEMORY_UTILIZATION_CPU if device_type == "cpu" else DEFAULT_MEMORY_UTILIZATION_ACCELERATOR


KV_ADMISSION_POLICIES = ("immediate", "lookahead")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by decode and prefill
    tokens; prompts longer than what is left of it are prefilled in chunks. ``kv_admission``:
    ``immediate`` starts a waiting request as soon as its prompt fits (vLLM's way: the most requests
    at once, the newest preempted and recomputed when the cache runs out); ``lookahead`` starts it
    only if the KV cache can hold what it and the running requests are still expected to need
    (almost no preemption, so no stalled streams, but longer waits for the first token).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    kv_admission: str = "immediate"  # immediate | lookahead

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError("policy must be fcfs or priority")
        if self.kv_admission not in KV_ADMISSION_POLICIES:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSION_POLICIES)}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's ``--speculative-config`` keys.

    ``ngram`` (prompt lookup): the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens of a
    sequence are looked up earlier in it (prompt and output), and the ``num_speculative_tokens``
    tokens that followed the most recent match are proposed; the target model checks them all in
    one forward. Speculation is off for a step when more than ``disable_by_batch_size`` requests
    run (the verification rows cost more than they save in a large batch).

    ``draft_model``: a smaller model of the same vocabulary (``model``: a Hugging Face directory or a
    ``.gguf`` file) proposes ``num_speculative_tokens`` tokens greedily, one forward each, over its own
    KV cache that shares the target's block tables; the target checks them as it checks lookups.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    disable_by_batch_size: int = 8
    model: str | None = None  # draft_model: the draft's path

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, not {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative config: num_speculative_tokens must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative config: prompt_lookup_min must not exceed prompt_lookup_max")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative config: method 'draft_model' needs \"model\": the draft model's path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative config: \"model\" is for method 'draft_model', not 'ngram'")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM's JSON form; an unknown key is an error. Only one of ``prompt_lookup_max`` /
        ``prompt_lookup_min`` given: the other takes its value where the default would not fit."""
        if not isinstance(values, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = sorted(set(values) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(
                f"speculative config: unknown key(s) {', '.join(unknown)}; known: {', '.join(_SPECULATIVE_KEYS)}"
            )
        values = dict(values)
        if "method" not in values and "model" in values:
            values["method"] = "draft_model"  # as vLLM reads a config that names only a model
        if "method" not in values:
            raise ValueError("speculative config: 'method' is required (e.g. \"ngram\")")
        lookup_max, lookup_min = values.get("prompt_lookup_max"), values.get("prompt_lookup_min")
        if isinstance(lookup_max, int) and lookup_min is None:
            values["prompt_lookup_min"] = min(lookup_max, DEFAULT_PROMPT_LOOKUP_MIN)
        if isinstance(lookup_min, int) and lookup_max is None:
            values["prompt_lookup_max"] = max(lookup_min, DEFAULT_PROMPT_LOOKUP_MAX)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` processes (ranks) each hold a slice of every large
    weight and of the KV cache (by attention heads) and run one forward together; one scheduler."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be a positive integer")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; built once from the CLI or the LLM constructor."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    max_logprobs: int = 20
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        spec = self.speculative
        if self.parallel.tensor_parallel_size > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError(
                "speculative method 'draft_model' does not run with tensor_parallel_size > 1; use 'ngram' or one rank"
            )


ENGINE_KINDS = ("paged", "hf")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: the name clients send as ``model``, what backs it, and how many replicas.

    ``replicas`` counts engine replicas on Ray Serve; the single-process server runs one engine per
    name (``replicas`` 1). Replacing the engine behind a name (hot swap) means a new ModelSpec.
    """

    name: str
    engine_config: EngineConfig
    engine: str = "paged"  # paged | hf
    replicas: int = 1

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"invalid model name {self.name!r}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}; got {self.engine!r}")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.engine == "hf" and self.engine_config.speculative is not None:
            raise ValueError("speculative decoding needs the paged engine, not --engine hf")
        if self.engine == "hf" and self.engine_config.parallel.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism needs the paged engine, not --engine hf")


REQUEST_ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Engine replicas on Ray Serve (``pagedserve serve --replicas N`` or ``--ray-address``).

    ``ray_address`` None starts a local Ray instance bound to 127.0.0.1; otherwise the server joins
    that cluster (``ray start --head`` on one node, ``ray start --address`` on the others).
    """

    ray_address: str | None = None
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    request_router: str = "prefix-affinity"
    object_store_memory: int = 256 << 20  # bytes, the local instance's object store
    dashboard: bool = False  # the local instance's Ray dashboard
    # prefix-affinity: a replica this many requests busier than the least loaded one is passed over
    imbalance_threshold: int = 8

    def __post_init__(self) -> None:
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {', '.join(REQUEST_ROUTERS)}")
        if self.cpus_per_replica <= 0:
            raise ValueError("cpus_per_replica must be positive")
        if self.gpus_per_replica < 0:
            raise ValueError("gpus_per_replica must be >= 0")
