import os
import subprocess
import sys
import warnings

import pytest

from torchtpu_export.targets.tpu import aot as tpu_compile

tpu_compile.prepare_environment()  # test modules that import jax themselves do so after this

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
# Tests import the zoo (examples/zoo.py) and the other example modules by name: pyproject.toml's pytest
# `pythonpath` puts examples/ on this process's path. The processes tests start (``python -c`` scripts that
# ``import zoo`` or ``import hf_llms``, model files the CLI loads) find them through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Runs ``torchtpu-export ARGS`` in a fresh process; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torchtpu_export", *map(str, args)], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


# Many CLI calls in one process (each ``torchtpu-export`` process spends seconds importing torch): every
# call's exit code, what it wrote to file descriptors 1 and 2 (native libraries' logs included), and the
# process's peak resident memory so far (VmHWM, in MB).
_MANY = """
import json, os, sys, tempfile
from torchtpu_export.cli import main
results = []
for argv in json.loads(sys.stdin.read()):
    print("case", argv, file=sys.__stdout__, flush=True)  # the case a crash happened in, for the report
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
        results.append([code, out.read(), err.read(), int(hwm.split()[1]) / 1024])
print("RESULTS", json.dumps(results), file=sys.__stdout__, flush=True)
"""


def run_cli_many(argvs, timeout=900, prelude: str = ""):
    """``torchtpu-export ARGV`` for each of ``argvs`` in one fresh process (``prelude`` run first), in order: a
    CompletedProcess-like (returncode, stdout, stderr, peak_mb: the process's peak so far) per call. A call
    that kills the process fails with what it printed."""
    import json
    import types
    r = subprocess.run([sys.executable, "-c", prelude + _MANY],
                       input=json.dumps([[str(a) for a in argv] for argv in argvs]),
                       cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if "RESULTS " not in r.stdout:
        raise AssertionError(f"the CLI process ended with {r.returncode} in {r.stdout.strip().splitlines()[-1:]}: "
                             f"{r.stderr[-2000:]}")
    results = json.loads(r.stdout.split("RESULTS ", 1)[1])
    return [types.SimpleNamespace(returncode=c, stdout=o, stderr=e, peak_mb=m) for c, o, e, m in results]


def export_folder(model, tokenizer, folder, *exports):
    """``model`` and ``tokenizer`` saved as a Hugging Face folder, then ``torchtpu-export FOLDER ARGS`` for
    each of ``exports`` (one process, as a user would): each must succeed, its self-check against
    transformers passed."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for r in run_cli_many([[folder, *args] for args in exports]):
        assert r.returncode == 0 and "checked against transformers on a probe prompt" in r.stdout, r.stderr


@pytest.fixture
def cli():
    return run_cli
