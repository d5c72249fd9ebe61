"""The `fulcrum` command line; the only place that reads env vars and configures logging."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fulcrum import __version__
from fulcrum.thread_priority import DEFAULT_COMPUTE_NICE

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MIB = 1024 * 1024
log = logging.getLogger("fulcrum.cli")


def _admin_token(flag: str | None) -> str | None:
    """The management API's token from the flag or FULCRUM_ADMIN_TOKEN; a blank one counts as
    none (a warning), since an empty Bearer token would otherwise open the API to anyone."""
    token = flag if flag is not None else os.environ.get("FULCRUM_ADMIN_TOKEN")
    if token is not None and not token.strip():
        log.warning("the admin token is empty: treated as unset (management API loopback-only)")
        return None
    return token


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_ray(args)
    import uvicorn

    from fulcrum.server.app import LOOPBACK, create_app
    from fulcrum.server.early_refusal import EarlyRefusal
    from fulcrum.server.limits import EdgeLimits, protocol_with
    from fulcrum.server.refusal_budget import RefusalBudget, RefusalGovernor
    from fulcrum.service import Service, ServiceSettings

    settings = ServiceSettings(
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        max_prompt_bytes=args.max_prompt_kb * 1024,
        drain_timeout_s=args.drain_timeout,
        load_models=tuple(args.model) if args.model else None,
        freeze_gc_after_start=True,
        memory_budget_bytes=None if args.memory_budget_mb is None else args.memory_budget_mb * MIB,
        compute_nice=args.compute_nice,
    )
    service = Service.from_repository(Path(args.repository), settings)
    app = create_app(service, admin_token=_admin_token(args.admin_token),
                     admin_open=args.host in LOOPBACK)  # fmt: skip
    limits = EdgeLimits(
        max_header_bytes=args.max_header_kb * 1024, max_headers=args.max_headers,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
    )  # fmt: skip
    budget = RefusalBudget(
        refusals_per_s=args.refusals_per_connection,
        burst=args.refusal_burst,
        refusals_per_answer=args.refusals_per_answer,
    )
    governor = (
        RefusalGovernor(budget, service.metrics.refusal_holds.inc) if budget.enabled else None
    )
    protocol = protocol_with(limits, EarlyRefusal(service), governor)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, loop="uvloop", http=protocol,
        access_log=False, log_level=args.log_level.lower(),
        timeout_keep_alive=args.keep_alive_timeout,
        timeout_graceful_shutdown=math.ceil(args.drain_timeout), lifespan="on",
    )  # fmt: skip

    class Server(uvicorn.Server):
        signalled = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.signalled:  # a second signal during the drain: stop waiting, exit now
                log.warning("second %s during shutdown: exiting now", signal.Signals(sig).name)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(128 + sig)  # as if killed by it: nothing more is drained or joined
            self.signalled = True
            service.begin_shutdown()  # readiness off at once, then uvicorn drains
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the caught signal after its drain, so a clean SIGTERM shutdown
            # would exit with status 143; ours exits 0 once the drain is done.
            previous = {s: signal.signal(s, self.handle_exit) for s in _SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    Server(config).run()
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    from fulcrum.ray.run import RayServeOptions, serve_on_ray
    from fulcrum.server.app import LOOPBACK

    return serve_on_ray(RayServeOptions(
        repository=args.repository, models=tuple(args.model or ()), host=args.host,
        port=args.port, address=args.address, admin_token=_admin_token(args.admin_token),
        admin_open=args.host in LOOPBACK, drain_timeout_s=args.drain_timeout,
        max_body_mb=args.max_body_mb,
    ))  # fmt: skip


def _examples(args: argparse.Namespace) -> int:
    from fulcrum.examples import build_examples

    names = build_examples(Path(args.directory))
    print(f"wrote {', '.join(names)} to {args.directory}")
    return 0


def _positive(kind: Callable[[str], float]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value

    return parse


def _at_least(kind: Callable[[str], float], low: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not (math.isfinite(value) and value >= low):  # NaN and inf too
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}: {text!r}")
        return value

    return parse


def _compute_nice(text: str) -> int:
    from fulcrum.errors import ConfigError
    from fulcrum.thread_priority import check_compute_nice

    try:
        return check_compute_nice(int(text))
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(f"must be an integer 0-19: {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fulcrum", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fulcrum {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("FULCRUM_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model repository over HTTP")
    serve.add_argument("--repository", required=True, help="model repository folder")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", action="append", help="load only this model (repeatable)")
    serve.add_argument("--max-body-mb", type=int, default=64, help="largest request body")
    serve.add_argument(
        "--max-prompt-kb",
        type=_positive(int),
        default=1024,
        help="largest LLM prompt (or chat messages) in KiB, refused (413) before tokenising; "
        "also at most 32 bytes per token of the model's context",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to drain "
        "on SIGTERM; requests still running then get 503 (a 2nd signal: exit now)",
    )
    serve.add_argument(
        "--max-header-kb",
        type=_positive(int),
        default=64,
        help="largest request head (request line + headers), KiB; over: 431",
    )
    serve.add_argument(
        "--max-headers",
        type=_positive(int),
        default=100,
        help="most header fields in a request; over: 431",
    )
    serve.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds from connection or first byte to the end of the headers",
    )
    serve.add_argument(
        "--body-timeout",
        type=_positive(float),
        default=30.0,
        help="seconds from the end of the headers to the end of the body",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=_positive(float),
        default=5.0,
        help="seconds an idle keep-alive connection is kept open (uvicorn's and vLLM's default "
        "5); behind a proxy or load balancer, set it above the proxy's idle timeout",
    )
    serve.add_argument(
        "--refusals-per-connection",
        type=_at_least(float, 0),
        default=8.0,
        help="refusal budget: 503s/429s with Retry-After a second one connection may be answered "
        "(after --refusal-burst) while the server refuses more than --refusals-per-answer "
        "requests per answer; past it the connection's next request is read only when the "
        "budget allows, at most Retry-After later (a client retrying at once is slowed, for "
        "free). 0: off",
    )
    serve.add_argument(
        "--refusal-burst",
        type=_at_least(int, 1),
        default=8,
        help="refusals one connection may take at once before its budget applies",
    )
    serve.add_argument(
        "--refusals-per-answer",
        type=_at_least(float, 0),
        default=4.0,
        help="connections are held only while the server refuses more than this many requests "
        "per request it answers (an open-loop 3x overload refuses about 2); 0: at any ratio",
    )
    serve.add_argument(
        "--memory-budget-mb",
        type=_positive(int),
        default=os.environ.get("FULCRUM_MEMORY_BUDGET_MB"),
        help="memory the loaded models may take together (measured at each load); a load past "
        "it first unloads the least recently used idle models (env FULCRUM_MEMORY_BUDGET_MB; "
        "default: no budget)",
    )
    serve.add_argument(
        "--compute-nice",
        type=_compute_nice,
        default=os.environ.get("FULCRUM_COMPUTE_NICE", str(DEFAULT_COMPUTE_NICE)),
        help="run the model instance threads and their runtime pools (ONNX Runtime, torch) this "
        "many nice steps (0-19) below the event loop, so 503s and health probes get a core "
        "under overload (Linux; env FULCRUM_COMPUTE_NICE; default %(default)s; 0: same priority)",
    )
    serve.add_argument("--admin-token", help="Bearer token for the management API "
                       "(required for it on a non-loopback address)")  # fmt: skip
    serve.add_argument("--ray", action="store_true", help="deploy on a Ray Serve "
                       "cluster (fulcrum-serve[ray]), a deployment per model")  # fmt: skip
    serve.add_argument("--address", help="with --ray: the cluster's address (default: start "
                       "a local one)")  # fmt: skip
    serve.set_defaults(func=_serve)

    examples = sub.add_parser("examples", help="write the example model repository")
    examples.add_argument("directory")
    examples.set_defaults(func=_examples)

    if importlib.util.find_spec("fulcrum.loadgen.cli") is not None:
        from fulcrum.loadgen.cli import register

        register(sub)
    from fulcrum.cache import calibrate_cli
    from fulcrum.tuning import profile_cli, quantize_cli, tune_cli

    for tool in (profile_cli, quantize_cli, tune_cli, calibrate_cli):
        tool.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from fulcrum.errors import FulcrumError

    try:
        return int(args.func(args))
    except FulcrumError as exc:  # a user's mistake (a missing extra, a bad config): no traceback
        print(f"fulcrum {args.command}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
