"""A Docker engine and a base image for building kvgate's image on machines that cannot pull from a registry.

Test scaffolding only; the shipped Dockerfile builds against the official Python image.
- :func:`ensure_engine` answers with a working ``docker`` client: it installs Debian's ``docker.io`` when no
  engine is installed (as root) and starts ``dockerd`` when no daemon answers.
- :func:`base_image` makes the stand-in for ``python:3.11-slim``: ``debootstrap --variant=minbase`` of
  Debian bookworm with python3, venv and pip, plus this host's pip configuration and CA bundle (so pip in
  the build reaches the package index exactly as the host's does), ``docker import``-ed. The root file
  system's tarball is cached under ``~/.cache/kvgate/docker-base`` and the image stays in the engine, both
  keyed by a digest of everything that goes into them.
An engine that cannot be made to answer is :class:`EngineUnavailable`; the tests skip on it loudly, or fail
under ``CI=true``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate")) / "docker-base"
MIRROR = os.environ.get("KVGATE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
PACKAGES = ["python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates"]
# Bump when the recipe below changes: it is part of the cache key.
RECIPE = "1"


class EngineUnavailable(RuntimeError):
    """No Docker engine could be installed or started here; the message says why."""


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _answers(docker: str) -> bool:
    try:
        return _run([docker, "info", "--format", "{{.ServerVersion}}"], 30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class Engine:
    """The ``docker`` client to use, and the ``dockerd`` this module started (stopped by :meth:`close`)."""

    def __init__(self, docker: str, daemon: subprocess.Popen | None = None, log: Path | None = None):
        self.docker, self.daemon, self.log = docker, daemon, log

    def run(self, *args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = _run([self.docker, *args], timeout, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def close(self) -> None:
        if self.daemon is None or self.daemon.poll() is not None:
            return
        self.daemon.terminate()
        try:
            self.daemon.wait(30)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait(10)


def _install_docker_io() -> None:
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine installed, and not root to `apt-get install docker.io`")
    if shutil.which("apt-get") is None:
        raise EngineUnavailable("no Docker engine installed, and no apt-get to install docker.io")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "docker.io"]):
        proc = _run(cmd, 900, env=env)
        if proc.returncode != 0:
            raise EngineUnavailable(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def ensure_engine(start_timeout: float = 60.0) -> Engine:
    docker = shutil.which("docker")
    if docker and _answers(docker):
        return Engine(docker)
    if shutil.which("dockerd") is None:
        _install_docker_io()
    docker = shutil.which("docker")
    dockerd = shutil.which("dockerd")
    if not docker or not dockerd:
        raise EngineUnavailable("docker.io is installed but docker/dockerd are not on PATH")
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker daemon answers, and not root to start dockerd")
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "dockerd.log"
    # Builds and runs use the host's network only, so the engine needs no bridge and no iptables rules.
    with open(log, "w") as f:
        daemon = subprocess.Popen([dockerd, "--iptables=false", "--ip6tables=false", "--bridge=none"],
                                  stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            break
        if _answers(docker):
            return Engine(docker, daemon, log)
        time.sleep(0.5)
    engine = Engine(docker, daemon, log)
    engine.close()
    tail = log.read_text(errors="replace")[-3000:]
    raise EngineUnavailable(f"dockerd did not answer within {start_timeout:.0f}s:\n{tail}")


def host_pip_files() -> list[Path]:
    """The pip configuration files and CA bundles of this host that a build's pip must see too."""
    paths = ["/etc/pip.conf", *glob.glob("/etc/xdg/pip/*"), str(Path.home() / ".config/pip/pip.conf"),
             str(Path.home() / ".pip/pip.conf"), os.environ.get("PIP_CONFIG_FILE", ""),
             "/etc/ssl/certs/ca-certificates.crt"]
    paths += [os.environ.get(v, "") for v in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")]
    try:
        out = _run([sys.executable, "-m", "pip", "config", "list"], 60).stdout
    except subprocess.TimeoutExpired:
        out = ""
    for line in out.splitlines():  # files the configuration names: cert=..., constraint=...
        _, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if value.startswith("/") and Path(value).is_file():
            paths.append(value)
    seen, files = set(), []
    for p in paths:
        if p and Path(p).is_file() and p not in seen:
            seen.add(p)
            files.append(Path(p))
    return files


def host_pip_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("PIP_")}


def _key(files: list[Path], env: dict[str, str]) -> str:
    h = hashlib.sha256(f"{RECIPE} {SUITE} {MIRROR} {' '.join(PACKAGES)}".encode())
    for f in files:
        h.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    for k, v in env.items():
        h.update(f"{k}={v}\0".encode())
    return h.hexdigest()[:16]


def _debootstrap(root: Path, files: list[Path]) -> None:
    if shutil.which("debootstrap") is None:
        proc = _run(["apt-get", "install", "-y", "-q", "debootstrap"], 600,
                    env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if proc.returncode != 0:
            raise RuntimeError(f"apt-get install debootstrap failed:\n{proc.stderr[-2000:]}")
    proc = _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root),
                 MIRROR], 1800)
    if proc.returncode != 0:
        raise RuntimeError(f"debootstrap failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    for f in files:  # the host's pip configuration and CA bundle, at the same paths
        dest = root / str(f).lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    # The official Python image lets pip install into its interpreter; Debian marks its own as managed.
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (root / junk).glob("*"):
            if p.is_file():
                p.unlink()


def base_image(engine: Engine, log=print) -> str:
    """The tag of the stand-in base image, made (and cached) on first use."""
    files, env = host_pip_files(), host_pip_env()
    key = _key(files, env)
    tag = f"kvgate-test-base:{SUITE}-{key}"
    if engine.run("image", "inspect", tag, check=False).returncode == 0:
        return tag
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"{SUITE}-{key}.tar"
    if not tarball.exists():
        log(f"building the test base image with debootstrap into {tarball} (once per machine) ...")
        with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as d:
            root = Path(d) / "root"
            _debootstrap(root, files)
            part = tarball.with_suffix(".part")
            proc = _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(part), "."], 900)
            if proc.returncode != 0:
                raise RuntimeError(f"tar of the base root failed:\n{proc.stderr[-2000:]}")
            part.rename(tarball)
    changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
               *(f"ENV {k}={json.dumps(v)}" for k, v in env.items()), 'CMD ["python3"]']
    args = [a for c in changes for a in ("--change", c)]
    engine.run("import", *args, str(tarball), tag, timeout=900)
    return tag
