"""Tiny Hugging Face causal LMs saved as model folders (config.json, safetensors, tokenizer.json), for
``torchtpu-export FOLDER --target litertlm`` and the tests. Seeded random weights, a BPE tokenizer
trained here on a few sentences: nothing is downloaded.

    python examples/hf_llms.py /tmp/llms            # one folder per architecture
    python examples/hf_llms.py /tmp/llms qwen3 llama
"""
from __future__ import annotations

import os
import sys

import torch

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny language model",
          "tokens are made locally from a small corpus of text", "on device models run on phones and in browsers",
          "a cache of keys and values makes decoding fast"]
SPECIALS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
# a chat template in the ChatML style Qwen uses; models whose tokenizer starts with <bos> render it first, as
# Llama 3's and Gemma's templates do (LiteRT-LM puts the start token first itself, and renders bos_token empty)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Chat templates written the ways public ones are (the constructs, not their text). Llama 3's way: the template writes the BOS, defaults tools to none and tests `is not none`, puts the date in,
# folds the system message into its header, and writes tools as indented JSON
HEADERS = (
    "{{- bos_token }}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = strftime_now('%d %b %Y') if strftime_now is defined else '26 Jul 2024' %}\n"
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = '' %}\n{%- endif %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if tools is not none %}\n    {{- 'Environment: tools\\n' }}\n{%- endif %}\n"
    "{{- 'Today: ' + date_string + '\\n\\n' }}\n"
    "{%- if tools is not none %}\n    {{- 'Call a function as JSON:\\n' }}\n"
    "    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- '\\n\\n' }}\n    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n{{- '<|im_end|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Mistral's way: roles must alternate (raise_exception), the system prompt goes into the last user turn, tools
# only where they are given (`is not none`), the EOS after each assistant turn
ALTERNATING = (
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if tools is not none and loop.last %}\n"
    "            {{- '[TOOLS]' + tools | tojson + '[/TOOLS]' }}\n        {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n            {{- '[INST]' + message['content'] + '[/INST]' }}\n        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n        {{- message['content'] + eos_token }}\n"
    "    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported!') }}\n"
    "    {%- endif %}\n{%- endfor %}\n")

# Phi's way: no BOS written (the tokenizer's post-processor adds one to plain text; a chat has none)
NO_BOS = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

# Gemma's way: .get() on messages, role names mapped, the system prompt folded into the first user turn,
# content as a string or as parts
GETS = (
    "{{ bos_token }}"
    "{%- set first = messages[0] -%}"
    "{%- if first.get('role') == 'system' -%}{%- set prefix = first.get('content', '') + '\\n\\n' -%}"
    "{%- set messages = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = {'assistant': 'model'}.get(message.get('role'), message.get('role')) -%}"
    "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}"
    "{%- if message.get('content') is string -%}{{ message.get('content') | trim }}"
    "{%- else -%}{%- for part in message.get('content', []) -%}{%- if part.get('type') == 'text' -%}"
    "{{ part.get('text') | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<end_of_turn>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}")

# Qwen 3's way: a namespace walking the history backwards, string methods on contents, tools in the system turn
METHODS = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- '# Tools\\n<tools>' }}\n    {%- for tool in tools %}\n        {{- '\\n' }}\n"
    "        {{- tool | tojson }}\n    {%- endfor %}\n    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(last_query=messages | length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages | length - 1) - loop.index0 %}\n"
    "    {%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}\n"
    "        {%- set ns.last_query = index %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

STYLE_TEMPLATES = {"headers": HEADERS, "alternating": ALTERNATING, "no_bos": NO_BOS, "gets": GETS,
                   "methods": METHODS}
# the style of each family's published template
FAMILY_TEMPLATES = {"llama": HEADERS, "mistral": ALTERNATING, "phi3": NO_BOS, "gemma3": GETS, "qwen3": METHODS,
                    "qwen2": METHODS}

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)


def tokenizer(add_bos: bool = True, vocab: int = 320):
    """A byte-level BPE tokenizer (transformers' fast tokenizer), with or without a leading <bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   chat_template=("{{ bos_token }}" if add_bos else "") + CHAT_TEMPLATE)


def large_tokenizer(vocab: int = 262_144, seed: int = 0):
    """A byte-level BPE tokenizer of ``vocab`` tokens, as large as real ones (262,144 tokens make a 32 MB
    tokenizer.json; Gemma 3's is 33 MB), built without training: the bytes, then pseudo-words of 3 to 30
    letters or byte-level characters, each prefix of one a token, many with a second merge to it."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    wide = [c for c in alphabet if ord(c) > 127]  # other scripts' UTF-8 bytes, as byte-level BPE spells them
    tok = Tokenizer(_pseudo_bpe(SPECIALS + alphabet, vocab, "Ġ", wide, seed))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def sentencepiece_tokenizer(vocab: int = 100_000, seed: int = 0):
    """A SentencePiece-style BPE tokenizer of ``vocab`` tokens, as Llama 2's, Mistral's and Gemma's converted
    ones are: words marked with ``▁`` (prepended to the text's start only), byte fallback (``<0x00>`` ...
    ``<0xFF>``), a decoder that strips the first space, and <bos> put first by its post-processor."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    base = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list("abcdefghijklmnopqrstuvwxyz,.!?'")
    tok = Tokenizer(_pseudo_bpe(base, vocab, "▁", [], seed, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def _pseudo_bpe(base: list, vocab: int, space: str, wide: list, seed: int, **options):
    """A BPE model of ``vocab`` tokens: ``base``, then pseudo-words of 3 to 30 letters (or of ``wide``
    characters), half of them starting with ``space``, each prefix of one a token, many with a second merge."""
    import random
    from tokenizers import models
    ids = {t: i for i, t in enumerate(base)}
    merges, rng = [], random.Random(seed)
    while len(ids) < vocab:
        chars = wide if wide and rng.random() < 0.4 else "abcdefghijklmnopqrstuvwxyz"
        word = (space if rng.random() < 0.5 else "") + "".join(rng.choice(chars) for _ in range(rng.randint(3, 30)))
        for k in range(2, len(word) + 1):
            if word[:k] not in ids and len(ids) < vocab:
                merges.append((word[:k - 1], word[k - 1]))
                if k > 2 and word[k - 2:k] in ids:
                    merges.append((word[:k - 2], word[k - 2:k]))
                ids[word[:k]] = len(ids)
    return models.BPE(vocab=ids, merges=merges, **options)


def _ids(tok):
    return dict(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**SMALL, **_ids(tok), rope_theta=500000.0))


def qwen2(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, **_ids(tok), tie_word_embeddings=True))


def qwen3(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, **_ids(tok), head_dim=32, tie_word_embeddings=True))


def gemma3(tok):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**dict(SMALL, num_hidden_layers=3), **_ids(tok), head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg)


def phi3(tok):
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**SMALL, **_ids(tok)))


def mistral(tok):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**SMALL, **_ids(tok), sliding_window=12))


def smollm(tok):  # SmolLM is a Llama with tied embeddings
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**SMALL, **_ids(tok), tie_word_embeddings=True))


# architecture -> (model builder, whether its tokenizer puts <bos> first)
MODELS = {"llama": (llama, True), "qwen2": (qwen2, False), "qwen3": (qwen3, False), "gemma3": (gemma3, True),
          "phi3": (phi3, True), "mistral": (mistral, True), "smollm": (smollm, False)}

# mixture-of-experts families (transformers' grouped_mm experts): 2 layers of 4 experts, 2 routed per token
MOE_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)
MOE_FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=128,
                      head_dim=16),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, intermediate_size=128),
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    # attention sinks, a router bias, expert biases and a clamped SwiGLU; sliding (8 positions) and full layers
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
}


# hybrid and recurrent families (a state-space, linear-attention or short-convolution layer and an attention
# layer, or recurrent layers alone): 2 layers, small state heads, chunked scans of 8
HYBRID_FAMILIES = {
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8,
                             shared_intermediate_size=64, intermediate_size=64),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=8,
                      head_dim=16, intermediate_size=128),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8,
                  intermediate_size=128),
    # a feed-forward layer between (no cache, no state), as Nemotron-H's published patterns have
    "nemotron_h": dict(layers_block_type=["mamba", "mlp", "attention"], num_hidden_layers=3, mamba_num_heads=8,
                       mamba_head_dim=16, ssm_state_size=16, chunk_size=8, n_groups=1, head_dim=16,
                       intermediate_size=128),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16,
                       intermediate_size=128),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, intermediate_size=128,
                 initializer_range=0.1),  # at 0.02 its greedy reply is one token repeated
    "mamba": dict(state_size=8, conv_kernel=4, expand=2, time_step_rank=8, initializer_range=0.3,
                  rescale_prenorm_residual=False),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, chunk_size=8, n_groups=1),
}


def moe(kind: str, seed: int = 0, **extra):
    """``(model, tokenizer)``: a tiny model of a transformers family by its ``model_type`` (the shapes of
    ``MOE_FAMILIES`` or ``HYBRID_FAMILIES`` for theirs, ``extra`` on top), seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tok = tokenizer()
    config = AutoConfig.for_model(kind, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **{**MOE_SMALL, **MOE_FAMILIES.get(kind, {}), **HYBRID_FAMILIES.get(kind, {}),
                                     **extra})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval(), tok


# TinyLlama-1.1B's shape (22 layers, hidden 2048, GQA 32:4): the ~1B model of the LLM benchmark
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, max_position_embeddings=2048, vocab_size=32000)


def save_llama_folder(path: str, config: dict, seed: int = 0) -> str:
    """A Llama of ``config``'s shape with seeded random weights (normal, std 0.02; norms 1), written as a
    model folder with the local tokenizer. Built on the meta device and filled in place: one copy."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tokenizer(True)
    cfg = LlamaConfig(**{**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, 0.02, generator=gen)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build(name: str, seed: int = 0):
    """``(model, tokenizer)`` for architecture ``name``, seeded."""
    make, add_bos = MODELS[name]
    tok = tokenizer(add_bos)
    torch.manual_seed(seed)
    return make(tok).eval(), tok


def save(model, tok, path: str) -> str:
    """``model`` and its tokenizer (or processor) written as a Hugging Face model folder at ``path``."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_folder(name: str, path: str, seed: int = 0, chat_template: str | None = None) -> str:
    """Writes architecture ``name`` as a Hugging Face model folder at ``path`` (with ``chat_template`` in place of
    the ChatML one)."""
    model, tok = build(name, seed)
    if chat_template is not None:
        tok.chat_template = chat_template
    return save(model, tok, path)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arch in sys.argv[2:] or list(MODELS):
        print(save_folder(arch, os.path.join(sys.argv[1], arch)))
