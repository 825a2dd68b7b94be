"""The KV cache a benchmark's requests needed, rebuilt from the client's own records.

KV efficiency (average / peak of the server's KV usage) mixes two things: how the load's need for
cache rises and falls (clients whose requests grow and end), and what the server's allocator adds
to it (whole blocks, blocks held after a request ends). This module measures the first one alone, so
a report can tell them apart: at each instant the server's KV usage was sampled, every request in
flight needs its prompt plus the tokens streamed so far. A request counts from its first streamed
token (before that it may be queued, holding nothing) to its end (the window's end for one cut off
there); failed requests hold nothing. With the server's block size and block count (vLLM's
``cache_config_info``), the sampled usage becomes tokens, and allocated / needed shows the
allocator's overhead (partly filled last blocks; under 1 where requests share prefix blocks).

The same lives also give a counterfactual: what a server that reserved each request's prompt plus
``max_tokens`` (no paging, as before PagedAttention) would hold at those instants, counted over the
same lives (from the first token: a conservative count, as such a server reserves at admission).
Its average / peak is often higher than the need's (a reservation is flat for the request's whole
life), while it holds reserved / needed times the memory: the ratio shows how much an efficiency
measured as average / peak rewards reserving.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.bench.request_funcs import INCOMPLETE, RequestFuncOutput


@dataclass(slots=True)
class KVDemand:
    """The KV cache the requests needed at the sampled instants (``kv_demand_summary``); None: no data."""

    peak_kv_demand_tokens: int | None
    avg_kv_demand_tokens: float | None
    kv_demand_efficiency: float | None  # average / peak of the need
    kv_reservation_efficiency: float | None  # average / peak of reserving prompt + max_tokens
    kv_reserved_per_needed: float | None
    kv_block_size: int | None  # the server's cache shape, from cache_config_info
    kv_num_blocks: int | None
    kv_allocated_per_needed: float | None  # the server's KV usage in tokens over the need


class _Life:
    """One request's context length over time: ``prompt_len`` plus the tokens streamed by then."""

    __slots__ = ("prompt_len", "reserved", "arrivals", "tokens_per_chunk", "end")

    def __init__(self, output: RequestFuncOutput, window_end: float) -> None:
        self.prompt_len = output.prompt_len
        # + max_tokens; where the client did not record it, the tokens streamed (so far, for a cut-off request)
        self.reserved = output.prompt_len + max(output.expected_output_len, output.output_tokens)
        first = output.start_time + output.ttft
        self.arrivals = list(itertools.accumulate(output.itl, initial=first))  # one time per streamed chunk
        self.tokens_per_chunk = output.output_tokens / len(self.arrivals) if output.output_tokens > 0 else 1.0
        self.end = window_end if output.error_reason == INCOMPLETE else output.start_time + output.latency

    def tokens_at(self, t: float) -> int:
        """Context at ``t``, an instant in ``[arrivals[0], end)``."""
        return self.prompt_len + round(bisect.bisect_right(self.arrivals, t) * self.tokens_per_chunk)

    def reserved_at(self, t: float) -> int:
        """What reserving prompt + ``max_tokens`` holds at ``t``: the same all life long."""
        return self.reserved


def demand_tokens(outputs: Iterable[RequestFuncOutput], times: list[float], window_end: float) -> list[int]:
    """Tokens of context held by the requests in flight at each of ``times`` (the clock of ``start_time``)."""
    return _held_tokens(_lives(outputs, window_end), times, _Life.tokens_at)


def reserved_tokens(outputs: Iterable[RequestFuncOutput], times: list[float], window_end: float) -> list[int]:
    """Tokens that reserving prompt + ``max_tokens`` per request would hold at each of ``times``, over the
    same lives as ``demand_tokens``."""
    return _held_tokens(_lives(outputs, window_end), times, _Life.reserved_at)


def _lives(outputs: Iterable[RequestFuncOutput], window_end: float) -> list[_Life]:
    """The requests that held cache: those that streamed a first token and then ended or were cut off."""
    return [_Life(o, window_end) for o in outputs if o.ttft > 0 and (o.success or o.error_reason == INCOMPLETE)]


def _held_tokens(lives: list[_Life], times: list[float], held: Callable[[_Life, float], int]) -> list[int]:
    order = sorted(range(len(times)), key=times.__getitem__)
    ordered = [times[i] for i in order]
    total = [0] * len(times)
    for life in lives:  # only the instants inside each request's life
        for k in range(bisect.bisect_left(ordered, life.arrivals[0]), bisect.bisect_left(ordered, life.end)):
            total[order[k]] += held(life, ordered[k])
    return total


def kv_demand_summary(
    outputs: Iterable[RequestFuncOutput],
    times: list[float],
    kv_usage: list[float],
    window_end: float,
    cache_config: dict[str, int] | None = None,
) -> KVDemand:
    """Demand efficiency over the instants ``times`` at which ``kv_usage`` (0..1) was sampled, and,
    with ``cache_config`` (``block_size``, ``num_gpu_blocks``), the allocated tokens per needed token; and
    the reservation counterfactual's efficiency and reserved tokens per needed token."""
    lives = _lives(outputs, window_end)
    demand = _held_tokens(lives, times, _Life.tokens_at)
    reserved = _held_tokens(lives, times, _Life.reserved_at)
    peak, total = max(demand, default=0), sum(demand)
    average = total / len(demand) if demand else None
    peak_reserved, total_reserved = max(reserved, default=0), sum(reserved)
    allocated_per_needed = None
    if cache_config and len(kv_usage) == len(demand) and total > 0:
        allocated = sum(kv_usage) * cache_config["num_gpu_blocks"] * cache_config["block_size"]
        allocated_per_needed = allocated / total
    return KVDemand(
        peak_kv_demand_tokens=peak if demand else None,
        avg_kv_demand_tokens=average,
        kv_demand_efficiency=average / peak if peak else None,
        kv_reservation_efficiency=total_reserved / len(reserved) / peak_reserved if peak_reserved else None,
        kv_reserved_per_needed=total_reserved / total if total else None,
        kv_block_size=cache_config["block_size"] if cache_config else None,
        kv_num_blocks=cache_config["num_gpu_blocks"] if cache_config else None,
        kv_allocated_per_needed=allocated_per_needed,
    )
