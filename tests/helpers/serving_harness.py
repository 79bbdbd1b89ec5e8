"""What the serving tests share: prompts, transformers' greedy tokens as the engine stops them, a
`torchtpu-export serve` process on a free port, the official `openai` client on it, and JAX's compile events."""
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch


PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and then some more words follow here",
           "a", "tiny language model", "tokens are made locally", "one two three", "small corpus of text",
           "is this a model", "made from a config", "what comes next", "the cache stays on the device",
           "continuous batching", "slots and steps", "prefill then insert", "sixteen requests", "the last one"]


def greedy(model, ids, n):
    """transformers' greedy tokens after ``ids``, cut at the end-of-sequence token (2), as the engine stops."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):]
    out = out.tolist()
    return out[:out.index(2)] if 2 in out else out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, path, *extra):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        # the server's log goes to a file: a pipe nobody reads would block it once full
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tte-serve-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export", "serve", str(path), "--port",
                                      str(self.port), *extra], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"the server exited: {self.log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise AssertionError("the server did not become ready in 120 s")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _openai(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _compile_events():
    """A list that JAX's compile logging fills with one entry per backend compilation from now on."""
    from jax import monitoring
    from jax._src import dispatch
    events = []
    monitoring.register_event_duration_secs_listener(
        lambda name, _, **kw: events.append(name) if name == dispatch.BACKEND_COMPILE_EVENT else None)
    return events
