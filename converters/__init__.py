"""Converters: one sub-package per target (stablehlo, litert, onnx). They never import runtimes."""
