"""The checks of user input against the served model's limits (prompt tokens, context length, logprobs,
stop token ids), made once in the front end before a request reaches the engine: by the HTTP routes
and by the offline ``LLM``. A failed check raises ``InputError`` (a ValueError)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.sampling_params import SamplingParams

EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


class InputError(ValueError):
    """Bad user input: the message for the user, the parameter at fault and an optional error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the engine can run: context length, vocabulary, most logprobs per token."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int

    def check_prompt_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """A prompt needs at least one token, each in the vocabulary."""
        if not token_ids:
            raise InputError(EMPTY_PROMPT, param)
        self.check_token_ids(token_ids, param)

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(
                f"Token id {bad[0]!r} is out of vocabulary (the vocabulary has {self.vocab_size} tokens).", param
            )

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        """A prompt must leave room for at least one generated token (vLLM's message)."""
        if num_prompt_tokens >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
                "messages",
                "context_length_exceeded",
            )

    def check_prompt_and_max_tokens(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """An explicit max_tokens must fit the context together with the prompt (vLLM's message)."""
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                "max_tokens",
                "context_length_exceeded",
            )

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is None:
            return
        if value < 0:
            raise InputError(f"`{param}` must be a non-negative value.", param)
        if value > self.max_logprobs:
            raise InputError(
                f"Requested {param} of {value}, which is greater than max allowed: {self.max_logprobs}", param
            )

    def check_stop_token_ids(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(f"stop_token_ids {bad} are out of vocabulary.", "stop_token_ids")

    def check_request(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Every check at once, for a caller that hands the engine token ids and ready SamplingParams."""
        self.check_prompt_ids(token_ids)
        self.check_prompt_length(len(token_ids))
        self.check_logprobs(params.logprobs, "logprobs")
        self.check_logprobs(params.prompt_logprobs, "prompt_logprobs")
        self.check_stop_token_ids(params.stop_token_ids)
