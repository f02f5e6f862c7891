"""The Helm chart, rendered and linted by Helm's own engine (Helm v4's Go SDK via ``helm-python-sdk``; no
helm binary, no cluster), for the default values and representative overrides. Every rendered manifest is
parsed (a SafeLoader that also rejects duplicate keys, which kubectl would reject) and checked for what a
user relies on: images, probes, env, mounts, RBAC verbs, selectors matching pod labels, replicas,
securityContext, and that the rendered kvgate.yaml plus env is accepted by kvgate's own Settings.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import helm_python as helm  # helm-python-sdk (test extra): Helm v4's Go SDK through ctypes
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvgate"
RELEASE, NAMESPACE = "kv", "llm"
FULL = f"{RELEASE}-kvgate"

SCENARIOS = {
    "default": {},
    "external-redis": {"redis": {"enabled": False}, "externalRedis": {"url": "redis://redis.example:6379/2"}},
    "external-redis-secret": {
        "redis": {"enabled": False},
        "externalRedis": {"existingSecret": "redis-cred", "existingSecretKey": "url"},
    },
    "redis-persistence": {
        "redis": {"persistence": {"enabled": True, "size": "20Gi", "storageClass": "fast"}}
    },
    "discovery-by-label": {
        "config": {
            "discovery": {
                "kind": "kubernetes",
                "namespace": "inference",
                "label_selector": "app.kubernetes.io/name=vllm",
            }
        }
    },
    "g4-volume": {
        "config": {"g4": {"prefetch_port": 8200, "tier": "cephfs-a"}},  # kept beside the chart's keys
        "g4": {
            "enabled": True,
            "existingClaim": "g4-cephfs",
            "mountPath": "/mnt/g4",
            "capacityBytes": 1099511627776,
        }
    },
    "ingress-on": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "hosts": [{"host": "llm.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
            "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
        }
    },
    "autoscaling-monitoring": {
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "admin": {"existingSecret": "kvgate-admin", "existingSecretKey": "admin-token"},
    },
    "static-workers": {
        "replicaCount": 1,
        "image": {"tag": "0.1.0-rc1"},
        "config": {
            "workers": [
                {
                    "url": "http://vllm-0.vllm:8000",
                    "name": "vllm-0",
                    "events_endpoint": "tcp://vllm-0.vllm:5557",
                    # documented per-worker settings the schema used to refuse
                    "max_num_batched_tokens": 4096,
                    "prefetch_url": "http://vllm-0.vllm:8200",
                    "g4_tier": "cephfs-a",
                }
            ]
        },
    },
}


class StrictLoader(yaml.SafeLoader):
    """yaml.safe_load semantics, but a duplicated mapping key is an error (the API server's decoder and
    kubectl reject them; PyYAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


class Rendered:
    def __init__(self, files: dict[str, str]) -> None:
        self.notes = files.pop("kvgate/templates/NOTES.txt", "")
        self.docs: list[dict] = []
        for name, text in files.items():
            for doc in yaml.load_all(text, Loader=StrictLoader):
                if doc:
                    doc["__file__"] = name
                    self.docs.append(doc)

    def kinds(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.kinds(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind} {name}: {[d['metadata']['name'] for d in self.kinds(kind)]}"
        return found[0]

    def gateway(self) -> dict:
        return self.one("Deployment", FULL)

    def container(self) -> dict:
        return self.gateway()["spec"]["template"]["spec"]["containers"][0]

    def env(self) -> dict[str, dict]:
        return {e["name"]: e for e in self.container()["env"]}

    def config(self) -> dict:
        return yaml.safe_load(self.one("ConfigMap", FULL)["data"]["kvgate.yaml"])


def render(chart, values: dict) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


def _selected(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- every value set ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lints_clean(scenario):
    report = helm.lint(str(CHART), SCENARIOS[scenario], strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and report["messages"] == [], report
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_manifests_are_well_formed_and_selectors_match_pods(chart, scenario):
    r = render(chart, SCENARIOS[scenario])
    assert r.docs
    for d in r.docs:
        assert d["apiVersion"] and d["kind"], d["__file__"]
        name = d["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) and len(name) <= 63, name
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    workloads = r.kinds("Deployment") + r.kinds("StatefulSet")
    pod_labels = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads}
    for w in workloads:
        assert _selected(w["spec"]["selector"]["matchLabels"], pod_labels[w["metadata"]["name"]])
    # Each Service selects the pods of exactly one workload: the gateway's never reaches Redis.
    for svc in r.kinds("Service"):
        hits = [n for n, labels in pod_labels.items() if _selected(svc["spec"]["selector"], labels)]
        expected = FULL + "-redis" if svc["metadata"]["name"].endswith("-redis") else FULL
        assert hits == [expected], (svc["metadata"]["name"], hits)
        named_ports = {
            p["name"]
            for w in workloads
            if w["metadata"]["name"] in hits
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        assert all(p["targetPort"] in named_ports for p in svc["spec"]["ports"])
    for pdb in r.kinds("PodDisruptionBudget"):
        assert [
            n for n, lb in pod_labels.items() if _selected(pdb["spec"]["selector"]["matchLabels"], lb)
        ] == [FULL]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_pod_is_hardened_and_probed(chart, scenario):
    r = render(chart, SCENARIOS[scenario])
    pod = r.gateway()["spec"]["template"]["spec"]
    c = r.container()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["args"] == ["--config", "/etc/kvgate/kvgate.yaml"]
    assert set(c["resources"]["requests"]) == {"cpu", "memory"} and set(c["resources"]["limits"]) == {
        "cpu",
        "memory",
    }
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Read-only root: /tmp is an emptyDir, the config a ConfigMap, and caches point into /tmp.
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert (
        volumes[mounts["/etc/kvgate"]["name"]]["configMap"]["name"] == FULL
        and mounts["/etc/kvgate"]["readOnly"]
    )
    assert r.env()["HF_HOME"]["value"].startswith("/tmp/")
    assert r.env()["HOME"]["value"] == "/tmp"
    assert re.fullmatch(
        r"[0-9a-f]{64}", r.gateway()["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_config_and_env_are_accepted_by_kvgate(chart, scenario, tmp_path, monkeypatch):
    """Feed the ConfigMap's kvgate.yaml and the pod's env to kvgate's own Settings, as the pod would."""
    from router.config import load_settings

    r = render(chart, SCENARIOS[scenario])
    secrets = {s["metadata"]["name"]: s["data"] for s in r.kinds("Secret")}
    path = tmp_path / "kvgate.yaml"
    path.write_text(r.one("ConfigMap", FULL)["data"]["kvgate.yaml"])
    for key in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(key)
    for name, e in r.env().items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            if ref["name"] in secrets:  # rendered by the chart
                monkeypatch.setenv(name, base64.b64decode(secrets[ref["name"]][ref["key"]]).decode())
            else:  # an existing Secret the user provides
                monkeypatch.setenv(name, f"<{ref['name']}/{ref['key']}>")
    s = load_settings(str(path))
    assert s.port == 8080 and s.host == "0.0.0.0"
    assert s.index.backend == "redis"  # the replicas share one index
    assert s.admin.token  # never an open admin API
    assert s.discovery.namespace in (NAMESPACE, "inference")
    values = SCENARIOS[scenario]
    if values.get("redis", {}).get("enabled") is False:
        ext = values["externalRedis"]
        assert s.index.redis_url == ext.get("url") or s.index.redis_url == f"<{ext['existingSecret']}/url>"
    else:
        assert s.index.redis_url == f"redis://{FULL}-redis:6379/0"


# ---- defaults and each override --------------------------------------------------------------------------


def test_defaults(chart):
    r = render(chart, {})
    dep = r.gateway()
    assert dep["spec"]["replicas"] == 2
    assert r.container()["image"] == "ghcr.io/kvgate/kvgate:0.1.0"  # appVersion
    # In-chart Redis, no persistence: an emptyDir and no claim templates.
    sts = r.one("StatefulSet", f"{FULL}-redis")
    assert sts["spec"]["replicas"] == 1 and "volumeClaimTemplates" not in sts["spec"]
    redis_pod = sts["spec"]["template"]["spec"]
    assert redis_pod["volumes"] == [{"name": "data", "emptyDir": {}}]
    args = redis_pod["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "no"
    # The index's keys are whole hashes and id maps: never let Redis evict them.
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis_pod["containers"][0]["image"] == "redis:7.4-alpine"
    assert redis_pod["securityContext"]["runAsNonRoot"] is True
    assert redis_pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert r.one("Service", f"{FULL}-redis")["spec"]["ports"][0]["port"] == 6379
    # Redis has no password: only the gateway pods may connect.
    np = r.one("NetworkPolicy", f"{FULL}-redis")
    redis_labels = sts["spec"]["template"]["metadata"]["labels"]
    gateway_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert _selected(np["spec"]["podSelector"]["matchLabels"], redis_labels)
    assert not _selected(np["spec"]["podSelector"]["matchLabels"], gateway_labels)
    (rule,) = np["spec"]["ingress"]
    assert _selected(rule["from"][0]["podSelector"]["matchLabels"], gateway_labels)
    assert not _selected(rule["from"][0]["podSelector"]["matchLabels"], redis_labels)
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    # Admin token: generated into the chart's Secret and passed by reference.
    secret = r.one("Secret", f"{FULL}-admin")
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    assert r.env()["KVGATE_ADMIN__TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULL}-admin",
        "key": "token",
    }
    # Static discovery: no API access at all.
    assert not r.kinds("Role") and not r.kinds("RoleBinding")
    assert r.one("ServiceAccount")["automountServiceAccountToken"] is False
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert r.one("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert not r.kinds("Ingress") and not r.kinds("HorizontalPodAutoscaler") and not r.kinds("ServiceMonitor")
    assert r.one("Service", FULL)["spec"]["type"] == "ClusterIP"
    assert "--kv-events-config" in r.notes and "--enable-prompt-tokens-details" in r.notes


def test_helm_test_hook_probes_the_service(chart, tmp_path):
    r = render(chart, {})
    pod = r.one("Pod", f"{FULL}-test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert c["image"] == r.container()["image"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    code = c["command"][2]
    assert f"http://{FULL}:8080/health" in code
    compile(code, "helm-test", "exec")  # what `python -c` will run
    svc = r.one("Service", FULL)
    assert not _selected(svc["spec"]["selector"], pod["metadata"]["labels"])


def test_config_change_rolls_the_pods(chart):
    a = render(chart, {}).gateway()["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    b = render(chart, {"config": {"routing": {"policy": "round_robin"}}}).gateway()
    assert b["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != a


def test_external_redis(chart):
    r = render(chart, SCENARIOS["external-redis"])
    assert not r.kinds("StatefulSet") and [s["metadata"]["name"] for s in r.kinds("Service")] == [FULL]
    assert not r.kinds("NetworkPolicy")
    assert r.env()["KVGATE_INDEX__REDIS_URL"]["value"] == "redis://redis.example:6379/2"
    r = render(chart, SCENARIOS["external-redis-secret"])
    assert r.env()["KVGATE_INDEX__REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-cred",
        "key": "url",
    }


def test_redis_persistence(chart):
    sts = render(chart, SCENARIOS["redis-persistence"]).one("StatefulSet")
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    pod = sts["spec"]["template"]["spec"]
    assert "volumes" not in pod
    args = pod["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"


def test_kubernetes_discovery_rbac(chart):
    r = render(chart, SCENARIOS["discovery-by-label"])
    role = r.one("Role")
    assert role["metadata"]["namespace"] == "inference"  # where the vLLM pods are
    rules = {(tuple(x["apiGroups"]), tuple(x["resources"])): sorted(x["verbs"]) for x in role["rules"]}
    assert rules == {
        (("discovery.k8s.io",), ("endpointslices",)): ["get", "list", "watch"],
        (("",), ("pods",)): ["get"],
    }
    binding = r.one("RoleBinding")
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = r.one("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = r.gateway()["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True and sa["automountServiceAccountToken"] is True
    cfg = r.config()["discovery"]
    assert cfg["kind"] == "kubernetes" and cfg["label_selector"] == "app.kubernetes.io/name=vllm"
    assert 'kvgate.io/events-endpoint: "tcp://*:5557"' in r.notes


def test_discovery_defaults_to_the_release_namespace(chart):
    r = render(chart, {"config": {"discovery": {"kind": "kubernetes"}}})
    assert r.one("Role")["metadata"]["namespace"] == NAMESPACE
    assert r.config()["discovery"]["namespace"] == NAMESPACE


def _json_args(text: str, flag: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(re.escape(flag) + r"[ =]'(\{.*?\})'", text)]


# Field names of vLLM's KVEventsConfig and KVTransferConfig (extra="forbid": unknown keys fail vLLM's start).
KV_EVENTS_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}
KV_TRANSFER_KEYS = {
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_role",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
}


def check_vllm_snippet(text: str, g4_path: str | None) -> None:
    events = _json_args(text, "--kv-events-config")
    assert events, "no --kv-events-config"
    for e in events:
        assert set(e) <= KV_EVENTS_KEYS and e["enable_kv_cache_events"] is True and e["publisher"] == "zmq"
        assert e["endpoint"].startswith("tcp://*:") and e["replay_endpoint"].startswith("tcp://*:")
    assert "--enable-prompt-tokens-details" in text
    if g4_path is None:
        return
    transfers = _json_args(text, "--kv-transfer-config")
    assert transfers, "no --kv-transfer-config"
    for t in transfers:
        assert set(t) <= KV_TRANSFER_KEYS
        assert (
            t["kv_connector"] == "KvgateConnector" and t["kv_connector_module_path"] == "cache_tier.connector"
        )
        assert t["kv_role"] == "kv_both" and t["kv_load_failure_policy"] == "recompute"
        assert t["kv_connector_extra_config"]["g4_path"] == g4_path


def test_g4_volume(chart):
    r = render(chart, SCENARIOS["g4-volume"])
    pod = r.gateway()["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "g4")
    assert vol["persistentVolumeClaim"] == {"claimName": "g4-cephfs", "readOnly": False}
    mount = next(m for m in r.container()["volumeMounts"] if m["name"] == "g4")
    assert mount["mountPath"] == "/mnt/g4" and mount["readOnly"] is False
    # the chart sets the path and the capacity; the user's other G4 settings stay (they were dropped)
    assert r.config()["g4"] == {"prefetch_port": 8200, "tier": "cephfs-a", "path": "/mnt/g4",
                                "capacity_bytes": 1099511627776}
    check_vllm_snippet(r.notes, "/mnt/g4")
    assert "g4-cephfs" in r.notes
    # Without G4 nothing of it is rendered.
    d = render(chart, {})
    assert "g4" not in d.config() and all(
        v["name"] != "g4" for v in d.gateway()["spec"]["template"]["spec"]["volumes"]
    )
    assert "--kv-transfer-config" not in d.notes


def test_ingress(chart):
    r = render(chart, SCENARIOS["ingress-on"])
    ing = r.one("Ingress")
    assert ing["spec"]["ingressClassName"] == "nginx"
    rule = ing["spec"]["rules"][0]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    svc = r.one("Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ing["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    assert "https://llm.example.com/v1/chat/completions" in r.notes


def test_autoscaling_monitoring_and_existing_admin_secret(chart):
    r = render(chart, SCENARIOS["autoscaling-monitoring"])
    dep = r.gateway()
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    hpa = r.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULL}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    sm = r.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    services = [
        s
        for s in r.kinds("Service")
        if _selected(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in services] == [FULL]
    assert not r.kinds("Secret")  # the user's Secret is used instead
    assert r.env()["KVGATE_ADMIN__TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvgate-admin",
        "key": "admin-token",
    }


def test_static_workers_single_replica(chart):
    r = render(chart, SCENARIOS["static-workers"])
    assert r.gateway()["spec"]["replicas"] == 1
    assert not r.kinds("PodDisruptionBudget")  # one replica + minAvailable 1 would block node drains
    assert r.container()["image"] == "ghcr.io/kvgate/kvgate:0.1.0-rc1"
    assert r.config()["workers"] == SCENARIOS["static-workers"]["config"]["workers"]


# ---- bad values are rejected ----------------------------------------------------------------------------

BAD_VALUES = {
    "zero-replicas": ({"replicaCount": 0}, "/replicaCount"),
    "replicas-not-int": ({"replicaCount": "two"}, "/replicaCount"),
    "unknown-discovery": ({"config": {"discovery": {"kind": "consul"}}}, "/config/discovery/kind"),
    "no-redis-at-all": ({"redis": {"enabled": False}}, "/externalRedis"),
    "redis-url-scheme": (
        {"redis": {"enabled": False}, "externalRedis": {"url": "http://redis:6379"}},
        "/externalRedis/url",
    ),
    "g4-without-claim": ({"g4": {"enabled": True}}, "/g4/existingClaim"),
    "unknown-top-level-key": ({"replicas": 3}, "additional properties 'replicas'"),
    "chart-managed-config-key": ({"config": {"index": {"backend": "memory"}}}, "/config"),
    "bad-pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "bad-eviction-policy": ({"redis": {"maxmemoryPolicy": "lru"}}, "/redis/maxmemoryPolicy"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_rejects_bad_values(chart, case):
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as exc:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(exc.value)
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] and any(where in e for e in report["errors"])


@pytest.mark.parametrize(
    "values, message",
    [
        ({"redis": {"enabled": False}}, "set externalRedis.url or externalRedis.existingSecret"),
        ({"g4": {"enabled": True}}, "g4.enabled needs g4.existingClaim"),
    ],
)
def test_templates_guard_even_without_the_schema(tmp_path, values, message):
    """With the schema gone (helm's --skip-schema-validation) the templates still refuse to render a
    release without a shared Redis or a G4 tier without its volume. (Helm's lint mode only logs ``fail``,
    so this renders a copy of the chart without values.schema.json.)"""
    import shutil

    copy = tmp_path / "kvgate"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    with helm.Chart.load(copy) as c:
        with pytest.raises(helm.HelmRenderError) as exc:
            c.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(exc.value)


# ---- docs ------------------------------------------------------------------------------------------------


def _container_args_in_yaml_blocks(text: str) -> list[list[str]]:
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        for doc in yaml.safe_load_all(block):
            spec = (
                ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
                if isinstance(doc, dict)
                else {}
            )
            found += [c.get("args") or [] for c in spec.get("containers", [])]
    return found


DOCS = ["README.md", "helm/kvgate/README.md", "docs/kubernetes.md"]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_documented_helm_install_commands_render_and_lint(chart, doc):
    """The exact `helm install` commands of the docs: `--set` parsed by Helm's own parser, and the doc's
    `my-values.yaml` example where it shows one."""
    text = (ROOT / doc).read_text()
    commands = re.findall(r"helm install kvgate \./helm/kvgate([^\n]*)", text.replace("\\\n", " "))
    assert commands
    shown = re.search(r"`my-values\.yaml`.*?```yaml\n(.*?)```", text, flags=re.S)
    for cmd in commands:
        sets = re.findall(r"--set (\S+)", cmd)
        values = helm.parse_set_string(",".join(sets)) if sets else {}
        if "-f my-values.yaml" in cmd and shown:
            values = _merge(yaml.safe_load(shown.group(1)), values)
        r = render(chart, values)
        assert r.container()["image"] == "registry.example.com/kvgate:0.1.0"
        if values.get("config", {}).get("discovery", {}).get("kind") == "kubernetes":
            assert r.one("Role")
        if values.get("g4", {}).get("enabled"):
            check_vllm_snippet(r.notes, values["g4"]["mountPath"])
        report = helm.lint(str(CHART), values, strict=True)
        assert report["errors"] == [] and report["messages"] == []


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_a_valid_vllm_snippet(doc):
    text = (ROOT / doc).read_text()
    check_vllm_snippet(text, "/mnt/kvgate-g4")
    assert "kvgate.io/events-endpoint" in text and "helm install kvgate ./helm/kvgate" in text
    # The manifest examples: a flag followed by its JSON value as the next list item.
    manifests = _container_args_in_yaml_blocks(text)
    if doc.startswith("helm/"):
        assert manifests, "the chart README shows a vLLM Deployment"
    for args in manifests:
        as_shell = " ".join(f"'{a}'" if a.startswith("{") else a for a in args)
        check_vllm_snippet(as_shell, "/mnt/kvgate-g4")
