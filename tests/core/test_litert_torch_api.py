"""`import torchtpu_export as litert_torch` works for litert-torch's public API: the default signature,
the built-in error classes, signature input/output names, flat-named calls and nested outputs, input
mutation, to_channel_last_io, keyword options, and the ops litert-torch converts.

Written from the behaviour litert-torch 0.10 shows (its signature names: positional inputs
``args_<i>``, keyword and nested ones by their path; dict outputs by their path, others
``output_<i>``), not copied from it."""
import dataclasses

import numpy as np
import pytest
import torch
from ai_edge_litert import interpreter as tfl_interpreter

import torchtpu_export as litert_torch
import zoo
from torchtpu_export.targets.litert.target import describe as describe_tflite


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


def _runner(edge, signature="serving_default"):
    return tfl_interpreter.Interpreter(model_content=edge.model_content()).get_signature_runner(signature)


# ---- 1. the default signature and error classes -------------------------------------------

def test_convert_with_a_module_makes_it_the_default_signature():
    small, large = (torch.randn(2, 4),), (torch.randn(8, 4),)
    edge = litert_torch.signature("large_input", Scale(), large).convert(Scale(), small)
    assert set(edge.signatures) == {"large_input", "serving_default"}
    np.testing.assert_allclose(edge(*small), Scale()(*small).numpy(), rtol=1e-6)
    np.testing.assert_allclose(edge(*large, signature_name="large_input"), Scale()(*large).numpy(), rtol=1e-6)


def test_several_signatures_without_a_default_need_a_name_and_say_so_as_value_error():
    edge = (litert_torch.signature("input", Scale(), (torch.randn(2, 4),))
            .signature("large_input", Scale(), (torch.randn(8, 4),)).convert())
    with pytest.raises(ValueError, match="signature_name"):
        edge(torch.randn(2, 4))
    with pytest.raises(ValueError):
        edge(torch.randn(2, 4), signature_name="nope")


def test_error_classes_are_the_matching_builtins():
    assert issubclass(litert_torch.InputError, ValueError)
    assert issubclass(litert_torch.ArtifactError, ValueError)
    assert issubclass(litert_torch.UnsupportedOpError, NotImplementedError)
    assert issubclass(litert_torch.OutputError, OSError)
    with pytest.raises(ValueError):
        litert_torch.convert(Scale(), (torch.randn(2, 4),))(torch.randn(3, 5))
    with pytest.raises(OSError):
        litert_torch.convert(Scale(), (torch.randn(2, 4),)).export("/no/such/folder/m.tflite")


# ---- 2. and 3. names, flat-named calls, nested outputs --------------------------------------

@dataclasses.dataclass
class Container:
    data_1: torch.Tensor
    data_2: object


torch.utils._pytree.register_dataclass(Container)


class Nested(torch.nn.Module):
    def forward(self, x, y, z):
        return x + y + z.data_1 + z.data_2[0]["foo"] + z.data_2[1]


def _nested_inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda: torch.randn(3, 3, generator=g)  # noqa: E731
    return (r(),), dict(y=r(), z=Container(data_1=r(), data_2=(dict(foo=r()), r())))


def test_signature_input_names_follow_litert_torch():
    args, kwargs = _nested_inputs()
    edge = litert_torch.convert(Nested().eval(), args, kwargs)
    flat = {"args_0": args[0].numpy(), "y": kwargs["y"].numpy(), "z_data_1": kwargs["z"].data_1.numpy(),
            "z_data_2_0_foo": kwargs["z"].data_2[0]["foo"].numpy(), "z_data_2_1": kwargs["z"].data_2[1].numpy()}
    assert set(_runner(edge).get_input_details()) == set(flat)
    want = Nested()(*args, **kwargs).numpy()
    np.testing.assert_allclose(edge(**flat), want, rtol=1e-6)  # litert-torch's flat-named call
    np.testing.assert_allclose(edge(*args, **kwargs), want, rtol=1e-6)  # and the module's own structure


def test_keyword_sample_inputs_are_named_by_keyword():
    kw = dict(x=torch.randn(4, 4), y=torch.randn(4, 4))
    edge = litert_torch.convert(Add().eval(), sample_kwargs=kw)
    assert set(_runner(edge).get_input_details()) == {"x", "y"}
    np.testing.assert_allclose(edge(**kw), (kw["x"] + kw["y"]).numpy(), rtol=1e-6)


class DictOut(torch.nn.Module):
    def forward(self, x, y, z):
        return {"x": x, "y": Container(data_1=y, data_2=[y, z])}


def test_nested_dict_outputs_have_flat_names_and_both_lookups():
    args = tuple(torch.randn(10, 10) for _ in range(3))
    edge = litert_torch.convert(DictOut().eval(), args)
    assert set(_runner(edge).get_output_details()) == {"x", "y_data_1", "y_data_2_0", "y_data_2_1"}
    out = edge(**{f"args_{i}": a.numpy() for i, a in enumerate(args)})
    np.testing.assert_almost_equal(out["x"], args[0].numpy())
    np.testing.assert_almost_equal(out["y_data_1"], args[1].numpy())  # litert-torch's flat key
    np.testing.assert_almost_equal(out["y_data_2_1"], args[2].numpy())
    np.testing.assert_almost_equal(out["y"].data_2[1], args[2].numpy())  # the module's own structure


def test_tuple_outputs_are_output_i():
    class Two(torch.nn.Module):
        def forward(self, x):
            return x + 1, x * 2

    edge = litert_torch.convert(Two().eval(), (torch.randn(2, 3),))
    assert set(_runner(edge).get_output_details()) == {"output_0", "output_1"}
    assert isinstance(edge(torch.randn(2, 3)), tuple)


# ---- 4. mutation -------------------------------------------------------------------------

class MutatesInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class DividesInPlace(torch.nn.Module):
    def forward(self, x):
        x /= 2
        x = x + 10
        return x


@pytest.mark.parametrize("module", [MutatesInput, DividesInPlace])
@pytest.mark.parametrize("target", ["litert", "tpu"])
def test_input_mutation_is_part_of_the_program(module, target):
    x = torch.randn(4, 5)
    want = module()(x.clone())
    prog = litert_torch.export(module().eval(), (x.clone(),), target=target,
                               **({"platforms": ("cpu",)} if target == "tpu" else {}))
    np.testing.assert_allclose(prog(x.clone()), want.numpy(), rtol=1e-6)


class CountsCalls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls


def test_a_mutated_buffer_is_refused_with_its_name_and_a_hint():
    with pytest.raises(litert_torch.CaptureError, match="calls") as e:
        litert_torch.convert(CountsCalls().eval(), (torch.randn(2, 3),))
    assert "explicit inputs" in e.value.hint


# ---- 5. to_channel_last_io -----------------------------------------------------------------

class Identity(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("shape,args,outputs,want", [
    ((1, 3, 10, 10), None, None, (1, 3, 10, 10)),
    ((1, 10, 10, 3), [0], None, (1, 3, 10, 10)),
    ((1, 3, 10, 10), None, [0], (1, 10, 10, 3)),
    ((1, 10, 10, 3), [0], [0], (1, 10, 10, 3)),
    ((1, 10, 10, 10, 3), [0], None, (1, 3, 10, 10, 10)),
    ((2, 7, 3), [0], None, (2, 3, 7)),
])
def test_to_channel_last_io_permutes_the_chosen_tensors(shape, args, outputs, want):
    assert litert_torch.to_channel_last_io(Identity(), args=args, outputs=outputs)(torch.rand(shape)).shape == want


def test_to_channel_last_io_chains_and_keeps_other_outputs():
    class TwoIdentity(torch.nn.Module):
        def forward(self, x):
            return x, x

    m = litert_torch.to_channel_last_io(litert_torch.to_channel_last_io(Identity(), args=[0]), outputs=[0])
    assert m(torch.rand(1, 10, 10, 3)).shape == (1, 10, 10, 3)
    y = litert_torch.to_channel_last_io(TwoIdentity(), outputs=[0])(torch.rand(1, 3, 10, 10))
    assert isinstance(y, tuple) and y[0].shape == (1, 10, 10, 3) and y[1].shape == (1, 3, 10, 10)
    with pytest.raises(ValueError, match="rank >= 3"):
        litert_torch.to_channel_last_io(Identity(), args=[0])(torch.rand(4, 4))


def test_converting_a_wrapped_cnn_adds_no_transpose_at_its_boundary(tmp_path):
    model, (x,) = zoo.small_cnn()
    wrapped = litert_torch.to_channel_last_io(model.eval(), args=[0])
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    edge = litert_torch.convert(wrapped, (nhwc,))
    np.testing.assert_allclose(edge(nhwc), model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    edge.export(tmp_path / "m.tflite")
    assert describe_tflite(str(tmp_path / "m.tflite"))["transposes"] == 0
    shorthand = litert_torch.convert(model.eval(), (x,), channels_last_io=True)  # every 4-D float input
    np.testing.assert_allclose(shorthand(nhwc), edge(nhwc), rtol=1e-6)


# ---- 6. ops --------------------------------------------------------------------------------

class Unfold(torch.nn.Module):
    def forward(self, x):
        return x.unfold(1, 3, 2)


class SplitCopy(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aten.split_copy.Tensor(x, 2, 1)


class SliceScatterStep(torch.nn.Module):
    def forward(self, x, src):
        return torch.slice_scatter(x, src, dim=1, start=1, end=9, step=3)


@pytest.mark.parametrize("module,args", [
    (Unfold, (torch.randn(2, 9, 4),)),
    (SplitCopy, (torch.randn(3, 7),)),
    (SliceScatterStep, (torch.zeros(2, 10), torch.randn(2, 3))),
])
def test_ops_litert_torch_converts(module, args):
    want = module()(*args)
    got = litert_torch.convert(module().eval(), args)(*args)
    for g, w in zip(got if isinstance(got, (tuple, list)) else (got,), want if isinstance(want, (tuple, list)) else (want,)):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-6)


# ---- 7. keyword options --------------------------------------------------------------------

def test_unknown_keyword_options_are_type_errors_naming_them():
    with pytest.raises(TypeError, match="frobnicate"):
        litert_torch.convert(Scale(), (torch.randn(2, 4),), frobnicate=True)
    with pytest.raises(TypeError, match="frobnicate"):
        litert_torch.signature("a", Scale(), (torch.randn(2, 4),)).convert(frobnicate=1)


def test_lightweight_conversion_is_accepted():
    edge = litert_torch.convert(Scale(), (torch.randn(2, 4),), lightweight_conversion=True)
    np.testing.assert_allclose(edge(torch.ones(2, 4)), np.full((2, 4), 3.0), rtol=1e-6)


def test_litert_torch_names_and_options(tmp_path):
    conv = litert_torch.Converter().add_signature("a", Scale(), (torch.randn(2, 4),))
    out = tmp_path / "m.tflite"
    edge = conv.convert(output_file_path=str(out))
    assert isinstance(edge, litert_torch.Model) and out.is_file()
    assert isinstance(litert_torch.load(str(out)), litert_torch.Model)
