"""Ports for the servers the tests start, and a vLLM server whose port was taken while it started.

The second and third tests run a stand-in for vLLM's launcher (a script that binds the KV event port from
the command line as vLLM's engine core does, then answers /health): a real vLLM start costs over a minute
here, and what is under test is how ``VllmServer`` reacts to the bind failing, which the stand-in does for
real. That a real engine core logs "Address already in use" when its event port is taken, and then fails
with "Engine core initialization failed", was checked by hand (CI's failure of 2026-12-03).
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from bench.ports import _ephemeral_low, free_port, free_port_pair
from bench.vllm_server import VllmServer, VllmStartError


def _bind_all(port: int) -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < _ephemeral_low() for p in ports)
    for p in ports[:20]:
        _bind_all(p)
    p = free_port_pair(10000)
    assert p + 10000 < _ephemeral_low()
    _bind_all(p)
    _bind_all(p + 10000)


STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import http.server, json, os, socket, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    events = json.loads(args[args.index("--kv-events-config") + 1])
    if os.environ.get("STAND_IN_FAIL"):
        print("(EngineCore pid=1) ERROR 12-03 [core.py:1] EngineCore failed to start.")
        print("(EngineCore pid=1) ERROR 12-03 [core.py:1] ValueError: the cause, far above the tail")
        for i in range(100):
            print(f"noise {{i}}")
        sys.exit(1)
    pub = socket.socket()
    try:
        pub.bind(("0.0.0.0", int(events["endpoint"].rsplit(":", 1)[1])))
    except OSError:
        print("(EngineCore pid=1) ERROR 12-03 [core.py:1] zmq.error.ZMQError: Address already in use")
        print("RuntimeError: Engine core initialization failed. See root cause above.")
        sys.exit(1)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path) -> Path:
    path = tmp_path / "python"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_a_server_whose_event_port_was_taken_moves_to_fresh_ports(stand_in, tmp_path):
    server = VllmServer(str(tmp_path), name="stand-in", python=stand_in, workdir=tmp_path / "w")
    taken = server.events_port
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", taken))
        squatter.listen()
        try:
            server.start().wait_ready(30)
            assert server.healthy()
            assert server.events_port != taken
            assert server.port_moves == 1
            assert server.worker_config()["events_endpoint"].endswith(f":{server.events_port}")
        finally:
            server.close()


def test_a_failed_start_reports_the_engine_cores_error_from_above_the_tail(stand_in, tmp_path):
    server = VllmServer(
        str(tmp_path), name="stand-in", python=stand_in, workdir=tmp_path / "w", extra_env={"STAND_IN_FAIL": "1"}
    )
    try:
        with pytest.raises(VllmStartError, match="the cause, far above the tail") as err:
            server.start().wait_ready(30)
        assert "noise 99" in str(err.value)
        assert server.port_moves == 0
    finally:
        server.close()
