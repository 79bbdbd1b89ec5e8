"""minGPT: learned positions, pre-LN blocks, causal attention, tied LM head; to .tpu and .tflite."""
import sys

from common import single_call_example
import zoo

if __name__ == "__main__":
    model, args = zoo.gpt(seq=32)
    sys.exit(single_call_example("mingpt", "minGPT decoder (2 layers, dim 128, vocab 512)", model, args))
