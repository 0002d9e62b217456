"""Request lifecycle: parse -> admit -> schedule -> record (the stream layer responds)."""

from extproc.lifecycle.router import Decision, RequestLifecycle

__all__ = ["Decision", "RequestLifecycle"]
