#!/usr/bin/env python
"""Closed-loop simulation of the scheduler under a full KV cache: ``--kv-admission`` policies side by side.

The real ``Scheduler`` and ``KVCacheManager`` run; the model does not. Each step costs
``STEP_BASE_S + prompt-or-decode tokens * STEP_PER_TOKEN_S + requests * STEP_PER_REQUEST_S`` of
simulated time (about this project's float32 CPU server at concurrency 64 on two cores), and every
request "samples" a fixed token. Clients send the benchmark's mixed workload (20 % 50/100, 50 %
200/500, 30 % 500/1000 prompt/output tokens) and send the next request when one ends; with
``--early-stop`` each request ends at a uniformly random share of its ``max_tokens`` (chat traffic),
otherwise it uses all of it (``--ignore-eos``). Prints TTFT, TPOT and the longest stall of a stream
in simulated seconds, and the preemptions. It shows how a policy behaves, not how fast a server is:

    .venv/bin/python scripts/sim_admission.py --blocks 363 --concurrency 64 --requests 500
"""

from __future__ import annotations

import argparse
import random
import statistics

from pagedserve.config import KV_ADMISSION_POLICIES, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

MIXED = ((0.2, 50, 100), (0.5, 200, 500), (0.3, 500, 1000))  # share, prompt tokens, max_tokens
STEP_BASE_S = 0.02
STEP_PER_TOKEN_S = 0.0004
STEP_PER_REQUEST_S = 0.0015


def pick_lengths(pick: float) -> tuple[int, int]:
    """Prompt and output lengths of the workload class that ``pick`` (uniform in [0, 1)) falls in."""
    share = 0.0
    for share_of, num_prompt, max_tokens in MIXED:
        share += share_of
        if pick < share:
            return num_prompt, max_tokens
    return MIXED[-1][1], MIXED[-1][2]


def simulate(policy: str, args: argparse.Namespace, early_stop: bool) -> dict[str, float]:
    rng = random.Random(args.seed)
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, kv_admission=policy)
    scheduler = Scheduler(config, KVCacheManager(args.blocks, args.block_size), max_model_len=8192)
    clock = 0.0
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    target: dict[str, int] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    stalls: list[float] = []
    made = finished = tokens = 0
    measured_from = 0.0

    def send() -> None:
        nonlocal made
        num_prompt, max_tokens = pick_lengths(rng.random())
        request_id = f"r{made}"
        made += 1
        target[request_id] = max(1, int(max_tokens * rng.random())) if early_stop else max_tokens
        prompt = [rng.randrange(100, 30_000) for _ in range(num_prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        arrival[request_id] = clock
        scheduler.add_request(Request(request_id, 0, prompt, params, clock, (2,)))

    # clients start one by one over the ramp-up; the first `warmup` requests are left out of the figures
    starts = [k * args.ramp_up / args.concurrency for k in range(args.concurrency)]
    warmup = 2 * args.concurrency
    while finished < args.requests + warmup:
        while starts and starts[0] <= clock:
            starts.pop(0)
            send()
        sched = scheduler.schedule()
        if sched.is_empty:
            clock = starts[0] if starts else clock
            continue
        clock += STEP_BASE_S + sched.num_batched_tokens * STEP_PER_TOKEN_S + len(sched.scheduled) * STEP_PER_REQUEST_S
        result = ModelRunnerOutput(
            [[7] * item.num_samples for item in sched.scheduled],
            [None] * len(sched.scheduled),
            [None] * len(sched.scheduled),
        )
        for out in scheduler.update_from_output(sched, result):
            request_id = out.request_id
            tokens += len(out.new_token_ids) if finished >= warmup else 0
            measured = int(request_id[1:]) >= warmup
            if request_id not in first:
                first[request_id] = clock
                if measured:
                    ttft.append(clock - arrival[request_id])
            elif measured:
                stalls.append(clock - last[request_id])
            last[request_id] = clock
            samples = scheduler.requests.get(request_id)
            done = out.finish_reason is not None
            if not done and samples and samples[0].num_output_tokens >= target[request_id]:
                scheduler.stop_samples([(request_id, 0)])  # the "EOS" of an early-stopping request
                done = True
            if done:
                if target[request_id] > 1 and measured:
                    tpot.append((clock - first[request_id]) / (target[request_id] - 1))
                finished += 1
                if finished == warmup:
                    measured_from = clock
                    scheduler.reset_counters()
                send()
    pct = statistics.quantiles
    return {
        "out tok/s": tokens / (clock - measured_from),
        "TTFT p50 s": pct(ttft, n=100)[49],
        "TTFT p99 s": pct(ttft, n=100)[98],
        "TPOT p50 ms": pct(tpot, n=100)[49] * 1000,
        "TPOT p99 ms": pct(tpot, n=100)[98] * 1000,
        "longest stall s": max(stalls),
        "preemptions": scheduler.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=363, help="KV blocks (363 x 128 tokens: 1 GiB in bf16)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--requests", type=int, default=500, help="finished requests per run, after a warm-up of 2 x concurrency"
    )
    parser.add_argument("--ramp-up", type=float, default=20.0, help="simulated seconds over which the clients start")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [
        (traffic, policy, simulate(policy, args, traffic == "early stop"))
        for traffic in ("whole budgets", "early stop")
        for policy in KV_ADMISSION_POLICIES
    ]
    columns = list(rows[0][2])
    print("| traffic | --kv-admission | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for traffic, policy, row in rows:
        cells = [f"{row[c]:,.0f}" if c in ("preemptions", "out tok/s") else f"{row[c]:,.2f}" for c in columns]
        print(f"| {traffic} | {policy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
