"""Work on what a request or a served file brings (its tokenizer and chat template, a request's grammar, a
request's images) in worker processes, each operation under a time and a memory budget.

Such work may loop, backtrack or allocate without bound: a template that builds a gigabyte string, a JSON
schema whose lexer has a million states, a JPEG of 26,000 progressive scans. Run in the server, it would
stall the event loop that answers every other request and health check, or grow the server past what it
gives back. So it runs in worker processes started as plain scripts (``python -I this_file``: none of the
server's torch, jax, threads or memory), which:

- import the role's module (``role``: a module of this package; its ``worker_ops(config)`` gives the
  operations) without running the package's ``__init__`` (which imports torch);
- live under an address-space limit (``RLIMIT_AS``: their size once the role is set up plus
  ``memory_budget``), so an operation that would allocate past it fails alone, with a MemoryError;
- are killed and replaced when an operation runs past ``time_budget`` seconds, or when they crash: the
  request that asked fails (:class:`WorkerError`), no other;
- end when the server is gone.

A :class:`WorkerPool` owns a few such workers and a thread per worker to wait on them (never the event
loop's default executor, which other work shares), so a pool that is busy (every image worker decoding)
makes only its own callers wait. Messages are JSON lines over the worker's stdin and stdout; nothing is
unpickled.

This file is also the worker (``__main__`` below), so it imports nothing of the package at its top.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import types

MAX_LINE = 1 << 30  # a reply line (callers bound what they send and what the operations return)
PACKAGE = os.path.dirname(os.path.abspath(__file__))


class WorkerError(Exception):
    """One operation failed (refused its input, ran out of a budget, the worker crashed); the caller that
    asked gets this message, nobody else."""


# ---- the worker (this file run as a script) ---------------------------------------------------

def _import_role(name: str):
    """``name`` (``torchtpu_export.llm.textproc``) imported with its parent packages as bare namespaces: their
    ``__init__`` files, which import torch, never run; their modules import each other as usual."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        package = ".".join(parts[:k])
        if package not in sys.modules:
            stub = types.ModuleType(package)
            stub.__path__ = [os.path.join(os.path.dirname(PACKAGE), *parts[:k])]
            sys.modules[package] = stub
    return importlib.import_module(name)


def _exit_with_parent() -> None:
    """Ends this worker when the server is gone, even mid-operation (a thread watching the parent:
    PR_SET_PDEATHSIG would fire when the server thread that started it ends)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_memory(budget: int) -> None:
    import resource
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + budget, size + budget))


def _ended(code) -> str:
    """Why a worker's output ended, by its exit status."""
    if code is not None and code < 0:
        import signal
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        # a native library that cannot allocate under the address-space limit aborts
        return f"it ended with {name}" + (", as native code does past its memory limit" if name == "SIGABRT" else "")
    return "it exited" if code is not None else "it closed its output"


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _worker_main() -> None:
    _exit_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def send(obj) -> None:
        stdout.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        stdout.flush()

    config = json.loads(stdin.readline())
    try:
        role = _import_role(config["role"])
        # what an operation raises to refuse its input: the message goes to the caller as it is
        package = os.path.basename(PACKAGE)
        refusals = (WorkerError, _import_role(f"{package}.workers").WorkerError,
                    _import_role(f"{package}.errors").TteError)
        ops = role.worker_ops(config)
        # what the work may take from here on: the role is set up (a tokenizer loaded), its start within it
        if os.path.exists("/proc/self/statm"):
            _limit_memory(config["memory_budget"])
        start = ops.pop("start", None)
        if start is not None:
            start()
    except BaseException as e:  # noqa: BLE001 - the tokenizers library's Rust panics are BaseExceptions
        send(["error", _describe(e)])
        return
    send(["ok", None])
    for line in stdin:
        try:
            op, args = json.loads(line)
            reply = ["ok", ops[op](*args)]
        except refusals as e:
            reply = ["refused", str(e)]
        except MemoryError:
            reply = ["error", f"it needs more than the {config['memory_budget'] >> 20} MB a worker may add"]
        except BaseException as e:  # noqa: BLE001 - whatever the role's work raised, for this operation
            reply = ["error", _describe(e)]
        try:
            send(reply)
        except MemoryError:
            send(["error", "its result is larger than a worker can send"])


# ---- the server's side ------------------------------------------------------------------------

class _Worker:
    """One worker process and its pipes; ``call`` blocks (run it in a thread)."""

    def __init__(self, config: bytes, start_budget: float):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._buf = b""
        try:
            self.proc.stdin.write(config)
            self.proc.stdin.flush()
            status, value = self._reply(start_budget)
        except (WorkerError, OSError, TimeoutError) as e:
            self.kill()
            raise WorkerError(f"its worker did not start ({e or 'it took too long'})") from None
        if status != "ok":
            self.kill()
            raise WorkerError(value)

    def _reply(self, budget: float):
        deadline = time.monotonic() + budget
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    try:
                        code = self.proc.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        code = None
                    raise WorkerError(_ended(code))
                self._buf += chunk
                if len(self._buf) > MAX_LINE:
                    raise WorkerError("the worker's reply is too large")
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def call(self, op: str, args: list, budget: float):
        self.proc.stdin.write(json.dumps([op, args], ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        self.proc.stdin.flush()
        return self._reply(budget)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class WorkerPool:
    """A few workers of one ``role`` (a module of this package with ``worker_ops(config)``). ``call`` (a
    coroutine) and ``run`` (from a plain thread) run an operation in a free worker, waiting for one, and
    raise :class:`WorkerError` for the caller alone; a worker that runs past ``time_budget`` or crashes is
    replaced in the background. ``what`` names each operation's subject in messages ("the model's
    tokenizer"). The workers start here: a role that does not set up (a tokenizer that does not load) is
    WorkerError."""

    def __init__(self, role: str, config: dict, *, what: dict, workers: int = 1, time_budget: float = 10.0,
                 memory_budget: int = 128 << 20, start_budget: float = 30.0):
        self._config = json.dumps(dict(config, role=role, memory_budget=memory_budget)).encode() + b"\n"
        self.what, self.workers = what, workers
        self.time_budget, self.start_budget = time_budget, start_budget
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._waiters: list = []  # (loop, future) waiting for a worker
        self._closed = False
        # one waiting thread per worker, never the loop's default executor that other work shares
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"tte-{role.rsplit('.')[-1]}")
        self._idle.append(_Worker(self._config, start_budget))
        for _ in range(workers - 1):
            self._idle.append(_Worker(self._config, start_budget))

    async def _take(self) -> _Worker:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise WorkerError("the server is stopping")
            if self._idle:
                return self._idle.pop()
            waiter = loop.create_future()
            self._waiters.append((loop, waiter))
        return await waiter

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
                return
            while self._waiters:
                loop, waiter = self._waiters.pop(0)
                if not waiter.done():
                    loop.call_soon_threadsafe(_hand, waiter, worker, self)
                    return
            self._idle.append(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()

        def start():
            while not self._closed:
                try:
                    self._give(_Worker(self._config, self.start_budget))
                    return
                except WorkerError:
                    time.sleep(1.0)
        threading.Thread(target=start, name="tte-worker-start", daemon=True).start()

    def _run(self, worker: _Worker, op: str, args: list):
        """In a thread: one operation; the worker goes back to the pool, or is replaced."""
        what = self.what[op]
        try:
            status, value = worker.call(op, args, self.time_budget)
        except TimeoutError:
            self._replace(worker)
            return "refused", f"{what} took longer than {self.time_budget:g} s on this request and was stopped"
        except (WorkerError, OSError, ValueError) as e:
            self._replace(worker)
            return "refused", f"{what} crashed on this request" + (f" ({e})" if isinstance(e, WorkerError) else "")
        self._give(worker)
        if status == "error":
            return "refused", f"{what} failed on this request ({value})"
        return status, value

    def run(self, op: str, *args):
        """One operation from a plain thread (``generate``, the command line): waits for a free worker."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            return asyncio.run(self.call(op, *args))
        status, value = self._run(worker, op, list(args))
        if status != "ok":
            raise WorkerError(value)
        return value

    async def call(self, op: str, *args):
        worker = await self._take()
        # shielded: a request that goes away mid-operation leaves it to finish, and the worker to return
        status, value = await asyncio.shield(asyncio.get_running_loop().run_in_executor(
            self._threads, self._run, worker, op, list(args)))
        if status != "ok":
            raise WorkerError(value)
        return value

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
        self._threads.shutdown(wait=False)


def _hand(waiter, worker, pool) -> None:
    if waiter.done():  # its request went away meanwhile
        pool._give(worker)
    else:
        waiter.set_result(worker)


if __name__ == "__main__":
    _worker_main()
