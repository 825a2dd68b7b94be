"""Sampler: turns the logits of the sampling positions into tokens and logprobs.

Steps, in order, for a batch of rows ``[num_rows, vocab]``:
  1. logits to float32; raw logprobs (log-softmax of the model's logits) if any row wants logprobs
  2. logit_bias; ban EOS and stop token ids while ``min_tokens`` is not reached
  3. penalties: repetition (prompt and output tokens), presence and frequency (output tokens)
  4. greedy rows (temperature 0): argmax
  5. random rows: temperature, top-k, top-p, min-p, then sample with the exponential race
     (argmax of probs / Exp(1) noise), drawing noise from the row's own generator when seeded
  6. logprob, rank and top-N alternatives of each chosen token
A batch of plain greedy rows takes a fast path (argmax only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.outputs import TokenLogprob
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from, and the request state it depends on."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator) -> None:
        self.vocab_size = vocab_size
        self.generator = generator  # for rows without a seed

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [num_rows, vocab]
        logits = logits[:, : self.vocab_size].float()
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [num_rows, vocab]
        if all(_is_plain_greedy(row) for row in rows):
            tokens = logits.max(dim=-1).indices  # NOTE: faster than argmax on CPU
        else:
            logits = self._apply_processors(logits.clone(), rows)
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * len(rows)
        return token_list, _gather_logprobs(raw_logprobs, tokens, [row.params.logprobs for row in rows])

    def _apply_processors(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            params = row.params
            if params.logit_bias:
                ids = torch.tensor([k for k in params.logit_bias if k < self.vocab_size], dtype=torch.long, device=logits.device)
                values = torch.tensor(
                    [v for k, v in params.logit_bias.items() if k < self.vocab_size], dtype=logits.dtype, device=logits.device
                )
                logits[i].index_add_(0, ids, values)
            if params.min_tokens and len(row.output_token_ids) < params.min_tokens:
                banned = [t for t in (*row.eos_token_ids, *params.stop_token_ids) if t < self.vocab_size]
                if banned:
                    logits[i, banned] = float("-inf")
            if params.needs_penalties:
                _apply_penalties(logits[i], row, self.vocab_size)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy_tokens = logits.max(dim=-1).indices  # [num_rows]
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return greedy_tokens
        index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, index)  # [num_random, vocab]
        temperature = torch.tensor(
            [rows[i].params.temperature for i in random_rows], dtype=sub.dtype, device=sub.device
        ).unsqueeze(1)
        sub = sub / temperature
        sub = _top_k_top_p_min_p(sub, [rows[i].params for i in random_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        for k, i in enumerate(random_rows):
            noise[k].exponential_(generator=rows[i].generator or self.generator)
        sampled = (probs / noise).argmax(dim=-1)
        greedy_tokens[index] = sampled
        return greedy_tokens


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (
        params.is_greedy
        and not params.logit_bias
        and not params.needs_penalties
        and not (params.min_tokens and len(row.output_token_ids) < params.min_tokens)
    )


def _apply_penalties(logits: torch.Tensor, row: SamplingRow, vocab_size: int) -> None:
    """Penalties on one row ``[vocab]`` in place, with vLLM's semantics."""
    params = row.params
    device = logits.device
    output = torch.tensor([t for t in row.output_token_ids if t < vocab_size], dtype=torch.long, device=device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            [t for t in row.prompt_token_ids if t < vocab_size], dtype=torch.long, device=device
        )
        seen = torch.unique(torch.cat([seen, output]))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].to(logits.dtype)  # [vocab]
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits ``[rows, vocab]`` outside each row's top-k / nucleus / min-p set with -inf."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [rows, vocab]
        k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        mask = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)
        mask |= cumulative >= p
        mask[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p, dtype=probs.dtype, device=logits.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprob | None]:
    """Logprob, rank and top-N of each chosen token; rows with ``num_top`` None get None."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [rows]
    max_top = max((n for n in num_top if n), default=0)
    top_values = top_ids = None
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [rows, max_top]
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_list, rank_list, token_list = chosen.squeeze(1).tolist(), ranks.tolist(), tokens.tolist()
    result: list[TokenLogprob | None] = []
    for i, n in enumerate(num_top):
        if n is None:
            result.append(None)
            continue
        top = list(zip(top_ids[i][:n], top_values[i][:n])) if n and top_ids is not None else []
        result.append(TokenLogprob(token_list[i], chosen_list[i], rank_list[i], top))
    return result
