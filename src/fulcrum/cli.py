"""The `fulcrum` command line; the only place that reads env vars and configures logging."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fulcrum import __version__

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from fulcrum.server.app import LOOPBACK, create_app
    from fulcrum.service import Service, ServiceSettings

    settings = ServiceSettings(
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        drain_timeout_s=args.drain_timeout,
        load_models=tuple(args.model) if args.model else None,
    )
    service = Service.from_repository(Path(args.repository), settings)
    token = args.admin_token or os.environ.get("FULCRUM_ADMIN_TOKEN")
    app = create_app(service, admin_token=token, admin_open=args.host in LOOPBACK)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, loop="uvloop", http="httptools",
        access_log=False, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=int(args.drain_timeout), lifespan="on",
    )  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
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


def _examples(args: argparse.Namespace) -> int:
    from fulcrum.examples import build_examples

    names = build_examples(Path(args.directory))
    print(f"wrote {', '.join(names)} to {args.directory}")
    return 0


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
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain")
    serve.add_argument("--admin-token", help="Bearer token for the management API "
                       "(required for it on a non-loopback address)")  # fmt: skip
    serve.set_defaults(func=_serve)

    examples = sub.add_parser("examples", help="write the example model repository")
    examples.add_argument("directory")
    examples.set_defaults(func=_examples)

    if importlib.util.find_spec("fulcrum.loadgen.cli") is not None:
        from fulcrum.loadgen.cli import register

        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
