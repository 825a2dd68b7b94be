"""The OpenAI routes' prompts, ready for the engine: texts or token ids (completions) and chat
messages through the chat template, tokenized, truncated and checked against the model."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.entrypoints.input_checks import EMPTY_PROMPT, ModelLimits
from pagedserve.entrypoints.openai.chat_template import ChatTemplate
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.tools.spec import FunctionTool
from pagedserve.entrypoints.serving.errors import bad_request
from pagedserve.entrypoints.serving.tokenization import PromptTokenizer


@dataclass(slots=True)
class PreparedPrompt:
    """A prompt ready for the engine (the text is what the detokenizer and ``echo`` start from)."""

    token_ids: list[int]
    text: str | None = None


class OpenAIPrompts:
    """Turns a request's prompt (or messages) into checked token ids."""

    __slots__ = ("tokenizer", "template", "limits")

    def __init__(self, tokenizer: PromptTokenizer, template: ChatTemplate, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.limits = limits

    async def completion_prompts(self, request: CompletionRequest) -> list[PreparedPrompt]:
        """One prompt per string or token list in ``prompt``."""
        prompt = request.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise bad_request(EMPTY_PROMPT, "prompt")
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        return [await self._completion_prompt(item, request) for item in items]

    async def _completion_prompt(self, item: str | list[int], request: CompletionRequest) -> PreparedPrompt:
        if isinstance(item, str):
            if not item:
                raise bad_request(EMPTY_PROMPT, "prompt")
            token_ids = await self.tokenizer.encode(item, request.add_special_tokens)
            text: str | None = item
        else:
            token_ids, text = list(item), None
        self.limits.check_prompt_ids(token_ids)
        token_ids = self.truncate(token_ids, request.truncate_prompt_tokens)
        if text is None or request.truncate_prompt_tokens is not None:
            text = self.tokenizer.decode(token_ids)
        return PreparedPrompt(token_ids, text)

    async def chat_prompt(
        self, request: ChatCompletionRequest, tools: tuple[FunctionTool, ...] | None = None
    ) -> PreparedPrompt:
        text = self.template.render(request, request.documents, tools)
        token_ids = await self.tokenizer.encode(text, request.add_special_tokens)
        token_ids = self.truncate(token_ids, request.truncate_prompt_tokens)
        self.limits.check_prompt_ids(token_ids, "messages")
        return PreparedPrompt(token_ids, text)

    def truncate(self, token_ids: list[int], truncate: int | None) -> list[int]:
        """Keep the last ``truncate`` tokens (vLLM's truncate_prompt_tokens)."""
        if truncate is None:
            return token_ids
        max_model_len = self.limits.max_model_len
        if truncate < 1:
            raise bad_request("truncate_prompt_tokens must be at least 1.", "truncate_prompt_tokens")
        if truncate > max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({max_model_len}). "
                "Please select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        return token_ids[-truncate:]
