"""NgramProposer: draft tokens by prompt lookup (the n-gram method of speculative decoding).

The last n tokens of a sequence (n from ``max_n`` down to ``min_n``) are looked up earlier in the
same sequence, prompt and output together; the tokens that followed the most recent earlier
occurrence are the draft. Output that copies spans of its input (editing, extraction, code, answers
grounded in a passage) is drafted well; elsewhere a lookup usually finds nothing and costs one search.
"""

from __future__ import annotations

from array import array

_ITEM = array("i").itemsize  # bytes per token id in the search buffer


class NgramProposer:
    """Stateless: ``propose`` looks at the whole sequence each time (a C-level bytes search)."""

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_drafts)`` tokens that may follow ``token_ids``; [] if none."""
        k = min(self.num_speculative_tokens, max_drafts)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        data = array("i", token_ids).tobytes()
        search_end = (num_tokens - 1) * _ITEM  # a match must leave at least one token after it
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            pattern = data[(num_tokens - n) * _ITEM :]
            end = search_end
            while True:
                pos = data.rfind(pattern, 0, end)
                if pos < 0:
                    break
                if pos % _ITEM == 0:  # aligned on a token boundary: a real n-gram match
                    start = pos // _ITEM + n
                    return token_ids[start : start + k]
                end = pos + len(pattern) - 1  # look for an earlier occurrence
        return []
