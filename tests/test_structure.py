"""The layout the docs describe holds: every target found in one place (the table in
``torchtpu_export.targets``, the same targets in docs/architecture.md), no dispatch on a target's
name elsewhere, no import circle, the core importing no target, converters and runtimes apart, and
``import torchtpu_export`` doing nothing but define names."""
import ast
import os
import re
import subprocess
import sys

from torchtpu_export import targets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> the package it installs as
PACKAGES = {"torchtpu_export": "torchtpu_export", "converters": "torchtpu_export.converters",
            "runtimes": "torchtpu_export.runtimes"}
# what converters and runtimes may rely on; it imports no target, converter, runtime or face
CORE = {"capture", "fxnodes", "errors", "specs", "treespec", "untrusted", "fileio", "safetensors_io", "tpu_format",
        "litert_format", "onnx_format", "flatbuf", "numerics", "quant", "core_ops", "torch_semantics", "progress",
        "_version", "tpu_compile", "npyfiles"}
FACES = ("torchtpu_export.targets", "torchtpu_export.converters", "torchtpu_export.runtimes", "torchtpu_export.api",
         "torchtpu_export.cli", "torchtpu_export.coverage", "torchtpu_export.debugger", "torchtpu_export.targets.litert.web",
         "torchtpu_export.describe", "torchtpu_export.models")


def _modules() -> dict[str, str]:
    """Every module of the package (dotted name as installed) -> its source path."""
    out = {}
    for folder, package in PACKAGES.items():
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, f), os.path.join(REPO, folder))[:-3].replace(os.sep, ".")
                name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                out[name] = os.path.join(root, f)
    return out


def _imports(name: str, path: str, modules: dict) -> set[str]:
    """The project modules ``name`` imports, at any level of its code (lazy imports included)."""
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        targets_ = []
        if isinstance(node, ast.Import):
            targets_ = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets_ = [module] + [f"{module}.{a.name}" for a in node.names]
        for t in targets_:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict) -> list | None:
    state: dict = {}
    stack: list = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _without_package_inits(graph: dict) -> dict:
    # a package's __init__ importing its own submodules (to register rules) is not a circle with them
    return {n: {m for m in deps if not (n.startswith(m + ".") and m != "torchtpu_export")} for n, deps in graph.items()}


def test_the_import_graph_has_no_circle():
    graph = _without_package_inits(_graph())
    for n in graph:  # the package root only hands names on: leave its re-exports out
        graph[n].discard("torchtpu_export")
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_core_imports_no_target_and_converters_and_runtimes_stay_apart():
    graph = _graph()
    bad = []
    for name, deps in graph.items():
        short = name.removeprefix("torchtpu_export.")
        for dep in deps:
            if short in CORE and dep.startswith(FACES):
                bad.append(f"core {name} imports {dep}")
            if name.startswith("torchtpu_export.converters") and dep.startswith("torchtpu_export.runtimes"):
                bad.append(f"converter {name} imports {dep}")
            if name.startswith("torchtpu_export.runtimes") and dep.startswith("torchtpu_export.converters"):
                bad.append(f"runtime {name} imports {dep}")
    assert not bad, bad


def test_no_module_imports_converters_or_runtimes_by_a_bare_name():
    bare = re.compile(r"^\s*(from|import)\s+(converters|runtimes)\b", re.M)
    found = [p for p in _modules().values() if bare.search(open(p).read())]
    assert not found, found


TARGET_BRANCH = re.compile(r"""(target|kind|\.name)\s*(==|!=)\s*["'](tpu|litert|onnx)["']"""
                           r"""|(target|kind)\s+(not\s+)?in\s+[(\[]["'](tpu|litert|onnx)""")


def test_no_code_dispatches_on_a_target_name_outside_the_table():
    table = os.path.join(REPO, "torchtpu_export", "targets")
    found = []
    for path in _modules().values():
        if path.startswith(table):
            continue
        for i, line in enumerate(open(path), 1):
            if TARGET_BRANCH.search(line):
                found.append(f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}")
    assert not found, found


def test_the_docs_list_the_targets_of_the_table():
    text = open(os.path.join(REPO, "docs", "architecture.md")).read()
    section = text.split("## Targets", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `converters/(\w+)` \|.*?`runtimes/(\w+)`.*?\| `(\w+)` \|", section, re.M)
    assert [r[0] for r in rows] == list(targets.NAMES)
    for name, converter, runtime, runnable in rows:
        t = targets.get(name)
        assert (t.converter, t.runtime, t.runnable.__name__) == (converter, runtime, runnable)
    assert "three steps" in section and "../shared" not in text + open(os.path.join(REPO, "README.md")).read()


def test_every_runnable_is_a_runnable():
    for t in targets.all_targets().values():
        assert issubclass(t.runnable, targets.Runnable), t.name
        for own in ("signatures", "_call_metadata", "_run", "save"):
            assert getattr(t.runnable, own) is not getattr(targets.Runnable, own), (t.name, own)


def test_import_does_nothing_but_define_names():
    code = ("import os, sys; import torchtpu_export as tte; "
            "print(sorted(k for k in os.environ if k.startswith('TPU_') or k == 'ALLOW_MULTIPLE_LIBTPU_LOAD'), "
            "'jax' in sys.modules, 'ai_edge_litert' in sys.modules, 'onnxruntime' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "[] False False False", r.stdout
