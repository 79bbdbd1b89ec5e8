"""Isolation: each task runs in a worker process, so a crash in a native runtime or a hang becomes
an ``error`` result instead of ending the run (or pytest)."""
from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Callable, Sequence

from .cells import first_line

CELL_TIMEOUT_S = 180.0
ISOLATION_REASONS = ("the runtime crashed", "timed out")
_READY = "ready"


def _worker(conn) -> None:
    # one ONNX Runtime / torch thread per worker: the matrix runs as many workers as there are cores
    os.environ.setdefault("TTE_ONNX_THREADS", "1")
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)  # torch logs failed traces at length; the cell carries the reason
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        path, args = task
        mod, _, fn = path.partition(":")
        try:
            result = getattr(importlib.import_module(mod), fn)(*args)
        except BaseException as e:  # noqa: BLE001  (reported as the task's result)
            result = {"status": "error", "reason": f"harness: {first_line(e)}"}
        conn.send(result)


def run_isolated(tasks: Sequence[tuple[str, tuple]], *, jobs: int = 2, timeout: float = CELL_TIMEOUT_S,
                 on_result: Callable[[int, dict, float], None] | None = None) -> list[dict]:
    """Runs ``module:function(*args)`` tasks in ``jobs`` worker processes.

    A task whose worker dies (a segfault in a native runtime) or that runs past ``timeout``
    seconds gets an ``error`` result; its worker is replaced and the run goes on.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    results: list[dict | None] = [None] * len(tasks)
    pending = list(range(len(tasks)))[::-1]
    workers: list[dict] = []

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child,), daemon=True)
        p.start()
        child.close()
        # the timeout clock of a task starts when its worker is ready (imports done)
        return {"proc": p, "conn": parent, "task": None, "t0": 0.0, "ready": False}

    def finish(w, result):
        i = w["task"]
        results[i] = result
        w["task"] = None
        if on_result:
            on_result(i, result, time.monotonic() - w["t0"])

    def replace(w, reason):
        finish(w, {"status": "error", "reason": reason})
        w["proc"].kill()
        w["proc"].join()
        w["conn"].close()
        workers[workers.index(w)] = start()

    try:
        workers.extend(start() for _ in range(max(1, min(jobs, len(tasks)))))
        while pending or any(w["task"] is not None for w in workers):
            for w in workers:
                if w["ready"] and w["task"] is None and pending:
                    i = pending.pop()
                    w["task"], w["t0"] = i, time.monotonic()
                    w["conn"].send(tasks[i])
            for w in [w for w in workers if not w["ready"]]:
                if w["conn"].poll(0.05):
                    try:
                        w["ready"] = w["conn"].recv() == _READY
                    except (EOFError, OSError):
                        pass
                if not w["ready"] and not w["proc"].is_alive():
                    raise RuntimeError(f"a coverage worker process failed to start (exit code {w['proc'].exitcode})")
            busy = [w for w in workers if w["task"] is not None]
            if not busy:
                continue
            ready = wait([w["conn"] for w in busy] + [w["proc"].sentinel for w in busy], timeout=1.0)
            now = time.monotonic()
            for w in busy:
                if w["conn"] in ready:
                    try:
                        finish(w, w["conn"].recv())
                        continue
                    except (EOFError, OSError):
                        pass
                if w["proc"].sentinel in ready or not w["proc"].is_alive():
                    code = w["proc"].exitcode
                    what = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    replace(w, f"{ISOLATION_REASONS[0]} the worker process ({what})")
                elif now - w["t0"] > timeout:
                    replace(w, f"{ISOLATION_REASONS[1]} after {timeout:.0f} s")
    finally:
        for w in workers:
            try:
                w["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in workers:
            w["proc"].join(timeout=5)
            if w["proc"].is_alive():
                w["proc"].kill()
    return results
