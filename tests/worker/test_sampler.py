"""Sampler: the candidate fast path for top-k / top-p gives the same distribution as the full sort;
typical_p keeps the set Transformers' typical warper keeps; the greedy fast path (and its C++ argmax)
picks what torch.max picks."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import load_cpu_kernels
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


def test_typical_p_keeps_what_transformers_keeps():
    from transformers.generation.logits_process import TypicalLogitsWarper

    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB) * torch.tensor([[0.5], [2.0], [4.0], [8.0]])  # flat to peaked rows
    logits[0, :100] = float("-inf")  # already masked tokens stay out and do not count
    for mass in (0.2, 0.5, 0.9, 0.99):
        ours = _top_k_top_p_min_p(logits.clone(), [SamplingParams(typical_p=mass)] * 4)
        theirs = TypicalLogitsWarper(mass)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), mass
        assert (~torch.isinf(ours)).sum(dim=-1).min() >= 1
    # only the rows that ask for it are filtered, and after top-p: within the nucleus
    mixed = _top_k_top_p_min_p(logits.clone(), [SamplingParams(typical_p=0.5, top_p=0.8), SamplingParams()] * 2)
    plain = _top_k_top_p_min_p(logits.clone(), [SamplingParams(top_p=0.8), SamplingParams()] * 2)
    assert torch.equal(mixed[1], plain[1]) and torch.equal(mixed[3], plain[3])
    assert torch.isinf(mixed[0]).sum() > torch.isinf(plain[0]).sum()
    nucleus = _top_k_top_p_min_p(logits[:1].clone(), [SamplingParams(top_p=0.8)])
    assert not (torch.isinf(nucleus[0]) & ~torch.isinf(mixed[0])).any()
    with pytest.raises(ValueError, match="typical_p"):
        SamplingParams(typical_p=0.0)


def test_typical_p_draws_from_the_typical_set():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(2))
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB) * 4
    params = {"temperature": 1.0, "typical_p": 0.6}
    target = expected(logits, params)
    seen = empirical(sampler, logits, params)
    assert seen[target == 0].sum() == 0 and (target == 0).any()  # a strict subset, nothing outside it
    assert (seen - target).abs().max() < 0.05


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
        return SamplingRow(
            SamplingParams(temperature=1.0, top_p=0.8, seed=5), torch.Generator().manual_seed(5), [], [], (0,)
        )

    alone, _ = sampler(logits[:1].clone(), [seeded()])
    batched, _ = sampler(logits.clone(), [seeded(), row(temperature=1.0), row(temperature=0.5, top_k=3)])
    assert alone[0] == batched[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_matches_torch_max(dtype):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    for vocab in (1, 7, 16, 17, 63, 64, 65, 127, 200, 49152, 49153):
        logits = torch.randn(9, vocab + 5).to(dtype)[:, :vocab]  # rows further apart than the vocab
        assert torch.equal(kernels.argmax_rows(logits), logits.max(dim=-1).indices), vocab
        few_values = torch.randint(0, 3, (9, vocab)).to(dtype)  # many equal maxima in every lane and chain
        assert torch.equal(kernels.argmax_rows(few_values), few_values.max(dim=-1).indices), vocab
    late = torch.zeros(3, 300, dtype=dtype)
    late[0, [70, 20]] = 1.0  # the later block's lane and the earlier one's: the first index wins
    late[1, 250] = float("nan")  # a NaN only in a later 64-wide block
    late[2, 299] = float("nan")  # a NaN only in the tail after the blocks
    assert kernels.argmax_rows(late).tolist() == [20, 250, 299]
    ties = torch.zeros(4, 100, dtype=dtype)
    ties[0, [3, 40, 99]] = 2.0  # equal maxima in different lanes and in the tail: the first wins
    ties[1, [17, 33]] = 1.0
    ties[2].fill_(float("-inf"))
    ties[3, [5, 50]] = float("nan")  # NaN propagates, as torch.max does: the first NaN
    assert kernels.argmax_rows(ties).tolist() == [3, 17, 0, 5]
    assert torch.equal(kernels.argmax_rows(ties), ties.max(dim=-1).indices)
    with pytest.raises(RuntimeError):
        kernels.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))


def test_greedy_fast_path_with_the_kernel_picks_the_same_tokens():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    logits = torch.randn(32, VOCAB + 11).bfloat16()  # padded vocab columns past VOCAB are ignored
    logits[:, VOCAB:] = 100.0
    plain = Sampler(VOCAB, torch.Generator().manual_seed(1))
    fast = Sampler(VOCAB, torch.Generator().manual_seed(1), kernels.argmax_rows)
    rows = [row(temperature=0.0) for _ in range(32)]
    tokens, logprobs = fast(logits, rows)
    assert tokens == plain(logits, rows)[0] == logits[:, :VOCAB].float().argmax(dim=-1).tolist()
    assert logprobs == [None] * 32
    with_logprobs = [row(temperature=0.0, logprobs=2) for _ in range(32)]
    tokens_lp, logprobs_lp = fast(logits, with_logprobs)
    assert tokens_lp == tokens and all(lp is not None and lp.token_id == t for lp, t in zip(logprobs_lp, tokens))
