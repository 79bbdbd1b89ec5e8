"""Hugging Face transformers models built from small configs (no downloads), to .tpu and .tflite.

    python examples/hf_transformers.py                 # all models, both targets
    python examples/hf_transformers.py llama bert vit  # a subset

Needs the `hf` extra (`pip install -e '.[hf]'`; `make test` installs it). Weights are random (seeded):
the point is that the architectures convert and agree with eager, not what they predict.
"""
from __future__ import annotations

import sys

import torch

from common import check_outputs, convert_both, report
import torchtpu_export as tte


class Head(torch.nn.Module):
    """A HF model as a plain function of tensors: no cache, one named output."""

    def __init__(self, model, output: str, **call_kwargs):
        super().__init__()
        self.model, self.output, self.call_kwargs = model, output, call_kwargs

    def forward(self, *args):
        return self.model(*args, return_dict=True, **self.call_kwargs)[self.output]


def _decoder(config_cls, model_cls, **config):
    cfg = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=2, **config)
    return Head(model_cls(cfg), "logits", use_cache=False), (torch.randint(0, 256, (1, 16)),)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _decoder(LlamaConfig, LlamaForCausalLM)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _decoder(Qwen2Config, Qwen2ForCausalLM)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=16)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    return Head(GPT2LMHeadModel(cfg), "logits", use_cache=False), (torch.randint(0, 256, (1, 16)),)


def bert():
    from transformers import BertConfig, BertModel
    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 10:] = 0
    return Head(BertModel(cfg), "last_hidden_state"), (torch.randint(0, 256, (2, 16)), mask)


def vit():
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, num_channels=3)
    return Head(ViTModel(cfg), "last_hidden_state"), (torch.randn(1, 3, 32, 32),)


def whisper_encoder():
    from transformers import WhisperConfig, WhisperModel
    cfg = WhisperConfig(vocab_size=256, num_mel_bins=16, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                        decoder_layers=1, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_source_positions=32, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    return Head(WhisperModel(cfg).get_encoder(), "last_hidden_state"), (torch.randn(1, 16, 64),)


MODELS = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "gpt2": gpt2, "bert": bert, "vit": vit,
          "whisper_encoder": whisper_encoder}


def main(names) -> int:
    failed = []
    for name in names:
        torch.manual_seed(0)
        model, args = MODELS[name]()
        model.eval()
        rows = convert_both(f"hf_{name}", lambda target: tte.export(model, args, target=target),
                            lambda art, target: art(*args), check_outputs(model, args, rtol=1e-5))
        if report(f"\ntransformers {name}: inputs {', '.join(str(tuple(a.shape)) for a in args)}", rows):
            failed.append(name)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(MODELS)
    unknown = [n for n in chosen if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    sys.exit(main(chosen))
