"""What a request brings is worked on within bounds: a grammar's compile and an image's decoding in worker
processes (``torchtpu_export.workers``) under a time and a memory budget, killed and replaced on overrun;
the sizes that make them costly refused before any work; a reply's tool calls read in linear time."""
import asyncio
import io
import time

import numpy as np
import pytest

import hf_llms
from image_craft import _scans_jpeg
from torchtpu_export.errors import InputError


@pytest.fixture(scope="module")
def grammars():
    from torchtpu_export.llm.grammar import Grammars
    tok = hf_llms.tokenizer()
    g = Grammars(tok.backend_tokenizer.to_str(), len(tok), [tok.eos_token_id])
    yield g
    g.close()


@pytest.mark.parametrize("kind, value, says", [
    # a 50-byte schema whose lexer has a million states: refused before anything compiles
    ("json_schema", {"type": "integer", "multipleOf": 999983}, "multipleOf 999983"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 12345.5}}},
     "multipleOf 12345.5"),
    # a regular expression whose lexer passes the worker's memory: the worker dies, the caller gets a message
    ("regex", "(a{1000}){1000}", "compiling the response format"),
    # formats no text satisfies: refused up front, in one line (never llguidance's state dump)
    ("json_schema", {"$ref": "#"}, "no text satisfies it"),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "no text satisfies it"),
    ("regex", r"[^\s\S]", "no text satisfies it"),
])
def test_costly_or_unsatisfiable_formats_are_refused_in_one_line(grammars, kind, value, says):
    with pytest.raises(InputError, match=says) as e:
        grammars.matcher(kind, value)
    assert "\n" not in str(e.value) and "<state>" not in str(e.value)


def test_the_grammar_worker_is_replaced_and_formats_compile_after_an_overrun(grammars):
    with pytest.raises(InputError):
        grammars.matcher("regex", "(b{1000}){1000}")
    m = grammars.matcher("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}},
                                          "required": ["n"]})
    assert m.error is None
    m2 = asyncio.run(_compile(grammars, "regex", "[0-9]{3}"))
    assert "regex" in m2 or "[0-9]" in m2


async def _compile(grammars, kind, value):
    return await grammars.compile_async(kind, value)


def test_gbnf_grammars_compile_and_constrain(grammars):
    """GBNF (llama.cpp's grammar form, ``::=``) goes through llguidance's converter to Lark."""
    tok = hf_llms.tokenizer()
    m = grammars.matcher("grammar", 'root ::= "ab" ("c" | "d") "!"')
    row = np.zeros((len(tok) + 31) // 32, np.int32)
    text = ""
    for _ in range(8):
        m.fill(row)
        allowed = [t for t in range(len(tok)) if row[t // 32] >> (t % 32) & 1]
        pick = next((t for t in allowed if tok.decode([t]) and tok.decode([t]) not in ("<eos>",)), None)
        if pick is None or m.stopped:
            break
        assert m.consume(pick)
        text += tok.decode([pick])
        if m.stopped:
            break
    assert text in ("abc!", "abd!"), text


# ---- structured outputs on every tokenizer: llguidance gets a token table built from the tokenizer itself ----

def _byte_level(holes: bool = False, size: int = 0) -> str:
    """A byte-level BPE (GPT-2's alphabet): with ``holes``, ids 100-104 have no token and every later id is 5
    past its place (llguidance's tokenizer.json reader lost the last ones); ``size`` fills it with tokens no
    merge reaches up to that many (a 100k-token vocabulary, built in a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    merges = [("1", "2"), ("12", "3"), ("{", '"'), ('"', ":"), ("a", "b")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for n in range(size - len(vocab)):
        vocab[f"Ġw{n}"] = len(vocab)
    if holes:
        vocab = {t: i if i < 100 else i + 5 for t, i in vocab.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    return tok.to_str()


def _sentencepiece(decoder: str, odd: bool = False) -> str:
    """A SentencePiece-style BPE with byte fallback (``<0x00>``..``<0xFF>``) and a prepended ``▁``, with the
    decoder ``decoder``: "sequence" (Replace ▁, ByteFallback, Fuse, Strip, as Llama's and Mistral's converted
    tokenizers have; Gemma's without the Strip), "metaspace" or a bare "fuse". ``odd``: a token spelled ``<0x...>`` that is no byte
    (llguidance's reader panicked on it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))])}
    pieces = ["▁", "1", "2", "3", "{", "}", '"', ":", "n", "12", "123", "▁{", '":', "é"] + ["<0xZZ>", "<0x>"] * odd
    for piece in pieces:
        vocab[piece] = len(vocab)
    merges = [("1", "2"), ("12", "3"), ("▁", "{"), ('"', ":")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if decoder == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Fuse() if decoder == "fuse" else decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()


TOKENIZERS = {  # name: (tokenizer.json, the model's vocabulary size, the tokens a 3-digit regex starts with)
    # llguidance's reader sized its table by the count of tokens: "12" and "123" (past it) were lost
    "byte-level BPE with holes in its ids": (lambda: _byte_level(holes=True), 300, {*"0123456789", "12", "123"}),
    # a model's vocabulary smaller than the tokenizer's: llguidance refused every format ("vocab size too small")
    "byte-level BPE past the model's vocabulary": (lambda: _byte_level(), 260, {*"0123456789", "12"}),
    "byte-level BPE of 100,352 tokens": (lambda: _byte_level(size=100_352), 100_352, {*"0123456789", "12", "123"}),
    "SentencePiece byte fallback": (lambda: _sentencepiece("sequence"), 280,
                                    {*"123", "12", "123", *(f"<0x{b:02X}>" for b in b"0123456789")}),
    "SentencePiece with odd <0x..> tokens": (lambda: _sentencepiece("sequence", odd=True), 290,
                                             {*"123", "12", "123", *(f"<0x{b:02X}>" for b in b"0123456789")}),
    # these two were refused with a 400 for every format ("can't determine decoder type"); neither decoder
    # has ByteFallback, so a byte token's text is its spelling ("<0x31>", no digit), as the reply would hold it
    "Metaspace decoder": (lambda: _sentencepiece("metaspace"), 280, {*"123", "12", "123"}),
    "bare Fuse decoder": (lambda: _sentencepiece("fuse"), 280, {*"123", "12", "123"}),
}


def _allowed(matcher, vocab: int) -> set[int]:
    row = np.zeros((vocab + 31) // 32, np.int32)
    matcher.fill(row)
    return {t for t in range(vocab) if row[t // 32] >> (t % 32) & 1}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_structured_outputs_work_on_every_tokenizer_kind(name):
    """The first mask of a regular expression allows exactly the tokens whose text starts a match, and a JSON
    schema's reply, walked token by token through the masks, decodes (as the server decodes it) to the JSON."""
    from tokenizers import Tokenizer

    from torchtpu_export.llm.grammar import Grammars
    make, vocab, digits = TOKENIZERS[name]
    tokenizer_json = make()
    tok = Tokenizer.from_str(tokenizer_json)
    eos = tok.token_to_id("<eos>") if tok.token_to_id("<eos>") is not None else tok.token_to_id("</s>")
    grammars = Grammars(tokenizer_json, vocab, [eos])
    try:
        assert {tok.id_to_token(t) for t in _allowed(grammars.matcher("regex", "[0-9]{3}"), vocab)} == digits
        m = grammars.matcher("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"], "additionalProperties": False})
        want, ids = '{"n":123}', []
        while not m.stopped:
            allowed = _allowed(m, vocab)
            if eos in allowed and tok.decode(ids) == want:
                break
            texts = {t: tok.decode(ids + [t]) for t in allowed}
            fits = [t for t, text in texts.items() if want.startswith(text) and len(text) > len(tok.decode(ids))]
            assert fits, (tok.decode(ids), [tok.id_to_token(t) for t in sorted(allowed)][:20])
            ids.append(max(fits, key=lambda t: len(texts[t])))
            assert m.consume(ids[-1]) and m.error is None
        assert tok.decode(ids) == want
    finally:
        grammars.close()


def test_a_tokenizer_that_panics_is_one_input_error():
    """tokenizers panics on this normalizer (pyo3's PanicException, a BaseException): one InputError, no panic."""
    import json

    from torchtpu_export.llm.grammar import Grammars
    broken = json.loads(_byte_level())
    broken["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAA"}
    with pytest.raises(InputError, match="structured outputs cannot use this model's tokenizer") as e:
        Grammars(json.dumps(broken), 300, [2])
    assert "\n" not in str(e.value)


def test_a_panic_in_a_step_ends_the_reply_with_its_error():
    """A matcher whose llguidance panics mid-reply: an empty row and an error (the engine ends that request
    with a 400), never a BaseException through the engine's step."""
    from torchtpu_export.llm.grammar import Matcher

    class PanicException(BaseException):  # pyo3's, as llguidance raises it
        pass

    class Panicking:
        def compute_bitmask(self, *token):
            raise PanicException("index out of bounds: the len is 9 but the index is 14")
        consume_token = compute_bitmask

        def is_stopped(self):
            return False

    m = Matcher(None, None, Panicking())
    row = np.full(4, -1, np.int32)
    m.fill(row)
    assert not row.any() and "index out of bounds" in m.error and not m.stopped
    assert m.consume(3) is False


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     "additionalProperties: false on every object; the schema's root"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}},
                                             "additionalProperties": False}},
      "required": ["a"], "additionalProperties": False}, "#/properties/a does not require 'b'"),
    ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {},
                                                              "additionalProperties": True}]}},
     "#/items/anyOf/1 has additionalProperties: true"),
    ({"$defs": {"p/q": {"type": "object"}}, "$ref": "#/$defs/p~1q"}, "#/\\$defs/p~1q has none"),
])
def test_strict_json_schemas_are_refused_as_openai_refuses_them(schema, says):
    from torchtpu_export.llm.grammar import format_of
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    with pytest.raises(InputError, match=says):
        format_of(strict)
    assert format_of(dict(strict, json_schema=dict(strict["json_schema"], strict=False))) == ("json_schema", schema)
    with pytest.raises(InputError, match="strict is a boolean"):
        format_of(dict(strict, json_schema=dict(strict["json_schema"], strict="yes")))
    ok = {"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"],
          "additionalProperties": False}
    assert format_of(dict(strict, json_schema={"name": "s", "schema": ok, "strict": True})) == ("json_schema", ok)


def _png(width: int, height: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return buf.getvalue()


VISION = {"height": 16, "width": 16, "resample": "bilinear"}


def test_images_are_refused_by_their_decoded_size_before_decoding():
    from torchtpu_export.images import MAX_IMAGE_DECODED, ImageWorkers, open_image
    thin = _png(1, 64 << 20)  # 1 x 67,108,864: within the pixel bound, 192 MiB once RGB
    assert len(thin) < 200_000
    with pytest.raises(InputError, match="decodes to"):
        open_image(thin, "thin.png")
    workers = ImageWorkers(workers=1)
    try:
        with pytest.raises(InputError, match=f"more than {MAX_IMAGE_DECODED:,}"):
            asyncio.run(workers.read([(thin, "messages[0].content[0]")], VISION))
        # several images within the per-image bound, past the per-request one together
        big = _png(8000, 6000)
        with pytest.raises(InputError, match="together"):
            asyncio.run(workers.read([(big, f"part {k}") for k in range(3)], VISION))
        ok = asyncio.run(workers.read([(_png(40, 30), "small")], VISION))
        assert ok[0].shape == (16, 16, 3) and ok[0].dtype == np.float32
    finally:
        workers.close()


def test_a_slow_image_is_stopped_at_its_time_budget_and_others_decode_meanwhile():
    """A JPEG that decodes for seconds is stopped at the budget (its worker killed and replaced); while it
    decodes, another request's image decodes in the other worker; the same pixels as in-process decoding."""
    from torchtpu_export.images import ImageWorkers, read_images
    slow = _scans_jpeg(4096, 3000)
    assert len(slow) < 300_000
    small = _png(40, 30)
    workers = ImageWorkers(workers=2, time_budget=1.0)

    async def both():
        return await asyncio.gather(workers.read([(slow, "slow.jpg")], VISION),
                                    _timed(workers.read([(small, "small.png")], VISION)), return_exceptions=True)
    try:
        start = time.monotonic()
        stopped, (fine, seconds) = asyncio.run(both())
        assert isinstance(stopped, InputError) and "slow.jpg" in str(stopped) and "took longer" in str(stopped)
        assert seconds < time.monotonic() - start  # answered before the slow one was stopped
        assert np.array_equal(fine[0], read_images([(small, "small.png")], VISION)[0])
        again = asyncio.run(workers.read([(small, "small.png")], VISION))  # a replacement worker answers
        assert np.array_equal(again[0], fine[0])
    finally:
        workers.close()


async def _timed(work):
    start = time.monotonic()
    out = await work
    return out, time.monotonic() - start


def test_image_files_are_read_only_when_regular(tmp_path):
    import os
    from torchtpu_export.images import open_image
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        open_image(str(fifo), str(fifo))


def test_tool_calls_are_read_in_linear_time_and_only_for_declared_tools():
    from torchtpu_export.server.openai import tool_calls
    start = time.monotonic()
    calls, text = tool_calls("<tool_call>" + " " * 200_000 + "x", {"f"})  # the regex took minutes on 4,000
    assert calls == [] and len(text) == 200_012 and time.monotonic() - start < 5
    reply = ('hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> and '
             '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
             '<tool_call>' + "[" * 5000 + "]" * 5000 + '</tool_call> bye')
    calls, text = tool_calls(reply, {"f"})
    assert [c["function"]["name"] for c in calls] == ["f"] and calls[0]["function"]["arguments"] == '{"a": 1}'
    assert text.startswith("hi  and <tool_call>{\"name\": \"rm_rf\"") and text.endswith("</tool_call> bye")
    assert "not json" in text
