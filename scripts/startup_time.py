"""How long `pagedserve serve` takes to become ready: the process is started ``--runs`` times in a row
with the arguments after ``--``, and each run prints the seconds from its start until ``/health``
answers 200, next to the load time its start-up banner reports. Ends with the medians.

    .venv/bin/python scripts/startup_time.py --runs 3 -- --dtype float32 --kv-cache-memory 1GiB
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_start(serve_args: list[str], timeout: float) -> tuple[float, float | None]:
    """Seconds until /health is 200, and the banner's "model loaded in" seconds (None if absent)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"pagedserve exited with {proc.returncode}:\n{log.read()[-2000:]}")
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"not ready after {timeout} s")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            ready = time.monotonic() - start
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        log.seek(0)
        match = re.search(r"model loaded in ([\d.]+) s", log.read())
    return ready, float(match.group(1)) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("serve_args", nargs="*", help="arguments for `pagedserve serve` (after --)")
    args = parser.parse_args()
    readies, loads = [], []
    for run in range(1, args.runs + 1):
        ready, loaded = one_start(args.serve_args, args.timeout)
        readies.append(ready)
        if loaded is not None:
            loads.append(loaded)
        print(f"run {run}: ready in {ready:.1f} s (banner: model loaded in {loaded} s)", flush=True)
    loaded_median = f"{statistics.median(loads):.1f} s" if loads else "-"
    print(f"median: ready in {statistics.median(readies):.1f} s, model loaded in {loaded_median}")


if __name__ == "__main__":
    main()
