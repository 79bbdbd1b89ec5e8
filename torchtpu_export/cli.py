"""The ``torchtpu-export`` command line.

    torchtpu-export MODEL --target {tpu,litert,onnx} [-o OUT] [--inputs SPEC ...] [--check]
    torchtpu-export inspect ARTIFACT
    torchtpu-export run ARTIFACT [--inputs x.npy ...] [-o outputs.npz]
    torchtpu-export HF_MODEL_FOLDER --target litertlm [--prefill-lengths 32,128] [--cache-length 1024]
    torchtpu-export run model.litertlm|model.tpu --prompt "..." [--chat]

Errors print one message on stderr and exit with the code of their class
(see ``errors.EXIT_CODES``); ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Callable

from . import debugger, server, targets
from .targets.litert import web
from ._version import __version__
from .coverage import cli as coverage_cli
from . import fileio
from .errors import EXIT_CODES, CaptureError, InputError, NumericsError, Terminated, TteError
from .numerics import tolerance_arg
from .untrusted import printable

log = logging.getLogger("torchtpu_export")


EXIT_CODES_HELP = "exit codes:\n" + "\n".join(f"  {code:>3}  {what}" for code, what in sorted(EXIT_CODES.items()))


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line plus a hint, like every other error (exit code 2)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n  hint: see `{self.prog} --help`\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug logs)")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _out(args, text: str = "") -> None:
    if not args.quiet:
        from . import progress
        progress.clear_line()
        print(printable(text, newlines=True), flush=True)


# ---- convert -------------------------------------------------------------------------------

def _convert_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="torchtpu-export",
        description="Convert a PyTorch model to a TPU StableHLO executable (.tpu), a LiteRT flatbuffer (.tflite) "
                    "or ONNX. Other commands: " + ", ".join(f"{n} ({h})" for n, (_, _, h) in sorted(COMMANDS.items())),
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a .pt2 from torch.export.save, a TorchScript archive, package.module:factory, "
                                 "or (LLMs) a Hugging Face model folder")
    p.add_argument("--target", required=True, choices=targets.NAMES)
    p.add_argument("-o", "--output", help="output file (default: the model's name with the target's suffix)")
    p.add_argument("--inputs", nargs="+", default=None, metavar="SPEC",
                   help="sample inputs: SHAPE:DTYPE (1x3x224x224:float32, 2x8:int64:0:1000, scalar:int64) "
                        "or .npy/.npz files; default: the model's own example inputs")
    p.add_argument("--check", action="store_true", help="run the artifact on the sample inputs and compare with eager")
    p.add_argument("--tolerance", type=tolerance_arg, default=None,
                   help="--check tolerance relative to the output scale (default 1e-5)")
    for t in targets.all_targets().values():  # each target's own flags, from its record
        for flag, kwargs in t.cli_arguments:
            p.add_argument(flag, **kwargs)
    recipes = "; ".join(f"{t.name} {', '.join(t.recipes)}" for t in targets.all_targets().values() if t.recipes)
    p.add_argument("--quantize", default=None, metavar="RECIPE", help=f"quantization recipe: {recipes} (see the quantization guide)")
    p.add_argument("--prefill-lengths", default=None, metavar="N,...",
                   help="LLM folders: prefill chunk lengths, one signature each (default 128)")
    p.add_argument("--cache-length", type=int, default=None, metavar="C",
                   help="LLM folders: KV-cache positions, the most tokens of prompt and reply (default: the smaller "
                        "of 1024 and the model's max_position_embeddings)")
    p.add_argument("--tokenizer", default=None, help="LLM folders: the tokenizer's folder (default: the model's)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="LLM folders: a Jinja chat template to carry instead of the tokenizer's (the export checks "
                        "that the runtime renders it as transformers does)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="LLM folders, tpu target: also a decode_batch program for B sequences at once "
                        "(the serving engine's slots; default 8, 1 for the one-slot decode only)")
    p.add_argument("--batch-buckets", default=None, metavar="B,...",
                   help="LLM folders, tpu target: smaller decode batches beside --batch-size's, stepped under a light "
                        "load (default 4,16,64,... below it; 'none' for none)")
    p.add_argument("--kv-pages", default=None, metavar="P",
                   help="LLM folders, tpu target: the batched steps over a paged KV cache of P pages (or 'auto': "
                        "as many positions as the B slots' caches) shared by the B rows, instead of a cache per slot")
    p.add_argument("--page-size", type=int, default=None, metavar="S",
                   help="with --kv-pages: positions per page (default 16)")
    p.add_argument("--no-check", action="store_true",
                   help="LLM folders: skip the check of the exported steps against transformers on a probe prompt")
    p.add_argument("--lora", default=None, metavar="PEFT_DIR|RANK",
                   help="LLM folders, --target litertlm: steps that take a LoRA adapter (LiteRT-LM's, rank 16 or 32); "
                        "given a PEFT folder, its adapter is written beside the bundle too (NAME.lora.tflite)")
    p.add_argument("--abstract-weights", action="store_true",
                   help="LLM folders, tpu target: build from config.json alone and export without weight values "
                        "(compile and inspect a model larger than this machine; bind the checkpoint at load)")
    p.add_argument("--strict", default="false", choices=["false", "true", "auto"], help="torch.export strict mode")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow loading a pickled module (torch.save); unpickling runs code from the file")
    p.add_argument("--version", action="version", version=f"torchtpu-export {__version__}")
    _common(p)
    return p


def _default_output(model: str, target: str) -> str:
    base = os.path.basename(model)
    stem = base.split(":")[-1] if ":" in base and not os.path.exists(model) else os.path.splitext(base)[0]
    return stem + targets.get(target).suffix


def _convert(args) -> int:
    import torch

    from . import api
    from .fileio import check_writable
    from .models import describe_inputs, ep_input_specs, load_model, parse_inputs

    target = targets.get(args.target)
    if target.llm.only or os.path.isdir(args.model):
        return _convert_llm(args, target)
    for flag in ("prefill_lengths", "cache_length", "tokenizer", "batch_size", "abstract_weights", "no_check",
                 "batch_buckets", "kv_pages", "page_size", "lora"):
        if getattr(args, flag) not in (None, False):
            raise InputError(f"--{flag.replace('_', '-')} applies to LLMs (a Hugging Face model folder), "
                             f"not {args.model}")
    _check_target_flags(args, target)
    if args.tolerance is not None and not args.check:
        raise InputError("--tolerance goes with --check: it is the check's tolerance")
    output = args.output or _default_output(args.model, args.target)
    check_writable(output, inputs=(args.model, *_input_files(args.inputs)))
    t0 = time.perf_counter()
    if _is_pt2(args.model):  # its inputs are known: files given with --inputs are checked against them first
        model, margs, mkwargs = load_model(args.model, trust_pickle=args.trust_pickle)
        sample = parse_inputs(args.inputs, expected=ep_input_specs(model)) if args.inputs else None
    else:
        sample = parse_inputs(args.inputs) if args.inputs else None
        model, margs, mkwargs = load_model(args.model, trust_pickle=args.trust_pickle, sample_inputs=sample)
    own_args = margs
    if sample is not None:
        margs, mkwargs = tuple(sample), {}
    if not margs and not mkwargs:
        raise InputError(f"{args.model} has no example inputs", hint="pass --inputs, e.g. --inputs 1x3x224x224:float32")
    strict = {"false": False, "true": True, "auto": "auto"}[args.strict]
    options = target.cli_options(args, margs, mkwargs)
    if isinstance(options.get("quant_config"), dict) and "calibration" in options["quant_config"]:
        _out(args, f"{args.quantize}: activation scales calibrated on the sample inputs only")
    if isinstance(model, torch.export.ExportedProgram) and sample is not None:
        _check_inputs_match(model, sample)
    try:
        artifact = api.export(model, margs, mkwargs, target=args.target, strict_export=strict, **options)
    except CaptureError as e:
        if sample is None or not own_args:
            raise
        raise CaptureError(f"the model does not run on --inputs {describe_inputs(margs)}: {e}".replace(
            "torch.export could not capture the model: ", ""),
            hint=f"the model's own sample inputs are {describe_inputs(own_args)}: give --inputs like them") from e
    artifact.save(output)
    dt = time.perf_counter() - t0
    _out(args, f"wrote {output} ({_human(os.path.getsize(output))}) in {dt:.1f} s "
               f"[target {args.target}; inputs {describe_inputs(margs)}]")
    report = artifact.quant_report
    if report:
        _out(args, str(report))
    if args.check:
        from . import progress
        with progress.stage("check"):
            return _check(args, model, margs, mkwargs, artifact)
    return 0


def _convert_llm(args, target) -> int:
    """An LLM (a Hugging Face model folder or file.py:factory) to prefill/decode programs or a bundle."""
    from . import api
    from .fileio import check_writable
    for flag in ("inputs", "check", "tolerance"):
        if getattr(args, flag) not in (None, False):
            raise InputError(f"--{flag} does not apply to LLMs: their inputs are the runtime's (tokens, positions, "
                             f"mask, KV cache)")
    _check_target_flags(args, target)
    try:
        given = "128" if args.prefill_lengths is None else args.prefill_lengths
        lengths = tuple(int(n) for n in given.split(","))
    except ValueError:
        raise InputError(f"--prefill-lengths takes comma-separated integers, got {args.prefill_lengths!r}") from None
    base = os.path.basename(os.path.normpath(args.model))
    output = args.output or (base.split(":")[-1] if ":" in base else base) + target.suffix
    check_writable(output, inputs=(args.model,))
    t0 = time.perf_counter()
    options = target.cli_options(args, (), None)
    if args.quantize:
        options["quant_config"] = args.quantize
    pages = args.kv_pages
    if pages is not None and pages != "auto":
        try:
            pages = int(pages)
        except ValueError:
            raise InputError(f"--kv-pages takes an integer or 'auto', got {pages!r}") from None
    if args.page_size is not None and pages is None:
        raise InputError("--page-size applies with --kv-pages (a paged KV cache)")
    if pages is not None:
        options.update(kv_pages=pages, page_size=16 if args.page_size is None else args.page_size)
    if args.batch_buckets is not None:
        try:
            options["batch_buckets"] = () if args.batch_buckets == "none" else \
                tuple(int(n) for n in args.batch_buckets.split(","))
        except ValueError:
            raise InputError(f"--batch-buckets takes comma-separated integers or 'none', got "
                             f"{args.batch_buckets!r}") from None
    if args.lora is not None:
        options["lora"] = int(args.lora) if args.lora.isdigit() else args.lora
        check_writable(_adapter_path(output, "nolora"), inputs=(args.model, args.lora))
    if args.chat_template is not None:
        data = fileio.read_regular(args.chat_template, f"the chat template {args.chat_template} (--chat-template)",
                                   4 << 20)
        try:
            options["chat_template"] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"the chat template {args.chat_template} (--chat-template) is not UTF-8 text") from None
    artifact = api.export_llm(args.model, args.tokenizer, target=target.name, prefill_lengths=lengths,
                              cache_length=args.cache_length, batch_size=args.batch_size,
                              abstract_weights=args.abstract_weights, check=not args.no_check, **options)
    adapter_path = None
    if artifact.adapter is not None:
        adapter_path = _adapter_path(output)
        check_writable(adapter_path, inputs=(args.model, args.lora))
    artifact.save(output)
    from .llm.plan import DECODE
    mask = next((s for s in artifact.inputs(DECODE) if s.name == "mask"), None)
    cache = f"; cache {mask.shape[-1]} positions" + ("" if args.cache_length else " (the default: the smaller of 1024 "
                                                     "and the model's limit)") if mask is not None else ""
    _out(args, f"wrote {output} ({_human(os.path.getsize(output))}) in {time.perf_counter() - t0:.1f} s "
               f"[target {target.name}; signatures {', '.join(artifact.signatures)}{cache}]")
    c = artifact.llm_check
    _out(args, f"checked against transformers on a probe prompt: max error {c['max_error']:.1e} of the logits' scale, "
               f"top-1 {c['top1']:.0%}, KL {c['kl']:.1e} over {c['positions']} positions ({c['seconds']} s)"
         if c.get("checked") else f"not checked against transformers: {c['why']}")
    chat = c.get("chat")
    if chat is not None:
        _out(args, f"chat: {len(chat['probes'])} probe conversations rendered by {chat['runtime']} give transformers' "
                   f"apply_chat_template ids ({', '.join(chat['probes'])})"
                   + (f"; refused by the template as by transformers: {', '.join(chat['refused'])}"
                      if chat.get("refused") else ""))
    vision = artifact.vision
    if vision is not None:
        v = c.get("vision")
        _out(args, f"vision ({vision.family}): a {vision.height}x{vision.width} image is {vision.image_tokens} rows of "
                   "the prompt; the image encoder, adapter and token embedder are sections of their own"
                   + (f"; encoder max error {v['encoder_error']:.1e}, adapter {v['adapter_error']:.1e} of their "
                      "outputs' scale" if v else ""))
        for note in vision.notes:
            _out(args, f"note: {note}")
    served = (artifact.llm or {}).get("vision")
    if served is not None:  # the tpu target's VLM
        v = c.get("vision") or {}
        _out(args, f"vision ({served['family']}): a {served['height']}x{served['width']} image is "
                   f"{served['rows']} rows "
                   "of the prompt, from the vision program; prefill_image_<N> puts them in"
             + (f"; checked against transformers' VLM on a probe image: rows max error {v['rows_error']:.1e}, "
                f"next-token logits {v['steps_error']:.1e}" if "steps_error" in v else ""))
    if artifact.lora_inputs:  # LiteRT-LM runs a session without an adapter on stale inputs
        from .llm.lora import zero_adapter
        zeros = _adapter_path(output, "nolora")
        zero_adapter(artifact.lora_inputs).save(zeros)
        _out(args, f"wrote {zeros}, the adapter of zeros (the base model): give LiteRT-LM an adapter in every "
                   "session, this one for the base model, as generate and run do")
    if adapter_path is not None:
        artifact.save_adapter(adapter_path)
        a = artifact.adapter
        _out(args, f"wrote the LoRA adapter {adapter_path} ({_human(os.path.getsize(adapter_path))}; rank {a.r} "
                   f"as LiteRT-LM's {a.rank}, {len(a.weights) // 2} projections): generate(lora=...) or "
                   f"run --lora {adapter_path}" + (" (checked: the steps with it against transformers' model with "
                                                  "it merged)" if c.get("checked") else ""))
    return 0


def _adapter_path(output: str, kind: str = "lora") -> str:
    stem = output[:-len(".litertlm")] if output.endswith(".litertlm") else output
    return f"{stem}.{kind}.tflite"


def _adapter_args(p):
    p.add_argument("peft", help="a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--base", required=True, help="the .litertlm exported with --lora (its steps take the adapter)")
    p.add_argument("-o", "--output", default=None, help="the adapter file (default: PEFT folder name + .lora.tflite)")


def _adapter(args) -> int:
    """A PEFT LoRA folder as LiteRT-LM's adapter file for a LoRA-ready bundle (``--base``), its shapes and
    rank read from the bundle's LoRA inputs."""
    from . import api
    from .fileio import check_writable
    from .llm.lora import features_of_inputs, read_peft
    base = api.load(args.base)
    inputs = base.lora_inputs
    if not inputs:
        raise InputError(f"{args.base} takes no LoRA adapter: its steps have no LoRA inputs (--base takes a "
                         ".litertlm bundle exported with --lora)",
                         hint="export the model with --lora PEFT_DIR (or --lora 16)")
    features, rank = features_of_inputs(inputs)
    output = args.output or os.path.basename(os.path.normpath(args.peft)) + ".lora.tflite"
    check_writable(output, inputs=(args.peft, args.base))
    adapter = read_peft(args.peft, features, rank)
    adapter.save(output)
    _out(args, f"wrote {output} ({_human(os.path.getsize(output))}; rank {adapter.r} as {adapter.rank}, "
               f"{len(adapter.weights) // 2} projections) for {args.base}")
    return 0


def _check(args, model, margs, mkwargs, artifact) -> int:
    import torch
    import torch.utils._pytree as pytree

    from .numerics import DEFAULT_RTOL, compare
    eager = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    if getattr(args, "channels_last", False):  # the artifact takes and gives NHWC images
        from .targets.litert.target import channels_last
        eager, margs, mkwargs = channels_last(eager, margs, mkwargs)
    with torch.no_grad():
        ref = pytree.tree_leaves(eager(*margs, **mkwargs))
    got = pytree.tree_leaves(artifact(*margs, **mkwargs))
    agreement = compare(got, ref, DEFAULT_RTOL if args.tolerance is None else args.tolerance)
    if not agreement.ok:
        raise NumericsError(f"--check failed: {agreement}",
                            hint=f"run `torchtpu-export debug {args.model} --target {args.target}` "
                                 "to find the first diverging op")
    _out(args, f"check: OK ({agreement})")
    return 0


def _check_target_flags(args, target) -> None:
    """A flag of another target's (set away from its default) is a usage error, not silently ignored."""
    parser = _convert_parser()
    for other in targets.all_targets().values():
        for flag in other.cli_flags:
            if flag in target.cli_flags or getattr(args, flag) == parser.get_default(flag):
                continue
            takers = [t.name for t in targets.all_targets().values() if flag in t.cli_flags]
            raise InputError(f"--{flag.replace('_', '-')} applies to --target {' or '.join(takers)}, "
                             f"not {target.name}")


def _check_inputs_match(ep, sample) -> None:
    from .models import ep_input_specs
    specs = ep_input_specs(ep)
    if len(specs) != len(sample):
        raise InputError(f"the model takes {len(specs)} inputs, --inputs gave {len(sample)}")
    for i, (spec, x) in enumerate(zip(specs, sample)):
        if spec is None:
            continue
        if spec.dtype != str(x.dtype).removeprefix("torch."):
            raise InputError(f"--inputs #{i + 1}: expected dtype {spec.dtype}, got {str(x.dtype).removeprefix('torch.')}")
        if len(spec.shape) != x.dim() or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, x.shape)):
            raise InputError(f"--inputs #{i + 1}: expected shape {list(spec.shape)}, got {list(x.shape)}")


def _input_files(inputs) -> list[str]:
    return [p for p in inputs or () if p.endswith((".npy", ".npz"))]


def _is_pt2(model: str) -> bool:
    from .models import is_factory, sniff_model
    return not is_factory(model) and os.path.isfile(model) and sniff_model(model) == "pt2"


# ---- inspect -------------------------------------------------------------------------------

def _inspect_args(p):
    p.add_argument("artifact", help="a .tpu, .tflite or .onnx file")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument("--topology", default=None, metavar="T[,T...]",
                   help=".tpu: compile for these TPU topologies (libtpu) and show what the compiler says")
    p.add_argument("--gpu", action="store_true",
                   help=".tflite: LiteRT's GPU-delegate compatibility check (its model analyzer) of every op")
    p.add_argument("--soc", default=None, metavar="VENDOR:SOC[,...]",
                   help=".tflite: compile for these NPUs in memory (LiteRT's AOT path) and show, per SoC, the ops "
                        "its NPU takes and those left on the CPU, e.g. qualcomm:all")


def _inspect(args) -> int:
    from .describe import describe, format_description
    target = targets.for_file(args.artifact)
    if args.gpu and (target is None or target.gpu_check is None):
        takers = [t.suffix for t in targets.all_targets().values() if t.gpu_check is not None]
        raise InputError(f"--gpu applies to {' and '.join(takers)} files (a GPU delegate's compatibility check)")
    if args.soc and (target is None or target.npu_check is None):
        takers = [t.suffix for t in targets.all_targets().values() if t.npu_check is not None]
        raise InputError(f"--soc applies to {' and '.join(takers)} files (NPU compilation)")
    desc = describe(args.artifact, topologies=args.topology)
    if args.gpu:
        desc["gpu_delegate"] = target.gpu_check(args.artifact)
    if args.soc:
        desc["npu_socs"] = target.npu_check(args.artifact, args.soc)
    text = json.dumps(desc, indent=1, sort_keys=True) if args.json else format_description(desc)
    if args.soc and not args.json:
        for r in desc["npu_socs"]:
            left = ", ".join(f"{op} {n}" for op, n in sorted(r["cpu_ops"].items())) or "none"
            text += (f"\nNPU {r['soc']}: {r['ops_on_npu']}/{r['ops_total']} ops in {r['partitions']} "
                     f"partition{'s' if r['partitions'] != 1 else ''}; on the CPU: {left}")
    if args.gpu and not args.json:
        gpu = desc["gpu_delegate"]
        text += "\nGPU delegate: " + ("every op compatible" if gpu["compatible"] else
                                                         "not compatible") + \
            "".join(f"\n  {printable(line)}" for line in gpu["problems"])
    print(text)
    return 0


# ---- compile -------------------------------------------------------------------------------

def _compile_args(p):
    p.add_argument("artifact", help="a .tpu file (for TPUs) or a .tflite file (for phone NPUs)")
    p.add_argument("--topology", default=None, metavar="T[,T...]",
                   help=".tpu: TPU topologies to compile for, e.g. v5e, v5e:2x2 or v5e:2x2,v6e-8 (no TPU needed); "
                        "an LLM's file also stores its server's engine calls, and cpu compiles those for this "
                        "host's processor")
    p.add_argument("--signature", default=None, help=".tpu: compile one program only (artifacts with several)")
    p.add_argument("--soc", default=None, metavar="VENDOR:SOC[,...]",
                   help=".tflite: NPUs to compile for through LiteRT's AOT path, e.g. qualcomm:SM8650 or "
                        "qualcomm:all; one <stem>_<SoC>.tflite each")
    p.add_argument("--ai-pack", default=None, metavar="DIR",
                   help=".tflite with --soc: write an Android AI Pack (Play for On-device AI) to DIR instead")
    p.add_argument("-o", "--output", default=None,
                   help=".tpu: write the artifact with its executables here (default: replace the input file); "
                        ".tflite: the folder for the compiled files (default: beside the model)")


def _compile(args) -> int:
    target = targets.for_file(args.artifact)
    if target is None or target.compile is None:
        takers = [t.suffix for t in targets.all_targets().values() if t.compile is not None]
        raise InputError(f"{args.artifact} is not an artifact that is compiled ahead of time",
                         hint=f"compile takes {' or '.join(takers)} files")
    t0 = time.perf_counter()
    for line in target.compile(args):
        _out(args, printable(line))
    _out(args, f"compiled in {time.perf_counter() - t0:.1f} s")
    return 0


# ---- run -----------------------------------------------------------------------------------

TRUST_HELP = (".tpu: load the file's stored executables (torchtpu-export compile) instead of compiling. They are "
              "native code, run as they are: only for files you trust (without this flag they are never read)")


def _run_args(p):
    p.add_argument("artifact", help="a .tpu, .tflite, .onnx or .litertlm file")
    p.add_argument("--inputs", nargs="+", default=None, metavar="SPEC",
                   help=".npy/.npz files or SHAPE:DTYPE specs; default: random inputs of the artifact's shapes")
    p.add_argument("--signature", default=None, help="program/signature to run (artifacts with several)")
    p.add_argument("-o", "--output", default=None, help="save the outputs to this .npz file")
    p.add_argument("--prompt", default=None, help="LLM artifacts (.tpu from export_llm, .litertlm): generate text after this prompt")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="with --prompt: the most tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="with --prompt: send it as a user message (chat template)")
    p.add_argument("--lora", default=None, metavar="FILE",
                   help="with --prompt, a .litertlm exported with --lora: the LoRA adapter file to apply")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="with --prompt, a vision-language model's .litertlm: an image the user message shows "
                        "before the prompt (PNG, JPEG, BMP, GIF); repeat for several")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", default=None, metavar="FILE",
                     help="with --prompt: the reply is JSON that follows this JSON schema (constrained decoding: "
                          "LiteRT-LM's for .litertlm, the decode step's grammar mask for .tpu)")
    fmt.add_argument("--regex", default=None, metavar="PATTERN",
                     help="with --prompt: the whole reply matches this regular expression")
    p.add_argument("--runtime", default=None, metavar="NAME",
                   help=".tflite: interpreter (default), compiled_model, or qnn_htp (a file compiled for a Qualcomm "
                        "NPU, on QNN's HTP simulator: x86-64 with onnxruntime-qnn)")
    p.add_argument("--trust-stored-executables", action="store_true", help=TRUST_HELP)


def _run(args) -> int:
    import numpy as np

    from . import api
    from .fileio import atomic_open
    from .models import parse_inputs

    _check_run_flags(args)
    if args.output:
        from .fileio import check_writable
        check_writable(args.output, inputs=(args.artifact, *_input_files(args.inputs)))
    response_format = _response_format(args)
    # before anything opens them: a FIFO there would block LiteRT-LM's or Pillow's open for ever
    for flag, paths in (("--lora", [args.lora] if args.lora else []), ("--image", args.image or ())):
        for path in paths:
            with fileio.open_regular(path, f"{path} ({flag})"):
                pass
    art = api.load(args.artifact, trust_stored_executables=args.trust_stored_executables)
    if args.prompt is not None:
        t0 = time.perf_counter()
        extra = {**({"images": args.image} if args.image else {}), **({"lora": args.lora} if args.lora else {})}
        import inspect as _inspect_mod
        takes = _inspect_mod.signature(art.generate).parameters
        for key in extra:
            if key not in takes:
                raise InputError(f"--{key.rstrip('s')} goes to a .litertlm bundle, not {args.artifact}")
        steps = 64 if args.max_new_tokens is None else args.max_new_tokens
        reply = art.generate(args.prompt, steps, chat=args.chat, response_format=response_format, **extra)
        print(printable(str(reply), newlines=True))
        _out(args, f"generated in {time.perf_counter() - t0:.2f} s ({len(reply.ids)} tokens, {reply.finish_reason})")
        return 0
    specs = art.inputs(args.signature)
    if args.inputs:
        inputs = parse_inputs(args.inputs, expected=specs)
    else:  # random inputs of the artifact's own shapes: a size the machine cannot hold is the file's
        from .errors import ArtifactError
        from .specs import numpy_dtype, require_memory
        for s in specs:
            if all(isinstance(d, int) for d in s.shape):
                require_memory(s.shape, numpy_dtype(s.dtype), f"{args.artifact}'s input {s.name}", ArtifactError)
        inputs = parse_inputs([_spec_text(s) for s in specs])
    t0 = time.perf_counter()
    import inspect as _inspect_mod
    if args.runtime is not None and "runtime" not in _inspect_mod.signature(art.run_flat).parameters:
        raise InputError(f"--runtime applies to .tflite files, not {args.artifact}")
    outs = art.run_flat(inputs, args.signature, **({"runtime": args.runtime} if args.runtime else {}))
    dt = time.perf_counter() - t0
    for spec, o in zip(art.outputs(args.signature), outs):
        o = np.asarray(o)
        stats = f" min {o.min():.6g} max {o.max():.6g} mean {o.astype(np.float64).mean():.6g}" \
            if o.size and o.dtype.kind in "fiub" else ""
        _out(args, f"{printable(spec.name)}: {o.dtype.name}{list(o.shape)}{stats}")
    _out(args, f"ran in {dt * 1000:.1f} ms")
    if args.output:
        with atomic_open(args.output) as f:
            np.savez(f, **{s.name: np.asarray(o) for s, o in zip(art.outputs(args.signature), outs)})
    return 0


# run's flags that belong to one of its two modes: generating text (--prompt) or running on inputs
_PROMPT_FLAGS = {"image": "the image is part of the message an LLM answers",
                 "lora": "the adapter applies to the text an LLM generates",
                 "chat": "it sends the prompt as a user message", "max_new_tokens": "it bounds the reply"}
_INPUTS_FLAGS = ("inputs", "signature", "runtime", "output")


def _check_run_flags(args) -> None:
    """A flag of the mode ``run`` is not in is a usage error, never ignored (``-o`` with ``--prompt`` would
    end with no file written)."""
    if args.prompt is None:
        for flag, why in _PROMPT_FLAGS.items():
            if getattr(args, flag) not in (None, False):
                raise InputError(f"--{flag.replace('_', '-')} goes with --prompt: {why}")
        return
    for flag in _INPUTS_FLAGS:
        if getattr(args, flag) is not None:
            name = "-o" if flag == "output" else f"--{flag}"
            raise InputError(f"{name} applies to a run on inputs, not to --prompt (the reply is printed)",
                             hint="leave it out; redirect the printed reply to keep it (> reply.txt)"
                             if flag == "output" else None)


def _response_format(args) -> dict | None:
    """``run``'s --json-schema FILE (read within a size cap) or --regex PATTERN, as a response_format."""
    if args.json_schema is None and args.regex is None:
        return None
    flag = "--json-schema" if args.json_schema is not None else "--regex"
    if args.prompt is None:
        raise InputError(f"{flag} goes with --prompt: it constrains the text an LLM generates")
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    from .runtimes.litertlm import MAX_FORMAT
    from .untrusted import load_json
    path = args.json_schema
    data = fileio.read_regular(path, f"the JSON schema {path} (--json-schema)", MAX_FORMAT)
    schema = load_json(data, f"the JSON schema {path} (--json-schema)", max_bytes=MAX_FORMAT, error=InputError)
    if not isinstance(schema, dict):
        raise InputError(f"the JSON schema {path} (--json-schema) is JSON but not a JSON schema (a schema is an "
                         "object, {...})")
    name = os.path.splitext(os.path.basename(path))[0]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _spec_text(spec) -> str:
    if any(not isinstance(d, int) for d in spec.shape):
        raise InputError(f"input {spec.name} has dynamic dims {list(spec.shape)}: pass --inputs")
    shape = "x".join(str(d) for d in spec.shape) or "scalar"
    return f"{shape}:{spec.dtype}"


# ---- entry point ---------------------------------------------------------------------------

def _setup_logging(args) -> None:
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(level)
    if args.verbose < 2:  # torch and jax chatter is not for our users
        import torch
        # torch logs the failures it then raises (fake-tensor tracebacks): the raised error is reported once
        torch._logging.set_logs(all=logging.CRITICAL)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")


# Every subcommand: name -> (add_arguments(parser), run(args) -> exit code, one-line help).
COMMANDS: dict[str, tuple[Callable, Callable, str]] = {
    "inspect": (_inspect_args, _inspect, "inputs, outputs, op histogram, kernels and sizes of an artifact"),
    "compile": (_compile_args, _compile,
                "compile a .tpu for TPU topologies (libtpu), or a .tflite for phone NPUs (LiteRT's AOT compilers)"),
    "run": (_run_args, _run, "run an artifact on inputs and print (or save) the outputs"),
    "adapter": (_adapter_args, _adapter, "a PEFT LoRA folder as LiteRT-LM's adapter file for a .litertlm"),
    "coverage": (coverage_cli.add_arguments, coverage_cli.run, coverage_cli.HELP),
    "debug": (debugger.add_arguments, debugger.run_cli, debugger.HELP),
    "serve-web": (web.add_arguments, web.run_cli, web.HELP),
    "serve": (server.add_arguments, server.run_cli, server.HELP),
}


def _raise_terminated(signum, frame):
    # raised where the program is; where Python swallows it (a gc callback, a __del__), the flag
    # still stops the output from being renamed into place
    fileio.STOP_SIGNAL[0] = signum
    raise Terminated(signum)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name`` (a key of ``COMMANDS``)."""
    add_arguments, _, help_text = COMMANDS[name]
    p = _Parser(prog=f"torchtpu-export {name}", description=help_text, epilog=EXIT_CODES_HELP,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    _common(p)
    return p


def parsers() -> list[argparse.ArgumentParser]:
    """Every parser of the command line: the converter's, then each subcommand's by name (the docs' CLI
    reference is generated from them)."""
    return [_convert_parser(), *(command_parser(name) for name in sorted(COMMANDS))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        if argv and argv[0] in COMMANDS:
            args = command_parser(argv[0]).parse_args(argv[1:])
            _setup_logging(args)
            return COMMANDS[argv[0]][1](args)
        args = _convert_parser().parse_args(argv)
        _setup_logging(args)
        from . import progress
        with progress.bar() if not args.quiet else contextlib.nullcontext():
            return _convert(args)
    except TteError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {printable(e.user_message(), newlines=True)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted; no output file was written", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"terminated ({e}); no output file was written", file=sys.stderr)
        return 128 + e.signum
    except Exception as e:  # an internal error: short by default, full with --debug
        if debug:
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {printable(str(e).splitlines()[0]) if str(e) else ''}\n"
              "  hint: this is a bug in torchtpu-export; rerun with --debug and report it", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
