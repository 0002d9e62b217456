"""What the endpoint-picker protocol has the proxy tell the picker, read out of ext_proc messages.

Gateway API Inference Extension, docs/proposals/004-endpoint-picker-protocol (v1.0.0):

- subset hint (request): filter metadata namespace `envoy.lb.subset_hint`, key
  `x-gateway-destination-endpoint-subset`, a list of `ip:port`. The picker MUST pick only inside it
  and answer 503 when nothing in it is eligible (an empty list included).
- served endpoint (response): metadata namespace `envoy.lb`, key
  `x-gateway-destination-endpoint-served`, the `ip:port` that actually served (the proxy may have
  gone down the fallback list on retries).

Both arrive in `ProcessingRequest.metadata_context` when Envoy's ext_proc filter forwards those
namespaces (`metadata_options.forwarding_namespaces.untyped`, envoy/endpoint-picker.yaml).
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Value

from extproc.lifecycle import Decision, RequestLifecycle
from extproc.lifecycle.endpoints import move_to_served

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Proxies following an early draft of the protocol put the subset under envoy.lb: accepted too.
_SUBSET_NAMESPACES = (SUBSET_NAMESPACE, SERVED_NAMESPACE)


def _strings(value: Value) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return [s for s in (i.strip() for i in items) if s]


def subset_hint(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints this request may go to; None when the proxy sent no hint (any endpoint).
    A hint present but empty (or with no string in it) is an empty set: nothing is eligible."""
    if not msg.HasField("metadata_context"):
        return None
    namespaces = msg.metadata_context.filter_metadata
    for ns in _SUBSET_NAMESPACES:
        if ns in namespaces:
            fields = namespaces[ns].fields
            if SUBSET_KEY in fields:
                return frozenset(_strings(fields[SUBSET_KEY]))
    return None


def served_endpoint(msg: pb.ProcessingRequest, headers: dict[str, str] | None = None) -> str | None:
    """The endpoint that served the request: from the metadata the protocol names, or else from a
    response header of the same name (a gateway can add it with %UPSTREAM_REMOTE_ADDRESS%)."""
    if msg.HasField("metadata_context"):
        namespaces = msg.metadata_context.filter_metadata
        if SERVED_NAMESPACE in namespaces:
            fields = namespaces[SERVED_NAMESPACE].fields
            if SERVED_KEY in fields:
                found = _strings(fields[SERVED_KEY])
                if found:
                    return found[0]
    if headers:
        value = headers.get(SERVED_KEY, "").split(",")[0].strip()
        return value or None
    return None


def record_served(lifecycle: RequestLifecycle, decision: Decision, served: str) -> str:
    """Count where the request was served and move its lease if that is not the pick."""
    outcome = move_to_served(lifecycle.inflight, lifecycle.config.pool, decision, served)
    lifecycle.metrics.endpoint_served_by(outcome).inc()
    return outcome
