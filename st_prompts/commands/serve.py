"""``st-prompts serve``: an OpenAI-compatible embedding server for a model or a prompt bank, with search.

    st-prompts serve my-bank                                     # http://127.0.0.1:8000/v1/embeddings, model = a task
    st-prompts serve my-bank --index docs=docs.index --port 9000  # and POST /search over an index
    st-prompts serve minilm --index docs=milvus:./docs.db#docs     # over a collection (st-prompts index export)
    ST_PROMPTS_ADMIN_TOKEN=... st-prompts serve my-bank          # with the admin endpoint (add/remove sets, reload)

Rows of every task share forward passes (a bank's per-row prompt sets); see docs/serving.md. Needs the ``serve``
extra (``pip install -e ".[serve]"``). Models load as every command loads them: nothing that ships with a model runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from st_prompts.commands._numbers import finite_float, int_range, positive_float, positive_int
from st_prompts.commands.options import add_dtype_argument, cli_text
from st_prompts.errors import ConfigurationError

#: The longest URL a server can take (httptools' URL parser; st_prompts.serving.protocol.MAX_URL_BYTES, kept here so
#: that ``--help`` imports no server code).
MAX_URL_BYTES = 65_535
#: The environment variable that holds the admin token (the admin endpoint exists only with a token).
ADMIN_TOKEN_ENV = "ST_PROMPTS_ADMIN_TOKEN"
#: The shortest admin token accepted.
MIN_TOKEN_LENGTH = 16


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve embeddings over HTTP (OpenAI-compatible), every task of a bank in shared batches",
        description=cli_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL_OR_BANK", help="a model or prompt bank folder, a hub id, or 'minilm'")
    parser.add_argument("--index", action="append", default=[], metavar="NAME=PATH",
                        help="serve the index folder PATH (st-prompts index build) as NAME on POST /search, or a "
                        "collection exported by 'st-prompts index export': PATH = milvus:FILE.db#COLLECTION or "
                        "http://HOST:PORT#COLLECTION; repeat for several")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                        "only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int_range(0, 65535), default=8000,
                        help="port (default 8000; 0: a free one, printed)")
    parser.add_argument("--model-name", help="the name a model that is not a prompt bank is served under (default: "
                        "the folder's name)")
    parser.add_argument("--device", help="device to encode on (default: sentence-transformers' choice)")
    parser.add_argument("--threads", type=positive_int(4096),
                        help="torch threads (per worker; default: torch's choice, with workers: cores // workers)")
    parser.add_argument("--workers", type=int_range(1, 256), default=1,
                        help="server processes forked after the model loads, sharing its weights and the port; "
                        "prompt-set changes reach every worker (CPU only; default 1; docs/serving.md)")
    parser.add_argument("--devices", type=_device_list, default=(), metavar="DEVICE,DEVICE,...",
                        help="one worker per device (e.g. cuda:0,cuda:1; cpu,cpu on the CPU), each started (not "
                        "forked) and loading the model onto its device, behind the same port; prompt-set changes "
                        "reach every worker. Not with --device or --workers (docs/serving.md)")
    parser.add_argument("--quantize", choices=("none", "int8"), default="none",
                        help="int8: the backbone's linear layers in int8 on the CPU, prompt sets unchanged "
                        "(1.2x the throughput measured, STS within 0.31 points; docs/serving.md); default none")
    add_dtype_argument(parser)
    batching = parser.add_argument_group("batching")
    batching.add_argument("--max-wait-ms", type=finite_float(0, 60_000), default=2.0,
                          help="the longest a row waits for others to share its forward pass (default 2)")
    batching.add_argument("--max-batch-tokens", type=positive_int(1 << 24), help="padded tokens (rows x longest row) "
                          "per forward pass (default: 4096 on a CPU; on a GPU 256 a row of --max-batch-rows)")
    batching.add_argument("--max-batch-rows", type=positive_int(1 << 16), help="rows per forward pass (default: 64 on "
                          "a CPU; on a GPU the fewest rows within 10%% of the best rate, measured at start)")
    batching.add_argument("--pass-overhead-tokens", type=finite_float(0, 1e6),
                          help="what a forward pass costs beyond its padded tokens, in tokens: the batcher splits "
                          "queued rows by length into the passes that cost least (default: measured at start)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-queue-rows", type=positive_int(1 << 24), default=4096,
                        help="rows waiting, all requests together (with workers: each worker takes an equal share); "
                        "beyond, 503 with Retry-After (default 4096)")
    limits.add_argument("--max-inputs", type=positive_int(1 << 20), default=2048,
                        help="inputs per request (default 2048)")
    limits.add_argument("--max-input-chars", type=positive_int(1 << 26), default=20_000,
                        help="characters per input (default 20000)")
    limits.add_argument("--max-body-bytes", type=positive_int(1 << 30), default=4 * 1024 * 1024,
                        help="bytes per request body (default 4 MiB)")
    limits.add_argument("--max-k", type=positive_int(100_000), default=100, help="hits per search query (default 100)")
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help=f"file holding the admin token (default: ${ADMIN_TOKEN_ENV}); without a token there is "
                        "no admin endpoint")
    parser.add_argument("--drain-timeout", type=finite_float(0, 86_400), default=30.0, help="on SIGTERM, seconds to "
                        "finish the requests in flight, at most, whatever clients do (default 30)")
    connections = parser.add_argument_group("connections (a client that stalls is dropped)")
    connections.add_argument("--header-timeout", type=positive_float(3600), default=10.0,
                             help="seconds for a request's headers to arrive, from its first byte (default 10)")
    connections.add_argument("--body-timeout", type=positive_float(3600), default=30.0,
                             help="seconds for a request's body to arrive after its headers; also the longest a "
                             "client may leave its answer unread (default 30)")
    connections.add_argument("--idle-timeout", type=positive_float(3600), default=5.0,
                             help="seconds a connection may stay open without a request (default 5)")
    connections.add_argument("--max-connections", type=positive_int(1_000_000), default=1000,
                             help="connections open at once, in the whole server (all workers together); more are "
                             "answered 503 and closed (default 1000)")
    connections.add_argument("--max-header-bytes", type=int_range(1024, 1 << 20), default=64 * 1024, help="bytes of a "
                             "request's line and headers (1 KiB to 1 MiB); more are answered 431 (default 65536)")
    connections.add_argument("--max-headers", type=int_range(1, 10_000), default=100,
                             help="header fields of a request; more are answered 431 (default 100)")
    connections.add_argument("--max-url-bytes", type=int_range(64, MAX_URL_BYTES), default=32 * 1024,
                             help=f"bytes of a request's URL (at most {MAX_URL_BYTES}); longer: 414 (default 32768)")
    parser.set_defaults(func=run_serve)


def _device_list(text: str) -> tuple[str, ...]:
    """``--devices``: comma-separated device names (checked against this machine when the server starts)."""
    devices = tuple(part.strip() for part in text.split(","))
    if not all(devices) or len(devices) > 256:
        raise argparse.ArgumentTypeError(f"takes 1 to 256 comma-separated devices (cpu, cuda:0, ...), got {text!r}")
    return devices


def _indexes(values: list[str]) -> list[tuple[str, str]]:
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path or "/" in name:
            raise ConfigurationError(f"--index takes NAME=PATH (a name without '/'), got {value!r}")
        if name in out:
            raise ConfigurationError(f"--index {name!r} is given twice")
        out[name] = path
    return list(out.items())


def admin_token(path: str | None) -> str | None:
    """The admin token: read from ``path`` (``--admin-token-file``), else ``$ST_PROMPTS_ADMIN_TOKEN``; ``None`` when
    neither gives one; a one-line error when it cannot be read or is too short."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read --admin-token-file {path}: {exc.strerror or exc}") from exc
        source = f"--admin-token-file {path}"
    else:
        token = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
        source = f"${ADMIN_TOKEN_ENV}"
    if not token:
        if path is not None:
            raise ConfigurationError(f"{source} is empty")
        return None
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise ConfigurationError(f"the admin token in {source} must be at least {MIN_TOKEN_LENGTH} characters "
                                 "without spaces")
    return token


def run_serve(args: argparse.Namespace) -> int:
    try:
        import st_prompts.serving.app  # noqa: F401 - starlette, orjson, prometheus_client
        from st_prompts.serving.limits import ServingLimits
        from st_prompts.serving.protocol import ConnectionGuard
        from st_prompts.serving.server import ServerOptions, run_server
    except ImportError as exc:  # the optional extra is missing
        raise ConfigurationError(f"st-prompts serve needs the serve extra ({exc.name} is missing): "
                                 "pip install -e \".[serve]\"") from exc

    def given(options_class) -> dict:  # the command line's value of each field it has an option for
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(options_class) if hasattr(args, f.name)}

    try:
        limits = ServingLimits(**given(ServingLimits))
    except ValueError as exc:
        raise ConfigurationError(f"--{str(exc).replace('_', '-')}") from exc
    options = ServerOptions(**given(ServerOptions), indexes=_indexes(args.index), limits=limits,
                            guard=ConnectionGuard(**given(ConnectionGuard)),
                            admin_token=admin_token(args.admin_token_file))
    return run_server(options)
