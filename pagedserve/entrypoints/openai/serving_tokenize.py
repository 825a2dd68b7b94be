"""POST /tokenize and POST /detokenize (vLLM's shapes), with the same model and input checks."""

from __future__ import annotations

from starlette.responses import Response

from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.entrypoints.openai.chat_template import ChatTemplate
from pagedserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from pagedserve.entrypoints.openai.request_checks import ServedModels
from pagedserve.entrypoints.serving.errors import json_response
from pagedserve.entrypoints.serving.tokenization import PromptTokenizer


class OpenAIServingTokenization:
    """Text or chat messages -> token ids, and token ids -> text."""

    def __init__(
        self, *, models: ServedModels, tokenizer: PromptTokenizer, template: ChatTemplate, limits: ModelLimits
    ) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.template = template
        self.limits = limits

    async def tokenize_request(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.template.render(request)
        else:
            text = request.prompt
        token_ids = await self.tokenizer.encode(text, request.add_special_tokens)
        body: dict = {"count": len(token_ids), "max_model_len": self.limits.max_model_len, "tokens": token_ids}
        if request.return_token_strs:
            body["token_strs"] = self.tokenizer.token_strs(token_ids)
        return json_response(body)

    async def detokenize_request(self, request: DetokenizeRequest) -> Response:
        self.models.resolve(request.model)
        self.limits.check_token_ids(request.tokens, "tokens")
        return json_response({"prompt": self.tokenizer.decode(request.tokens)})
