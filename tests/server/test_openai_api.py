"""What serving users expect of the API, checked with the official `openai` client against `torchtpu-export
serve` on a tiny random-weight model: structured outputs (JSON schemas validated with `jsonschema`, regular
expressions, choices, grammars), logprobs equal to transformers' log-softmax, n > 1 and best_of with seeds,
penalties, min_tokens and logit_bias as transformers' logits processors give them, several stop token ids,
and a tool call round trip through a Qwen-style chat template; bad combinations get one 400."""
import json
import re

import jsonschema
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from serving_harness import Server, _openai

pytestmark = pytest.mark.xdist_group("serving_api")

# a Qwen-style template (ChatML, tools in the system turn, <tool_call> JSON, tool results as <tool_response>)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\nAnswer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>."
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

PROMPT = "hello world, this is a tiny language model"

# 30 schemas of the kinds applications send: objects, enums, arrays, nesting, numbers, with bounds that a
# random-weight model reaches (its free text never ends a string of its own accord)
S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "boolean"}},
                                            "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "boolean"},
    {"enum": ["yes", "no", 1, None]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                                      "y": {"type": "number", "minimum": -5, "maximum": 5}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "object", "properties": {"ok": {"const": True}, "id": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["ok", "id"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                                                "minItems": 2, "maxItems": 2}},
     "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"first": S, "last": S},
                                               "required": ["first", "last"], "additionalProperties": False},
                                      "admin": {"type": "boolean"}},
     "required": ["user", "admin"], "additionalProperties": False},
    {"type": "string", "enum": ["alpha", "beta", "gamma", "delta"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 999}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "null"},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": 0, "maximum": 1},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temp", "unit"], "additionalProperties": False},
    {"type": "string", "maxLength": 4, "minLength": 2},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": [True, False]}}, "required": ["answer"],
     "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x"]}],
     "items": False, "minItems": 2},
    {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-c]{3}$"}}, "required": ["k"],
     "additionalProperties": False},
    {"type": "integer", "enum": [3, 5, 7]},
    {"type": "object", "properties": {"a": S, "b": S, "c": S}, "required": ["a", "b", "c"],
     "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"],
                "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "dog"}, "loud": {"type": "boolean"}},
                "required": ["kind", "loud"], "additionalProperties": False}]},
    {"type": "number", "enum": [1, 1.5, 2]},
    {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "note": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["level", "note"], "additionalProperties": False},
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tok = hf_llms.build("qwen3")
    tok.chat_template = TOOLS_TEMPLATE
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(16, 64), cache_length=512, batch_size=4,
                          platforms=("cpu",))
    path = tmp_path_factory.mktemp("api") / "tiny-qwen.tpu"
    prog.save(path)
    server = Server(path)
    yield model, tok, _openai(server), server
    server.close()


def _ids(client, ids, n, **kw):
    """The reply's token ids (logprobs naming tokens by id, vLLM's return_tokens_as_token_ids)."""
    extra = dict(kw.pop("extra_body", None) or {}, return_tokens_as_token_ids=True)
    r = client.completions.create(model="tiny-qwen", prompt=ids, max_tokens=n, logprobs=0, extra_body=extra,
                                  **dict(dict(temperature=0), **kw))
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens], r


def _greedy(model, ids, n, **processors):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **processors)[0, len(ids):]
    return out.tolist()


def test_thirty_json_schemas_give_replies_that_validate(served):
    _, _, client, _ = served
    for i, schema in enumerate(SCHEMAS):
        r = client.chat.completions.create(
            model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}], max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)  # parses, and validates
        assert r.choices[0].finish_reason == "stop", (i, text)
    # any JSON object: keys and strings have no bound, so a random model may run out of tokens first (OpenAI's
    # JSON mode says the same); what it writes is an object's beginning, and a finished one parses
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=60, temperature=0.7, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_strict_schemas_follow_openai_rules(served):
    """``"strict": true`` as OpenAI defines it: every object closed (``additionalProperties: false``) and each
    of its properties required, else one 400 naming the subschema; without strict the same schema is taken."""
    import openai
    _, _, client, _ = served
    inner = {"type": "object", "properties": {"c": {"type": "boolean"}}}
    loose = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": inner},
             "required": ["a", "b"]}
    closed = dict(loose, additionalProperties=False)
    refused = [(loose, "additionalProperties: false on every object; the schema's root (#) has none"),
               (closed, "#/properties/b has none"),
               (dict(closed, properties=dict(loose["properties"], b=dict(inner, additionalProperties=False))),
                "#/properties/b does not require 'c'")]
    for schema, says in refused:
        with pytest.raises(openai.BadRequestError, match=re.escape(says)):
            client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                                               "name": "s", "schema": schema, "strict": True}})
    r = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=4, temperature=0, response_format={
                                           "type": "json_schema", "json_schema": {"name": "s", "schema": loose}})
    assert r.choices[0].message.content.startswith("{")


def test_regex_choice_and_grammar_constraints_hold(served):
    _, _, client, _ = served
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=10, temperature=1.0, seed=seed,
                                           extra_body={"guided_choice": ["red", "green", "blue"]})
        assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'start: "ab" ("c" | "d") "!"'})
    assert r.choices[0].text in ("abc!", "abd!")


def test_logprobs_equal_transformers_log_softmax(served):
    model, tok, client, _ = served
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="tiny-qwen", prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    with torch.no_grad():
        seq = _greedy(model, ids, 6)
        ref = torch.log_softmax(model(torch.tensor([ids + seq])).logits[0].float(), -1)[len(ids) - 1:-1]
    assert [int(t.split(":")[1]) for t in lp.tokens] == seq
    for k, t in enumerate(seq):
        assert abs(lp.token_logprobs[k] - ref[k, t].item()) < 1e-4
        top = ref[k].topk(3)
        assert sorted(lp.top_logprobs[k].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-4)
    r = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-6)  # greedy: the top one


def test_n_and_best_of_with_seeds(served):
    _, _, client, _ = served
    kw = dict(model="tiny-qwen", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # independent seeds per choice
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    best = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=8, temperature=1.0, n=1,
                                     best_of=3, seed=11)
    assert len(best.choices) == 1 and best.usage.completion_tokens >= 3  # every candidate's tokens count
    chunks = list(client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=5, temperature=1.0, n=2, seed=5, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_penalties_min_tokens_and_logit_bias_are_transformers_processors(served):
    model, tok, client, _ = served
    ids = tok(PROMPT)["input_ids"]
    cases = [({"extra_body": {"repetition_penalty": 1.7}}, {"repetition_penalty": 1.7}),
             ({"logit_bias": {"7": 12.0}}, {"sequence_bias": [[[7], 12.0]]})]
    for ours, theirs in cases:
        assert _ids(client, ids, 12, **ours)[0] == _greedy(model, ids, 12, **theirs), ours
    # presence and frequency penalties: OpenAI's rule as a transformers logits processor
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            counts = torch.zeros_like(scores)
            for t in input_ids[0, len(ids):].tolist():
                counts[0, t] += 1
            return scores - 1.5 * (counts > 0) - 1.5 * counts

    got = _ids(client, ids, 32, presence_penalty=1.5, frequency_penalty=1.5)[0]
    want = _greedy(model, ids, 32, logits_processor=LogitsProcessorList([OpenAIPenalties()]))
    assert got == want and want != _greedy(model, ids, 32)  # the penalties change the tokens, as transformers'
    # min_tokens: the end-of-sequence token is masked until then; several stop token ids end a reply
    r = client.completions.create(model="tiny-qwen", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"min_tokens": 12, "stop_token_ids": [2, 99]})
    assert r.usage.completion_tokens == 12
    plain = _greedy(model, ids, 12)
    r = client.completions.create(model="tiny-qwen", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [plain[3]]})
    assert r.usage.completion_tokens == plain.index(plain[3]) and r.choices[0].finish_reason == "stop"


def test_tool_call_round_trip_with_a_qwen_style_template(served):
    _, _, client, _ = served
    messages = [{"role": "user", "content": "what is the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=[WEATHER], tool_choice="required",
                                       max_tokens=150, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=[WEATHER], max_tokens=8,
                                       temperature=0)  # auto: the model's own choice, rendered with the results
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    named = client.chat.completions.create(model="tiny-qwen", messages=messages[:1], tools=[WEATHER], max_tokens=150,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0.8, seed=2, stream=True)
    calls = [tc for c in named for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert calls and calls[0].function.name == "get_weather"


def test_bad_combinations_get_one_400(served):
    import openai
    _, _, client, server = served
    msgs = [{"role": "user", "content": PROMPT}]
    bad = [dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                extra_body={"guided_regex": "a+"}),
           dict(n=2, extra_body={"best_of": 3}, stream=True),
           dict(extra_body={"guided_regex": "(unclosed"}),
           dict(top_logprobs=3),
           dict(logit_bias={"99999": 5}),
           dict(tool_choice="required"),
           dict(presence_penalty=3.0),
           dict(n=99)]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            out = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=4, **kw)
            if kw.get("stream"):
                list(out)
        assert e.value.body and "message" in e.value.body, kw
    # an image to a model that takes none: refused, never answered as if the text were all
    picture = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
               {"type": "text", "text": "hi"}]
    with pytest.raises(openai.BadRequestError, match="this model takes no images"):
        client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": picture}], max_tokens=3)
    # the server is fine afterwards
    r = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=3, temperature=0)
    assert r.choices[0].message.content is not None


def test_what_the_engine_would_refuse_names_the_field_it_is_about(served):
    """A prompt's ids, its length with max_tokens and min_tokens past max_tokens: each a 400 in the engine's
    words whose param is the request's field (found from the request's fields, not from the message)."""
    import openai
    model, _, client, _ = served
    msgs = [{"role": "user", "content": PROMPT}]
    vocab = model.config.vocab_size
    for call, says, param in (
            (lambda: client.completions.create(model="tiny-qwen", prompt=[1, vocab + 5], max_tokens=2),
             "prompt token ids must be in [0, ", "prompt"),
            (lambda: client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=600),
             "do not fit the cache", "max_tokens"),
            (lambda: client.chat.completions.create(model="tiny-qwen", messages=msgs, max_completion_tokens=600),
             "do not fit the cache", "max_completion_tokens"),
            (lambda: client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=2,
                                                    extra_body={"min_tokens": 5}),
             "min_tokens must be an integer from 0 to max_new_tokens (2)", "min_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert says in e.value.body["message"] and e.value.body["param"] == param, e.value.body


def test_costly_unsatisfiable_and_conflicting_formats_get_one_400_line(served):
    """Each gets a 400 in one line, none a 500 with llguidance's state dump, and the server is fine after:
    schemas whose lexers take gigabytes, formats no text satisfies, tools with a format, GBNF grammars."""
    import openai
    _, _, client, server = served
    msgs = [{"role": "user", "content": PROMPT}]
    bad = [dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
               "type": "integer", "multipleOf": 999983}}}),
           dict(extra_body={"guided_regex": "(a{1000}){1000}"}),
           dict(extra_body={"guided_json": {"$ref": "#"}}),
           dict(extra_body={"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                            "$ref": "#/$defs/a"}}),
           dict(extra_body={"guided_regex": r"[^\s\S]"}),
           dict(tools=[WEATHER], extra_body={"guided_regex": "[a-z]+"}),  # which would win is not defined: refused
           dict(logit_bias={"\u00b2": 3}),
           dict(logit_bias={"1" * 5000: 3})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=4, **kw)
        message = e.value.body["message"]
        assert "\n" not in message and "<state>" not in message and len(message) < 600, (kw, message)
    deep = "[" * 5000 + "]" * 5000  # a tool call's arguments nested 5,000 deep in the history
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]}]
    with pytest.raises(openai.BadRequestError, match="nests"):
        client.chat.completions.create(model="tiny-qwen", messages=history, tools=[WEATHER], max_tokens=4)
    import urllib.error
    import urllib.request
    for route, body in (("chat/completions", {"messages": [{"role": "user", "content": "a\udcff"}]}),
                        ("completions", {"prompt": "a\udcff"})):  # a lone surrogate escape is no text
        request = urllib.request.Request(f"{server.url}/v1/{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=60)
        assert e.value.code == 400 and "surrogate" in json.loads(e.value.read())["error"]["message"]
    # a choice of a special token's text: written as text, or refused; never a 500
    try:
        r = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=12, temperature=0,
                                           extra_body={"guided_choice": ["<|im_end|>", "<eos>"]})
        assert r.choices[0].message.content in ("<|im_end|>", "<eos>", "")
    except openai.BadRequestError:
        pass
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "ab" ("c" | "d") "!"'})  # GBNF
    assert r.choices[0].text in ("abc!", "abd!")


def test_tiny_sampling_values_do_not_underflow_on_the_device(served):
    """top_p and repetition_penalty as small as JSON allows are legal: top_p keeps the most likely token (the
    greedy reply), a tiny penalty makes the seen tokens' logits huge; neither draws from NaN (all <pad>)."""
    model, tok, client, _ = served
    ids = tok(PROMPT)["input_ids"]
    greedy = _greedy(model, ids, 10)
    assert _ids(client, ids, 10, temperature=1.0, top_p=1e-300)[0] == greedy
    for temperature in (0, 0.7):
        got = _ids(client, ids, 10, temperature=temperature, seed=3, extra_body={"repetition_penalty": 1e-300})[0]
        assert len(got) == 10 and set(got) != {tok.pad_token_id}, got
        assert set(got) <= set(ids) | set(got[:1])  # the seen tokens' logits dominate


def test_top_logprobs_name_each_alternative_once(served):
    """Byte tokens of partial characters all read "\ufffd": they are named by their vocabulary entry, so that
    completions' top_logprobs (keyed by name) hold every alternative asked for, and chat's bytes are theirs."""
    _, tok, client, _ = served
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=20)
    lp = r.choices[0].logprobs
    assert all(len(top) == 20 for top in lp.top_logprobs), [len(top) for top in lp.top_logprobs]
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    r = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=20)
    entries = [alt for c in r.choices[0].logprobs.content for alt in c.top_logprobs]
    partial = [a for a in entries if bytes(a.bytes).decode("utf-8", "replace") != a.token]
    assert all(len(a.bytes) == 1 and a.bytes[0] >= 0x80 for a in partial), partial[:3]

