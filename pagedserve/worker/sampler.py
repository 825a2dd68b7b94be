"""Sampler: turns the logits of the sampling positions into tokens and logprobs.

Steps, in order, for a batch of rows ``[num_rows, vocab]``:
  1. logits to float32; raw logprobs (log-softmax of the model's logits) if any row wants logprobs
  2. logit_bias; ban EOS and stop token ids while ``min_tokens`` is not reached
  3. penalties: repetition (prompt and output tokens), presence and frequency (output tokens)
  4. greedy rows (temperature 0): argmax
  5. random rows: temperature, top-k, top-p, min-p, then one draw by inverse CDF: a uniform number
     per row (from the row's own generator when seeded) located by binary search in the cumulative
     sum of its probabilities; top-k / nucleus sets that fit in the best CANDIDATES tokens are
     handled there instead of sorting the whole vocabulary
  6. logprob, rank and top-N alternatives of each chosen token
A batch of plain greedy rows takes a fast path: argmax only, in the logits' own dtype (with a
C++ kernel on CPUs when built).
"""

from __future__ import annotations

from collections.abc import Callable
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
    def __init__(
        self,
        vocab_size: int,
        generator: torch.Generator,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.generator = generator  # for rows without a seed
        # a kernel for [rows, vocab] bf16/float32 CPU logits -> int64 [rows], as torch.max(dim=-1).indices
        self.argmax_rows = argmax_rows

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [num_rows, vocab]
        logits = logits[:, : self.vocab_size]
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        plain_greedy = all(_is_plain_greedy(row) for row in rows)
        if plain_greedy and not want_logprobs:
            return self._greedy(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [num_rows, vocab]
        if plain_greedy:
            tokens = self._greedy(logits)
        else:
            if any(_needs_processing(row) for row in rows):
                logits = self._apply_processors(logits.clone(), rows)
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * len(rows)
        return token_list, _gather_logprobs(raw_logprobs, tokens, [row.params.logprobs for row in rows])

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax of each row, in the logits' own dtype (rounding to float32 keeps the order)."""
        if (
            self.argmax_rows is not None
            and logits.device.type == "cpu"
            and logits.dtype in (torch.bfloat16, torch.float32)
        ):
            return self.argmax_rows(logits)
        return logits.max(dim=-1).indices  # NOTE: faster than argmax on CPU

    def _apply_processors(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            params = row.params
            if params.logit_bias:
                ids = torch.tensor(
                    [k for k in params.logit_bias if k < self.vocab_size], dtype=torch.long, device=logits.device
                )
                values = torch.tensor(
                    [v for k, v in params.logit_bias.items() if k < self.vocab_size],
                    dtype=logits.dtype,
                    device=logits.device,
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
        greedy_tokens = self._greedy(logits)  # [num_rows]
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return greedy_tokens
        index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        temperature = torch.tensor(
            [rows[i].params.temperature for i in random_rows], dtype=logits.dtype, device=logits.device
        ).unsqueeze(1)
        if len(random_rows) == len(rows):
            sub = logits / temperature  # [num_random, vocab]
        else:
            sub = logits.index_select(0, index).div_(temperature)
        params = [rows[i].params for i in random_rows]
        generators = [rows[i].generator for i in random_rows]
        sampled = torch.empty(len(random_rows), dtype=torch.long, device=sub.device)
        truncated = [k for k, p in enumerate(params) if (0 < p.top_k < sub.shape[-1]) or p.top_p < 1.0]
        in_candidates: list[int] = []
        if truncated and sub.shape[-1] > CANDIDATES:
            # NOTE: top-k / nucleus sets that fit in the best CANDIDATES tokens are sampled there,
            # avoiding a sort of the whole vocabulary; exact, decided per row from its own logits.
            rows_t = torch.tensor(truncated, dtype=torch.long, device=sub.device)
            cand_logits = sub.index_select(0, rows_t)  # [r, vocab]
            values, token_ids = cand_logits.topk(CANDIDATES, dim=-1)  # sorted, [r, CANDIDATES]
            cand_params = [params[k] for k in truncated]
            has_top_k = torch.tensor([0 < p.top_k <= CANDIDATES for p in cand_params], device=sub.device).unsqueeze(1)
            k = torch.tensor(
                [p.top_k if 0 < p.top_k <= CANDIDATES else CANDIDATES for p in cand_params], device=sub.device
            )
            beyond_k = torch.arange(CANDIDATES, device=sub.device).unsqueeze(0) >= k.unsqueeze(1)
            # the nucleus is measured against the whole distribution, or the top-k set when there is one
            log_norm = torch.where(
                has_top_k,
                torch.logsumexp(values.masked_fill(beyond_k, float("-inf")), dim=-1, keepdim=True),
                torch.logsumexp(cand_logits, dim=-1, keepdim=True),
            )  # [r, 1]
            mass = torch.exp(values - log_norm).sum(dim=-1)  # candidates' share of that mass
            top_p = torch.tensor([p.top_p for p in cand_params], dtype=mass.dtype, device=mass.device)
            fits = (has_top_k.squeeze(1) | (mass >= top_p + 1e-4)).tolist()
            fits = [
                ok and (0 < p.top_k <= CANDIDATES or not 0 < p.top_k < sub.shape[-1])
                for ok, p in zip(fits, cand_params)
            ]
            picked = [j for j, ok in enumerate(fits) if ok]
            if picked:
                sel = torch.tensor(picked, dtype=torch.long, device=sub.device)
                masked = _top_k_top_p_min_p(
                    values[sel], [cand_params[j] for j in picked], presorted=True, log_norm=log_norm[sel]
                )
                choice = self._draw(torch.softmax(masked, dim=-1), [generators[truncated[j]] for j in picked])
                in_candidates = [truncated[j] for j in picked]
                sampled[torch.tensor(in_candidates, dtype=torch.long, device=sub.device)] = (
                    token_ids[sel].gather(1, choice.unsqueeze(1)).squeeze(1)
                )
        done = set(in_candidates)
        full = [k for k in range(len(random_rows)) if k not in done]
        if full:
            rows_t = torch.tensor(full, dtype=torch.long, device=sub.device)
            values = _top_k_top_p_min_p(sub.index_select(0, rows_t), [params[k] for k in full])
            sampled[rows_t] = self._draw(torch.softmax(values, dim=-1), [generators[k] for k in full])
        greedy_tokens[index] = sampled
        return greedy_tokens

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One index per row of ``probs`` ``[rows, n]`` by inverse CDF; seeded rows use their own generator.

        NOTE: not torch.multinomial, which is much slower on CPU for vocabulary-sized rows
        (docs/design/cpu-performance.md).
        """
        num_rows = probs.shape[0]
        uniform = torch.empty(num_rows, 1, dtype=probs.dtype, device=probs.device)  # [rows, 1]
        unseeded = [k for k, g in enumerate(generators) if g is None]
        if unseeded:
            draws = torch.rand(len(unseeded), 1, generator=self.generator, dtype=probs.dtype, device=probs.device)
            uniform[torch.tensor(unseeded, dtype=torch.long, device=probs.device)] = draws
        for k, generator in enumerate(generators):
            if generator is not None:
                uniform[k] = torch.rand(1, generator=generator, dtype=probs.dtype, device=probs.device)
        cdf = probs.cumsum(dim=-1)  # [rows, n]
        # first index whose cumulative mass exceeds u: never a zero-probability token
        picks = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
        return picks.squeeze(1).clamp_(max=probs.shape[-1] - 1)


CANDIDATES = 1024  # tokens considered first for top-k / top-p rows


def _needs_processing(row: SamplingRow) -> bool:
    params = row.params
    return (
        bool(params.logit_bias)
        or params.needs_penalties
        or (params.min_tokens > 0 and len(row.output_token_ids) < params.min_tokens)
    )


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
        seen = torch.tensor([t for t in row.prompt_token_ids if t < vocab_size], dtype=torch.long, device=device)
        seen = torch.unique(torch.cat([seen, output]))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].to(logits.dtype)  # [vocab]
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p_min_p(
    logits: torch.Tensor, params: list[SamplingParams], presorted: bool = False, log_norm: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask logits ``[rows, n]`` outside each row's top-k / nucleus / min-p set with -inf.

    ``presorted``: each row is already in descending order (the candidate path), and ``log_norm``
    ``[rows, 1]`` is the log of the mass the nucleus is measured against.
    """
    vocab = logits.shape[-1]
    typical_p = [p.typical_p for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        if presorted:
            sorted_logits = logits
            sorted_idx = torch.arange(vocab, device=logits.device).expand_as(logits)
        else:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [rows, vocab]
        k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        mask = ranks >= k
        kept = sorted_logits.masked_fill(mask, float("-inf"))
        probs = torch.exp(kept - log_norm) if log_norm is not None else torch.softmax(kept, dim=-1)
        cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)
        mask |= cumulative >= p
        mask[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    if any(t < 1.0 for t in typical_p):
        logits = _typical(logits, typical_p)
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = (
            torch.tensor(min_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)
            * probs.max(dim=-1, keepdim=True).values
        )
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _typical(logits: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """Locally typical sampling on logits ``[rows, n]`` (-inf already masked out): in each row with
    ``typical_p < 1``, keep the tokens whose surprisal is closest to the row's entropy until their
    probability reaches ``typical_p`` (the best such token always; ties at the cut kept), as
    Transformers' and TGI's typical warper does; other rows pass unchanged."""
    rows = [k for k, t in enumerate(typical_p) if t < 1.0]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)  # [r, n]
    log_probs = torch.log_softmax(sub.float(), dim=-1)
    probs = log_probs.exp()
    entropy = -torch.nan_to_num(log_probs * probs).sum(dim=-1, keepdim=True)  # [r, 1]; masked tokens add 0
    distance = (-log_probs - entropy).abs()  # masked tokens: +inf, sorted last
    sorted_distance, order = distance.sort(dim=-1)
    cumulative = probs.gather(1, order).cumsum(dim=-1)
    mass = torch.tensor([typical_p[k] for k in rows], dtype=cumulative.dtype, device=logits.device).unsqueeze(1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp_(max=sub.shape[-1] - 1)  # [r, 1]
    cut = sorted_distance.gather(1, last)
    drop = distance > cut
    logits = logits.clone()
    logits[index] = sub.masked_fill(drop, float("-inf"))
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
