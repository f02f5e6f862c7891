"""Settings from a YAML file overlaid by KVGATE_* variables (router/config.py), and a bad file's errors."""
from __future__ import annotations

import pytest

from router.cli import main
from router.config import load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVGATE_CONFIG", "")  # load_settings sets it; monkeypatch puts it back


def test_yaml_file_then_environment_then_arguments(tmp_path, monkeypatch):
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("port: 9001\nrouting:\n  policy: session\n  cache_affinity: 0.2\n"
                   "workers:\n  - url: http://w0:8000\nindex:\n  backend: redis\n")
    s = load_settings(str(cfg))
    got = (s.port, s.routing.policy, s.routing.cache_affinity, s.index.backend)
    assert got == (9001, "session", 0.2, "redis")
    assert [w.url for w in s.workers] == ["http://w0:8000"] and s.host == "0.0.0.0"  # default kept
    monkeypatch.setenv("KVGATE_ROUTING__POLICY", "round_robin")
    monkeypatch.setenv("KVGATE_PORT", "9002")
    s = load_settings(str(cfg))
    # a nested variable replaces one field; the file's other fields of that section stay
    assert (s.port, s.routing.policy, s.routing.cache_affinity) == (9002, "round_robin", 0.2)
    assert load_settings(str(cfg), port=9003).port == 9003


def test_no_file_means_defaults_and_an_empty_file_too(tmp_path):
    assert load_settings().port == 8080
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert load_settings(str(empty)).routing.policy == "kv"


@pytest.mark.parametrize("text, reason", [
    ("- port: 1\n", "must be a mapping"),
    ("8080\n", "must be a mapping"),
    ("port: [1\n", "not valid YAML"),
    ("prot: 1\n", "prot"),  # an unknown key is refused, not ignored
    # below the top level too (they were accepted and did nothing)
    ("routing:\n  polcy: round_robin\n", "polcy"),
    ("workers:\n  - url: http://a:8000\n    nmae: a\n", "nmae"),
    ("g4:\n  prefetch_prot: 8200\n", "prefetch_prot"),
    ("port: many\n", "port"),
    # values that passed and broke the fleet at run time: one failed check dropped a live worker's
    # entries; a zero timeout or connection pool kept every worker unhealthy
    ("unhealthy_after: 0\n", "unhealthy_after"),
    ("health_timeout_s: 0\n", "health_timeout_s"),
    ("connect_timeout_s: -1\n", "connect_timeout_s"),
    ("max_connections: 0\n", "max_connections"),
    ("health_interval_s: .nan\n", "health_interval_s"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, capsys, text, reason):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["serve", "--config", str(bad)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kvgate serve: invalid configuration:") and reason in out, out


def test_a_missing_file_is_refused(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "no such configuration file" in capsys.readouterr().out
