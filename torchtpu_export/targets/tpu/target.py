"""The tpu target: datacenter serving on TPUs (and any PJRT backend).

Everything it is made of, named here:
- converter: ``converters/stablehlo`` (a JAX lowering per ATen op, hot ops as Pallas kernels,
  ``jax.export`` per platform);
- artifact: ``.tpu`` (``tpu_format``: a stored zip of a manifest, programs, StableHLO text and
  safetensors weights), compiled ahead of time for TPU topologies by ``tpu_compile`` (libtpu);
- runtime: ``runtimes/xla`` (PJRT: cpu here, tpu or cuda where present);
- runnable: :class:`TpuProgram`; describer: :func:`describe`.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from . import artifact as tpu_format
from ...errors import InputError
from ..base import LlmSupport, Runnable, Target


class TpuProgram(Runnable):
    """A ``.tpu`` artifact: StableHLO programs for each platform, plus weights.

    ``prog(*args)`` runs a program on the local PJRT backend (cpu on a machine without TPU) and
    returns numpy arrays in the model's output structure. With several programs
    (``tte.signature``), pick one with ``signature_name``.

    ``trust_stored_executables``: the file's stored executables (``compile``: its programs' for TPU chips,
    its serving engine's calls) are native code, read only when this is True; otherwise the programs and
    engine compile as if the file stored none.
    """

    default_signature = "main"
    abstract = False  # the engine's program protocol: its chips are attached (stored.TopologyProgram's are not)

    def __init__(self, artifact: tpu_format.TpuArtifact, *, trust_stored_executables: bool = False):
        if not isinstance(trust_stored_executables, bool):  # an opt-in to native code is said in so many words
            raise InputError(f"trust_stored_executables takes True or False, not {trust_stored_executables!r}")
        self.artifact = artifact
        self.trust_stored_executables = trust_stored_executables
        self._runners: dict = {}
        self._placed: dict = {}  # weights on the device, shared by the runners of every program
        self._state: dict = {}  # buffers the programs change in place: their current values, on the device
        self.quant_report = None  # set by export(..., quant_config=...)
        self._llm_session = None  # generate's engine, text workers and grammars (engine.session)

    @property
    def manifest(self) -> dict:
        return self.artifact.manifest

    @property
    def llm(self) -> dict | None:
        return self.manifest.get("llm")

    @property
    def signatures(self) -> list[str]:
        return list(self.manifest["programs"])

    def _call_metadata(self, sig: str) -> dict:
        return self.manifest["programs"][sig]

    def _run(self, sig: str, inputs: list) -> list[np.ndarray]:
        return self.runner(sig).run(inputs)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ``.tpu`` file atomically."""
        self.artifact.save(path)

    def runner(self, signature_name: str | None = None, platform: str | None = None):
        """The runtime of one program on one PJRT platform (the local one by default)."""
        from ...runtimes.xla import XlaRunner
        key = (self.signature(signature_name), platform)
        if key not in self._runners and self.abstract_weights:
            raise InputError(f"this program's {len(self.abstract_weights)} weights are abstract (exported without "
                             "values): it compiles and inspects, but runs only once values are bound",
                             hint="prog = prog.bind_weights('model.safetensors' or a folder of safetensors shards)")
        if key not in self._runners:
            self._runners[key] = XlaRunner(self.artifact, key[0], platform, self._placed, self._state,
                                           trust_stored_executables=self.trust_stored_executables)
        return self._runners[key]

    # the serving engine's stored executables (:mod:`.stored`): the engine asks its program, never this target

    def stored_calls(self, devices: list) -> dict[str, bytes] | None:
        """The file's stored engine executables that run on ``devices`` (call name -> bytes), or None (see
        :func:`.stored.stored_calls`)."""
        from .stored import stored_calls
        return stored_calls(self, devices)

    def ignored_calls(self) -> int:
        """How many stored engine executables go unread because the file is not trusted."""
        from .stored import ignored_calls
        return ignored_calls(self)

    def load_executable(self, blob: bytes, *, uses_x64: bool, devices: list, trees):
        """One stored engine executable loaded for ``devices`` (``trees``: its input and output trees)."""
        from .aot import load_executable
        return load_executable(blob, None, uses_x64=uses_x64, devices=devices, trees=trees)

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The buffers the model changes in place (a cache kept as a buffer), as they are now: kept on the
        device between calls (each call donates them and keeps their new values), shared by the programs
        of one artifact by buffer name. Before the first call, the values the module had at export."""
        out = {}
        for spec in self.manifest["programs"].values():
            for d in spec.get("state", ()):
                live = [v for (name, _), v in self._state.items() if name == d["name"]]
                out[d["name"]] = np.asarray(live[0]) if live else \
                    np.asarray(self.artifact.weights[tpu_format.STATE_PREFIX + d["name"]])
        return out

    def reset_state(self) -> "TpuProgram":
        """Back to the state the module had at export (the next call starts from it)."""
        self._state.clear()
        return self

    @property
    def abstract_weights(self) -> list[str]:
        """The names of the weights that have no values yet (``tte.abstract_weights()``)."""
        return [n for n, w in self.artifact.weights.items() if isinstance(w, tpu_format.AbstractWeight)]

    def bind_weights(self, source, *, prefix: str | None = None) -> "TpuProgram":
        """A program whose abstract weights take values: ``source`` is a ``.safetensors`` file, a folder of
        them (a Hugging Face checkpoint's shards) or a mapping of name to array or tensor. A weight is found
        under its own name, or under it with a leading module path removed (``model.`` of an LLM's wrapper:
        the checkpoint's names), or with ``prefix`` removed. Floats are cast to the program's dtype (bf16);
        the int8 recipe quantizes here, as export would have. Every weight must be found, with its shape."""
        from .bind import bind
        return TpuProgram(bind(self.artifact, source, prefix), trust_stored_executables=self.trust_stored_executables)

    def stablehlo_text(self, platform: str = "tpu", signature_name: str | None = None) -> str:
        """The StableHLO module of one platform, as MLIR text."""
        texts = self.artifact.mlir[self.signature(signature_name)]
        if platform not in texts:
            raise InputError(f"no {platform} program in this artifact; it has {sorted(texts)}")
        return texts[platform]

    def compile(self, topology="v5e:2x2", signature_name: str | None = None) -> "TpuProgram":
        """Compiles the tpu program(s) for TPU topologies (``"v5e:2x2"``, ``"v5e:2x2,v6e:2x2"`` or a
        sequence) with libtpu, ahead of time (no TPU needed), and stores each executable in the
        artifact (``save`` writes them; ``load`` on a matching TPU host runs them without compiling).
        For an LLM (``export_llm``) and all its programs, the serving engine's calls are compiled and
        stored too (:mod:`.stored`: a server on such chips starts without compiling); the topology
        ``"cpu"`` compiles those for this host's processor. Raises ConversionError with the compiler's
        message if it rejects a program."""
        from . import aot as tpu_compile
        from .stored import CPU, compile_engine
        names = [t.strip() for t in (topology.split(",") if isinstance(topology, str) else topology) if t.strip()]
        on_cpu = CPU in names
        tpus = [t for t in names if t != CPU]
        if on_cpu and (signature_name is not None or "llm" not in self.manifest):
            raise InputError("the cpu topology compiles an LLM's serving engine (all its programs); this is "
                             + ("one program" if signature_name is not None else "not an export_llm file"),
                             hint="compile for TPU topologies, e.g. v5e")
        programs = None if signature_name is None else [self.signature(signature_name)]
        for topo in tpu_compile.parse_topologies(tpus) if tpus else ():
            tpu_compile.compile_artifact(self.artifact, topo, programs)
            if programs is None and "llm" in self.manifest:
                compile_engine(self, topo)
        if on_cpu:
            compile_engine(self, CPU)
        return self

    def compiled_stats(self, topology: str = "v5e:2x2", signature_name: str | None = None) -> dict:
        """What the TPU compiler says about one program on a topology's chips: HBM bytes (arguments,
        outputs, temporaries, code) and whether they fit, FLOPs, bytes accessed, and a roofline estimate
        from the generation's published peak FLOP/s and HBM bandwidth. Compiles (and stores) if needed."""
        from . import aot as tpu_compile
        prog = self.signature(signature_name)
        (topo,) = tpu_compile.parse_topologies(topology)
        entry = self.manifest.get("compiled", {}).get(topo, {}).get(prog)
        if entry is None or entry.get("libtpu") != tpu_compile.libtpu_version():
            self.compile(topo, signature_name=prog)
            entry = self.manifest["compiled"][topo][prog]
        return entry["stats"]

    def generate(self, prompt, max_new_tokens: int = 64, *, chat: bool = False, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop=None, seed: int | None = None,
                 response_format: dict | None = None, images=None):
        """The reply of an LLM's programs (``tte.export_llm(..., target="tpu")``) to ``prompt`` (token ids, or
        text the artifact's tokenizer encodes), as a ``Generation`` (text and ids): the KV cache kept on
        the device and updated in place (donated), sampling on the device (greedy at ``temperature=0``, else
        top-k / top-p seeded by ``seed``). ``chat=True`` renders a text prompt as a user message through the
        artifact's chat template. Ends at a token in ``stop`` (default: the artifact's stop tokens).
        ``response_format`` (see ``Runnable.generate``): constrained decoding with llguidance, the mask
        applied in the decode step on the device. Tokenizer and template run in a worker process under
        time and memory budgets (they are the file's). ``images`` (image files, a vision-language model's):
        the user message shows them before the text prompt, rendered by the chat template."""
        from ...llm.contract import Generation, prompt_ids
        llm = self.manifest.get("llm")
        if llm is None:
            return super().generate(prompt)
        ids = prompt_ids(prompt)
        session = self._session()
        text = session.text
        pixels = self._images(images, ids is None and text is not None)
        if ids is None:
            if text is None:
                raise InputError("this .tpu carries no tokenizer: give the prompt as token ids")
            if pixels:  # the image parts first, as a VLM's user message shows them
                ids = text.run("chat", [{"role": "user", "content": [*[{"type": "image"}] * len(pixels),
                                                                     {"type": "text", "text": prompt}]}])
            else:
                ids = text.run("chat", [{"role": "user", "content": prompt}]) if chat else text.run("encode", prompt)
        elif chat:
            raise InputError("chat=True takes the prompt as text (the chat template renders messages)")
        if stop is None:
            stop = session.stop_ids
        constraint = None
        from ...llm.grammar import format_of
        fmt = format_of(response_format)
        if fmt is not None:
            if session.tokenizer_json is None:
                raise InputError("response_format needs the model's tokenizer, which this .tpu does not carry")
            constraint = session.grammars().matcher(*fmt)
        out = session.engine.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                      stop=stop, seed=seed, constraint=constraint, images=pixels)
        reply = text.run("decode", out, 0)[1] if text is not None else None
        return Generation(reply, out, "length" if len(out) >= max_new_tokens else "stop")

    def _images(self, images, as_text: bool) -> list | None:
        """``images`` (files) as the vision program takes them, read and resized as the model's processor does."""
        if not images:
            return None
        vision = self.manifest["llm"].get("vision")
        if vision is None:
            raise InputError("this .tpu is not a vision-language model: it takes no images")
        if not as_text:
            raise InputError("images go with a text prompt (the chat template places them), not token ids")
        from ...images import read_images
        return read_images([(p, os.fspath(p)) for p in images], vision)

    def _session(self):
        """The engine (one slot), tokenizer and grammars of ``generate`` (made on first use, kept)."""
        if self._llm_session is None:
            from ...engine.session import LlmSession
            self._llm_session = LlmSession(self, batched=False)
        return self._llm_session

    def kernels(self) -> list[dict]:
        """Per hot node: the Pallas kernel chosen, or why it fell back to XLA."""
        return [dict(k, program=p) for p, spec in self.manifest["programs"].items() for k in spec.get("kernels", [])]

    def __repr__(self) -> str:
        return f"TpuProgram(programs={self.signatures}, platforms={self.manifest['platforms']})"


TRUST_FLAG = "--trust-stored-executables"  # the opt-in to a file's stored executables (run, serve)

_OPTIONS = ("platforms", "kernels", "narrow_64bit", "quant_config", "mesh", "sharding", "input_shardings",
            "precompile", "quant_report", "llm")


def build(captures: dict, options: dict) -> TpuProgram:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"export() got an unexpected keyword argument {unknown[0]!r} for the tpu target")
    from ... import converters
    options = dict(options)
    TARGET.check_recipe(options.get("quant_config"))
    report = options.pop("quant_report", True)  # False: no error measured on the sample inputs
    llm = options.pop("llm", None)
    if llm is not None:  # the steps update the KV cache (and recurrent states) in place
        options["donate_prefixes"] = ("kv_cache_",)
    artifact = converters.converter(TARGET.converter).convert(captures, **options)
    if llm is not None:
        _carry_llm(artifact, llm)
    prog = TpuProgram(artifact)
    quant_config, platforms = options.get("quant_config"), options.get("platforms", ("tpu", "cpu"))
    if quant_config is not None and "cpu" in platforms and report and not prog.abstract_weights:
        from ...quant import parse, report_against_eager
        float_bytes = sum(t.numel() * t.element_size() for c in captures.values() for t in c.weights.values())
        prog.quant_report = report_against_eager(prog, captures, parse(quant_config, "tpu").recipe, float_bytes,
                                                 sum(w.nbytes for w in prog.artifact.weights.values()))
        prog.reset_state()  # measuring ran the program: the state starts over, as exported
    return prog


def load(path, *, trust_stored_executables: bool = False) -> TpuProgram:
    """A ``.tpu`` file as a :class:`TpuProgram`; its stored executables are read only with
    ``trust_stored_executables`` (native code: for files you trust)."""
    return TpuProgram(tpu_format.read(path), trust_stored_executables=trust_stored_executables)


def describe(path: str, topologies=None) -> dict:
    """What ``inspect`` shows of a ``.tpu``; with ``topologies``, also what the TPU compiler says about
    each program on them (compiled here with libtpu, nothing written)."""
    from . import aot as tpu_compile
    art = tpu_format.read(path)
    slices = {}
    for topo in tpu_compile.parse_topologies(topologies) if topologies else ():
        tpu_compile.require_libtpu("--topology")
        tpu_compile.compile_artifact(art, topo, store=False)
        chips, hosts = tpu_compile.slice_size(topo)
        slices[topo] = {"chips": chips, "hosts": hosts}
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: i.file_size for i in zf.infolist()}
    m = art.manifest
    programs = {}
    for name, spec in m["programs"].items():
        programs[name] = {
            "inputs": spec["inputs"], "outputs": spec["outputs"], "state": spec.get("state", []),
            "platforms": sorted(spec["files"]),
            "weights": len(spec["weights"]),
            "op_histogram": spec.get("op_histogram", {}),
            "kernels": spec.get("kernels", []),
            "kernel_cost": spec.get("kernel_cost"),
            "narrow_64bit": spec.get("narrow_64bit", False),
            "sharding": spec.get("sharding"),
            "compiled": {topo: per[name] for topo, per in sorted(m.get("compiled", {}).items()) if name in per},
        }
    stored = {"programs": sum(1 for per in m.get("compiled", {}).values() for e in per.values() if e.get("executable")),
              "engine_calls": sum(len(e.get("calls", {})) for e in ((m.get("llm") or {}).get("engine") or {}).values())}
    return {
        "path": path, "kind": "tpu", "size": os.path.getsize(path), "format_version": m["format_version"],
        "versions": m.get("versions", {}), "platforms": m.get("platforms", []), "programs": programs,
        "weights": {k: (len(v) if k == "abstract" else v) for k, v in m.get("weights", {}).items()},
        "entries": entries, "mesh": m.get("mesh"),
        **({"topologies": slices} if slices else {}), **({"llm": _llm_summary(m["llm"])} if "llm" in m else {}),
        **({"stored_executables": dict(stored, loaded_only_with=TRUST_FLAG)} if any(stored.values()) else {}),
    }


def describe_lines(desc: dict, program: str | None) -> list[str]:
    """``inspect``'s text of what only a .tpu has: the mesh, topologies, the LLM served (``program``
    None), and per program its kernels, compiled executables and sharding plan."""
    from .aot import describe_stats
    lines: list[str] = []
    if program is None:
        if desc.get("mesh"):
            axes = desc["mesh"]["axes"]
            lines.append(f"mesh: {', '.join(f'{a}={n}' for a, n in axes)} ({desc['mesh']['devices']} devices)")
        for topo, size in (desc.get("topologies") or {}).items():
            lines.append(f"topology {topo}: {size['chips']} chip{'s' if size['chips'] != 1 else ''} on {size['hosts']} "
                         f"host{'s' if size['hosts'] != 1 else ''}")
        llm = desc.get("llm")
        if llm:  # an export_llm .tpu: what the serving engine and server read
            lines.append(f"llm {llm.get('name', '?')}: cache {llm['cache_length']} positions, prefill lengths "
                         f"{', '.join(map(str, llm['prefill_lengths']))}, {llm.get('slots', 1)} decode slot(s), "
                         + (f"tokenizer (stop ids {llm.get('stop_ids', [])}, chat template "
                            f"{'yes' if llm.get('chat_template') else 'no'})" if llm.get("tokenizer") else "no tokenizer"))
        if llm and llm.get("chat_template"):
            chat = llm.get("chat")
            lines.append(f"chat: the export's probe conversations ({', '.join(chat['probes'])}) rendered by "
                         f"{chat['runtime']} gave transformers' apply_chat_template ids" if chat else
                         "chat: not checked against transformers at export (a file of an older export, or check=False)")
        vision = (llm or {}).get("vision")
        if vision:  # a VLM: its images' programs
            lines.append(f"vision ({vision.get('family', '?')}): a {vision['height']}x{vision['width']} image is "
                         f"{vision['rows']} rows of the prompt (program vision; prefill_image_<N> puts them in, "
                         f"{'the rows of an image attend to one another' if vision['bidirectional'] else 'causal'}); "
                         f"resized {vision['resample']}")
        states = (llm or {}).get("recurrent_states")
        if states:
            lines.append(f"recurrent states: {states['tensors']} tensors beside the KV cache, "
                         f"{states['bytes_per_sequence']} bytes per sequence (prompts cut into exact chunks)")
        elif llm:
            lines.append(_pages_line(desc, llm))
        for topo, entry in sorted(((llm or {}).get("engine") or {}).items()):
            lines.append(f"serving engine [{topo}, {entry.get('device_kind')}, jax {entry.get('jax')}"
                         + (f", libtpu {entry['libtpu']}" if entry.get("libtpu") else "")
                         + f"]: {len(entry.get('calls', {}))} calls stored (a matching server given "
                           f"{TRUST_FLAG} starts without compiling)")
        stored = desc.get("stored_executables")
        if stored:
            what = [f"{n} {kind}" for n, kind in ((stored["programs"], "program executables"),
                                                  (stored["engine_calls"], "serving engine calls")) if n]
            lines.append(f"stored executables: {' and '.join(what)}, native code: loaded only with {TRUST_FLAG} "
                         "(run, serve; tte.load(path, trust_stored_executables=True)), never read without it "
                         "(everything compiles)")
        return lines
    prog = desc["programs"][program]
    for k in prog.get("kernels") or []:
        what = k.get("kernel") or f"xla ({k.get('reason', 'no kernel')})"
        if k.get("kernel") and k.get("detail"):
            what += f" ({k['detail']})"
        lines.append(f"  kernel [{k.get('platform', '?')}] {k.get('node', '?')} ({k.get('op', '?')}): {what}")
    cost = prog.get("kernel_cost")
    if cost:
        lines.append(_kernel_cost_line(cost))
    for topo, entry in (prog.get("compiled") or {}).items():
        stored = "executable stored" if entry.get("executable") else entry.get("executable_reason", "not stored")
        lines.append(f"  compiled [{topo}, {entry.get('device_kind')}, libtpu {entry.get('libtpu')}, {stored}]: "
                     + describe_stats(entry["stats"]))
    plan = prog.get("sharding")
    if plan:
        sharded = {w: s for w, s in plan["weights"].items() if any(s)}
        lines.append(f"  sharding {plan['mode']}: {len(plan['column_parallel'])} column-parallel, "
                     f"{len(plan['row_parallel'])} row-parallel, "
                     + (f"{len(plan['expert_parallel'])} split by expert over {plan['expert_axis']!r}, "
                        if plan.get("expert_parallel") else "")
                     + f"{len(plan['weights']) - len(sharded)} replicated")
        lines += [f"  shard {w}: [{', '.join(a or '-' for a in s)}]" for w, s in sorted(sharded.items())]
        names = [i["name"] for i in prog.get("inputs", [])]
        lines += [f"  shard input {names[i] if i < len(names) else i}: [{', '.join(a or '-' for a in s)}]"
                  for i, s in enumerate(plan["inputs"]) if any(s)]
        lines += [f"  shard output {i}: [{', '.join(a or '-' for a in s)}]"
                  for i, s in enumerate(plan.get("outputs", [])) if any(s)]
    return lines


def _kernel_cost_line(cost: dict) -> str:
    """Bytes accessed with kernels and with XLA alone, per topology, and which the program kept."""
    if cost.get("not_compared"):
        return f"  kernels vs XLA: not compared ({cost['not_compared']}); kernels kept"
    per = ", ".join(f"{t} {cost['pallas'][t] / 1e6:.1f} vs {cost['xla'].get(t, 0) / 1e6:.1f} MB"
                    for t in cost.get("pallas", {}))
    kept = cost.get("kept")
    if kept == "pallas" and cost.get("dropped"):
        kept += f" (without {', '.join('pallas.' + k for k in cost['dropped'])}, which made it access more)"
    return f"  kernels vs XLA (bytes accessed, compiler's cost analysis): {per}; kept {kept}"


def _pages_line(desc: dict, llm: dict) -> str:
    """What ``serve`` keeps for prefix caching by default (:mod:`torchtpu_export.engine.prefix`), or a paged
    program's page pool (:mod:`torchtpu_export.engine.paged`)."""
    import ml_dtypes
    import numpy as np

    from ...engine.prefix import PAGE_SIZE, default_pages
    from ...llm.plan import DECODE, DECODE_PAGED
    paged = [i for i in (desc.get("programs", {}).get(DECODE_PAGED) or {}).get("inputs", [])
             if i["name"].startswith(("kv_cache_k_", "kv_cache_v_"))]
    kv = [i for i in (desc.get("programs", {}).get(DECODE) or {}).get("inputs", [])
          if i["name"].startswith(("kv_cache_k_", "kv_cache_v_"))]

    def itemsize(dtype) -> int:  # bytes per element (bfloat16 too); 0 for what is no dtype
        try:
            return np.dtype(getattr(ml_dtypes, str(dtype), None) or str(dtype)).itemsize
        except TypeError:
            return 0

    per_position = sum(i["shape"][1] * i["shape"][3] * itemsize(i["dtype"]) for i in kv
                       if len(i["shape"]) == 4 and all(isinstance(d, int) for d in i["shape"]))
    slots = llm.get("slots", 1)
    if paged and all(len(i["shape"]) == 4 and all(isinstance(d, int) for d in i["shape"]) for i in paged):
        pages, page = paged[0]["shape"][1], paged[0]["shape"][2]  # [kv heads, pages, page, dim]
        mib = sum(int(np.prod(i["shape"])) * itemsize(i["dtype"]) for i in paged) / 2 ** 20
        full = (pages - 1) * page // llm["cache_length"]
        return (f"serving: paged KV cache of {pages} pages of {page} positions ({mib:.1f} MiB on the device) shared "
                f"by {slots} rows: {(pages - 1) * page} positions, {full} sequence(s) of the full "
                f"{llm['cache_length']}; prefix pages shared in place (serve --no-prefix-cache: kept by none)")
    pages = default_pages(slots, llm["cache_length"])
    mib = pages * PAGE_SIZE * per_position / 2 ** 20
    return (f"serving: prefix cache of {pages} pages of {PAGE_SIZE} positions ({mib:.1f} MiB on the device; "
            "serve --no-prefix-cache: none)" + ("; one request alone steps through decode" if slots > 1 else ""))


def _llm_summary(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "chat_template"} | {"chat_template": bool(info.get("chat_template"))}


def compile_cli(args) -> list[str]:
    """``torchtpu-export compile model.tpu --topology ...``: compiles, stores the executables in
    ``-o`` (default: the input file), and returns a line per program and topology."""
    from . import aot as tpu_compile
    from ...fileio import check_writable
    if args.topology is None:
        raise InputError("compile model.tpu needs --topology", hint="e.g. --topology v5e or v5e:2x2,v6e-8")
    for flag in ("soc", "ai_pack"):
        if getattr(args, flag, None):
            raise InputError(f"--{flag.replace('_', '-')} applies to .tflite files (NPUs), not .tpu programs")
    output = check_writable(args.output or args.artifact)
    from .stored import CPU
    names = [t.strip() for t in args.topology.split(",") if t.strip()]
    topologies = tpu_compile.parse_topologies([t for t in names if t != CPU]) if set(names) - {CPU} else ()
    if topologies:
        tpu_compile.require_libtpu("torchtpu-export compile")
    prog = load(args.artifact)
    prog.compile([*topologies, *([CPU] if CPU in names else [])], signature_name=args.signature)
    prog.save(output)
    lines = []
    for topo in topologies:
        chips, hosts = tpu_compile.slice_size(topo)
        lines.append(f"{topo}: {chips} chip{'s' if chips != 1 else ''} on {hosts} host{'s' if hosts != 1 else ''}")
        for name, entry in sorted(prog.manifest["compiled"][topo].items()):
            stored = "executable stored" if entry.get("executable") else entry.get("executable_reason", "not stored")
            lines.append(f"{topo} {name}: {tpu_compile.describe_stats(entry['stats'])} [{stored}]")
    for topo, entry in sorted((prog.manifest.get("llm") or {}).get("engine", {}).items()):
        if topo in topologies or topo == CPU and CPU in names:
            calls = entry["calls"].values()
            lines.append(f"{topo} serving engine ({entry.get('server')}): {len(calls)} calls stored, "
                         f"{sum(c['bytes'] for c in calls) / 2**20:.1f} MiB, compiled in "
                         f"{sum(c['seconds'] for c in calls):.1f} s: a server on {entry['device_kind']} given "
                         f"{TRUST_FLAG} starts without compiling")
    lines.append(f"wrote {output} ({os.path.getsize(output):,} bytes)")
    return lines


def cli_options(args, sample_args, sample_kwargs) -> dict:
    options = dict(platforms=tuple(p for p in args.platforms.split(",") if p), kernels=args.kernels,
                   narrow_64bit=args.narrow_64bit, mesh=_parse_mesh(args.mesh), sharding=args.sharding)
    if args.quantize:
        options["quant_config"] = args.quantize
    return options


def _parse_mesh(text: str | None):
    if not text:
        return None
    try:
        return tuple((name, int(size)) for name, size in (item.split("=") for item in text.split(",")))
    except ValueError:
        raise InputError(f"bad --mesh {text!r}", hint="use AXIS=SIZE pairs, e.g. --mesh data=1,model=8") from None


LLM_TOKENIZER = "llm/tokenizer.json"


def llm_options(source, layout, prefill_lengths) -> dict:
    """What an LLM's programs carry (``export_llm``), as a build option: ``build`` writes it into the manifest."""
    return {"llm": {"source": source, "layout": layout, "prefill_lengths": list(prefill_lengths)}}


def _carry_llm(artifact, llm: dict) -> None:
    """What a server needs to take text: the tokenizer, its special tokens and
    the chat template, the cache length, prefill lengths and decode slots."""
    from ...llm.plan import DECODE_BATCH, DECODE_PAGED
    manifest = artifact.manifest
    batch = manifest["programs"].get(DECODE_BATCH) or manifest["programs"].get(DECODE_PAGED)
    source, layout = llm["source"], llm["layout"]
    info = {"name": source.name, "cache_length": layout.length, "prefill_lengths": llm["prefill_lengths"],
            "slots": next(i["shape"][0] for i in batch["inputs"] if i["name"] == "tokens") if batch else 1}
    parts = source.vision
    if parts is not None:  # a VLM: what the server needs to put images into a prompt (llm.plan.VISION)
        info["vision"] = {"family": parts.family, "height": parts.height, "width": parts.width,
                          "rows": parts.image_tokens - (parts.image_end is not None), "hidden": parts.hidden,
                          "image_token_id": parts.image_token_id, "marker": parts.expansion[0],
                          "sequence": parts.expansion[1], "bidirectional": parts.bidirectional,
                          "resample": parts.resample}
    if layout.states:  # recurrent layers' states beside the KV cache (llm.contract)
        import numpy as np
        info["recurrent_states"] = {"tensors": len(layout.states), "bytes_per_sequence": sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in layout.states)}
    tok = source.tokenizer
    if tok is not None:
        info.update(tokenizer=LLM_TOKENIZER, chat_template=tok.chat_template, bos_id=tok.bos_id, pad_id=tok.pad_id,
                    stop_ids=list(tok.stop_ids), specials=dict(tok.specials))
        artifact.extras[LLM_TOKENIZER] = tok.json.encode()
        if source.chat is not None:  # the export's chat probes, through the code the server's text workers run
            from ...llm.chat import check_text_workers
            info["chat"] = source.chat_report = check_text_workers(tok, source.chat, info.get("vision"), layout.length)
    manifest["llm"] = info


TARGET = Target(
    name="tpu", summary="TPU StableHLO executables (.tpu), run on PJRT (cpu here, tpu or gpu where present)",
    converter="stablehlo", runtime="xla", suffix=".tpu", runnable=TpuProgram, signature="main",
    build=build, load=load, describe=describe, cli_options=cli_options, compile=compile_cli,
    cli_arguments=(
        ("--platforms", dict(default="tpu,cpu", help="tpu target: comma-separated PJRT platforms")),
        ("--kernels", dict(default="auto", choices=["auto", "pallas", "xla"],
                           help="tpu target: Pallas kernels for hot ops (auto: where shapes allow)")),
        ("--narrow-64bit", dict(action="store_true", help="tpu target: int64/float64 become 32-bit")),
        ("--mesh", dict(default=None, metavar="AXIS=N,...",
                         help="tpu target: shard over a device mesh, e.g. data=1,model=8 (a mixture-of-experts "
                              "model's experts go over 'expert' where the mesh has it, else over 'model')")),
        ("--sharding", dict(default=None, choices=["tensor_parallel", "data_parallel", "replicated"],
                            help="tpu target with --mesh: how weights and inputs are split (default tensor_parallel)")),
    ),
    recipes=("int8_weight_only", "bf16"), magic=lambda head, names: names is not None and "manifest.json" in names,
    zipped=True, describe_lines=describe_lines,
    local_options={"platforms": ("cpu",)}, abstract_weights=True, stateful=True, stored_executables=True,
    llm=LlmSupport(options=llm_options, recurrent_state=True, vision=True, image_rows=True, batched=True,
                   cache_follows_recipe=True),
)
