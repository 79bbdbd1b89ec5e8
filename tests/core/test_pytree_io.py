"""Every pytree torch.export takes or returns round-trips through an artifact: torch.return_types
(max, topk, sort, ...) and user namedtuples come back as the same namedtuples, on every target."""
import collections
import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
from torchtpu_export import treespec
from torchtpu_export.errors import ArtifactError, InputError

Pair = collections.namedtuple("Pair", "x scale")
SUFFIX = {"tpu": ".tpu", "litert": ".tflite", "onnx": ".onnx"}


class Stats(torch.nn.Module):
    def forward(self, inp: Pair):
        y = inp.x * inp.scale
        return torch.max(y, 1), {"top": torch.topk(y, 2), "sorted": torch.sort(y, dim=-1)}


def _export(model, args, target):
    if target == "tpu":
        return tte.export(model, args, target="tpu", platforms=("cpu",))
    return tte.export(model, args, target=target)


@pytest.mark.parametrize("target", ["tpu", "litert", "onnx"])
def test_return_types_and_namedtuple_inputs_round_trip(target, tmp_path):
    g = torch.Generator().manual_seed(0)
    inp = Pair(torch.randn(3, 6, generator=g), torch.rand(3, 1, generator=g) + 0.5)
    ref = Stats()(inp)
    path = tmp_path / f"m{SUFFIX[target]}"
    _export(Stats(), (inp,), target).save(path)
    out = tte.load(path)(inp)
    assert type(out[0]) is torch.return_types.max
    assert type(out[1]["top"]) is torch.return_types.topk and type(out[1]["sorted"]) is torch.return_types.sort
    np.testing.assert_allclose(out[0].values, ref[0].values.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out[0].indices, ref[0].indices.numpy())
    np.testing.assert_array_equal(out[1]["top"].indices, ref[1]["top"].indices.numpy())
    with pytest.raises(InputError, match="structure of the captured ones"):
        tte.load(path)((inp.x, inp.scale))  # a plain tuple is not a Pair


def test_user_namedtuple_output_comes_back_as_its_class():
    class M(torch.nn.Module):
        def forward(self, x):
            return Pair(x + 1, x * 2)

    out = _export(M(), (torch.ones(2),), "tpu")(torch.ones(2))
    assert type(out) is Pair and out.scale.tolist() == [2.0, 2.0]


def test_a_namedtuple_unknown_to_the_loading_process_is_rebuilt_by_its_fields():
    text = json.dumps({treespec.TAG: 1, "tree": {"t": "namedtuple", "n": "somewhere_else.Result",
                                                 "f": ["logits", "cache"], "c": [0, 0]}})
    value = pytree.tree_unflatten([1, 2], treespec.loads(text))
    assert type(value).__name__ == "Result" and value.logits == 1 and value.cache == 2


@dataclasses.dataclass
class Unregistered:
    a: torch.Tensor


def test_an_unrecordable_pytree_node_names_its_type_and_the_registration():
    pytree.register_pytree_node(Unregistered, lambda u: ([u.a], None), lambda v, c: Unregistered(v[0]))
    try:
        class M(torch.nn.Module):
            def forward(self, x):
                return Unregistered(x + 1)

        with pytest.raises(InputError, match="Unregistered") as e:
            _export(M(), (torch.ones(2),), "tpu")
        assert "serialized_type_name" in e.value.hint
    finally:
        pytree._deregister_pytree_node(Unregistered)


@pytest.mark.parametrize("text", ['{"torchtpu_export.treespec": 1, "tree": {"t": "exec"}}',
                                  '{"torchtpu_export.treespec": 1, "tree": {"t": "namedtuple", "n": "os.system",'
                                  ' "f": ["import os"], "c": [0]}}',
                                  '{"torchtpu_export.treespec": 1, "tree": {"t": "dict", "k": [[1]], "c": [0]}}',
                                  "not json"])
def test_malformed_specs_are_artifact_errors(text):
    with pytest.raises(ArtifactError, match="malformed"):
        treespec.loads(text)
