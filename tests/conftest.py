import os
import subprocess
import sys
import warnings

import pytest

from torchtpu_export import tpu_compile

tpu_compile.prepare_environment()  # test modules that import jax themselves do so after this

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)  # zoo: the example models tests build (and, below, the processes tests start)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Runs ``torchtpu-export ARGS`` in a fresh process; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torchtpu_export", *map(str, args)], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli
