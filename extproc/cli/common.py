"""What every command shares: the help formatter, the log flags, the event loop runner, the checks
that fail in one line before anything starts."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

from extproc.settings import ENV_REDIS_PASSWORD
from extproc.telemetry.logs import LOG_FORMATS, LOG_LEVELS

log = logging.getLogger("extproc.cli")
T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end on uvloop where installed (the service's event loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something: not None, not a switch's False,
    and not when the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
            or isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


LOG_OPTION_DESTS = ("log_level", "log_format")


def add_log_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--log-level and --log-format, before the command (top) and after it (each command, where the
    defaults are suppressed so a value given before the command survives)."""
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO" if top else argparse.SUPPRESS,
        help="log threshold, any case (default: INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if top else argparse.SUPPRESS,
        help="text lines, or one JSON object per line: ts, level, logger, message, extra fields "
        "(default: text)",
    )


def check_listen(address: str, flag: str) -> None:
    """Fail in one line, before anything starts, when `address` (host:port) cannot be listened on here:
    a host that does not resolve, an address that is not this machine's, or a port already taken.
    SO_REUSEPORT is set as the gRPC server sets it, so only what would really clash is refused."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} {address!r}: expected host:port with a port 0-65535")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{flag} {address}: cannot resolve host {host!r} ({reason})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    f"{flag} {address}: port {port} is already in use (another llm-extproc, engine or "
                    "Envoy?); stop it or pick a free port"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(
                    f"{flag} {address}: {host} is not an address of this machine; use 127.0.0.1, "
                    "0.0.0.0 or one of its own IPs"
                ) from None
            if exc.errno == errno.EACCES:
                raise OSError(f"{flag} {address}: port {port} needs privileges; use a port >= 1024") from None
            raise OSError(f"{flag} {address}: cannot listen ({exc.strerror or exc})") from None


def warn_credentials_in_argv(flag: str, url: str | None) -> bool:
    """Log a warning when a Redis URL given on the command line carries credentials (`user:pw@`):
    every user of the host reads a process's arguments (`ps`, /proc/<pid>/cmdline). True if it did.
    The password belongs in $LLM_EXTPROC_REDIS_PASSWORD, which is used in place of the URL's."""
    if not url:
        return False
    rest = url.partition("://")[2] or url
    if "@" not in rest:
        return False
    log.warning(
        "%s carries credentials: every user of this host can read them in the process list "
        "(/proc/<pid>/cmdline); pass the URL without them and the password in $%s",
        flag,
        ENV_REDIS_PASSWORD,
    )
    return True
