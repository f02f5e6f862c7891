"""``kvgate serve --config kvgate.yaml [--host H --port P]``: run the gateway with uvicorn."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration file (else $KVGATE_CONFIG; env KVGATE_* overrides)")
    p.add_argument("--host", help="listen address (default: settings.host)")
    p.add_argument("--port", type=int, help="listen port (default: settings.port)")
    p.add_argument("--log-level", help="uvicorn log level (default: settings.log_level)")


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn
    from pydantic import ValidationError

    from router.app import create_app
    from router.config import load_settings

    try:
        settings = load_settings(args.config)
    except (ValidationError, ValueError, OSError) as e:
        print(f"kvgate serve: invalid configuration: {e}")
        return 2
    level = args.log_level or settings.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=args.host or settings.host, port=args.port or settings.port, log_level=level,
                access_log=False, timeout_graceful_shutdown=30)
    return 0
