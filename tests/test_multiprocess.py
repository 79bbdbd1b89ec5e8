"""A sharded program under JAX's multi-controller runtime: two CPU processes on localhost, each with two
devices, joined by ``jax.distributed.initialize`` with gloo collectives, run one tensor-parallel decoder
over their 2x2 process x device mesh. Their outputs equal one process running it on four devices, and
each process reads only its own shards of the sharded weights."""
import json
import os
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
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
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


def test_two_processes_run_one_sharded_program_like_one_process(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    ref = subprocess.run([sys.executable, "-c", EXPORT, str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    total = json.loads(ref.stdout.strip().splitlines()[-1])["bytes_read"]
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), port, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    single = np.load(tmp_path / "single.npy")
    for i in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"process{i}.npy"), single, rtol=1e-5, atol=1e-5)
    for r in results:
        # each process holds 2 of the 4 shards of every sharded weight, and all of the replicated ones
        assert r["sharded"] and r["bytes_read"] == total - r["sharded_bytes"] // 2, (r, total)
