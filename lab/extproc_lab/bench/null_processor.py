"""A do-nothing ext_proc processor in Python: the floor a Python processor sets for the overhead bench.

    python -m extproc_lab.bench.null_processor --port 50051 --cluster gpu-a

The same message exchange as llm-extproc under the shipped envoy.yaml (request headers, then the
buffered body; nothing of the response; each request's access-log entry on Envoy's gRPC access-log
stream), the same server stack (grpc.aio, the Envoy protos, the gRPC health service Envoy checks),
and nothing else: each request's headers get an empty reply, its body a reply that sets the
destination-cluster header to `--cluster` (a comma list: each in turn, as the service spreads
requests) and a ticket header (so that Envoy sends the entry), and its log entry is read and dropped.
No parsing, no scheduling, no Redis. `llm-extproc bench-overhead --workers 1` runs it beside the
service to tell the service's own cost from what any Python processor pays
(extproc_lab.bench.workers_overhead).
`--busy-us N` spends N microseconds of CPU on the event loop before each body reply: a processor whose
only work is a decision of that cost (`--null-busy-us` of the bench), the floor of a real one.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

HEADER = "x-llm-destination-cluster"
TICKET = "x-llm-ticket"  # what the service sets so that Envoy logs the request to it (envoy.yaml)


class NullProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, clusters: Sequence[str], busy_us: float = 0.0) -> None:
        self.busy_s = busy_us / 1e6
        self.headers_reply = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        self.body_replies = [self._body_reply(c) for c in clusters]  # taken in turn, as Envoy's round robin
        self.turn = 0

    @staticmethod
    def _body_reply(cluster: str) -> pb.ProcessingResponse:
        value = core.HeaderValue(key=HEADER, raw_value=cluster.encode())
        ticket = core.HeaderValue(key=TICKET, raw_value=b"null")
        route = pb.HeaderMutation(
            set_headers=[core.HeaderValueOption(header=value), core.HeaderValueOption(header=ticket)]
        )
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(header_mutation=route, clear_route_cache=True)
            )
        )

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """The reader/writer API, as the service uses it; the call ends once the body is answered."""
        while (msg := await context.read()) is not grpc.aio.EOF:
            if msg.HasField("request_headers"):
                await context.write(self.headers_reply)
                if msg.request_headers.end_of_stream:  # no body: routed on the headers
                    return
            elif msg.HasField("request_body") and msg.request_body.end_of_stream:
                if self.busy_s:
                    _spin(self.busy_s)
                self.turn = (self.turn + 1) % len(self.body_replies)
                await context.write(self.body_replies[self.turn])
                return


def _spin(seconds: float) -> None:
    """CPU time, not a sleep: the stand-in for a decision's work holds the loop as one would."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class NullAccessLog(als_pb2_grpc.AccessLogServiceServicer):
    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(port: int, clusters: Sequence[str], busy_us: float = 0.0) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(clusters, busy_us), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(NullAccessLog(), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    for name in ("", pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name):  # what Envoy asks
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cluster", required=True, help="the destination cluster, or a comma list taken in turn")
    ap.add_argument(
        "--busy-us", type=float, default=0.0, help="CPU microseconds spent before each body reply"
    )
    args = ap.parse_args(argv)
    asyncio.run(serve(args.port, args.cluster.split(","), args.busy_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
