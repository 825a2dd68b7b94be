"""Where one decode step's time goes: N requests decoding together at a given context length.

Runs the engine offline (no server), lets every request finish its prefill, then times
``--steps`` decode steps end to end (and the share of them spent in the model forward, logits
included), and once more under the torch profiler, printing the top operators by self CPU time.

    python scripts/profile_decode.py --batch 64 --context 256
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile


def time_spent_in(module: torch.nn.Module, methods: tuple[str, ...]) -> list[float]:
    """Wrap ``module``'s methods so that the returned one-element list accumulates their wall time."""
    total = [0.0]
    for name in methods:
        original = getattr(module, name)

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start

        setattr(module, name, timed)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.messages import EngineCoreRequest

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=max(256, args.batch))
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(args.context)]
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.monotonic()))
    while engine.get_stats().num_waiting:  # prefill everything
        engine.step()
    for _ in range(3):
        engine.step()
    in_forward = time_spent_in(engine.runner.model, ("forward", "compute_logits"))
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = time.perf_counter() - start
    step_ms = elapsed / args.steps * 1e3
    print(
        f"batch {args.batch}, context ~{args.context}: {step_ms:.1f} ms/step, {args.batch / step_ms * 1e3:.0f} tok/s, "
        f"{100 * (1 - in_forward[0] / elapsed):.1f} % of the step outside the model forward and logits"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
