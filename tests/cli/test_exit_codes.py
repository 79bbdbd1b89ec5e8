"""The CLI's exit codes against the documented rules (docs/reference/cli.md), for the cases red-team round 5 found (issue #65): bad user
input is exit 2 naming the flag, never a hang, an internal error (1), another class's code (3, 6) or a
silent success that ignores what was asked. Each group of cases runs in one CLI process (run_cli_many)."""
import os
import socket

import pytest
import torch

import hf_llms
import torchtpu_export as tte
from conftest import run_cli_many

pytestmark = pytest.mark.xdist_group("cli_exit_codes")  # one worker: the artifacts are shared


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny model's .pt2 and .tpu, and the tiny Llama's folder and its LLM .tpu (cache 64)."""
    import cli_models
    root = tmp_path_factory.mktemp("exit_codes")
    model, args = cli_models.tiny()
    torch.export.save(torch.export.export(model, args), root / "tiny.pt2")
    folder = hf_llms.save_folder("llama", str(root / "llama"))
    tte.export_llm(folder, target="tpu", prefill_lengths=(8,), cache_length=64, batch_size=1).save(root / "llm.tpu")
    for r in run_cli_many([[root / "tiny.pt2", "--target", "tpu", "-o", root / "tiny.tpu", "-q"],
                           [root / "tiny.pt2", "--target", "litert", "-o", root / "tiny.tflite", "-q"]]):
        assert r.returncode == 0, r.stderr
    return root


def _each(cases: dict, timeout: float = 300):
    """Runs every case's argv in one CLI process; each must end with its exit code, one message (no
    traceback) holding each of its words."""
    results = run_cli_many([argv for argv, _, _ in cases.values()], timeout=timeout)
    for (name, (argv, code, words)), r in zip(cases.items(), results):
        assert r.returncode == code, (name, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (name, r.stderr)
        for word in words:
            assert word in r.stderr, (name, word, r.stderr)


def test_fifos_named_by_run_flags_are_refused_at_once(made, tmp_path):
    # were: --json-schema, --lora and --image waited for a writer for ever (killed after 240 s)
    fifo = tmp_path / "named.fifo"
    os.mkfifo(fifo)
    npy = tmp_path / "x.npy"
    os.mkfifo(npy)
    llm, tiny = made / "llm.tpu", made / "tiny.tpu"
    _each({
        "json-schema": (["run", llm, "--prompt", "hi", "--json-schema", fifo], 2, [str(fifo), "--json-schema", "FIFO"]),
        "lora": (["run", llm, "--prompt", "hi", "--lora", fifo], 2, [str(fifo), "--lora", "FIFO"]),
        "image": (["run", llm, "--prompt", "hi", "--image", made / "tiny.pt2", "--image", fifo], 2,
                  [str(fifo), "--image", "FIFO"]),
        "inputs": (["run", tiny, "--inputs", npy], 2, [str(npy), "--inputs", "FIFO"]),
        "artifact": (["run", fifo], 2, [str(fifo), "FIFO"]),
        "inspect": (["inspect", fifo], 2, [str(fifo), "FIFO"]),
        "directory": (["run", llm, "--prompt", "hi", "--json-schema", tmp_path], 2, ["--json-schema", "directory"]),
    }, timeout=60)


def test_run_flags_of_the_other_mode_are_refused(made, tmp_path):
    llm = made / "llm.tpu"
    out = tmp_path / "out.npz"
    _each({  # were exit 0, the flag ignored: -o wrote no file
        "-o": (["run", llm, "--prompt", "hi", "-o", out], 2, ["-o applies to a run on inputs", "--prompt"]),
        "--inputs": (["run", llm, "--prompt", "hi", "--inputs", "1x1:int32"], 2, ["--inputs"]),
        "--signature": (["run", llm, "--prompt", "hi", "--signature", "decode"], 2, ["--signature"]),
        "--chat": (["run", made / "tiny.tpu", "--chat"], 2, ["--chat goes with --prompt"]),
        "--max-new-tokens": (["run", made / "tiny.tpu", "--max-new-tokens", "3"], 2, ["--max-new-tokens goes with"]),
    })
    assert not out.exists()


def test_prompts_and_artifacts_that_do_not_go_together(made):
    llm, tiny = made / "llm.tpu", made / "tiny.tpu"
    _each({
        # was exit 1 (the text worker's tokenizer failed: WorkerError); LiteRT-LM's bundles said 2 already
        "not UTF-8": (["run", llm, "--prompt", "hi\udcff", "--max-new-tokens", "3"], 2, ["not valid text"]),
        "no LLM": (["run", tiny, "--prompt", "hi"], 2, ["holds no LLM", "--prompt"]),
        "several signatures": (["run", llm], 2, ["several signatures", "--signature"]),
        "--lora on a .tpu": (["run", llm, "--prompt", "hi", "--lora", made / "tiny.tflite"], 2, [".litertlm"]),
    })


def _usage_error(capsys, *argv) -> str:
    """What ``torchtpu-export ARGV`` says, where argparse refuses it (exit 2, raised as SystemExit)."""
    from torchtpu_export import cli
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


def test_export_numbers_out_of_range_are_refused(made, tmp_path, capsys):
    pt2, folder = made / "tiny.pt2", made / "llama"
    for value in ("-1", "nan"):  # were exit 6 (--check failed) for -1, which fails every check, and 0 for NaN,
        # which passes every check
        err = _usage_error(capsys, pt2, "--target", "tpu", "--check", "--tolerance", value, "-o", tmp_path / "a.tpu")
        assert "argument --tolerance" in err and value in err, err
    assert "--tolerance" in _usage_error(capsys, "debug", pt2, "--target", "tpu", "--tolerance", "-1")
    _each({
        "tolerance without --check": ([pt2, "--target", "tpu", "--tolerance", "1e-3", "-o", tmp_path / "c.tpu"], 2,
                                      ["--tolerance goes with --check"]),
        # were exit 0: page size 0 became 16, an empty list of prefill lengths the default 128
        "page size 0": ([folder, "--target", "tpu", "--kv-pages", "auto", "--page-size", "0", "-o", tmp_path / "p.tpu"],
                        2, ["page_size", "got 0"]),
        "no prefill lengths": ([folder, "--target", "litertlm", "--prefill-lengths", "", "-o", tmp_path / "x.litertlm"],
                               2, ["--prefill-lengths"]),
    })
    assert not any(tmp_path.iterdir())


def test_serve_on_an_address_it_cannot_listen_on_is_the_users_error(made):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        _each({  # were exit 3 (the code of a failed capture) from uvicorn, after the model had loaded
            "port in use": (["serve", made / "tiny.tpu", "--port", port], 2, [f"--port {port} is in use"]),
            "not this machine's": (["serve", made / "tiny.tpu", "--host", "192.0.2.1"], 2, ["--host", "192.0.2.1"]),
        }, timeout=120)
    finally:
        busy.close()


def test_tolerance_arg_takes_finite_numbers_from_zero():
    import argparse

    from torchtpu_export.numerics import tolerance_arg
    assert tolerance_arg("0") == 0.0 and tolerance_arg("1e-4") == 1e-4
    for bad in ("-1e-5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            tolerance_arg(bad)
