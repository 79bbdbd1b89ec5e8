"""Every example runs to completion on both targets and matches eager (tokens for the decoders),
and the TPU compiler (libtpu, ahead of time) accepts every .tpu it writes for v5e and v6e."""
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES
from torchtpu_export.targets.tpu import aot as tpu_compile, artifact as tpu_format


# The project's own code raises no deprecation or user warnings on the paths users take: the demo and
# the decoder examples run with those warnings as errors.
STRICT = "error::FutureWarning,error::UserWarning,error::DeprecationWarning"


def run_example(script, *args, tmp_path, warnings="ignore"):
    env = dict(os.environ, TTE_EXAMPLES_OUT=str(tmp_path), PYTHONWARNINGS=warnings)
    proc = subprocess.run([sys.executable, script, *args], cwd=EXAMPLES, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _tpu_artifacts_compile(tmp_path)
    return proc.stdout


def _tpu_artifacts_compile(folder):
    paths = sorted(p for p in os.listdir(folder) if p.endswith(".tpu"))
    assert paths, f"the example wrote no .tpu to {folder}"
    for name in paths:
        artifact = tpu_format.read(os.path.join(folder, name))
        for topology in ("v5e:2x2", "v6e:2x2"):
            try:
                tpu_compile.compile_artifact(artifact, topology, store=False)
            except tpu_compile.CompileError as e:
                pytest.fail(f"{name}: {e}", pytrace=False)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decoder_examples_generate_eager_tokens(name, tmp_path):
    out = run_example(f"{name}.py", tmp_path=tmp_path, warnings=STRICT)
    rows = [line for line in out.splitlines() if line.startswith(("tpu ", "litert "))]
    assert len(rows) == 2 and all("8 greedy tokens match eager" in r and " OK: " in r for r in rows), out
    assert (tmp_path / f"{name}.tpu").exists() and (tmp_path / f"{name}.tflite").exists()


@pytest.mark.parametrize("name", ["mingpt", "resnet50", "dlrm", "unet"])
def test_model_examples_agree_with_eager(name, tmp_path):
    out = run_example(f"{name}.py", tmp_path=tmp_path)
    rows = [line for line in out.splitlines() if line.startswith(("tpu ", "litert "))]
    assert len(rows) == 2 and all(" OK: max abs err" in r for r in rows), out


def test_hf_transformers_example(tmp_path):
    out = run_example("hf_transformers.py", tmp_path=tmp_path)
    for name in ("llama", "qwen2", "qwen3", "gpt2", "bert", "vit", "whisper_encoder"):
        assert f"transformers {name}:" in out
    rows = [line for line in out.splitlines() if line.startswith(("tpu ", "litert "))]
    assert len(rows) == 14 and all(" OK: " in r for r in rows), out


def test_demo(tmp_path):
    out = run_example("demo.py", tmp_path=tmp_path, warnings=STRICT)
    assert out.count(" OK ") >= 2, out
