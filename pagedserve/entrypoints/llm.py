"""LLM: the offline batch API (``LLM(model).generate(prompts, params)``, ``LLM.chat(messages)``) over LLMEngine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.messages import EngineCoreRequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import eos_token_ids, load_tokenizer, tokenizer_path

PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """Generate for a batch of prompts at once; all of them share the engine's continuous batching.

    Bad input (an empty prompt, one longer than the context, invalid sampling parameters or
    token ids) raises ValueError before anything is queued, and the engine stays usable.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int | None = None,
        kv_cache_memory: str | int | None = None,
        memory_utilization: float | None = None,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        kv_admission: str = "immediate",
        seed: int = 0,
        device: str = "auto",
        num_threads: int | None = None,
        max_logprobs: int = 20,
        quantization: str | None = None,
        quantization_group_size: int = 32,
        quantization_symmetric: bool = False,
        speculative_config: dict | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                quantization=quantization,
                quantization_group_size=quantization_group_size,
                quantization_symmetric=quantization_symmetric,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory),
                memory_utilization=memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_blocks_override=num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=scheduling_policy,
                kv_admission=kv_admission,
            ),
            device=device,
            num_threads=num_threads,
            max_logprobs=max_logprobs,
            speculative=(
                SpeculativeConfig.from_dict(speculative_config)
                if isinstance(speculative_config, dict)
                else speculative_config
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )
        self._attach(LLMEngine(config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. several cache configurations over one loaded model)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = load_tokenizer(tokenizer_path(engine.config.model))
        info = engine.model_info
        self._limits = ModelLimits(info.max_model_len, info.vocab_size, engine.config.max_logprobs)
        self._eos_token_ids = () if info.eos_token_ids else eos_token_ids(self.tokenizer)  # empty: the model's
        self._counter = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order of ``prompts``."""
        items = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(items), "sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise ValueError("priority must have one entry per prompt")
        requests = [
            self._make_request(item, params, prio) for item, params, prio in zip(items, params_list, priorities)
        ]
        for request, _ in requests:
            self._limits.check_request(request.prompt_token_ids, request.sampling_params)
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = []
        for conversation in conversations:
            if not conversation:
                raise ValueError("a conversation needs at least one message")
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            prompts.append({"prompt": text, "prompt_token_ids": self._encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ----------------------------------------------------------------- internals
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _make_request(
        self, item: PromptInput, params: SamplingParams, priority: int
    ) -> tuple[EngineCoreRequest, str | None]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text: str | None
        if isinstance(item, str):
            if not item:
                raise ValueError("The prompt is empty: at least one token is required.")
            text, token_ids = item, self._encode(item)
        elif isinstance(item, dict):
            text = item.get("prompt")
            token_ids = item.get("prompt_token_ids")
            if token_ids is None:
                if not isinstance(text, str):
                    raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
                token_ids = self._encode(text)
        elif isinstance(item, list):
            text, token_ids = None, item
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(item).__name__}")
        request_id = str(next(self._counter))
        request = EngineCoreRequest(
            request_id, list(token_ids), params, time.monotonic(), priority, self._eos_token_ids
        )
        return request, text

    def _run(self, requests: list[tuple[EngineCoreRequest, str | None]], use_tqdm: bool) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        for request, text in requests:
            processor.add_request(
                request.request_id,
                text,
                request.prompt_token_ids,
                request.sampling_params,
                request.arrival_time,
                cumulative=True,
            )
            self.engine.add_request(request)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                processed = processor.process_outputs(self.engine.step())
                if processed.samples_to_stop:
                    self.engine.stop_samples(processed.samples_to_stop)
                for output in processed.request_outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            self.engine.abort_requests([r.request_id for r, _ in requests])
            raise
        finally:
            progress.close()
        return [finished[r.request_id] for r, _ in requests]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    return items


def _broadcast(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} must have one entry per prompt ({count}), got {len(value)}")
        return list(value)
    return [value] * count
