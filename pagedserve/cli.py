"""The ``pagedserve`` command: ``serve`` (the HTTP server) and ``bench`` (the load-test tool)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from pagedserve import __version__
    from pagedserve.entrypoints.cli_args import add_serve_arguments

    parser = argparse.ArgumentParser(prog="pagedserve", description="High-concurrency LLM inference server")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,bench}")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI and TGI HTTP APIs",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(serve)
    bench = commands.add_parser("bench", help="load-test one or more servers")
    try:
        from pagedserve.bench import cli as bench_cli
    except ImportError as exc:
        bench.set_defaults(bench_missing=str(exc))
    else:
        bench_cli.add_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # NOTE: only the command itself (argv None) may re-execute the process; a program that calls
    # main(argv) may have patched modules in this process that a fresh interpreter would lose
    may_reexec = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, parser, argv if may_reexec else None)
    if args.command == "bench":
        missing = getattr(args, "bench_missing", None)
        if missing is not None:
            print(f"pagedserve bench is not available in this installation ({missing})", file=sys.stderr)
            return 2
        from pagedserve.bench import cli as bench_cli

        return bench_cli.main(args)
    parser.print_help()
    return 2


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser, reexec_argv: list[str] | None) -> int:
    from pagedserve.entrypoints.cli_args import server_config_from_args
    from pagedserve.entrypoints.malloc_env import reexec_with_huge_page_malloc

    try:
        config = server_config_from_args(args)  # flag errors before anything heavy happens
    except ValueError as exc:
        parser.error(str(exc))
    if reexec_argv is not None:
        reexec_with_huge_page_malloc(reexec_argv)  # weights on huge pages; returns if already so (or not wanted)
    from pagedserve.entrypoints.launcher import run_server
    from pagedserve.models.registry import ModelLoadError

    try:
        return run_server(config)
    except ModelLoadError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pagedserve: cannot serve on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
