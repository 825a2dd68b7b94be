"""Test helpers: ``RemoteServer`` runs ``pagedserve serve`` as a real subprocess on a free local port;
``assert_bf16_close`` compares a bf16 kernel's output with PyTorch's; ``cpu_kernels_or_skip`` and
``assert_no_leak`` are shared by several test folders."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import torch

DEFAULT_START_TIMEOUT_S = 240.0  # model load + warm-up take ~30-60 s on 2 cores; generous for busy CI


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float, max_mismatch: float) -> None:
    """Equal up to float32 summation order: at most one bf16 rounding step apart (rtol 2^-7), and on
    at most ``max_mismatch`` of the elements."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=2**-7)
    assert (out != ref).float().mean() < max_mismatch


def cpu_kernels_or_skip(capability: str | None = None, reason: str = "the C++ kernels could not be built here"):
    """The compiled kernel module; skips the test when it is not built, or when ``module.<capability>()`` is False."""
    from pagedserve.kernels import load_cpu_kernels

    module = load_cpu_kernels()
    if module is None or (capability is not None and not getattr(module, capability)()):
        pytest.skip(reason)
    return module


def assert_no_leak(llm) -> None:
    """An offline LLM with nothing left running and every KV block back in the free pool."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


# the shape of the tiny random Llama-family models the model, loader and engine tests build
TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TEST_KV_CACHE = "512MiB"  # holds the default 8,192-token context; zero-filled at every start, so no larger


class RemoteServer:
    """``with RemoteServer(["--max-num-seqs", "8"]) as server: ...``

    Starts ``python -m pagedserve.cli serve <args> --host 127.0.0.1 --port <free>``, waits until
    ``/health`` answers 200, exposes ``url``, ``base_url`` (``…/v1``), ``pid`` and the log, and
    terminates the process (SIGTERM, then SIGKILL) on exit.

    A server whose ``args`` do not size its KV cache gets a fixed ``TEST_KV_CACHE`` (the default,
    a share of the machine's memory, would commit gigabytes per test server); ``size_kv_cache=False``
    keeps the server's own default (the tests of that default).
    """

    def __init__(
        self,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        api_key: str | None = None,
        launcher: list[str] | None = None,
        size_kv_cache: bool = True,
    ) -> None:
        self.args = list(args or [])
        sizing_flags = ("--kv-cache-memory", "--memory-utilization", "--gpu-memory-utilization")
        if size_kv_cache and not any(arg.split("=")[0] in sizing_flags for arg in self.args):
            self.args += ["--kv-cache-memory", TEST_KV_CACHE]
        # what runs `pagedserve`: by default this interpreter's `-m pagedserve.cli`
        self.launcher = list(launcher or [sys.executable, "-m", "pagedserve.cli"])
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start_timeout = start_timeout
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-", suffix=".log", delete=False)
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log_path(self) -> str:
        return self._log.name

    def log_text(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def __enter__(self) -> RemoteServer:
        cmd = [*self.launcher, "serve", *self.args, "--host", self.host, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        try:
            self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pagedserve exited with {self.proc.returncode} during start-up:\n{self.log_text()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"pagedserve not healthy after {self.start_timeout} s:\n{self.log_text()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.returncode = self.proc.returncode
        self._log.close()
        return self.returncode

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs: object) -> httpx.Response:
        kwargs.setdefault("timeout", 60.0)
        kwargs.setdefault("headers", self.headers())
        return httpx.get(self.url + path, **kwargs)

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("headers", self.headers())
        return httpx.post(self.url + path, **kwargs)

    def openai_client(self, **kwargs: object):
        import openai

        kwargs.setdefault("api_key", self.api_key or "EMPTY")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.base_url, **kwargs)

    def async_openai_client(self, **kwargs: object):
        import openai

        kwargs.setdefault("api_key", self.api_key or "EMPTY")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.base_url, **kwargs)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} plus {"name": value} for the first sample of each name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        values[name_part] = number
        base = name_part.split("{", 1)[0]
        values.setdefault(base, number)
    return values
