"""Speculative decoding keeps the model's output distribution, and greedy output, exactly.

A fake model whose next-token distribution depends only on the last token (a Markov chain that
moves to ``token + 1`` with probability 0.5) makes the exact distribution of every output position
computable; a repeating prompt makes prompt lookup propose that very continuation, so drafts are
accepted about half the time at each position and rejected otherwise. Thousands of sampled
requests, verified with drafts, must match the exact marginals; greedy and seeded output must
equal the output without speculation.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.models.loader import LoadedModel
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner

VOCAB = 12
BS = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "2 3" was followed by "4 5 6 7": the drafts after "... 2 3"
NUM_OUTPUT = 5


def transition_matrix() -> torch.Tensor:
    """``P[a, b]``: probability of token b after token a; 0.5 on a + 1, the rest spread unevenly."""
    rest = torch.rand(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)) + 0.2
    matrix = torch.zeros(VOCAB, VOCAB)
    for a in range(VOCAB):
        row = rest[a].clone()
        row[(a + 1) % VOCAB] = 0.0
        matrix[a] = 0.5 * row / row.sum()
        matrix[a, (a + 1) % VOCAB] = 0.5
    return matrix


class MarkovModel(nn.Module):
    """Logits = log P[last token]: the K/V cache is not used."""

    def __init__(self, matrix: torch.Tensor) -> None:
        super().__init__()
        self.log_p = matrix.log()

    def forward(self, ids, positions, kv_caches, meta):  # ids: [num_tokens]
        return self.log_p[ids]  # [num_tokens, vocab]

    def compute_logits(self, hidden):
        return hidden


class Engine:
    """A scheduler and a model runner over the Markov model, stepped as LLMEngine does."""

    def __init__(self, speculative: SpeculativeConfig | None, num_blocks: int = 2048) -> None:
        draft = None
        if speculative is not None and speculative.method == "draft_model":  # drafts the chain's likeliest path
            draft = LoadedModel(
                MarkovModel(transition_matrix()), None, torch.float32, (0,), 200, "draft", 1, 1, 4, VOCAB, {}
            )
        config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=512)
        self.scheduler = Scheduler(config, KVCacheManager(num_blocks, BS), 200, speculative)
        self.runner = ModelRunner(
            MarkovModel(transition_matrix()),
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            vocab_size=VOCAB,
            num_blocks=num_blocks,
            block_size=BS,
            dtype=torch.float32,
            device=torch.device("cpu"),
            seed=7,
            use_cpu_kernels=False,
            draft=draft,
        )
        self.tokens: dict[str, list[int]] = {}

    def add(self, request_id: str, **params) -> None:
        params.setdefault("max_tokens", NUM_OUTPUT)
        sp = SamplingParams(ignore_eos=True, **params)
        self.scheduler.add_request(Request(request_id, 0, list(PROMPT), sp, 0.0, (0,)))

    def run(self) -> dict[str, list[int]]:
        while self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            for out in self.scheduler.update_from_output(sched, self.runner.execute_model(sched)):
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert self.scheduler.kv_cache.num_free_blocks == self.scheduler.kv_cache.pool.num_usable_blocks
        return self.tokens


def spec_config(method: str = "ngram") -> SpeculativeConfig:
    if method == "draft_model":
        return SpeculativeConfig(method, num_speculative_tokens=3, disable_by_batch_size=512, model="markov")
    return SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2, disable_by_batch_size=512
    )


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_output_follows_the_target_distribution(method):
    num_samples = 3000
    engine = Engine(spec_config(method))
    for i in range(num_samples):
        engine.add(f"r{i}", temperature=1.0)
    outputs = engine.run()
    stats = engine.scheduler.get_stats()
    assert all(len(tokens) == NUM_OUTPUT for tokens in outputs.values())
    # drafts were verified, and both accepted and rejected, at every position
    assert stats.spec_num_drafts > num_samples // 2
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert all(count > 0 for count in stats.spec_accepted_per_pos)

    matrix = transition_matrix().double()
    exact = matrix[PROMPT[-1]]  # distribution of output token 0
    for position in range(NUM_OUTPUT):
        counts = torch.bincount(torch.tensor([tokens[position] for tokens in outputs.values()]), minlength=VOCAB)
        observed = counts.double() / num_samples
        for token in range(VOCAB):
            p = exact[token].item()
            sigma = math.sqrt(p * (1 - p) / num_samples)
            assert abs(observed[token].item() - p) <= 5 * sigma + 1e-3, (
                f"position {position} token {token}: observed {observed[token]:.4f}, exact {p:.4f}"
            )
        exact = exact @ matrix  # the next position's marginal
    # and pairs: after token a, the next output token follows row a of the chain
    pairs = [(tokens[0], tokens[1]) for tokens in outputs.values()]
    first = PROMPT[-1] + 1  # the most likely first token
    following = torch.bincount(torch.tensor([b for a, b in pairs if a == first]), minlength=VOCAB).double()
    conditional = following / following.sum()
    n = following.sum().item()
    for token in range(VOCAB):
        p = matrix[first, token].item()
        assert abs(conditional[token].item() - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-3


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_and_seeded_output_equals_output_without_speculation(method):
    def run(speculative):
        engine = Engine(speculative)
        engine.add("greedy", temperature=0.0, max_tokens=20)
        engine.add("penalised", temperature=0.0, max_tokens=20, repetition_penalty=1.3, min_tokens=5)
        engine.add("seeded", temperature=1.0, seed=11, max_tokens=20)
        return engine.run(), engine.scheduler.get_stats()

    plain, _ = run(None)
    spec, stats = run(spec_config(method))
    assert stats.spec_num_accepted_tokens > 0
    assert spec["greedy"] == plain["greedy"] and spec["penalised"] == plain["penalised"]
    assert len(spec["seeded"]) == 20
    again, _ = run(spec_config(method))
    assert again["seeded"] == spec["seeded"]  # a seed makes speculative sampling reproducible
