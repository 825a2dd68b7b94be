"""LLMEngine: the synchronous engine core. ``step()`` = schedule -> execute_model -> update_from_output.

It takes requests the front end has checked (token ids only; it asserts its own invariants), owns the
scheduler, the KV cache manager and the model runner, and is driven by the offline ``LLM`` or, in the
server, by the engine-core loop (``core_loop.py``) in a thread or a child process.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref

import torch

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.kv_cache_sizing import KVCacheSize, activation_reserve, device_memory, kv_cache_size
from pagedserve.host_resources import CpuBudget, thread_budget
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.models.loader import LoadedModel, ModelLoadError, load_model
from pagedserve.models.tensor_parallel import TensorParallel
from pagedserve.outputs import FinishReason
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.manager import StructuredOutputManager, build_compiler
from pagedserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from pagedserve.worker.tensor_parallel_executor import TensorParallelError, TensorParallelExecutor, rank_device

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_SECONDS = 0.005  # an idle step's wait for a compile (new messages are read between steps)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    """Engine core over token ids. Not thread-safe: one caller drives it."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        threads = thread_budget(config.num_threads)
        tp_size = config.parallel.tensor_parallel_size
        if tp_size > 1:  # each rank (this process and tp_size - 1 workers) gets an equal share of the CPUs
            threads = CpuBudget(
                max(1, threads.count // tp_size), f"per rank: {threads.count}, {threads.reason}, over {tp_size} ranks"
            )
        torch.set_num_threads(threads.count)
        self.device = resolve_device(config.device)
        self.executor: TensorParallelExecutor | None = None
        self._tensor_parallel_failure: TensorParallelError | None = None  # set once a step failed mid-way
        tensor_parallel = TensorParallel(0, tp_size)
        if tp_size > 1:
            if loaded is not None:
                raise ValueError("a model loaded whole cannot be split over tensor-parallel ranks; pass none")
            self.device = rank_device(self.device, 0)
            self.executor = TensorParallelExecutor(config, self.device, threads.count)
            tensor_parallel = self.executor.tensor_parallel
            # the workers stop when this engine is collected or the interpreter exits, whichever comes first
            self._close_executor = weakref.finalize(self, self.executor.close)
        try:
            self._build(config, loaded, threads, tensor_parallel)
        except BaseException:
            self.shutdown()
            raise

    def _build(
        self, config: EngineConfig, loaded: LoadedModel | None, threads: CpuBudget, tensor_parallel: TensorParallel
    ) -> None:
        loaded = loaded or load_model(config.model, self.device, tensor_parallel)
        if self.executor is not None:
            self.executor.wait_loaded()
        draft = self._load_draft(config, loaded)
        cache = config.cache
        self.block_size = block_size = cache.resolved_block_size(self.device.type)
        block_bytes = sum(  # a draft model's K/V shares the blocks; all ranks' K/V heads together
            kv_cache_bytes_per_block(m.num_layers, block_size, m.kv_heads_all_ranks, m.head_dim, m.dtype)
            for m in (loaded, draft)
            if m is not None
        )
        kv_size = self._kv_cache_size(config, loaded, block_size, block_bytes)
        num_blocks = cache.num_blocks_override or max(2, kv_size.bytes // block_bytes)
        capacity = (num_blocks - 1) * block_size
        if config.model.max_model_len is not None and capacity < config.model.max_model_len:
            raise ValueError(
                f"The KV cache holds {capacity} tokens ({num_blocks - 1} blocks of {block_size}), fewer than one "
                f"request of max_model_len={config.model.max_model_len} needs: give it more memory "
                f"(--kv-cache-memory or --memory-utilization; now {kv_size.bytes} bytes: {kv_size.reason}) "
                "or lower --max-model-len."
            )
        self.max_model_len = min(loaded.max_model_len, capacity)  # the model's own length: lowered to fit
        if self.max_model_len < loaded.max_model_len:
            logger.warning(
                "max_model_len lowered from %d to %d tokens: that is all the KV cache holds",
                loaded.max_model_len,
                self.max_model_len,
            )
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.kv_cache = KVCacheManager(num_blocks, block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, config.speculative)
        # wall seconds from one step's start to the next while requests were in flight (cumulative): the
        # steps themselves and what the engine loop does between them (inputs, sending outputs)
        self._busy_seconds = 0.0
        self._busy_since: float | None = None
        batch_size_hint = min(config.scheduler.max_num_seqs, 64)
        if self.executor is not None:
            self.executor.build_runners(num_blocks, block_size, batch_size_hint)
        self.runner = ModelRunner(
            loaded.model,
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            vocab_size=loaded.vocab_size,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=loaded.dtype,
            device=self.device,
            seed=config.model.seed,
            batch_size_hint=batch_size_hint,
            draft=draft,
            send_plan=self.executor.send_plan if self.executor is not None else None,
        )
        self.model_info = ModelInfo(
            model_name=loaded.model_name,
            max_model_len=self.max_model_len,
            vocab_size=loaded.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            dtype=str(loaded.dtype).removeprefix("torch."),
            generation_config=dict(loaded.generation_config),
            num_kv_blocks=num_blocks - 1,
            block_size=block_size,
            engine_name="paged",
            num_threads=threads.count,
            threads_reason=threads.reason,
            kv_cache_bytes=num_blocks * block_bytes,
            kv_cache_reason=kv_size.reason,
            tensor_parallel_size=tensor_parallel.world_size,
        )
        self.dtype = loaded.dtype
        # grammar compiler (the tokenizer's vocabulary) built on its own thread; requests with structured
        # outputs wait there for their compile while the others step
        self.structured = StructuredOutputManager(
            functools.partial(build_compiler, config.model, loaded.vocab_size, loaded.eos_token_ids), loaded.vocab_size
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB: %s), dtype %s, device %s",
            num_blocks - 1,
            block_size,
            capacity,
            num_blocks * block_bytes / 2**20,
            self.model_info.kv_cache_reason,
            loaded.dtype,
            self.device,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def _load_draft(self, config: EngineConfig, loaded: LoadedModel) -> LoadedModel | None:
        """The speculative draft model, with the target's dtype; its vocabulary must be the target's."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        draft = load_model(ModelConfig(model=spec.model, dtype=config.model.dtype), self.device)
        if draft.vocab_size != loaded.vocab_size:
            raise ModelLoadError(
                f"the draft model {spec.model} has a vocabulary of {draft.vocab_size} tokens, the model "
                f"{loaded.model_name} one of {loaded.vocab_size}: a draft model must share the target's tokenizer"
            )
        logger.info("draft model %s: %d layers, context %d", draft.model_name, draft.num_layers, draft.max_model_len)
        return draft

    def _kv_cache_size(
        self, config: EngineConfig, loaded: LoadedModel, block_size: int, block_bytes: int
    ) -> KVCacheSize:
        """The KV cache's bytes: configured, or sized from the memory left after the weights loaded."""
        if config.cache.num_blocks_override is not None:
            return KVCacheSize(0, "a fixed number of blocks")
        hf = loaded.hf_config
        hidden = getattr(hf, "hidden_size", 0)
        draft_rows = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        reserve = activation_reserve(
            hidden,
            getattr(hf, "intermediate_size", 4 * hidden),
            loaded.vocab_size,
            config.scheduler,
            rows_per_seq=1 + draft_rows,
        )
        # the most the cache can be used for: max_num_seqs sequences at the full context length
        max_len = config.model.max_model_len or loaded.max_model_len
        most_useful = (config.scheduler.max_num_seqs * cdiv(max_len, block_size) + 1) * block_bytes
        return kv_cache_size(config.cache, self.device, device_memory(self.device), reserve, most_useful)

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end checked (pagedserve.entrypoints.input_checks); the invariants
        the engine relies on are asserted, not reported."""
        assert 0 < len(request.prompt_token_ids) < self.max_model_len, "prompt empty or longer than the context"
        if request.sampling_params.structured_outputs is not None:
            self.structured.submit(request)  # scheduled once its grammar is compiled
            return
        self._schedule_request(request)

    def _schedule_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params  # a seed's generators are the runner's (sample i: seed + i)
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                index=0,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=params,
                arrival_time=request.arrival_time,
                eos_token_ids=tuple(request.eos_token_ids) or self.eos_token_ids,
                priority=request.priority,
                cache_salt=request.cache_salt,
                num_samples_to_fork=params.n,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured.abort(request_ids)
        self.scheduler.abort_requests(request_ids)
        self._close_busy_period()

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        self.scheduler.stop_samples(samples)
        self._close_busy_period()

    def _close_busy_period(self) -> None:
        """Requests removed between steps may leave the engine idle: the busy time ends now, not at
        the next step (which may come after an idle wait)."""
        if self._busy_since is not None and not self.scheduler.has_unfinished_requests():
            self._busy_seconds += time.perf_counter() - self._busy_since
            self._busy_since = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured.has_pending

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[EngineCoreOutput]:
        if self._tensor_parallel_failure is not None:
            raise self._tensor_parallel_failure
        start = time.perf_counter()
        if self._busy_since is not None:  # the engine had work since the last step began
            self._busy_seconds += start - self._busy_since
        failed = self._admit_compiled() if self.structured.has_pending else []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._busy_since = None
            if self.structured.has_pending and not failed:
                self.structured.wait(GRAMMAR_WAIT_SECONDS)  # nothing to run until a grammar is ready
            return failed
        structured = self.structured
        structured.release(sched.finished_req_ids, self.scheduler.requests.__contains__)
        try:
            result = self.runner.execute_model(sched, structured.logits_mask(sched))
        except BaseException as exc:
            if self.executor is None:
                raise
            # the ranks may now be at different collectives: this engine cannot step again
            cause = self.executor.explain_failure(exc)
            self._tensor_parallel_failure = TensorParallelError(
                f"a step failed, the tensor-parallel workers were stopped: {cause or repr(exc)}"
            )
            self.shutdown()
            if cause is not None:
                raise cause from exc
            raise
        structured.accept(sched, result)
        outputs = self.scheduler.update_from_output(sched, result)
        if failed:
            outputs = failed + outputs
        if self.scheduler.has_unfinished_requests():
            self._busy_since = start  # this step's time is counted when the next one starts
        else:
            self._busy_seconds += time.perf_counter() - start
            self._busy_since = None
        return outputs

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Schedule the requests whose grammar compiled; end those whose compile failed with an error."""
        ready, failed = self.structured.take_compiled()
        for request in ready:
            self._schedule_request(request)
        return [
            EngineCoreOutput(request.request_id, 0, [], finish_reason=FinishReason.ABORT, error=error)
            for request, error in failed
        ]

    def check_health(self) -> None:
        """Raise if the engine cannot serve any more (a tensor-parallel worker died); cheap."""
        if self._tensor_parallel_failure is not None:
            raise self._tensor_parallel_failure
        if self.executor is not None:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step after this."""
        if self.executor is not None:
            self._close_executor()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        stats.busy_seconds = self._busy_seconds
        stats.model_forward_seconds = self.runner.forward_seconds
        stats.model_forward_cpu_seconds = self.runner.forward_cpu_seconds
        stats.engine_cpu_seconds = time.process_time()
        return stats

    def warmup(self, num_prompt_tokens: int = 32, num_output_tokens: int = 4) -> None:
        """Run a real prefill and a few decode steps (first-call costs), then forget them."""
        prompt = [i % self.vocab_size for i in range(1, num_prompt_tokens + 1)]
        request_id = "__warmup__"
        params = SamplingParams(max_tokens=num_output_tokens, ignore_eos=True, temperature=0.0)
        self.add_request(EngineCoreRequest(request_id, prompt, params, time.monotonic()))
        while request_id in self.scheduler.requests:
            self.step()
        self.kv_cache.pool.reset_prefix_cache()
        self.scheduler.reset_counters()
        self._busy_seconds, self._busy_since = 0.0, None
        self.runner.forward_seconds = self.runner.forward_cpu_seconds = 0.0

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.kv_cache.pool.num_usable_blocks


__all__ = ["LLMEngine", "resolve_device", "cdiv"]
