"""A Qwen3-style decoder: prefill + decode signatures in one .tflite and one .tpu, greedy tokens vs eager."""
import sys

import torch

from common import decoder_example
import zoo

if __name__ == "__main__":
    model, (tokens,) = zoo.qwen3(seq=12)
    sys.exit(decoder_example("qwen3", "Qwen3-style decoder (" + zoo.qwen3.__doc__.split("(", 1)[-1].rstrip(".)") + ")",
                             model, tokens, steps=8))
