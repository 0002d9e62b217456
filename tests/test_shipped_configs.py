"""The shipped envoy/*.yaml files are valid for Envoy 1.40 and agree with the service configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.config import load_config
from extproc.settings import HeaderNames
from extproc_lab.stack import ENVOY_DIR, ext_proc_filter, find_envoy, load_envoy_config

PAIRS = [("envoy.yaml", "llm-extproc.yaml"), ("endpoint-picker.yaml", "llm-extproc-endpoint.yaml")]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["envoy.yaml", "endpoint-picker.yaml"])
def test_envoy_validates(name: str) -> None:
    out = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(ENVOY_DIR / name), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


@pytest.mark.integration
def test_envoy_rejects_a_broken_config(tmp_path) -> None:
    """The validation above can fail: a typo in a field name is caught."""
    cfg = load_envoy_config(ENVOY_DIR / "envoy.yaml")
    ext_proc_filter(cfg)["processing_mode"]["request_body_mod"] = "BUFFERED"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(bad)], capture_output=True, timeout=60
    )
    assert out.returncode != 0


@pytest.mark.parametrize(("envoy_file", "service_file"), PAIRS)
def test_service_names_only_clusters_envoy_has(envoy_file: str, service_file: str) -> None:
    envoy = load_envoy_config(ENVOY_DIR / envoy_file)
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    service = load_config(ENVOY_DIR / service_file)
    for spec in service.pool.clusters:
        assert spec.name in clusters, f"{service_file} names cluster {spec.name} missing from {envoy_file}"
        if spec.endpoints:
            envoy_eps = {
                f"{e['endpoint']['address']['socket_address']['address']}:"
                f"{e['endpoint']['address']['socket_address']['port_value']}"
                for group in clusters[spec.name]["load_assignment"]["endpoints"]
                for e in group["lb_endpoints"]
            }
            assert set(spec.endpoints) == envoy_eps
    assert ext_proc_filter(envoy)["grpc_service"]["envoy_grpc"]["cluster_name"] in clusters


@pytest.mark.parametrize("envoy_file", ["envoy.yaml", "endpoint-picker.yaml"])
def test_envoy_settings_the_design_requires(envoy_file: str) -> None:
    cfg = load_envoy_config(ENVOY_DIR / envoy_file)
    f = ext_proc_filter(cfg)
    pm = f["processing_mode"]
    assert pm["request_header_mode"] == "SEND"  # SKIP would route before the body is seen
    # The stream ends after routing: a generation never depends on it (release via the access log).
    assert pm["response_trailer_mode"] == "SKIP"
    assert f["mutation_rules"]["disallow_all"] is True
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # Client routing headers are stripped before route selection (early), so fail-open cannot be
    # steered by a client: every header the service sets (x-llm-priority is the client's to send).
    early = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    names = HeaderNames()
    for header in (names.destination_cluster, names.destination_endpoint, names.ticket, names.stream):
        assert {"remove": header} in early
    # The access log reports routed requests' ends to llm-extproc, with the ticket.
    als = next(a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    assert (
        als["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        == (f["grpc_service"]["envoy_grpc"]["cluster_name"])
    )
    assert als["typed_config"]["additional_request_headers_to_log"] == [HeaderNames().ticket]
    extproc_cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm-extproc")
    opts = extproc_cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    assert extproc_cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= 10_000
    assert "grpc_health_check" in extproc_cluster["health_checks"][0]


@pytest.mark.parametrize(("envoy_file", "service_file"), PAIRS)
def test_release_mode_matches_envoy(envoy_file: str, service_file: str) -> None:
    """stream_end needs the stream held open (SEND); access_log works with either (the service
    closes the stream after routing), and the shipped files skip the extra phase."""
    pm = ext_proc_filter(load_envoy_config(ENVOY_DIR / envoy_file))["processing_mode"]
    release_on = load_config(ENVOY_DIR / service_file).release_on
    assert (release_on, pm["response_trailer_mode"]) in {("access_log", "SKIP"), ("stream_end", "SEND")}
    assert release_on == "access_log"  # the default too: a generation never depends on the service


@pytest.mark.integration
@pytest.mark.parametrize(("envoy_file", "service_file"), PAIRS)
def test_check_config_cli(envoy_file: str, service_file: str) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "extproc.cli", "check-config"),
            *("--config", str(ENVOY_DIR / service_file), "--envoy-config", str(ENVOY_DIR / envoy_file)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok:")
    assert "route metadata" in out.stdout


@pytest.mark.parametrize("service_file", [p[1] for p in PAIRS])
def test_shipped_service_configs_cap_clients_at_standard(service_file: str) -> None:
    """A client's own x-llm-priority cannot make it critical unless a route grants it."""
    assert load_config(ENVOY_DIR / service_file).admission.client_max_priority == 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"key": "x-llm-max-priority", "value": "critcal"}, "x-llm-max-priority='critcal': must be one of"),
        ({"key": "x-llm-priority", "value": "high"}, "x-llm-priority='high'"),
        ({"key": "x-llm-ttft-slo-ms", "value": "fast"}, "must be a number of milliseconds"),
        ({"key": "x-llm-profile", "value": "nosuch"}, "no such profile"),
    ],
)
def test_check_config_cli_reports_bad_route_metadata(
    tmp_path: Path, entry: dict[str, str], expected: str
) -> None:
    """A misspelt cap in envoy.yaml is an error before traffic, not a cap that silently disappears."""
    cfg = load_envoy_config(ENVOY_DIR / "envoy.yaml")
    routes = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"
    ]["virtual_hosts"][0]["routes"]
    routes[0]["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"grpc_initial_metadata": [entry]},
        }
    }
    envoy_file = tmp_path / "envoy.yaml"
    envoy_file.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [
            *(sys.executable, "-m", "extproc.cli", "check-config"),
            *("--config", str(ENVOY_DIR / "llm-extproc.yaml"), "--envoy-config", str(envoy_file)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout
    assert expected in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pool: {clusters: [{name: a, models: []}]}\n", "models"),
        ("listen: notanaddress\npool: {clusters: [{name: a, models: [m]}]}\n", "'listen' must be host:port"),
        ("pool: {clusters: [{name: a, modles: [m]}]}\n", "unknown keys ['modles']"),
    ],
)
def test_check_config_cli_reports_errors(tmp_path, text: str, expected: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "extproc.cli", "check-config", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert expected in out.stderr
