"""`llm-extproc doctor` against a real stack (Envoy + service + Redis + `llm-extproc publish` as a
process, simulated engines), healthy and then broken in the ways an operator meets: Redis down, stale
snapshots, a cluster missing from envoy.yaml, Envoy gone. Also checks what `publish` logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml

from extproc.cli import main
from extproc.doctor import Check, DoctorOptions, report, run_doctor
from extproc.fleet import snapshot_pb2 as spb
from extproc.settings import RedisSettings
from extproc_lab.stack import ENVOY_DIR, RedisProcess

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import Stack, service_config, wait_until

INTERVAL = 0.3


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


class Setup:
    def __init__(self, stack: Stack, redis_server: RedisProcess, publisher_log: Path) -> None:
        self.stack = stack
        self.redis = redis_server
        self.publisher_log = publisher_log
        self.admin = f"http://127.0.0.1:{stack.admin_port}"
        self.config = str(stack.service.config_path)

    def doctor(self, **kw: object) -> dict[str, Check]:
        import asyncio

        opts = DoctorOptions(
            config=self.config, envoy_admin=self.admin, timeout_s=2.0, service_metrics=self.stack.metrics_url
        )
        for k, v in kw.items():
            setattr(opts, k, v)
        return {c.name: c for c in asyncio.run(run_doctor(opts))}

    def publish_logs(self) -> list[dict]:
        return [
            json.loads(line) for line in self.publisher_log.read_text().splitlines() if line.startswith("{")
        ]


def put_snapshot(setup: Setup, **fields: object) -> None:
    """A READY snapshot of a second gpu-b instance, written into Redis beside the publisher's."""
    snap = spb.UpstreamSnapshot(
        upstream_id="gpu-b/127.0.0.1:1", cluster="gpu-b", address="127.0.0.1:1", readiness=spb.READY, **fields
    )
    key = RedisSettings(pool="default").key(snap.upstream_id)
    redis.Redis.from_url(setup.redis.url).set(key, snap.SerializeToString(), px=60_000)


@pytest.fixture
def setup(make_stack: Callable[..., Stack], redis_server: RedisProcess, tmp_path: Path) -> Iterator[Setup]:
    fleet = {"url": redis_server.url, "pool": "default", "resync_interval_s": 1.0}
    stack = make_stack(service=service_config(fleet=fleet))
    log = tmp_path / "publish.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "extproc.cli",
                "publish",
                "--envoy-admin",
                f"http://127.0.0.1:{stack.admin_port}",
                "--redis-url",
                redis_server.url,
                "--pool",
                "default",
                "--interval",
                str(INTERVAL),
                "--log-format",
                "json",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    s = Setup(stack, redis_server, log)
    try:
        assert wait_until(lambda: all(c.ok is not False for c in s.doctor().values()), timeout=15), s.doctor()
        s.proc = proc  # type: ignore[attr-defined]
        yield s
    finally:
        proc.terminate()
        proc.wait(10)


def test_healthy_stack_passes_every_check(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    checks = setup.doctor()
    assert set(checks) == {
        "service config",
        "envoy admin",
        "llm-extproc cluster",
        "clusters agree",
        "route metadata",
        "redis",
        "snapshots gpu-a",
        "snapshots gpu-b",
        "calibration",
    }
    assert checks["calibration"].ok is None  # nothing routed yet: nothing learnt
    assert all(c.ok for name, c in checks.items() if name != "calibration")
    assert f"127.0.0.1:{setup.stack.service_port}" in checks["llm-extproc cluster"].detail
    assert "READY" in checks["snapshots gpu-a"].detail
    # Traffic: the publisher copies the engines' prompt-token counters into the snapshots, the
    # service compares them with what it routed, the doctor reads the ratio off its /metrics (the
    # simulated engines count ~4 characters a token, as bytes / 4 does: no note).
    url = f"http://127.0.0.1:{setup.stack.listener_port}/v1/chat/completions"
    for q in range(12):
        body = {
            "model": "sim-llama",
            "messages": [{"role": "user", "content": f"question {q} " + "about the weather " * 40}],
            "max_tokens": 4,
        }
        assert post_json(url, body) == 200
    assert wait_until(lambda: setup.doctor()["calibration"].ok is True, timeout=15), setup.doctor()
    calibration = setup.doctor()["calibration"]
    assert "token ratio" in calibration.detail and not calibration.warn, calibration.detail
    # The command itself: one line per check, exit 0.
    status = main(
        [
            "doctor",
            "--config",
            setup.config,
            "--envoy-admin",
            setup.admin,
            "--service-metrics",
            setup.stack.metrics_url,
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[-1] == "all checks passed"
    assert all(line.startswith("OK ") for line in out[:-1]) and len(out) == 10


def post_json(url: str, body: dict[str, object]) -> int:
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        return int(r.status)


def test_publish_logs_what_it_found_and_state_changes(setup: Setup) -> None:
    logs = setup.publish_logs()
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in logs)
    start = logs[0]["message"]
    assert "every 0.3 s" in start and "Envoy admin" in start and "llm-extproc:default" in start
    discovery = next(e for e in logs if "envoy discovery" in e["message"])
    assert sorted(discovery["instances"]) == sorted(
        f"{c}/127.0.0.1:{p}" for c, p in zip(["gpu-a", "gpu-b"], setup.stack.engines.ports, strict=True)
    )
    changes = [e for e in logs if e.get("state")]
    assert {(e["upstream"].split("/")[0], e["previous"], e["state"]) for e in changes} == {
        ("gpu-a", "NEW", "READY"),
        ("gpu-b", "NEW", "READY"),
    }
    # An engine that stops answering health: one WARNING line READY -> ..., with the reason.
    engine = setup.stack.engines.engines[0]
    engine.ready = False
    try:
        assert wait_until(lambda: any(e.get("previous") == "READY" for e in setup.publish_logs()))
        # The doctor sees it too, and says which upstream is in which state.
        check = setup.doctor()["snapshots gpu-a"]
        assert check.ok is False and "DRAINING" in check.detail and "gpu-a/127.0.0.1:" in check.detail
        assert setup.doctor()["snapshots gpu-b"].ok
    finally:
        engine.ready = True
    down = next(e for e in setup.publish_logs() if e.get("previous") == "READY")
    assert down["level"] == "WARNING" and down["reason"] == "health_status_503"
    assert down["upstream"].startswith("gpu-a/")
    # Back: READY again in the log, and the doctor passes.
    assert wait_until(lambda: setup.doctor()["snapshots gpu-a"].ok is True)
    assert any(e.get("previous") == "DRAINING" and e["state"] == "READY" for e in setup.publish_logs())


def test_redis_down_fails_redis_and_snapshots(setup: Setup) -> None:
    setup.redis.stop()
    checks = setup.doctor()
    assert checks["redis"].ok is False and "unreachable" in checks["redis"].detail
    assert checks["snapshots"].ok is False
    assert checks["envoy admin"].ok and checks["llm-extproc cluster"].ok  # the rest still checked
    text, status = report(list(checks.values()))
    assert status == 1 and "FAIL redis:" in text


def test_stopped_publisher_leaves_no_or_stale_snapshots(setup: Setup) -> None:
    setup.proc.terminate()  # type: ignore[attr-defined]
    setup.proc.wait(10)  # type: ignore[attr-defined]
    # Snapshots expire from Redis with their TTL (max(3 x interval, 2 s)).
    assert wait_until(lambda: setup.doctor()["snapshots gpu-a"].ok is False, timeout=8)
    check = setup.doctor()["snapshots gpu-a"]
    assert "no snapshot" in check.detail and "llm-extproc publish" in check.detail
    # A snapshot still in Redis but past its own TTL (a publisher whose clock or key TTL is off) is stale.
    put_snapshot(
        setup,
        engine="vllm",
        published_at_ms=int((time.time() - 60) * 1000),
        ttl_ms=3000,
        publisher_id="old-publisher",
        num_running=0,
    )
    check = setup.doctor()["snapshots gpu-b"]
    assert check.ok is False and "stale" in check.detail and "old-publisher" in check.detail


def test_cluster_missing_from_envoy_yaml(setup: Setup, tmp_path: Path) -> None:
    cfg = yaml.safe_load(Path(setup.config).read_text())
    cfg["pool"]["clusters"].append({"name": "gpu-c", "models": ["sim-llama"]})
    bad = tmp_path / "service.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    checks = setup.doctor(config=str(bad))
    assert checks["clusters agree"].ok is False
    assert "not in Envoy: gpu-c" in checks["clusters agree"].detail
    assert checks["snapshots gpu-c"].ok is False
    # The same against the file instead of the live config: the shipped envoy.yaml lacks gpu-c too.
    checks = setup.doctor(config=str(bad), envoy_admin=None, envoy_config=str(ENVOY_DIR / "envoy.yaml"))
    assert checks["clusters agree"].ok is False and checks["envoy admin"].ok is None
    # A pool that forgets a tagged Envoy cluster.
    cfg["pool"]["clusters"] = [c for c in cfg["pool"]["clusters"] if c["name"] == "gpu-a"]
    bad.write_text(yaml.safe_dump(cfg))
    check = setup.doctor(config=str(bad))["clusters agree"]
    assert check.ok is False and "not in the service YAML's pool: gpu-b" in check.detail


def test_envoy_down_and_service_down(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    setup.stack.service.kill()
    assert wait_until(lambda: setup.doctor()["llm-extproc cluster"].ok is False, timeout=15)
    assert "no healthy host" in setup.doctor()["llm-extproc cluster"].detail
    setup.stack.envoy.stop()
    checks = setup.doctor()
    assert checks["envoy admin"].ok is False and "is Envoy running" in checks["envoy admin"].detail
    assert main(["doctor", "--config", setup.config, "--envoy-admin", setup.admin]) == 1
    assert "FAIL envoy admin:" in capsys.readouterr().out


def test_engine_priority_probe_finds_engines_left_on_fcfs(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM does not publish its scheduling policy; with `engine_priority:` an engine left on FCFS
    answers 400 to every critical and sheddable request. `--probe-engines` asks each engine."""
    cfg = yaml.safe_load(Path(setup.config).read_text())
    path = tmp_path / "service.yaml"

    def with_engine_priority(section: dict[str, object]) -> str:
        path.write_text(yaml.safe_dump({**cfg, "engine_priority": section}))
        return str(path)

    # Not asked for: skipped, saying how to ask; the engines saw nothing.
    check = setup.doctor(config=with_engine_priority({}))["engine priority"]
    assert check.ok is None and "--probe-engines" in check.detail and "gpu-a, gpu-b" in check.detail
    a, b = setup.stack.engines.engines  # gpu-a, gpu-b
    assert not a.stats.priorities and not b.stats.priorities
    a.scheduling_policy = "priority"  # b stays on FCFS
    try:
        checks = setup.doctor(config=with_engine_priority({}), probe_engines=True)
        good, bad = checks["engine priority gpu-a"], checks["engine priority gpu-b"]
        assert good.ok is True and "accepts priority -1" in good.detail, good
        assert bad.ok is False and "HTTP 400" in bad.detail and "--scheduling-policy priority" in bad.detail
        assert "engine_priority.clusters" in bad.detail
        assert a.stats.priorities == [-1] and b.stats.priorities == [-1]
        # The command: exit status 1, the FAIL line names the engine.
        args = ["doctor", "--config", str(path), "--envoy-admin", setup.admin, "--probe-engines"]
        assert main(args) == 1
        assert f"FAIL engine priority gpu-b: gpu-b/127.0.0.1:{setup.stack.engines.ports[1]}" in (
            capsys.readouterr().out
        )
        # `clusters:` leaves gpu-b out: it is not asked, and everything passes.
        asked_b = len(b.stats.priorities)
        checks = setup.doctor(config=with_engine_priority({"clusters": ["gpu-a"]}), probe_engines=True)
        assert "engine priority gpu-b" not in checks and checks["engine priority gpu-a"].ok is True
        assert len(b.stats.priorities) == asked_b
        # Numbers the engines would read as higher-first: the critical value is what is sent.
        higher_first = with_engine_priority({"critical": 7, "sheddable": -3})
        checks = setup.doctor(config=higher_first, probe_engines=True)
        assert "accepts priority 7" in checks["engine priority gpu-a"].detail
        # An engine that does not answer (a snapshot whose address nobody listens on) fails too.
        put_snapshot(
            setup,
            engine="vllm",
            models=["sim-llama"],
            published_at_ms=int(time.time() * 1000),
            ttl_ms=60_000,
            publisher_id="p",
        )
        check = setup.doctor(config=with_engine_priority({}), probe_engines=True)["engine priority gpu-b"]
        assert check.ok is False and "gpu-b/127.0.0.1:1 (127.0.0.1:1): no answer" in check.detail
        # Every class written as 0: nothing any engine could refuse, so nothing is sent.
        zero = {"critical": 0, "standard": 0, "sheddable": 0}
        sent = len(a.stats.priorities)
        check = setup.doctor(config=with_engine_priority(zero), probe_engines=True)["engine priority"]
        assert check.ok is None and "as 0" in check.detail and len(a.stats.priorities) == sent
    finally:
        a.scheduling_policy = "fcfs"


def test_a_snapshot_without_load_or_kv_figures_is_a_warning(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    """A publisher told the wrong engine type reads none of the server's metric names: the snapshot
    is fresh and READY, so the service routes there, but on the fleet's median load and an assumed
    KV size. The doctor says so (WARN) without failing."""
    checks = setup.doctor()
    assert "signals gpu-b" not in checks  # the simulated engines publish everything
    put_snapshot(
        setup,
        engine="tgi",
        published_at_ms=int(time.time() * 1000),
        ttl_ms=60_000,
        publisher_id="misconfigured",
        load_presence=True,  # as `llm-extproc publish` writes: unset load fields are unknown, not 0
    )
    checks = setup.doctor()
    warn = checks["signals gpu-b"]
    assert warn.ok is True and warn.warn
    assert warn.detail.startswith(
        "gpu-b/127.0.0.1:1: no load figures (running, waiting, KV usage), no KV capacity"
    )
    assert "`engine`" in warn.detail and f"gpu-b/127.0.0.1:{setup.stack.engines.ports[1]}" not in warn.detail
    assert checks["snapshots gpu-b"].ok is True and "signals gpu-a" not in checks
    assert main(["doctor", "--config", setup.config, "--envoy-admin", setup.admin]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "all checks passed (1 warning)"
    assert any(line.startswith("WARN signals gpu-b: gpu-b/127.0.0.1:1") for line in out)


def test_admission_without_published_batch_limits_is_a_warning(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM publishes no `--max-num-seqs`: with admission on, a cold fleet's batches fill before
    their limits show, ahead of critical requests. The doctor names the upstreams lacking it and
    says where to set it; with admission off it says nothing."""
    assert "batch limits" not in setup.doctor()  # admission off (the shipped default)
    cfg = yaml.safe_load(Path(setup.config).read_text())
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump({**cfg, "admission": {"enabled": True}}))
    warn = setup.doctor(config=str(path))["batch limits"]
    ports = setup.stack.engines.ports
    assert warn.ok is True and warn.warn
    assert warn.detail.startswith(f"2 of 2 upstreams publish no max_num_seqs (gpu-a/127.0.0.1:{ports[0]}, ")
    assert f"gpu-b/127.0.0.1:{ports[1]}" in warn.detail and "--max-num-seqs" in warn.detail
    # An upstream whose publisher was told the figure is not listed.
    put_snapshot(
        setup,
        engine="vllm",
        published_at_ms=int(time.time() * 1000),
        ttl_ms=60_000,
        publisher_id="p",
        max_num_seqs=8,
    )
    warn = setup.doctor(config=str(path))["batch limits"]
    assert warn.detail.startswith("2 of 3 upstreams") and "127.0.0.1:1" not in warn.detail
    assert main(["doctor", "--config", str(path), "--envoy-admin", setup.admin]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("WARN batch limits: 2 of 3 upstreams") for line in out), out
    assert out[-1].startswith("all checks passed (")  # the bare snapshot also lacks load figures


def test_batch_limits_check_counts_fresh_ready_upstreams_of_the_pool() -> None:
    from extproc.config import config_from_dict
    from extproc.doctor import check_batch_limits
    from extproc.fleet.snapshots import InstanceState, decode

    now = time.time()
    config = config_from_dict(
        {"pool": {"clusters": [{"name": "gpu-a", "models": ["m"]}]}, "admission": {"enabled": True}}
    )

    def state(
        uid: str, seqs: int | None, ready: int = spb.READY, age_s: float = 0.0, cluster: str = "gpu-a"
    ) -> InstanceState:
        snap = spb.UpstreamSnapshot(
            upstream_id=f"{cluster}/{uid}",
            cluster=cluster,
            readiness=ready,
            published_at_ms=int((now - age_s) * 1000),
            ttl_ms=5_000,
        )
        if seqs is not None:
            snap.max_num_seqs = seqs
        return decode(snap.SerializeToString(), frozenset({"gpu-a", "gpu-b"}))

    ok = check_batch_limits(config, [state("a:1", 8), state("a:2", 256)])
    assert ok.ok is True and not ok.warn and ok.detail == "max_num_seqs known for all 2 upstreams"
    # Stale, not ready or outside the pool: not counted either way.
    others = [
        state("a:3", None, age_s=60.0),
        state("a:4", None, ready=spb.DOWN),
        state("b:1", None, cluster="gpu-b"),
    ]
    assert check_batch_limits(config, [state("a:1", 8), *others]).detail.startswith(
        "max_num_seqs known for all 1"
    )
    skipped = check_batch_limits(config, others)
    assert skipped.ok is None
    many = check_batch_limits(config, [state(f"a:{i}", None) for i in range(6)] + [state("a:9", 8)])
    assert many.warn and many.detail.startswith(
        "6 of 7 upstreams publish no max_num_seqs (gpu-a/a:0, gpu-a/a:1,"
    )
    assert "gpu-a/a:3 and 2 more)" in many.detail


# -- calibration (the service's /metrics) -------------------------------------------------------------


def _calibration_metrics(ratios: dict[str, float], relative: dict[str, float] | None = None) -> str:
    """The service's calibration series; an upstream's TTFT error is 0.8 s wherever `relative` names it."""
    lines = ["# TYPE llm_extproc_calibration_token_ratio gauge"]
    lines += [
        f'llm_extproc_calibration_token_ratio{{profile="default",upstream="{u}"}} {r}'
        for u, r in ratios.items()
    ]
    lines.append("# TYPE llm_extproc_calibration_ttft_relative_error gauge")
    lines += [
        f'llm_extproc_calibration_ttft_relative_error{{profile="default",upstream="{u}"}} {e}'
        for u, e in (relative or {}).items()
    ]
    lines.append("# TYPE llm_extproc_calibration_ttft_error_seconds gauge")
    lines += [
        f'llm_extproc_calibration_ttft_error_seconds{{profile="default",upstream="{u}"}} 0.8'
        for u in (relative or {})
    ]
    return "\n".join(lines) + "\n"


def test_calibration_findings_name_a_wrong_tokenizer_and_a_late_engine(tmp_path: Path) -> None:
    from test_tokenization import train_bytelevel

    from extproc.config import config_from_dict
    from extproc.doctor import calibration_findings

    train_bytelevel(tmp_path / "tokenizer.json")
    pool = {"clusters": [{"name": "gpu-a", "models": ["llama"]}, {"name": "gpu-b", "models": ["other"]}]}
    cfg = config_from_dict(
        {"pool": pool, "metrics_listen": None, "tokenizers": {"llama": {"tokenizer_json": "tokenizer.json"}}},
        base_dir=tmp_path,
    )
    # gpu-a has a tokenizer and the engines count 1.6x it: the wrong tokenizer. gpu-b has none and its
    # engines count 0.57x bytes/4: calibrated, a note. Both alike otherwise: nothing to say.
    warnings, notes, ratios = calibration_findings(
        _calibration_metrics({"gpu-a": 1.6, "gpu-b": 0.57}, {"gpu-b": 1.8}), cfg
    )
    assert ratios == {"gpu-a": 1.6, "gpu-b": 0.57}
    assert len(warnings) == 2
    assert "gpu-a counts 1.60 tokens per token of the configured tokenizer" in warnings[0]
    assert "gpu-b's first tokens come 2.8x as late as predicted" in warnings[1]
    assert len(notes) == 1 and "gpu-b counts 0.57 tokens per 4 bytes" in notes[0]
    assert calibration_findings(_calibration_metrics({"gpu-a": 1.02, "gpu-b": 1.1}), cfg)[:2] == ([], [])
    guard = (
        _calibration_metrics({"gpu-a": 1.0})
        + "# TYPE llm_extproc_bounded_load_dropped counter\n"
        + 'llm_extproc_bounded_load_dropped_total{profile="default",upstream="gpu-a"} 17.0\n'
    )
    assert calibration_findings(guard, cfg)[1] == [
        "bounded-load took gpu-a out 17 times since the service started (over twice its share with "
        "requests waiting there)"
    ]


async def test_calibration_check_reads_the_services_metrics(tmp_path: Path) -> None:
    from aiohttp import web
    from builders import serve_http

    from extproc.config import config_from_dict
    from extproc.doctor import _check_calibration

    cfg = config_from_dict(
        {"pool": {"clusters": [{"name": "gpu-a", "models": ["m"]}]}, "metrics_listen": None}
    )
    text = _calibration_metrics({"gpu-a": 0.98})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text)

    runner, port = await serve_http("GET", "/metrics", metrics)
    try:
        check = await _check_calibration(cfg, DoctorOptions(service_metrics=f"http://127.0.0.1:{port}"))
        assert (
            check.ok is True and not check.warn and "token ratio 0.98-0.98 over 1 upstreams" in check.detail
        )
        text = _calibration_metrics({"gpu-a": 0.98}, {"gpu-a": 3.0})
        check = await _check_calibration(cfg, DoctorOptions(service_metrics=f"http://127.0.0.1:{port}"))
        assert check.warn and "4.0x as late as predicted" in check.detail
        text = "# nothing\n"
        check = await _check_calibration(cfg, DoctorOptions(service_metrics=f"http://127.0.0.1:{port}"))
        assert check.ok is None and "nothing learnt yet" in check.detail
    finally:
        await runner.cleanup()
    gone = await _check_calibration(
        cfg, DoctorOptions(service_metrics=f"http://127.0.0.1:{port}", timeout_s=1)
    )
    assert gone.ok is None and "unreachable" in gone.detail
    assert (await _check_calibration(cfg, DoctorOptions())).ok is None  # no metrics_listen: not checked
