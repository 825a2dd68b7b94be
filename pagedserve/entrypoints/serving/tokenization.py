"""Request texts -> token ids for the handlers: refuses invalid Unicode (400) and encodes long texts in
a worker thread, so that one big prompt does not stall the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from pagedserve.entrypoints.serving.errors import bad_request

LARGE_TEXT_CHARS = 20_000  # tokenize longer texts in a worker thread


def check_text(text: str, param: str = "prompt") -> None:
    """Refuse strings that are not valid Unicode (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}.", param) from exc


class PromptTokenizer:
    """The server's tokenizer as the handlers use it: checked, off-loop encoding; decoding."""

    __slots__ = ("tokenizer",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        check_text(text)
        if len(text) > LARGE_TEXT_CHARS:
            return await asyncio.to_thread(self._encode, text, add_special_tokens)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entries of the tokens (byte-level spellings, as the tokenizer stores them)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)
