"""The conversation is part of the contract: with chat templates written in the ways public templates are
(``set tools = none`` defaults and ``is not none`` tests, ``.get()``, ``raise_exception``, ``strftime_now``,
``tojson(indent=4)`` tool sections, a BOS written by the template or not, system prompts folded into the first
turn, ``.split``/``.strip``/``.startswith``, namespaces), a tiny decoder exported with its template gives, in
LiteRT-LM's conversation API and in the server's text workers, the token ids transformers'
``apply_chat_template`` gives, checked by the export itself (its probe conversations) and again here on the
files, with the greedy reply transformers' ``generate`` gives; a template LiteRT-LM cannot render alike is
refused at export, naming the construct and its line."""
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from conftest import run_cli_many
from torchtpu_export.llm.chat import PROBES, ChatTemplateError

pytestmark = pytest.mark.xdist_group("chat_templates")

TEMPLATES = hf_llms.STYLE_TEMPLATES
NO_BOS = TEMPLATES["no_bos"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama of the byte-level BPE tokenizer (its post-processor adds <bos>) saved once per template."""
    root = tmp_path_factory.mktemp("chat_templates")
    model, tok = hf_llms.build("llama")
    out = {}
    for name, template in TEMPLATES.items():
        tok.chat_template = template
        folder = root / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = folder
    return root, model, out


def _reference(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def _chat_ids(tok, messages, tools=None) -> list:
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_litert_lm_and_the_text_workers_render_as_transformers(folders, name):
    """The bundle's export checked its probes in LiteRT-LM; the file as written and loaded gives them again, and
    so do text workers started as a server starts them for this tokenizer (a .tpu export of each style is the
    family tests': test_llm_tpu); LiteRT-LM's greedy chat reply is transformers'."""
    from torchtpu_export.llm.text import LlmTokenizer
    from torchtpu_export.llm.textproc import TextWorkers
    root, model, made = folders
    folder = made[name]
    bundle = tte.export_llm(str(folder), target="litertlm", prefill_lengths=(32,), cache_length=256)
    tok = _reference(folder)
    uses_tools = "tools" in TEMPLATES[name]
    chat = bundle.llm_check["chat"]
    want = [p for p, _, tools in PROBES if not tools or uses_tools]
    assert chat["probes"] + chat["refused"] and sorted(chat["probes"] + chat["refused"]) == sorted(want), chat
    bundle.save(root / f"{name}.litertlm")
    engine = tte.load(root / f"{name}.litertlm").engine()
    ours = LlmTokenizer.from_dir(str(folder))
    served = TextWorkers(ours.json.encode(), template=ours.chat_template, bos_id=ours.bos_id, eos_id=ours.stop_ids[0],
                         max_chars=8192, workers=1, specials=ours.specials)
    try:
        for probe, messages, tools in PROBES:
            if tools and not uses_tools:
                continue
            try:
                want = _chat_ids(tok, messages, tools)
            except Exception:  # noqa: BLE001 - the template refuses it (a system role it does not take)
                continue
            assert engine.conversation_ids(messages, tools) == want, (name, probe)
            assert served.run("chat", messages, tools) == want, (name, probe)
    finally:
        served.close()
    # greedy replies to a user message, as transformers' generate gives on its ids
    messages = [{"role": "user", "content": "Hello! What can you do?"}]
    ids = _chat_ids(tok, messages)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    text = tte.load(root / f"{name}.litertlm").generate(messages[0]["content"], 6, chat=True).text
    assert text == tok.decode(greedy), (text, tok.decode(greedy))  # LiteRT-LM writes special tokens out


def test_a_raw_prompt_keeps_the_tokenizers_bos_on_litert_lm(folders):
    """The bundle carries no start token (its template writes the chat's BOS); a raw prompt is prefilled after
    the BOS the tokenizer's post-processor adds, as ``tokenizer(prompt)`` gives it."""
    root, model, made = folders
    path = root / "no_bos.litertlm"
    if not path.exists():
        tte.export_llm(str(made["no_bos"]), target="litertlm", prefill_lengths=(32,), cache_length=256).save(path)
    tok = _reference(made["no_bos"])
    ids = tok("the quick brown fox")["input_ids"]
    assert ids[0] == tok.bos_token_id
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert tte.load(path).generate("the quick brown fox", 6).text == tok.decode(greedy)


def test_a_template_litert_lm_renders_otherwise_is_refused_naming_the_construct(folders, tmp_path):
    """Loop controls: LiteRT-LM's engine has none (it cannot even load the template); the export refuses,
    naming the construct and its line, and --chat-template supplies one that renders alike."""
    root, model, made = folders
    template = ("{%- for message in messages %}\n{%- if message['role'] == 'system' %}{% continue %}{% endif %}\n"
                "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
                "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(ChatTemplateError, match=r"\{% continue %\} \(line 2\)"):
        tte.export_llm(str(made["no_bos"]), target="litertlm", prefill_lengths=(32,), cache_length=256,
                       chat_template=template)
    plain = tmp_path / "plain.jinja"
    plain.write_text(NO_BOS)
    bad = tmp_path / "loops.jinja"
    bad.write_text(template)
    refused, taken = tmp_path / "refused.litertlm", tmp_path / "taken.litertlm"
    r, ok = run_cli_many([[made["headers"], "--target", "litertlm", "--prefill-lengths", "32", "--cache-length", "256",
                           "--chat-template", template, "-o", out] for template, out in ((bad, refused),
                                                                                         (plain, taken))])
    assert r.returncode == 2 and "continue" in r.stderr and "--chat-template" in r.stderr and not refused.exists(), \
        r.stderr
    assert ok.returncode == 0 and "chat: 3 probe conversations rendered by LiteRT-LM" in ok.stdout, ok.stderr


def test_the_rewrite_keeps_text_and_strings_and_rewrites_only_tags():
    from torchtpu_export.targets.litertlm.chat import litert_template, unsupported
    source = ("x is none {{ a.get('b', 'is none') }}{% if c is not none %}.strip(){% endif %}"
              "{{ ', '.join(xs) }}{{ d | tojson(indent=2) }}\n")
    out = litert_template(source, {"bos_token": "<s>"}, parts=False)
    body = out[out.index("{{ '' }}") + len("{{ '' }}"):]
    assert body == ("x is none {{ (a['b'] | default('is none')) }}{% if c != none %}.strip(){% endif %}"
                    "{{ (xs | join(', ')) }}{{ (_tte_tojson(d, 2)) }}")
    assert '{%- set bos_token = "<s>" %}' in out
    assert unsupported("{{ '%d' % 3 }}\n{{ x.format(1) }}") == ["'...' % ... formatting (line 1)", ".format() (line 2)"]


def test_a_sentencepiece_tokenizer_of_100k_tokens_chats_as_transformers_on_both_targets(tmp_path):
    """A SentencePiece-style tokenizer (``▁`` prepended to the text's start, byte fallback, <bos> from the
    post-processor) of 100,000 tokens with a Mistral-style template: the rendered text tokenized as one piece, as
    transformers does (a start token in the bundle made LiteRT-LM tokenize the text after it alone, with a
    leading ``▁``), on both targets; LiteRT-LM's greedy chat reply is transformers'."""
    tok = hf_llms.sentencepiece_tokenizer(100_000)
    tok.chat_template = TEMPLATES["alternating"]
    torch.manual_seed(0)
    model = hf_llms.llama(tok).eval()
    folder = tmp_path / "sp"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    bundle = tte.export_llm(str(folder), target="litertlm", prefill_lengths=(32,), cache_length=128)
    program = tte.export_llm(str(folder), target="tpu", prefill_lengths=(32,), cache_length=128, batch_size=1,
                             platforms=("cpu",))
    assert bundle.llm_check["chat"]["probes"] and program.llm_check["chat"]["probes"]
    reference = _reference(folder)
    messages = [{"role": "user", "content": "hello world, the quick brown fox"}]
    ids = _chat_ids(reference, messages)
    assert bundle.engine().conversation_ids(messages) == ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert bundle.generate(messages[0]["content"], 6, chat=True).text == reference.decode(greedy)
    assert program.generate(messages[0]["content"], 6, chat=True).ids == greedy
