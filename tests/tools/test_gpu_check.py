"""`ggraph gpu-check` (tools/gpu_check.py and its gpu_*.py parts) without a GPU.

Tests marked `cudasim` run under numba's CUDA simulator, in the process tests/conftest.py
starts with NUMBA_ENABLE_CUDASIM=1 (or: NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim
tests/tools/test_gpu_check.py): the device-side input check catching a corrupted device copy and a
kernel that writes into its source, the random-weight decode model's weights, the --json
report's sections (tiny decode with its launch count included), conformance split over child
processes, and a sanitizer run through a stand-in compute-sanitizer. The others need no CUDA
at all (sanitizer summaries and budgets, merging shards, killing a hung child with its own
children, case selection, section flags, torch's peer shapes on the CPU) and run in the main
suite.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time

import numpy as np
import pytest

from ggraph.ir.opkind import OpKind
from ggraph.tools import gpu_check
from ggraph.tools.gpu import gpu_child, gpu_perf
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
sim_only = pytest.mark.skipif(not SIM, reason="needs NUMBA_ENABLE_CUDASIM=1 before numba is "
                              "imported (tests/conftest.py runs these in their own process)")


@pytest.fixture(scope="module")
def sim():
    """The simulator's runtime and a fresh backend factory (imported only where enabled)."""
    from ggraph.backends.cuda import CUDABackend, runtime as R

    if not R.SIM:
        pytest.skip("numba.cuda was imported before NUMBA_ENABLE_CUDASIM=1 took effect")
    sys.setswitchinterval(5e-4)  # simulated threads wait on each other at barriers
    return R, CUDABackend


# -- no CUDA needed -----------------------------------------------------------------------------

def test_sanitizer_summaries_are_parsed():
    memcheck = "========= COMPUTE-SANITIZER\n...\n========= ERROR SUMMARY: 3 errors\n"
    assert gpu_child.parse_summary(memcheck) == {"errors": 3}
    race = ("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
            "========= ERROR SUMMARY: 1 error\n")
    assert gpu_child.parse_summary(race) == {"errors": 1, "hazards": 2, "race_errors": 1,
                                             "race_warnings": 1}
    # CUDA 13's racecheck (the H200's): its own line alone, which counts as the summary
    race13 = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert gpu_child.parse_summary(race13) == {"errors": 0, "hazards": 0, "race_errors": 0,
                                               "race_warnings": 0}
    assert gpu_child.parse_summary(race13.replace("(0 errors", "(2 errors"))["errors"] == 2
    assert gpu_child.parse_summary("Traceback ...\nKilled") == {"errors": None}


def test_sanitizer_is_found_under_cuda_home(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "compute-sanitizer"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert gpu_child.find_sanitizer() == str(exe)


def test_sanitizer_children_run_conformance_only_on_their_subset():
    args = gpu_child.sanitizer_args("racecheck", ["--tiny"])
    assert args[args.index("--sections") + 1] == "conformance"
    assert args[args.index("--jobs") + 1] == "1" and args[-1] == "--tiny"
    ops = args[args.index("--ops") + 1].split(",")
    assert {"mul_mat", "soft_max", "flash_attn_ext"} <= set(ops)
    picked = gpu_check.select_cases([OpKind[o.upper()] for o in ops],
                                    int(args[args.index("--per-op") + 1]),
                                    args[args.index("--match") + 1])
    labels = [c.label for c in picked]
    assert len(labels) == len(ops), labels  # one case of each op: the regex finds each
    mm = next(c for c in picked if c.op == OpKind.MUL_MAT)
    assert dict(mm.vars)["n"] > 8  # the tiled kernel (shared memory), not the mat-vec


def test_sanitizer_runs_skip_when_the_budget_is_spent():
    runs = list(gpu_child.sanitizer_runs("/nonexistent/compute-sanitizer", lambda: 30.0, []))
    assert [t for t, _ in runs] == ["memcheck", "racecheck"]
    assert all("time budget" in r["skipped"] for _, r in runs)
    assert gpu_child.sanitizer_line(*runs[0]).startswith("sanitizer memcheck: skipped")


def test_a_shard_that_crashed_is_a_failing_case():
    ok = gpu_child.ChildRun(["x"], rc=0, output="  SCALE(a): OK\n", report={
        "conformance": {"cases": [{"case": "SCALE(a)", "op": "SCALE", "status": "OK"}]},
        "inputs": {"checked": 2, "bytes": 64, "mismatches": []}})
    dead = gpu_child.ChildRun(["y"], rc=-9, output="Traceback (most recent call last)\nBoom\n")
    conf, inputs, lines = gpu_child.merge_shards([ok, dead])
    assert conf["jobs"] == 2 and conf["passed"] == 1 and conf["tested"] == 2
    assert conf["failed"] == 1 and "exit status -9" in conf["cases"][1]["detail"]
    assert inputs == {"checked": 2, "bytes": 64, "mismatches": [], "status": "OK"}
    assert lines == ["  SCALE(a): OK", "  shard 1/2: FAIL (exit status -9, no report)"]


def test_a_child_past_its_timeout_goes_with_its_own_children():
    """What a hung sanitizer run does: the wrapper and the process it started are killed."""
    r = gpu_child.run_child([], 1.0, wrap=["sh", "-c", "sleep 60 & echo $!; wait", "sh"])
    assert r.timed_out and r.seconds < 30 and r.report is None
    pid = int(r.output.split()[0])
    for _ in range(50):  # the grandchild: gone, or a zombie waiting for init
        try:
            with open(f"/proc/{pid}/status") as f:
                if "zombie" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"sleep {pid} outlived its group")


def test_case_selection_per_op_match_and_shards():
    ops = [OpKind.SCALE, OpKind.SILU, OpKind.MUL_MAT]
    every = gpu_check.select_cases(ops)
    first = gpu_check.select_cases(ops, per_op=1)
    assert [c.op for c in first] == [OpKind.SCALE, OpKind.SILU, OpKind.MUL_MAT]
    f16 = gpu_check.select_cases(ops, match=r"type=f16")
    assert f16 and all("type=f16" in c.label for c in f16)
    shards = [gpu_check.select_cases(ops, shard=(i, 3)) for i in range(3)]
    assert sorted(c.label for s in shards for c in s) == sorted(c.label for c in every)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_sections_flags():
    ap = argparse.ArgumentParser()
    gpu_check.add_arguments(ap)
    assert gpu_check._sections(ap.parse_args([])) == list(gpu_check.SECTIONS)
    got = gpu_check._sections(ap.parse_args(["--no-decode", "--no-sanitizer", "--no-perf"]))
    assert got == ["conformance", "graphs", "launch"]
    assert gpu_check._sections(ap.parse_args(["--ptx"])) == ["conformance", "graphs"]
    with pytest.raises(ValueError, match="unknown section"):
        gpu_check._sections(ap.parse_args(["--sections", "conformance,speed"]))


def test_torch_peers_match_the_perf_cases_shapes():
    """torch at the tiny perf shapes on the CPU (wall clock): every ggraph perf case finds
    its peers (F32 mul_mat: torch F32, TF32, BF16; Q4_1: BF16; flash: SDPA)."""
    pytest.importorskip("torch")
    peers = gpu_perf.torch_peers(tiny=True, min_seconds=0.01, device="cpu")
    perf = [{"case": name, "us": 10.0} for name, *_ in gpu_perf.perf_cases(tiny=True)]
    table = gpu_perf.peer_table(perf, peers)
    by_case: dict[str, list[str]] = {}
    for r in table:
        by_case.setdefault(r["case"], []).append(r["peer"])
        assert r["torch_us"] > 0 and r["ratio"] == pytest.approx(10.0 / r["torch_us"])
    assert set(by_case) == {p["case"] for p in perf}
    for case, got in by_case.items():
        want = (["torch.matmul f32", "torch.matmul tf32", "torch.matmul bf16"]
                if "type=f32" in case else ["torch.matmul bf16"] if "q4_1" in case
                else ["torch sdpa f16"])
        assert got == want, case
    assert gpu_perf.peer_lines(table)[0].split()[:2] == ["case", "ggraph"]


# -- under the simulator ----------------------------------------------------------------------

@pytest.mark.cudasim
@sim_only
def test_device_input_check_sees_a_corrupted_device_copy(sim):
    R, CUDABackend = sim
    from ggraph.check.conformance import cases_for, run_case

    backend = CUDABackend()
    kept = gpu_check.track_uploads(backend)
    case = next(iter(cases_for([OpKind.SCALE])))
    assert run_case(case, backend).status == "OK"
    ok = gpu_check.check_device_inputs(backend, kept)
    assert ok["status"] == "OK" and ok["checked"] >= 1 and not ok["mismatches"]
    t = kept[0]
    host, dev = backend.buffers.uploaded(t)
    before = host.copy()
    first = np.asarray(backend.buffers.to_host(dev))[:1]
    backend.buffers.write_bytes(dev, 0, first ^ np.uint8(0xFF))  # one flipped byte on the device
    bad = gpu_check.check_device_inputs(backend, kept)
    assert bad["status"] == "FAIL" and len(bad["mismatches"]) == 1
    m = bad["mismatches"][0]
    assert m["tensor"] == t.describe() and m["bytes_differ"] == 1 and m["first_offset"] == 0
    assert np.array_equal(host, before)  # the host array, which conformance compares, is fine
    assert "FAIL" in gpu_check.inputs_lines(bad)[0]


@pytest.mark.cudasim
@sim_only
def test_kernel_writing_into_its_source_passes_conformance_but_not_the_input_check(
        sim, tmp_path, monkeypatch):
    """A SCALE kernel that computes the right values and then zeroes its source's first bytes
    on the device: the results and the host arrays are right, only the read-back sees it."""
    R, _ = sim
    from ggraph.backends.base import Kernel
    from ggraph.backends.cuda import kernels as CK

    real = CK.KERNELS[OpKind.SCALE]

    def scale_then_scribble(node, session):
        launch = real.fn(node, session)
        buf, off = session.storage(node.src[0])

        def run():
            launch()
            session.backend.buffers.write_bytes(buf, off, np.zeros(4, np.uint8))  # the bug
        return run

    monkeypatch.setitem(CK.KERNELS, OpKind.SCALE,
                        Kernel(scale_then_scribble, real.accepts, real.why_not, bind=True))
    path = tmp_path / "g.json"
    rc = gpu_check.main(["--tiny", "--ops", "scale", "--per-op", "1", "--sections",
                         "conformance", "--json", str(path)])
    rep = json.loads(path.read_text())
    assert rep["conformance"]["passed"] == rep["conformance"]["tested"] == 1
    assert rc == 1 and rep["inputs"]["status"] == "FAIL" and rep["failed"] == 1
    m = rep["inputs"]["mismatches"][0]
    assert "f32 ne=[33, 4, 3, 1]" in m["tensor"] and m["first_offset"] == 0


@pytest.mark.cudasim
@sim_only
@pytest.mark.parametrize("wtype", ["q8_0", "q4_1"])
def test_random_weights_are_made_on_the_device_with_finite_scales(sim, wtype):
    R, CUDABackend = sim
    from ggraph.tools.gpu import gpu_decode as D
    from ggraph.ir.types import GGMLType

    backend = CUDABackend()
    model, weights = D.random_model(D.TINY, GGMLType.parse(wtype))
    assert all(w.data is None and w.buffer == "model" for w in weights)  # nothing to upload
    session = backend.session()
    D.fill_weights(session, weights)
    assert all(backend.buffers.uploaded(w) is None for w in weights)
    mats = [w for w in weights if w.ne[1] > 1]
    assert {w.type for w in mats} == {GGMLType.parse(wtype)}
    for w in mats:
        v = session.read(w)
        assert np.isfinite(v).all()
        assert 0.7 < v.std() * np.sqrt(w.ne[0]) < 1.3, w.name  # std 1/sqrt(row length)
        assert abs(v.mean()) < 0.2 * v.std(), w.name
    norm = next(w for w in weights if w.ne[1] == 1)
    assert np.array_equal(session.read(norm), np.ones(norm.shape, np.float32))
    a, b = (session.read(w) for w in mats[:2])
    assert not np.array_equal(a.ravel()[:64], b.ravel()[:64])  # each tensor its own bytes


@pytest.mark.cudasim
@sim_only
def test_json_report_has_every_section(sim, tmp_path):
    path = tmp_path / "g.json"
    rc = gpu_check.main(["--tiny", "--ops", "scale", "--no-graphs", "--json", str(path)])
    rep = json.loads(path.read_text())
    assert rc == 0 and rep["failed"] == 0 and rep["mode"] == "sim"
    assert "simulator" in rep["device"]
    geo = rep["geometry"]
    assert geo["kind"].startswith("small") and geo["templates"]["EW_NT"] > 0
    assert geo["templates_mm"]["MM_NT"] > 0 and geo["MAX_BLOCKS"] > 0
    assert rep["conformance"]["passed"] == rep["conformance"]["tested"] == 3
    assert rep["inputs"]["status"] == "OK" and rep["inputs"]["checked"] >= 3
    assert {r["case"].split("(")[0] for r in rep["perf"]} == {"mul_mat", "flash_attn_ext"}
    for r in rep["perf"]:  # the simulator's events carry no time: wall clock alone
        assert "gflops" in r and r["event_us"] is None and r["wall_us"] > 0 and r["launches"] >= 1
    assert "not on a GPU" in rep["torch"]["skipped"]
    assert "not on a GPU" in rep["sanitizer"]["skipped"]
    assert set(rep["skipped"]) == {"torch", "sanitizer"}
    launch = rep["launch"]
    assert launch["bound_launch"]["wall_us"] > 0 and launch["bound_launch"]["runs"] >= 1
    assert launch["session_run_1_node"]["wall_us"] > 0 and launch["dispatcher"]["wall_us"] > 0
    assert launch["replay"]["mode"] == "sim"
    dec = rep["decode"]
    assert dec["shape"]["n_layer"] == 1 and "made on the device" in dec["model"]
    assert [r["flash_attn"] for r in dec["rows"]] == [False, True]
    for r in dec["rows"]:
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["logits_finite"] and r["gpu_ms_per_token"] is None
        # per layer: norms, Q/K/V, rope, cache stores, attention, output, FFN; then the head
        assert 10 <= r["launches_per_token"] <= 60
    assert set(rep["seconds"]) >= {"conformance", "perf", "launch", "decode", "total"}


@pytest.mark.cudasim
@sim_only
def test_conformance_split_over_child_processes(sim, tmp_path, capsys):
    path = tmp_path / "g.json"
    rc = gpu_check.main(["--tiny", "--ops", "scale,silu", "--jobs", "2", "--sections",
                         "conformance", "--json", str(path)])
    rep = json.loads(path.read_text())
    conf = rep["conformance"]
    assert rc == 0 and conf["jobs"] == 2
    n = len(gpu_check.select_cases([OpKind.SCALE, OpKind.SILU]))
    assert conf["passed"] == conf["tested"] == n and len(conf["cases"]) == n
    assert rep["inputs"]["status"] == "OK" and rep["inputs"]["checked"] >= n
    out = capsys.readouterr().out
    assert out.count(": OK") == n and f"conformance: {n}/{n} tests passed" in out


@pytest.mark.cudasim
@sim_only
def test_sanitizer_run_through_a_stand_in_tool(sim, tmp_path):
    """The child process and the summary parsing, with a script standing in for
    compute-sanitizer: it drops `--tool T --print-limit N`, runs the rest, prints a summary."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\nrc=$?\n"
                    "echo '========= ERROR SUMMARY: 0 errors'\nexit $rc\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    r = gpu_child.run_sanitizer(str(fake), "memcheck", 300,
                                ["--tiny", "--ops", "scale", "--per-op", "1"])
    assert r["status"] == "OK" and r["errors"] == 0 and not r["timed_out"], r["output_tail"]
    assert r["cases_passed"] == r["cases_tested"] == 1
    assert r["argv"][:3] == [str(fake), "--tool", "memcheck"]
