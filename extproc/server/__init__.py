"""ext_proc gRPC server: stream state machine, response builders, process bootstrap."""

from extproc.server.app import RunningService, serve, start

__all__ = ["RunningService", "serve", "start"]
