"""ServerConfig: what ``pagedserve serve`` runs with (address, the served models and their engine core,
HTTP options, the admin key, the cluster or none), frozen and built once from the command line by
``cli_args``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.config import ClusterConfig, EngineConfig, ModelSpec


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    """The HTTP server's limits and options."""

    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False  # /metrics behind the API keys too
    allowed_origins: tuple[str, ...] = ("*",)  # CORS; empty: no CORS middleware
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    rate_limit: tuple[int, float] | None = None  # (requests, per seconds), per API key or client IP
    allowed_hosts: tuple[str, ...] = ()  # Host header check; empty: any host
    gzip_min_bytes: int = 1000  # compress non-streaming responses at least this big; 0: no GZip
    middleware: tuple[str, ...] = ()  # import paths of the user's ASGI middleware (class or function)
    web_ui: bool = True  # the playground at /, the dashboard at /dashboard
    max_request_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    max_queued_requests: int | None = 1024  # beyond the running ones; None: unbounded
    retry_after_s: int = 1
    request_timeout: float | None = 600.0  # seconds; None: no limit
    stream_stall_timeout: float | None = 60.0  # seconds a stream's write may block on its client; None: no limit
    structured_max_string_length: int = 256  # maxLength given to strings a JSON schema leaves unbounded; 0: none
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls from the text with tool_call_parser
    tool_call_parser: str | None = None  # hermes | llama3_json
    max_parallel_tool_calls: int = 0  # most calls in a forced "required" answer; 0: the request's number of tools
    shutdown_timeout: float = 30.0  # seconds of draining on SIGTERM
    log_stats_interval: float = 10.0  # seconds; 0: no stats log line
    http_protocol: str = "auto"  # auto | httptools | h11
    event_loop: str = "auto"  # auto | uvloop | asyncio
    access_log: bool = True
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One server process: where it listens, which models it serves (the first is the default), how their
    engines run (local cores, or replicas on Ray when ``cluster`` is set) and how it serves HTTP.

    ``served_model_names`` are extra names (aliases) of the single model (``--served-model-name``);
    with several models each is known by its ``ModelSpec.name`` only.
    """

    models: tuple[ModelSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    engine_core: str = "process"  # process | thread (local cores)
    served_model_names: tuple[str, ...] = ()  # empty: the model's own name
    admin_key: str | None = None  # None: no admin API
    cluster: ClusterConfig | None = None  # None: one process, no Ray
    http: HTTPOptions = field(default_factory=HTTPOptions)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model must be served")
        names = [spec.name for spec in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique; got {names}")
        if self.served_model_names and len(self.models) > 1:
            raise ValueError("--served-model-name names the single model; with several models use NAME=PATH")

    @property
    def default_model(self) -> ModelSpec:
        return self.models[0]

    @property
    def engine_config(self) -> EngineConfig:
        """The default model's EngineConfig (every model shares the engine flags)."""
        return self.models[0].engine_config

    @property
    def engine(self) -> str:
        return self.models[0].engine

    def names_of(self, spec: ModelSpec) -> tuple[str, ...]:
        """The names clients may use for ``spec``: its own, then the aliases of the single model."""
        if spec is self.models[0] and self.served_model_names:
            return tuple(dict.fromkeys((spec.name, *self.served_model_names)))
        return (spec.name,)

    @staticmethod
    def max_running_requests(spec: ModelSpec) -> int:
        """What one engine runs at once: max_num_seqs for the paged engine, one for ``--engine hf``."""
        return spec.engine_config.scheduler.max_num_seqs if spec.engine == "paged" else 1

    def admission_capacity(self, spec: ModelSpec) -> int | None:
        """Requests of ``spec`` in flight before new ones get 429 (None: unbounded)."""
        queued = self.http.max_queued_requests
        return None if queued is None else self.max_running_requests(spec) * spec.replicas + queued
