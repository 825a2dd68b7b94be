"""HFEngineCoreClient (``--engine hf``): the articles' FastAPI + Transformers baseline as an engine core.

A ``transformers`` causal LM decodes ONE request at a time in a background thread, token by
token with the Hugging Face KV cache (``DynamicCache``); other requests wait in a FIFO queue.
There is no batching and no paged cache: this is the design pagedserve is measured against.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import threading
import time
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.engine.output_mailbox import OutputMailbox
from pagedserve.engine.validation import check_request
from pagedserve.engine.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.outputs import FinishReason, TokenLogprob
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(config: EngineConfig, device: torch.device) -> tuple[Any, Any, tuple[int, ...], dict[str, Any], str]:
    """(model, tokenizer, eos ids, generation config, path) for a GGUF file or a Hugging Face directory.

    ``dtype=auto`` means float32, as the articles' baseline runs it.
    """
    from pagedserve.models.default_model import default_model_path
    from pagedserve.models.registry import ModelLoadError

    path = config.model.model or default_model_path()
    dtype = _DTYPES[config.model.dtype]
    try:
        return _load(config, path, dtype, device)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot load {path!r} for --engine hf: {exc}") from exc


def _load(config: EngineConfig, path: str, dtype: torch.dtype,
          device: torch.device) -> tuple[Any, Any, tuple[int, ...], dict[str, Any], str]:
    from transformers import AutoModelForCausalLM

    from pagedserve.tokenizer import load_tokenizer

    generation_config: dict[str, Any] = {}
    if path.endswith(".gguf"):
        from pagedserve.models.gguf_loader import gguf_eos_token_ids, open_gguf, read_gguf_metadata

        directory, filename = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype, local_files_only=True)
        eos_ids = list(gguf_eos_token_ids(read_gguf_metadata(open_gguf(path))))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        generation_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_file):
            with open(generation_file, encoding="utf-8") as file:
                generation_config = json.load(file)
        eos_ids = _id_list(model.config.eos_token_id) + _id_list(generation_config.get("eos_token_id"))
    tokenizer = load_tokenizer(config.model.tokenizer or path)
    eos_ids += _id_list(tokenizer.eos_token_id) if not eos_ids else []
    model.to(device).eval()
    return model, tokenizer, tuple(dict.fromkeys(eos_ids)), generation_config, path


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class HFEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over a Transformers model, one request at a time (the ``hf`` engine).

    Invariants: only the worker thread runs the model; the event loop and the thread share
    ``_queue``, ``_live``, ``_aborted`` and ``_stopped`` only under ``_lock``;
    a request id is in ``_live`` from ``add_request`` until its last sample finishes.
    """

    def __init__(self, config: EngineConfig, model: Any = None, tokenizer: Any = None,
                 eos_token_ids: tuple[int, ...] | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        generation_config: dict[str, Any] = {}
        if model is None:
            model, tokenizer, eos_token_ids, generation_config, path = load_hf_model(config, self.device)
            from pagedserve.models.loader import derive_model_name

            name = config.model.served_model_name or derive_model_name(path)
        else:
            name = config.model.served_model_name or getattr(model.config, "name_or_path", "") or "hf-model"
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids or _id_list(getattr(model.config, "eos_token_id", None)))
        model_len = getattr(model.config, "max_position_embeddings", None) or 2048
        if config.model.max_model_len is not None and config.model.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.model.max_model_len} exceeds the model's context length ({model_len})")
        self.max_model_len = config.model.max_model_len or model_len
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(self.vocab_size, torch.Generator(device=self.device).manual_seed(config.model.seed))
        self._model_info = ModelInfo(
            model_name=name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            tokenizer=tokenizer,
            generation_config=generation_config,
            engine_name="hf",
        )
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._queue: collections.deque[EngineCoreRequest] = collections.deque()
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._stopped: set[tuple[str, int]] = set()
        self._mailbox = OutputMailbox()
        self._stopping = False
        self._running = 0
        self._error: BaseException | None = None
        self._counters = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- EngineCoreClient
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    async def warmup(self) -> None:
        """One short generation before serving (first-call costs); call before ``start``."""
        if self._thread is None:
            params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
            request = EngineCoreRequest("__warmup__", [1, 2, 3, 4], params, time.monotonic())
            await asyncio.to_thread(lambda: list(self._generate(request, 0, None)))
            self._counters = dict.fromkeys(self._counters, 0)

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._mailbox.bind(self._loop)
        self._thread = threading.Thread(target=self._run, name="hf-engine-core", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._queue.clear()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            await asyncio.to_thread(self._thread.join, 30.0)

    async def add_request(self, request: EngineCoreRequest) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine core died: {self._error!r}")
        if self._stopping or self._thread is None:
            raise EngineDeadError("the engine core is not running")
        self.validate_request(request)
        with self._lock:
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._live.add(request.request_id)
            self._queue.append(request)
        self._wakeup.set()

    async def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            ids = {rid for rid in request_ids if rid in self._live}
            if not ids:
                return
            self._aborted |= ids
            queued = [r for r in self._queue if r.request_id in ids]
            for request in queued:
                self._queue.remove(request)
                self._finish_request(request.request_id)

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        with self._lock:
            self._stopped |= {sample for sample in samples if sample[0] in self._live}

    async def get_outputs(self) -> list[EngineCoreOutput]:
        return await self._mailbox.get()

    def get_stats(self) -> SchedulerStats:
        with self._lock:
            num_waiting = len(self._queue)
        return SchedulerStats(num_running=self._running, num_waiting=num_waiting, **self._counters)

    # ----------------------------------------------------------------- validation
    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError for input the model cannot run (same rules as the paged engine)."""
        check_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      max_logprobs=self.config.max_logprobs)

    # ----------------------------------------------------------------- worker thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    request = self._queue.popleft() if self._queue else None
                    self._running = 1 if request is not None else 0
                if request is None:
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                try:
                    self._run_request(request)
                finally:
                    with self._lock:
                        self._finish_request(request.request_id)
                        self._running = 0
        except BaseException as exc:  # noqa: BLE001 - any failure kills the core
            logger.exception("hf engine core failed; no more requests can be served")
            with self._lock:
                self._error = exc
            self._mailbox.fail(exc)

    def _finish_request(self, request_id: str) -> None:
        """Forget a request's bookkeeping (called with ``_lock`` held)."""
        self._live.discard(request_id)
        self._aborted.discard(request_id)
        self._stopped = {sample for sample in self._stopped if sample[0] != request_id}

    def _run_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        first_scheduled_time = time.monotonic()
        self._counters["num_prompt_tokens"] += len(request.prompt_token_ids)
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed((params.seed + index) % (2**63))
            for output in self._generate(request, index, generator, first_scheduled_time):
                self._push(output)
            with self._lock:
                if request.request_id in self._aborted:
                    return

    def _cancelled(self, request_id: str, index: int) -> bool:
        with self._lock:
            return request_id in self._aborted or (request_id, index) in self._stopped or self._stopping

    @torch.inference_mode()
    def _generate(self, request: EngineCoreRequest, index: int, generator: torch.Generator | None,
                  first_scheduled_time: float | None = None):
        """Decode one sample token by token; yields an EngineCoreOutput per token (none once cancelled)."""
        from transformers import DynamicCache

        params = request.sampling_params
        prompt = list(request.prompt_token_ids)
        eos_ids = tuple(request.eos_token_ids) or self.eos_token_ids
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, prompt_len]
        cache = DynamicCache()
        result = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        prompt_logprobs = None
        if index == 0 and params.prompt_logprobs is not None:
            prompt_logprobs = _prompt_logprobs(result.logits[0, :, : self.vocab_size], prompt, params.prompt_logprobs)
        logits = result.logits[:, -1, :]  # [1, vocab]
        output_ids: list[int] = []
        while True:
            if self._cancelled(request.request_id, index):
                return
            row = SamplingRow(params, generator, prompt, output_ids, eos_ids)
            tokens, logprobs = self.sampler(logits, [row])
            token_id = tokens[0]
            output_ids.append(token_id)
            self._counters["num_generation_tokens"] += 1
            self._counters["num_steps"] += 1
            finish_reason, stop_reason = _check_stop(params, token_id, output_ids, eos_ids, max_tokens,
                                                     len(prompt), self.max_model_len)
            first = len(output_ids) == 1
            yield EngineCoreOutput(
                request_id=request.request_id,
                index=index,
                new_token_ids=[token_id],
                new_logprobs=[logprobs[0]] if logprobs[0] is not None else None,
                prompt_logprobs=prompt_logprobs if first else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                first_scheduled_time=first_scheduled_time if first else None,
            )
            if finish_reason is not None:
                return
            step_ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)  # [1, 1]
            result = self.model(input_ids=step_ids, past_key_values=result.past_key_values, use_cache=True)
            logits = result.logits[:, -1, :]

    def _push(self, output: EngineCoreOutput) -> None:
        self._mailbox.put([output])


def _check_stop(params: SamplingParams, token_id: int, output_ids: list[int], eos_ids: tuple[int, ...],
                max_tokens: int, prompt_len: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
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


__all__ = ["HFEngineCoreClient", "load_hf_model"]
