"""xgrammar against llguidance on the default model's vocabulary: what docs/structured-outputs.md quotes
when it says why pagedserve constrains decoding with xgrammar.

For each backend and spec (JSON schemas from small to nested, "any JSON object", a regex, a choice list):
the tokenizer set-up once, a compile of each spec (to a fresh matcher, no cache; the fastest of
--repeat), and, along a real output of that spec
(tokenized as the model would emit it), the time to fill one row's allowed-token mask and to advance
the matcher by one token, as medians over the output's tokens. JSON has no free whitespace in either
backend: compact separators, and once the engine's layout (`", "` and `": "`, xgrammar's own); the mask check at the end says whether each backend
accepted every token of the output.

    pip install llguidance==1.9.1   # not a pagedserve dependency; only this script uses it
    python scripts/grammar_backends.py [--repeat 5]

A backend that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.models.default_model import default_model_path
from pagedserve.tokenizer import eos_token_ids, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "customer": PERSON,
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 8,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "customer", "lines", "paid"],
    "additionalProperties": False,
}
ADA = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "code"]}
COMPACT = (",", ":")
ENGINE = (", ", ": ")  # what the engine compiles (xgrammar's layout without free whitespace)
# (name, kind, spec, an output that satisfies it); a JSON spec is (schema, separators)
SPECS: list[tuple[str, str, Any, str]] = [
    ("json: flat person", "json", (PERSON, COMPACT), json.dumps(ADA, separators=COMPACT)),
    (
        "json: nested order",
        "json",
        (ORDER, COMPACT),
        json.dumps(
            {
                "id": "AB-1234",
                "customer": ADA,
                "lines": [{"sku": "pen", "qty": 2}, {"sku": "ink", "qty": 1}],
                "paid": True,
            },
            separators=COMPACT,
        ),
    ),
    (
        "json: any object",
        "json",
        ({"type": "object"}, COMPACT),
        json.dumps({"a": [1, 2, {"b": None}], "c": "text"}, separators=COMPACT),
    ),
    ("json: flat person, engine layout", "json", (PERSON, ENGINE), json.dumps(ADA, separators=ENGINE)),
    ("regex: date", "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "2026-12-07"),
    ("choice: 3 words", "choice", ["positive", "negative", "neutral"], "negative"),
]


@dataclass
class Row:
    backend: str
    spec: str
    compile_ms: float
    fill_us: float
    advance_us: float
    accepted: bool


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            schema, separators = spec
            return self.compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True, separators=separators
            )
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)

    def allowed(self, token: int) -> bool:
        return bool((self.bitmask[0, token // 32].item() >> (token % 32)) & 1)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids[0])
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, kind: str, spec: Any) -> Any:
        matcher = self.ll.LLMatcher
        if kind == "json":
            schema, (item, key) = spec
            options = {"whitespace_flexible": False, "item_separator": item, "key_separator": key}
            grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        else:
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        return grammar

    def matcher(self, compiled: Any) -> Any:
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher: Any) -> None:
        self._fill(matcher, self.bitmask, 0)

    def allowed(self, token: int) -> bool:
        return bool((self.bitmask[0, token // 32].item() >> (token % 32)) & 1)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(backend: Any, tokenizer: Any, repeat: int) -> list[Row]:
    rows = []
    for name, kind, spec, output in SPECS:
        token_ids = tokenizer.encode(output, add_special_tokens=False)
        compile_s, fill_s, advance_s, accepted = [], [], [], True
        for _ in range(repeat):
            start = time.perf_counter()
            matcher = backend.matcher(backend.compile(kind, spec))  # llguidance compiles in its matcher
            compile_s.append(time.perf_counter() - start)
            for token in token_ids:
                start = time.perf_counter()
                backend.fill(matcher)
                fill_s.append(time.perf_counter() - start)
                accepted = accepted and backend.allowed(token)
                start = time.perf_counter()
                ok = backend.advance(matcher, token)
                advance_s.append(time.perf_counter() - start)
                accepted = accepted and bool(ok)
        rows.append(Row(backend.name, name, min(compile_s) * 1e3, median_us(fill_s), median_us(advance_s), accepted))
    return rows


def timed(build: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = build()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="compiles (the fastest is kept) and walks per spec")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(default_model_path())
    vocab_size = len(tokenizer)
    stop_ids = sorted(set(eos_token_ids(tokenizer)))
    print(f"default model vocabulary: {vocab_size} tokens; stop ids {stop_ids}")
    rows: list[Row] = []
    for backend_class in (XGrammar, LLGuidance):
        try:
            backend, setup_s = timed(lambda cls=backend_class: cls(tokenizer, vocab_size, stop_ids))
        except ImportError as exc:
            print(f"{backend_class.name}: not installed ({exc})")
            continue
        print(f"{backend.name}: tokenizer set-up {setup_s * 1e3:.0f} ms")
        rows += measure(backend, tokenizer, args.repeat)
    print()
    print("| backend | spec | compile ms | mask fill µs / token | advance µs / token | output accepted |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.backend} | {row.spec} | {row.compile_ms:.2f} | {row.fill_us:.0f} | {row.advance_us:.0f} "
            f"| {'yes' if row.accepted else 'no'} |"
        )


if __name__ == "__main__":
    main()
