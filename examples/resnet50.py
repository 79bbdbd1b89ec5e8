"""A ResNet-50-style CNN (bottleneck blocks [3, 4, 6, 3], width 16) to .tpu and .tflite."""
import sys

from common import single_call_example
import zoo

if __name__ == "__main__":
    model, args = zoo.resnet50(size=64)
    sys.exit(single_call_example("resnet50", "ResNet-50-style CNN (bottlenecks [3, 4, 6, 3], width 16)", model, args))
