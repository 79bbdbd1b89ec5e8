"""Hostile Hugging Face model folders, each through the CLI as the red-team report gave it: links that
would copy local files into the bundle (``chat_template.jinja`` -> ``/etc/passwd``) or reach devices and
directories, a config.json far larger than its checkpoint, a padded safetensors header, and configs that
transformers cannot build. Each ends in one message and exit 2, in bounded memory; a plain folder and a
Hugging Face cache snapshot (every file a link to ``../../blobs/SHA``) still export."""
import hashlib
import json
import os
import shutil
import struct

import pytest

import hf_llms
from cli_checks import _clean, _cli_peak_rss_mb
from conftest import run_cli, run_cli_many

EXPORT = ("--target", "litertlm", "--prefill-lengths", "8", "--cache-length", "32")
AS_LIMIT = 8 << 30  # a regression must fail the test, not exhaust the shared machine (one case took 24 GB)
LIMIT = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({AS_LIMIT}, {AS_LIMIT}))\n"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return hf_llms.save_folder("llama", str(tmp_path_factory.mktemp("hf") / "llama"))


def _peak(*argv):
    """The CLI in a process of its own, under an address-space limit; its result and peak memory in MB."""
    return _cli_peak_rss_mb(*argv, prelude=LIMIT)


@pytest.fixture(scope="module")
def baseline(good, tmp_path_factory):
    """Peak memory of exporting the good folder (what torch and transformers cost by themselves)."""
    r, peak = _peak(good, *EXPORT, "-o", tmp_path_factory.mktemp("base") / "good.litertlm")
    assert r.returncode == 0, r.stderr[-2000:]
    return peak


def _all_refused(cases: dict, words: dict, tmp_path, *, peak_under=None):
    """Every case exit 2 with one message holding its words, no output written."""
    argvs = [[folder, *EXPORT, *extra, "-o", tmp_path / f"out{i}.litertlm"]
             for i, (folder, extra) in enumerate(cases.values())]
    results = run_cli_many(argvs, prelude=LIMIT)  # many cases per process: each would import torch
    for case, r in zip(cases, results):
        code, err = r.returncode, r.stderr
        assert code == 2 and "Traceback" not in err and "internal error" not in err, (case, code, err[-2000:])
        assert err.count("error:") == 1 and all(w in err for w in words[case]), (case, err)
    assert not list(tmp_path.glob("out*.litertlm"))
    if peak_under is not None:
        assert results[-1].peak_mb < peak_under, (results[-1].peak_mb, peak_under)


def _copy(good, tmp_path, name="model"):
    return shutil.copytree(good, tmp_path / name)


def _refused(folder, tmp_path, *words, extra=()):
    out = tmp_path / "out.litertlm"
    r = run_cli(folder, *EXPORT, *extra, "-o", out, timeout=120)
    _clean(r, 2)
    assert all(w in r.stderr for w in words), r.stderr
    assert r.stderr.count("error:") == 1 and not out.exists(), r.stderr
    return r


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ---- 1: files are read only if they are regular files inside the folder ------------------------

LINKS_OUT = [
    ("chat_template.jinja", "/etc/passwd"),  # the report: the bundle's template was the passwd file
    ("config.json", "/dev/zero"),
    ("tokenizer.json", "/"),
    ("tokenizer_config.json", "/dev/urandom"),
    ("generation_config.json", "/proc/self/environ"),
    ("model.safetensors", "OUTSIDE"),  # a real checkpoint, but outside the folder
]


def test_a_link_out_of_the_folder_is_never_read(good, tmp_path):
    cases, words = {}, {}
    for name, target in LINKS_OUT:
        folder = _copy(good, tmp_path, name)
        if target == "OUTSIDE":
            target = shutil.copy(str(folder / name), str(tmp_path / "elsewhere.safetensors"))
        (folder / name).unlink()
        (folder / name).symlink_to(target)
        shown = "/proc/" if target.startswith("/proc/") else os.path.realpath(target)
        cases[name], words[name] = (folder, ()), (f"{name} is a link to {shown}", "outside the model folder")
    _all_refused(cases, words, tmp_path)


def test_a_tokenizer_folder_is_checked_like_the_model_folder(good, tmp_path):
    tok = _copy(good, tmp_path, "tok")
    (tok / "chat_template.jinja").unlink()
    (tok / "chat_template.jinja").symlink_to("/etc/passwd")
    _refused(good, tmp_path, "chat_template.jinja is a link to /etc/passwd", extra=("--tokenizer", tok))


def test_special_files_in_the_folder_are_refused_without_blocking(good, tmp_path):
    cases, words = {}, {}
    for kind in ("fifo", "directory", "broken link", "link loop"):
        folder = _copy(good, tmp_path, kind.replace(" ", "_"))
        jinja = folder / "chat_template.jinja"
        jinja.unlink()
        if kind == "fifo":  # opening it would wait for a writer forever
            os.mkfifo(jinja)
            found = "is not a regular file (a FIFO)"
        elif kind == "directory":
            jinja.mkdir()
            found = "is not a regular file (a directory)"
        else:
            jinja.symlink_to("nowhere" if kind == "broken link" else "chat_template.jinja")
            found = "is a link that leads to no file"
        cases[kind], words[kind] = (folder, ()), ("chat_template.jinja", found)
    _all_refused(cases, words, tmp_path)


def _hub_snapshot(good, root, model="models--org--tiny"):
    """The Hugging Face cache's layout: every file of the snapshot a relative link to its blob."""
    snapshot = root / model / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (root / model / "blobs").mkdir()
    for name in os.listdir(good):
        data = open(os.path.join(good, name), "rb").read()
        sha = hashlib.sha256(data).hexdigest()
        (root / model / "blobs" / sha).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{sha}")
    return snapshot


def test_a_hub_cache_snapshot_and_links_within_the_folder_still_export(good, tmp_path):
    snapshot = _hub_snapshot(good, tmp_path / "hub")
    r = run_cli(snapshot, *EXPORT, "-o", tmp_path / "hub.litertlm")
    assert r.returncode == 0 and "signatures prefill_8, decode" in r.stdout, r.stderr[-2000:]
    folder = _copy(good, tmp_path)
    (folder / "chat_template.jinja").rename(folder / "template.jinja")
    (folder / "chat_template.jinja").symlink_to("template.jinja")
    r = run_cli(folder, *EXPORT, "-o", tmp_path / "inner.litertlm")
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_hub_snapshot_links_only_to_its_own_models_blobs(good, tmp_path):
    snapshot = _hub_snapshot(good, tmp_path / "hub")
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    (other / "sha").write_text("{{ 'a template from another model' }}")
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to("../../../models--evil--x/blobs/sha")
    _refused(snapshot, tmp_path, "chat_template.jinja is a link to", "outside the model folder")
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to("../../blobs")  # inside the model, but a directory
    _refused(snapshot, tmp_path, "chat_template.jinja is not a regular file (a directory)")


def _sharded(good, tmp_path, shard="model-00001-of-00001.safetensors"):
    folder = _copy(good, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    data = (folder / "model-00001-of-00001.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    names = [k for k in json.loads(data[8:8 + n]) if k != "__metadata__"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for k in names}}))
    return folder


def test_a_sharded_checkpoint_reads_only_shards_inside_the_folder(good, tmp_path):
    r = run_cli(_sharded(good, tmp_path / "ok"), *EXPORT, "-o", tmp_path / "sharded.litertlm")
    assert r.returncode == 0, r.stderr[-2000:]
    _refused(_sharded(good, tmp_path / "up", shard="../llama/model.safetensors"), tmp_path,
             "names the shard '../llama/model.safetensors'")
    folder = _sharded(good, tmp_path / "link")
    (folder / "model-00001-of-00001.safetensors").unlink()
    (folder / "model-00001-of-00001.safetensors").symlink_to(os.path.join(good, "model.safetensors"))
    _refused(folder, tmp_path, "model-00001-of-00001.safetensors is a link to", "outside the model folder")


# ---- 2: nothing of a model's size is allocated before it is compared with its checkpoint -------

def test_a_config_far_larger_than_its_checkpoint_is_refused_in_bounded_memory(good, baseline, tmp_path):
    folder = _copy(good, tmp_path)
    _edit_json(folder / "config.json", vocab_size=2 ** 26)  # 32 GB of float32 embeddings for a 0.5 MB checkpoint
    r, peak = _peak(folder, *EXPORT, "-o", tmp_path / "out.litertlm")
    _clean(r, 2)
    assert "config.json describes a LlamaForCausalLM of 8,590,008,640 weights" in r.stderr, r.stderr
    assert "do not match" in r.stderr and peak < baseline + 100, (peak, baseline)


def test_a_padded_safetensors_header_is_refused_in_bounded_memory(good, baseline, tmp_path):
    folder = _copy(good, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.update({f"pad.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(1_100_000)})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    assert len(raw) > 60 << 20  # the report's 63 MB header: +1 GB in safetensors' parser
    r, peak = _peak(folder, *EXPORT, "-o", tmp_path / "out.litertlm")
    _clean(r, 2)
    assert "model.safetensors: the safetensors header is" in r.stderr and peak < baseline + 100, (peak, r.stderr)


def test_an_index_naming_more_tensors_than_its_shards_hold_is_refused(good, tmp_path):
    folder = _sharded(good, tmp_path)
    _edit_json(folder / "model.safetensors.index.json",
               weight_map={f"t{i}": "model-00001-of-00001.safetensors" for i in range(1000)})
    _refused(folder, tmp_path, "model.safetensors.index.json names 1,000 tensors; its shards hold 21")


# ---- 3: whatever transformers cannot build from config.json is exit 2 naming it ----------------

HOSTILE_CONFIGS = {
    "no heads": ({"num_attention_heads": 0}, "ZeroDivisionError"),
    "negative heads": ({"num_attention_heads": -4}, "num_attention_heads must be a positive integer"),
    "heads as text": ({"num_attention_heads": "4"}, "expected int, got str"),
    "heads not dividing hidden_size": ({"num_attention_heads": 3}, "not a multiple of the number of attention heads"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    "no kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    "negative hidden_size": ({"hidden_size": -64}, "hidden_size must be a positive integer"),
    "negative layers": ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
    "a billion layers": ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers is 1000000000"),
    "a thousand layers": ({"num_hidden_layers": 1000}, "more than 1,066 weight tensors"),
    "layers null": ({"num_hidden_layers": None}, "num_hidden_layers"),
    "negative intermediate_size": ({"intermediate_size": -5}, "negative dimension"),
    "intermediate_size a list": ({"intermediate_size": [1, 2]}, "intermediate_size"),
    "vocab_size true": ({"vocab_size": True}, "vocab_size"),
    "unknown activation": ({"hidden_act": "nope"}, "KeyError: 'nope'"),
    "unknown rope": ({"rope_parameters": {"rope_type": "nope"}}, "KeyError: 'nope'"),
    "huge head_dim": ({"head_dim": 2 ** 30}, "computed buffers take 4,096 MiB"),
    "max_position_embeddings as text": ({"max_position_embeddings": "x"}, "max_position_embeddings"),
    "eos_token_id as text": ({"eos_token_id": "x"}, "eos_token_id"),
    "text_config not an object": ({"text_config": 5}, "num_attention_heads must be a positive integer"),
    "quantized": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                  "quantized checkpoint"),
    "weights outside": ({"transformers_weights": "../llama/model.safetensors"}, "of the folder itself"),
    "weights a pickle": ({"transformers_weights": "adapter_model.bin"}, "of the folder itself"),
}


def test_a_config_transformers_cannot_build_is_exit_2_naming_it(good, baseline, tmp_path):
    cases, words = {}, {}
    for i, (case, (edit, found)) in enumerate(HOSTILE_CONFIGS.items()):
        folder = _copy(good, tmp_path, f"config{i}")
        _edit_json(folder / "config.json", **edit)
        cases[case], words[case] = (folder, ()), ("config.json", found)
    _all_refused(cases, words, tmp_path, peak_under=baseline + 100)


GENERATION_AND_TOKENIZER = [
    ("generation_config.json", {"eos_token_id": "x"}, "eos_token_id must be a token id"),
    ("generation_config.json", {"eos_token_id": [2 ** 40]}, "eos_token_id must be a token id"),
    ("tokenizer_config.json", {"chat_template": 5}, "chat_template must be text"),
    ("tokenizer_config.json", {"chat_template": [1, 2]}, "chat_template must be a template or a list"),
]
MALFORMED = [
    ("config.json", "[" * 100_000 + "]" * 100_000, "nests 100000 levels deep"),
    ("config.json", " " * (5 << 20), "at most 4,194,304 are read"),
    ("config.json", "[]", "is not a JSON object"),
    ("tokenizer.json", b"\xff\xfe", "is not UTF-8 text"),
    ("model.safetensors", b"\x10" + b"\0" * 7 + b"{}", "safetensors header is truncated"),
]


def test_hostile_generation_tokenizer_and_malformed_files_are_exit_2(good, tmp_path):
    cases, words = {}, {}
    for i, (name, edit, found) in enumerate(GENERATION_AND_TOKENIZER):
        folder = _copy(good, tmp_path, f"gen{i}")
        (folder / "chat_template.jinja").unlink()  # else the template file is taken
        _edit_json(folder / name, **edit)
        cases[f"{name} {edit}"], words[f"{name} {edit}"] = (folder, ()), (name, found)
    for i, (name, content, found) in enumerate(MALFORMED):
        folder = _copy(good, tmp_path, f"bad{i}")
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        cases[f"malformed {name} {i}"], words[f"malformed {name} {i}"] = (folder, ()), (name, found)
    _all_refused(cases, words, tmp_path)
