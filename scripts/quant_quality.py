#!/usr/bin/env python3
"""Quality and memory of each weight-storage scheme, side by side in one run: perplexity of a fixed
English text (from prompt logprobs), greedy agreement with the unquantized model on chat prompts,
and the resident weight bytes.

    .venv/bin/python scripts/quant_quality.py                    # none gguf int8 int4 on the default model
    .venv/bin/python scripts/quant_quality.py --schemes none int4 --model /path/to/model

Perplexity is exp(-mean log p) over every token of the text after the first; agreement counts
the prompts whose greedy completion (--max-tokens tokens) is token-for-token that of `none`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedserve import LLM, SamplingParams  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "perplexity_text.txt")
PROMPTS = [
    "What is the capital of Australia?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that reverses a string.",
    "List three uses of copper.",
    "Translate 'good morning' into French and Spanish.",
    "What is 17 multiplied by 23?",
    "Give me a short tip for sleeping better.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Write a haiku about autumn leaves.",
    "What does a CPU cache do?",
    "Name two planets with rings.",
    "How do I make a cup of green tea?",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet turtle.",
    "Why do we need sleep?",
    "Describe a rainbow to someone who has never seen one.",
]


def evaluate(scheme: str, model: str | None, text: str, max_tokens: int, group_size: int) -> dict:
    llm = LLM(model, quantization=scheme, quantization_group_size=group_size, max_model_len=4096)
    runner = llm.engine.runner
    token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    out = llm.generate(
        [{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    )[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs if entry is not None]
    perplexity = math.exp(-sum(logprobs) / len(logprobs))
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    greedy = llm.chat(conversations, SamplingParams(max_tokens=max_tokens, temperature=0))
    result = {
        "scheme": scheme,
        "tokens": len(logprobs),
        "perplexity": perplexity,
        "weight_mib": runner.weight_bytes / 2**20,
        "completions": [list(o.outputs[0].token_ids) for o in greedy],
        "texts": [o.outputs[0].text for o in greedy],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the default GGUF model)")
    parser.add_argument("--schemes", nargs="+", default=["none", "gguf", "int8", "int4"])
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--show", action="store_true", help="print each scheme's completions")
    args = parser.parse_args()
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    results = [evaluate(s, args.model, text, args.max_tokens, args.group_size) for s in args.schemes]
    base = results[0]
    print(
        f"\n{len(base['completions'])} prompts, {args.max_tokens} greedy tokens; perplexity over {base['tokens']} tokens"
    )
    print(
        "| scheme | perplexity | vs "
        + base["scheme"]
        + " | weights MiB | vs "
        + base["scheme"]
        + " | greedy = "
        + base["scheme"]
        + " | mean agreeing prefix (tokens) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        same = sum(a == b for a, b in zip(r["completions"], base["completions"]))
        prefixes = []
        for a, b in zip(r["completions"], base["completions"]):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefixes.append(n)
        print(
            f"| {r['scheme']} | {r['perplexity']:.3f} | {r['perplexity'] / base['perplexity'] - 1:+.2%} | "
            f"{r['weight_mib']:.1f} | {r['weight_mib'] / base['weight_mib']:.2f}x | {same}/{len(r['completions'])} | "
            f"{sum(prefixes) / len(prefixes):.1f} |"
        )
    if args.show:
        for r in results:
            print(f"\n## {r['scheme']}")
            for prompt, completion in zip(PROMPTS, r["texts"]):
                print(f"- {prompt!r} -> {completion!r}")


if __name__ == "__main__":
    main()
