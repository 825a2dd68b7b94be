"""Offline throughput: N prompts of given input/output lengths through ``LLM.generate``, next to
the same prompts through transformers' batched ``generate`` (same weights, same dtype), in one run.

    python scripts/bench_offline.py --num-prompts 64 --input-len 200 --output-len 200
    python scripts/bench_offline.py --num-prompts 32 --input-len 500 --output-len 1 --skip-transformers  # prefill
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch


def make_prompts(tokenizer, num: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the of and to in is was for on that with as by at from his her an which they this be are".split()
    prompts = []
    for _ in range(num):
        text = " ".join(rng.choice(words) for _ in range(input_len * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:input_len])
    return prompts


def run_pagedserve(args, prompts) -> tuple[float, int]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params.clone(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_transformers(args, prompts) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from pagedserve.models.default_model import default_model_path
    from pagedserve.models.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu")
    path = args.model or default_model_path()
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype, local_files_only=True
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    pad = 2
    total, tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[start : start + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            total += time.perf_counter() - t0
            tokens += (out.shape[1] - width) * len(batch)
    return total, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pagedserve.models.default_model import default_model_path
    from pagedserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model or default_model_path())
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    elapsed, tokens = run_pagedserve(args, prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"pagedserve:   {tokens} output tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} output tok/s "
        f"({prompt_tokens / elapsed:.1f} prompt tok/s; with --output-len 1 that is the prefill rate)"
    )
    if not args.skip_transformers:
        hf_elapsed, hf_tokens = run_transformers(args, prompts)
        print(
            f"transformers: {hf_tokens} output tokens in {hf_elapsed:.1f} s = {hf_tokens / hf_elapsed:.1f} output tok/s "
            f"(batch {args.hf_batch_size})"
        )
        print(f"ratio: {(tokens / elapsed) / (hf_tokens / hf_elapsed):.2f}x")


if __name__ == "__main__":
    main()
