"""Run the kvgate gateway for a benchmark or the demo: ``python -m bench.sim.gateway_proc settings.json``.

The settings file holds ``router.config.Settings`` fields; the app is ``router.app.create_app``."""
from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.sim.gateway_proc SETTINGS.json", file=sys.stderr)
        return 2
    import uvicorn

    from router.app import create_app
    from router.config import Settings

    with open(argv[0]) as f:
        settings = Settings(**json.load(f))
    # serving: the process is the gateway's, as under ``kvgate serve`` (router.app.settle_gc: start-up's
    # objects frozen out of the cycle collector). Without it the simulator's gateway paid full collections
    # of ~400K tracked objects, 0.25 s stalls of its event loop, seven in a 16-worker replay (gc.callbacks).
    app = create_app(settings, serving=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
