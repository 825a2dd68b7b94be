"""Chat messages -> prompt text with the model's chat template: roles, text-only content, template
kwargs a request may set, and the template's own errors as 400s."""

from __future__ import annotations

from typing import Any

from pagedserve.entrypoints.openai.protocol import CHAT_ROLES, ChatCompletionRequest, ChatMessage, TokenizeChatRequest
from pagedserve.entrypoints.openai.tools.prompt import messages_with_tools, template_supports_tools
from pagedserve.entrypoints.openai.tools.spec import FunctionTool
from pagedserve.entrypoints.serving.errors import bad_request
from pagedserve.entrypoints.serving.tokenization import check_text

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "tokenizer",
        "padding",
        "truncation",
    }
)


class ChatTemplate:
    """The served model's chat template (from its tokenizer); request-supplied templates are refused."""

    __slots__ = ("tokenizer", "supports_tools")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # templates that read `tools` get them as the template argument; others get a default system block
        self.supports_tools = template_supports_tools(tokenizer.chat_template)

    def render(
        self,
        request: ChatCompletionRequest | TokenizeChatRequest,
        documents: list[Any] | None = None,
        tools: tuple[FunctionTool, ...] | None = None,
    ) -> str:
        """``apply`` with the template fields of a chat or chat-tokenize request."""
        return self.apply(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            request.chat_template_kwargs,
            documents,
            tools,
        )

    def apply(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        template_kwargs: dict[str, Any] | None,
        documents: list[Any] | None = None,
        tools: tuple[FunctionTool, ...] | None = None,
    ) -> str:
        if chat_template is not None:
            raise bad_request("Request-supplied chat templates are not allowed on this server.", "chat_template")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        if not messages:
            raise bad_request("messages must contain at least one message.", "messages")
        if self.tokenizer.chat_template is None:
            raise bad_request("This model has no chat template; use /v1/completions.", "messages")
        kwargs = _template_kwargs(template_kwargs)
        if documents is not None:
            kwargs["documents"] = documents
        conversation = messages_with_tools(
            [_message_dict(i, m) for i, m in enumerate(messages)], tools, self.supports_tools
        )
        if tools and self.supports_tools:
            kwargs["tools"] = [tool.to_openai() for tool in tools]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, ValueError from transformers
            raise bad_request(f"Cannot apply the chat template to these messages: {exc}", "messages") from exc


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    result = {}
    for key, value in (kwargs or {}).items():
        if key in _RESERVED_TEMPLATE_KWARGS or key.startswith("_"):
            raise bad_request(f"chat_template_kwargs may not set {key!r}.", "chat_template_kwargs")
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise bad_request(
                f"chat_template_kwargs[{key!r}] must be a string, number or boolean.", "chat_template_kwargs"
            )
        result[key] = value
    return result


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    if message.role not in CHAT_ROLES:
        raise bad_request(f"messages[{index}].role: unknown role {message.role!r}.", f"messages[{index}].role")
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}].content: only text content parts are supported, got type {part.type!r}.",
                    f"messages[{index}].content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None:
        content = ""
    check_text(content, f"messages[{index}].content")
    result: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result
