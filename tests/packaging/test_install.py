"""The installed package works without the checkout: a wheel of the project, installed into a
folder of its own, run from another folder (coverage, a conversion, serve-web's page and LiteRT.js);
and LiteRT.js fetched with npm into the user cache when no checkout provides it."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO

CHECKOUT_LITERTJS = os.path.join(REPO, "examples", "web", "node_modules")
# one worker builds the wheel once for every test here (two pip builds of one checkout at once collide)
pytestmark = pytest.mark.xdist_group("install")

FACTORY = '''
import torch

def tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()), (torch.randn(2, 8),)
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, a working folder outside the checkout, env that sees only the installed package)."""
    root = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools' build/ folder in the checkout is left alone (and never shared)
    src = root / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "node_modules", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", "dist"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(root / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (root / "dist").glob("torchtpu_export-*.whl")
    site = root / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    work = root / "work"
    work.mkdir()
    (work / "tiny.py").write_text(FACTORY)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TTE_LITERTJS")}
    env.update(PYTHONPATH=str(site), PYTHONWARNINGS="ignore", XDG_CACHE_HOME=str(root / "cache"))
    return site, work, env


def _cli(installed, *args, extra_env=None, timeout=600):
    _, work, env = installed
    return subprocess.run([sys.executable, "-m", "torchtpu_export", *map(str, args)], cwd=work,
                          env=dict(env, **(extra_env or {})), capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_the_one_that_runs(installed):
    site, work, env = installed
    out = subprocess.run([sys.executable, "-c", "import torchtpu_export, os; print(torchtpu_export.__file__)"],
                         cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith(str(site)), out
    assert (site / "torchtpu_export" / "targets" / "litert" / "web" / "page" / "index.html").is_file()
    assert not (site / "torchtpu_export" / "zoo.py").exists() and not (site / "examples").exists()


IMPORT_ALL = """
import importlib, pkgutil, sys
import torchtpu_export
assert torchtpu_export.__file__.startswith(sys.argv[1]), torchtpu_export.__file__
names = [m.name for m in pkgutil.walk_packages(torchtpu_export.__path__, "torchtpu_export.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_every_module_imports_from_the_installed_wheel(installed):
    """Every module of the installed package imports from a folder outside the checkout (no bare
    `converters` or `runtimes` import, every package listed in pyproject.toml)."""
    site, work, env = installed
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(site)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sources = sum(f.endswith(".py") and f != "__main__.py" for top in ("torchtpu_export", "converters", "runtimes")
                  for _, _, files in os.walk(os.path.join(REPO, top)) for f in files)
    assert int(r.stdout.split()[-1]) == sources - 1  # every source file but the package's own __init__


def test_coverage_and_conversion_from_another_folder(installed):
    r = _cli(installed, "coverage", "--ops", "aten.add.Tensor", "--targets", "xla,litert", "--format", "json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["ops"]
    assert row["cells"]["xla"]["status"] == "pass"
    r = _cli(installed, "tiny.py:tiny", "--target", "litert", "-o", "tiny.tflite", "--check")
    assert r.returncode == 0, r.stderr
    assert "check: OK" in r.stdout and (installed[1] / "tiny.tflite").is_file()


def _serve(installed, extra_env):
    proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export", "serve-web", "tiny.tflite", "--port", "0"],
                            cwd=installed[1], env=dict(installed[2], **extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving tiny.tflite at" in line, line + proc.stderr.read()
        url = line.split(" at ", 1)[1].split()[0]
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        script = urllib.request.urlopen(url + "vendor/@litertjs/core/dist/index.js", timeout=30).read()
        return page, script
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_web_serves_the_installed_page_and_litertjs(installed):
    if not (installed[1] / "tiny.tflite").is_file():
        _cli(installed, "tiny.py:tiny", "--target", "litert", "-o", "tiny.tflite")
    page, script = _serve(installed, {"TTE_LITERTJS": CHECKOUT_LITERTJS})
    with open(os.path.join(CHECKOUT_LITERTJS, "@litertjs", "core", "dist", "index.js"), "rb") as f:
        assert "@litertjs/core" in page and script == f.read()


def test_litertjs_is_fetched_with_npm_into_the_user_cache_once(installed, tmp_path):
    """A stand-in npm (the real one would reach the registry) shows the first-use fetch and its cache."""
    if not (installed[1] / "tiny.tflite").is_file():
        _cli(installed, "tiny.py:tiny", "--target", "litert", "-o", "tiny.tflite")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "npm.log"
    fake = bin_dir / "npm"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
open({str(log)!r}, "a").write(" ".join(args) + "\\n")
prefix = args[args.index("--prefix") + 1]
for spec in [a for a in args if a.startswith("@litertjs/")]:
    name = spec.rsplit("@", 1)[0]
    d = os.path.join(prefix, "node_modules", name)
    os.makedirs(d, exist_ok=True)
    json.dump({{"name": name, "version": spec.rsplit("@", 1)[1]}}, open(os.path.join(d, "package.json"), "w"))
    os.makedirs(os.path.join(d, "dist"), exist_ok=True)
    open(os.path.join(d, "dist", "index.js"), "w").write("// " + name)
""")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for _ in range(2):
        _, script = _serve(installed, env)
        assert script == b"// @litertjs/core"
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "@litertjs/core@2.5.3" in calls[0]
    assert (tmp_path / "cache" / "torchtpu_export" / "litertjs-2.5.3" / "node_modules" / "@litertjs" / "core").is_dir()


def test_without_npm_serve_web_says_what_to_install(installed, tmp_path):
    if not (installed[1] / "tiny.tflite").is_file():
        _cli(installed, "tiny.py:tiny", "--target", "litert", "-o", "tiny.tflite")
    empty = tmp_path / "empty"
    empty.mkdir()
    t0 = time.monotonic()
    r = _cli(installed, "serve-web", "tiny.tflite", "--port", "0",
             extra_env={"PATH": str(empty), "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=120)
    assert r.returncode == 2 and "npm is not installed" in r.stderr and "--litertjs" in r.stderr
    assert time.monotonic() - t0 < 120
