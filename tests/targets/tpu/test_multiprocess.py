"""A sharded program under JAX's multi-controller runtime: CPU processes on localhost (two with two
devices each, or four with one), joined by ``jax.distributed.initialize`` with gloo collectives, run one
tensor-parallel decoder over their process x device mesh. Their outputs equal one process running it on
four devices, and each process reads only its own shards of the sharded weights."""
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("multiprocess")

EXPORT = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, torchtpu_export as tte
    import zoo
    out = sys.argv[1]
    m, args = zoo.llama(dim=128, heads=8, kv_heads=4, hidden=256)
    prog = tte.export(m, args, platforms=("cpu",), mesh=(("data", 1), ("model", 4)), sharding="tensor_parallel")
    prog.save(os.path.join(out, "tp.tpu"))
    prog = tte.load(os.path.join(out, "tp.tpu"))
    np.save(os.path.join(out, "tokens.npy"), args[0].numpy())
    np.save(os.path.join(out, "single.npy"), np.asarray(prog(*args)))
    print(json.dumps({"bytes_read": prog.runner().bytes_read}))
""")

WORKER = textwrap.dedent("""
    import os, sys, json
    pid, n, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // n}"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    assert jax.process_count() == n and len(jax.devices()) == 4 and len(jax.local_devices()) == 4 // n
    import numpy as np, torchtpu_export as tte
    prog = tte.load(os.path.join(out, "tp.tpu"))
    got = np.asarray(prog(np.load(os.path.join(out, "tokens.npy"))))
    np.save(os.path.join(out, f"process{pid}.npy"), got)
    runner = prog.runner()
    plan = prog.manifest["programs"]["main"]["sharding"]
    sharded = [n for n, s in plan["weights"].items() if any(s)]
    print(json.dumps({"bytes_read": runner.bytes_read, "sharded": sharded,
                      "sharded_bytes": sum(prog.artifact.weights[n].nbytes for n in sharded)}))
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The program exported, and run by one process over four devices: (folder, bytes it read)."""
    out = tmp_path_factory.mktemp("tp")
    ref = subprocess.run([sys.executable, "-c", EXPORT, str(out)], capture_output=True, text=True, timeout=600,
                         env=_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    return out, json.loads(ref.stdout.strip().splitlines()[-1])["bytes_read"]


def _env() -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


@pytest.mark.parametrize("n", [2, 4], ids=["2x2", "4x1"])
def test_processes_run_one_sharded_program_like_one_process(single_process, n):
    out, total = single_process
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(n), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(n)]
    results = []
    try:
        for p in procs:
            stdout, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    single = np.load(out / "single.npy")
    for i in range(n):
        np.testing.assert_allclose(np.load(out / f"process{i}.npy"), single, rtol=1e-5, atol=1e-5)
    for r in results:
        # each process holds its 4/n of the 4 shards of every sharded weight, and all of the replicated ones
        assert r["sharded"] and r["bytes_read"] == total - r["sharded_bytes"] * (n - 1) // n, (r, total)


EXPORT_LLM = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import torchtpu_export as tte
    from torchtpu_export.engine import Engine
    import hf_llms
    out = sys.argv[1]
    model, tok = hf_llms.build("llama")
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 16), cache_length=64, batch_size=2,
                          platforms=("cpu",), mesh=(("data", 1), ("model", 4)))
    prog.save(os.path.join(out, "llm.tpu"))
    # the reference: one process over four devices, the two requests batched together
    engine = Engine(tte.load(os.path.join(out, "llm.tpu")))
    prompts = ["hello world, this is a tiny model",
               "a longer prompt, one that takes more than a chunk of eight tokens to prefill"]
    stop = engine.program.manifest["llm"]["stop_ids"]  # as the server passes them
    requests = [engine.submit(tok(p)["input_ids"], 10, stop=stop) for p in prompts]
    while engine.busy:
        engine.step()
    print(json.dumps({"prompts": prompts, "texts": [tok.decode(r.result(), skip_special_tokens=True)
                                                    for r in requests]}))
""")


# jax's own client trying to register as process 1 of the running job, with no secret
STRANGER = textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", 2, 1, initialization_timeout=5,
                               cluster_detection_method="deactivate")
    print("joined")
""")


def _serve_distributed(path, env: dict, tmp_path, devices: int = 2):
    """``serve path --distributed`` as two processes of ``devices`` CPU devices each (gloo), once process 0 is
    ready: (coordinator port, process 0's HTTP port, the processes, their log files, ``log(i, tail)``)."""
    import time
    import urllib.request
    port, http = _free_port(), _free_port()
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               TTE_DISTRIBUTED_TOKEN=secrets.token_hex(16))
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "torchtpu_export", "serve", str(path),
                               "--port", str(http + i if i else http), "--name", "tiny", "--distributed",
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=logs[i], stderr=subprocess.STDOUT, env=env, text=True) for i in range(2)]

    def log(i, tail=3000):
        logs[i].seek(0)
        return logs[i].read()[-tail if tail else 0:]
    try:
        deadline = time.time() + 300
        while True:
            assert all(p.poll() is None for p in procs), (log(0), log(1))
            assert time.time() < deadline, "process 0 did not serve in 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return port, http, procs, logs, log
            except OSError:
                time.sleep(0.5)
    except BaseException:
        _kill(procs, logs)
        raise


def _stop(procs, log) -> None:
    """Process 0 stopped: its engine stops and tells process 1's, which ends cleanly."""
    procs[0].terminate()
    assert procs[1].wait(120) == 0, log(1)
    procs[0].wait(60)


def _kill(procs, logs) -> None:
    for p in procs:
        p.kill()
    for f in logs:
        f.close()


def test_serving_engine_across_two_processes(tmp_path):
    """``serve --distributed`` on two processes of two CPU devices each (gloo), one tensor-parallel LLM over
    their four devices: process 0 takes HTTP requests, process 1 runs the steps process 0's engine
    schedules. Two concurrent OpenAI completions give the tokens one process gives over four devices, and
    stopping process 0 ends process 1 cleanly. The coordinator listens on the address given only, and
    strangers (jax's own client with no secret, a process with another secret, a wrong handshake) are
    refused without disturbing the job."""
    import threading
    import openai
    env = _env()
    ref = subprocess.run([sys.executable, "-c", EXPORT_LLM, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    port, http, procs, logs, log = _serve_distributed(tmp_path / "llm.tpu", env, tmp_path)
    try:
        # the coordinator listens on the address given, nowhere else (read from the system)
        import psutil
        process0 = psutil.Process(procs[0].pid)
        listening = {(c.laddr.ip, c.laddr.port) for c in getattr(process0, "net_connections", process0.connections)(
                     "inet") if c.status == psutil.CONN_LISTEN}
        assert {a for a in listening if a[1] == port} == {("127.0.0.1", port)}, listening
        # strangers cannot join: jax's own client, a wrong secret, or a wrong answer to the handshake
        stranger = subprocess.run([sys.executable, "-c", STRANGER, str(port)], capture_output=True, text=True,
                                  timeout=120, env=dict(env, TTE_DISTRIBUTED_TOKEN=""))
        assert stranger.returncode != 0 and "joined" not in stranger.stdout, stranger.stdout
        wrong = subprocess.run([sys.executable, "-m", "torchtpu_export", "serve", str(tmp_path / "llm.tpu"),
                                "--distributed", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                "--process-id", "1"], capture_output=True, text=True, timeout=120,
                               env=dict(env, TTE_DISTRIBUTED_TOKEN=secrets.token_hex(16)))
        assert wrong.returncode == 2 and "refused to let this process join" in wrong.stderr, wrong.stderr
        assert "Traceback" not in wrong.stderr
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.recv(64)
            s.sendall(b"\0" * 64)
            assert s.recv(64) == b""  # closed
        assert all(p.poll() is None for p in procs), (log(0), log(1))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=300)
        # a client that goes away mid-stream: process 0 cancels it at the next step, and so does process 1
        stream = client.completions.create(model="tiny", prompt=want["prompts"][0], max_tokens=40, temperature=0,
                                           stream=True)
        next(iter(stream))
        stream.close()
        texts = [None, None]

        def ask(i):
            done = client.completions.create(model="tiny", prompt=want["prompts"][i], max_tokens=10, temperature=0)
            texts[i] = done.choices[0].text
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert texts == want["texts"], (texts, want["texts"], log(0))
        assert "running the steps of process 0's engine" in log(1, None)
        _stop(procs, log)
    finally:
        _kill(procs, logs)


EXPORT_PAGED = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np, torchtpu_export as tte
    from torchtpu_export.engine import Engine
    import hf_llms
    out = sys.argv[1]
    model, tok = hf_llms.build("llama")
    # 4 rows of a 64-position cache over 9 pages of 16: two full sequences (and page 0), fewer than the four
    # requests below take together; the pool split by KV head over two chips
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=64, batch_size=4,
                          batch_buckets=(), platforms=("cpu",), mesh=(("data", 1), ("model", 2)), kv_pages=9)
    prog.save(os.path.join(out, "paged.tpu"))
    engine = Engine(tte.load(os.path.join(out, "paged.tpu")))
    rng = np.random.default_rng(5)
    system = rng.integers(3, 300, 20).tolist()
    prompts = [system + rng.integers(3, 300, k).tolist() for k in (3, 9, 5, 14)]
    stop = engine.program.manifest["llm"]["stop_ids"]
    requests = [engine.submit(p, 30, stop=stop) for p in prompts]
    while engine.busy:
        engine.step()
    spec = prog.manifest["programs"]["decode_paged"]
    split = spec["sharding"]["inputs"][[i["name"] for i in spec["inputs"]].index("kv_cache_k_0")]
    print(json.dumps({"prompts": prompts, "tokens": [r.result() for r in requests], "stats": engine.stats,
                      "pool_split": split}))
""")


def test_a_paged_export_is_served_across_two_processes(tmp_path):
    """``serve --distributed`` of a paged export (the pool split by KV head over two processes' chips): four
    concurrent requests on a pool that holds two of them at a time (they wait, are preempted and readmitted,
    and share their prompts' first pages; a readmitted prompt's chunks ride in packed mixed steps) give the
    tokens one process gives, every process taking the same steps (process 1 follows the pages process 0
    hands out)."""
    import threading

    import openai
    env = _env()
    ref = subprocess.run([sys.executable, "-c", EXPORT_PAGED, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    assert want["stats"]["preemptions"] > 0 and want["stats"]["prefix_hit_tokens"] > 0, want["stats"]
    assert want["stats"]["mixed_steps"] > 0, want["stats"]  # a readmitted request's chunks ride in decode steps
    assert want["pool_split"] == ["model", None, None, None]  # [kv heads, pages, page, dim]: a chip's heads' pages
    port, http, procs, logs, log = _serve_distributed(tmp_path / "paged.tpu", env, tmp_path, devices=1)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=300)
        got = [None] * len(want["prompts"])

        def ask(i):
            done = client.completions.create(model="tiny", prompt=want["prompts"][i], max_tokens=30, temperature=0)
            got[i] = done.choices[0].text
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(got))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        import hf_llms
        tok = hf_llms.tokenizer(hf_llms.MODELS["llama"][1])
        assert got == [tok.decode(t, skip_special_tokens=True) for t in want["tokens"]], (got, log(0))
        _stop(procs, log)
    finally:
        _kill(procs, logs)
