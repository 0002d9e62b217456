"""A body-parsing worker: `python -m extproc.openai.worker [--nice N] [--shm FD SIZE] [module:function]`.

The service (lifecycle/bodies.py) starts a few of these and hands each big request body to an idle
one, so that orjson, which holds the GIL while it parses, never stalls the event loop. One request
at a time; small frames on stdin/stdout, the bulk in a buffer shared with the service (a memfd
mapped by both, `--shm`), so each side copies a 15 MB body once rather than through pipe chunks:

    request  REQUEST (where, meta length, body length), pickle.dumps((head, keep_messages)), then the
             body itself if `where` is INLINE, else it is already in the shared buffer
    reply    REPLY (status, where, payload length), then the payload if INLINE, else it is in the
             shared buffer: the pickled InferenceRequest (OK), the RequestError to answer with
             (REJECTED), or a one-line description of a bug (FAILED)

Without `--shm`, or for what does not fit the buffer, everything goes inline. The worker imports only
this package and orjson (never the service's `__main__`), keeps big buffers in its heap while busy
and hands them back to the OS after a second idle (tune_allocator), ignores SIGINT (the service stops
it by closing stdin) and exits at end of input. Anything printed goes to stderr: stdout carries only
frames.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import mmap
import os
import pickle
import select
import signal
import struct
import sys
import traceback
from collections.abc import Callable

from extproc.openai.errors import RequestError
from extproc.openai.parse import Body, InferenceRequest, RequestHead, parse_detached

REQUEST = struct.Struct("<BIQ")
REPLY = struct.Struct("<BBQ")
OK, REJECTED, FAILED = 0, 1, 2
SHARED, INLINE = 0, 1
MODULE = __name__
# glibc: by default a freed 15 MB buffer is unmapped (or the heap top trimmed) at once, so the next
# body faults every page in again, which costs more than the copy itself. Keep big buffers in the
# heap instead, and hand free memory back with malloc_trim once idle.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum
TRIM_THRESHOLD = 256 * 1024 * 1024
IDLE_TRIM_S = 1.0

Parser = Callable[[RequestHead, Body, bool], InferenceRequest]


def load_parser(spec: str | None) -> Parser:
    """`module:function`, or the default parse_detached."""
    if not spec:
        return parse_detached
    module, _, name = spec.partition(":")
    parser: Parser = getattr(importlib.import_module(module), name)
    return parser


def read_exactly(fd: int, size: int) -> bytearray | None:
    """`size` bytes from `fd` into one buffer (no per-read allocation), or None at end of input."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return None
        got += n
    return buf


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def tune_allocator() -> Callable[[int], int] | None:
    """Keep big buffers in the heap (see above); returns malloc_trim, or None without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    trim: Callable[[int], int] = libc.malloc_trim
    return trim


def _wait_idle(fd: int, trim: Callable[[int], int] | None) -> None:
    """Block until the next request; memory goes back to the OS if none comes for a while."""
    if trim is not None and not select.select([fd], [], [], IDLE_TRIM_S)[0]:
        trim(0)


def serve(
    parser: Parser,
    fd_in: int,
    fd_out: int,
    shared: mmap.mmap | None = None,
    trim: Callable[[int], int] | None = None,
) -> None:
    """Answer requests until end of input."""
    capacity = len(shared) if shared is not None else 0
    while True:
        _wait_idle(fd_in, trim)
        header = read_exactly(fd_in, REQUEST.size)
        if header is None:
            return
        where, meta_size, body_size = REQUEST.unpack(header)
        meta = read_exactly(fd_in, meta_size)
        if meta is None:
            return
        body: bytearray | memoryview | None
        if where == INLINE or shared is None:
            body = read_exactly(fd_in, body_size)
            if body is None:
                return
        else:
            body = memoryview(shared)[:body_size]
        head, keep_messages = pickle.loads(meta)
        status: int
        result: object
        try:
            result, status = parser(head, body, keep_messages), OK
        except RequestError as err:
            result, status = err, REJECTED
        except Exception as exc:
            traceback.print_exc()
            result, status = f"{type(exc).__name__}: {str(exc)[:200]}", FAILED
        if isinstance(body, memoryview):
            body.release()
        del body
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        del result
        if shared is not None and len(payload) <= capacity:
            shared[: len(payload)] = payload
            write_all(fd_out, REPLY.pack(status, SHARED, len(payload)))
        else:
            write_all(fd_out, REPLY.pack(status, INLINE, len(payload)))
            write_all(fd_out, payload)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trim = tune_allocator()
    if args[:1] == ["--nice"]:
        with contextlib.suppress(OSError):
            os.nice(int(args[1]))
        del args[:2]
    shared = None
    if args[:1] == ["--shm"]:
        fd, size = int(args[1]), int(args[2])
        shared = mmap.mmap(fd, size)
        os.close(fd)
        del args[:3]
    parser = load_parser(args[0] if args else None)
    fd_out = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the frames
    serve(parser, 0, fd_out, shared, trim)


if __name__ == "__main__":
    main()
