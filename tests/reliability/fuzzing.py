"""schemathesis against a real server, driven by the server's own /openapi.json: the run (its command,
exit status and summary), the server-side checks after it (nothing left running or waiting, no KV block
held, the same greedy answer as before), and ``python -m tests.reliability.fuzzing`` for long runs
(`make fuzz`)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.utils import RemoteServer, parse_metrics

API_KEY = "sk-fuzz"
# a short context keeps every generated request short however large its max_tokens
SERVER_ARGS = ["--max-model-len", "64", "--api-key", API_KEY, "--log-stats-interval", "0", "--disable-access-log"]
# positive_data_acceptance ("every schema-valid request gets a 2xx") cannot hold: some rules span
# several fields (stream_options only with stream, min_tokens <= max_tokens, ...) or depend on the
# model (vocabulary, context length); every other check, conformance included, runs.
EXCLUDED_CHECKS = ["positive_data_acceptance"]
REFERENCE = {"prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0.0}


@dataclass(frozen=True)
class FuzzRun:
    command: list[str]
    returncode: int
    output: str

    @property
    def cases(self) -> int:
        """How many test cases schemathesis generated (its summary line)."""
        match = re.search(r"(\d+) generated", self.output)
        return int(match.group(1)) if match else 0

    @property
    def summary(self) -> str:
        lines = [line for line in self.output.splitlines() if "generated" in line or line.startswith("=")]
        return "\n".join(lines[-3:])


def schemathesis_command(
    url: str, *, api_key: str | None, max_examples: int, max_time: int | None, seed: int, phases: str | None = None
) -> list[str]:
    """``phases``: schemathesis' (examples, coverage, fuzzing, stateful); None: all of them. Coverage
    alone generates some 2,000 boundary cases whatever ``max_examples`` is (minutes here)."""
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    command = [
        st,
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        ",".join(EXCLUDED_CHECKS),
        "--max-examples",
        str(max_examples),
        "--workers",
        "1",
        "--request-timeout",
        "120",  # a request that takes longer is a hang
        "--generation-database",
        "none",
        "--seed",
        str(seed),
        "--no-color",
    ]
    if max_time is not None:
        command += ["--max-time", str(max_time)]
    if phases is not None:
        command += ["--phases", phases]
    if api_key is not None:
        command += ["-H", f"Authorization: Bearer {api_key}"]
    return command


def run_schemathesis(server: RemoteServer, **kwargs: object) -> FuzzRun:
    command = schemathesis_command(server.url, **kwargs)  # type: ignore[arg-type]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    return FuzzRun(command, done.returncode, done.stdout + done.stderr)


def reference_answer(server: RemoteServer) -> str:
    response = server.post("/v1/completions", json=REFERENCE)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def engine_state(server: RemoteServer, deadline_s: float = 60.0) -> dict[str, float]:
    """The engine's gauges once no request runs or waits (aborts are asynchronous), or at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        values = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
        running = values["pagedserve:num_requests_running"]
        waiting = values["pagedserve:num_requests_waiting"]
        if (running == 0 and waiting == 0) or time.monotonic() > end:
            return {"running": running, "waiting": waiting, "kv_usage": values["pagedserve:kv_cache_usage_perc"]}
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description="Fuzz a real pagedserve server from its /openapi.json")
    parser.add_argument("--max-time", type=int, default=1800, help="seconds of fuzzing with the API key")
    parser.add_argument("--max-examples", type=int, default=100_000, help="per operation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with RemoteServer(SERVER_ARGS, api_key=API_KEY) as server:
        before = reference_answer(server)
        runs = [
            run_schemathesis(
                server, api_key=API_KEY, max_examples=args.max_examples, max_time=args.max_time, seed=args.seed
            ),
            run_schemathesis(server, api_key=None, max_examples=50, max_time=None, seed=args.seed),
        ]
        state = engine_state(server)
        after = reference_answer(server)
    for run in runs:
        print(" ".join(run.command))
        print(run.output[-6000:] if run.returncode else run.summary)
    print(f"cases: {sum(run.cases for run in runs)}; after: {state}; reference answer unchanged: {before == after}")
    ok = all(run.returncode == 0 for run in runs) and state == {"running": 0, "waiting": 0, "kv_usage": 0.0}
    return 0 if ok and before == after else 1


if __name__ == "__main__":
    sys.exit(main())
