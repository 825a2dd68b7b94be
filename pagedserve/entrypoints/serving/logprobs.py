"""Token texts (decoded once per token id, cached) and logprob clamping: what the OpenAI and TGI
logprob formats share."""

from __future__ import annotations

from typing import Any

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
MAX_CACHED_TOKEN_TEXTS = 200_000


def clamp_logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Each token's own text (special tokens spelled out) and whether it is special."""

    __slots__ = ("_tokenizer", "_texts", "_special_ids")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._special_ids = frozenset(tokenizer.all_special_ids)

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < MAX_CACHED_TOKEN_TEXTS:
                self._texts[token_id] = text
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
