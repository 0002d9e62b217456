"""deploy/: Kubernetes, Istio, Envoy Gateway and InferencePool manifests, alerts and the dashboard.

Nothing here talks to a cluster. What is checked, and how:
- every manifest against the schema of its kind: Kubernetes core/apps/policy from the
  kubernetes-json-schema set (v1.33, strict), CRDs from their upstream openAPIV3Schema vendored in
  deploy/schemas/crds (strict: unknown fields are errors, as with `kubectl --validate=strict`);
- the Envoy configuration inside the Istio EnvoyFilter and the Envoy Gateway policies, applied to a
  stand-in of the generated listener/cluster and run through the real `envoy --mode validate`;
- that those Envoy blocks are the ones envoy/envoy.yaml ships (same ext_proc settings, same health
  check the shutdown announce period is derived from);
- the service and publisher YAML in the ConfigMaps with the project's own loaders;
- the names that must agree across files (clusters, Services, ports, probes, grace periods);
- the alert rules with `promtool check rules` / `promtool test rules`, and every metric named by an
  alert or a dashboard panel against the metrics the service and the publisher really register.
Each validator has a negative test showing it rejects a broken input.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from extproc.config import config_from_dict
from extproc.publishers import load_publisher_config
from extproc.publishers.engines import ENGINE_METRICS
from extproc.publishers.metrics import PublisherMetrics
from extproc.settings import (
    DEFAULT_PUBLISH_INTERVAL_S,
    DEFAULT_SHUTDOWN_ANNOUNCE_S,
    ENVOY_EXTPROC_HC_INTERVAL_S,
    ENVOY_EXTPROC_HC_TIMEOUT_S,
    ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD,
    ConfigError,
)
from extproc.telemetry import Metrics
from extproc.telemetry.metrics import PLUGIN_FIGURES
from extproc_lab.stack import ENVOY_DIR, ext_proc_filter, find_envoy, load_envoy_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
# envoy-gateway/mtls: an optional overlay with its own kustomization, not listed by its parent.
MANIFEST_DIRS = [
    "kubernetes",
    "istio",
    "envoy-gateway",
    "envoy-gateway/mtls",
    "inference-extension",
    "monitoring",
]

HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


# -- loading ------------------------------------------------------------------------------------------
def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    return sorted(
        p for d in MANIFEST_DIRS for p in (DEPLOY / d).glob("*.yaml") if p.name != "kustomization.yaml"
    )


def all_manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in manifest_files():
        for doc in load_all(path):
            yield path, doc


def one(folder: str, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for p in (DEPLOY / folder).glob("*.yaml")
        if p.name != "kustomization.yaml"
        for d in load_all(p)
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{folder}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kustomize_namespace(folder: str) -> str | None:
    return yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text()).get("namespace")


def namespace_of(folder: str, doc: dict[str, Any]) -> str:
    ns = doc["metadata"].get("namespace") or kustomize_namespace(folder)
    assert ns, f"{folder}: {doc['kind']} {doc['metadata']['name']} has no namespace"
    return ns


def service_config(folder: str, configmap: str) -> tuple[dict[str, Any], Any]:
    raw = yaml.safe_load(one(folder, "ConfigMap", configmap)["data"]["llm-extproc.yaml"])
    return raw, config_from_dict(raw)


# -- schemas ------------------------------------------------------------------------------------------
K8S = json.loads((SCHEMAS / "kubernetes-v1.33-strict.json").read_text())
OBJECT_META = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def to_json_schema(node: Any) -> Any:
    """A CRD's openAPIV3Schema as JSON Schema, strict like the API server's field validation: an
    object that lists its properties accepts no others unless it preserves unknown fields."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key.startswith("x-kubernetes-") or key in ("nullable", "default", "format"):
            continue
        elif key == "pattern" and value.startswith("^(?i)"):
            out[key] = "(?i)^" + value[5:]  # Go's RE2 takes a flag group anywhere, Python only first
        else:
            out[key] = value
    # OpenAPI 3.0's boolean exclusiveMaximum/Minimum are numbers in JSON Schema 2020-12.
    for bound, limit in (("exclusiveMaximum", "maximum"), ("exclusiveMinimum", "minimum")):
        if out.get(bound) is True:
            out[bound] = out.pop(limit)
        elif out.get(bound) is False:
            out.pop(bound)
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((SCHEMAS / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        schema = to_json_schema(crd["openAPIV3Schema"])
        props = schema.setdefault("properties", {})
        api = f"{crd['group']}/{crd['version']}"
        props["apiVersion"] = {"const": api}
        props["kind"] = {"const": crd["kind"]}
        props["metadata"] = OBJECT_META
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
        out[(api, crd["kind"])] = {"$defs": K8S["$defs"], **schema}
    return out


CRDS = crd_schemas()


def schema_for(doc: dict[str, Any]) -> dict[str, Any]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        return CRDS[key]
    kind = K8S["kinds"].get(f"{key[0]}/{key[1]}")
    assert kind is not None, f"no vendored schema for {key}"
    return {"$defs": K8S["$defs"], **kind}


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema_for(doc))
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)
    ]


# -- 1. every file parses, every manifest matches its schema -------------------------------------------
def test_every_yaml_parses_and_kustomizations_list_every_file() -> None:
    for folder in MANIFEST_DIRS:
        kust = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
        assert kust["kind"] == "Kustomization"
        listed = set(kust.get("resources", []))
        listed |= {f for g in kust.get("configMapGenerator", []) for f in g.get("files", [])}
        present = {p.name for p in (DEPLOY / folder).iterdir() if p.suffix in (".yaml", ".json")}
        assert listed <= present, f"{folder}: kustomization names missing files {listed - present}"
        assert present - {"kustomization.yaml"} <= listed, (
            f"{folder}: not in kustomization: {present - listed}"
        )
    for path in manifest_files():
        docs = load_all(path)
        assert docs, path
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(d, id=f"{p.parent.name}/{p.name}:{d['kind']}/{d['metadata']['name']}")
        for p, d in all_manifests()
    ],
)
def test_manifest_matches_its_schema(doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == []


def test_vendored_crd_schemas_cover_every_custom_kind() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for _, d in all_manifests()}
    custom = {k for k in kinds if f"{k[0]}/{k[1]}" not in K8S["kinds"]}
    assert custom, "expected CRD-based manifests"
    assert custom == set(CRDS), "every custom kind has a vendored schema, every vendored schema is used"
    for schema in CRDS.values():
        jsonschema.Draft202012Validator.check_schema({k: v for k, v in schema.items() if k != "$defs"})


def _breakages() -> list[tuple[str, Any]]:
    """One broken copy of a manifest per vendored schema: the validation must reject each."""

    def deployment(d: dict[str, Any]) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = "two"

    def service(d: dict[str, Any]) -> None:
        d["spec"]["ports"][0]["port"] = "grpc"

    def configmap(d: dict[str, Any]) -> None:
        d["data"]["max_body_bytes"] = 16

    def pdb(d: dict[str, Any]) -> None:
        d["spec"]["minAvaliable"] = 1

    def envoyfilter(d: dict[str, Any]) -> None:
        d["spec"]["configPatches"][0]["patch"]["operation"] = "INSERT_BEFOR"

    def destinationrule(d: dict[str, Any]) -> None:
        d["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequest"] = 10

    def httproute(d: dict[str, Any]) -> None:
        d["spec"]["rules"][0]["matches"][0]["headers"][0]["type"] = "Prefix"

    def eep(d: dict[str, Any]) -> None:
        d["spec"]["extProc"][0]["processingMode"]["request"]["body"] = "FullDuplex"

    def epp(d: dict[str, Any]) -> None:
        d["spec"]["jsonPatches"][0]["type"] = "type.googleapis.com/envoy.config.listener.v3.Listenr"

    def refgrant(d: dict[str, Any]) -> None:
        del d["spec"]["from"][0]["namespace"]

    def pool(d: dict[str, Any]) -> None:
        d["spec"]["endpointPickerRef"]["failureMode"] = "FailClosed"

    def smon(d: dict[str, Any]) -> None:
        d["spec"]["endpoints"][0]["interval"] = "15 seconds"

    def prule(d: dict[str, Any]) -> None:
        d["spec"]["groups"][0]["rules"][0]["for"] = "2 minutes"

    def peerauth(d: dict[str, Any]) -> None:
        d["spec"]["mtls"]["mode"] = "STRICTLY"

    def authz(d: dict[str, Any]) -> None:
        source = d["spec"]["rules"][0]["from"][0]["source"]
        source["principal"] = source.pop("principals")

    def btls(d: dict[str, Any]) -> None:
        d["spec"]["validation"]["hostname"] = "LLM-extproc"

    def eproxy(d: dict[str, Any]) -> None:
        del d["spec"]["backendTLS"]["clientCertificateRef"]["name"]

    def meta(d: dict[str, Any]) -> None:
        d["metadata"]["lables"] = {"a": "b"}

    return [
        ("kubernetes/Deployment/llm-extproc", deployment),
        ("kubernetes/Service/llm-extproc", service),
        ("kubernetes/ConfigMap/llm-extproc-config", configmap),
        ("kubernetes/PodDisruptionBudget/llm-extproc", pdb),
        ("istio/EnvoyFilter/llm-extproc", envoyfilter),
        ("istio/DestinationRule/llm-extproc", destinationrule),
        ("istio/HTTPRoute/llm", httproute),
        ("istio/PeerAuthentication/llm-extproc", peerauth),
        ("istio/AuthorizationPolicy/llm-extproc", authz),
        ("envoy-gateway/EnvoyExtensionPolicy/llm-extproc", eep),
        ("envoy-gateway/EnvoyPatchPolicy/llm-extproc", epp),
        ("envoy-gateway/ReferenceGrant/llm-extproc-from-llm", refgrant),
        ("envoy-gateway/mtls/BackendTLSPolicy/llm-extproc", btls),
        ("envoy-gateway/mtls/EnvoyProxy/llm-gateway", eproxy),
        ("inference-extension/InferencePool/vllm-llama", pool),
        ("monitoring/ServiceMonitor/llm-extproc", smon),
        ("monitoring/PrometheusRule/llm-extproc", prule),
        ("inference-extension/InferencePool/vllm-llama", meta),
    ]


@pytest.mark.parametrize(
    ("where", "breaker"), _breakages(), ids=[f"{w}:{b.__name__}" for w, b in _breakages()]
)
def test_schema_validation_rejects_a_broken_manifest(where: str, breaker: Any) -> None:
    folder, kind, name = where.rsplit("/", 2)
    doc = copy.deepcopy(one(folder, kind, name))
    assert schema_errors(doc) == []
    breaker(doc)
    assert schema_errors(doc), f"{where}: the broken copy ({breaker.__name__}) was accepted"


# -- 2. the service and publisher configs, and the names that must agree ------------------------------
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


@pytest.mark.parametrize(
    ("folder", "deployment", "configmap", "routing", "release_on"),
    [
        ("kubernetes", "llm-extproc", "llm-extproc-config", "cluster", "access_log"),
        ("inference-extension", "llm-extproc-epp", "llm-extproc-epp-config", "endpoint", "stream_end"),
    ],
)
def test_service_deployment_matches_its_config(
    folder: str, deployment: str, configmap: str, routing: str, release_on: str
) -> None:
    raw, cfg = service_config(folder, configmap)
    assert raw["routing"] == routing
    assert cfg.release_on == release_on
    assert cfg.listen.startswith("0.0.0.0:") and cfg.metrics_listen.startswith("0.0.0.0:")
    dep = one(folder, "Deployment", deployment)
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert dep["spec"]["replicas"] >= 2
    # The config file the container reads is the one the ConfigMap provides.
    assert c["args"][:2] == ["serve", "--config"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == configmap
    assert c["args"][2] == f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}"
    assert volume["configMap"]["items"][0]["key"] == "llm-extproc.yaml"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": port_of(cfg.listen), "metrics": port_of(cfg.metrics_listen)}
    # Ready = /serving (what gRPC health says too; SIGTERM turns it not ready), over HTTP on the metrics
    # port: the kubelet has no client certificate for a gRPC port that requires one (`tls:`).
    assert c["readinessProbe"]["httpGet"] == {"path": "/serving", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "grpc" not in c["livenessProbe"], "a draining replica is NOT_SERVING on purpose"
    # The Redis password comes from the Secret the shipped Redis requires (redis.yaml).
    env = {e["name"]: e for e in c["env"]}
    assert env["LLM_EXTPROC_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == REDIS_SECRET
    # Only the gateway reaches the gRPC port, only Prometheus the metrics port.
    policy = one(folder, "NetworkPolicy", deployment)
    assert policy["spec"]["podSelector"] == dep["spec"]["selector"]
    rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert set(rules) == {"grpc", "metrics"}
    assert all(f["podSelector"]["matchLabels"] for f in rules["grpc"]), "never every pod of a namespace"
    # Alive = the event loop turns (/healthz on the metrics port; /metrics would answer from its thread
    # even with the loop stuck).
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # Kubernetes must not SIGKILL before announce + drain are over.
    assert pod["terminationGracePeriodSeconds"] >= cfg.shutdown_announce_s + cfg.shutdown_grace_s + 3
    assert cfg.shutdown_announce_s >= DEFAULT_SHUTDOWN_ANNOUNCE_S
    # Non-root, read-only, no privileges.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"requests", "limits"} <= c["resources"].keys()
    # The Service in front of it exposes exactly those ports, by name, as gRPC on the routing port.
    svc = one(folder, "Service", deployment)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    sports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert {n: p["targetPort"] for n, p in sports.items()} == {"grpc": "grpc", "metrics": "metrics"}
    assert sports["grpc"]["appProtocol"] == "grpc"


def test_config_loaders_reject_a_broken_config(tmp_path: Path) -> None:
    raw, _ = service_config("kubernetes", "llm-extproc-config")
    with pytest.raises(ConfigError):
        config_from_dict({**raw, "release_on": "response_end"})
    text = one("kubernetes", "ConfigMap", "llm-extproc-config")["data"]["publisher.yaml"]
    bad = tmp_path / "publisher.yaml"
    bad.write_text(text.replace("192.0.2.10:8000", "vllm-a:8000"))
    with pytest.raises(ConfigError):
        load_publisher_config(str(bad))


def test_publisher_config_loads_and_names_the_service_clusters(tmp_path: Path) -> None:
    path = tmp_path / "publisher.yaml"
    path.write_text(one("kubernetes", "ConfigMap", "llm-extproc-config")["data"]["publisher.yaml"])
    pub = load_publisher_config(str(path))
    assert pub.interval_s == DEFAULT_PUBLISH_INTERVAL_S  # the interval the benches measure
    _, cfg = service_config("kubernetes", "llm-extproc-config")
    assert {i.cluster for i in pub.instances} <= set(cfg.pool.cluster_names())
    assert pub.redis.url == cfg.fleet.url and pub.redis.pool == cfg.fleet.pool
    dep = one("kubernetes", "Deployment", "llm-extproc-publisher")
    c = container(dep)
    assert c["args"] == ["publish", "--config", "/etc/llm-extproc/publisher.yaml"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": port_of(pub.metrics_listen)}
    # Placeholder addresses: it must not start publishing DOWN snapshots for them by itself.
    assert dep["spec"]["replicas"] == 0
    assert all(i.address.startswith("192.0.2.") for i in pub.instances)


REDIS_SECRET = {"name": "llm-extproc-redis", "key": "password"}


def test_the_shipped_redis_requires_the_password_its_clients_read() -> None:
    redis = container(one("kubernetes", "Deployment", "redis"))
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == REDIS_SECRET
    # One ACL user with that password, limited to the llm-extproc:* keys and channels; no default user
    # (tests/test_redis_acl.py runs a redis-server with these very arguments under the service).
    args = redis["args"]
    assert " ".join(args[args.index("--user") : args.index("--user") + 3]) == "--user default off"
    user = args[args.index("llm-extproc") - 1 : args.index("llm-extproc") + 4]
    assert user == ["--user", "llm-extproc", "on", ">$(REDIS_PASSWORD)", "~llm-extproc:*"]
    publisher = container(one("kubernetes", "Deployment", "llm-extproc-publisher"))
    env = {e["name"]: e for e in publisher["env"]}
    assert env["LLM_EXTPROC_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == REDIS_SECRET
    # Only the service, the publisher and the endpoint picker reach Redis.
    policy = one("kubernetes", "NetworkPolicy", "redis")
    allowed = {
        f["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for f in policy["spec"]["ingress"][0]["from"]
    }
    assert allowed == {"llm-extproc", "llm-extproc-publisher", "llm-extproc-epp"}


def test_redis_urls_point_at_the_shipped_redis_service() -> None:
    _, cfg = service_config("kubernetes", "llm-extproc-config")
    redis = one("kubernetes", "Service", "redis")
    host = f"{redis['metadata']['name']}.{namespace_of('kubernetes', redis)}.svc.cluster.local"
    port = redis["spec"]["ports"][0]["port"]
    _, epp = service_config("inference-extension", "llm-extproc-epp-config")
    for url in (cfg.fleet.url, epp.fleet.url):
        assert url == f"redis://llm-extproc@{host}:{port}/0"  # the ACL user; its password from the env


# -- 3. the gateway manifests point at the service and route on its decisions -------------------------
def llm_extproc_service() -> tuple[str, str, int]:
    svc = one("kubernetes", "Service", "llm-extproc")
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    return svc["metadata"]["name"], namespace_of("kubernetes", svc), grpc["port"]


def istio_cluster_name() -> str:
    name, ns, port = llm_extproc_service()
    return f"outbound|{port}||{name}.{ns}.svc.cluster.local"


@pytest.mark.parametrize("folder", ["istio", "envoy-gateway"])
def test_httproute_has_a_rule_per_pool_cluster_and_a_catch_all(folder: str) -> None:
    _, cfg = service_config("kubernetes", "llm-extproc-config")
    route = one(folder, "HTTPRoute", "llm")
    by_header: dict[str, list[str]] = {}
    catch_all = []
    for rule in route["spec"]["rules"]:
        headers = [h for m in rule["matches"] for h in m.get("headers", [])]
        backends = [b["name"] for b in rule["backendRefs"]]
        assert rule["timeouts"] == {"request": "0s"}, "generations outlive any route timeout"
        if not headers:
            catch_all.append(backends)
            continue
        (header,) = headers
        assert header["name"] == "x-llm-destination-cluster" and header.get("type", "Exact") == "Exact"
        by_header[header["value"]] = backends
    assert set(by_header) == set(cfg.pool.cluster_names())
    assert route["spec"]["rules"][-1]["matches"][0].get("headers") is None
    assert catch_all == [sorted({b for bs in by_header.values() for b in bs})]


def test_istio_resources_target_the_llm_extproc_service() -> None:
    name, ns, port = llm_extproc_service()
    ef = one("istio", "EnvoyFilter", "llm-extproc")
    patches = ef["spec"]["configPatches"]
    ext_proc = patches[0]["patch"]["value"]["typed_config"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == istio_cluster_name()
    access_log = patches[1]["patch"]["value"]["typed_config"]["access_log"][0]["typed_config"]
    assert access_log["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == istio_cluster_name()
    assert patches[2]["match"]["cluster"] == {"service": f"{name}.{ns}.svc.cluster.local", "portNumber": port}
    assert one("istio", "DestinationRule", "llm-extproc")["spec"]["host"] == f"{name}.{ns}.svc.cluster.local"
    gateway = one("istio", "HTTPRoute", "llm")["spec"]["parentRefs"][0]
    assert ef["spec"]["workloadSelector"]["labels"] == {
        "gateway.networking.k8s.io/gateway-name": gateway["name"]
    }
    assert ef["metadata"]["namespace"] == gateway["namespace"]


def test_envoy_gateway_resources_target_the_llm_extproc_service() -> None:
    name, ns, port = llm_extproc_service()
    eep = one("envoy-gateway", "EnvoyExtensionPolicy", "llm-extproc")
    (ext,) = eep["spec"]["extProc"]
    assert ext["backendRefs"] == [{"name": name, "namespace": ns, "port": port}]
    assert ext["failOpen"] is False
    route = one("envoy-gateway", "HTTPRoute", "llm")
    assert eep["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    assert eep["metadata"]["namespace"] == route["metadata"]["namespace"]
    grant = one("envoy-gateway", "ReferenceGrant")
    assert grant["metadata"]["namespace"] == ns
    assert grant["spec"]["from"] == [
        {
            "group": "gateway.envoyproxy.io",
            "kind": "EnvoyExtensionPolicy",
            "namespace": eep["metadata"]["namespace"],
        }
    ]
    assert grant["spec"]["to"] == [{"group": "", "kind": "Service", "name": name}]
    patch = one("envoy-gateway", "EnvoyPatchPolicy", "llm-extproc")
    gateway = route["spec"]["parentRefs"][0]
    assert patch["metadata"]["namespace"] == gateway["namespace"]
    assert patch["spec"]["targetRef"]["name"] == gateway["name"]
    for jp in patch["spec"]["jsonPatches"]:
        assert jp["name"] == f"{gateway['namespace']}/{gateway['name']}/http"


def test_istio_mesh_mtls_admits_only_the_gateway_to_the_grpc_port() -> None:
    """PeerAuthentication STRICT and an ALLOW AuthorizationPolicy on the llm-extproc pods: only the
    identity of the gateway the HTTPRoute attaches to may open gRPC streams; the metrics port stays
    plaintext for Prometheus (the NetworkPolicy limits who). Ports are the sidecar's: container ports."""
    dep = one("kubernetes", "Deployment", "llm-extproc")
    ns = namespace_of("kubernetes", dep)
    labels = dep["spec"]["selector"]["matchLabels"]
    ports = {p["name"]: str(p["containerPort"]) for p in container(dep)["ports"]}
    pa = one("istio", "PeerAuthentication", "llm-extproc")
    assert pa["metadata"]["namespace"] == ns
    assert pa["spec"]["selector"]["matchLabels"] == labels
    assert pa["spec"]["mtls"] == {"mode": "STRICT"}
    assert pa["spec"]["portLevelMtls"] == {ports["metrics"]: {"mode": "PERMISSIVE"}}
    # Istio runs a Gateway API gateway under the ServiceAccount <name>-<gatewayClassName> (`istio`).
    gateway = one("istio", "HTTPRoute", "llm")["spec"]["parentRefs"][0]
    principal = f"cluster.local/ns/{gateway['namespace']}/sa/{gateway['name']}-istio"
    ap = one("istio", "AuthorizationPolicy", "llm-extproc")
    assert ap["metadata"]["namespace"] == ns
    assert ap["spec"]["selector"]["matchLabels"] == labels
    assert ap["spec"]["action"] == "ALLOW"
    by_port: dict[str, Any] = {}
    for rule in ap["spec"]["rules"]:
        (to,) = rule["to"]
        (port,) = to["operation"]["ports"]
        by_port[port] = rule.get("from")
    assert by_port == {ports["grpc"]: [{"source": {"principals": [principal]}}], ports["metrics"]: None}
    # The gateway's side: Istio's auto mTLS, which a `tls:` in the DestinationRule would override.
    tls = one("istio", "DestinationRule", "llm-extproc")["spec"]["trafficPolicy"].get("tls")
    assert tls in (None, {"mode": "ISTIO_MUTUAL"})


def shipped_mtls_transport() -> dict[str, Any]:
    """envoy.yaml's commented `# BEGIN mtls` transport_socket (tests/test_mtls.py runs it)."""
    lines = (ENVOY_DIR / "envoy.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# BEGIN mtls")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# END mtls")
    prefix = lines[start][: lines[start].index("#")] + "# "
    body = [line.removeprefix(prefix) for line in lines[start + 1 : end]]
    return yaml.safe_load("\n".join(body))["transport_socket"]


def test_envoy_gateway_mtls_overlay_is_optional_and_matches_the_service() -> None:
    """deploy/envoy-gateway/mtls: TLS to the llm-extproc Service with the name envoy.yaml's mTLS block
    checks, and the proxies' client certificate from an EnvoyProxy next to the Gateway."""
    name, ns, _ = llm_extproc_service()
    parent = yaml.safe_load((DEPLOY / "envoy-gateway" / "kustomization.yaml").read_text())
    assert not any("mtls" in r for r in parent["resources"]), "the overlay is opt-in"
    policy = one("envoy-gateway/mtls", "BackendTLSPolicy", "llm-extproc")
    assert policy["metadata"]["namespace"] == ns, "a BackendTLSPolicy lives with its Service"
    assert policy["spec"]["targetRefs"] == [{"group": "", "kind": "Service", "name": name}]
    (ext,) = one("envoy-gateway", "EnvoyExtensionPolicy", "llm-extproc")["spec"]["extProc"]
    assert {(b["name"], b["namespace"]) for b in ext["backendRefs"]} == {(name, ns)}
    tls = shipped_mtls_transport()["typed_config"]
    sans = tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    assert policy["spec"]["validation"]["hostname"] == tls["sni"]
    assert [s["matcher"]["exact"] for s in sans] == [tls["sni"]]
    (ca,) = policy["spec"]["validation"]["caCertificateRefs"]
    assert (ca["group"], ca["kind"]) == ("", "ConfigMap"), "Core support: a ConfigMap with ca.crt"
    proxy = one("envoy-gateway/mtls", "EnvoyProxy")
    gateway = one("envoy-gateway", "HTTPRoute", "llm")["spec"]["parentRefs"][0]
    assert (proxy["metadata"]["name"], proxy["metadata"]["namespace"]) == (
        gateway["name"],
        gateway["namespace"],
    )
    ref = proxy["spec"]["backendTLS"]["clientCertificateRef"]
    assert ref["kind"] == "Secret" and "namespace" not in ref, "a Secret next to the EnvoyProxy"


def observed_ttft_policy() -> dict[str, Any]:
    """deploy/envoy-gateway/observed-ttft's EnvoyExtensionPolicy: deploy/envoy-gateway's with the
    overlay's patch merged as kustomize merges a custom resource (a JSON merge patch; `lua` is new)."""
    policy = copy.deepcopy(one("envoy-gateway", "EnvoyExtensionPolicy", "llm-extproc"))
    patch = one("envoy-gateway/observed-ttft", "EnvoyExtensionPolicy", "llm-extproc")
    assert patch["metadata"] == policy["metadata"], "the patch names the base policy"
    assert patch["spec"].keys() == {"lua"} and "lua" not in policy["spec"]
    policy["spec"]["lua"] = copy.deepcopy(patch["spec"]["lua"])
    return policy


def test_envoy_gateway_observed_ttft_overlay_adds_the_shipped_first_byte_script() -> None:
    """deploy/envoy-gateway/observed-ttft: the base resources, the ext_proc policy with envoy.yaml's
    first-byte Lua script added (opt-in: it needs Lua extensions on in Envoy Gateway)."""
    folder = DEPLOY / "envoy-gateway" / "observed-ttft"
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kust["resources"] == [".."]
    assert [p["path"] for p in kust["patches"]] == ["first-byte.yaml"]
    assert {p.name for p in folder.iterdir()} == {"kustomization.yaml", "first-byte.yaml"}
    parent = yaml.safe_load((DEPLOY / "envoy-gateway" / "kustomization.yaml").read_text())
    assert not any("observed-ttft" in r for r in parent["resources"]), "the overlay is opt-in"
    policy = observed_ttft_policy()
    assert schema_errors(policy) == []
    (lua,) = policy["spec"]["lua"]
    assert lua["type"] == "Inline"
    assert {"inline_string": lua["inline"]} == shipped()["first_byte"]["typed_config"]["source_codes"][
        "first-byte"
    ]
    lua["type"] = "File"
    assert schema_errors(policy), "the vendored lua schema checks the source type"


def test_inference_pool_picks_through_the_llm_extproc_epp() -> None:
    pool = one("inference-extension", "InferencePool", "vllm-llama")
    svc = one("inference-extension", "Service", "llm-extproc-epp")
    ref = pool["spec"]["endpointPickerRef"]
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert (ref["name"], ref["port"]["number"], ref.get("kind", "Service")) == (
        svc["metadata"]["name"],
        grpc["port"],
        "Service",
    )
    assert ref["failureMode"] == "FailClose"
    assert svc["metadata"]["namespace"] == pool["metadata"]["namespace"], "endpointPickerRef has no namespace"
    _, cfg = service_config("inference-extension", "llm-extproc-epp-config")
    (cluster,) = cfg.pool.clusters
    assert cluster.name == pool["metadata"]["name"]
    target_ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    assert {port_of(e) for e in cluster.endpoints} <= target_ports
    route = one("inference-extension", "HTTPRoute", "llm-pool")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }


def test_servicemonitor_scrapes_the_metrics_port_of_every_service() -> None:
    smon = one("monitoring", "ServiceMonitor", "llm-extproc")
    (expr,) = smon["spec"]["selector"]["matchExpressions"]
    services = [
        ("kubernetes", one("kubernetes", "Service", "llm-extproc")),
        ("kubernetes", one("kubernetes", "Service", "llm-extproc-publisher")),
        ("inference-extension", one("inference-extension", "Service", "llm-extproc-epp")),
    ]
    names = {d["metadata"]["name"] for _, d in services}
    assert set(expr["values"]) == names == {"llm-extproc", "llm-extproc-publisher", "llm-extproc-epp"}
    assert set(smon["spec"]["namespaceSelector"]["matchNames"]) == {namespace_of(f, d) for f, d in services}
    for _, svc in services:
        assert svc["metadata"]["labels"][expr["key"]] == svc["metadata"]["name"]
        assert any(p["name"] == smon["spec"]["endpoints"][0]["port"] for p in svc["spec"]["ports"])


# -- 4. the Envoy configuration inside the Istio and Envoy Gateway resources ---------------------------
def run_envoy(bootstrap: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def proto_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """Protobuf Merge, which Istio's EnvoyFilter MERGE uses: messages merge, lists append."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            proto_merge(dst[key], value)
        elif isinstance(value, list) and isinstance(dst.get(key), list):
            dst[key].extend(copy.deepcopy(value))
        else:
            dst[key] = copy.deepcopy(value)


def duration_s(text: str) -> float:
    return float(text.removesuffix("s"))


def backend_cluster(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                            }
                        }
                    ]
                }
            ],
        },
    }


def listener(name: str, hcm: dict[str, Any], default_chain: bool = False) -> dict[str, Any]:
    chain = {"filters": [{"name": HCM, "typed_config": hcm}]}
    out: dict[str, Any] = {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10080}},
    }
    if default_chain:
        out["default_filter_chain"] = chain
    else:
        out["filter_chains"] = [chain]
    return out


def gateway_hcm(backend: str) -> dict[str, Any]:
    """What a gateway's generated connection manager has before the patches: a route and the router."""
    return {
        "@type": HCM_TYPE,
        "stat_prefix": "gateway",
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": backend}}],
                }
            ],
        },
        "access_log": [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
                },
            }
        ],
        "http_filters": [copy.deepcopy(ROUTER)],
    }


def istio_bootstrap(envoyfilter: dict[str, Any], destinationrule: dict[str, Any]) -> dict[str, Any]:
    """The EnvoyFilter patches applied the way istiod applies them, to a stand-in of the gateway's
    connection manager and of the llm-extproc cluster (an EDS cluster there, STRICT_DNS here), with
    the DestinationRule's connection pool and outlier detection in Envoy's terms."""
    hcm = gateway_hcm("outbound|8000||vllm-a.llm.svc.cluster.local")
    dr = destinationrule["spec"]["trafficPolicy"]
    pool, outlier = dr["connectionPool"], dr["outlierDetection"]
    cluster: dict[str, Any] = {
        **backend_cluster(istio_cluster_name(), 9002),
        "type": "STRICT_DNS",
        "connect_timeout": pool["tcp"]["connectTimeout"],
        "typed_extension_protocol_options": copy.deepcopy(HTTP2),
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": pool["tcp"]["maxConnections"],
                    "max_pending_requests": pool["http"]["http1MaxPendingRequests"],
                    "max_requests": pool["http"]["http2MaxRequests"],
                    "max_retries": pool["http"]["maxRetries"],
                }
            ]
        },
        "outlier_detection": {
            "split_external_local_origin_errors": outlier["splitExternalLocalOriginErrors"],
            "consecutive_local_origin_failure": outlier["consecutiveLocalOriginFailures"],
            "interval": outlier["interval"],
            "base_ejection_time": outlier["baseEjectionTime"],
            "max_ejection_percent": outlier["maxEjectionPercent"],
        },
        "upstream_connection_options": {
            "tcp_keepalive": {
                "keepalive_time": int(duration_s(pool["tcp"]["tcpKeepalive"]["time"])),
                "keepalive_interval": int(duration_s(pool["tcp"]["tcpKeepalive"]["interval"])),
            }
        },
    }
    for cp in envoyfilter["spec"]["configPatches"]:
        op, value = cp["patch"]["operation"], cp["patch"]["value"]
        if cp["applyTo"] == "HTTP_FILTER" and op == "INSERT_BEFORE":
            before = cp["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == before)
            hcm["http_filters"].insert(at, copy.deepcopy(value))
        elif cp["applyTo"] == "NETWORK_FILTER" and op == "MERGE":
            assert value["name"] == HCM
            proto_merge(hcm, value["typed_config"])
        elif cp["applyTo"] == "CLUSTER" and op == "MERGE":
            proto_merge(cluster, value)
        else:
            raise AssertionError(f"no stand-in for {cp['applyTo']} {op}")
    return {
        "static_resources": {
            "listeners": [listener("0.0.0.0_8080", hcm)],
            "clusters": [cluster, backend_cluster("outbound|8000||vllm-a.llm.svc.cluster.local", 8000)],
        }
    }


def json_patch_add(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        if last == "-":
            node.append(copy.deepcopy(value))
        else:
            node.insert(int(last), copy.deepcopy(value))
    else:
        node[last] = copy.deepcopy(value)


def eg_ext_proc_cluster_name(eep: dict[str, Any]) -> str:
    return f"envoyextensionpolicy/{eep['metadata']['namespace']}/{eep['metadata']['name']}/extproc/0"


def eg_bootstrap(eep: dict[str, Any], patch_policy: dict[str, Any]) -> dict[str, Any]:
    """Our reading of what Envoy Gateway generates for the EnvoyExtensionPolicy (ext_proc filter and
    its cluster), plus the EnvoyPatchPolicy's JSON patches applied to a stand-in listener."""
    (ext,) = eep["spec"]["extProc"]
    mode = ext["processingMode"]
    body_modes = {
        "Buffered": "BUFFERED",
        "Streamed": "STREAMED",
        "BufferedPartial": "BUFFERED_PARTIAL",
        "FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
    }
    cluster_name = eg_ext_proc_cluster_name(eep)
    filter_ = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster_name}},
            "failure_mode_allow": ext["failOpen"],
            "message_timeout": ext["messageTimeout"],
            "processing_mode": {
                "request_header_mode": "SEND" if "request" in mode else "SKIP",
                "request_body_mode": body_modes[mode["request"]["body"]],
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND" if "response" in mode else "SKIP",
                "response_body_mode": body_modes[mode["response"]["body"]] if "response" in mode else "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    settings = ext["backendSettings"]
    cb, hc, passive = (
        settings["circuitBreaker"],
        settings["healthCheck"]["active"],
        settings["healthCheck"]["passive"],
    )
    cluster = {
        **backend_cluster(cluster_name, ext["backendRefs"][0]["port"]),
        "connect_timeout": settings["timeout"]["tcp"]["connectTimeout"],
        "typed_extension_protocol_options": copy.deepcopy(HTTP2),
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": cb["maxConnections"],
                    "max_pending_requests": cb["maxPendingRequests"],
                    "max_requests": cb["maxParallelRequests"],
                    "max_retries": cb["maxParallelRetries"],
                }
            ]
        },
        "health_checks": [
            {
                "timeout": hc["timeout"],
                "interval": hc["interval"],
                "unhealthy_threshold": hc["unhealthyThreshold"],
                "healthy_threshold": hc["healthyThreshold"],
                "grpc_health_check": {"service_name": hc["grpc"]["service"]},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": passive["splitExternalLocalOriginErrors"],
            "consecutive_local_origin_failure": passive["consecutiveLocalOriginFailures"],
            "interval": passive["interval"],
            "base_ejection_time": passive["baseEjectionTime"],
            "max_ejection_percent": passive["maxEjectionPercent"],
        },
    }
    hcm = gateway_hcm("httproute/llm/llm/rule/0")
    hcm["http_filters"].insert(0, filter_)
    for script in eep["spec"].get("lua", []):  # each Lua entry: a filter before the router
        lua = {
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": script["inline"]},
            },
        }
        hcm["http_filters"].insert(len(hcm["http_filters"]) - 1, lua)
    listeners = {}
    for jp in patch_policy["spec"]["jsonPatches"]:
        assert jp["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener"
        target = listeners.setdefault(
            jp["name"], listener(jp["name"], copy.deepcopy(hcm), default_chain=True)
        )
        assert jp["operation"]["op"] == "add"
        json_patch_add(target, jp["operation"]["path"], jp["operation"]["value"])
    return {
        "static_resources": {
            "listeners": list(listeners.values()),
            "clusters": [cluster, backend_cluster("httproute/llm/llm/rule/0", 8000)],
        }
    }


@pytest.mark.integration
def test_istio_envoyfilter_is_valid_envoy_config(tmp_path: Path) -> None:
    boot = istio_bootstrap(
        one("istio", "EnvoyFilter", "llm-extproc"), one("istio", "DestinationRule", "llm-extproc")
    )
    out = run_envoy(boot, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


@pytest.mark.integration
def test_envoy_gateway_policies_are_valid_envoy_config(tmp_path: Path) -> None:
    boot = eg_bootstrap(
        one("envoy-gateway", "EnvoyExtensionPolicy"), one("envoy-gateway", "EnvoyPatchPolicy")
    )
    out = run_envoy(boot, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


@pytest.mark.integration
def test_envoy_gateway_observed_ttft_policy_is_valid_envoy_config(tmp_path: Path) -> None:
    """The overlay's policy as Envoy Gateway programs it (the Lua filter before the router) loads in
    Envoy; a script that does not compile does not."""
    policy = observed_ttft_policy()
    out = run_envoy(eg_bootstrap(policy, one("envoy-gateway", "EnvoyPatchPolicy")), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    policy["spec"]["lua"][0]["inline"] = "function envoy_on_response(handle\n"
    assert run_envoy(eg_bootstrap(policy, one("envoy-gateway", "EnvoyPatchPolicy")), tmp_path).returncode != 0


@pytest.mark.integration
def test_envoy_validation_rejects_a_broken_patch(tmp_path: Path) -> None:
    ef = copy.deepcopy(one("istio", "EnvoyFilter", "llm-extproc"))
    ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["processing_mode"][
        "request_body_mode"
    ] = "BUFFERD"
    assert (
        run_envoy(istio_bootstrap(ef, one("istio", "DestinationRule", "llm-extproc")), tmp_path).returncode
        != 0
    )
    epp = copy.deepcopy(one("envoy-gateway", "EnvoyPatchPolicy"))
    epp["spec"]["jsonPatches"][1]["operation"]["value"]["typed_config"][
        "additional_request_headers_to_logg"
    ] = ["x"]
    assert (
        run_envoy(eg_bootstrap(one("envoy-gateway", "EnvoyExtensionPolicy"), epp), tmp_path).returncode != 0
    )


def shipped() -> dict[str, Any]:
    cfg = load_envoy_config(ENVOY_DIR / "envoy.yaml")
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    grpc_log = next(a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm-extproc")
    return {
        "ext_proc": ext_proc_filter(cfg),
        "early": hcm["early_header_mutation_extensions"],
        "access_log": grpc_log,
        "health_checks": cluster["health_checks"],
        "first_byte": next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.lua"),
    }


def without_grpc_target(block: dict[str, Any]) -> dict[str, Any]:
    block = copy.deepcopy(block)
    for holder in (
        block.get("grpc_service"),
        block.get("typed_config", {}).get("common_config", {}).get("grpc_service"),
    ):
        if holder:
            holder["envoy_grpc"] = {}
    return block


def test_istio_envoyfilter_carries_the_shipped_envoy_blocks() -> None:
    ref = shipped()
    patches = one("istio", "EnvoyFilter", "llm-extproc")["spec"]["configPatches"]
    ext_proc = patches[0]["patch"]["value"]["typed_config"]
    assert without_grpc_target(ext_proc) == without_grpc_target(ref["ext_proc"])
    hcm = patches[1]["patch"]["value"]["typed_config"]
    assert hcm["early_header_mutation_extensions"] == ref["early"]
    assert [without_grpc_target(a) for a in hcm["access_log"]] == [without_grpc_target(ref["access_log"])]
    assert patches[2]["patch"]["value"]["health_checks"] == ref["health_checks"]
    # the same script, run for every response (Istio's routes are its own): non-streamed ones return
    # at the content-type check
    lua = patches[3]["patch"]["value"]["typed_config"]
    assert lua["default_source_code"] == ref["first_byte"]["typed_config"]["source_codes"]["first-byte"]


@pytest.mark.parametrize("name", ["envoy.yaml", "endpoint-picker.yaml"])
def test_the_first_byte_filter_runs_on_the_streaming_route_only(name: str) -> None:
    """Observed TTFT: the Lua filter right before the router, its script named by the streaming
    route's per-filter config and by no other route (non-streamed requests pay nothing)."""
    cfg = load_envoy_config(ENVOY_DIR / name)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[-2:] == ["envoy.filters.http.lua", "envoy.filters.http.router"]
    assert hcm["http_filters"][-2] == shipped()["first_byte"]
    assert "default_source_code" not in hcm["http_filters"][-2]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    with_lua = [r for r in routes if "envoy.filters.http.lua" in r.get("typed_per_filter_config", {})]
    assert len(with_lua) == 1
    assert {"name": "x-llm-stream", "present_match": True} in with_lua[0]["match"]["headers"]
    assert with_lua[0]["typed_per_filter_config"]["envoy.filters.http.lua"]["name"] == "first-byte"


def test_envoy_gateway_policies_carry_the_shipped_settings() -> None:
    ref = shipped()
    eep = one("envoy-gateway", "EnvoyExtensionPolicy")
    (ext,) = eep["spec"]["extProc"]
    assert ext["messageTimeout"] == ref["ext_proc"]["message_timeout"]
    assert ext["failOpen"] == ref["ext_proc"]["failure_mode_allow"]
    assert ext["processingMode"] == {"request": {"body": "Buffered"}}
    patches = one("envoy-gateway", "EnvoyPatchPolicy")["spec"]["jsonPatches"]
    assert patches[0]["operation"]["value"] == ref["early"]
    log = patches[1]["operation"]["value"]
    assert without_grpc_target(log) == without_grpc_target(ref["access_log"])
    assert log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"
    ] == eg_ext_proc_cluster_name(eep)


def test_health_checks_match_the_shutdown_announce_period() -> None:
    """shutdown_announce_s is derived from the llm-extproc cluster's health check (settings.py):
    the Istio and Envoy Gateway health checks must be that same check."""
    (hc,) = one("istio", "EnvoyFilter", "llm-extproc")["spec"]["configPatches"][2]["patch"]["value"][
        "health_checks"
    ]
    active = one("envoy-gateway", "EnvoyExtensionPolicy")["spec"]["extProc"][0]["backendSettings"][
        "healthCheck"
    ]["active"]
    want = (ENVOY_EXTPROC_HC_INTERVAL_S, ENVOY_EXTPROC_HC_TIMEOUT_S, ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD)
    assert (duration_s(hc["interval"]), duration_s(hc["timeout"]), hc["unhealthy_threshold"]) == want
    assert (
        duration_s(active["interval"]),
        duration_s(active["timeout"]),
        active["unhealthyThreshold"],
    ) == want
    assert hc["grpc_health_check"]["service_name"] == active["grpc"]["service"] == EXT_PROC_SERVICE


# -- 5. alerts and dashboard: real metric names, valid PromQL ------------------------------------------
PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp_max",
    "clamp_min",
    "count",
    "count_over_time",
    "delta",
    "deriv",
    "floor",
    "histogram_quantile",
    "increase",
    "irate",
    "label_replace",
    "last_over_time",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "predict_linear",
    "quantile",
    "rate",
    "resets",
    "round",
    "scalar",
    "sort",
    "sort_desc",
    "stddev",
    "sum",
    "sum_over_time",
    "time",
    "timestamp",
    "topk",
    "vector",
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}
SYNTHETIC = {"up"}  # set by Prometheus for every scrape target


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label matchers, strings, ranges and grouping
    labels removed; an identifier followed by `(` must be a known function)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        following = s[m.end() :].lstrip()
        if following.startswith("(") or (word in PROMQL_FUNCTIONS and re.match(r"(by|without)\b", following)):
            assert word in PROMQL_FUNCTIONS | PROMQL_KEYWORDS, f"unknown PromQL function {word!r} in {expr!r}"
        elif word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def exported_metric_names() -> set[str]:
    """Every series name the service and the publisher can expose (from their live registries)."""
    names: set[str] = set()
    for registry in (Metrics(["m"], ["c"]).registry, PublisherMetrics().registry):
        for family in registry.collect():
            if family.type == "counter":
                names |= {f"{family.name}_total", f"{family.name}_created"}
            elif family.type == "histogram":
                names |= {f"{family.name}{s}" for s in ("_bucket", "_sum", "_count", "_created")}
            else:
                names.add(family.name)
    # The scheduling plugins' own figures: exposed once a plugin reports one (telemetry/metrics.py).
    for name, kind, _ in PLUGIN_FIGURES.values():
        names.add(f"{name}_total" if kind == "counter" else name)
    return names


def engine_prefix_cache_names() -> set[str]:
    """Engine series the publisher itself reads for the prefix-cache hit rate (engines.py)."""
    return {
        m.name
        for row in ENGINE_METRICS.values()
        for m in (*row.prefix_cache_hits, *row.prefix_cache_queries, *row.prefix_cache_hit_rate)
    }


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in one("monitoring", "PrometheusRule")["spec"]["groups"] for r in g["rules"]]


def unknown_metrics(expr: str) -> set[str]:
    return metric_names(expr) - exported_metric_names() - SYNTHETIC - engine_prefix_cache_names()


def test_exported_names_come_from_the_registry() -> None:
    names = exported_metric_names()
    for expected in (
        "llm_extproc_requests_total",
        "llm_extproc_decision_seconds_bucket",
        "llm_extproc_inflight_requests",
        "llm_extproc_publisher_last_publish_timestamp_seconds",
    ):
        assert expected in names
    assert "llm_extproc_requests" not in names  # counters are exposed with _total only


def test_dashboard_and_alerts_name_only_exported_metrics() -> None:
    for title, expr in dashboard_exprs():
        assert metric_names(expr), title
        assert unknown_metrics(expr) == set(), f"dashboard panel {title!r}"
    for rule in alert_rules():
        assert unknown_metrics(rule["expr"]) == set(), f"alert {rule['alert']}"
    engine = {n for _, e in dashboard_exprs() for n in metric_names(e)} & engine_prefix_cache_names()
    assert engine == {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}


def test_metric_name_check_catches_a_wrong_name() -> None:
    assert unknown_metrics('sum(rate(llm_extproc_decisions_total{job="x"}[5m]))') == {
        "llm_extproc_decisions_total"
    }
    assert unknown_metrics("llm_extproc_requests") == {"llm_extproc_requests"}
    assert unknown_metrics('sum by (cluster) (llm_extproc_inflight_requests{cluster=~"gpu.*"})') == set()
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        metric_names("rates(llm_extproc_requests_total[5m])")


def test_dashboard_structure() -> None:
    dash = dashboard()
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    used = {n for _, e in dashboard_exprs() for n in metric_names(e)}
    for metric in (
        "llm_extproc_requests_total",
        "llm_extproc_decision_seconds_bucket",
        "llm_extproc_plugin_seconds_bucket",
        "llm_extproc_fallbacks_total",
        "llm_extproc_snapshot_age_seconds",
        "llm_extproc_fleet_instances",
        "llm_extproc_inflight_requests",
        "llm_extproc_releases_total",
        "llm_extproc_redis_connected",
        "llm_extproc_access_log_streams",
        "vllm:prefix_cache_hits_total",
    ):
        assert metric in used, f"no panel shows {metric}"


def test_alert_rules_cover_the_failure_modes() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    expects = {
        "LLMExtprocDown": "up",
        "LLMExtprocNoDecisions": "llm_extproc_requests_total",
        "LLMExtprocDecisionLatencyHigh": "llm_extproc_decision_seconds_bucket",
        "LLMExtprocFallbacksRising": "llm_extproc_fallbacks_total",
        "LLMExtprocSnapshotsStale": "llm_extproc_fleet_instances",
        "LLMExtprocRedisDisconnected": "llm_extproc_redis_connected",
        "LLMExtprocLeaseExpiries": "llm_extproc_releases_total",
        "LLMExtprocNoAccessLogStream": "llm_extproc_access_log_streams",
        "LLMExtprocPublisherStalled": "llm_extproc_publisher_last_publish_timestamp_seconds",
    }
    for alert, metric in expects.items():
        assert metric in metric_names(rules[alert]["expr"]), alert
    assert 'trigger="expired"' in rules["LLMExtprocLeaseExpiries"]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)


def write_rules(tmp_path: Path, groups: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_accepts_the_alert_rules(tmp_path: Path) -> None:
    out = promtool(
        "check", "rules", str(write_rules(tmp_path, one("monitoring", "PrometheusRule")["spec"]["groups"]))
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each panel query as a recording rule (Grafana's $__rate_interval as 5m): PromQL syntax check."""
    rules = [
        {
            "record": f"dashboard:panel_{i}",
            "expr": expr.replace("$__rate_interval", "5m").replace("$job", "llm-extproc"),
        }
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    out = promtool("check", "rules", str(write_rules(tmp_path, [{"name": "dashboard", "rules": rules}])))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    groups = copy.deepcopy(one("monitoring", "PrometheusRule")["spec"]["groups"])
    groups[0]["rules"][0]["expr"] = "sum by (job (llm_extproc_requests_total)"
    out = promtool("check", "rules", str(write_rules(tmp_path, groups)))
    assert out.returncode != 0


def expected_alert(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    def render(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)

    return {
        "exp_labels": {**labels, **rule["labels"], "alertname": rule["alert"]},
        "exp_annotations": {k: render(v) for k, v in rule["annotations"].items()},
    }


@needs_promtool
def test_alerts_fire_on_the_conditions_they_describe(tmp_path: Path) -> None:
    """`promtool test rules`: series in, alerts out (and silence when the condition does not hold)."""
    rules = {r["alert"]: r for r in alert_rules()}
    routed = (
        'llm_extproc_requests_total{job="llm-extproc",instance="a",model="m",'
        'cluster="gpu-a",outcome="routed"}'
    )
    tests = [
        {  # requests routed, no access-log stream anywhere: in-flight counts would never fall
            "interval": "1m",
            "input_series": [
                {"series": routed, "values": "0+10x20"},
                {
                    "series": 'llm_extproc_access_log_streams{job="llm-extproc",instance="a"}',
                    "values": "0x20",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "LLMExtprocNoAccessLogStream", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "LLMExtprocNoAccessLogStream",
                    "exp_alerts": [
                        expected_alert(rules["LLMExtprocNoAccessLogStream"], {"job": "llm-extproc"})
                    ],
                },
            ],
        },
        {  # the same traffic with a stream open: silent
            "interval": "1m",
            "input_series": [
                {"series": routed, "values": "0+10x20"},
                {
                    "series": 'llm_extproc_access_log_streams{job="llm-extproc",instance="a"}',
                    "values": "2x20",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "LLMExtprocNoAccessLogStream", "exp_alerts": []}
            ],
        },
        {  # leases expiring instead of being released by the access log
            "interval": "1m",
            "input_series": [
                {
                    "series": 'llm_extproc_releases_total{job="llm-extproc",instance="a",trigger="expired"}',
                    "values": "0+3x40",
                },
                {
                    "series": 'llm_extproc_releases_total{job="llm-extproc",instance="a",trigger="access_log"}',  # noqa: E501
                    "values": "0+50x40",
                },
            ],
            "alert_rule_test": [
                {
                    "eval_time": "25m",
                    "alertname": "LLMExtprocLeaseExpiries",
                    "exp_alerts": [expected_alert(rules["LLMExtprocLeaseExpiries"], {"job": "llm-extproc"})],
                },
            ],
        },
        {  # a replica that stops answering scrapes
            "interval": "1m",
            "input_series": [
                {"series": 'up{job="llm-extproc",instance="10.0.0.1:9090"}', "values": "1 1 0 0 0 0 0"}
            ],
            "alert_rule_test": [
                {
                    "eval_time": "6m",
                    "alertname": "LLMExtprocDown",
                    "exp_alerts": [
                        expected_alert(
                            rules["LLMExtprocDown"], {"job": "llm-extproc", "instance": "10.0.0.1:9090"}
                        )
                    ],
                },
            ],
        },
    ]
    rules_path = write_rules(tmp_path, one("monitoring", "PrometheusRule")["spec"]["groups"])
    test_path = tmp_path / "alerts.test.yaml"
    test_path.write_text(
        yaml.safe_dump(
            {"rule_files": [rules_path.name], "evaluation_interval": "1m", "tests": tests}, sort_keys=False
        )
    )
    out = promtool("test", "rules", str(test_path))
    assert out.returncode == 0, out.stdout + out.stderr
