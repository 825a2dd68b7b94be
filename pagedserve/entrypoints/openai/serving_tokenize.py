"""POST /tokenize and POST /detokenize (vLLM's shapes), with the same model and input checks."""

from __future__ import annotations

from starlette.responses import Response

from pagedserve.entrypoints.openai.errors import bad_request, json_response
from pagedserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize_request(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.apply_chat_template(
                request.messages, request.add_generation_prompt, request.continue_final_message,
                request.chat_template, request.chat_template_kwargs,
            )
        else:
            text = request.prompt
        token_ids = await self.tokenize(text, request.add_special_tokens)
        body: dict = {"count": len(token_ids), "max_model_len": self.max_model_len, "tokens": token_ids}
        if request.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(token_ids)
        return json_response(body)

    async def detokenize_request(self, request: DetokenizeRequest) -> Response:
        self.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary (the vocabulary has {self.vocab_size} tokens).",
                              "tokens")
        return json_response({"prompt": self.tokenizer.decode(request.tokens)})
