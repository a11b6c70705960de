"""``headspace serve``: the OpenAI-compatible server (the work is in ``headspace.server``)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from headspace.cli.options import (
    add_engine_options,
    add_engine_parallel_options,
    engine_options,
    memory_value,
)
from headspace.errors import UserError

DEFAULT_BODY = "16MiB"  # a 1M-token prompt is about 4 MB of text; JSON escapes grow it


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: embedded model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default: 127.0.0.1; 0.0.0.0 for every interface)")  # fmt: skip
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument("--api-key", default=None, help="bearer key the /v1 routes require "
                        "(default: none, open)")  # fmt: skip
    server.add_argument("--served-model-name", default=None, help="the model's name in the API "
                        "(default: the model's directory or file name)")  # fmt: skip
    server.add_argument("--max-concurrent-requests", type=int, default=64,
                        help="requests in the engine at once; more wait in a queue "
                        "(default: 64)")  # fmt: skip
    server.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting beyond those; past this a request gets 429 "
                        "(default: 256)")  # fmt: skip
    server.add_argument("--max-body-size", type=memory_value, default=DEFAULT_BODY,
                        help=f"largest request body (default: {DEFAULT_BODY})")  # fmt: skip
    server.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the start-up request (compiles, captures graphs)")  # fmt: skip
    add_engine_options(p, defaults={"progress": False})
    add_engine_parallel_options(p)


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return "SmolLM2-135M-Instruct"
    return str(args.model).rstrip("/").split("/")[-1]


def run_serve(args: argparse.Namespace) -> None:
    """Load the model, warm it up, serve until interrupted (Ctrl-C / SIGTERM)."""
    from headspace.engine.memory import parse_memory

    for flag in ("max_concurrent_requests", "max_queued_requests"):
        if getattr(args, flag) < (1 if flag == "max_concurrent_requests" else 0):
            raise UserError(f"--{flag.replace('_', '-')} must be a positive integer")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    body_bytes = parse_memory(args.max_body_size, 0)  # a size, not a fraction
    if body_bytes < 1024:
        raise UserError(f"--max-body-size must be a size of 1KiB or more, got {args.max_body_size}")
    from headspace.api import LLM
    from headspace.server.serve import serve

    llm = LLM(args.model, **engine_options(args))
    name = _served_name(args)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the server has shut down
        serve(llm.engine, name, args.host, args.port, api_key=args.api_key,
              max_concurrent=args.max_concurrent_requests, max_queued=args.max_queued_requests,
              max_body_bytes=body_bytes, warm_up=args.warm_up)  # fmt: skip
    print("stopped", file=sys.stderr)
