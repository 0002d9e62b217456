"""The simulated engine's KV-cache event publisher: vLLM's ZMQ PUB side.

Each engine step's events (EngineModel.drain_kv_events) go out as one `KVEventBatch`, in the
multipart message vLLM's `ZmqEventPublisher` sends: `[topic, seq (8-byte big-endian, from 0),
payload (msgpack, extproc.publishers.kv_events.encode_batch)]`. Like vLLM's publisher it binds (the
subscriber connects) and never blocks: PUB drops messages past the high-water mark, and a subscriber
sees the hole in `seq`. vLLM's replay ROUTER socket is not simulated.
"""

from __future__ import annotations

import contextlib
import time

import zmq

from extproc.publishers.kv_events import KvEvent, KVEventBatch, encode_batch


class KvEventPublisher:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, topic: str = "", hwm: int = 100_000) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.set_hwm(hwm)
        endpoint = f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
        self._sock.bind(endpoint)
        last: bytes | str | int = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.port = int((last.decode() if isinstance(last, bytes) else str(last)).rpartition(":")[2])
        self._topic = topic.encode()
        self.seq = 0
        self.skip_next = 0  # tests: drop this many batches (a subscriber then sees a sequence gap)

    def publish(self, events: list[KvEvent]) -> None:
        seq = self.seq
        self.seq += 1
        if self.skip_next > 0:
            self.skip_next -= 1
            return
        payload = encode_batch(KVEventBatch(time.time(), events, 0))
        # Past the high-water mark the message is dropped, as vLLM's PUB socket drops it.
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
