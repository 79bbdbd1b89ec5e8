"""Tiny Hugging Face vision-language models saved as model folders (config.json, safetensors, tokenizer.json,
the image processor's and processor's configs), for ``torchtpu-export FOLDER --target litertlm`` and the
tests. Seeded random weights, the local BPE tokenizer of ``hf_llms`` with the family's image tokens, images
made from numbers: nothing is downloaded.

    python examples/hf_vlms.py /tmp/vlms            # one folder per family
"""
from __future__ import annotations

import os
import sys

import torch

try:
    from hf_llms import SMALL, save, tokenizer
except ModuleNotFoundError:  # imported as examples.hf_vlms (the benchmarks)
    from examples.hf_llms import SMALL, save, tokenizer

# Gemma 3's image tokens (its tokenizer's boi/eoi/image tokens) and chat template, as google/gemma-3-4b-it
# has them: an image is "<start_of_image>" in the prompt, the processor expands it to the soft tokens
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == "
    "'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_tokenizer():
    """The local tokenizer with Gemma 3's turn and image tokens (their own ids, after the trained ones)."""
    from transformers import PreTrainedTokenizerFast
    base = tokenizer(True).backend_tokenizer
    base.add_special_tokens(["<start_of_turn>", "<end_of_turn>", *GEMMA3_IMAGE_TOKENS.values()])
    return PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens=GEMMA3_IMAGE_TOKENS, chat_template=GEMMA3_TEMPLATE)


def gemma3(image_size: int = 32, seed: int = 0):
    """``(model, processor)``: a Gemma 3 VLM, a SigLIP tower of 2 layers over 8-pixel patches of a
    ``image_size`` square image (16 patches at 32), pooled to 4 image tokens."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)
    tok = gemma3_tokenizer()
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_IMAGE_TOKENS.items()}
    text = Gemma3TextConfig(**dict(SMALL, num_hidden_layers=3), vocab_size=len(tok), bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            tie_word_embeddings=False)  # a tied head of a random model repeats its input
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=image_size, patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], initializer_range=0.2, tie_word_embeddings=False,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zeros: random, so that an image changes the reply
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    images = Gemma3ImageProcessor(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    return model, Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4,
                                  chat_template=GEMMA3_TEMPLATE)


# SmolVLM's chat template (HuggingFaceTB/SmolVLM-Instruct: Idefics3), an image as "<image>"
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", "<|im_start|>"]


def idefics3(image_size: int = 32, seed: int = 0):
    """``(model, processor)``: an Idefics3 (SmolVLM) VLM, a SigLIP tower of 2 layers over 8-pixel patches of an
    ``image_size`` square image (16 patches at 32), pixel-shuffled by 2 to 4 image tokens, before a Llama; the
    image processor keeps one image whole (no tiles)."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig, PreTrainedTokenizerFast)
    base = tokenizer(False).backend_tokenizer
    base.add_special_tokens(IDEFICS3_TOKENS[:4])
    tok = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<end_of_utterance>", pad_token="<pad>",
                                  chat_template=IDEFICS3_TEMPLATE)
    text = LlamaConfig(**SMALL, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=0,
                       bos_token_id=None, tie_word_embeddings=False)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=image_size, patch_size=8, initializer_range=0.2)
    config = Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                            pad_token_id=0)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    images = Idefics3ImageProcessor(size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                                    do_image_splitting=False)
    return model, Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                    chat_template=IDEFICS3_TEMPLATE)


FAMILIES = {"gemma3": gemma3, "idefics3": idefics3}


def image(seed: int, size: int = 32):
    """An RGB test image (uint8 ``[size, size, 3]``): smooth gradients and a seeded pattern."""
    import numpy as np
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, (x + y) / 2], -1) * 255 * rng.uniform(0.3, 1.0, 3)
    return np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)


def save_image(path: str, seed: int, size: int = 32) -> str:
    """``image(seed)`` written as a PNG at ``path``."""
    from PIL import Image
    Image.fromarray(image(seed, size)).save(path)
    return path


def save_folder(name: str, path: str, seed: int = 0) -> str:
    """Writes family ``name`` as a Hugging Face model folder at ``path`` (model, tokenizer, processor)."""
    return save(*FAMILIES[name](seed=seed), path)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for family in sys.argv[2:] or list(FAMILIES):
        print(save_folder(family, os.path.join(sys.argv[1], family)))
