"""Stored executables (`torchtpu-export compile`) are native code, read only from a file marked trusted
(`--trust-stored-executables`, `tte.load(path, trust_stored_executables=True)`). A file compiled with
`--topology cpu` whose stored bytes were replaced, the manifest's digests recomputed as anyone editing the
file can, runs and serves without the flag by compiling, its stored bytes never deserialized; with the flag
the checks decide. A compiled file's one-slot engine (`run --prompt`, `serve --one-slot`) never takes the
batched engine's calls for its own."""
import hashlib
import logging

import jax
import pytest

import hf_llms
import torchtpu_export as tte
from conftest import run_cli_many
from serving_harness import _free_port, greedy
from torchtpu_export.engine import Engine
from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.server import Served
from torchtpu_export.targets.tpu import aot as tpu_compile

UD2 = b"\x0f\x0b" * 4096  # x86's undefined instruction, over and over: a process that runs it dies of SIGILL
PROMPT = "hello world"


def _edit_calls(src, dst, new_bytes) -> int:
    """``src`` written to ``dst`` with each stored engine call's bytes replaced by ``new_bytes(name, calls)``
    (calls: name -> its bytes), the manifest's sha256 and sizes recomputed; returns how many calls it stores."""
    prog = tte.load(src)
    calls = prog.manifest["llm"]["engine"]["cpu"]["calls"]
    old = {name: prog.artifact.extras[call["file"]] for name, call in calls.items()}
    for name, call in calls.items():
        data = new_bytes(name, old)
        prog.artifact.extras[call["file"]] = data
        call.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    prog.save(dst)
    return len(calls)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    model, tok = hf_llms.build("llama")
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=32, batch_size=2,
                          batch_buckets=(), platforms=("cpu",), check=False)
    d = tmp_path_factory.mktemp("executables")
    paths = {k: d / f"{k}.tpu" for k in ("plain", "compiled", "hostile", "swapped")}
    prog.save(paths["plain"])
    prog.compile("cpu").save(paths["compiled"])
    calls = _edit_calls(paths["compiled"], paths["hostile"], lambda name, old: UD2)
    # a valid executable in another call's place: the one-row zero caches where the batch's are stored
    _edit_calls(paths["compiled"], paths["swapped"],
                lambda name, old: old["zeros"] if name.startswith("batch_zeros.") else old[name])
    want = greedy(model, tok(PROMPT)["input_ids"], 6)
    return paths, calls, tok(PROMPT)["input_ids"], want


def test_an_untrusted_file_s_stored_executables_are_never_read(files, monkeypatch, caplog):
    """Without the opt-in `serve` (batched and --one-slot) and `run --prompt` compile every call and give
    transformers' tokens; nothing stored is deserialized, and the log and the stats say why."""
    paths, calls, ids, want = files
    monkeypatch.setattr(tpu_compile, "load_executable", lambda *a, **k: pytest.fail("a stored executable was read"))
    with caplog.at_level(logging.WARNING, logger="torchtpu_export"):
        for batched in (True, False):  # serve FILE, serve FILE --one-slot
            served = Served(paths["hostile"], batched=batched, text_workers=1, warm=True)
            try:
                stats = served.engine.stats
                assert stats["stored_executables"] == 0 and stats["stored_executables_ignored"] == calls
                assert served.engine.generate(ids, 6, stop=[2]) == want
            finally:
                served.close()
    said = [r.getMessage() for r in caplog.records if "stored engine executables" in r.getMessage()]
    assert len(said) == 2 and f"ignoring the file's {calls} stored" in said[0], said
    assert "--trust-stored-executables" in said[0]
    assert tte.load(paths["hostile"]).generate(ids, 6).ids == want  # run FILE --prompt


def test_a_trusted_file_s_stored_executables_load_only_past_the_checks(files):
    """With the opt-in: bytes that are no executable, or another call's executable, are refused naming the
    call; the file as compiled loads all of them and gives the same tokens. Its one-slot engine (`run
    --prompt`) takes none of the batched engine's calls for its own (it took the batch's zero caches, and
    failed on their shape); warmed (`serve --one-slot`) it is refused naming the call the file lacks."""
    paths, calls, ids, want = files
    with pytest.raises(ArtifactError, match=r"stored engine call 'batch_zeros\.2'.*cannot be loaded"):
        Engine(tte.load(paths["hostile"], trust_stored_executables=True))
    with pytest.raises(ArtifactError, match=r"stored engine call 'batch_zeros\.2'.*gives other results"):
        Engine(tte.load(paths["swapped"], trust_stored_executables=True))
    engine = Engine(tte.load(paths["compiled"], trust_stored_executables=True))
    engine.warm()
    assert engine.stats["stored_executables"] == calls and engine.stats["stored_executables_ignored"] == 0
    assert engine.generate(ids, 6, stop=[2]) == want
    one = Engine(tte.load(paths["compiled"], trust_stored_executables=True), batched=False)
    assert one.generate(ids, 6, stop=[2]) == want
    with pytest.raises(ArtifactError, match="lack the engine call 'set_row.1'"):
        Engine(tte.load(paths["compiled"], trust_stored_executables=True), batched=False).warm()
    with pytest.raises(InputError, match="True or False"):
        tte.load(paths["compiled"], trust_stored_executables="yes")


def test_a_program_s_stored_tpu_executable_is_never_read_untrusted(files, monkeypatch, caplog):
    """The per-program TPU executables (`compile --topology v5e`) likewise: a runner on the tpu platform
    over a file not marked trusted never looks at them, and says so once."""
    paths = files[0]
    prog = tte.load(paths["plain"])
    art = prog.artifact
    art.programs["decode"]["tpu"] = art.programs["decode"]["cpu"]
    art.executables = {"v5e:1x1": {"decode": UD2}}
    art.manifest["compiled"] = {"v5e:1x1": {"decode": {
        "stats": {}, "device_kind": jax.devices()[0].device_kind, "devices": 1, "libtpu": tpu_compile.libtpu_version(),
        "jax": jax.__version__, "executable": {"file": "x", "sha256": hashlib.sha256(UD2).hexdigest()}}}}
    monkeypatch.setattr(tpu_compile, "stored_executable", lambda *a, **k: pytest.fail("looked for an executable"))
    monkeypatch.setattr(tpu_compile, "load_executable", lambda *a, **k: pytest.fail("deserialized"))
    with caplog.at_level(logging.WARNING, logger="torchtpu_export"):
        runner = prog.runner("decode", platform="tpu")
    assert runner.executable is None
    said = [r.getMessage() for r in caplog.records if "no stored executable is used" in r.getMessage()]
    assert len(said) == 1 and "not marked trusted" in said[0] and "--trust-stored-executables" in said[0]


def test_the_command_line_needs_the_flag_and_inspect_says_so(files):
    """`run --prompt` gives the plain file's text on the edited file without the flag, and on the compiled
    file with it; `serve --trust-stored-executables` refuses the edited file and `--one-slot` on the
    compiled one with exit 5 and one message; `inspect` says what the stored executables are."""
    paths = files[0]
    port = str(_free_port())
    prompt = ["--prompt", PROMPT, "--max-new-tokens", "6"]
    plain, hostile, trusted, one_slot, refused, shown, none = run_cli_many([
        ["run", paths["plain"], *prompt], ["run", paths["hostile"], *prompt],
        ["run", paths["compiled"], *prompt, "--trust-stored-executables"],
        ["serve", paths["compiled"], "--one-slot", "--trust-stored-executables", "--port", port],
        ["serve", paths["hostile"], "--trust-stored-executables", "--port", port],
        ["inspect", paths["hostile"]], ["inspect", paths["plain"]]])
    assert plain.returncode == 0, plain.stderr
    reply = plain.stdout.splitlines()[0]
    for r in (hostile, trusted):
        assert r.returncode == 0 and r.stdout.splitlines()[0] == reply, r.stderr
    assert "ignoring the file's" in hostile.stderr and "ignoring" not in trusted.stderr
    for r, says in ((one_slot, "lack the engine call 'set_row.1'"), (refused, "cannot be loaded")):
        assert r.returncode == 5 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert shown.returncode == 0
    assert "native code: loaded only with --trust-stored-executables" in shown.stdout, shown.stdout
    assert "stored executables" not in none.stdout
