"""OpenAI sampling fields -> SamplingParams: vLLM's max_tokens rule, the model's generation-config
defaults, logit bias and stop token ids; SamplingParams' own ValueErrors become 400s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.entrypoints.openai.protocol import SamplingFields
from pagedserve.entrypoints.serving.errors import bad_request, param_from_message
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What the model's generation_config.json sets: sampling defaults and a cap on new tokens."""

    values: Mapping[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None

    @classmethod
    def from_generation_config(cls, generation_config: Mapping[str, Any] | None) -> SamplingDefaults:
        config = generation_config or {}
        values = {k: config[k] for k in _GENERATION_CONFIG_KEYS if config.get(k) is not None}
        return cls(values, config.get("max_new_tokens"))


class SamplingBuilder:
    """Builds a request's SamplingParams within the model's limits."""

    __slots__ = ("limits", "defaults")

    def __init__(self, limits: ModelLimits, defaults: SamplingDefaults) -> None:
        self.limits = limits
        self.defaults = defaults

    def check_logprobs(self, value: int | None, param: str) -> None:
        self.limits.check_logprobs(value, param)

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, default: int | None) -> int:
        """vLLM's rule: an explicit max_tokens must fit the context; a default is clipped to it."""
        if requested is not None:
            self.limits.check_prompt_and_max_tokens(num_prompt_tokens, requested)
            return requested
        self.limits.check_prompt_length(num_prompt_tokens)
        room = self.limits.max_model_len - num_prompt_tokens
        if self.defaults.max_new_tokens:
            room = min(room, int(self.defaults.max_new_tokens))
        return room if default is None else min(default, room)

    def build(
        self,
        request: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        stop = request.stop
        stop_list = [stop] if isinstance(stop, str) else list(stop or [])
        stop_token_ids = list(request.stop_token_ids or [])
        self.limits.check_stop_token_ids(stop_token_ids)
        defaults = self.defaults.values

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
                stop_token_ids=stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.parse_logit_bias(request.logit_bias),
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                structured_outputs=structured_outputs,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param_from_message(str(exc))) from exc

    def parse_logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        vocab_size = self.limits.vocab_size
        parsed: dict[int, float] = {}
        bad_keys = []
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                bad_keys.append(key)
                continue
            if not 0 <= token_id < vocab_size:
                bad_keys.append(key)
                continue
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias value {value} for token {key} must be in [-100, 100].", "logit_bias")
            parsed[token_id] = float(value)
        if bad_keys:
            raise bad_request(
                f"Invalid logit_bias keys {bad_keys}: keys must be token ids in [0, {vocab_size}).", "logit_bias"
            )
        return parsed
