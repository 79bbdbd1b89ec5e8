"""Mutation fuzzing of every reader: a .tpu (its zip, its manifest), safetensors, a .tflite flatbuffer
and a .pt2, at least MIN_MUTANTS mutants each, within TIME_BUDGET_S seconds.

Each mutant must load or be refused with the reader's own error (ArtifactError / InputError, exit
codes 5 / 2; ValueError for the bare safetensors parser): no other exception (an exit 1), no crash,
no mutant slower than SLOW_S. Mutants are drawn from a fixed seed; a failure prints the mutation
that reproduces it. The mutated .tflite files that pass validation are then run by LiteRT in worker
processes (coverage's pool), where a crash would be reported instead of ending the suite.
"""
import io
import json
import random
import time
import zipfile

import numpy as np
import pytest
import torch

import torchtpu_export as tte
from torchtpu_export.targets.litert import artifact as litert_format
from torchtpu_export import models, safetensors_io, targets
from torchtpu_export.targets.tpu import artifact as tpu_format
from torchtpu_export.errors import ArtifactError, InputError

from mutants import _rezip, mutate, mutations

MIN_MUTANTS = 1000
TIME_BUDGET_S = 90.0
SLOW_S = 10.0


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.l(x))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-readers")
    torch.manual_seed(0)
    m, x = Tiny(), torch.randn(2, 4)
    tte.export(m, (x,), platforms=("cpu",)).save(d / "m.tpu")
    tte.convert(m, (x,)).export(d / "m.tflite")
    torch.export.save(torch.export.export(m, (x,)), d / "m.pt2")
    out = {k: (d / f"m.{k}").read_bytes() for k in ("tpu", "tflite", "pt2")}
    with zipfile.ZipFile(io.BytesIO(out["tpu"])) as zf:
        out["manifest"] = zf.read("manifest.json")
        out["safetensors"] = zf.read("weights.safetensors")
    return out


def fuzz(original: bytes, attempt, allowed, seed: int):
    """Runs ``attempt(mutant)`` on mutants until MIN_MUTANTS are done and the budget spent (or the
    budget, if it runs out first, which fails); returns how many loaded cleanly."""
    rng = random.Random(seed)
    t_end = time.monotonic() + TIME_BUDGET_S
    n = loaded = 0
    while n < MIN_MUTANTS:
        assert time.monotonic() < t_end, f"only {n} mutants in {TIME_BUDGET_S:.0f} s"
        ops = mutations(rng, len(original))
        mutant = mutate(original, ops)
        t0 = time.monotonic()
        try:
            attempt(mutant)
            loaded += 1
        except allowed:
            pass
        except Exception as e:  # noqa: BLE001  (the failure to report)
            pytest.fail(f"mutant {n} ({ops}) raised {type(e).__name__}: {str(e)[:300]}", pytrace=False)
        assert time.monotonic() - t0 < SLOW_S, f"mutant {n} ({ops}) took {time.monotonic() - t0:.1f} s"
        n += 1
    return loaded


def test_tpu_files(originals, tmp_path):
    path = tmp_path / "f.tpu"

    def attempt(data):
        path.write_bytes(data)
        tpu_format.read(path)
    fuzz(originals["tpu"], attempt, (ArtifactError, InputError), seed=1)


def test_tpu_manifests(originals, tmp_path):
    """Mutated manifests in a well-formed zip (digests do not cover the manifest itself)."""
    path = tmp_path / "m.tpu"
    base = json.loads(originals["manifest"])
    rng = random.Random(7)
    values = [None, -1, 0, 2 ** 63, "x", [], {}, [1, "a"], {"a": 1}, True, 1.5, "../../etc/passwd"]

    def structural(data):
        # half the mutants change a field anywhere in the manifest to a value of another type
        doc = json.loads(data)
        node, key = doc, None
        for _ in range(rng.randint(1, 6)):
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) \
                if isinstance(node, list) else []
            if not items:
                break
            key, child = rng.choice(items)
            if not isinstance(child, (dict, list)) or rng.random() < 0.3:
                node[key] = rng.choice(values)
                break
            node = child
        return json.dumps(doc).encode()

    def attempt(data):
        if rng.random() < 0.5:
            data = structural(originals["manifest"])
        path.write_bytes(_rezip(originals["tpu"], "manifest.json", data))
        tpu_format.read(path)
    assert base["format_version"] == tpu_format.FORMAT_VERSION
    fuzz(originals["manifest"], attempt, (ArtifactError, InputError), seed=2)


def test_safetensors(originals):
    fuzz(originals["safetensors"], safetensors_io.read, (ValueError,), seed=3)


def test_tflite_files(originals, tmp_path):
    path = tmp_path / "f.tflite"

    def attempt(data):
        litert_format.validate(data)
        litert_format.read_metadata(data, verify=True)
        path.write_bytes(data)
        targets.get("litert").describe(str(path))
    fuzz(originals["tflite"], attempt, (ArtifactError, InputError), seed=4)


def test_pt2_files(originals, tmp_path):
    path = tmp_path / "f.pt2"

    def attempt(data):
        path.write_bytes(data)
        models.load_model(str(path))
    fuzz(originals["pt2"], attempt, (ArtifactError, InputError), seed=5)


def run_tflite(path: str) -> dict:
    """Worker task: the EdgeModel path (validation, then LiteRT) on one file."""
    from torchtpu_export.errors import TteError
    try:
        edge = tte.load(path)
        edge(np.ones((2, 4), np.float32))
    except TteError as e:
        return {"status": "refused", "code": e.exit_code}
    except Exception as e:  # noqa: BLE001
        return {"status": "exception", "reason": f"{type(e).__name__}: {e}"}
    return {"status": "ran"}


def test_validated_tflite_mutants_never_crash_litert(originals, tmp_path):
    """Mutants that pass validation go to the LiteRT interpreter, each in a worker process."""
    from torchtpu_export.coverage import run_isolated
    rng = random.Random(6)
    paths = []
    while len(paths) < 60:
        ops = mutations(rng, len(originals["tflite"]))
        data = mutate(originals["tflite"], ops)
        try:
            litert_format.validate(data)
            litert_format.read_metadata(data, verify=True)
        except ArtifactError:
            continue
        path = tmp_path / f"v{len(paths)}.tflite"
        path.write_bytes(data)
        paths.append(str(path))
    results = run_isolated([("test_fuzz_readers:run_tflite", (p,)) for p in paths], jobs=2, timeout=60)
    bad = [(p, r) for p, r in zip(paths, results) if r.get("status") not in ("ran", "refused")
           or r.get("code") == 1]
    assert not bad, bad[:3]
