"""Prefix-cache and router counters of running pagedserve servers, summed over models and replicas:
``snapshot`` writes them to a JSON file, ``diff`` prints the hit rates between two snapshots as a table.

  python scripts/prefix_cache_rates.py snapshot before.json NAME=URL ...
  python scripts/prefix_cache_rates.py diff before.json after.json
"""

from __future__ import annotations

import json
import sys

import httpx

COUNTERS = (
    "pagedserve:prefix_cache_queries_total",
    "pagedserve:prefix_cache_hits_total",
    "pagedserve:router_prefix_queries_total",
    "pagedserve:router_prefix_affinity_hits_total",
)


def counters(url: str) -> dict[str, float]:
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def main() -> None:
    if sys.argv[1] == "snapshot":
        targets = dict(arg.split("=", 1) for arg in sys.argv[3:])
        with open(sys.argv[2], "w") as f:
            json.dump({name: counters(url) for name, url in targets.items()}, f, indent=1)
        return
    before, after = (json.load(open(path)) for path in sys.argv[2:4])
    print("| target | prefix-cache hit rate (tokens) | prompts sent where their prefix went |")
    print("|---|---|---|")
    for name, end in after.items():
        delta = {key: end[key] - before[name][key] for key in end}
        queries, hits = delta[COUNTERS[0]], delta[COUNTERS[1]]
        routed, affine = delta[COUNTERS[2]], delta[COUNTERS[3]]
        rate = f"{hits / queries:.1%}" if queries else "n/a"
        affinity = f"{affine / routed:.1%} of {int(routed)}" if routed else "n/a"
        print(f"| {name} | {rate} | {affinity} |")


if __name__ == "__main__":
    main()
