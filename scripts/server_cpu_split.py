"""Where a running server's CPU time goes under load: the front-end process against its children.

Starts a `pagedserve bench` run against the server and reports the CPU seconds (user + system)
each process of the server used during it. For pagedserve the parent process is the front end
(HTTP, validation, detokenization, SSE) and the child is the engine core (scheduler and model).

    python scripts/server_cpu_split.py --pid $(pgrep -f "pagedserve serve" | head -1) \
        --url http://127.0.0.1:8000 --workload short --concurrency 64 --duration 20
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

import psutil


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def snapshot(root: psutil.Process) -> dict[int, tuple[str, float]]:
    procs = [root, *root.children(recursive=True)]
    return {p.pid: (" ".join(p.cmdline()[:3])[:60], cpu_seconds(p)) for p in procs if p.is_running()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the server's main process")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--workload", default="short")
    parser.add_argument("--concurrency", default="64")
    parser.add_argument("--duration", default="20")
    args = parser.parse_args()

    root = psutil.Process(args.pid)
    before = snapshot(root)
    with tempfile.TemporaryDirectory() as output_dir:
        subprocess.run([sys.executable, "-m", "pagedserve.bench", "--target", args.url, "--workload", args.workload,
                        "--concurrency", args.concurrency, "--duration", args.duration, "--drain-timeout", "0",
                        "--num-warmups", "0", "--ignore-eos", "--no-progress", "--output-dir", output_dir],
                       check=True, stdout=subprocess.DEVNULL)
    after = snapshot(root)
    used = {pid: after[pid][1] - before.get(pid, ("", 0.0))[1] for pid in after}
    total = sum(used.values()) or 1.0
    for pid, seconds in sorted(used.items(), key=lambda item: -item[1]):
        role = "front end" if pid == args.pid else "child"
        print(f"{pid:>8} {role:<10} {seconds:8.1f} s CPU  {100 * seconds / total:5.1f} %  {after[pid][0]}")


if __name__ == "__main__":
    main()
