"""OpInfo pass rates side by side: ours (xla, litert) against torchax and litert-torch, on the same cases.

    python -m benchmarks.opinfo_peers [--ops PATTERN] [--jobs 2] [-o RESULTS-opinfo-peers.md] [--json FILE]
                                      [--peer-cells EARLIER.json]

The cases are those of ``torchtpu-export coverage --source opinfo`` (torchtpu_export/coverage/opinfo.py: the
same op_db entries, the first float32 samples of each, batched into one module per OpInfo), with
torch's generator seeded so a run is repeatable. Only cases that torch.export captures in our
harness are compared: that one set is the denominator of all four columns.

1. In this venv, one worker process per job: each case is prepared by ``opinfo.prepare``, exported,
   saved (``torch.export.save`` of the program, ``torch.save`` of the inputs and torch eager's
   outputs), and run on our xla and litert columns exactly as the coverage matrix runs them.
2. Each peer runs in its own venv (its own torch) as long-lived worker processes fed one case at a
   time; a case that crashes its worker or runs past the timeout becomes an ``error`` cell.
   torchax (``.venv-bench-torchax``, see tpu_export.py): ``torchax.export.exported_program_to_jax``
   on the saved program, jitted and run by jax on CPU. litert-torch (``.venv-bench-litert-torch``,
   see litert_vs_litert_torch.py): ``litert_torch.convert(program.module(), inputs)``, then the
   converted model is run by its LiteRT interpreter.
3. Back here, each peer's outputs are judged by our comparison (``coverage.compare_outputs``, the
   OpInfo tolerance): torchax with the xla column's rules, litert-torch with the litert column's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEERS = {
    # peer: (venv, the column of ours it is compared with)
    "torchax": (os.path.join(REPO, ".venv-bench-torchax"), "xla"),
    "litert_torch": (os.path.join(REPO, ".venv-bench-litert-torch"), "litert"),
}
OURS = ("xla", "litert")
CASE_TIMEOUT_S = 180.0
STATUSES = ("pass", "mismatch", "unsupported", "error")


# ---- ours (this venv, in run_isolated's workers) --------------------------------------------

def ours_case(name: str, case_dir: str) -> dict:
    """Prepares one OpInfo case, saves it for the peers, and runs it on our columns."""
    import torch

    from torchtpu_export.coverage import opinfo
    from torchtpu_export.coverage.cells import Cell, columns, first_line
    torch.manual_seed(0)
    case = opinfo.prepare(name)
    if isinstance(case, Cell):
        return {"captured": False, "reason": case.reason}
    entry, samples, batch, kind = case
    if kind is not None:   # our columns compare these by distribution or by shape; the peers' harness by value
        return {"captured": False, "reason": f"{kind} values: not comparable by value"}
    try:
        ep = batch.exported()
    except Exception as e:
        return {"captured": False, "reason": f"torch.export: {first_line(e)}"}
    os.makedirs(case_dir, exist_ok=True)
    try:
        torch.export.save(ep, os.path.join(case_dir, "program.pt2"))
        torch.save({"inputs": [t.clone() for t in batch.inputs], "refs": batch.refs,
                    "descs": [s.desc for s in samples]}, os.path.join(case_dir, "case.pt"))
    except Exception as e:
        return {"captured": False, "reason": f"harness: the program cannot be saved for the peers: {first_line(e)}"}
    columns = columns()
    return {"captured": True, **{rt: opinfo.run_column(case, columns[rt]).to_json() for rt in OURS}}


# ---- the peers (their venvs, long-lived workers) ---------------------------------------------

def _peer_loop(peer: str) -> None:
    """A peer worker: reads case folders from stdin, converts and runs each, writes its outputs."""
    import logging
    import pickle
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import numpy as np
    import torch
    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' prints go to stderr; stdout carries only the protocol
    if peer == "torchax":
        from benchmarks import torchax_shim  # noqa: F401  (torch 2.13 removed overloads torchax names)
        import jax
        import torchax
        from torchax import export as tx_export
        torchax.enable_accuracy_mode()  # float64/int64 kept, highest matmul precision: torch's semantics
        versions = {"torchax": torchax.__version__, "jax": jax.__version__}

        def convert_and_run(ep, inputs):
            states, func = tx_export.exported_program_to_jax(ep)
            args = tuple(jax.numpy.asarray(_numpy(t)) for t in inputs)
            return list(jax.jit(func)(states, args))
    else:
        from importlib.metadata import version

        import litert_torch
        versions = {"litert-torch": version("litert-torch"), "ai-edge-litert": version("ai-edge-litert")}

        def convert_and_run(ep, inputs):
            model = litert_torch.convert(ep.module(), tuple(inputs))
            # it narrows int64 inputs to int32 (as ours does): feed each input as the file declares it
            details = model._get_interpreter().get_signature_runner().get_input_details()
            feed = [_numpy(t) for t in inputs]
            feed = [x.astype(details[f"args_{i}"]["dtype"]) if f"args_{i}" in details else x
                    for i, x in enumerate(feed)]
            return _flatten(model(*feed))
    versions["torch"] = torch.__version__
    print("READY " + json.dumps(versions), file=out, flush=True)
    for line in sys.stdin:
        case_dir = line.strip()
        try:
            ep = torch.export.load(os.path.join(case_dir, "program.pt2"))
            data = torch.load(os.path.join(case_dir, "case.pt"))
            outs = [np.asarray(o) for o in convert_and_run(ep, data["inputs"])]
            with open(os.path.join(case_dir, f"{peer}.pkl"), "wb") as f:
                pickle.dump(outs, f)
            result = {"status": "ran"}
        except BaseException as e:  # noqa: BLE001  (the case's verdict)
            result = {"status": "unsupported" if _unsupported(peer, e) else "error", "reason": first_line(e)}
        print("RESULT " + json.dumps(result), file=out, flush=True)


def _numpy(t):
    return t.resolve_conj().resolve_neg().numpy()


def _flatten(x) -> list:
    if isinstance(x, dict):
        return [v for k in x for v in _flatten(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _flatten(item)]
    return [x]


def _unsupported(peer: str, e: BaseException) -> bool:
    """Whether the peer's exception says it has no conversion for an op (its own 'unsupported')."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if peer == "torchax":
        # OperatorNotFound, or JaxInterpreter's `assert op is not None, target` naming the overload
        return type(e).__name__ == "OperatorNotFound" or (
            isinstance(e, AssertionError) and re.fullmatch(r"\w+\.\w+(\.\w+)?", text) is not None)
    return "Lowering not found" in text


def first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0] if text else ''}"
    return msg if len(msg) <= limit else msg[:limit] + "..."


class PeerWorker:
    """One peer worker process; a crash or a timeout kills it, and the next case starts a new one."""

    def __init__(self, peer: str, python: str, log):
        self.peer, self.python, self.log, self.proc = peer, python, log, None
        self.versions: dict = {}

    def _start(self) -> None:
        env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen([self.python, "-m", "benchmarks.opinfo_peers", "--peer", self.peer],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=REPO)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        first = self._next(600.0)
        if first is None or not first.startswith("READY "):
            self._kill()
            raise RuntimeError(f"the {self.peer} worker did not start ({first!r}); see its log")
        self.versions = json.loads(first[len("READY "):])

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _next(self, timeout: float):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return "TIMEOUT"

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, case_dir: str, timeout: float) -> dict:
        if self.proc is None:
            self._start()
        self.proc.stdin.write(case_dir + "\n")
        self.proc.stdin.flush()
        line = self._next(timeout)
        if line is None or line == "TIMEOUT":
            code = self.proc.poll()
            self._kill()
            if line == "TIMEOUT":
                return {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
            what = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return {"status": "error", "reason": f"the peer crashed its worker process ({what})"}
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()


def run_peer(peer: str, python: str, case_dirs: list, jobs: int, timeout: float, log_path: str) -> tuple[list, dict]:
    """Every case on one peer, ``jobs`` workers at a time; returns (raw results, versions)."""
    todo: queue.Queue = queue.Queue()
    for i, d in enumerate(case_dirs):
        todo.put((i, d))
    results: list = [None] * len(case_dirs)
    versions: dict = {}
    done = [0]
    lock = threading.Lock()
    log = open(log_path, "a")

    def work():
        w = PeerWorker(peer, python, log)
        try:
            while True:
                try:
                    i, d = todo.get_nowait()
                except queue.Empty:
                    return
                t = time.monotonic()
                try:
                    results[i] = w.run(d, timeout)
                except Exception as e:  # noqa: BLE001
                    results[i] = {"status": "error", "reason": f"harness: {first_line(e)}"}
                versions.update(w.versions)
                with lock:
                    done[0] += 1
                    print(f"[{peer} {done[0]}/{len(case_dirs)}] {os.path.basename(d)}: {results[i]['status']} "
                          f"({time.monotonic() - t:.1f} s)", file=sys.stderr, flush=True)
        finally:
            w.close()

    threads = [threading.Thread(target=work) for _ in range(max(1, min(jobs, len(case_dirs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    return results, versions


def judge(peer: str, case_dir: str, raw: dict) -> dict:
    """A peer's cell: its outputs compared with torch eager by our rules (that of the paired column)."""
    import pickle
    import types

    import torch

    from torchtpu_export.coverage.cells import Cell, columns, compare_outputs
    from torchtpu_export.coverage.opinfo import OpInfoEntry
    if raw["status"] != "ran":
        return Cell(raw["status"], reason=raw.get("reason")).to_json()
    data = torch.load(os.path.join(case_dir, "case.pt"))
    with open(os.path.join(case_dir, f"{peer}.pkl"), "rb") as f:
        outs = pickle.load(f)
    samples = [types.SimpleNamespace(desc=d) for d in data["descs"]]
    entry = OpInfoEntry(os.path.basename(case_dir), None)
    want = sum(len(r) for r in data["refs"])
    if len(outs) != want:
        return Cell("mismatch", reason=f"{len(outs)} outputs, torch has {want}").to_json()
    try:
        return compare_outputs(entry, samples, data["refs"], outs, columns()[PEERS[peer][1]]).to_json()
    except Exception as e:  # noqa: BLE001
        return Cell("error", reason=f"compare: {first_line(e)}").to_json()


# ---- the run ---------------------------------------------------------------------------------

def measure(pattern: str | None, jobs: int, timeout: float, peers: list, work: str, reuse: dict | None = None) -> dict:
    import torch

    from torchtpu_export.coverage import opinfo, run_isolated
    names = sorted(opinfo._op_db())
    if pattern:
        names = [n for n in names if pattern in n]
    t0 = time.monotonic()
    dirs = {n: os.path.join(work, re.sub(r"[^\w.-]", "_", n)) for n in names}
    tasks = [("benchmarks.opinfo_peers:ours_case", (n, dirs[n])) for n in names]

    def progress(i, result, seconds):
        cells = ", ".join(f"{rt} {result[rt]['status']}" for rt in OURS if rt in result) or result.get("reason", "")
        print(f"[ours {i + 1}/{len(names)}] {names[i]}: {cells[:100]} ({seconds:.1f} s)", file=sys.stderr, flush=True)

    ours = run_isolated(tasks, jobs=jobs, timeout=timeout * len(OURS), on_result=progress)
    cases = {}
    excluded = {}
    for n, r in zip(names, ours):
        if r.get("captured"):
            cases[n] = {rt: r[rt] for rt in OURS}
        else:
            excluded[n] = r.get("reason") or "?"
    seconds = {"ours": round(time.monotonic() - t0)}
    versions = {"ours": {"torch": torch.__version__}}
    reused = {}
    for peer in peers:
        if reuse and peer in reuse.get("peers", ()):
            # the peer's cells of an earlier run (--peer-cells): same cases, same saved programs
            missing = [n for n in cases if peer not in reuse["cases"].get(n, {})]
            if missing:
                raise SystemExit(f"--peer-cells: {peer} has no cell for {len(missing)} case(s) of this run "
                                 f"(e.g. {missing[0]}); rerun without --peer-cells")
            for n in cases:
                cases[n][peer] = reuse["cases"][n][peer]
            versions[peer] = reuse["versions"][peer]
            seconds[peer] = reuse["seconds"][peer]
            reused[peer] = reuse.get("measured", "an earlier date")
            continue
        venv, _ = PEERS[peer]
        python = os.path.join(venv, "bin", "python")
        t1 = time.monotonic()
        if not os.path.exists(python):
            for n in cases:
                cases[n][peer] = {"status": "error", "reason": f"no venv at {venv}"}
            continue
        raw, versions[peer] = run_peer(peer, python, [dirs[n] for n in cases], jobs, timeout,
                                       os.path.join(work, f"{peer}.log"))
        for n, r in zip(list(cases), raw):
            cases[n][peer] = judge(peer, dirs[n], r)
        seconds[peer] = round(time.monotonic() - t1)
    from importlib.metadata import version
    versions["ours"].update({"jax": version("jax"), "ai-edge-litert": version("ai-edge-litert")})
    return {"opinfos": len(names), "cases": cases, "excluded": excluded, "versions": versions,
            "seconds": seconds, "peers": peers, "reused": reused, "measured": datetime.date.today().isoformat()}


def _cell(c: dict) -> str:
    return c["status"] + (f": {c['reason']}" if c.get("reason") and c["status"] != "pass" else "")


def _reused_note(reused: dict) -> str:
    if not reused:
        return ""
    names = " and ".join(k.replace("_", "-") for k in reused)
    when = ", ".join(sorted(set(reused.values())))
    return (f" The {names} cells, versions and wall times are reused from their run of {when} (`--peer-cells`): "
            "the peers and the saved cases did not change, only our columns were measured again.")


def to_markdown(report: dict, command: str, jobs: int) -> str:
    cases, peers = report["cases"], report["peers"]
    n = len(cases)
    v = report["versions"]
    today = datetime.date.today().isoformat()
    ver = "; ".join(f"{k}: " + ", ".join(f"{p} {x}" for p, x in d.items()) for k, d in v.items())
    lines = [
        "# OpInfo pass rates: ours vs torchax and litert-torch", "",
        f"Measured {today} on {platform.machine()} Linux, {os.cpu_count()} cores, {jobs} worker processes "
        f"(shared machine); Python {platform.python_version()}. Versions: {ver}. "
        f"Command: `{command}` (`make bench` runs it as `opinfo-peers`). Wall time (s): "
        + ", ".join(f"{k} {s}" for k, s in report["seconds"].items()) + "."
        + _reused_note(report.get("reused", {})),
        "",
        "Cases: the OpInfo cases of `torchtpu-export coverage --source opinfo` (torchtpu_export/coverage/opinfo.py: "
        "each op_db entry's first float32 samples, integer or bool for ops without float32, batched into one "
        "module), torch's generator seeded. Of the "
        f"{report['opinfos']} OpInfos, **{n}** are compared: those with a deterministic sample that torch.export "
        "captures in our harness. That one set is the denominator of every column; the other "
        f"{len(report['excluded'])} (no sample, random ops, eager fails, torch.export fails) are left out of "
        "all four. Ours and the peers run the same saved program on the same input tensors; every column is "
        "judged by the same comparison (max error within 1e-05 of the output's scale, integers and bools "
        "exactly; the litert column and litert-torch may return int32 for int64).", "",
        "torchax: `torchax.export.exported_program_to_jax` of the saved `torch.export` program, `jax.jit`, run "
        "on CPU, after `torchax.enable_accuracy_mode()` (64-bit types kept, the torch semantics); it needs "
        "benchmarks/torchax_shim.py to import on torch 2.13. litert-torch: `litert_torch.convert(program.module(), "
        "inputs)` in its own venv (its own torch), the result run by its LiteRT interpreter. A crash or a "
        f"run past {CASE_TIMEOUT_S:.0f} s is an `error`; `unsupported` is the peer saying it has no lowering "
        "for an op (torchax: `OperatorNotFound` or its interpreter's missing-op assertion; litert-torch: "
        "`Lowering not found`).", "",
    ]
    pairs = [("xla", "torchax"), ("litert", "litert_torch")]
    lines += ["| column | " + " | ".join(STATUSES) + " | pass rate |", "|---|" + "---|" * (len(STATUSES) + 1)]
    for ours, peer in pairs:
        for col in (ours, peer):
            if col != ours and col not in peers:
                continue
            counts = {s: sum(1 for c in cases.values() if c[col]["status"] == s) for s in STATUSES}
            label = f"ours {col}" if col == ours else col.replace("_", "-")
            lines.append(f"| {label} | " + " | ".join(str(counts[s]) for s in STATUSES)
                         + f" | {counts['pass']}/{n} ({100 * counts['pass'] / max(n, 1):.1f} %) |")
    for ours, peer in pairs:
        if peer not in peers:
            continue
        only_peer = sorted(k for k, c in cases.items() if c[peer]["status"] == "pass" and c[ours]["status"] != "pass")
        only_ours = sorted(k for k, c in cases.items() if c[ours]["status"] == "pass" and c[peer]["status"] != "pass")
        pname = peer.replace("_", "-")
        lines += ["", f"## {pname} passes, ours {ours} does not ({len(only_peer)})", ""]
        if only_peer:
            lines += [f"| OpInfo | ours {ours} |", "|---|---|"]
            lines += [f"| `{k}` | {_cell(cases[k][ours])} |" for k in only_peer]
        else:
            lines.append("None.")
        lines += ["", f"Ours {ours} passes and {pname} does not: {len(only_ours)} cases.", ""]
        reasons: dict = {}
        for k in only_ours:
            c = cases[k][peer]
            key = c["status"] + ": " + re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", (c.get("reason") or "")[:70])
            reasons.setdefault(key, []).append(k)
        if reasons:
            lines += [f"| {pname} cell (digits as N) | cases | examples |", "|---|---|---|"]
            for key, ks in sorted(reasons.items(), key=lambda kv: -len(kv[1]))[:15]:
                lines.append(f"| {key.replace('|', '/')} | {len(ks)} | {', '.join(f'`{x}`' for x in ks[:4])} |")
    lines += ["", "## Every compared case", "", "| OpInfo | ours xla | torchax | ours litert | litert-torch |",
              "|---|---|---|---|---|"]
    for k, c in sorted(cases.items()):
        lines.append(f"| `{k}` | " + " | ".join(c[col]["status"] if col in c else "-"
                                              for col in ("xla", "torchax", "litert", "litert_torch")) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        _peer_loop(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="only OpInfos whose name contains this")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per case and column")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: torchax,litert_torch")
    p.add_argument("-o", "--output", help="write the markdown table here")
    p.add_argument("--json", help="write every cell as JSON here")
    p.add_argument("--keep", help="keep the saved cases in this folder")
    p.add_argument("--peer-cells", help="take the peers' cells from this earlier --json report instead of rerunning "
                   "them (only our columns are measured again)")
    args = p.parse_args()
    peers = [x for x in args.peers.split(",") if x]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    work = args.keep or tempfile.mkdtemp(prefix="opinfo-peers-")
    try:
        reuse = None
        if args.peer_cells:
            with _open_text(args.peer_cells) as f:
                reuse = json.load(f)
        report = measure(args.ops, args.jobs, args.timeout, peers, work, reuse)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    command = " ".join(["python -m benchmarks.opinfo_peers"]
                       + [os.path.relpath(a, REPO) if os.path.isabs(a) else a for a in sys.argv[1:]])
    text = to_markdown(report, command, args.jobs)
    if args.json:  # a name ending in .gz is written compressed (the committed report is)
        with _open_text(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)
    return 0


def _open_text(path: str, mode: str = "r"):
    import gzip
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


if __name__ == "__main__":
    sys.exit(main())
