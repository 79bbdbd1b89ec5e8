"""Progress: a bar on terminals once a conversion runs long; nothing in pipes; stage times in the log."""
import io
import logging
import time

from torchtpu_export import progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_bar_draws_stages_on_a_tty_after_the_delay():
    out = FakeTTY()
    with progress.bar(out, delay=0.0):
        with progress.stage("capture"):
            time.sleep(0.3)
        with progress.stage("lower (tpu)"):
            time.sleep(0.3)
    text = out.getvalue()
    assert "\u2713 capture" in text and "\u2713 lower (tpu)" in text


def test_no_bar_in_pipes_or_for_quick_conversions():
    pipe = io.StringIO()
    with progress.bar(pipe, delay=0.0):
        with progress.stage("capture"):
            time.sleep(0.3)
    assert pipe.getvalue() == ""
    tty = FakeTTY()
    with progress.bar(tty, delay=60.0):
        with progress.stage("capture"):
            pass
    assert tty.getvalue() == ""


def test_stage_times_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="torchtpu_export"):
        with progress.stage("write"):
            pass
    assert any(r.name == "torchtpu_export" and r.getMessage().startswith("write:") for r in caplog.records)


def test_cli_verbose_logs_stages(tmp_path):
    from conftest import run_cli
    proc = run_cli("examples/zoo.py:small_cnn", "--target", "tpu", "-o", tmp_path / "m.tpu", "-v")
    assert proc.returncode == 0, proc.stderr
    assert "capture:" in proc.stderr and "write:" in proc.stderr
    assert "\r" not in proc.stderr  # no bar in a pipe
    quiet = run_cli("examples/zoo.py:small_cnn", "--target", "tpu", "-o", tmp_path / "m.tpu", "-q")
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""
