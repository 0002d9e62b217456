"""Unit tests for extproc.config, extproc.fleet.pool and extproc.fleet.accounting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ServiceConfig, config_from_dict, load_config
from extproc.fleet import ClusterSpec, InFlight, Lease, Pool, RoutingMode, Upstream, pool_from_config
from extproc.fleet.pool import WILDCARD, parse_endpoint
from extproc.scheduling import plugin_name
from extproc.scheduling.decode_speed import DecodeSpeedScorer
from extproc.scheduling.plugins import (
    LeastOutstandingScorer,
    MaxInflightFilter,
    MaxScorePicker,
    SessionAffinityScorer,
    WeightedRandomPicker,
)
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.settings import DEFAULT_GRPC_MAX_MESSAGE_BYTES, ENV_CONFIG, ConfigError, HeaderNames

ENVOY_DIR = Path(__file__).resolve().parent.parent / "envoy"
MIB = 1024 * 1024


def minimal(**extra: Any) -> dict[str, Any]:
    return {"pool": {"clusters": [{"name": "gpu-a", "models": ["m"]}]}, **extra}


def write_yaml(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


# --------------------------------------------------------------------------------------------------
# config_from_dict
# --------------------------------------------------------------------------------------------------


class TestConfigFromDict:
    def test_minimal_defaults(self) -> None:
        cfg = config_from_dict(minimal())
        assert isinstance(cfg, ServiceConfig)
        assert cfg.listen == "127.0.0.1:9002"
        assert cfg.metrics_listen == "127.0.0.1:9090"
        assert cfg.max_body_bytes == 16 * MIB
        assert cfg.shutdown_grace_s == 30.0
        assert cfg.endpoint_metadata_namespace == "envoy.lb"
        assert cfg.headers == HeaderNames()
        assert cfg.pool.mode is RoutingMode.CLUSTER
        assert cfg.profile.name == "default"
        assert [type(s) for s, _ in cfg.profile.scorers] == [PredictedTtftScorer, DecodeSpeedScorer]
        assert isinstance(cfg.profile.picker, MaxScorePicker)

    def test_cluster_routing_happy_path(self) -> None:
        cfg = config_from_dict(
            {
                "listen": "0.0.0.0:9100",
                "metrics_listen": None,
                "max_body_bytes": 1024,
                "shutdown_grace_s": 5,
                "routing": "cluster",
                "pool": {
                    "clusters": [
                        {"name": "gpu-a", "models": ["llama", "mistral"], "weight": 2},
                        {"name": "gpu-b", "models": ["llama"]},
                    ]
                },
                "scheduling": {
                    "profile": "sticky",
                    "profiles": {
                        "sticky": {
                            "filters": [{"name": "max-inflight", "params": {"limit": 8}}],
                            "scorers": [
                                {"name": "least-outstanding", "weight": 1},
                                {"name": "session-affinity", "weight": 2},
                            ],
                            "picker": "weighted-random",
                        },
                        "other": {"scorers": ["least-outstanding"]},
                    },
                },
            }
        )
        assert cfg.listen == "0.0.0.0:9100"
        assert cfg.metrics_listen is None
        assert cfg.max_body_bytes == 1024
        assert cfg.shutdown_grace_s == 5
        assert cfg.pool.mode is RoutingMode.CLUSTER
        assert cfg.pool.cluster_names() == ["gpu-a", "gpu-b"]
        assert cfg.pool.models() == ["llama", "mistral"]
        llama = cfg.pool.candidates("llama")
        assert llama is not None
        assert [u.id for u in llama] == ["gpu-a", "gpu-b"]
        assert all(u.address is None for u in llama)
        assert llama[0].weight == 2.0
        assert [u.id for u in cfg.pool.candidates("mistral") or ()] == ["gpu-a"]
        assert cfg.profile.name == "sticky"
        assert isinstance(cfg.profile.filters[0], MaxInflightFilter)
        assert cfg.profile.filters[0].limit == 8
        assert [(type(s), w) for s, w in cfg.profile.scorers] == [
            (LeastOutstandingScorer, 1.0),
            (SessionAffinityScorer, 2.0),
        ]
        assert isinstance(cfg.profile.picker, WeightedRandomPicker)

    def test_endpoint_routing_happy_path(self) -> None:
        cfg = config_from_dict(
            {
                "routing": "endpoint",
                "endpoint_metadata_namespace": "custom.ns",
                "pool": {
                    "clusters": [
                        {"name": "pool", "models": ["m"], "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}
                    ]
                },
            }
        )
        assert cfg.pool.mode is RoutingMode.ENDPOINT
        assert cfg.endpoint_metadata_namespace == "custom.ns"
        assert [(u.id, u.cluster, u.address) for u in cfg.pool.everything()] == [
            ("pool/10.0.0.1:8000", "pool", "10.0.0.1:8000"),
            ("pool/10.0.0.2:8000", "pool", "10.0.0.2:8000"),
        ]

    def test_bad_routing_mode(self) -> None:
        with pytest.raises(ValueError):
            config_from_dict(minimal(routing="round-robin"))

    @pytest.mark.parametrize("key", ["lisen", "bogus", "max_body", "profiles"])
    def test_unknown_top_level_key(self, key: str) -> None:
        with pytest.raises(ValueError, match="unknown keys") as info:
            config_from_dict(minimal(**{key: 1}))
        assert key in str(info.value)

    @pytest.mark.parametrize("raw", [{}, {"pool": None}, {"pool": {}}])
    def test_missing_pool(self, raw: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match=r"pool\.clusters"):
            config_from_dict(raw)

    @pytest.mark.parametrize(
        ("raw", "match"),
        [
            ({"pool": []}, "'pool' must be a mapping"),
            ({"pool": {"cluster": []}}, r"unknown keys \['cluster'\]"),
            (minimal(listen="x"), "'listen' must be host:port"),
        ],
    )
    def test_malformed_pool_or_listen_named(self, raw: dict[str, Any], match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            config_from_dict(raw)

    def test_empty_clusters(self) -> None:
        with pytest.raises(ValueError, match="at least one cluster"):
            config_from_dict({"pool": {"clusters": []}})

    def test_undefined_profile(self) -> None:
        with pytest.raises(ValueError, match="'fast' is not defined"):
            config_from_dict(minimal(scheduling={"profile": "fast"}))
        with pytest.raises(ValueError, match="'default' is not defined"):
            config_from_dict(minimal(scheduling={"profiles": {"fast": {"scorers": ["least-outstanding"]}}}))

    def test_bad_profile_propagates(self) -> None:
        with pytest.raises(ValueError, match="known:"):
            config_from_dict(minimal(scheduling={"profiles": {"default": {"scorers": ["nope"]}}}))

    def test_header_names_lower_cased(self) -> None:
        cfg = config_from_dict(
            minimal(
                headers={
                    "session": "X-Conversation-ID",
                    "user": "X-User",
                    "priority": "X-Priority",
                    "destination_cluster": "X-Dest",
                    "destination_endpoint": "X-Gateway-Destination-Endpoint",
                }
            )
        )
        assert cfg.headers == HeaderNames(
            destination_cluster="x-dest",
            destination_endpoint="x-gateway-destination-endpoint",
            session="x-conversation-id",
            user="x-user",
            priority="x-priority",
        )

    def test_partial_headers_keep_defaults(self) -> None:
        cfg = config_from_dict(minimal(headers={"session": "X-S"}))
        assert cfg.headers.session == "x-s"
        assert cfg.headers.user == "x-user-id"
        assert cfg.headers.priority == "x-llm-priority"
        assert cfg.headers.destination_cluster == "x-llm-destination-cluster"

    @pytest.mark.parametrize(
        "extra",
        [
            {"headers": {"sesion": "x-s"}},
            {"headers": {"session": 5}},
            {"max_body_bytes": "16MiB"},
            {"scheduling": ["default"]},
        ],
        ids=["unknown-header-key", "non-string-header", "string-max-body", "scheduling-not-mapping"],
    )
    def test_malformed_sections_raise_value_error(self, extra: dict[str, Any]) -> None:
        with pytest.raises(ValueError):
            config_from_dict(minimal(**extra))

    def test_overrides(self) -> None:
        cfg = config_from_dict(minimal(listen="1.1.1.1:1"), listen="2.2.2.2:2", metrics_listen=None)
        assert cfg.listen == "2.2.2.2:2"
        assert cfg.metrics_listen == "127.0.0.1:9090"  # None overrides are ignored

    def test_unknown_override_rejected(self) -> None:
        with pytest.raises(ValueError, match="unknown keys"):
            config_from_dict(minimal(), colour="blue")

    def test_raw_not_mutated(self) -> None:
        raw = minimal()
        before = yaml.safe_dump(raw)
        config_from_dict(raw, listen="9.9.9.9:9")
        assert yaml.safe_dump(raw) == before


class TestMessageSizes:
    @pytest.mark.parametrize(
        "max_body",
        [1, 1024, 16 * MIB, 32 * MIB, 64 * MIB, 64 * MIB + 1, 100 * MIB, 512 * MIB],
    )
    @pytest.mark.parametrize("grpc", [None, 0, 1, 4 * MIB, 65 * MIB])
    def test_grpc_floor(self, max_body: int, grpc: int | None) -> None:
        extra: dict[str, Any] = {"max_body_bytes": max_body}
        if grpc is not None:
            extra["grpc_max_message_bytes"] = grpc
        cfg = config_from_dict(minimal(**extra))
        assert cfg.grpc_max_message_bytes >= max_body + MIB
        assert cfg.grpc_max_message_bytes >= 65 * MIB
        assert cfg.grpc_max_message_bytes >= DEFAULT_GRPC_MAX_MESSAGE_BYTES + MIB

    def test_default_exact(self) -> None:
        assert config_from_dict(minimal()).grpc_max_message_bytes == 65 * MIB

    def test_large_body_exact(self) -> None:
        cfg = config_from_dict(minimal(max_body_bytes=100 * MIB))
        assert cfg.grpc_max_message_bytes == 101 * MIB

    def test_larger_explicit_value_kept(self) -> None:
        cfg = config_from_dict(minimal(grpc_max_message_bytes=200 * MIB))
        assert cfg.grpc_max_message_bytes == 200 * MIB

    def test_direct_construction_also_floors(self) -> None:
        pool = pool_from_config([{"name": "a", "models": ["m"]}], RoutingMode.CLUSTER)
        cfg = config_from_dict(minimal())
        direct = ServiceConfig(
            pool=pool, profile=cfg.profile, max_body_bytes=80 * MIB, grpc_max_message_bytes=1
        )
        assert direct.grpc_max_message_bytes == 81 * MIB

    @pytest.mark.parametrize("value", [0, -1, -16 * MIB])
    def test_non_positive_max_body_rejected(self, value: int) -> None:
        with pytest.raises(ValueError, match="max_body_bytes' must be a positive integer"):
            config_from_dict(minimal(max_body_bytes=value))


# --------------------------------------------------------------------------------------------------
# load_config
# --------------------------------------------------------------------------------------------------


class TestLoadConfig:
    def test_reads_yaml_file(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        path = write_yaml(tmp_path / "c.yaml", minimal(listen="127.0.0.1:7777", max_body_bytes=2048))
        cfg = load_config(path)
        assert cfg.listen == "127.0.0.1:7777"
        assert cfg.max_body_bytes == 2048
        assert cfg.pool.cluster_names() == ["gpu-a"]
        assert load_config(str(path)).listen == "127.0.0.1:7777"

    def test_env_var(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = write_yaml(tmp_path / "env.yaml", minimal(listen="127.0.0.1:8888"))
        monkeypatch.setenv(ENV_CONFIG, str(path))
        assert ENV_CONFIG == "LLM_EXTPROC_CONFIG"
        assert load_config().listen == "127.0.0.1:8888"

    def test_explicit_path_beats_env(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        env_path = write_yaml(tmp_path / "env.yaml", minimal(listen="127.0.0.1:1"))
        arg_path = write_yaml(tmp_path / "arg.yaml", minimal(listen="127.0.0.1:2"))
        monkeypatch.setenv(ENV_CONFIG, str(env_path))
        assert load_config(arg_path).listen == "127.0.0.1:2"

    def test_overrides(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        path = write_yaml(tmp_path / "c.yaml", minimal(listen="127.0.0.1:1"))
        cfg = load_config(path, listen="127.0.0.1:3", max_body_bytes=None)
        assert cfg.listen == "127.0.0.1:3"
        assert cfg.max_body_bytes == 16 * MIB

    def test_no_config_at_all(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        with pytest.raises(ValueError, match=ENV_CONFIG):
            load_config()
        monkeypatch.setenv(ENV_CONFIG, "")
        with pytest.raises(ValueError, match="no configuration file"):
            load_config()

    def test_missing_file(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        with pytest.raises(OSError):
            load_config(tmp_path / "absent.yaml")

    def test_top_level_not_mapping(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        path = tmp_path / "list.yaml"
        path.write_text("- a\n- b\n")
        with pytest.raises(ValueError, match="top level must be a mapping"):
            load_config(path)

    def test_empty_file(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        path = tmp_path / "empty.yaml"
        path.write_text("")
        with pytest.raises(ValueError, match=r"pool\.clusters"):
            load_config(path)

    def test_shipped_cluster_config(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(ENV_CONFIG, raising=False)
        cfg = load_config(ENVOY_DIR / "llm-extproc.yaml")
        assert cfg.pool.mode is RoutingMode.CLUSTER
        assert cfg.pool.cluster_names() == ["gpu-a", "gpu-b"]
        assert [u.id for u in cfg.pool.candidates("sim-llama") or ()] == ["gpu-a", "gpu-b"]
        assert cfg.max_body_bytes == 16 * MIB
        assert cfg.grpc_max_message_bytes >= cfg.max_body_bytes + MIB
        assert cfg.profile.name == "default"
        assert [(plugin_name(s), w) for s, w in cfg.profile.scorers] == [
            ("predicted-ttft", 1.0),
            ("decode-speed", 0.6),
        ]
        # no global KV-usage cut-off; slo-ttft / slo-tpot act only on requests with an objective
        assert [plugin_name(f) for f in cfg.profile.filters] == ["bounded-load", "slo-ttft", "slo-tpot"]
        assert not cfg.admission.enabled and cfg.admission.max_wait_s < 2.0  # Envoy's message_timeout
        scorer = cfg.profile.scorers[0][0]
        assert isinstance(scorer, PredictedTtftScorer) and scorer.prefill_tokens_per_s == 2400
        assert cfg.fleet is not None and cfg.fleet.prefix == "llm-extproc:default"

    def test_shipped_endpoint_config(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(ENV_CONFIG, str(ENVOY_DIR / "llm-extproc-endpoint.yaml"))
        cfg = load_config()
        assert cfg.pool.mode is RoutingMode.ENDPOINT
        assert cfg.pool.cluster_names() == ["inference-pool"]
        assert [u.id for u in cfg.pool.everything()] == [
            "inference-pool/127.0.0.1:8001",
            "inference-pool/127.0.0.1:8002",
        ]
        assert cfg.pool.candidates("sim-llama") == cfg.pool.everything()
        assert cfg.pool.candidates("other-model") is None


# --------------------------------------------------------------------------------------------------
# pool
# --------------------------------------------------------------------------------------------------


class TestPool:
    def test_duplicate_cluster_names(self) -> None:
        with pytest.raises(ValueError, match="unique"):
            pool_from_config(
                [{"name": "a", "models": ["m"]}, {"name": "a", "models": ["n"]}], RoutingMode.CLUSTER
            )

    def test_duplicate_cluster_names_direct(self) -> None:
        with pytest.raises(ValueError, match="unique"):
            Pool(clusters=(ClusterSpec("a", ("m",)), ClusterSpec("a", ("n",))))

    @pytest.mark.parametrize(
        "item",
        [
            {"name": "a"},
            {"name": "a", "models": []},
            {"name": "a", "models": "m"},
            {"name": "a", "models": None},
            {"name": "a", "models": ["m", 3]},
        ],
    )
    def test_missing_or_bad_models(self, item: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match="'models'"):
            pool_from_config([item], RoutingMode.CLUSTER)

    @pytest.mark.parametrize("item", [{"models": ["m"]}, {"name": 5, "models": ["m"]}, "a", None])
    def test_bad_name(self, item: Any) -> None:
        with pytest.raises(ValueError, match="string 'name'"):
            pool_from_config([item], RoutingMode.CLUSTER)

    @pytest.mark.parametrize("weight", [0, 0.0, -1, -0.5, True, False, "2", None])
    def test_bad_weight(self, weight: Any) -> None:
        with pytest.raises(ValueError, match="'weight' must be a positive number"):
            pool_from_config([{"name": "a", "models": ["m"], "weight": weight}], RoutingMode.CLUSTER)

    @pytest.mark.parametrize(("weight", "expected"), [(1, 1.0), (3, 3.0), (0.25, 0.25)])
    def test_good_weight(self, weight: float, expected: float) -> None:
        pool = pool_from_config([{"name": "a", "models": ["m"], "weight": weight}], RoutingMode.CLUSTER)
        (u,) = pool.everything()
        assert u.weight == expected
        assert isinstance(u.weight, float)

    def test_endpoint_mode_requires_endpoints(self) -> None:
        with pytest.raises(ValueError, match="needs 'endpoints'"):
            pool_from_config([{"name": "a", "models": ["m"]}], RoutingMode.ENDPOINT)
        with pytest.raises(ValueError, match="needs 'endpoints'"):
            pool_from_config([{"name": "a", "models": ["m"], "endpoints": []}], RoutingMode.ENDPOINT)

    def test_cluster_mode_ignores_endpoints(self) -> None:
        pool = pool_from_config(
            [{"name": "a", "models": ["m"], "endpoints": ["10.0.0.1:80", "10.0.0.2:80"]}], RoutingMode.CLUSTER
        )
        assert pool.everything() == (Upstream(id="a", cluster="a", address=None, weight=1.0),)

    @pytest.mark.parametrize(
        "endpoint",
        ["nohost", "1.2.3.4:99999", "1.2.3.4:0", "1.2.3.4:", ":8000", "1.2.3.4:http", "1.2.3.4:-1", ""],
    )
    def test_bad_endpoint_literal(self, endpoint: str) -> None:
        with pytest.raises(ValueError, match="must be ip:port"):
            parse_endpoint(endpoint)
        with pytest.raises(ValueError, match="must be ip:port"):
            pool_from_config([{"name": "a", "models": ["m"], "endpoints": [endpoint]}], RoutingMode.ENDPOINT)

    @pytest.mark.parametrize("endpoints", ["10.0.0.1:80", [8000], [None], {"a": "10.0.0.1:80"}])
    def test_endpoints_not_list_of_strings(self, endpoints: Any) -> None:
        with pytest.raises(ValueError, match="'endpoints' must be a list"):
            pool_from_config([{"name": "a", "models": ["m"], "endpoints": endpoints}], RoutingMode.ENDPOINT)

    @pytest.mark.parametrize("endpoint", ["10.0.0.1:8000", "127.0.0.1:1", "127.0.0.1:65535", "[::1]:8000"])
    def test_good_endpoint_literal(self, endpoint: str) -> None:
        assert parse_endpoint(endpoint) == endpoint

    @pytest.mark.parametrize("endpoint", ["example.com:8000", "::1"])
    def test_non_ip_endpoint_rejected(self, endpoint: str) -> None:
        with pytest.raises(ValueError):
            parse_endpoint(endpoint)

    def test_wildcard_serves_unknown_models(self) -> None:
        pool = pool_from_config(
            [
                {"name": "llama", "models": ["llama"]},
                {"name": "catchall", "models": [WILDCARD]},
                {"name": "both", "models": ["llama", "*"]},
            ],
            RoutingMode.CLUSTER,
        )
        assert [u.id for u in pool.candidates("llama") or ()] == ["llama", "both"]
        assert [u.id for u in pool.candidates("anything-else") or ()] == ["catchall", "both"]
        assert pool.models() == ["llama"]

    def test_unknown_model_without_wildcard_is_none(self) -> None:
        pool = pool_from_config(
            [{"name": "a", "models": ["m1"]}, {"name": "b", "models": ["m2"]}], RoutingMode.CLUSTER
        )
        assert pool.candidates("m3") is None
        assert pool.candidates("") is None
        assert pool.candidates("M1") is None
        assert [u.id for u in pool.candidates("m1") or ()] == ["a"]
        assert [u.id for u in pool.candidates("m2") or ()] == ["b"]

    def test_everything_cluster_mode(self) -> None:
        pool = pool_from_config(
            [{"name": "a", "models": ["m"], "weight": 2}, {"name": "b", "models": ["*"]}], RoutingMode.CLUSTER
        )
        assert pool.everything() == (
            Upstream(id="a", cluster="a", address=None, weight=2.0),
            Upstream(id="b", cluster="b", address=None, weight=1.0),
        )
        assert pool.cluster_names() == ["a", "b"]

    def test_everything_endpoint_mode(self) -> None:
        pool = pool_from_config(
            [
                {"name": "a", "models": ["m"], "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"], "weight": 2},
                {"name": "b", "models": ["n", "*"], "endpoints": ["10.0.1.1:9000"]},
            ],
            RoutingMode.ENDPOINT,
        )
        assert pool.everything() == (
            Upstream(id="a/10.0.0.1:8000", cluster="a", address="10.0.0.1:8000", weight=2.0),
            Upstream(id="a/10.0.0.2:8000", cluster="a", address="10.0.0.2:8000", weight=2.0),
            Upstream(id="b/10.0.1.1:9000", cluster="b", address="10.0.1.1:9000", weight=1.0),
        )
        assert [u.id for u in pool.candidates("m") or ()] == ["a/10.0.0.1:8000", "a/10.0.0.2:8000"]
        assert [u.id for u in pool.candidates("zzz") or ()] == ["b/10.0.1.1:9000"]
        assert len({u.id for u in pool.everything()}) == 3

    def test_default_mode_is_cluster(self) -> None:
        pool = Pool(clusters=(ClusterSpec("a", ("m",), endpoints=("10.0.0.1:1",)),))
        assert pool.mode is RoutingMode.CLUSTER
        assert pool.everything()[0].address is None

    def test_routing_mode_values(self) -> None:
        assert RoutingMode("cluster") is RoutingMode.CLUSTER
        assert RoutingMode("endpoint") is RoutingMode.ENDPOINT


# --------------------------------------------------------------------------------------------------
# InFlight accounting
# --------------------------------------------------------------------------------------------------


class TestInFlight:
    def test_acquire_count_total(self) -> None:
        a, b = Upstream("a", "a", None, 1.0), Upstream("b", "b", None, 1.0)
        state = InFlight()
        assert state.count("a") == 0
        assert state.total() == 0
        la = [state.acquire(a) for _ in range(3)]
        lb = state.acquire(b)
        assert isinstance(lb, Lease)
        assert lb.upstream is b
        assert lb.released is False
        assert (state.count("a"), state.count("b"), state.count("zzz")) == (3, 1, 0)
        assert state.total() == 4
        assert la[0].release() is True
        assert state.count("a") == 2
        assert state.total() == 3
        for lease in (*la[1:], lb):
            lease.release()
        assert state.total() == 0
        assert state.count("a") == 0

    def test_release_idempotent(self) -> None:
        a = Upstream("a", "a", None, 1.0)
        state = InFlight()
        keep = state.acquire(a)
        lease = state.acquire(a)
        assert lease.release() is True
        assert lease.released is True
        assert lease.release() is False
        assert lease.release() is False
        assert state.count("a") == 1
        assert keep.release() is True
        assert keep.release() is False
        assert state.count("a") == 0
        assert state.total() == 0

    def test_never_negative(self) -> None:
        a = Upstream("a", "a", None, 1.0)
        state = InFlight()
        lease = state.acquire(a)
        for _ in range(5):
            lease.release()
        assert state.count("a") == 0
        assert state.total() == 0
        again = state.acquire(a)
        assert state.count("a") == 1
        again.release()
        assert state.count("a") == 0

    def test_upstreams_keyed_by_id(self) -> None:
        state = InFlight()
        state.acquire(Upstream("pool/10.0.0.1:80", "pool", "10.0.0.1:80", 1.0))
        state.acquire(Upstream("pool/10.0.0.2:80", "pool", "10.0.0.2:80", 1.0))
        assert state.count("pool") == 0
        assert state.count("pool/10.0.0.1:80") == 1
        assert state.count("pool/10.0.0.2:80") == 1

    def test_on_change_hook(self) -> None:
        a, b = Upstream("a", "a", None, 1.0), Upstream("b", "b", None, 1.0)
        calls: list[tuple[str, int]] = []
        state = InFlight(on_change=lambda cluster, delta: calls.append((cluster, delta)))
        la = state.acquire(a)
        lb = state.acquire(b)
        assert calls == [("a", 1), ("b", 1)]
        la.release()
        la.release()  # idempotent: no second hook call
        assert calls == [("a", 1), ("b", 1), ("a", -1)]
        lb.release()
        assert calls == [("a", 1), ("b", 1), ("a", -1), ("b", -1)]
        assert sum(d for _, d in calls) == state.total() == 0

    def test_hook_is_told_the_cluster(self) -> None:
        seen: list[str] = []
        state = InFlight(on_change=lambda cluster, _d: seen.append(cluster))
        state.acquire(Upstream("clu/1.2.3.4:5", "clu", "1.2.3.4:5", 2.0)).release()
        assert seen == ["clu", "clu"]


def test_fleet_stale_ready_grace_is_configurable() -> None:
    base = {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}}
    cfg = config_from_dict({**base, "fleet": {"url": "redis://127.0.0.1:6379/0"}})
    assert cfg.fleet is not None and cfg.fleet.stale_ready_grace_ttls == 1.0
    cfg = config_from_dict({**base, "fleet": {"stale_ready_grace_ttls": 0}})
    assert cfg.fleet is not None and cfg.fleet.stale_ready_grace_ttls == 0.0
    for bad in (-1, "1", True, 1000):
        with pytest.raises(ConfigError, match="stale_ready_grace_ttls"):
            config_from_dict({**base, "fleet": {"stale_ready_grace_ttls": bad}})


@pytest.mark.parametrize(
    ("fleet_yaml", "secret", "names"),
    [
        ("password: 48213977", "48213977", "password"),  # YAML reads it as a number
        ("password: 0123", "0123", "password"),  # ... or as octal (83): never taken silently
        ("username: 31337", "31337", "username"),
        ("url: 'user:Sup3rSecret@redis.internal:6379/0'", "Sup3rSecret", "no scheme"),
        ("url: ':Sup3r/Secret@redis.internal:6379'", "Sup3r", "no scheme"),
        ("url: 'Sup3rSecret@redis.internal'", "Sup3rSecret", "no scheme"),
    ],
)
def test_redis_config_errors_do_not_echo_the_secret(
    tmp_path: Path, fleet_yaml: str, secret: str, names: str
) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text(f"pool:\n  clusters:\n  - {{name: a, models: [m]}}\nfleet:\n  {fleet_yaml}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert names in str(info.value)
    assert secret not in str(info.value) and "83" not in str(info.value)


def test_redacted_url_hides_what_stands_before_the_at() -> None:
    from extproc.settings import redacted_url

    assert redacted_url("redis://u:p@10.0.0.1:6380/2") == "redis://***@10.0.0.1:6380/2"
    assert redacted_url("rediss+sentinel://:p/w@h1:1,h2:2/m/0") == "rediss+sentinel://***@h1:1,h2:2/m/0"
    assert redacted_url("u:p@h:1") == "***@h:1"
    assert redacted_url("redis://h:1/0") == "redis://h:1/0"


def test_a_predicted_wait_without_a_predictor_is_refused() -> None:
    """admission.max_predicted_wait_s reads the default profile's model of the prefill queues: with a
    profile that has none, the setting would do nothing, so the config is refused (it found the
    scorer by type before, and swapping the scorer silently turned the signal off)."""
    pool = {"clusters": [{"name": "a", "models": ["m"]}]}
    plain = {"profiles": {"default": {"scorers": ["least-outstanding"], "picker": "max-score"}}}
    with pytest.raises(ConfigError, match="max_predicted_wait_s' needs a model of the prefill queues"):
        config_from_dict({"pool": pool, "scheduling": plain, "admission": {"max_predicted_wait_s": 0.5}})
    cfg = config_from_dict({"pool": pool, "admission": {"max_predicted_wait_s": 0.5}})
    assert cfg.profile.prefill_queue is not None and "predicted-ttft" in cfg.profile.produced
    plain_profile = config_from_dict({"pool": pool, "scheduling": plain}).profile
    assert plain_profile.prefill_queue is None and not plain_profile.produced


@pytest.mark.parametrize("value", ["urgent", 1.5, True, None])
def test_a_bad_client_max_priority_is_a_config_error(value: object) -> None:
    pool = {"clusters": [{"name": "a", "models": ["m"]}]}
    with pytest.raises(ConfigError, match="client_max_priority"):
        config_from_dict({"pool": pool, "admission": {"client_max_priority": value}})
    assert (
        config_from_dict(
            {"pool": pool, "admission": {"client_max_priority": "critical"}}
        ).admission.client_max_priority
        == 1
    )
