"""OpenAIServing: what every route shares (model check, tokenization, length and parameter
validation, admission control, logprob formatting, timeouts) before a request reaches AsyncLLM.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.openai.errors import APIError, bad_request, param_from_message
from pagedserve.entrypoints.openai.protocol import CHAT_ROLES, ChatMessage, SamplingFields
from pagedserve.outputs import RequestOutput, TokenLogprob
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LARGE_TEXT_CHARS = 20_000  # tokenize longer texts in a worker thread
LOGPROB_FLOOR = -9999.0  # JSON has no -inf
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_tensors", "tokenizer", "padding", "truncation",
})
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(slots=True)
class ServingConfig:
    """Front-end limits and names, built once by the CLI."""

    served_model_names: list[str]
    model_path: str = ""
    max_logprobs: int = 20
    request_timeout: float | None = None  # seconds; None = no limit
    max_queued_requests: int | None = None  # None = unbounded
    max_running_requests: int = 256  # what the engine runs at once (max_num_seqs; 1 for --engine hf)
    retry_after_s: int = 1
    max_stop_sequences: int = 16

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(slots=True)
class AdmissionControl:
    """Bounded queue: refuses (429) once in-flight requests exceed running capacity + queue limit."""

    capacity: int | None
    retry_after_s: int = 1
    on_reject: Callable[[str], None] | None = None
    in_flight: int = 0

    def acquire(self, count: int = 1) -> None:
        if self.capacity is not None and self.in_flight + count > self.capacity:
            if self.on_reject is not None:
                self.on_reject("overloaded")
            raise APIError(
                "The server is overloaded: too many requests are queued. Please retry later.",
                429, code="server_overloaded", type="overloaded_error",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += count

    def release(self, count: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - count)


@dataclass(slots=True)
class PreparedPrompt:
    """A prompt ready for the engine."""

    token_ids: list[int]
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Shared validation and helpers of the OpenAI (and TGI) serving classes."""

    def __init__(self, engine: AsyncLLM, config: ServingConfig, admission: AdmissionControl) -> None:
        self.engine = engine
        self.config = config
        self.admission = admission
        info = engine.model_info
        self.model_info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self._token_strs: dict[int, str] = {}
        self._special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        gen_cfg = info.generation_config or {}
        self.default_sampling = {k: gen_cfg[k] for k in _GENERATION_CONFIG_KEYS if gen_cfg.get(k) is not None}
        self.default_max_new_tokens = gen_cfg.get("max_new_tokens")

    # ----------------------------------------------------------------- model and prompt
    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 if the client asked for a model we do not serve."""
        names = self.config.served_model_names
        if model is None or model == "" or model in names:
            return names[0]
        raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_text(text)
        if len(text) > LARGE_TEXT_CHARS:
            return await asyncio.to_thread(self._encode, text, add_special_tokens)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", param)
        bad = [t for t in token_ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise bad_request(
                f"Token id {bad[0]} is out of vocabulary (the vocabulary has {self.vocab_size} tokens).", param
            )

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        template_kwargs: dict[str, Any] | None,
        documents: list[Any] | None = None,
    ) -> str:
        if chat_template is not None:
            raise bad_request("Request-supplied chat templates are not allowed on this server.", "chat_template")
        if continue_final_message and add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        if not messages:
            raise bad_request("messages must contain at least one message.", "messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions.", "messages")
        kwargs = self._template_kwargs(template_kwargs)
        if documents is not None:
            kwargs["documents"] = documents
        conversation = [self._message_dict(i, m) for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, ValueError from transformers
            raise bad_request(f"Cannot apply the chat template to these messages: {exc}", "messages") from exc

    @staticmethod
    def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
        result = {}
        for key, value in (kwargs or {}).items():
            if key in _RESERVED_TEMPLATE_KWARGS or key.startswith("_"):
                raise bad_request(f"chat_template_kwargs may not set {key!r}.", "chat_template_kwargs")
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise bad_request(f"chat_template_kwargs[{key!r}] must be a string, number or boolean.",
                                  "chat_template_kwargs")
            result[key] = value
        return result

    @staticmethod
    def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
        if message.role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role: unknown role {message.role!r}.", f"messages[{index}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{index}].content: only text content parts are supported, "
                                      f"got type {part.type!r}.", f"messages[{index}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None:
            content = ""
        check_text(content, f"messages[{index}].content")
        result: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            result["name"] = message.name
        return result

    # ----------------------------------------------------------------- lengths and params
    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, default: int | None) -> int:
        """vLLM's rule: an explicit max_tokens must fit the context; a default is clipped to it."""
        limit = self.max_model_len
        if requested is not None:
            if num_prompt_tokens + requested > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in "
                    f"the completion). Please reduce the length of the messages or completion.",
                    400, param="max_tokens", code="context_length_exceeded",
                )
            return requested
        if num_prompt_tokens >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
                400, param="messages", code="context_length_exceeded",
            )
        room = limit - num_prompt_tokens
        if self.default_max_new_tokens:
            room = min(room, int(self.default_max_new_tokens))
        return room if default is None else min(default, room)

    def truncate_prompt(self, token_ids: list[int], truncate: int | None) -> list[int]:
        if truncate is None:
            return token_ids
        if truncate < 1:
            raise bad_request("truncate_prompt_tokens must be at least 1.", "truncate_prompt_tokens")
        if truncate > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({self.max_model_len}). "
                "Please select a smaller truncation size.", "truncate_prompt_tokens")
        return token_ids[-truncate:]

    def check_generation_request(self, request: SamplingFields) -> str:
        """What every generation route checks first, in this order: the model (404), a live engine
        (503), unsupported fields (400). Returns the model name to answer with."""
        model_name = self.check_model(request.model)
        self.check_engine_alive()
        self.reject_unsupported(request)
        return model_name

    def reject_unsupported(self, request: SamplingFields) -> None:
        if request.model_extra:
            logger.info("The following fields were present in the request but ignored: %s",
                        sorted(request.model_extra))
        if request.best_of is not None and request.best_of != 1:
            raise bad_request("best_of is not supported; use n (and logprobs) instead.", "best_of")
        if request.use_beam_search:
            raise bad_request("Beam search is not supported.", "use_beam_search")
        fmt = request.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise bad_request(f"response_format type {fmt.get('type')!r} is not supported by this server; "
                              "only 'text' is.", "response_format")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "logits_processors"):
            if getattr(request, name) is not None:
                raise bad_request(f"{name} is not supported by this server.", name)
        if request.stream_options is not None and not request.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        stops = request.stop
        if isinstance(stops, list) and len(stops) > self.config.max_stop_sequences:
            raise bad_request(f"At most {self.config.max_stop_sequences} stop sequences are supported.", "stop")

    def parse_logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        parsed: dict[int, float] = {}
        bad_keys = []
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                bad_keys.append(key)
                continue
            if not 0 <= token_id < self.vocab_size:
                bad_keys.append(key)
                continue
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias value {value} for token {key} must be in [-100, 100].", "logit_bias")
            parsed[token_id] = float(value)
        if bad_keys:
            raise bad_request(
                f"Invalid logit_bias keys {bad_keys}: keys must be token ids in [0, {self.vocab_size}).",
                "logit_bias")
        return parsed

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is None:
            return
        if value < 0:
            raise bad_request(f"`{param}` must be a non-negative value.", param)
        if value > self.config.max_logprobs:
            raise bad_request(
                f"Requested {param} of {value}, which is greater than max allowed: {self.config.max_logprobs}", param)

    def make_sampling_params(self, request: SamplingFields, max_tokens: int, logprobs: int | None,
                             prompt_logprobs: int | None) -> SamplingParams:
        stop = request.stop
        stop_list = [stop] if isinstance(stop, str) else list(stop or [])
        bad_stop_ids = [t for t in request.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop_ids:
            raise bad_request(f"stop_token_ids {bad_stop_ids} are out of vocabulary.", "stop_token_ids")
        defaults = self.default_sampling

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(request, name)
            if value is not None:
                return value
            return defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=request.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=stop_list,
                stop_token_ids=list(request.stop_token_ids or []),
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.parse_logit_bias(request.logit_bias),
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param_from_message(str(exc))) from exc

    # ----------------------------------------------------------------- running requests
    def generate(self, prompt: PreparedPrompt, params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.generate(prompt.token_ids, params, request_id, prompt=prompt.text, priority=priority)

    def check_engine_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError("The engine is not running.", 503, code="engine_dead", type="service_unavailable")

    async def collect(self, stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
        """Run a request to completion, merging its deltas into one output (with the timeout)."""
        final: RequestOutput | None = None
        try:
            async with asyncio.timeout(self.config.request_timeout):
                async for output in stream:
                    if final is None:
                        final = output
                    else:
                        final.merge_delta(output)
        except TimeoutError as exc:
            raise timeout_error(self.config.request_timeout) from exc
        except EngineDeadError as exc:
            raise APIError(f"The engine failed: {exc}", 500, type="internal_server_error") from exc
        except ValueError as exc:
            raise bad_request(str(exc), param_from_message(str(exc))) from exc
        assert final is not None
        return final

    # ----------------------------------------------------------------- token strings and logprobs
    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_strs) < 200_000:
                self._token_strs[token_id] = text
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def prompt_logprobs_json(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> list | None:
        if logprobs is None:
            return None
        result: list = []
        for token_id, entry in zip(token_ids, logprobs):
            if entry is None:
                result.append(None)
                continue
            item = {str(token_id): {"logprob": clamp_logprob(entry.logprob), "rank": entry.rank,
                                    "decoded_token": self.token_str(token_id)}}
            for rank, (alt, lp) in enumerate(entry.top, start=1):
                item.setdefault(str(alt), {"logprob": clamp_logprob(lp), "rank": rank,
                                           "decoded_token": self.token_str(alt)})
            result.append(item)
        return result


def check_text(text: str, param: str = "prompt") -> None:
    """Refuse strings that are not valid Unicode (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}.", param) from exc


def timeout_error(seconds: float | None) -> APIError:
    return APIError(f"The request timed out after {seconds} s and was aborted.", 408, code="request_timeout",
                    type="timeout_error")


def clamp_logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR



def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    result: dict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        result["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return result
