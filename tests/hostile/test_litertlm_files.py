""".litertlm bundles made hostile, each as the red team reported it and then the kin of each: sections
LiteRT-LM reads that would abort it (a Rust panic in its tokenizer, a missing LlmMetadata, a wild
pointer in its header reader), a second section of a kind that LiteRT-LM takes in place of the first,
a tokenizer that inflates 500x, metadata out of range, and prompts and templates LiteRT-LM fails on.
Each goes through the CLI's run and inspect: one message and exit 5 (2 for the user's prompt), no
signal, within the memory docs/security.md promises; the good bundle still generates."""
import json
import zlib

import flatbuffers
import pytest
import torch
from litert_lm_builder import litertlm_header_schema_py_generated as schema
from litert_lm_builder.runtime.proto import llm_metadata_pb2

import hf_llms
import torchtpu_export as tte
from cli_checks import _cli_peak_rss_mb
from conftest import run_cli, run_cli_many
from torchtpu_export.targets.litertlm import artifact, checks
from torchtpu_export.targets.litertlm.target import LitertLmBundle

T = schema.AnySectionDataType
MEMORY_BOUND_MB = 300  # plus 4x the file: what docs/security.md promises for any hostile file


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("litertlm")
    bundle = tte.export_llm(hf_llms.save_folder("llama", str(root / "llama")), target="litertlm",
                            prefill_lengths=(8,), cache_length=32)
    path = root / "good.litertlm"
    bundle.save(path)
    parts = {s["type"]: artifact.section_bytes(str(path), s) for s in artifact.read_sections(str(path))}
    tokenizer = zlib.decompress(parts["HF_Tokenizer_Zlib"][8:])
    return {"path": path, "tflite": parts["TFLiteModel"], "tokenizer": tokenizer,
            "metadata": parts["LlmMetadataProto"], "bundle": bundle}


# ---- making bundles: LiteRT-LM's container with any sections, items and header ------------------

def _item(key, value):
    """A header item: text, or (VData type, value table) for what litert-lm-builder would not write."""
    kv = schema.KeyValuePairT()
    kv.key = key
    if isinstance(value, str):
        kv.valueType, kv.value = schema.VData.StringValue, schema.StringValueT(value)
    else:
        kv.valueType, kv.value = value
    return kv


def _write(path, sections, *, major=1, header_pad=0):
    """``sections``: (type, bytes, {key: value} or None for no items); laid out as litert-lm-builder does."""
    objects = []
    for code, data, items in sections:
        obj = schema.SectionObjectT()
        obj.items = None if items is None else [_item(k, v) for k, v in items.items()]
        obj.dataType, obj.beginOffset, obj.endOffset = code, 1, 1
        objects.append(obj)
    meta = schema.LiteRTLMMetaDataT(systemMetadata=schema.SystemMetadataT(entries=[_item("Authors", "x" * header_pad)]),
                                    sectionMetadata=schema.SectionMetadataT(objects=objects))
    builder = flatbuffers.Builder(0)
    builder.Finish(meta.Pack(builder))
    size = builder.Offset()
    offset = (32 + size + 16383) & ~16383
    for obj, (_, data, _) in zip(objects, sections):
        obj.beginOffset, obj.endOffset = offset, offset + len(data)
        offset = (offset + len(data) + 16383) & ~16383
    builder = flatbuffers.Builder(0)
    builder.Finish(meta.Pack(builder))
    out = bytearray(b"LITERTLM" + major.to_bytes(4, "little") + (7).to_bytes(4, "little") + bytes(8)
                    + (32 + size).to_bytes(8, "little") + builder.Output())
    for obj, (_, data, _) in zip(objects, sections):
        out += bytes(obj.beginOffset - len(out)) + data
    path.write_bytes(bytes(out))
    return path


def _zlib(text: bytes, declared=None) -> bytes:
    return (len(text) if declared is None else declared).to_bytes(8, "little") + zlib.compress(text)


PREFILL_DECODE = {"model_type": "tf_lite_prefill_decode"}


def _sections(good, *, tflite=None, tokenizer=None, metadata=None):
    """The good bundle's three sections, any of them replaced (b"" drops it)."""
    out = [(T.TFLiteModel, good["tflite"] if tflite is None else tflite, PREFILL_DECODE),
           (T.HF_Tokenizer_Zlib, _zlib(good["tokenizer"]) if tokenizer is None else tokenizer, {}),
           (T.LlmMetadataProto, good["metadata"] if metadata is None else metadata, {})]
    return [s for s in out if s[1] != b""]


def _metadata(good, change) -> bytes:
    msg = llm_metadata_pb2.LlmMetadata()
    msg.ParseFromString(good["metadata"])
    change(msg)
    return msg.SerializeToString()


def _tokenizer_json(good, change) -> bytes:
    j = json.loads(good["tokenizer"])
    change(j)
    return json.dumps(j).encode()


def _one_message(r, code, says="", case=""):
    lines = [line for line in r.stderr.strip().splitlines() if line and not line.startswith("PEAK_RSS_KB")]
    assert r.returncode == code, (case, r.returncode, r.stderr[-2000:])  # not a signal, not exit 1
    assert lines and lines[0].startswith("error:") and says in lines[0], (case, r.stderr[-2000:])
    # no traceback, no C++ or Rust log
    assert all(line.startswith("  hint:") for line in lines[1:]), (case, r.stderr[-2000:])


def _refused_all(cases: dict):
    """``{case: (bundle, words)}``: ``run --prompt`` and ``inspect`` both refuse each bundle with one message
    holding its words (all of them in one CLI process, each call's file descriptors captured)."""
    argvs = []
    for path, _ in cases.values():
        argvs += [("run", path, "--prompt", "hi", "--max-new-tokens", "4"), ("inspect", path)]
    results = run_cli_many(argvs)
    for i, (case, (_, says)) in enumerate(cases.items()):
        for r in results[2 * i:2 * i + 2]:
            _one_message(r, 5, says, case)


def _refused(path, says):
    _refused_all({str(path): (path, says)})


def _runs(path):
    r = run_cli("run", path, "--prompt", "hi", "--max-new-tokens", "4")
    assert r.returncode == 0 and "generated in" in r.stderr + r.stdout, r.stderr[-2000:]
    r = run_cli("inspect", path)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# ---- the red team's cases ---------------------------------------------------------------------

TOKENIZERS = {  # each aborted LiteRT-LM (SIGABRT from a Rust panic) and passed inspect
    "not JSON": (lambda good: b"{not json", "is not valid JSON"),
    "merges outside the vocabulary": (lambda good: _tokenizer_json(
        good, lambda j: j["model"]["merges"].append(["zzzq", "qqqz"])), "out of vocabulary"),
    "an empty WordPiece vocabulary": (lambda good: _tokenizer_json(good, lambda j: j.__setitem__("model", {
        "type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100, "vocab": {}})), "Missing [UNK] token"),
    # the error quotes the file's token: it stays on the message's one line, escaped
    "a merge naming a token with a line break": (lambda good: _tokenizer_json(
        good, lambda j: j["model"]["merges"].append(["a\nerror: fake", "b"])), "out of vocabulary"),
    "deep nesting": (lambda good: b"[" * 100_000 + b"]" * 100_000, "levels deep"),
    "nesting inside a tokenizer": (lambda good: _tokenizer_json(
        good, lambda j: j.__setitem__("normalizer", json.loads('{"type": "Sequence", "normalizers": ' + "[" * 80
                                                               + "]" * 80 + "}"))), "levels deep"),
    # tokenizers itself panics here (pyo3's PanicException, a BaseException): caught, and Rust's
    # panic hook (with RUST_BACKTRACE, a backtrace) kept off the terminal
    "a panic in tokenizers": (lambda good: _tokenizer_json(good, lambda j: j.__setitem__(
        "normalizer", {"type": "Precompiled", "precompiled_charsmap": "AAAA"})), "PanicException"),
    # loads, and "hi" runs; a prompt with a character outside the vocabulary aborts LiteRT-LM
    "a BPE unknown token it does not have": (lambda good: _tokenizer_json(good, lambda j: j.update(
        model=dict(j["model"], unk_token="<nope>"), pre_tokenizer={"type": "Whitespace"}, decoder=None)),
        "fails on text"),
    "a UTF-16 tokenizer": (lambda good: good["tokenizer"].decode().encode("utf-16"), "does not load"),
}


def test_a_tokenizer_litert_lm_would_abort_on_is_refused(good, tmp_path):
    _refused_all({case: (_write(tmp_path / f"b{i}.litertlm", _sections(good, tokenizer=_zlib(make(good)))), says)
                  for i, (case, (make, says)) in enumerate(TOKENIZERS.items())})


ZLIB = {
    "inflates past its size": (lambda t: _zlib(t, len(t) - 100), "inflates to more than"),
    "inflates short of its size": (lambda t: _zlib(t, len(t) + 100), "not the"),  # LiteRT-LM pads with zeros
    "not zlib": (lambda t: len(t).to_bytes(8, "little") + b"\x12\x34" * 500, "not zlib data"),
    "cut short": (lambda t: _zlib(t)[:200], "cut short"),
    "bytes after the stream": (lambda t: _zlib(t) + b"junk", "bytes after its zlib stream"),
    "too short for a size": (lambda t: b"abc", "too short"),
    "a size of 2**62": (lambda t: _zlib(t, 1 << 62), "says it inflates to"),
}


def test_a_tokenizer_section_that_does_not_inflate_to_its_size_is_refused(good, tmp_path):
    _refused_all({case: (_write(tmp_path / f"b{i}.litertlm", _sections(good, tokenizer=make(good["tokenizer"]))), says)
                  for i, (case, (make, says)) in enumerate(ZLIB.items())})


def _inflating(text: bytes, pad: int) -> bytes:
    """zlib of ``text`` with ``pad`` spaces after its first byte (still the same JSON)."""
    z = zlib.compressobj(9)
    parts = [z.compress(text[:1])] + [z.compress(b" " * (16 << 20)) for _ in range(pad >> 24)]
    return b"".join(parts + [z.compress(text[1:]), z.flush()])


def test_a_tokenizer_that_inflates_to_600_mb_is_refused_in_bounded_memory(good, tmp_path):
    _, baseline = _cli_peak_rss_mb("inspect", good["path"])
    stream = _inflating(good["tokenizer"], 600 << 20)
    # the size it declares is the size it inflates to, or a lie (it never inflates past what it declares)
    for declared, says in ((len(good["tokenizer"]) + (600 << 20), "says it inflates to"),
                           (len(good["tokenizer"]), "inflates to more than")):
        bomb = _write(tmp_path / "bomb.litertlm",
                      _sections(good, tokenizer=declared.to_bytes(8, "little") + stream))
        size_mb = bomb.stat().st_size / 2 ** 20
        assert size_mb < 1.5  # a 1.1 MB file; LiteRT-LM would take 1.5 GB for it and exit 0
        for argv in (("run", bomb, "--prompt", "hi"), ("inspect", bomb)):
            r, peak = _cli_peak_rss_mb(*argv)
            _one_message(r, 5, says)
            print(f"{argv[0]} of a {size_mb:.1f} MB bundle inflating to 600 MB: peak {peak:.0f} MB "
                  f"(a good bundle's inspect: {baseline:.0f} MB)")
            assert peak < baseline + 4 * size_mb + MEMORY_BOUND_MB, (argv[0], peak, baseline)
            assert peak < baseline + 100, (argv[0], peak, baseline)  # it is never inflated


def test_a_tokenizer_that_takes_gigabytes_to_load_is_refused_in_bounded_memory(good, tmp_path):
    # 64 MiB of merges (20 million JSON values: ~3.5 GB in the tokenizers library) in 64 KB of zlib, within
    # the JSON caps: its child process runs out of the memory a tokenizer may take, this one never loads it
    j = json.loads(good["tokenizer"])
    j["model"]["merges"] = ["MERGES"]
    head, tail = json.dumps(j).encode().split(b'"MERGES"')
    n = (checks.MAX_TOKENIZER - len(head) - len(tail)) // 10
    text = head + b'["a","b"],' * (n - 1) + b'["a","b"]' + tail
    bomb = _write(tmp_path / "bomb.litertlm", _sections(good, tokenizer=_zlib(text)))
    size_mb = bomb.stat().st_size / 2 ** 20
    _, baseline = _cli_peak_rss_mb("inspect", good["path"])
    for argv in (("run", bomb, "--prompt", "hi"), ("inspect", bomb)):
        r, peak = _cli_peak_rss_mb(*argv)
        _one_message(r, 5, f"takes more than the {checks.TOKENIZER_MEMORY >> 20} MB a tokenizer may take")
        print(f"{argv[0]} of a {size_mb:.1f} MB bundle whose tokenizer takes gigabytes: peak {peak:.0f} MB "
              f"(a good bundle's inspect: {baseline:.0f} MB)")
        assert peak < baseline + 4 * size_mb + MEMORY_BOUND_MB, (argv[0], peak, baseline)


def test_a_bundle_with_a_real_vocabulary_is_written_loaded_and_run(tmp_path):
    """262,144 tokens (a 32 MB tokenizer.json, as Gemma 3's) in a 20 MB bundle: the tokenizer's bound does not
    shrink with the bundle (past 4 MiB + a sixteenth of the file it was refused as a zip bomb)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = hf_llms.large_tokenizer(262_144)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, max_position_embeddings=64, vocab_size=len(tok), eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True, initializer_range=0.2)).eval()
    folder = hf_llms.save(model, tok, str(tmp_path / "hf"))
    path = tmp_path / "vocab.litertlm"
    tte.export_llm(folder, target="litertlm", prefill_lengths=(8,), cache_length=32).save(path)
    size, text = path.stat().st_size, (tmp_path / "hf" / "tokenizer.json").stat().st_size
    assert size < 24 << 20 and text > 30 << 20, (size, text)
    assert tte.load(path).generate("hi", max_new_tokens=4).text
    r = run_cli("run", path, "--prompt", "hi", "--max-new-tokens", "4")
    assert r.returncode == 0 and "generated in" in r.stderr + r.stdout, r.stderr[-2000:]


def test_a_bundle_load_would_refuse_is_never_written(good, tmp_path, monkeypatch):
    exported = good["bundle"]
    bundle = LitertLmBundle(exported.edge, exported.tokenizer, exported.metadata)  # not packed yet
    monkeypatch.setattr(checks, "MAX_TOKENIZER", 1000)  # its tokenizer past the bound
    out = tmp_path / "out.litertlm"
    with pytest.raises(tte.ArtifactError) as e:
        bundle.save(out)
    assert str(e.value).startswith(f"the bundle packed for {out} would be refused when loaded: {out}'s tokenizer")
    assert "says it inflates to" in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing at the path, no temporary file left


def test_a_bundle_without_llm_metadata_is_refused(good, tmp_path):
    # LiteRT-LM aborted in Engine() without a word (std::optional::value() of nothing)
    _refused(_write(tmp_path / "b.litertlm", _sections(good, metadata=b"")), "has no LlmMetadata")
    _refused(_write(tmp_path / "t.litertlm", _sections(good, tokenizer=b"")), "no tokenizer")
    _refused(_write(tmp_path / "m.litertlm", _sections(good, tflite=b"")), "no TFLite model")


def test_of_two_tflite_models_the_one_litert_lm_runs_is_checked_and_described(good, tmp_path):
    # LiteRT-LM keys sections by (type, model_type) and the later one replaces the earlier
    garbage = b"not a flatbuffer" * 64
    second_bad = _sections(good) + [(T.TFLiteModel, garbage, PREFILL_DECODE)]
    _refused(_write(tmp_path / "second.litertlm", second_bad), "section 3")
    first_bad = [(T.TFLiteModel, garbage, {})] + _sections(good)  # no model_type: tf_lite_prefill_decode too
    out = _runs(_write(tmp_path / "first.litertlm", first_bad))
    assert "section TFLiteModel (tf_lite_prefill_decode): 1,024 bytes, never read: section 1 of the same " \
           "kind replaces it" in out
    runs = f"section TFLiteModel (tf_lite_prefill_decode): {len(good['tflite']):,} bytes, the model LiteRT-LM runs"
    assert runs in out
    assert "signature decode:" in out


def test_of_two_tokenizers_or_metadata_the_later_is_checked(good, tmp_path):
    bad_tok, bad_meta = _zlib(b"{not json"), b"\xff" * 100
    _refused(_write(tmp_path / "t2.litertlm", _sections(good) + [(T.HF_Tokenizer_Zlib, bad_tok, {})]), "section 3")
    _refused(_write(tmp_path / "m2.litertlm", _sections(good) + [(T.LlmMetadataProto, bad_meta, {})]), "damaged")
    _runs(_write(tmp_path / "t1.litertlm", [(T.HF_Tokenizer_Zlib, bad_tok, {})] + _sections(good)))


def test_the_tokenizer_litert_lm_prefers_is_checked(good, tmp_path):
    bad_tok = _zlib(b"{not json")
    # a tokenizer keyed tf_lite_prefill_decode comes before one without a model_type, wherever it is
    keyed = _sections(good)[:1] + [(T.HF_Tokenizer_Zlib, bad_tok, PREFILL_DECODE)] + _sections(good)[1:]
    _refused(_write(tmp_path / "k.litertlm", keyed), "section 1")
    # and a SentencePiece tokenizer before both: checked by SentencePiece in a child process first
    _refused_all({case: (_write(tmp_path / f"sp{i}.litertlm", _sections(good) + [(T.SP_Tokenizer, data, {})]),
                         "does not load as a SentencePiece model")
                  for i, (case, data) in enumerate({"garbage": b"\x0a\x03abc", "cut short": _sp_model()[:5000],
                                                    "noise": bytes(range(256)) * 40}.items())})


def _sp_model(vocab: int = 320) -> bytes:
    """A SentencePiece model of ``vocab`` pieces (the tiny model's), trained here on the tiny corpus."""
    import io
    import sentencepiece
    extra = []
    for _ in range(2):
        out = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(hf_llms.CORPUS * 4), model_writer=out,
                                                 vocab_size=vocab, hard_vocab_limit=False, byte_fallback=True,
                                                 user_defined_symbols=extra, minloglevel=2)
        sp = sentencepiece.SentencePieceProcessor()
        sp.LoadFromSerializedProto(out.getvalue())
        if sp.GetPieceSize() == vocab:
            return out.getvalue()
        extra = [f"<extra{i}>" for i in range(vocab - sp.GetPieceSize())]
    raise AssertionError(f"{sp.GetPieceSize()} pieces, not {vocab}")


def test_a_bundle_with_a_sentencepiece_tokenizer_runs(good, tmp_path):
    """Bundles of Google's and of litert-torch's export carry SentencePiece: checked, then run."""
    sections = [(T.TFLiteModel, good["tflite"], PREFILL_DECODE), (T.SP_Tokenizer, _sp_model(), {}),
                (T.LlmMetadataProto, good["metadata"], {})]
    out = _runs(_write(tmp_path / "sp.litertlm", sections))
    assert "section SP_Tokenizer" in out and "the tokenizer (320 tokens" in out


def test_sections_litert_lm_does_not_read_are_listed_not_checked(good, tmp_path):
    extra = [(T.TFLiteWeights, b"\x00" * 64, {}), (T.GenericBinaryData, b"\x01" * 64, {"name": "x"}),
             (T.ExecutorMetadataProto, b"\xff" * 64, {}), (99, b"\x02" * 64, {}),
             (T.HF_Tokenizer_Zlib, _zlib(b"{not json"), {"model_type": "tf_lite_embedder"})]
    out = _runs(_write(tmp_path / "x.litertlm", _sections(good) + extra))
    assert "section type 99: 64 bytes, not read when generating text" in out


METADATA = {  # what LiteRT-LM aborts on, fails on later, or runs with tokens past the embedding
    # (the good bundle has none: its chat template writes the BOS, as transformers renders it)
    "a start token outside the vocabulary": (lambda m: m.start_token.token_ids.ids.append(100_000),
                                             "start_token.token_ids holds token 100000"),
    "a negative start token": (lambda m: m.start_token.token_ids.ids.append(-5), "token -5"),
    "an empty start token (LiteRT-LM aborts)": (lambda m: m.start_token.token_ids.SetInParent(),
                                                "start_token is empty"),
    "no stop token": (lambda m: m.ClearField("stop_tokens"), "no stop token"),
    "a stop token outside the vocabulary": (lambda m: m.stop_tokens[0].token_ids.ids.__setitem__(0, 320),
                                            "stop_tokens[0].token_ids holds token 320"),
    "an empty stop token": (lambda m: m.stop_tokens.add(), "stop_tokens[1] is empty"),
    "a pad token outside the vocabulary": (lambda m: m.pad_token.token_ids.ids.__setitem__(0, 1 << 30),
                                           "pad_token"),
    "a suppressed token outside the vocabulary": (lambda m: m.suppress_tokens.ids.append(999), "suppress_tokens"),
    "an image token outside the vocabulary": (
        lambda m: m.llm_model_type.gemma3.start_of_image_token.token_ids.ids.append(12345), "start_of_image_token"),
    "max_num_tokens past the model's cache": (lambda m: setattr(m, "max_num_tokens", 1 << 30), "max_num_tokens"),
    "a negative max_num_tokens": (lambda m: setattr(m, "max_num_tokens", -1), "max_num_tokens"),
    "sampler values out of range": (lambda m: setattr(m.sampler_params, "p", 5.0), "sampler_params"),
    "a sampler type LiteRT-LM does not define": (lambda m: setattr(m.sampler_params, "type", 99),
                                                 "sampler_params.type is 99"),
    "a channel without its delimiters": (lambda m: m.channels.add(channel_name="x"), "channel"),
}


def test_llm_metadata_out_of_range_is_refused(good, tmp_path):
    _refused_all({case: (_write(tmp_path / f"b{i}.litertlm", _sections(good, metadata=_metadata(good, change))), says)
                  for i, (case, (change, says)) in enumerate(METADATA.items())})


def _header_cases(good):
    no_string = schema.StringValueT()
    no_string.value = None
    model = good["tflite"]
    return {  # LiteRT-LM's C++ reads the header without a flatbuffer verifier
        "a model_type that is a number (LiteRT-LM: SIGSEGV)": (
            [(T.TFLiteModel, model, {"model_type": (schema.VData.Int32, schema.Int32T(5))})], {}, "is not text"),
        "a model_type without its string (SIGSEGV)": (
            [(T.TFLiteModel, model, {"model_type": (schema.VData.StringValue, no_string)})], {}, "is not text"),
        "a backend_constraint that is a number (SIGSEGV)": (
            [(T.TFLiteModel, model, {**PREFILL_DECODE, "backend_constraint": (schema.VData.Int32, schema.Int32T(1))})],
            {}, "is not text"),
        "a model_type LiteRT-LM does not know": ([(T.TFLiteModel, model, {"model_type": "prefill_decode"})], {},
                                                 "does not know"),
        "a header past the 16 KiB LiteRT-LM reads": ([(T.TFLiteModel, model, PREFILL_DECODE)],
                                                     {"header_pad": 20_000}, "16,384 bytes"),
        "format 2": ([(T.TFLiteModel, model, PREFILL_DECODE)], {"major": 2}, "format 1 only"),
        "an empty TFLite model": ([(T.TFLiteModel, b"", PREFILL_DECODE)], {}, "is empty"),
        "a TFLite model without items": ([(T.TFLiteModel, model, None)], {}, "no TFLite model"),
    }


def test_a_header_litert_lm_would_misread_is_refused(good, tmp_path):
    _refused_all({case: (_write(tmp_path / f"b{i}.litertlm", sections + _sections(good)[1:], **layout), says)
                  for i, (case, (sections, layout, says)) in enumerate(_header_cases(good).items())})


def test_a_string_running_past_the_header_is_refused(good, tmp_path):
    data = bytearray(good["path"].read_bytes())
    at = data.index(b"tf_lite_prefill_decode")
    data[at - 4:at] = (0x7FFFFFF0).to_bytes(4, "little")  # LiteRT-LM reads 2 GB past its 16 KiB: SIGSEGV
    bad = tmp_path / "b.litertlm"
    bad.write_bytes(bytes(data))
    _refused(bad, "runs past the end of the header")


def test_a_tflite_model_litert_lm_cannot_run_is_refused(good, tmp_path):
    damaged = bytearray(good["tflite"])
    damaged[4:8] = b"XXXX"
    _refused(_write(tmp_path / "d.litertlm", _sections(good, tflite=bytes(damaged))), "TFL3")
    plain = tmp_path / "plain.tflite"  # a valid model, but not one LiteRT-LM can run as an LLM
    tte.export(Twice(), (torch.ones(1, 4),), target="litert").export(str(plain))
    _refused(_write(tmp_path / "s.litertlm", _sections(good, tflite=plain.read_bytes())), "prefill* and decode")


class Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2


# ---- prompts and templates: the user's (exit 2) or the bundle's (exit 5) --------------------------

def test_prompts_litert_lm_cannot_take_are_the_users_error(good):
    long = "hello world this is a tiny language model and tokens are made locally from a small corpus"
    _one_message(run_cli("run", good["path"], "--prompt", long), 2, "holds 32 tokens of context")
    _one_message(run_cli("run", good["path"], "--prompt", "a\udcffb"), 2, "not valid text")
    # with the chat template's text the prompt no longer fits (a shorter one does)
    mid = "hello world this is a tiny language model and tokens are made"
    _one_message(run_cli("run", good["path"], "--prompt", mid, "--chat"), 2, "chat template")


@pytest.mark.parametrize("template", ["{% for %}", "{{ raise_exception('no') }}"])
def test_a_chat_template_litert_lm_cannot_render_is_the_bundles_error(good, tmp_path, template):
    bundle = _write(tmp_path / "b.litertlm", _sections(good, metadata=_metadata(
        good, lambda m: setattr(m, "jinja_prompt_template", template))))
    _one_message(run_cli("run", bundle, "--prompt", "hi", "--chat"), 5, "chat template")
    _runs(bundle)  # without --chat the template is not used


def test_the_good_bundle_still_generates_and_says_what_runs(good):
    out = _runs(good["path"])
    assert "the model LiteRT-LM runs" in out and "the tokenizer (320 tokens" in out and "the LlmMetadata" in out
    r = run_cli("run", good["path"], "--prompt", "hi", "--chat", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    checked = checks.check(str(good["path"]))
    # no start token: the template writes the chat's BOS, and a raw prompt is prefilled after the tokenizer's
    assert (checked.context, checked.vocab, checked.start_tokens, checked.raw_bos) == (32, 320, 0, "<bos>")
