"""HFEngine (``--engine hf``): a FastAPI + Transformers serving baseline as an engine.

A ``transformers`` causal LM decodes ONE request at a time, token by token with the Hugging Face KV
cache (``DynamicCache``); other requests wait in a FIFO queue. There is no batching and no paged
cache: this is the design pagedserve is measured against. It has LLMEngine's synchronous surface
(``step()`` makes one token of the current request), so the same engine-core loop and clients drive it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.host_resources import thread_budget
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.outputs import FinishReason, TokenLogprob
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(config: EngineConfig, device: torch.device) -> tuple[Any, tuple[int, ...], dict[str, Any], str]:
    """(model, eos ids, generation config, path) for a GGUF file or a Hugging Face directory (no tokenizer:
    the front end adds its tokenizer's EOS to requests when these ids are empty).

    ``dtype=auto`` means float32, Transformers' own default, as such baselines run.
    """
    from pagedserve.models.default_model import default_model_path
    from pagedserve.models.registry import ModelLoadError

    path = config.model.model or default_model_path()
    dtype = _DTYPES[config.model.dtype]
    try:
        return _load(config, path, dtype, device)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot load {path!r} for --engine hf: {exc}") from exc


def _load(
    config: EngineConfig, path: str, dtype: torch.dtype, device: torch.device
) -> tuple[Any, tuple[int, ...], dict[str, Any], str]:
    from transformers import AutoModelForCausalLM

    generation_config: dict[str, Any] = {}
    if path.endswith(".gguf"):
        from pagedserve.models.gguf_loader import gguf_eos_token_ids, open_gguf

        directory, filename = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype, local_files_only=True)
        eos_ids = list(gguf_eos_token_ids(open_gguf(path).metadata))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        generation_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_file):
            with open(generation_file, encoding="utf-8") as file:
                generation_config = json.load(file)
        eos_ids = _id_list(model.config.eos_token_id) + _id_list(generation_config.get("eos_token_id"))
    model.to(device).eval()
    return model, tuple(dict.fromkeys(eos_ids)), generation_config, path


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


@dataclass(slots=True)
class _Running:
    """The request being served: its samples run one after another."""

    request: EngineCoreRequest
    first_scheduled_time: float
    next_index: int = 0  # the sample to start next


@dataclass(slots=True)
class _Sample:
    """One sample being decoded: its KV cache and the logits of the next token."""

    index: int
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    output_ids: list
    past_key_values: Any = None
    logits: Any = None  # [1, vocab] for the next token; None: the model must first run the last one
    prompt_logprobs: list[TokenLogprob | None] | None = None


class HFEngine:
    """A Transformers model serving one request at a time, one token per ``step()`` (the ``hf`` engine).

    Not thread-safe: one caller drives it (the engine-core loop). A request id is in ``_live`` from
    ``add_request`` until its last sample finishes or it is aborted.
    """

    def __init__(self, config: EngineConfig, model: Any = None, eos_token_ids: tuple[int, ...] | None = None) -> None:
        threads = thread_budget(config.num_threads)
        torch.set_num_threads(threads.count)
        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        generation_config: dict[str, Any] = {}
        if model is None:
            model, eos_token_ids, generation_config, path = load_hf_model(config, self.device)
            from pagedserve.models.loader import derive_model_name

            name = config.model.served_model_name or derive_model_name(path)
        else:
            name = config.model.served_model_name or getattr(model.config, "name_or_path", "") or "hf-model"
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids or _id_list(getattr(model.config, "eos_token_id", None)))
        model_len = getattr(model.config, "max_position_embeddings", None) or 2048
        if config.model.max_model_len is not None and config.model.max_model_len > model_len:
            raise ValueError(
                f"max_model_len={config.model.max_model_len} exceeds the model's context length ({model_len})"
            )
        self.max_model_len = config.model.max_model_len or model_len
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(self.vocab_size, torch.Generator(device=self.device).manual_seed(config.model.seed))
        self.model_info = ModelInfo(
            model_name=name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            dtype=str(model.dtype).removeprefix("torch."),
            generation_config=generation_config,
            engine_name="hf",
            num_threads=threads.count,
            threads_reason=threads.reason,
        )
        self._queue: collections.deque[EngineCoreRequest] = collections.deque()
        self._live: set[str] = set()
        self._stopped: set[tuple[str, int]] = set()  # samples of live requests finished early
        self._running: _Running | None = None
        self._sample: _Sample | None = None
        self._counters = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0}

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end checked; the engine's invariants are asserted."""
        assert 0 < len(request.prompt_token_ids) < self.max_model_len, "prompt empty or longer than the context"
        assert request.request_id not in self._live, f"request id {request.request_id!r} in flight"
        self._live.add(request.request_id)
        self._queue.append(request)

    def abort_requests(self, request_ids) -> None:
        ids = {rid for rid in request_ids if rid in self._live}
        if not ids:
            return
        if self._running is not None and self._running.request.request_id in ids:
            self._sample = None
            self._finish_running()
        for request in [r for r in self._queue if r.request_id in ids]:
            self._queue.remove(request)
            self._forget(request.request_id)

    def stop_samples(self, samples) -> None:
        running = self._running
        for sample in samples:
            if sample[0] not in self._live:
                continue
            if (
                running is not None
                and self._sample is not None
                and sample[0] == running.request.request_id
                and sample[1] == self._sample.index
            ):
                self._end_sample()
            else:
                self._stopped.add(tuple(sample))

    def has_unfinished_requests(self) -> bool:
        return self._running is not None or bool(self._queue)

    def check_health(self) -> None:
        """Always healthy: one process, nothing to watch."""

    def shutdown(self) -> None:
        """Nothing to release."""

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=1 if self._running is not None else 0, num_waiting=len(self._queue), **self._counters
        )

    # ----------------------------------------------------------------- the loop
    @torch.inference_mode()
    def step(self) -> list[EngineCoreOutput]:
        """One token of the current request's current sample (starting the next sample or request first)."""
        while self._sample is None:
            if not self._start_next_sample():
                return []
        return [self._next_token()]

    def warmup(self) -> None:
        """One short generation (first-call costs), then forget its counts."""
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        self.add_request(EngineCoreRequest("__warmup__", [1, 2, 3, 4], params, time.monotonic()))
        while "__warmup__" in self._live:
            self.step()
        self._counters = dict.fromkeys(self._counters, 0)

    # ----------------------------------------------------------------- internals
    def _start_next_sample(self) -> bool:
        """Make ``_sample`` the next sample to decode (prefill included); False when there is no work."""
        running = self._running
        if running is None:
            if not self._queue:
                return False
            request = self._queue.popleft()
            running = self._running = _Running(request, time.monotonic())
            self._counters["num_prompt_tokens"] += len(request.prompt_token_ids)
        request = running.request
        params = request.sampling_params
        index = running.next_index
        while index < params.n and (request.request_id, index) in self._stopped:
            index += 1
        if index >= params.n:
            self._finish_running()
            return True
        running.next_index = index + 1
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed((params.seed + index) % (2**63))
        prompt = request.prompt_token_ids
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        sample = _Sample(index, generator, tuple(request.eos_token_ids) or self.eos_token_ids, max_tokens, [])
        from transformers import DynamicCache

        input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)  # [1, prompt_len]
        result = self.model(input_ids=input_ids, past_key_values=DynamicCache(), use_cache=True)
        if index == 0 and params.prompt_logprobs is not None:
            sample.prompt_logprobs = _prompt_logprobs(
                result.logits[0, :, : self.vocab_size], list(prompt), params.prompt_logprobs
            )
        sample.past_key_values = result.past_key_values
        sample.logits = result.logits[:, -1, :]  # [1, vocab]
        self._sample = sample
        return True

    def _next_token(self) -> EngineCoreOutput:
        sample, running = self._sample, self._running
        request = running.request
        params = request.sampling_params
        output_ids = sample.output_ids
        if sample.logits is None:  # decode the previous token
            step_ids = torch.tensor([[output_ids[-1]]], dtype=torch.long, device=self.device)  # [1, 1]
            result = self.model(input_ids=step_ids, past_key_values=sample.past_key_values, use_cache=True)
            sample.past_key_values = result.past_key_values
            sample.logits = result.logits[:, -1, :]
        row = SamplingRow(params, sample.generator, request.prompt_token_ids, output_ids, sample.eos_token_ids)
        tokens, logprobs = self.sampler(sample.logits, [row])
        sample.logits = None
        token_id = tokens[0]
        output_ids.append(token_id)
        self._counters["num_generation_tokens"] += 1
        self._counters["num_steps"] += 1
        finish_reason, stop_reason = _check_stop(
            params,
            token_id,
            output_ids,
            sample.eos_token_ids,
            sample.max_tokens,
            len(request.prompt_token_ids),
            self.max_model_len,
        )
        first = len(output_ids) == 1
        output = EngineCoreOutput(
            request_id=request.request_id,
            index=sample.index,
            new_token_ids=[token_id],
            new_logprobs=[logprobs[0]] if logprobs[0] is not None else None,
            prompt_logprobs=sample.prompt_logprobs if first else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            first_scheduled_time=running.first_scheduled_time if first else None,
        )
        if finish_reason is not None:
            self._end_sample()
        return output

    def _end_sample(self) -> None:
        """The current sample is done: the request ends with its last sample."""
        self._sample = None
        running = self._running
        params = running.request.sampling_params
        request_id = running.request.request_id
        index = running.next_index
        while index < params.n and (request_id, index) in self._stopped:
            index += 1
        running.next_index = index
        if index >= params.n:
            self._finish_running()

    def _finish_running(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            self._forget(running.request.request_id)

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        if self._stopped:
            self._stopped = {sample for sample in self._stopped if sample[0] != request_id}


def _check_stop(
    params: SamplingParams,
    token_id: int,
    output_ids: list[int],
    eos_ids: tuple[int, ...],
    max_tokens: int,
    prompt_len: int,
    max_model_len: int,
) -> tuple[FinishReason | None, int | None]:
    num_output = len(output_ids)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_ids:
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
    if num_output >= max_tokens or prompt_len + num_output >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], num_top: int) -> list[TokenLogprob | None]:
    """Logprob, rank and top-N of each prompt token given the ones before it; None for the first."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [prompt_len - 1, vocab]
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, targets)  # [prompt_len - 1, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    result: list[TokenLogprob | None] = [None]
    for i, token_id in enumerate(prompt[1:]):
        top = list(zip(top_ids[i].tolist(), top_values[i].tolist())) if top_ids is not None else []
        result.append(TokenLogprob(token_id, float(chosen[i, 0]), int(ranks[i]), top))
    return result


__all__ = ["HFEngine", "load_hf_model"]
