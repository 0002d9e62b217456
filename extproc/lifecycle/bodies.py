"""Request bodies: small ones parsed on the event loop, big ones in a few worker processes.

orjson holds the GIL while it parses, so parsing a multi-megabyte body on a thread would stall the
event loop just the same: bodies of at least `offload_bytes` are parsed, and their routing fields
extracted, by worker processes (`python -m extproc.openai.worker`; the protocol is described there).
At most `workers` big bodies are parsed at once, one per worker; the others wait on a semaphore,
which costs the loop nothing. Workers start when a big body finds none idle, run at `worker_nice`
(a burst of big bodies yields CPU to the loop), and parse with the same function as the loop
(`parse_request`), so both paths give the same request; token ids come back as a uint32 array, and
chat messages only when tokenizers need them. Each worker shares a buffer with this process: the
body goes in with one memmove on a thread (ctypes releases the GIL) and the reply is unpickled
straight out of it, so the loop does one decode per body and no pipe copying (multiprocessing's
pipes cost more than the parse itself; docs/tuning.md, "Big request bodies").

A worker that dies (killed, out of memory) or overruns BODY_PARSE_DEADLINE_S fails the body it held
with a 503 that invites a retry; the next big body starts a fresh one. A request cancelled meanwhile
(Envoy's message timeout) lets its worker finish in the background, so the worker stays usable and
the bound stays true.

Memory: a big body passes through several 15 MB buffers here (gRPC's, the body, the parsed prompt).
glibc's defaults unmap such buffers, or trim the heap, as soon as they are freed, so every body
would fault its pages in again (which costs more than the copy itself), and what fragmentation kept
would stay at the peak. From the first big body on, big buffers stay in the heap
(worker.tune_allocator) and, once big bodies stop (`trim_interval_s` without one), `malloc_trim(0)`
hands free memory back to the OS, on a thread, never while a body is in a worker; idle workers'
shared buffers are released then too. Workers trim themselves after a second idle. A routed big
body's prompt is dropped from its request (router.py), which lives as long as the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from extproc.openai import InferenceRequest, RequestError, RequestHead
from extproc.openai.errors import parser_failed
from extproc.openai.worker import FAILED, INLINE, MODULE, OK, REPLY, REQUEST, SHARED, tune_allocator
from extproc.settings import BODY_PARSE_DEADLINE_S, BodySettings

log = logging.getLogger("extproc.bodies")


@dataclass(slots=True)
class BodyStats:
    """Counters for tests and benches (only the event loop touches them)."""

    offloaded: int = 0  # big bodies parsed by a worker
    active: int = 0  # in a worker now
    waiting: int = 0  # waiting for a worker now
    max_active: int = 0
    workers_started: int = 0
    worker_failures: int = 0  # workers that died on a body
    trims: int = 0


class MemoryTrimmer:
    """Hands free heap memory back to the OS once big bodies stop coming (see the module doc):
    `interval_s` after the last one, or, while they keep coming, at a moment when none is in a
    worker at most every FORCE_AFTER intervals. Never mid-burst otherwise: the next body would fault
    the pages straight back in, on the event loop."""

    FORCE_AFTER = 15

    __slots__ = ("_busy", "_handle", "_last", "_recent", "_release", "_trim", "_tuned", "interval_s", "stats")

    def __init__(
        self,
        interval_s: float,
        stats: BodyStats,
        busy: Callable[[], bool],
        release: Callable[[], None] = lambda: None,
    ) -> None:
        self._trim: Callable[[int], int] | None = None
        self._tuned = False
        self.interval_s = interval_s
        self.stats = stats
        self._busy = busy
        self._release = release  # on the loop, first: what else big bodies left behind
        self._handle: asyncio.TimerHandle | None = None
        self._last = 0.0  # last trim (loop time)
        self._recent = 0.0  # last big body seen or done

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def big_body_seen(self) -> None:
        """A big body arrived. The first one switches this process to keeping big buffers in the
        heap (worker.tune_allocator), handed back by the trims; a process that never sees one keeps
        glibc's defaults."""
        if not self._tuned and self.interval_s > 0:
            self._tuned = True
            self._trim = tune_allocator()
            self._last = asyncio.get_running_loop().time()
        self._touch()

    def big_body_done(self) -> None:
        self._touch()

    def _touch(self) -> None:
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        self._recent = loop.time()
        if self._handle is None:
            self._handle = loop.call_later(self.interval_s, self._fire)

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        quiet = now - self._recent >= self.interval_s
        overdue = now - self._last >= self.FORCE_AFTER * self.interval_s
        if self._busy() or not (quiet or overdue):
            self._handle = loop.call_later(max(0.05, self._recent + self.interval_s - now), self._fire)
            return
        self._handle = None
        self._last = now
        self.stats.trims += 1
        self._release()
        assert self._trim is not None
        loop.run_in_executor(None, self._trim, 0)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _shared_buffer(size: int) -> tuple[int, mmap.mmap]:
    """An anonymous file of `size` bytes (pages exist only once written) and this side's mapping."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("llm-extproc-body", 0)  # not inherited except through pass_fds
    else:
        with tempfile.TemporaryFile() as f:  # already unlinked: gone when both sides close it
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


class _Worker(asyncio.SubprocessProtocol):
    """One worker process, its pipes and the buffer it shares with this process; one body at a time.
    The body goes into the buffer with one copy and the reply is unpickled straight from it."""

    def __init__(self, shared: mmap.mmap) -> None:
        self.shared = shared
        self._view: ctypes.c_char | None = ctypes.c_char.from_buffer(shared)  # its address, for memmove
        self.used = 0  # bytes of the buffer written since its pages were last released
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited = False
        self._reply: asyncio.Future[tuple[int, bytearray | None, int]] | None = None
        self._header = bytearray()
        self._status = OK
        self._buf: bytearray | None = None
        self._got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    @property
    def pid(self) -> int:
        assert self.transport is not None
        return self.transport.get_pid()

    @property
    def alive(self) -> bool:
        return not self.exited and self.transport is not None and not self.transport.is_closing()

    async def run(self, head: RequestHead, body: bytes, keep_messages: bool) -> tuple[int, object]:
        """Parse `body` in the worker: its (status, unpickled payload)."""
        assert self.transport is not None and self._reply is None
        stdin = self.transport.get_pipe_transport(0)
        if stdin is None or stdin.is_closing() or self.exited:
            raise ConnectionError("the worker has gone")
        assert isinstance(stdin, asyncio.WriteTransport)
        self._reply = asyncio.get_running_loop().create_future()
        meta = pickle.dumps((head, keep_messages), protocol=pickle.HIGHEST_PROTOCOL)
        size = len(body)
        if size <= len(self.shared):
            # ctypes releases the GIL while it copies: the event loop goes on meanwhile.
            assert self._view is not None
            dst = ctypes.addressof(self._view)
            await asyncio.get_running_loop().run_in_executor(None, ctypes.memmove, dst, body, size)
            self.used = max(self.used, size)
            stdin.write(REQUEST.pack(SHARED, len(meta), size) + meta)
        else:
            stdin.write(REQUEST.pack(INLINE, len(meta), size) + meta)
            stdin.write(body)
        try:
            status, inline, length = await asyncio.wait_for(self._reply, BODY_PARSE_DEADLINE_S)
        finally:
            self._reply = None
        if inline is not None:
            return status, pickle.loads(inline)
        self.used = max(self.used, length)
        with memoryview(self.shared) as view, view[:length] as payload:
            return status, pickle.loads(payload)

    def release_pages(self) -> None:
        """Give the buffer's memory back (it reads as zeros; pages return when next written)."""
        if self.used and hasattr(mmap, "MADV_REMOVE"):
            with contextlib.suppress(OSError):
                self.shared.madvise(mmap.MADV_REMOVE, 0, -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.used = 0

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._buf is None:
                need = REPLY.size - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) < REPLY.size:
                    return
                status, where, size = REPLY.unpack(self._header)
                self._header.clear()
                if where == SHARED:
                    self._resolve((status, None, size))
                    continue
                self._status, self._buf, self._got = status, bytearray(size), 0
            n = min(len(view), len(self._buf) - self._got)
            self._buf[self._got : self._got + n] = view[:n]
            self._got += n
            view = view[n:]
            if self._got == len(self._buf):
                reply, self._buf = self._buf, None
                self._resolve((self._status, reply, len(reply)))

    def _resolve(self, reply: tuple[int, bytearray | None, int]) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(reply)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._lost()

    def process_exited(self) -> None:
        self.exited = True
        self._lost()

    def _lost(self) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(ConnectionError("the body parser process exited"))

    def kill(self) -> None:
        if self.transport is not None:
            pid = self.transport.get_pid()
            try:
                self.transport.close()  # kills a process still running
            except RuntimeError:  # its event loop is closed already
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self._view = None  # the mapping can close only once nothing points into it
        with contextlib.suppress(BufferError):
            self.shared.close()


class BodyParser:
    """Parses big bodies in worker processes, a bounded number at a time (see the module doc).
    `parser` ("module:function") replaces the workers' parse function (tests)."""

    __slots__ = ("_all", "_idle", "_parser", "_slots", "capacity", "settings", "stats", "trimmer")

    def __init__(self, settings: BodySettings, max_body_bytes: int, parser: str | None = None) -> None:
        self.settings = settings
        # Each worker's shared buffer: a body, then its reply (the prompt, and the messages when they
        # are kept: up to twice the body). Only the pages written take memory.
        self.capacity = 2 * max_body_bytes + 1024 * 1024
        self.stats = BodyStats()
        self._parser = parser
        self._slots = asyncio.Semaphore(settings.workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self.trimmer = MemoryTrimmer(
            settings.trim_interval_s, self.stats, lambda: self.stats.active > 0, self._release_pages
        )

    def _release_pages(self) -> None:
        for worker in self._idle:
            worker.release_pages()

    @property
    def limit(self) -> int:
        return self.settings.offload_bytes

    def is_big(self, body: bytes | None) -> bool:
        return body is not None and len(body) >= self.settings.offload_bytes

    def pids(self) -> list[int]:
        return [w.pid for w in self._all]

    async def parse(self, head: RequestHead, body: bytes, *, keep_messages: bool) -> InferenceRequest:
        """The request a worker parsed from `body`. Raises RequestError as parse_request() does, or
        503 `body_parser_failed` when the worker died on it."""
        stats = self.stats
        self.trimmer.big_body_seen()
        stats.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            stats.waiting -= 1
        try:
            worker = await self._worker()
        except BaseException:
            self._slots.release()
            raise
        stats.active += 1
        stats.max_active = max(stats.max_active, stats.active)
        # The job owns the slot until its worker is free again, even if this request is cancelled.
        job = asyncio.ensure_future(self._run(worker, head, body, keep_messages))
        job.add_done_callback(self._job_done)
        status, result = await asyncio.shield(job)
        if status == OK:
            stats.offloaded += 1
            assert isinstance(result, InferenceRequest)
            return result
        if isinstance(result, RequestError):
            raise result
        raise RuntimeError(f"body parser {'failed' if status == FAILED else 'answered'}: {result}")

    async def _run(
        self, worker: _Worker, head: RequestHead, body: bytes, keep_messages: bool
    ) -> tuple[int, object]:
        try:
            reply = await worker.run(head, body, keep_messages)
        except OSError as exc:  # it exited, its pipes broke, or it overran the deadline
            self._discard(worker)
            self.stats.worker_failures += 1
            assert worker.transport is not None
            what = "stuck" if isinstance(exc, TimeoutError) else "died"
            log.error("a body parser process %s (exit code %s)", what, worker.transport.get_returncode())
            raise parser_failed() from None
        except BaseException:
            self._discard(worker)  # cancelled mid-frame (shutdown): its pipe state is unknown
            raise
        self._idle.append(worker)
        return reply

    def _job_done(self, job: asyncio.Future[tuple[int, object]]) -> None:
        self.stats.active -= 1
        self._slots.release()
        if not job.cancelled():
            job.exception()  # retrieved: a request cancelled meanwhile does not await it
        self.trimmer.big_body_done()

    async def start(self) -> None:
        """Start every worker now rather than when big bodies first need them."""
        while len(self._all) < self.settings.workers:
            self._idle.append(await self._start())

    async def _worker(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.alive:
                return worker
            self._discard(worker)  # died while idle: nothing was lost
        return await self._start()

    async def _start(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the code this process runs
        fd, shared = _shared_buffer(self.capacity)
        args = ["--nice", str(self.settings.worker_nice), "--shm", str(fd), str(self.capacity)]
        args += [self._parser] if self._parser else []
        try:
            _, worker = await asyncio.get_running_loop().subprocess_exec(
                lambda: _Worker(shared),
                sys.executable,
                "-m",
                MODULE,
                *args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
                env=env,
                pass_fds=(fd,),
            )
        except BaseException:
            shared.close()
            raise
        finally:
            os.close(fd)
        self._all.add(worker)
        self.stats.workers_started += 1
        if self.stats.workers_started <= self.settings.workers:
            log.info("started body parser process %d (bodies of %d bytes or more)", worker.pid, self.limit)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)
        with contextlib.suppress(ValueError):
            self._idle.remove(worker)

    def close(self) -> None:
        """Stop the workers."""
        self.trimmer.close()
        for worker in list(self._all):
            worker.kill()
        self._all.clear()
        self._idle.clear()
