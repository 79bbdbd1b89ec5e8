"""Structured outputs on device: a ``.litertlm`` bundle generates through LiteRT-LM's own constrained decoding
(llguidance, the LL_GUIDANCE provider) with ``generate(..., response_format=...)`` and ``torchtpu-export run
--json-schema FILE`` / ``--regex PATTERN``. The tiny models have random weights, so their free text is
gibberish: a reply that parses and validates does so because the grammar made it.

LiteRT-LM hands llguidance the tokens' spellings, not their bytes (google-ai-edge/LiteRT-LM#3510): with these
byte-level BPE tokenizers a space is spelled ``Ġ``, a control byte a letter such as ``ă``. So the schemas here
give their strings a ``pattern`` (a free string of a random model takes control bytes, which no JSON reader
takes), and a format that requires a space is the dead end the last tests show."""
import importlib.util
import json
import re
import shutil

import jsonschema
import pytest

import hf_llms
import torchtpu_export as tte
from conftest import run_cli, run_cli_many
from torchtpu_export.errors import InputError

pytestmark = pytest.mark.xdist_group("llm")  # one worker, as test_llm_bundles: the folders and bundles are shared

PROMPT = "the quick brown fox"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
CODE = "[0-9]{3}-[a-z]{2}"
STEPS = 40  # the longest reply SCHEMA allows is 31 tokens of these tokenizers (one per character at worst)
# a template that renders the tools (as Qwen's do), for the tool-call test
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}" + hf_llms.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """qwen3 (no start token; typed qwen3 for LiteRT-LM) and llama (a start token; generic) bundles."""
    root = tmp_path_factory.mktemp("structured")
    out = {}
    for arch in ("qwen3", "llama"):
        folder = hf_llms.save_folder(arch, str(root / arch))
        path = root / f"{arch}.litertlm"
        r = run_cli(folder, "--target", "litertlm", "--prefill-lengths", "16", "--cache-length", "96", "-o", path)
        assert r.returncode == 0, r.stderr
        out[arch] = path
    return out


def _person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("arch,chat", [("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)])
def test_json_schema_and_regex_replies_follow_the_format(bundles, arch, chat):
    bundle = tte.load(bundles[arch])
    free = bundle.generate(PROMPT, STEPS, chat=chat).text
    with pytest.raises(ValueError):
        json.loads(free)  # the model's own text is no JSON
    reply = bundle.generate(PROMPT, STEPS, chat=chat, response_format=PERSON)
    _person(reply.text)
    assert reply.finish_reason == "stop" and reply.ids == bundle.engine().tokenize(reply.text)
    for prompt in ("hello world", "a cache of keys"):
        reply = bundle.generate(prompt, 12, chat=chat, response_format={"type": "regex", "pattern": CODE})
        assert re.fullmatch(CODE, reply.text), reply.text
    # any JSON object: it starts as one (a random model does not close it in a few tokens)
    assert bundle.generate(PROMPT, 6, chat=chat, response_format={"type": "json_object"}).text.startswith("{")


@pytest.mark.parametrize("chat", [False, True])
def test_a_format_that_allows_everything_changes_nothing(bundles, chat):
    """A raw prompt goes through LiteRT-LM's conversation API (constrained decoding lives there only) with a
    template that renders it unchanged: the same tokens as the raw session, so the same greedy reply."""
    for arch in ("qwen3", "llama"):
        bundle = tte.load(bundles[arch])
        want = bundle.generate(PROMPT, 20, chat=chat)
        assert bundle.generate(PROMPT, 20, chat=chat, response_format={"type": "regex", "pattern": ".*"}) == want
        assert bundle.generate(PROMPT, 20, chat=chat, response_format={"type": "text"}) == want


# llguidance's Python package (the serve extra) checks a format as LiteRT-LM's copy will compile it, with
# its reason; without it LiteRT-LM's failure to compile is the check
LLGUIDANCE = importlib.util.find_spec("llguidance") is not None
NOT_COMPILED = "LiteRT-LM could not generate to the response_format"


@pytest.mark.parametrize("fmt,says,compiles", [
    ("[0-9]+", "response_format is a str", False),
    ({"type": "xml"}, "type 'xml'", False),
    ({"pattern": "a"}, "a dict without a type", False),
    ({"type": "regex"}, "the pattern is a non-empty string", False),
    ({"type": "regex", "pattern": "([a-z"}, "pattern '([a-z' is not valid: unclosed character class", True),
    ({"type": "regex", "pattern": "(?=a)b"}, "look-around", True),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "the schema is a JSON object", False),
    ({"type": "json_schema", "json_schema": {"schema": {"type": 5}}}, "JSON schema is not valid", True),
    ({"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}}, "is not JSON", False),
    ({"type": "regex", "pattern": "a" * (65 << 10)}, "at most 65,536", False),
])
def test_a_bad_response_format_is_one_input_error(bundles, fmt, says, compiles):
    bundle = tte.load(bundles["qwen3"])
    with pytest.raises(InputError) as e:
        bundle.generate(PROMPT, 8, response_format=fmt)
    assert (says if LLGUIDANCE or not compiles else NOT_COMPILED) in str(e.value) and "\n" not in str(e.value)
    if LLGUIDANCE or not compiles:
        assert bundle._engine is None  # refused before LiteRT-LM loads the bundle


def test_a_format_that_requires_a_space_is_a_dead_end_on_litert_lm(bundles):
    """LiteRT-LM's token table has no token spelled with a space (``Ġ`` stands for it): where the format
    requires one, llguidance stops the reply and LiteRT-LM fails; where it only allows one, none comes."""
    bundle = tte.load(bundles["qwen3"])
    with pytest.raises(InputError, match="LiteRT-LM#3510"):
        bundle.generate("hello", 8, response_format={"type": "regex", "pattern": "cat dog"})
    reply = bundle.generate("hello", 12, response_format={"type": "regex", "pattern": "[a-z]+( [a-z]+)?"})
    assert re.fullmatch("[a-z]+", reply.text) and reply.finish_reason == "length"
    assert bundle.generate("hello", 4).text  # the engine still answers


def test_cli_run_json_schema_and_regex(bundles, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": 5}')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"description": "x" * (65 << 10)}))
    m = tmp_path / "m.tflite"
    prelude = ("import torch, torchtpu_export as tte\n"
               "class M(torch.nn.Module):\n    def forward(self, x): return x * 2\n"
               f"tte.export(M(), (torch.ones(2),), target='litert').save({str(m)!r})\n")
    q = bundles["qwen3"]
    cases = [
        ("run", q, "--prompt", PROMPT, "--json-schema", schema, "--max-new-tokens", STEPS, "-q"),
        ("run", bundles["llama"], "--prompt", PROMPT, "--json-schema", schema, "--chat", "--max-new-tokens", STEPS,
         "-q"),
        ("run", q, "--prompt", PROMPT, "--regex", CODE, "--max-new-tokens", 12, "-q"),
        ("run", q, "--prompt", PROMPT, "--regex", "([a-z"),
        ("run", q, "--prompt", PROMPT, "--json-schema", bad),
        ("run", q, "--prompt", PROMPT, "--json-schema", listed),
        ("run", q, "--prompt", PROMPT, "--json-schema", big),
        ("run", q, "--prompt", PROMPT, "--json-schema", tmp_path / "missing.json"),
        ("run", q, "--regex", CODE),
        ("run", m, "--prompt", PROMPT, "--regex", CODE),
    ]
    rs = run_cli_many(cases, prelude=prelude)
    for r in rs[:2]:
        assert r.returncode == 0, r.stderr
        _person(r.stdout.strip())
    assert rs[2].returncode == 0 and re.fullmatch(CODE, rs[2].stdout.strip()), rs[2].stderr
    says = ["pattern '([a-z' is not valid" if LLGUIDANCE else NOT_COMPILED,
            "JSON schema is not valid" if LLGUIDANCE else NOT_COMPILED, "is JSON but not a JSON schema",
            "at most 65,536 are read", "cannot read the JSON schema", "--regex goes with --prompt",
            "holds no LLM"]
    for r, want in zip(rs[3:], says):
        assert r.returncode == 2, (want, r.stderr)
        assert want in r.stderr and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("error: ") == 1 and not r.stdout
    r = run_cli("run", q, "--prompt", PROMPT, "--regex", CODE, "--json-schema", schema)  # argparse exits
    assert r.returncode == 2 and "not allowed with argument" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tool_calls_come_back_parsed_from_a_qwen_bundle(bundles, tmp_path):
    """A Qwen bundle is typed qwen3 in its LlmMetadata: LiteRT-LM's Qwen data processor reads a reply's
    ``<tool_call>{json}</tool_call>`` into the message's ``tool_calls`` (the generic one returns it as
    text), and ModelInfo says it takes tools when the template renders them."""
    import litert_lm
    folder = tmp_path / "qwen3_tools"
    shutil.copytree(bundles["qwen3"].parent / "qwen3", folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    path = tmp_path / "tools.litertlm"
    r = run_cli(folder, "--target", "litertlm", "--prefill-lengths", "64", "--cache-length", "384", "-o", path)
    assert r.returncode == 0, r.stderr
    assert tte.load(path).metadata["model_type"] == "qwen3"
    assert tte.load(bundles["llama"]).metadata["model_type"] == "generic_model"
    with litert_lm.ModelInfo(str(path)) as info:
        assert info.llm.supports_function_calling()
    with litert_lm.ModelInfo(str(bundles["qwen3"])) as info:  # its template does not render tools
        assert not info.llm.supports_function_calling()

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    call = r'<tool_call>\{"name":"get_weather","arguments":\{"city":"[a-z]{1,6}"\}\}</tool_call>'
    decoding = litert_lm.ConstrainedDecodingConfig(enable=True,
                                                   provider=litert_lm.LiteRtLmConstraintProviderType.LL_GUIDANCE)
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        with engine.create_conversation(tools=[get_weather], automatic_tool_calling=False, max_output_tokens=120,
                                        sampler_config=litert_lm.SamplerConfig(top_k=1),
                                        constrained_decoding_config=decoding) as conv:
            assert '"name": "get_weather"' in conv.render_message_to_string("hi")
            reply = dict(conv.send_message("what is the weather?",
                                           response_format=litert_lm.ResponseFormat.regex(call)))
    finally:
        engine.close()
    (tool,) = reply["tool_calls"]
    assert tool["function"]["name"] == "get_weather"
    assert re.fullmatch("[a-z]{1,6}", tool["function"]["arguments"]["city"])
