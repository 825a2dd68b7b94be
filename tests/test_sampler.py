"""Sampler: the candidate fast path for top-k / top-p gives the same distribution as the full sort."""

from __future__ import annotations

import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import CANDIDATES, Sampler, SamplingRow, _top_k_top_p_min_p

VOCAB = 5000


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), None, [1, 2, 3], [], (0,))


def empirical(sampler: Sampler, logits: torch.Tensor, params: dict, draws: int = 4000) -> torch.Tensor:
    rows = [row(**params) for _ in range(draws)]
    tokens, _ = sampler(logits.expand(draws, -1).clone(), rows)
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / draws


def expected(logits: torch.Tensor, params: dict) -> torch.Tensor:
    p = SamplingParams(**params)
    masked = _top_k_top_p_min_p(logits / p.temperature, [p])
    return torch.softmax(masked, dim=-1)[0]


def test_candidate_path_matches_the_full_distribution():
    torch.manual_seed(0)
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(1))
    logits = torch.randn(1, VOCAB) * 3
    for params in ({"top_k": 20}, {"top_p": 0.5}, {"top_p": 0.9, "top_k": 100}, {"top_p": 0.3, "min_p": 0.1}):
        params = {"temperature": 0.7, **params}
        target = expected(logits, params)
        seen = empirical(sampler, logits, params)
        assert seen[target == 0].sum() == 0, params  # nothing outside the allowed set
        assert (seen - target).abs().max() < 0.05, params


def test_flat_distribution_falls_back_to_the_full_sort():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(1))
    logits = torch.zeros(1, VOCAB)  # the nucleus of p=0.9 spans 4,500 tokens > CANDIDATES
    assert VOCAB * 0.9 > CANDIDATES
    seen = empirical(sampler, logits, {"temperature": 1.0, "top_p": 0.9}, draws=2000)
    assert (seen > 0).sum() > CANDIDATES


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(1))
    logits = torch.randn(3, VOCAB)

    def seeded():
        return SamplingRow(SamplingParams(temperature=1.0, top_p=0.8, seed=5), torch.Generator().manual_seed(5), [], [], (0,))

    alone, _ = sampler(logits[:1].clone(), [seeded()])
    batched, _ = sampler(logits.clone(), [seeded(), row(temperature=1.0), row(temperature=0.5, top_k=3)])
    assert alone[0] == batched[0]
