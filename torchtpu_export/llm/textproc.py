"""An LLM server's text work (tokenizing, the chat template, detokenizing) in worker processes, each
operation under a time and a memory budget.

A served file's tokenizer and chat template are the file's: a template that loops for ever or builds a
gigabyte string, or a tokenizer whose regular expression backtracks, must not stall the event loop
that answers every other request and health check, nor grow the server, nor keep SIGTERM from
ending it. So they run in worker processes started as plain scripts (``python -I this_file``: no
torch, jax or threads of the server's), which:

- load the tokenizer and compile the template once, at start: a file whose tokenizer or template does
  not load is refused then (:class:`TextWorkers` raises ArtifactError);
- live under an address-space limit (``RLIMIT_AS``: their size once the tokenizer is loaded plus
  ``memory_budget``, 128 MB), so an operation that would allocate past it fails alone, with a
  MemoryError; the template's ``*``, ``+`` and ``**`` refuse values longer than it may write;
- are killed and replaced when an operation runs past ``time_budget`` seconds, or when they crash:
  the request that asked fails (:class:`TextError`), no other;
- end when the server is gone.

Messages are JSON lines over the worker's stdin and stdout; nothing is unpickled. The server bounds
what it sends (prompt characters, message counts) and how much text a template may write.

This file is also the worker (``__main__`` below), so it imports nothing of the package at its top.
"""
from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import threading
import time

MAX_LINE = 1 << 30  # a reply line (bounded by what the server sends: prompts are capped far below)


CHARS_PER_POSITION = 32  # prompt characters per cache position: far more than any real text needs


class TextError(Exception):
    """One text operation failed (the template refused the messages, a budget ran out, the worker
    crashed); the request that asked for it gets this message, nobody else."""


# ---- the worker (this file run as a script) ---------------------------------------------------

class _Codec:
    """The tokenizer and chat template of one served file, in a worker process."""

    def __init__(self, tokenizer_json: str, bos_id, eos_id, max_chars: int, images=None):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_str(tokenizer_json)
        self.images = images  # a VLM's [marker, sequence]: the processor's text for each image the template marks
        self.max_chars = max_chars
        self.bos = self.tok.id_to_token(bos_id) if bos_id is not None else None
        self.eos = self.tok.id_to_token(eos_id) if eos_id is not None else None
        self.template = None

    def compile(self, source: str) -> None:
        import jinja2.ext
        self.template = _sandbox(self.max_chars, [jinja2.ext.loopcontrols]).from_string(source)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], split: int) -> list[str]:
        """The text of ``ids[:split]`` and of ``ids`` (an incremental detokenizer's window)."""
        return [self.tok.decode(ids[:split], skip_special_tokens=True),
                self.tok.decode(ids, skip_special_tokens=True)]

    def decode_many(self, windows: list) -> list:
        """:meth:`decode` of several requests' windows at once (one message per engine step, not one per token)."""
        return [self.decode(ids, split) for ids, split in windows]

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (logprobs name their tokens)."""
        return [self.tok.decode([i], skip_special_tokens=False) for i in ids]

    def chat(self, messages: list, tools: list | None = None) -> list[int]:
        if self.template is None:
            raise TextError("this model has no chat template: use /v1/completions")
        import jinja2
        out, size = [], 0
        try:
            extra = {"tools": tools} if tools else {}
            for piece in self.template.generate(messages=messages, add_generation_prompt=True,
                                                bos_token=self.bos or "", eos_token=self.eos or "", **extra):
                size += len(piece)
                if size > self.max_chars:
                    raise TextError(f"the chat template writes more than {self.max_chars:,} characters for "
                                    "these messages (more than the model's cache holds)")
                out.append(piece)
        except jinja2.TemplateError as e:
            raise TextError(f"the chat template fails on these messages: {e}") from None
        text = "".join(out)
        if self.images and self.images[0]:
            marker, sequence = self.images
            if text.count(marker) * len(sequence) > self.max_chars:
                raise TextError(f"the images of these messages take more than {self.max_chars:,} characters")
            text = text.replace(marker, sequence)
        return self.encode(text, special=False)


def _sandbox(max_items: int, extensions):
    """jinja's immutable sandbox, as transformers renders chat templates, whose ``*``, ``+`` and ``**``
    refuse to build a value larger than a template may write (and, being intercepted, are never folded
    into constants while the template is compiled)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "**"])

        def call_binop(self, context, operator, left, right):
            sized = (str, list, tuple)
            if operator == "*" and isinstance(left, sized + (int,)) and isinstance(right, sized + (int,)):
                seq, count = (left, right) if isinstance(left, sized) else (right, left)
                if isinstance(seq, sized) and isinstance(count, int) and len(seq) * count > max_items:
                    raise TextError(f"the chat template builds a value of {len(seq) * count:,} items")
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                if len(left) + len(right) > max_items:
                    raise TextError(f"the chat template builds a value of {len(left) + len(right):,} items")
            elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 4096 \
                    and isinstance(left, (int, float)) and abs(left) > 1:
                raise TextError("the chat template raises a number to a power too large to compute")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TextError(f"the chat template refuses these messages: {message}")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
    return env


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


def _worker_main() -> None:
    _exit_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def send(obj) -> None:
        stdout.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        stdout.flush()

    config = json.loads(stdin.readline())
    import jinja2.ext  # noqa: F401 - imported before the memory limit is set
    import jinja2.sandbox  # noqa: F401
    try:
        codec = _Codec(config["tokenizer"], config["bos_id"], config["eos_id"], config["max_chars"],
                       config.get("images"))
        # what the file may take from here on: its tokenizer is loaded, the template is compiled within it
        if os.path.exists("/proc/self/statm"):
            _limit_memory(config["memory_budget"])
        if config["template"]:
            codec.compile(config["template"])
    except BaseException as e:  # noqa: BLE001 - the tokenizers library's Rust panics are BaseExceptions
        send(["error", _describe(e)])
        return
    send(["ok", None])
    ops = {"encode": codec.encode, "decode": codec.decode, "decode_many": codec.decode_many, "chat": codec.chat,
           "pieces": codec.pieces}
    for line in stdin:
        try:
            op, args = json.loads(line)
            reply = ["ok", ops[op](*args)]
        except TextError as e:
            reply = ["refused", str(e)]
        except MemoryError:
            reply = ["error", f"it needs more than the {config['memory_budget'] >> 20} MB a text worker may add"]
        except BaseException as e:  # noqa: BLE001 - whatever the template or tokenizer raised, for this request
            reply = ["error", _describe(e)]
        try:
            send(reply)
        except MemoryError:
            send(["error", "its result is larger than a text worker can send"])


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


# ---- the server's side ------------------------------------------------------------------------

_WHAT = {"encode": "tokenizer", "decode": "tokenizer", "decode_many": "tokenizer", "chat": "chat template",
         "pieces": "tokenizer"}


class _Worker:
    """One worker process and its pipes; ``call`` blocks (run it in a thread)."""

    def __init__(self, config: bytes, start_budget: float):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._buf = b""
        try:
            self.proc.stdin.write(config)
            self.proc.stdin.flush()
            status, value = self._reply(start_budget)
        except (TextError, OSError) as e:
            self.kill()
            raise TextError(f"its text worker did not start ({e})") from None
        if status != "ok":
            self.kill()
            raise TextError(value)

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
                    code = self.proc.poll()
                    raise TextError(f"signal {-code}" if code and code < 0 else "it exited")
                self._buf += chunk
                if len(self._buf) > MAX_LINE:
                    raise TextError("the text worker's reply is too large")
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


def image_text(vision: dict | None) -> tuple | None:
    """``(marker, sequence)`` of a VLM file's ``llm.vision`` (what the chat template puts for an image, and the
    processor's text for it), or None."""
    return (vision["marker"], vision["sequence"]) if vision else None


class TextWorkers:
    """A small pool of text workers for one served file. ``encode``, ``chat`` and ``decode`` are
    coroutines that run in a free worker (waiting for one) and raise :class:`TextError` for the caller
    alone; a worker that runs past ``time_budget`` or crashes is replaced in the background."""

    def __init__(self, tokenizer_json: bytes, *, template: str | None, bos_id, eos_id, max_chars: int,
                 workers: int = 2, time_budget: float = 10.0, memory_budget: int = 128 << 20,
                 start_budget: float = 30.0, images: tuple | None = None):
        from ..errors import ArtifactError
        config = {"tokenizer": tokenizer_json.decode("utf-8", "replace"), "template": template, "bos_id": bos_id,
                  "eos_id": eos_id, "max_chars": max_chars, "memory_budget": memory_budget,
                  "images": list(images) if images else None}
        self._config = json.dumps(config).encode() + b"\n"
        self.time_budget, self.start_budget = time_budget, start_budget
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._waiters: list = []  # (loop, future) waiting for a worker
        self._closed = False
        self._decodes: list = []  # (ids, split, future) waiting for the next batch
        self._flusher = None
        try:
            first = _Worker(self._config, start_budget)
        except TextError as e:
            raise ArtifactError(f"the served file's tokenizer or chat template does not load: {e}",
                                hint="export the model again from a tokenizer that transformers loads") from None
        self._idle.append(first)
        for _ in range(workers - 1):
            self._idle.append(_Worker(self._config, start_budget))

    # -- the pool

    async def _take(self) -> _Worker:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise TextError("the server is stopping")
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
                except TextError:
                    time.sleep(1.0)
        threading.Thread(target=start, name="tte-text-worker", daemon=True).start()

    def _run(self, worker: _Worker, op: str, args: list):
        """In a thread: one operation; the worker goes back to the pool, or is replaced."""
        what = _WHAT[op]
        try:
            status, value = worker.call(op, args, self.time_budget)
        except TimeoutError:
            self._replace(worker)
            return "refused", f"the model's {what} took longer than {self.time_budget:g} s on this request and was stopped"
        except (TextError, OSError, ValueError) as e:
            self._replace(worker)
            return "refused", f"the model's {what} crashed on this request" + (f" ({e})" if isinstance(e, TextError) else "")
        self._give(worker)
        if status == "error":
            return "refused", f"the model's {what} failed on this request ({value})"
        return status, value

    def run(self, op: str, *args):
        """One operation from a plain thread (``generate``): waits for a free worker, raises TextError."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            return asyncio.run(self.call(op, *args))
        status, value = self._run(worker, op, list(args))
        if status != "ok":
            raise TextError(value)
        return value

    @staticmethod
    def chars_for(cache_length: int) -> int:
        """The most characters of prompt or template output a model with ``cache_length`` positions takes:
        ``CHARS_PER_POSITION`` per position, plus room for a template's own text."""
        return CHARS_PER_POSITION * cache_length + 4096

    async def call(self, op: str, *args):
        worker = await self._take()
        # shielded: a request that goes away mid-operation leaves it to finish, and the worker to return
        status, value = await asyncio.shield(asyncio.get_running_loop().run_in_executor(
            None, self._run, worker, op, list(args)))
        if status != "ok":
            raise TextError(value)
        return value

    # -- the operations

    async def encode(self, text: str, special: bool = True) -> list[int]:
        return await self.call("encode", text, special)

    async def chat(self, messages: list, tools: list | None = None) -> list[int]:
        return await self.call("chat", messages, tools)

    async def pieces(self, ids: list[int]) -> list[str]:
        return await self.call("pieces", list(ids))

    async def decode(self, ids: list[int], split: int) -> tuple[str, str]:
        """The text of ``ids[:split]`` and of ``ids``. The windows of every request waiting go to a worker in
        one message; when that batch fails, each of them is decoded alone, so that only the request whose
        tokens the tokenizer fails on gets the error."""
        future = asyncio.get_running_loop().create_future()
        self._decodes.append((list(ids), split, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_decodes())
        before, after = await future
        return before, after

    async def _flush_decodes(self) -> None:
        while self._decodes:
            batch, self._decodes = [d for d in self._decodes if not d[2].done()], []
            if not batch:
                continue
            try:
                results = await self.call("decode_many", [[ids, split] for ids, split, _ in batch])
            except TextError:
                results = None
            for k, (ids, split, future) in enumerate(batch):
                if results is None:  # one at a time: the failure is the request's whose tokens cause it
                    try:
                        result = await self.call("decode", ids, split)
                    except TextError as e:
                        if not future.done():
                            future.set_exception(e)
                        continue
                else:
                    result = results[k]
                if not future.done():
                    future.set_result(tuple(result))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


def _hand(waiter, worker, pool) -> None:
    if waiter.done():  # its request went away meanwhile
        pool._give(worker)
    else:
        waiter.set_result(worker)


class Detokenizer:
    """Text deltas of a growing token list, each from a window of the last few tokens (the work per
    token stays constant however long the reply): the window's text before and after the new token
    differ by the delta; a delta ending inside a multi-byte character waits for the rest."""

    def __init__(self, text: TextWorkers):
        self.text, self.ids = text, []
        self.prefix = self.read = 0  # the window starts at ids[prefix]; ids[:read] are sent

    async def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = await self.text.decode(self.ids[self.prefix:], self.read - self.prefix)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    async def flush(self) -> str:
        if self.read == len(self.ids):
            return ""
        before, after = await self.text.decode(self.ids[self.prefix:], self.read - self.prefix)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


if __name__ == "__main__":
    _worker_main()
