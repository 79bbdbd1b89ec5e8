"""Every example runs to completion on both targets and matches eager (tokens for the decoders)."""
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(script, *args, tmp_path):
    env = dict(os.environ, TTE_EXAMPLES_OUT=str(tmp_path), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, *args], cwd=EXAMPLES, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decoder_examples_generate_eager_tokens(name, tmp_path):
    out = run_example(f"{name}.py", tmp_path=tmp_path)
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
    out = run_example("demo.py", tmp_path=tmp_path)
    assert out.count(" OK ") >= 2, out
