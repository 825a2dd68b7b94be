"""PNG plots of a benchmark run (matplotlib, the ``bench`` extra): throughput and P99 latency
against load per target, latency CDFs, and TTFT against input length."""

from __future__ import annotations

import math
import os

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pagedserve.bench.runner import PointResult  # noqa: E402


def _load_x(result: PointResult) -> float | None:
    point = result.point
    if point.is_open:
        rate = point.request_rate or math.inf
        return None if math.isinf(rate) else rate
    return float(point.concurrency or 1)


_LINE_STYLES = ("-", "--", ":", "-.")


def _colors(results: list[PointResult]) -> dict[str, str]:
    names = list(dict.fromkeys(r.target.name for r in results))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _by_target(results: list[PointResult]) -> dict[str, list[PointResult]]:
    groups: dict[str, list[PointResult]] = {}
    for result in results:
        groups.setdefault(result.target.name, []).append(result)
    return groups


def _scaling_plot(path: str, workload: str, results: list[PointResult]) -> bool:
    open_loop = all(r.point.is_open for r in results)
    series = []
    for target, group in _by_target(results).items():
        points = sorted(
            (x, r.record.metrics) for r in group if (x := _load_x(r)) is not None and r.point.is_open == open_loop
        )
        if points:
            series.append((target, points))
    if not series:
        return False
    colors = _colors(results)
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for target, points in series:
        xs = [x for x, _ in points]
        color = colors[target]
        ax_tput.plot(xs, [m.output_throughput for _, m in points], marker="o", color=color, label=target)
        # NOTE: a point where nothing completed has no latency (NaN leaves a gap, not a zero)
        ax_lat.plot(
            xs,
            [m.e2el_ms["p99"] if m.completed else math.nan for _, m in points],
            marker="o",
            color=color,
            label=f"{target} E2E",
        )
        ax_lat.plot(
            xs,
            [m.ttft_ms["p99"] if m.completed else math.nan for _, m in points],
            marker="x",
            color=color,
            linestyle="--",
            label=f"{target} TTFT",
        )
    xlabel = "request rate (req/s)" if open_loop else "concurrency"
    all_xs = sorted({x for _, pts in series for x, _ in pts})
    for ax, ylabel in ((ax_tput, "output tokens/s"), (ax_lat, "P99 latency (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if not open_loop and all_xs[-1] > 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_xs)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_tput.set_title(f"{workload}: throughput")
    ax_lat.set_title(f"{workload}: P99 latency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _cdf_plot(path: str, workload: str, results: list[PointResult]) -> bool:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    drawn = False
    colors = _colors(results)
    styles = {
        label: _LINE_STYLES[i % len(_LINE_STYLES)]
        for i, label in enumerate(dict.fromkeys(r.point.label for r in results))
    }
    for result in results:
        done = [o for o in result.outputs if o.success]
        if not done:
            continue
        label = f"{result.target.name} {result.point.label}"
        tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
        for ax, values in zip(axes, ([o.ttft for o in done], tpots, [o.latency for o in done])):
            if values:
                data = np.sort(np.asarray(values) * 1000.0)
                ax.step(
                    data,
                    np.arange(1, len(data) + 1) / len(data),
                    where="post",
                    label=label,
                    color=colors[result.target.name],
                    linestyle=styles[result.point.label],
                )
                drawn = True
    for ax, name in zip(axes, ("TTFT", "TPOT", "end-to-end latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{workload}: {name} CDF")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _ttft_vs_input_plot(path: str, results: list[PointResult]) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    colors = _colors(results)
    for target, group in _by_target(results).items():
        done = [o for r in group for o in r.outputs if o.success]
        if done:
            ax.scatter(
                [o.prompt_len for o in done],
                [o.ttft * 1000.0 for o in done],
                s=10,
                alpha=0.6,
                color=colors[target],
                label=target,
            )
            drawn = True
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT against input length (all loads)")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def write_plots(output_dir: str, results: list[PointResult]) -> list[tuple[str, str]]:
    """Write the PNGs under ``output_dir/plots``; returns (title, path relative to output_dir)."""
    plot_dir = os.path.join(output_dir, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    written: list[tuple[str, str]] = []
    workloads: dict[str, list[PointResult]] = {}
    for result in results:
        workloads.setdefault(result.workload, []).append(result)
    for workload, group in workloads.items():
        name = f"scaling_{workload}.png"
        if _scaling_plot(os.path.join(plot_dir, name), workload, group):
            written.append((f"{workload}: throughput and P99 latency against load", f"plots/{name}"))
        name = f"latency_cdf_{workload}.png"
        if _cdf_plot(os.path.join(plot_dir, name), workload, group):
            written.append((f"{workload}: latency CDFs", f"plots/{name}"))
    if _ttft_vs_input_plot(os.path.join(plot_dir, "ttft_vs_input_len.png"), results):
        written.append(("TTFT against input length", "plots/ttft_vs_input_len.png"))
    return written
