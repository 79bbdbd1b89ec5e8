"""A Llama-style decoder: prefill + decode signatures in one .tflite and one .tpu, greedy tokens vs eager."""
import sys

import torch

from common import decoder_example
import zoo

if __name__ == "__main__":
    model, (tokens,) = zoo.llama(seq=12)
    sys.exit(decoder_example("llama", "Llama-style decoder (" + zoo.llama.__doc__.split("(", 1)[-1].rstrip(".)") + ")",
                             model, tokens, steps=8))
