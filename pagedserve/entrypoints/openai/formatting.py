"""Pieces of OpenAI response bodies: usage, completion logprobs, chat logprobs and vLLM's prompt logprobs."""

from __future__ import annotations

from pagedserve.entrypoints.serving.logprobs import TokenTexts, clamp_logprob
from pagedserve.outputs import TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    result: dict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        result["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return result


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprob | None] | None, num_top: int, text_offset: int
) -> dict:
    """The legacy completions shape: parallel lists of tokens, offsets, logprobs and top logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    logprobs = logprobs or []
    for i, token_id in enumerate(token_ids):
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        entry = logprobs[i] if i < len(logprobs) else None
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp_logprob(entry.logprob))
        top = {texts.text(t): clamp_logprob(lp) for t, lp in entry.top[:num_top]} if num_top else {}
        top.setdefault(text, clamp_logprob(entry.logprob))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprob] | None, num_top: int) -> dict:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs or []):
        text = texts.text(token_id)
        content.append(
            {
                "token": text,
                "logprob": clamp_logprob(entry.logprob),
                "bytes": list(text.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (alt := texts.text(t)),
                        "logprob": clamp_logprob(lp),
                        "bytes": list(alt.encode("utf-8", errors="replace")),
                    }
                    for t, lp in entry.top[:num_top]
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(
    texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprob | None] | None
) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or {token id: logprob, rank, text}."""
    if logprobs is None:
        return None
    result: list = []
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            result.append(None)
            continue
        item = {
            str(token_id): {
                "logprob": clamp_logprob(entry.logprob),
                "rank": entry.rank,
                "decoded_token": texts.text(token_id),
            }
        }
        for rank, (alt, lp) in enumerate(entry.top, start=1):
            item.setdefault(str(alt), {"logprob": clamp_logprob(lp), "rank": rank, "decoded_token": texts.text(alt)})
        result.append(item)
    return result
