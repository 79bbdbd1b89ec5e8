"""What every target provides (``Target``) and what every artifact object is (``Runnable``)."""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError
from ..specs import TensorSpec


@dataclasses.dataclass(frozen=True)
class LlmSupport:
    """What a target does with an LLM (``api.export_llm``); by default its prefill and decode programs as plain
    programs of this target, one sequence each, float32 caches."""

    # the target whose converter makes the programs (None: this one), and what wraps them into this target's
    # artifact ((program, source, cache layout, prefill lengths, **parts) -> Runnable; None: the program itself)
    program_target: str | None = None
    from_llm: Callable | None = None
    # (source, cache layout) -> None, or InputError for a model whose cache this target's runtime cannot use
    # (checked before anything is exported)
    check_layout: Callable | None = None
    # (source, cache layout, prefill lengths) -> build options through which the programs carry what an LLM
    # artifact needs (the tpu target's manifest: donated caches, tokenizer, chat template)
    options: Callable | None = None
    only: bool = False  # the target takes only LLMs: its command-line input is a model folder, not a module
    # its artifacts carry recurrent layers' states (Mamba, linear attention, short convolutions) from step to
    # step; export_llm refuses such a model for the other targets, naming the layer (and ``recurrent_state_why``)
    recurrent_state: bool = False
    recurrent_state_why: str = ""
    # its runtime pads a prompt's last chunk (LiteRT-LM: token 0 at position 0, the rows masked): the steps then
    # find the real tokens themselves and keep each recurrent state as it was after the last of them
    pads_prompts: bool = False
    # vision-language models (llm.vision): an image encoder and adapter beside the language model; with
    # ``image_rows`` the steps take tokens and an image's rows (``prefill_image_<N>``, a serving engine merges
    # them), else embeddings (the runtime merges an image's rows); export_llm refuses a VLM elsewhere
    vision: bool = False
    image_rows: bool = False
    lora: bool = False  # LoRA adapters (llm.lora): export_llm(lora=) makes LoRA-ready steps
    # datacenter serving: batched programs for an engine's slots (by default ``DEFAULT_SLOTS`` rows), smaller
    # decode batches, paged KV caches
    batched: bool = False
    cache_follows_recipe: bool = False  # a bf16 recipe keeps the KV cache in bf16 (on-device runtimes: float32)


@dataclasses.dataclass(frozen=True)
class Target:
    """A deployment target: the one record code goes through for anything that differs by target.

    ``name`` is what users type (``--target NAME``, ``tte.export(target=NAME)``) and the kind
    ``targets.sniff`` gives its artifact files (those ``magic(head, zip_names)`` claims; a target without
    ``magic`` claims the files no one else does that end in its ``suffix``); ``converter`` names the package under
    ``converters/`` and ``runtime`` the module under ``runtimes/``. The callables take:
    ``build(captures, options) -> Runnable`` (converted, wrapped in its runnable object),
    ``load(path) -> Runnable``, ``describe(path, topologies) -> dict`` (what ``inspect`` prints),
    ``cli_options(args, sample_args, sample_kwargs) -> dict`` (the converter's options from the
    command line's flags, of which ``cli_flags`` are this target's), and ``prepare(module, args,
    kwargs, options) -> (module, args, kwargs, options)``, what happens before capture (the
    litert target's channel-last wrapping). ``describe`` takes ``topologies`` only where the target
    compiles for them (:func:`no_topologies` says so for the others).
    """

    name: str
    summary: str
    converter: str
    runtime: str
    suffix: str
    runnable: type
    signature: str  # the name of a single captured program ("main", litert-torch's "serving_default")
    build: Callable
    load: Callable
    describe: Callable
    cli_options: Callable
    # the command line: this target's own arguments, (flag, argparse keywords) each, added to the convert
    # parser by the CLI, and the quantization recipes it takes (``--quantize``, ``quant_config=``)
    cli_arguments: tuple = ()
    recipes: tuple = ()
    magic: Callable | None = None  # (first 8 bytes, zip member names or None) -> whether the file is this target's
    zipped: bool = False  # its artifact is a zip archive
    describe_lines: Callable | None = None  # (inspect's dict, program name or None) -> this target's lines of text
    prepare: Callable | None = None
    compile: Callable | None = None  # `torchtpu-export compile`: (args, output path) -> lines to print
    local_options: dict = dataclasses.field(default_factory=dict)  # to build what runs on this machine
    multi_signature: bool = True  # several signatures (tte.signature) in one artifact
    debuggable: bool = True  # `torchtpu-export debug` compares its intermediates
    gpu_check: Callable | None = None  # path -> {"compatible", "problems"}: `inspect --gpu` (a GPU delegate's verdict)
    npu_check: Callable | None = None  # (path, "vendor:SoC,...") -> per-SoC ops on the NPU/CPU: `inspect --soc`
    stateful: bool = False  # buffers a module changes in place are kept between calls (on the device)
    # what the target does with an LLM (api.export_llm): its own sub-record
    llm: "LlmSupport" = dataclasses.field(default_factory=lambda: LlmSupport())
    # programs take weights by shape and dtype alone (a model built under abstract_weights()); values
    # are bound at load. Other targets write weight values into their files.
    abstract_weights: bool = False
    # its files may store executables compiled ahead of time (`compile`), native code: its ``load`` takes
    # ``trust_stored_executables`` and reads them only when that is True
    stored_executables: bool = False


    @property
    def cli_flags(self) -> tuple:
        """The argparse names of this target's flags (``--quantize`` where it has recipes)."""
        own = tuple(flag.lstrip("-").replace("-", "_") for flag, _ in self.cli_arguments)
        return own + (("quantize",) if self.recipes else ())

    def check_recipe(self, quant_config) -> None:
        """A recipe this target does not take is refused before anything is captured."""
        from ..quant import parse
        parse(quant_config, self.name, self.recipes)


def no_topologies(topologies) -> None:
    if topologies:
        raise InputError("--topology applies to .tpu artifacts")


class Runnable:
    """An artifact held in memory and run on its runtime: named signatures, each with torch-side input
    and output specs and (for artifacts this project wrote) the module's call structure.

    ``obj(*args, signature_name=None, **kwargs)`` takes the module's own (nested) arguments and gives
    numpy outputs in the module's output structure; ``run_flat`` takes and gives flat lists;
    ``save(path)`` writes the file atomically. A subclass provides ``signatures``, ``_call_metadata``,
    ``_io``, ``_run`` and ``save``; it may refine the call (``_bind``, ``_structure``).
    """

    default_signature: str | None = None  # what a call without signature_name runs, among several
    # an LLM artifact's: the LoRA adapter export_llm(lora=PEFT_DIR) converted, a VLM bundle's image parts
    # (llm.vision.VisionParts); None for the others
    adapter = None
    vision = None
    quant_report = None  # a quantized edge model's error against float (tte.convert's)

    @property
    def llm(self) -> dict | None:
        """What an LLM artifact carries for a server (a ``.tpu``'s manifest entry ``llm``), or None."""
        return None

    @property
    def lora_inputs(self) -> dict:
        """``{name: shape}`` of the LoRA adapter inputs its steps take (empty: it takes no adapter)."""
        return {}

    @property
    def signatures(self) -> list[str]:
        raise NotImplementedError

    def _call_metadata(self, sig: str) -> dict | None:
        """The signature's call metadata (``CapturedProgram.call_metadata``), or None for a file made elsewhere."""
        raise NotImplementedError

    def _io(self, sig: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The signature's inputs and outputs as the file itself declares them (files made elsewhere)."""
        raise NotImplementedError

    def _run(self, sig: str, inputs: list) -> list[np.ndarray]:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    def generate(self, prompt, max_new_tokens: int = 64, *, chat: bool = False, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop=None, seed: int | None = None,
                 response_format: dict | None = None):
        """An LLM artifact's reply to ``prompt`` (text, or token ids), as a ``llm.contract.Generation``
        (text and ids). ``chat=True`` sends a text prompt as a user message through the artifact's chat
        template; greedy at ``temperature=0``, else top-k / top-p sampling seeded by ``seed``; ``stop``:
        token ids that end the reply (default: the artifact's stop tokens); ``response_format``: the reply
        follows a JSON schema (``{"type": "json_schema", "json_schema": {"schema": ...}}``), is a JSON
        object (``{"type": "json_object"}``) or matches a regular expression (``{"type": "regex",
        "pattern": ...}``), by constrained decoding. Artifacts that hold no LLM (not made by
        ``export_llm``) refuse."""
        raise InputError(f"this {type(self).__name__} holds no LLM: generate (run --prompt) applies to the artifacts "
                         "tte.export_llm makes from a language model (.tpu, .litertlm)")

    # ---- shared ------------------------------------------------------------------------------

    def signature(self, signature_name: str | None = None) -> str:
        """The signature a call runs: the one named, else the only one, else the default one."""
        sigs = self.signatures
        if signature_name is None:
            if len(sigs) == 1:
                return sigs[0]
            if self.default_signature in sigs:
                return self.default_signature
            raise InputError(f"this artifact has several signatures {sigs}"
                             + (f" and no {self.default_signature!r}" if self.default_signature else "")
                             + ": pass signature_name= (run --signature)")
        if signature_name not in sigs:
            raise InputError(f"no signature {signature_name!r}; " + (
                f"this artifact holds one program, {sigs[0]!r}" if len(sigs) == 1 else f"this artifact has {sigs}"))
        return signature_name

    def call_metadata(self, signature_name: str | None = None) -> dict | None:
        """How the module is called (``CapturedProgram.call_metadata``: pytree specs of inputs and outputs,
        constant inputs) for one signature, or None for a file made elsewhere."""
        return self._call_metadata(self.signature(signature_name))

    def inputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        """The inputs as the original module takes them (torch's names, shapes and dtypes)."""
        sig = self.signature(signature_name)
        meta = self._call_metadata(sig)
        return [TensorSpec.from_json(d) for d in meta["inputs"]] if meta else list(self._io(sig)[0])

    def outputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        sig = self.signature(signature_name)
        meta = self._call_metadata(sig)
        return [TensorSpec.from_json(d) for d in meta["outputs"]] if meta else list(self._io(sig)[1])

    def run_flat(self, inputs: Sequence, signature_name: str | None = None) -> list[np.ndarray]:
        """Runs on already-flattened inputs (the signature's input order); returns the flat outputs."""
        sig = self.signature(signature_name)
        return self._run(sig, list(inputs))

    def __call__(self, *args, signature_name: str | None = None, **kwargs):
        sig = self.signature(signature_name)
        meta = self._call_metadata(sig)
        flat = self._bind(sig, args, kwargs)
        if meta is None:  # a file from elsewhere: flat inputs (positional or by name), flat outputs
            if flat is None and kwargs:
                raise InputError(f"pass the inputs positionally or by their names "
                                 f"{[s.name for s in self.inputs(sig)]}")
            outs = self.run_flat(list(args) if flat is None else flat, sig)
            return outs[0] if len(outs) == 1 else tuple(outs)
        if flat is None:
            from ..capture import flatten_call_args
            flat = flatten_call_args(meta["in_spec"], meta.get("constant_inputs", {}), args, kwargs)
        return self._structure(sig, self.run_flat(flat, sig))

    def _bind(self, sig: str, args, kwargs) -> list | None:
        """The flat inputs when the call names them the file's way, else None (the module's way)."""
        return None

    def _structure(self, sig: str, outs: list):
        """The flat outputs in the module's output structure."""
        import torch.utils._pytree as pytree

        from .. import treespec
        return pytree.tree_unflatten(outs, treespec.loads(self._call_metadata(sig)["out_spec"]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(signatures={self.signatures})"
