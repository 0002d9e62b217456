"""The command line as a first-time user meets it: help for everything, global flags anywhere, JSON logs,
and one-line errors (exit 2, no traceback) for busy ports and bad addresses."""

from __future__ import annotations

import argparse
import io
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.cli import build_parser, main
from extproc.telemetry.logs import JsonFormatter, setup_logging

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import service_config


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_has_a_description_and_every_flag_help() -> None:
    commands = subcommands()
    assert {"serve", "publish", "sim", "doctor", "check-config", "init"} <= set(commands)
    for name, p in commands.items():
        assert p.description, f"{name} has no description"
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_help_shows_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # no wrapping inside "(default: ...)"
    commands = subcommands()
    sim = commands["sim"].format_help()
    assert "(default: 8001)" in sim and "(default: 127.0.0.1)" in sim and "(default: sim-llama)" in sim
    assert "(default: None)" not in sim
    assert "(default: 3.0)" in commands["doctor"].format_help()
    for name, p in commands.items():
        text = p.format_help()
        assert "--log-level" in text and "(default: INFO)" in text and "(default: text)" in text, name
        assert "(default: None)" not in text and "(default: False)" not in text, name


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["serve"], "INFO", "text"),
        (["serve", "--log-level", "debug"], "DEBUG", "text"),
        (["--log-level", "WARNING", "serve"], "WARNING", "text"),
        (["--log-level", "WARNING", "serve", "--log-level", "error"], "ERROR", "text"),
        (["--log-format", "json", "sim"], "INFO", "json"),
        (["publish", "--log-format", "json", "--log-level", "DEBUG"], "DEBUG", "json"),
    ],
)
def test_global_flags_before_or_after_the_command(argv: list[str], level: str, fmt: str) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "LOUD", "check-config"],
        ["check-config", "--log-level", "verbose"],
        ["serve", "--log-format", "xml"],
    ],
)
def test_bad_log_options_are_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_json_formatter_one_object_per_line_with_extra_fields() -> None:
    stream = io.StringIO()
    setup_logging("DEBUG", "json", stream)
    try:
        logging.getLogger("extproc.test").info("hello %s", "there", extra={"upstream": "gpu-a/x"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("extproc.test").exception("failed")
    finally:
        setup_logging("INFO", "text")
    lines = stream.getvalue().splitlines()
    first = json.loads(lines[0])
    assert first["message"] == "hello there" and first["level"] == "INFO"
    assert first["logger"] == "extproc.test" and first["upstream"] == "gpu-a/x"
    assert first["ts"].endswith("+00:00")
    second = json.loads(lines[1])
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc"]
    assert len(lines) == 2  # the traceback stays inside its JSON line
    assert isinstance(JsonFormatter().format(logging.makeLogRecord({"msg": "x"})), str)


# -- real processes ------------------------------------------------------------------------------
def run_cli(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(service_config()))
    return str(path)


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("llm-extproc: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.integration
def test_busy_ports_are_one_line_errors(busy_port: int, config: str) -> None:
    address = f"127.0.0.1:{busy_port}"
    one_line_error(run_cli("serve", "--config", config, "--listen", address), "--listen", "already in use")
    one_line_error(
        run_cli("serve", "--config", config, "--listen", "127.0.0.1:0", "--metrics-listen", address),
        "--metrics-listen",
        "already in use",
    )
    one_line_error(run_cli("sim", "--port", str(busy_port), "--count", "1"), "already in use")
    one_line_error(
        run_cli(
            "publish",
            "--envoy-admin",
            "http://127.0.0.1:1",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--metrics-listen",
            address,
        ),
        "--metrics-listen",
        "already in use",
    )


@pytest.mark.integration
def test_bad_addresses_are_one_line_errors(config: str) -> None:
    # 192.0.2.1 is TEST-NET-1: never an address of this machine.
    one_line_error(
        run_cli("serve", "--config", config, "--listen", "192.0.2.1:9002"), "not an address of this machine"
    )
    one_line_error(run_cli("serve", "--config", config, "--listen", "bad..host:9002"), "bad..host")
    one_line_error(run_cli("sim", "--host", "192.0.2.1", "--count", "1"), "not an address of this machine")
    one_line_error(run_cli("sim", "--host", "bad..host", "--count", "1"), "cannot resolve")
    one_line_error(run_cli("serve", "--config", config, "--listen", "127.0.0.1:99999"), "port")


@pytest.mark.integration
def test_serve_logs_json_after_the_subcommand(config: str) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc.cli",
            "serve",
            "--config",
            config,
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = json.loads(proc.stderr.readline())
        while "listening" not in first["message"]:
            first = json.loads(proc.stderr.readline())
        assert first["level"] == "INFO" and first["logger"].startswith("extproc")
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.integration
def test_publish_says_what_it_does_and_logs_discovery_errors() -> None:
    """Not minutes of silence: the plan at start, then each failed discovery with the admin URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here once the socket is closed
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc.cli",
            "publish",
            "--envoy-admin",
            f"http://127.0.0.1:{closed}",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        start = json.loads(proc.stderr.readline())
        assert start["message"].startswith("publishing to redis://127.0.0.1:1/0")
        assert f"Envoy admin http://127.0.0.1:{closed}" in start["message"]
        failed = json.loads(proc.stderr.readline())
        assert failed["level"] == "WARNING" and failed["envoy_admin"] == f"http://127.0.0.1:{closed}"
        assert "envoy discovery" in failed["message"] and "failed" in failed["message"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_redis_password_in_argv_is_warned_about_and_the_env_var_serves_instead(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A process's arguments are world-readable (/proc/<pid>/cmdline): `--redis-url` / `--redis` with
    credentials get a warning at startup (never the password itself), the help says where the password
    goes, and $LLM_EXTPROC_REDIS_PASSWORD reaches doctor's Redis client as it reaches the service's."""
    import extproc.doctor as doctor
    from extproc.config import config_from_dict
    from extproc.settings import ENV_REDIS_PASSWORD

    commands = subcommands()
    assert ENV_REDIS_PASSWORD in commands["publish"].format_help().replace("\n", "")
    assert ENV_REDIS_PASSWORD in commands["doctor"].format_help().replace("\n", "")

    seen: list[doctor.DoctorOptions] = []

    async def fake_run(opts: doctor.DoctorOptions, wait_s: float = 0.0) -> list[doctor.Check]:
        seen.append(opts)
        return []

    monkeypatch.setattr(doctor, "run_doctor_until", fake_run)
    try:
        assert main(["doctor", "--redis", "redis://admin:Hunter2@127.0.0.1:6379/0"]) == 0
        err = capsys.readouterr().err
        assert "--redis carries credentials" in err and ENV_REDIS_PASSWORD in err and "Hunter2" not in err
        assert main(["doctor", "--redis", "redis://127.0.0.1:6379/0"]) == 0
        assert "credentials" not in capsys.readouterr().err
    finally:
        setup_logging("INFO", "text")
    assert [o.redis_url for o in seen] == [
        "redis://admin:Hunter2@127.0.0.1:6379/0",
        "redis://127.0.0.1:6379/0",
    ]

    monkeypatch.setenv(ENV_REDIS_PASSWORD, "from-the-env")
    static = config_from_dict({"pool": {"clusters": [{"name": "a", "models": ["m"]}]}})
    settings = doctor._redis_settings(static, "redis://127.0.0.1:6379/0")
    assert settings is not None and settings.password == "from-the-env"
