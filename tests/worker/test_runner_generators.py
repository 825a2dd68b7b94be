"""The model runner's per-sample generators: sample i of a seeded request draws from seed + i, keeps
its generator across a preemption (the recompute continues the same draws), and the generator is
dropped once the scheduler reports the sample finished (a reused request id starts afresh).

A fake model whose logits depend only on each token and its position (not on the KV cache) makes a
sample's tokens a function of its seed alone, whatever the batch, the cache size or the preemptions.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner

VOCAB = 64
BS = 4
PROMPT = [3, 17, 42, 9, 5, 30]


class PositionalModel(nn.Module):
    """Logits from a fixed random table indexed by (token id, position)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(97, VOCAB, generator=torch.Generator().manual_seed(0)) * 2

    def forward(self, ids, positions, kv_caches, meta):
        return self.table[(ids * 7 + positions) % 97]

    def compute_logits(self, hidden):
        return hidden


class Engine:
    """A scheduler and a model runner, stepped as LLMEngine does."""

    def __init__(self, num_blocks: int = 64) -> None:
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
        self.scheduler = Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len=200)
        self.runner = ModelRunner(
            PositionalModel(),
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            vocab_size=VOCAB,
            num_blocks=num_blocks,
            block_size=BS,
            dtype=torch.float32,
            device=torch.device("cpu"),
            use_cpu_kernels=False,
        )
        self.tokens: dict[tuple[str, int], list[int]] = {}

    def add(self, request_id: str, prompt: list[int] = PROMPT, **params) -> None:
        params.setdefault("temperature", 1.0)
        params.setdefault("ignore_eos", True)
        sp = SamplingParams(**params)
        self.scheduler.add_request(Request(request_id, 0, list(prompt), sp, 0.0, (0,), num_samples_to_fork=sp.n))

    def step(self) -> None:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return
        for out in self.scheduler.update_from_output(sched, self.runner.execute_model(sched)):
            self.tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)

    def run(self) -> dict[tuple[str, int], list[int]]:
        while self.scheduler.has_unfinished_requests():
            self.step()
        return self.tokens


def test_sample_i_draws_from_seed_plus_i():
    forked = Engine()
    forked.add("a", seed=100, n=3, max_tokens=12)
    tokens = forked.run()
    for i in range(3):
        alone = Engine()
        alone.add("b", seed=100 + i, max_tokens=12)
        assert alone.run()[("b", 0)] == tokens[("a", i)]
    assert len({tuple(t) for t in tokens.values()}) == 3


def test_a_preempted_sample_keeps_its_generator():
    def run(num_blocks: int) -> tuple[dict, int]:
        engine = Engine(num_blocks)
        engine.add("a", seed=1, n=2, max_tokens=14)
        engine.add("b", seed=2, max_tokens=14)
        engine.add("c", seed=3, max_tokens=14, top_k=5)
        return engine.run(), engine.scheduler.num_preemptions

    roomy, none = run(64)
    tight, preemptions = run(9)  # 8 usable blocks of 4 tokens for 4 samples of up to 20 tokens
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_finished_samples_drop_their_generators():
    engine = Engine()
    engine.add("a", seed=5, n=2, max_tokens=3)
    engine.add("g", temperature=0.0, max_tokens=3)  # unseeded: no generator of its own
    engine.step()
    assert set(engine.runner._generators) == {("a", 0), ("a", 1)}
    first = list(engine.run()[("a", 0)])
    engine.add("a", seed=5, max_tokens=3)  # the same id and seed again: a fresh generator
    engine.add("s", seed=6, max_tokens=8)
    engine.step()
    assert set(engine.runner._generators) == {("a", 0), ("s", 0)}  # ("a", 1) dropped, ("a", 0) made anew
    assert engine.run()[("a", 0)] == first + first  # tokens are appended per key across both runs
    engine.add("z", temperature=0.0, max_tokens=1)
    engine.step()
    assert engine.runner._generators == {}
