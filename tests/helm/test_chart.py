"""The kv-epp Helm chart, rendered by the real Helm v4 engine (helm-python-sdk, no cluster).

Each test renders the chart with a value set a platform team would use and checks the manifests
that Kubernetes would receive: ports, probes, arguments, RBAC, security context, the config file
kv-epp reads, and that the schema and the templates refuse bad values with a message naming them.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from pyhelpers import require_modules  # noqa: E402

helm_python, yaml = require_modules(helm_python="helm-python-sdk", yaml="PyYAML")
CHART = ROOT / "deploy" / "helm" / "kv-epp"
GATEWAY = ROOT / "deploy" / "gateway"
RELEASE = "llama"
NAMESPACE = "ai"
FULLNAME = "llama-kv-epp"

# The one value the chart cannot default: which pods are the model servers.
BASE = {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm-llama"}}}}
# The peers section of the rendered config by default: the peer Service, and a Lease per release
# deciding which replica drains TensorRT-LLM's HTTP event queues.
PEERS = {
    "service": f"{FULLNAME}-peers",
    "coordination": "lease",
    "lease_name": f"{FULLNAME}-drains",
    "lease_duration_seconds": 10,
    "lease_renew_ms": 2000,
}


def merged(*overrides: dict) -> dict:
    """BASE with each override merged in (nested dicts merge, everything else replaces)."""

    def merge(into: dict, top: dict) -> dict:
        for key, value in top.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = copy.deepcopy(value)
        return into

    out = copy.deepcopy(BASE)
    for o in overrides:
        merge(out, o)
    return out


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(str(CHART)) as c:
        yield c


class Rendered:
    """The manifests of one render, indexed by kind and name."""

    def __init__(self, files: dict[str, str]):
        self.notes = files.get("kv-epp/templates/NOTES.txt", "")
        self.docs = [
            doc
            for name, text in files.items()
            if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text)
            if doc
        ]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    @property
    def container(self) -> dict:
        return self.one("Deployment")["spec"]["template"]["spec"]["containers"][0]

    @property
    def pod(self) -> dict:
        return self.one("Deployment")["spec"]["template"]["spec"]

    @property
    def config(self) -> dict:
        return yaml.safe_load(self.one("ConfigMap")["data"]["config.yaml"])


def render(chart, values: dict) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE))


def render_error(chart, values: dict) -> str:
    with pytest.raises(helm_python.HelmError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(err.value)


# --- lint and defaults ------------------------------------------------------------------------


def test_lint_is_clean(chart):
    report = helm_python.lint(str(CHART), BASE, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == [], serious


def test_default_values_satisfy_the_schema(chart):
    chart.validate_schema(chart.values)


def test_defaults_need_the_model_server_labels(chart):
    message = render_error(chart, {})
    assert "inferencePool.modelServers.matchLabels is required" in message


def test_defaults_render_the_picker_and_its_pool(chart):
    r = render(chart, BASE)
    assert r.kinds() == sorted(
        [
            "ConfigMap",
            "Deployment",
            "InferencePool",
            "NetworkPolicy",
            "Role",
            "RoleBinding",
            "Secret",  # peer token
            "Secret",  # salt fingerprint key
            "Secret",  # admin token
            "Secret",  # peer TLS
            "Service",
            "Service",
            "ServiceAccount",
        ]
    )
    for doc in r.docs:
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert len(doc["metadata"]["name"]) <= 63
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert "InferencePool \"llama\"" in r.notes


def test_service_ports_and_app_protocols(chart):
    r = render(chart, BASE)
    ports = {p["name"]: p for p in r.one("Service", FULLNAME)["spec"]["ports"]}
    assert {n: (p["port"], p.get("appProtocol")) for n, p in ports.items()} == {
        "grpc-ext-proc": (9002, "http2"),
        "grpc-health": (9003, "grpc"),
        "http-metrics": (9090, "http"),
        "peer": (9004, "grpc"),
    }, "the admin API is not on the Service by default"
    container_ports = {p["name"]: p["containerPort"] for p in r.container["ports"]}
    for p in ports.values():
        assert container_ports[p["targetPort"]] == p["port"]
    assert container_ports["admin"] == 9091, "kubectl port-forward reaches the container port"


def test_admin_port_on_the_service_when_asked(chart):
    r = render(chart, merged({"inferenceExtension": {"admin": {"service": True}, "adminPort": 9191}}))
    ports = {p["name"]: p for p in r.one("Service", FULLNAME)["spec"]["ports"]}
    assert (ports["admin"]["port"], ports["admin"]["targetPort"], ports["admin"]["appProtocol"]) == (9191, "admin", "http")


def test_headless_peer_service_lists_every_replica(chart):
    r = render(chart, BASE)
    peers = r.one("Service", f"{FULLNAME}-peers")["spec"]
    assert peers["clusterIP"] == "None"
    assert peers["publishNotReadyAddresses"] is True
    assert [(p["name"], p["port"]) for p in peers["ports"]] == [("peer", 9004)]
    deployment_labels = r.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert peers["selector"].items() <= deployment_labels.items()
    assert r.config["peers"] == PEERS


def test_probes_use_grpc_health_service_names(chart):
    c = render(chart, BASE).container
    assert c["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert c["startupProbe"]["grpc"] == {"port": 9003, "service": "liveness"}


def test_args_follow_the_kv_epp_cli(chart):
    assert render(chart, BASE).container["args"] == [
        "serve",
        "--config-file=/etc/kv-epp/config.yaml",
        "--pool-name=llama",
        "--pool-namespace=ai",
        "--grpc-port=9002",
        "--grpc-health-port=9003",
        "--metrics-port=9090",
        "--admin-port=9091",
        "--peer-port=9004",
        "--peer-token-file=/var/run/secrets/kv-epp/peer-auth/token",
        "--admin-token-file=/var/run/secrets/kv-epp/admin-auth/token",
        "--peer-cert-path=/var/run/secrets/kv-epp/peer-tls",
        "--secure-serving",
    ]


def test_extra_flags_follow_the_chart_flags(chart):
    flags = {"log-format": "json", "verbose": True, "quiet": False, "scrape-batch": 1000000, "ratio": 0.5}
    args = render(chart, merged({"inferenceExtension": {"flags": flags}})).container["args"]
    # Helm ranges over a map in key order.
    assert args[-4:] == ["--log-format=json", "--ratio=0.5", "--scrape-batch=1000000", "--verbose"]
    assert not any(a.startswith("--quiet") for a in args)


def test_namespace_and_pod_identity_come_from_the_downward_api(chart):
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in render(chart, BASE).container["env"]}
    assert env == {"NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name", "POD_IP": "status.podIP"}


def test_security_context_is_locked_down(chart):
    r = render(chart, BASE)
    sc = r.container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    pod_sc = r.pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Writable scratch space exists because the root filesystem is read-only.
    mounts = {m["name"]: m for m in r.container["volumeMounts"]}
    assert mounts["tmp"]["mountPath"] == "/tmp"
    assert all(m.get("readOnly") for n, m in mounts.items() if n != "tmp")


def test_replicas_spread_over_nodes_by_default(chart):
    affinity = render(chart, BASE).pod["affinity"]["podAntiAffinity"]
    term = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    hard = render(chart, merged({"inferenceExtension": {"podAntiAffinity": "hard"}})).pod["affinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard["podAntiAffinity"]
    assert "affinity" not in render(chart, merged({"inferenceExtension": {"podAntiAffinity": "none"}})).pod


# --- RBAC ----------------------------------------------------------------------------------


def test_rbac_is_read_only_and_namespaced(chart):
    r = render(chart, BASE)
    assert r.one("Role")["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io", "inference.networking.x-k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    ]
    binding = r.one("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    assert r.pod["serviceAccountName"] == FULLNAME
    assert r.all("ClusterRole") == [] and r.all("ClusterRoleBinding") == []


def test_metrics_auth_adds_only_the_two_reviews(chart):
    r = render(
        chart,
        merged(
            {
                "inferenceExtension": {
                    "monitoring": {
                        "interval": "15s",
                        "prometheus": {"enabled": True, "auth": {"enabled": True, "secretName": "scraper-token"}},
                    }
                }
            }
        ),
    )
    assert r.one("ClusterRole")["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ]
    crb = r.one("ClusterRoleBinding")
    assert crb["roleRef"]["name"] == r.one("ClusterRole")["metadata"]["name"]
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    endpoint = r.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["port"] == "http-metrics" and endpoint["interval"] == "15s"
    assert endpoint["authorization"]["credentials"] == {"name": "scraper-token", "key": "token"}
    assert r.config["server"]["metrics_auth"] is True


def test_service_monitor_scrapes_the_metrics_port(chart):
    r = render(chart, merged({"inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}}}))
    sm = r.one("ServiceMonitor")
    assert sm["spec"]["endpoints"] == [{"port": "http-metrics", "path": "/metrics", "scheme": "http", "interval": "10s"}]
    assert sm["spec"]["selector"]["matchLabels"].items() <= r.one("Service", FULLNAME)["metadata"]["labels"].items()
    assert "metrics_auth" not in r.config["server"]
    assert r.all("ClusterRole") == []


# --- replicas ------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 3])
def test_replicas_and_disruption_budget(chart, replicas):
    r = render(chart, merged({"inferenceExtension": {"replicas": replicas}}))
    assert r.one("Deployment")["spec"]["replicas"] == replicas
    pdbs = r.all("PodDisruptionBudget")
    if replicas == 1:
        assert pdbs == []
    else:
        (pdb,) = pdbs
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"] == r.one("Deployment")["spec"]["selector"]


# --- the config file ---------------------------------------------------------------------------

FULL_CONFIG = {
    "server": {"bind_address": "::", "max_concurrent_streams": 256, "keepalive_interval_ms": 0, "keepalive_timeout_ms": 5000, "io_threads": 2},
    "routing": {
        "max_body_bytes": 8388608,
        "max_inflight_per_worker": 32,
        "retry_after_seconds": 2,
        "fallbacks": 0,
        "unknown_model": "reject",
        "conformance_hooks": True,
        "stream_idle_timeout_ms": 15000,
        "max_buffered_body_bytes": 134217728,
        "decision_threads": 4,
        "large_body_decision_threads": 1,
        "unrenderable": "reject",
    },
    "scoring": {
        "prefix_weight": 4.5,
        "queue_weight": 1.0,
        "kv_usage_weight": 0.5,
        "offload_credit": 0.25,
        "queue_scale": 8.0,
        "temperature": 0.1,
        "max_fallbacks": 1,
    },
    "salt": {"sources": ["header"], "required": True},
    "index": {"capacity": 1000000, "max_blocks_per_worker": 200000},
    "models": [
        {
            "name": "meta-llama/Llama-3.1-8B-Instruct",
            "block_size": 16,
            "lora_adapters": ["support-bot", "sql-bot"],
            "tokenizer": {"path": "/tokenizers/llama-3.1-8b", "max_word_bytes": 131072},
        },
        {"name": "Qwen/Qwen3-0.6B", "block_size": 32, "max_prompt_tokens": 40960},
    ],
    "events": {"engine": "", "zmq": {"port": 6000, "replay_port": 0, "topic": "kv"}, "trtllm": {"poll_interval_ms": 100}},
    "workers": [{"endpoint": "10.0.0.11:8000", "model": "Qwen/Qwen3-0.6B", "dp_rank": 1}],
}
TOKENIZERS = {"volume": {"persistentVolumeClaim": {"claimName": "tokenizers", "readOnly": True}}, "mountPath": "/tokenizers"}


def test_config_file_matches_the_values(chart):
    r = render(chart, merged({"config": FULL_CONFIG, "inferenceExtension": {"tokenizers": TOKENIZERS}}))
    cfg = r.config
    for section in ("routing", "scoring", "index", "models", "workers"):
        assert cfg[section] == FULL_CONFIG[section], section
    assert cfg["salt"] == {
        "sources": ["header"],
        "required": True,
        "fingerprint_key_file": "/var/run/secrets/kv-epp/salt/fingerprint-key",
    }
    assert cfg["server"] == {
        "bind_address": "::",
        "grpc_port": 9002,
        "grpc_health_port": 9003,
        "metrics_port": 9090,
        "secure_serving": True,
        "max_concurrent_streams": 256,
        "keepalive_interval_ms": 0,
        "keepalive_timeout_ms": 5000,
        "io_threads": 2,
    }
    assert cfg["pool"] == {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "api_version": "v1",
        "model_label": "kv-epp.io/model",
        "api_unreachable_timeout_ms": 30000,
    }
    assert cfg["events"] == {"engine": "vllm", "zmq": {"port": 6000, "replay_port": 0, "topic": "kv"}}
    # The file is mounted where --config-file points.
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "config")
    assert f"--config-file={mount['mountPath']}/config.yaml" in r.container["args"]
    assert next(v for v in r.pod["volumes"] if v["name"] == "config")["configMap"]["name"] == FULLNAME


def test_default_config_sections_match_the_example_config_file(chart):
    """Drift check: the chart's config defaults carry the same keys and values as the documented
    example (deploy/examples/kv-epp.yaml) for the sections config.rs reads."""
    example = yaml.safe_load((ROOT / "deploy" / "examples" / "kv-epp.yaml").read_text())
    cfg = render(chart, BASE).config
    for section in ("routing", "flow_control", "scoring", "index"):
        assert set(cfg[section]) >= set(example[section]), section
        for key, value in example[section].items():
            assert cfg[section][key] == value, f"{section}.{key}"
    assert cfg["salt"]["sources"] == example["salt"]["sources"]
    assert cfg["salt"]["required"] == example["salt"]["required"]
    for key in (
        "grpc_port",
        "grpc_health_port",
        "metrics_port",
        "bind_address",
        "max_concurrent_streams",
        "keepalive_interval_ms",
        "keepalive_timeout_ms",
        "io_threads",
    ):
        assert str(cfg["server"][key]) == str(example["server"][key]), key


def test_config_change_rolls_the_pods(chart):
    def checksum(values):
        return render(chart, values).one("Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(BASE) == checksum(BASE)
    assert checksum(BASE) != checksum(merged({"config": {"scoring": {"temperature": 0.5}}}))


def test_tokenizer_volume_is_mounted_read_only(chart):
    r = render(chart, merged({"config": FULL_CONFIG, "inferenceExtension": {"tokenizers": TOKENIZERS}}))
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "tokenizers")
    assert mount == {"name": "tokenizers", "mountPath": "/tokenizers", "readOnly": True}
    volume = next(v for v in r.pod["volumes"] if v["name"] == "tokenizers")
    assert volume["persistentVolumeClaim"] == {"claimName": "tokenizers", "readOnly": True}
    assert "tokenizers" not in {m["name"] for m in render(chart, BASE).container["volumeMounts"]}


def test_tokenizer_path_without_a_volume_is_refused(chart):
    message = render_error(chart, merged({"config": FULL_CONFIG}))
    assert "config.models[0].tokenizer is set but inferenceExtension.tokenizers.volume is empty" in message


# --- secrets -------------------------------------------------------------------------------


def test_generated_secrets_are_mounted_as_files(chart):
    r = render(chart, BASE)
    secrets = {s["metadata"]["name"]: s for s in r.all("Secret")}
    assert set(secrets) == {
        f"{FULLNAME}-peer-auth",
        f"{FULLNAME}-salt-key",
        f"{FULLNAME}-admin-auth",
        f"{FULLNAME}-peer-tls",
    }
    assert list(secrets[f"{FULLNAME}-peer-auth"]["data"]) == ["token"]
    assert list(secrets[f"{FULLNAME}-salt-key"]["data"]) == ["fingerprint-key"]
    assert list(secrets[f"{FULLNAME}-admin-auth"]["data"]) == ["token"]
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert volumes["peer-auth"]["secret"]["secretName"] == f"{FULLNAME}-peer-auth"
    assert volumes["salt-key"]["secret"]["secretName"] == f"{FULLNAME}-salt-key"
    # Secret values never appear in the ConfigMap.
    cm = r.one("ConfigMap")["data"]["config.yaml"]
    for s in secrets.values():
        for value in s["data"].values():
            assert value not in cm


def test_existing_secrets_are_used_not_generated(chart):
    r = render(
        chart,
        merged(
            {
                "inferenceExtension": {
                    "peerAuth": {"existingSecret": "kv-epp-peers", "key": "shared"},
                    "saltFingerprintKey": {"existingSecret": "kv-epp-salt", "key": "k"},
                    "admin": {"existingSecret": "kv-epp-admin", "key": "bearer"},
                    "peerTLS": {"existingSecret": "kv-epp-peer-certs"},
                }
            }
        ),
    )
    assert r.all("Secret") == []
    volumes = {v["name"]: v["secret"] for v in r.pod["volumes"] if "secret" in v}
    assert volumes["peer-auth"] == {"secretName": "kv-epp-peers", "items": [{"key": "shared", "path": "shared"}]}
    assert volumes["salt-key"]["secretName"] == "kv-epp-salt"
    assert volumes["peer-tls"] == {"secretName": "kv-epp-peer-certs"}
    assert "--peer-token-file=/var/run/secrets/kv-epp/peer-auth/shared" in r.container["args"]
    assert r.config["salt"]["fingerprint_key_file"] == "/var/run/secrets/kv-epp/salt/k"
    assert volumes["admin-auth"] == {"secretName": "kv-epp-admin", "items": [{"key": "bearer", "path": "bearer"}]}
    assert "--admin-token-file=/var/run/secrets/kv-epp/admin-auth/bearer" in r.container["args"]


def test_admin_token_is_a_generated_secret_mounted_as_a_followed_file(chart):
    r = render(chart, BASE)
    secret = r.one("Secret", f"{FULLNAME}-admin-auth")
    assert secret["type"] == "Opaque"
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    # A fresh render draws a new token (no cluster to look up); `lookup` keeps the live one on
    # upgrade, as for the other generated Secrets.
    assert render(chart, BASE).one("Secret", f"{FULLNAME}-admin-auth")["data"] != secret["data"]
    volume = next(v for v in r.pod["volumes"] if v["name"] == "admin-auth")
    assert volume["secret"] == {"secretName": f"{FULLNAME}-admin-auth", "items": [{"key": "token", "path": "token"}]}
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "admin-auth")
    # No subPath: the kubelet then updates the file when the Secret changes, and kv-epp re-reads it.
    assert mount == {"name": "admin-auth", "mountPath": "/var/run/secrets/kv-epp/admin-auth", "readOnly": True}
    assert "--admin-token-file=/var/run/secrets/kv-epp/admin-auth/token" in r.container["args"]
    assert "admin_token_file" not in r.config["server"], "the flag carries it, as for the peer token"
    templates = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret"' in templates
    assert "Bearer $TOKEN" in r.notes and f"{FULLNAME}-admin-auth" in r.notes


# --- NetworkPolicy ---------------------------------------------------------------------------


def ingress_by_port(r: Rendered) -> dict[int, dict]:
    rules = r.one("NetworkPolicy", FULLNAME)["spec"]["ingress"]
    out = {}
    for rule in rules:
        (port,) = rule["ports"]
        assert port["protocol"] == "TCP"
        out[port["port"]] = rule
    return out


def test_network_policy_admits_each_port_only_from_who_needs_it(chart):
    r = render(chart, BASE)
    policy = r.one("NetworkPolicy", FULLNAME)["spec"]
    pod_labels = r.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"], "egress stays open (API server, engines, peers)"
    rules = ingress_by_port(r)
    assert set(rules) == {9002, 9003, 9004, 9090}, "no admin rule: the admin port is reached by port-forward"
    # ext_proc: the gateway's pods, by default every pod of the release namespace.
    assert rules[9002]["from"] == [{"podSelector": {}}]
    # Health: from anywhere (the kubelet probes from the node).
    assert "from" not in rules[9003]
    # Peers: only this release's own pods.
    assert rules[9004]["from"] == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    # Metrics: any pod of any namespace until narrowed.
    assert rules[9090]["from"] == [{"podSelector": {}, "namespaceSelector": {}}]


def test_network_policy_selectors_come_from_the_values(chart):
    gateway_ns = {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}
    gateway_pods = {"matchExpressions": [{"key": "gateway.envoyproxy.io/owning-gateway-name", "operator": "Exists"}]}
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    prometheus = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    values = merged(
        {
            "inferenceExtension": {
                "admin": {"service": True},
                "networkPolicy": {
                    "gateway": {
                        "namespaceSelector": gateway_ns,
                        "podSelector": gateway_pods,
                        "ipBlocks": [{"cidr": "10.129.0.0/23"}],
                    },
                    "metrics": {"namespaceSelector": monitoring, "podSelector": prometheus},
                    "admin": {"podSelector": {"matchLabels": {"role": "operator"}}},
                },
            }
        }
    )
    rules = ingress_by_port(render(chart, values))
    assert rules[9002]["from"] == [
        {"podSelector": gateway_pods, "namespaceSelector": gateway_ns},
        {"ipBlock": {"cidr": "10.129.0.0/23"}},
    ]
    assert rules[9090]["from"] == [{"podSelector": prometheus, "namespaceSelector": monitoring}]
    assert rules[9091]["from"] == [{"podSelector": {"matchLabels": {"role": "operator"}}}], "release namespace only"


def test_network_policy_can_be_left_out(chart):
    r = render(chart, merged({"inferenceExtension": {"networkPolicy": {"enabled": False}}}))
    assert r.all("NetworkPolicy") == []


# --- TLS -------------------------------------------------------------------------------------


def test_tls_off(chart):
    r = render(chart, merged({"inferenceExtension": {"tls": {"enabled": False}}}))
    assert not any(a.startswith(("--secure-serving", "--cert-path")) for a in r.container["args"])
    assert r.config["server"]["secure_serving"] is False
    assert "cert_path" not in r.config["server"]


def test_tls_with_a_certificate_secret(chart):
    r = render(chart, merged({"inferenceExtension": {"tls": {"enabled": True, "secretName": "picker-tls"}}}))
    args = r.container["args"]
    assert "--secure-serving" in args
    assert "--cert-path=/var/run/secrets/kv-epp/tls" in args
    assert r.config["server"]["secure_serving"] is True
    assert r.config["server"]["cert_path"] == "/var/run/secrets/kv-epp/tls"
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "tls")
    assert mount["mountPath"] == "/var/run/secrets/kv-epp/tls" and mount["readOnly"] is True
    assert next(v for v in r.pod["volumes"] if v["name"] == "tls")["secret"] == {"secretName": "picker-tls"}


def test_self_signed_tls_mounts_no_certificate(chart):
    r = render(chart, BASE)
    assert "--secure-serving" in r.container["args"]
    assert not any(a.startswith("--cert-path") for a in r.container["args"])
    assert "cert_path" not in r.config["server"]


def test_client_ca_makes_the_ext_proc_port_mutual_tls(chart):
    r = render(chart, merged({"inferenceExtension": {"tls": {"secretName": "picker-tls", "clientCA": {"secretName": "gateway-ca"}}}}))
    path = "/var/run/secrets/kv-epp/client-ca/ca.crt"
    assert f"--client-ca-path={path}" in r.container["args"]
    assert r.config["server"]["client_ca_path"] == path
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "client-ca")
    assert mount == {"name": "client-ca", "mountPath": "/var/run/secrets/kv-epp/client-ca", "readOnly": True}
    volume = next(v for v in r.pod["volumes"] if v["name"] == "client-ca")
    assert volume["secret"] == {"secretName": "gateway-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    # A self-signed server certificate with client certificates required is fine too, with any key.
    r = render(chart, merged({"inferenceExtension": {"tls": {"clientCA": {"secretName": "gateway-ca", "key": "bundle.pem"}}}}))
    assert "--client-ca-path=/var/run/secrets/kv-epp/client-ca/bundle.pem" in r.container["args"]
    # Without it, nothing is mounted and no client certificate is asked for.
    plain = render(chart, BASE)
    assert "client_ca_path" not in plain.config["server"]
    assert "client-ca" not in {m["name"] for m in plain.container["volumeMounts"]}


def peer_tls_secret(r: Rendered) -> dict[str, bytes]:
    import base64

    secret = r.one("Secret", f"{FULLNAME}-peer-tls")
    assert secret["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def mutual_handshake(files: dict[str, bytes], server_name: str, tmp_path: Path) -> None:
    """Two ends holding the same files (as two replicas do) complete a mutual TLS handshake in
    memory (Python's ssl), the client checking the server's certificate against `server_name`."""
    import ssl

    for name, data in files.items():
        (tmp_path / name).write_bytes(data)

    def context(side):
        ctx = ssl.SSLContext(side)
        ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
        ctx.load_verify_locations(tmp_path / "ca.crt")
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    client_ctx = context(ssl.PROTOCOL_TLS_CLIENT)
    server_ctx = context(ssl.PROTOCOL_TLS_SERVER)
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, end in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    assert all(done.values()), done
    assert server.getpeercert()["subjectAltName"], "the server saw the client's certificate"


def test_peer_tls_is_on_by_default_with_a_generated_certificate(chart, tmp_path):
    r = render(chart, BASE)
    assert "--peer-cert-path=/var/run/secrets/kv-epp/peer-tls" in r.container["args"]
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "peer-tls")
    assert mount == {"name": "peer-tls", "mountPath": "/var/run/secrets/kv-epp/peer-tls", "readOnly": True}
    volume = next(v for v in r.pod["volumes"] if v["name"] == "peer-tls")
    # The whole Secret (no items), so its three files are swapped together when it changes.
    assert volume["secret"] == {"secretName": f"{FULLNAME}-peer-tls"}
    files = peer_tls_secret(r)
    assert set(files) == {"tls.crt", "tls.key", "ca.crt"}
    # The name kv-epp checks under peers.service (`<service>.<pool namespace>.svc`).
    assert r.config["peers"] == PEERS
    mutual_handshake(files, f"{FULLNAME}-peers.{NAMESPACE}.svc", tmp_path)
    # Secret material never reaches the ConfigMap.
    cm = r.one("ConfigMap")["data"]["config.yaml"]
    assert "BEGIN" not in cm


def test_peer_tls_from_cert_manager(chart):
    values = {"inferenceExtension": {"peerTLS": {"certManager": {"enabled": True, "issuerRef": {"name": "kv-epp-ca", "kind": "ClusterIssuer"}}}}}
    r = render(chart, merged(values))
    cert = r.one("Certificate", f"{FULLNAME}-peer-tls")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    spec = cert["spec"]
    assert spec["secretName"] == f"{FULLNAME}-peer-tls"
    assert f"{FULLNAME}-peers.{NAMESPACE}.svc" in spec["dnsNames"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"] == {"name": "kv-epp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert (spec["duration"], spec["renewBefore"]) == ("2160h", "360h")
    assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert f"{FULLNAME}-peer-tls" not in {s["metadata"]["name"] for s in r.all("Secret")}
    volume = next(v for v in r.pod["volumes"] if v["name"] == "peer-tls")
    assert volume["secret"] == {"secretName": f"{FULLNAME}-peer-tls"}


def test_peer_tls_off(chart):
    r = render(chart, merged({"inferenceExtension": {"peerTLS": {"enabled": False}}}))
    assert not any(a.startswith("--peer-cert-path") for a in r.container["args"])
    assert "peer-tls" not in {v["name"] for v in r.pod["volumes"]}
    assert r.all("Certificate") == []
    assert f"{FULLNAME}-peer-tls" not in {s["metadata"]["name"] for s in r.all("Secret")}
    # The token still authenticates replicas.
    assert any(a.startswith("--peer-token-file=") for a in r.container["args"])


# --- InferencePool and HTTPRoute -----------------------------------------------------------


def test_inference_pool_points_at_the_picker_service(chart):
    r = render(chart, merged({"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]}}))
    pool = r.one("InferencePool", RELEASE)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"] == {"matchLabels": {"app": "vllm-llama"}}
    assert spec["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    service = r.one("Service", FULLNAME)
    ext_proc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": service["metadata"]["name"],
        "port": {"number": ext_proc["port"]},
        "failureMode": "FailClose",
    }


def test_fail_open_and_a_custom_pool_name(chart):
    r = render(chart, merged({"inferencePool": {"name": "qwen"}, "inferenceExtension": {"failureMode": "FailOpen"}}))
    pool = r.one("InferencePool", "qwen")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert "--pool-name=qwen" in r.container["args"]
    assert r.config["pool"]["name"] == "qwen"


def test_without_the_pool_the_picker_still_serves_it(chart):
    r = render(chart, {"inferencePool": {"create": False}})
    assert r.all("InferencePool") == []
    assert "--pool-name=llama" in r.container["args"]
    assert "not created by this release" in r.notes


def test_older_pool_api(chart):
    r = render(chart, merged({"inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}}))
    pool = r.one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert pool["spec"] == {
        "selector": {"app": "vllm-llama"},
        "targetPortNumber": 8000,
        "extensionRef": {"group": "", "kind": "Service", "name": FULLNAME, "portNumber": 9002, "failureMode": "FailClose"},
    }


def test_discovery_settings_follow_the_pool_and_the_values(chart):
    """kv-epp watches the API version the pool is written in (no 404 fallback guesswork), and
    the discovery keys reach the config file."""
    values = merged(
        {
            "inferencePool": {"apiVersion": "inference.networking.x-k8s.io/v1alpha2"},
            "config": {"pool": {"model_label": "example.com/model", "api_unreachable_timeout_ms": 5000}},
        }
    )
    assert render(chart, values).config["pool"] == {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "api_version": "v1alpha2",
        "model_label": "example.com/model",
        "api_unreachable_timeout_ms": 5000,
    }
    assert render(chart, BASE).config["workers"] == [], "no static workers: the pool's pods are discovered"


def test_http_route_sends_the_gateway_to_the_pool(chart):
    r = render(
        chart,
        merged({"experimentalHttpRoute": {"enabled": True, "inferenceGatewayName": "edge", "requestTimeout": "10m"}}),
    )
    route = r.one("HTTPRoute", RELEASE)["spec"]
    assert route["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge"}]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": RELEASE}]
    assert rule["timeouts"] == {"request": "10m"}
    assert render(chart, BASE).all("HTTPRoute") == []


# --- model-server types --------------------------------------------------------------------


def test_tensorrt_llm_workers_are_polled(chart):
    r = render(
        chart,
        merged(
            {
                "inferencePool": {"modelServerType": "trtllm-serve", "targetPorts": [{"number": 8000}, {"number": 8001}]},
                "config": {
                    "models": [{"name": "nvidia/Llama-3.1-8B-Instruct-FP8", "block_size": 32}],
                    "workers": [
                        {"endpoint": "10.1.0.5:8000", "model": "nvidia/Llama-3.1-8B-Instruct-FP8"},
                        {"endpoint": "10.1.0.5:8001", "model": "nvidia/Llama-3.1-8B-Instruct-FP8", "dp_rank": 1},
                    ],
                    "events": {"trtllm": {"poll_interval_ms": 50}},
                },
            }
        ),
    )
    assert r.config["events"] == {"engine": "trtllm", "trtllm": {"poll_interval_ms": 50}}
    assert [w["endpoint"] for w in r.config["workers"]] == ["10.1.0.5:8000", "10.1.0.5:8001"]
    assert r.one("InferencePool")["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]


def test_the_drain_lease_is_the_only_write_and_only_for_http_drains(chart):
    """TensorRT-LLM drained over HTTP under `coordination: lease` (the default): the Role may
    create a Lease and read and update that one Lease, nothing else; any other engine, the ZeroMQ
    transport or `coordination: probes` leaves the Role read-only."""
    lease_rules = [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [f"{FULLNAME}-drains"],
            "verbs": ["get", "update"],
        },
    ]
    trt = {"inferencePool": {"modelServerType": "trtllm-serve"}}
    r = render(chart, merged(trt, {"config": {"peers": {"lease_duration_seconds": 15, "lease_renew_ms": 3000}}}))
    rules = r.one("Role")["rules"]
    assert rules[3:] == lease_rules
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in rules[:3])
    assert r.config["peers"] == {**PEERS, "lease_duration_seconds": 15, "lease_renew_ms": 3000}
    for other in (
        {"config": {"events": {"trtllm": {"transport": "zmq"}}}},
        {"config": {"peers": {"coordination": "probes"}}},
        {"inferencePool": {"modelServerType": "vllm"}},
    ):
        r = render(chart, merged(trt, other))
        assert len(r.one("Role")["rules"]) == 3, other
    assert render(chart, merged(trt, {"config": {"peers": {"coordination": "probes"}}})).config["peers"][
        "coordination"
    ] == "probes"


def test_trtllm_over_zeromq_and_unsalted_engines(chart):
    values = {"inferencePool": {"modelServerType": "trtllm-serve"}, "config": {"events": {
        "trtllm": {"transport": "zmq"}, "salted_events": False, "zmq": {"port": 7000}}}}
    events = render(chart, merged(values)).config["events"]
    assert events["trtllm"] == {"poll_interval_ms": 100, "transport": "zmq"}
    assert events["zmq"]["port"] == 7000, "every replica subscribes on the ZeroMQ ports"
    assert events["salted_events"] is False


@pytest.mark.parametrize(
    ("server", "engine", "expected"),
    [("vllm", "", "vllm"), ("sglang", "", "sglang"), ("trtllm-serve", "", "trtllm"), ("vllm", "none", "none")],
)
def test_event_engine_follows_the_model_server(chart, server, engine, expected):
    cfg = render(chart, merged({"inferencePool": {"modelServerType": server}, "config": {"events": {"engine": engine}}})).config
    assert cfg["events"]["engine"] == expected
    assert ("zmq" in cfg["events"]) == (expected in ("vllm", "sglang"))


# --- refused values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "where", "why"),
    [
        ({"inferenceExtension": {"replicas": -1}}, "/inferenceExtension/replicas", "minimum"),
        ({"inferenceExtension": {"replicas": "three"}}, "/inferenceExtension/replicas", "want integer"),
        ({"inferencePool": {"modelServerType": "tgi"}}, "/inferencePool/modelServerType", "vllm"),
        ({"inferenceExtension": {"extProcPort": "abc"}}, "/inferenceExtension/extProcPort", "want integer"),
        ({"inferenceExtension": {"metricsPort": 70000}}, "/inferenceExtension/metricsPort", "maximum"),
        ({"inferenceExtension": {"failureMode": "Open"}}, "/inferenceExtension/failureMode", "FailClose"),
        ({"inferenceExtension": {"replica": 2}}, "/inferenceExtension", "'replica' not allowed"),
        ({"bogus": 1}, "", "'bogus' not allowed"),
        ({"inferencePool": {"targetPorts": [{"number": p} for p in range(8000, 8009)]}}, "/inferencePool/targetPorts", "maxItems"),
        ({"inferencePool": {"targetPorts": []}}, "/inferencePool/targetPorts", "minItems"),
        ({"config": {"salt": {"sources": ["cookie"]}}}, "/config/salt/sources/0", "header"),
        ({"config": {"salt": {"sources": [], "required": True}}}, "/config/salt/sources", "minItems"),
        ({"config": {"scoring": {"offload_credit": 2}}}, "/config/scoring/offload_credit", "maximum"),
        ({"config": {"scoring": {"queue_scale": 0}}}, "/config/scoring/queue_scale", "exclusiveMinimum"),
        ({"config": {"routing": {"max_body_byts": 3}}}, "/config/routing", "'max_body_byts' not allowed"),
        ({"config": {"routing": {"unknown_model": "drop"}}}, "/config/routing/unknown_model", "load_only"),
        ({"config": {"models": [{"name": "m"}]}}, "/config/models/0", "block_size"),
        ({"config": {"models": [{"name": "m", "block_size": 0}]}}, "/config/models/0/block_size", "minimum"),
        ({"config": {"workers": [{"endpoint": "vllm-0:8000", "model": "m"}]}}, "/config/workers/0/endpoint", "pattern"),
        ({"config": {"events": {"engine": "kafka"}}}, "/config/events/engine", "trtllm"),
        ({"config": {"pool": {"api_unreachable_timeout_ms": 0}}}, "/config/pool/api_unreachable_timeout_ms", "minimum"),
        ({"config": {"pool": {"model_label": ""}}}, "/config/pool/model_label", "minLength"),
        ({"config": {"pool": {"name": "x"}}}, "/config/pool", "'name' not allowed"),
        ({"config": {"peers": {"coordination": "raft"}}}, "/config/peers/coordination", "lease"),
        ({"config": {"peers": {"lease_duration_seconds": 0}}}, "/config/peers/lease_duration_seconds", "minimum"),
        ({"config": {"peers": {"service": "x"}}}, "/config/peers", "'service' not allowed"),
        ({"experimentalHttpRoute": {"requestTimeout": "forever"}}, "/experimentalHttpRoute/requestTimeout", "pattern"),
        ({"inferenceExtension": {"admin": {"service": "yes"}}}, "/inferenceExtension/admin/service", "want boolean"),
        ({"inferenceExtension": {"admin": {"secret": "x"}}}, "/inferenceExtension/admin", "'secret' not allowed"),
        (
            {"inferenceExtension": {"networkPolicy": {"gateway": {"podSelector": {"matchLabel": {"a": "b"}}}}}},
            "/inferenceExtension/networkPolicy/gateway/podSelector",
            "'matchLabel' not allowed",
        ),
        (
            {"inferenceExtension": {"networkPolicy": {"metrics": {"namespaceSelector": "monitoring"}}}},
            "/inferenceExtension/networkPolicy/metrics/namespaceSelector",
            "want null",
        ),
        (
            {"inferenceExtension": {"networkPolicy": {"gateway": {"ipBlocks": [{"cidr": "10.0.0.1"}]}}}},
            "/inferenceExtension/networkPolicy/gateway/ipBlocks/0/cidr",
            "pattern",
        ),
        ({"inferenceExtension": {"tls": {"clientCA": {"secret": "x"}}}}, "/inferenceExtension/tls/clientCA", "'secret' not allowed"),
        ({"inferenceExtension": {"peerTLS": {"enabled": "yes"}}}, "/inferenceExtension/peerTLS/enabled", "want boolean"),
        ({"inferenceExtension": {"peerTLS": {"certManager": {"issuerRef": {"kind": "Vault"}}}}}, "/inferenceExtension/peerTLS/certManager/issuerRef/kind", "Issuer"),
        ({"inferenceExtension": {"peerTLS": {"certManager": {"duration": "90 days"}}}}, "/inferenceExtension/peerTLS/certManager/duration", "pattern"),
    ],
)
def test_schema_refuses_bad_values(chart, values, where, why):
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(chart.merge_values(merged(values)))
    message = str(err.value)
    assert f"at '{where}'" in message and why in message, message
    # An install (render) refuses them the same way.
    assert f"at '{where}'" in render_error(chart, merged(values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"inferenceExtension": {"metricsPort": 9002}},
            "inferenceExtension.extProcPort and inferenceExtension.metricsPort are both 9002",
        ),
        (
            {"inferenceExtension": {"flags": {"grpc-port": 9100}}},
            "inferenceExtension.flags.grpc-port: the chart sets --grpc-port itself; use inferenceExtension.extProcPort",
        ),
        (
            {"inferenceExtension": {"flags": {"admin-token-file": "/tmp/t"}}},
            "the chart sets --admin-token-file itself; use inferenceExtension.admin",
        ),
        (
            {
                "inferencePool": {
                    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                    "targetPorts": [{"number": 8000}, {"number": 8001}],
                }
            },
            "v1alpha2 pools have a single target port",
        ),
        (
            {"inferenceExtension": {"monitoring": {"prometheus": {"enabled": True, "auth": {"enabled": True}}}}},
            "inferenceExtension.monitoring.prometheus.auth.secretName is required",
        ),
        (
            {"inferenceExtension": {"tls": {"enabled": False, "clientCA": {"secretName": "gateway-ca"}}}},
            "inferenceExtension.tls.clientCA.secretName needs inferenceExtension.tls.enabled",
        ),
        (
            {"inferenceExtension": {"peerTLS": {"certManager": {"enabled": True}}}},
            "inferenceExtension.peerTLS.certManager.issuerRef.name is required",
        ),
        (
            {"inferenceExtension": {"peerTLS": {"existingSecret": "s", "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}}},
            "inferenceExtension.peerTLS: set existingSecret or certManager.enabled, not both",
        ),
        (
            {"inferenceExtension": {"flags": {"client-ca-path": "/ca.crt"}}},
            "the chart sets --client-ca-path itself; use inferenceExtension.tls.clientCA",
        ),
        (
            {"inferenceExtension": {"flags": {"peer-cert-path": "/p"}}},
            "the chart sets --peer-cert-path itself; use inferenceExtension.peerTLS",
        ),
    ],
)
def test_templates_refuse_inconsistent_values(chart, values, message):
    assert message in render_error(chart, merged(values))


# --- the Gateway example and the image agree with the chart --------------------------------


def test_gateway_example_points_at_what_the_chart_installs(chart):
    docs = [d for f in sorted(GATEWAY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Gateway", "HTTPRoute", "InferencePool"}
    # The README installs the chart as release `llama` without its own pool.
    r = render(chart, {"inferencePool": {"create": False}})
    service = r.one("Service", FULLNAME)
    ext_proc = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    ref = by_kind["InferencePool"]["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", FULLNAME, ext_proc)
    assert by_kind["InferencePool"]["metadata"]["name"] == r.config["pool"]["name"]
    route = by_kind["HTTPRoute"]["spec"]
    assert route["parentRefs"][0]["name"] == by_kind["Gateway"]["metadata"]["name"]
    assert route["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert route["rules"][0]["backendRefs"][0]["name"] == by_kind["InferencePool"]["metadata"]["name"]
    # The same pool, as the chart would render it, matches the example.
    chart_pool = render(chart, BASE).one("InferencePool")["spec"]
    assert chart_pool["endpointPickerRef"] == ref
    assert chart_pool["selector"] == by_kind["InferencePool"]["spec"]["selector"]


def test_dockerfile_exposes_the_chart_ports(chart):
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()}
    ie = chart.values["inferenceExtension"]
    assert exposed == {ie[k] for k in ("extProcPort", "grpcHealthPort", "metricsPort", "adminPort", "peerPort")}
    assert re.search(r"^USER 65532", dockerfile, re.M), "runs as the non-root user the chart expects"


def test_dockerfile_builds_the_product_alone_from_the_whole_workspace():
    """The image builds only the `kv-epp` package (no simulator inside) and copies every file the
    workspace needs to resolve: each member listed in Cargo.toml, build.rs and proto/."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = {p.rstrip("/") for line in re.findall(r"^COPY (?!--)(.+?) \S+$", dockerfile, re.M) for p in line.split()}
    manifest = (ROOT / "Cargo.toml").read_text()
    members = re.search(r"^members = \[(.*?)\]", manifest, re.M | re.S).group(1)
    for member in re.findall(r'"([^"]+)"', members):
        top = member.split("/")[0]
        assert member == "." or top in copied, f"workspace member {member} is not copied into the image"
    for needed in ("Cargo.toml", "Cargo.lock", "build.rs", "proto", "src"):
        assert needed in copied, f"{needed} is not copied into the image"
    build = re.search(r"cargo build (.+?)\\?$", dockerfile, re.M).group(1)
    assert "-p kv-epp " in build and "--bin kv-epp" in build, build
    assert "kv-epp-sim" not in build


def helm_install_values(readme: Path) -> dict:
    """The values of the `helm install` command in a README, as Helm's --set parser reads them."""
    text = readme.read_text()
    command = re.search(r"^helm install llama deploy/helm/kv-epp(.*?)(?<!\\)\n", text, re.M | re.S)
    assert command, f"no `helm install llama deploy/helm/kv-epp` in {readme}"
    sets = re.findall(r"--set\s+('([^']*)'|(\S+))", command.group(1))
    assert sets, f"the install command in {readme} sets no values"
    return helm_python.parse_set_string(",".join(quoted or bare for _, quoted, bare in sets))


@pytest.mark.parametrize("readme", [ROOT / "README.md", GATEWAY / "README.md"], ids=["README", "gateway-README"])
def test_documented_install_commands_render(chart, readme):
    values = helm_install_values(readme)
    r = render(chart, values)
    assert r.config["models"] == [{"name": "meta-llama/Llama-3.1-8B-Instruct", "block_size": 16}]
    assert r.container["image"].startswith("registry.example.com/kv-epp/kv-epp:")


# --- the binary accepts what the chart renders ---------------------------------------------------


def kv_epp_binary() -> Path | None:
    path = os.environ.get("KV_EPP_BIN")
    if path and Path(path).exists():
        return Path(path)
    candidate = Path(__file__).resolve().parents[2] / "target" / "debug" / "kv-epp"
    return candidate if candidate.exists() else None


@pytest.mark.parametrize(
    "values",
    [
        BASE,
        merged(BASE, {"inferenceExtension": {"replicas": 3}}),
        merged(BASE, {"inferenceExtension": {"monitoring": {"prometheus": {"auth": {"enabled": True}}}}}),
        merged(BASE, {"inferencePool": {"modelServerType": "trtllm-serve"}}),
        merged(BASE, {"inferencePool": {"modelServerType": "trtllm-serve"}, "config": {"peers": {"coordination": "probes"}}}),
        merged(BASE, {"inferencePool": {"modelServerType": "sglang"}}),
        merged(BASE, {"config": {"models": [{"name": "m", "block_size": 16}]}}),
        merged(BASE, {"inferenceExtension": {"tls": {"secretName": "t", "clientCA": {"secretName": "ca"}}, "peerTLS": {"enabled": False}}}),
    ],
)
def test_rendered_args_and_config_are_accepted_by_kv_epp(chart, values, tmp_path):
    """Runs the real binary on the Deployment's arguments and the ConfigMap's file
    (`serve --validate-only`), with secret mounts replaced by temporary files."""
    import subprocess

    binary = kv_epp_binary()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kv-epp binary not built (make builds it before helm-test)")
        pytest.skip("kv-epp binary not built")
    r = render(chart, values)
    config = r.config
    key = tmp_path / "fingerprint-key"
    key.write_text("k")
    if config.get("salt", {}).get("fingerprint_key_file"):
        config["salt"]["fingerprint_key_file"] = str(key)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    token = tmp_path / "peer-token"
    token.write_text("t")
    admin_token = tmp_path / "admin-token"
    admin_token.write_text("a")
    args = []
    for a in r.container["args"]:
        if a.startswith("--config-file="):
            a = f"--config-file={config_path}"
        elif a.startswith("--peer-token-file="):
            a = f"--peer-token-file={token}"
        elif a.startswith("--admin-token-file="):
            a = f"--admin-token-file={admin_token}"
        elif a.startswith("--cert-path="):
            continue
        args.append(a)
    done = subprocess.run(
        [str(binary), *args, "--validate-only"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NAMESPACE": NAMESPACE},
    )
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    assert "configuration OK" in done.stdout
