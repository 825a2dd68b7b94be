"""Benchmark metrics: percentiles, per-request TPOT, goodput against SLOs, throughput, failures by reason.

Definitions follow ``vllm bench serve``: TTFT is send to first generated text; TPOT is
(E2E - TTFT) / (output tokens - 1) per request; ITL are the gaps between streamed chunks;
throughputs divide by the wall time of the measured phase.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pagedserve.bench.request_funcs import INCOMPLETE, RequestFuncOutput

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
_SLO_UNITS = {"ms": 1.0, "s": 1000.0, "": 1.0}


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft:500ms,tpot:50ms,e2el:2s`` -> {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        name = name.strip().lower()
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", value)
        if name not in LATENCY_METRICS or not match:
            raise ValueError(f"bad SLO {part!r}: use NAME:VALUE[ms|s] with NAME in {', '.join(LATENCY_METRICS)}")
        slos[name] = float(match.group(1)) * _SLO_UNITS[match.group(2) or ""]
    return slos


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean/p50/p90/p99 (and min/max/std) in milliseconds; zeros for an empty list."""
    if not values_s:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0, "std": 0.0}
    array = np.asarray(values_s, dtype=np.float64) * 1000.0
    result = {"mean": float(array.mean())}
    for p, value in zip(PERCENTILES, np.percentile(array, PERCENTILES)):
        result[f"p{p}"] = float(value)
    result.update(min=float(array.min()), max=float(array.max()), std=float(array.std()))
    return result


def request_tpot(output: RequestFuncOutput) -> float | None:
    if output.output_tokens <= 1:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def fill_token_counts(outputs: list[RequestFuncOutput], tokenizer: Any | None) -> None:
    """Output token counts for requests whose server sent no usage (or that were cut off): count the text."""
    for output in outputs:
        if (output.success or output.error_reason == INCOMPLETE) and not output.usage_reported:
            if tokenizer is not None:
                output.output_tokens = len(tokenizer.encode(output.generated_text, add_special_tokens=False))
            else:
                output.output_tokens = output.num_chunks


def meets_slo(output: RequestFuncOutput, slos: dict[str, float]) -> bool:
    values = {"ttft": output.ttft, "e2el": output.latency, "tpot": request_tpot(output) or 0.0}
    if "itl" in slos and output.itl:
        values["itl"] = max(output.itl)
    return all(values.get(name, 0.0) * 1000.0 <= limit for name, limit in slos.items())


def failure_reasons(outputs: list[RequestFuncOutput]) -> tuple[dict[str, int], dict[str, str]]:
    """Counts by short reason, and one full message per reason as an example."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for output in outputs:
        if output.success:
            continue
        reason = output.error_reason or "unknown"
        counts[reason] += 1
        examples.setdefault(reason, output.error)
    return dict(counts.most_common()), examples


def tokens_streamed_after(output: RequestFuncOutput, boundary: float) -> int:
    """How many of a request's output tokens arrived at or after ``boundary`` (the clock of ``start_time``).

    Chunk arrival times are rebuilt from the first-token time and the inter-chunk gaps; a chunk's
    tokens are its share of ``output_tokens`` (one token per chunk when the server streams each).
    """
    if output.ttft <= 0 or output.output_tokens <= 0:
        return 0
    arrival = output.start_time + output.ttft
    after = int(arrival >= boundary)
    for gap in output.itl:
        arrival += gap
        after += arrival >= boundary
    return round(output.output_tokens * after / (1 + len(output.itl)))


@dataclass(slots=True)
class PointMetrics:
    """The aggregate figures of one benchmark point (``summarize``); latency stats are ``stats_ms`` dicts."""

    completed: int
    failed: int
    incomplete: int  # cut off at the end of a --duration window
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    incomplete_output_tokens: int
    warmup_carried_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    ttft_started_ms: dict[str, float]
    started: int
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    failures: dict[str, int]
    failure_examples: dict[str, str]
    usage_reported: bool
    slo: dict[str, float] | None = None  # None (and no goodput_fraction) without SLOs
    goodput: float | None = None
    goodput_fraction: float | None = None

    def to_json(self) -> dict[str, Any]:
        """summary.json's fields, where ``slo`` and ``goodput_fraction`` appear only with SLOs."""
        fields = asdict(self)
        if self.slo is None:
            del fields["slo"], fields["goodput_fraction"]
        return fields


def summarize(
    outputs: list[RequestFuncOutput],
    duration_s: float,
    slos: dict[str, float] | None = None,
    carried_output_tokens: int = 0,
) -> PointMetrics:
    """Aggregate metrics of one benchmark point (the fields of summary.json except identity and memory).

    Requests cut off at the end of a ``--duration`` window count as ``incomplete``: neither
    completed nor failed and not in the latency figures, but the tokens they streamed inside
    the window count in the token throughputs (tokens delivered per second of the window), and
    those that got their first token count in ``ttft_started_ms``: where long requests outlive
    the window, TTFT over completed requests alone is a small sample biased to the short ones.
    ``carried_output_tokens`` are those streamed inside the window by requests sent before it
    opened (``--warmup-duration``): in the throughputs too, not in the latencies.
    """
    cut = [o for o in outputs if o.error_reason == INCOMPLETE]
    outputs = [o for o in outputs if o.error_reason != INCOMPLETE]
    done = [o for o in outputs if o.success]
    failed = len(outputs) - len(done)
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    cut_output = sum(o.output_tokens for o in cut)
    cut_input = sum(o.prompt_len for o in cut if o.ttft > 0)
    duration_s = max(duration_s, 1e-9)
    started_ttfts = [o.ttft for o in done + cut if o.ttft > 0]
    tpots = [t for t in (request_tpot(o) for o in done) if t is not None]
    itls = [gap for o in done for gap in o.itl]
    reasons, examples = failure_reasons(outputs)
    metrics = PointMetrics(
        completed=len(done),
        failed=failed,
        incomplete=len(cut),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        incomplete_output_tokens=cut_output,
        warmup_carried_output_tokens=carried_output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=(total_output + cut_output + carried_output_tokens) / duration_s,
        total_token_throughput=(total_input + total_output + cut_input + cut_output + carried_output_tokens)
        / duration_s,
        ttft_ms=stats_ms([o.ttft for o in done]),
        ttft_started_ms=stats_ms(started_ttfts),
        started=len(started_ttfts),
        tpot_ms=stats_ms(tpots),
        itl_ms=stats_ms(itls),
        e2el_ms=stats_ms([o.latency for o in done]),
        failures=reasons,
        failure_examples=examples,
        usage_reported=bool(done) and all(o.usage_reported for o in done),
    )
    if slos:
        good = sum(1 for o in done if meets_slo(o, slos))
        metrics.slo = dict(slos)
        metrics.goodput = good / duration_s
        metrics.goodput_fraction = good / len(outputs) if outputs else 0.0
    return metrics


def cost_per_1k_output_tokens(price_per_hour: float | None, duration_s: float, output_tokens: int) -> float | None:
    if price_per_hour is None or output_tokens <= 0:
        return None
    return price_per_hour * duration_s / 3600.0 / (output_tokens / 1000.0)
