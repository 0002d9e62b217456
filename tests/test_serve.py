"""`serve()`, the process entry point: once started it freezes the heap (so the garbage collector's
full passes stop walking the ~50k objects of a started service while every stream waits), and a
signal drains and stops it."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from extproc.config import config_from_dict
from extproc.server import app
from extproc_lab.stack import free_port

POOL = {"clusters": [{"name": "gpu-a", "models": ["m"]}]}


def test_freeze_heap_moves_what_is_alive_out_of_the_collectors_walks() -> None:
    kept = [{"a": [1]} for _ in range(100)]  # tracked containers, alive
    try:
        frozen = app.freeze_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        walked = {id(o) for o in gc.get_objects()}  # the generations a collection walks
        assert not any(id(x) in walked for x in kept)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


async def test_serve_freezes_the_started_service_and_stops_on_a_signal() -> None:
    cfg = config_from_dict(
        {
            "pool": POOL,
            "listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": f"127.0.0.1:{free_port()}",
            "shutdown_announce_s": 0,
            "shutdown_grace_s": 1,
        }
    )
    gc.unfreeze()
    task = asyncio.create_task(app.serve(cfg))
    try:
        for _ in range(200):  # started and frozen (the signal handlers are installed right after)
            if gc.get_freeze_count() > 0 or task.done():
                break
            await asyncio.sleep(0.025)
        assert not task.done(), task.exception() if task.done() else None
        assert gc.get_freeze_count() > 1000  # modules, config, plugins: thousands of objects
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # handled by serve(): announce, drain, stop
        await asyncio.wait_for(task, 30)
    finally:
        gc.unfreeze()
        if not task.done():
            task.cancel()
