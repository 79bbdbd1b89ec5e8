"""The examples, and the models they, the tests and the benchmarks build (``zoo``, ``hf_llms``).

Each example is a script: ``cd examples && python demo.py``. Code outside examples/ imports the zoo as
``from examples import zoo`` (benchmarks and tools, run as ``python -m benchmarks.NAME`` from the
repository root); the tests import it as ``zoo`` (pyproject.toml's pytest ``pythonpath``).
"""
