"""ServerConfig: what ``pagedserve serve`` runs with (address, engine and core, HTTP options, the
EngineConfig, served names), frozen and built once from the command line by ``cli_args``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    """The HTTP server's limits and options."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ("*",)  # CORS; empty: no CORS middleware
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    rate_limit: tuple[int, float] | None = None  # (requests, per seconds), per API key or client IP
    max_request_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    max_queued_requests: int | None = 1024  # beyond the running ones; None: unbounded
    retry_after_s: int = 1
    request_timeout: float | None = 600.0  # seconds; None: no limit
    shutdown_timeout: float = 30.0  # seconds of draining on SIGTERM
    log_stats_interval: float = 10.0  # seconds; 0: no stats log line
    http_protocol: str = "auto"  # auto | httptools | h11
    event_loop: str = "auto"  # auto | uvloop | asyncio
    access_log: bool = True
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One server process: where it listens, which engine it runs, and how it serves HTTP."""

    engine_config: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "paged"  # paged | hf
    engine_core: str = "process"  # process | thread
    served_model_names: tuple[str, ...] = ()  # empty: the model's own name
    http: HTTPOptions = field(default_factory=HTTPOptions)

    @property
    def max_running_requests(self) -> int:
        """What the engine runs at once: max_num_seqs for the paged engine, one for ``--engine hf``."""
        return self.engine_config.scheduler.max_num_seqs if self.engine == "paged" else 1

    @property
    def admission_capacity(self) -> int | None:
        """Requests in flight before new ones get 429 (None: unbounded)."""
        queued = self.http.max_queued_requests
        return None if queued is None else self.max_running_requests + queued
