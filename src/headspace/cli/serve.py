"""``headspace serve``: the OpenAI-compatible server (the work is in ``headspace.server``)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
from typing import TYPE_CHECKING

from headspace.cli.commands import COMMAND_HELP
from headspace.cli.options import (
    add_engine_options,
    add_engine_parallel_options,
    engine_options,
    memory_value,
)
from headspace.errors import UserError

if TYPE_CHECKING:
    from headspace.engine.hooks import EngineHooks

DEFAULT_BODY = "16MiB"  # a 1M-token prompt is about 4 MB of text; JSON escapes grow it


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help=COMMAND_HELP["serve"])
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: embedded model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default: 127.0.0.1; 0.0.0.0 for every interface)")  # fmt: skip
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument("--api-key", default=os.environ.get("HEADSPACE_API_KEY"),
                        help="bearer key the /v1 routes require (default: $HEADSPACE_API_KEY, "
                        "else none: open)")  # fmt: skip
    server.add_argument("--served-model-name", default=None, help="the model's name in the API "
                        "(default: the model's directory or file name)")  # fmt: skip
    server.add_argument("--max-concurrent-requests", type=int, default=64,
                        help="requests in the engine at once; more wait in a queue "
                        "(default: 64)")  # fmt: skip
    server.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting beyond those; past this a request gets 429 "
                        "(default: 256)")  # fmt: skip
    server.add_argument("--default-max-tokens", type=int, default=4096,
                        help="most new tokens of a chat request that names none "
                        "(completions: 16, as OpenAI's; default: 4096)")  # fmt: skip
    server.add_argument("--max-body-size", type=memory_value, default=DEFAULT_BODY,
                        help=f"largest request body (default: {DEFAULT_BODY})")  # fmt: skip
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGINT or SIGTERM, seconds the running requests may finish "
                        "before the rest are ended (default: 30)")  # fmt: skip
    server.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection has to send a request's headers whole, "
                        "else it is closed (default: 10)")  # fmt: skip
    server.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the start-up request (compiles, captures graphs)")  # fmt: skip
    add_engine_options(p, defaults={"progress": False, "mixed_steps": True})
    add_engine_parallel_options(p)


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        from headspace.model.source import EMBEDDED_NAME

        return EMBEDDED_NAME
    return str(args.model).rstrip("/").split("/")[-1]


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay local
        return False


def run_serve(args: argparse.Namespace, hooks: EngineHooks | None = None) -> None:
    """Load the model, warm it up, serve until interrupted (Ctrl-C / SIGTERM); ``hooks``:
    a test's seams in the engine."""
    from headspace.engine.memory import parse_memory

    for flag, least in (("max_concurrent_requests", 1), ("max_queued_requests", 0),
                        ("default_max_tokens", 1)):  # fmt: skip
        if getattr(args, flag) < least:
            raise UserError(f"--{flag.replace('_', '-')} must be an integer >= {least}, got "
                            f"{getattr(args, flag)}")  # fmt: skip
    if not 0 < args.header_timeout < float("inf"):  # (NaN too)
        raise UserError(f"--header-timeout must be > 0 seconds, got {args.header_timeout}")
    if not args.shutdown_timeout >= 0:  # (NaN too)
        raise UserError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("the API key is empty (--api-key or HEADSPACE_API_KEY): give a key, "
                        "or unset it to serve without one")  # fmt: skip
    if args.api_key is None and not _loopback(args.host):
        print(f"warning: listening on {args.host} without an API key: anyone who reaches "
              "the port can use the server (--api-key or HEADSPACE_API_KEY)",
              file=sys.stderr, flush=True)  # fmt: skip
    body_bytes = parse_memory(args.max_body_size, 0)  # a size, not a fraction
    if body_bytes < 1024:
        raise UserError(f"--max-body-size must be a size of 1KiB or more, got {args.max_body_size}")
    from headspace.api import LLM
    from headspace.server.app import ServerOptions
    from headspace.server.serve import serve

    llm = LLM(args.model, hooks=hooks, **engine_options(args))
    name = _served_name(args)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the server has shut down
        options = ServerOptions(name, args.api_key, body_bytes, args.default_max_tokens)
        serve(llm.engine, options, args.host, args.port, warm_up=args.warm_up,
              max_concurrent=args.max_concurrent_requests,
              max_queued=args.max_queued_requests,
              shutdown_timeout=args.shutdown_timeout,
              header_timeout=args.header_timeout)  # fmt: skip
    print("stopped", file=sys.stderr)
