"""Speed and memory of every router against the baseline (bench.py), at toy sizes on the CPU."""

import builtins
import errno
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest
import torch

import bench
import methods
from conftest import error_of

def test_bench_runs_and_reports_ratios(tmp_path, capsys):
    path = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--routers", "none,lime,first-2,lime", "--n-layer", "4", "--block-size", "16",
                "--batch-size", "1", "--steps", "1", "--warmup", "1", "--gen-tokens", "2", "--gen-repeats", "1",
                "--depths", "2", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["shape"]["n_layer"] == 4 and saved["shape"]["n_embd"] == 384
    assert [run["n_layer"] for run in saved["runs"]] == [4, 2]
    rows = {r["router"]: r for r in saved["runs"][0]["results"]}
    assert [r["router"] for r in saved["runs"][0]["results"]] == ["none", "lime", "first-2"]  # each once
    for r in rows.values():
        assert r["step_ratio"] == pytest.approx(r["ms_per_step"] / rows["none"]["ms_per_step"])
        assert r["memory_ratio"] == pytest.approx(r["memory_bytes"] / rows["none"]["memory_bytes"])
        assert r["mfu"] is None and r["gen_tokens_per_s"] > 0  # no MFU on a CPU
    assert rows["lime"]["flops_per_token"] > rows["first-2"]["flops_per_token"] > rows["none"]["flops_per_token"]
    assert rows["none"]["memory_bytes"] < rows["lime"]["memory_bytes"] < 1.15 * rows["none"]["memory_bytes"]
    out = capsys.readouterr().out
    # what it is doing, before the table: at the default sizes a CPU takes minutes to get there
    phases = ["3 mode(s) at 4 layers: building them, 1 warm-up step(s) each ...", "1 timed step(s) each, taking turns",
              "generation, 1 timing(s) each", "x none"]
    assert all(phase in out for phase in phases) and sorted(phases, key=out.index) == phases


def test_each_figure_is_the_median_of_its_timings(monkeypatch):
    """ms/step the median of a mode's timed steps (not their mean, nor the first), tokens/s and generation's tokens/s
    from the medians, MFU the model's FLOPs at those tokens/s over the device's peak: on a clock that each step and
    each generation moves on by what the test says."""
    clock, steps, gens = [0.0], {"none": [0.3, 0.1, 0.2], "lime": [0.5, 0.4, 0.9]}, {"none": [2.0, 1.0, 4.0],
                                                                                   "lime": [3.0, 3.0, 1.0]}
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench.Runner, "train_step", lambda self, idx, autocast: clock.__setitem__(
        0, clock[0] + steps[self.router].pop(0)))  # (no warm-up: every step is timed)
    turns = iter(["none", "lime"] * 3)  # the modes generate by turns too
    monkeypatch.setattr(bench, "generate", lambda model, idx, n, temperature: clock.__setitem__(
        0, clock[0] + gens[next(turns)].pop(0)))
    monkeypatch.setattr(bench, "peak_flops", lambda device, dtype: 1e12)
    shape = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16, vocab_size=32, block_size=8, batch_size=2)
    args = types.SimpleNamespace(dtype="float32", compile="off", warmup=0, steps=3, profile=False, gen_repeats=3,
                                 gen_tokens=4)
    results = {r["router"]: r for r in bench.measure(["none", "lime"], shape, args, "cpu")}
    for router, step_s, gen_s in (("none", 0.2, 2.0), ("lime", 0.5, 3.0)):
        r = results[router]
        assert r["ms_per_step"] == pytest.approx(1000 * step_s) and r["tokens_per_s"] == pytest.approx(2 * 8 / step_s)
        assert r["gen_tokens_per_s"] == pytest.approx(2 * 4 / gen_s)
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * 2 * 8 / step_s / 1e12)
    assert bench.add_ratios(list(results.values())) == "none" and results["lime"]["step_ratio"] == pytest.approx(2.5)
    clock[0], calls = 0.0, iter([100.0, 100.0, 100.0, 1.0])  # the routing op alone: three untimed calls first
    assert bench.time_op(lambda: clock.__setitem__(0, clock[0] + next(calls)), "cpu", 1) == pytest.approx(1000.0)


def test_the_tables_show_mib_and_the_change_from_the_base(capsys):
    """report(): memory in MiB; print_profile(): each kind's change from the base mode, signed."""
    row = dict(ms_per_step=1.0, tokens_per_s=1.0, memory_bytes=10 * 2**20, gen_tokens_per_s=None, mfu=None)
    bench.report([dict(row, router="none")], "t")
    assert capsys.readouterr().out.splitlines()[-1].split()[5] == "10.0"

    def profile(ms):
        return dict(steps=1, busy_ms=ms, kinds={"matmul": (ms, 1)}, top=[])
    bench.print_profile([dict(router="none", ms_per_step=1.0, profile=profile(1.0)),
                         dict(router="lime", ms_per_step=3.0, profile=profile(3.0))], "none")
    matmul = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("matmul"))
    assert matmul.split() == ["matmul", "1.00", "(", "1)", "+0.00", "3.00", "(", "1)", "+2.00"]
    bench.print_profile([dict(router="lime", ms_per_step=3.0, profile=profile(3.0))], "none")  # (a --suite part
    matmul = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("matmul"))
    assert matmul.split() == ["matmul", "3.00", "(", "1)", "-"]  # whose none failed: no change from another model)


@pytest.fixture
def commands(monkeypatch):
    """The command lines of the fresh processes bench.py starts, each run in this process instead (for time)."""
    started = []

    def run_in_this_process(cmd):
        started.append(cmd)
        bench.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", run_in_this_process)
    return started


def test_bench_fresh_process_per_mode(tmp_path, capsys, monkeypatch, commands):
    """What CUDA does: each mode alone in a fresh process (here the process runs in this one, for time), at each
    depth of --depths its own."""
    path = tmp_path / "bench.json"
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=3, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=4, batch_size=2))
    bench.main(["--device", "cpu", "--shape", "t", "--routers", "lime,none", "--n-layer", "2", "--block-size", "8",
                "--batch-size", "1", "--steps", "1", "--gen-repeats", "0", "--fresh-processes", "--depths", "1",
                "--json", str(path)])
    assert [c[:2] for c in commands] == [[sys.executable, str(Path(bench.__file__).resolve())]] * 4
    assert [c[-6:-2] for c in commands] == [["--routers", r, "--n-layer", n] for n in "21" for r in ("lime", "none")]
    runs = json.loads(path.read_text())["runs"]
    assert [r["params"] for r in runs[1]["results"]] < [r["params"] for r in runs[0]["results"]]  # (1 layer, not 2)
    rows = runs[0]["results"]
    assert [r["router"] for r in rows] == ["lime", "none"]
    assert rows[0]["step_ratio"] == pytest.approx(rows[0]["ms_per_step"] / rows[1]["ms_per_step"])  # to none
    assert rows[0]["gen_tokens_per_s"] is None
    assert "lime: in a fresh process" in capsys.readouterr().out


def test_bench_suite_measures_every_part_and_goes_on_after_a_cut(tmp_path, capsys, monkeypatch, commands):
    """--suite: the routing op, then each router of each shape in its own process; a second run keeps the parts
    the JSON holds (a command cut short by a time limit goes on from there)."""
    tiny = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16, vocab_size=32, block_size=8, batch_size=1)
    monkeypatch.setitem(bench.SHAPES, "t1", tiny)
    monkeypatch.setitem(bench.SHAPES, "t2", {**tiny, "n_layer": 3})
    monkeypatch.setattr(bench, "SUITE", [("t1", "kernels"), ("t1", "none,lime"), ("t2", "first-2")])
    path, argv = tmp_path / "suite.json", ["--device", "cpu", "--suite", "--steps", "1", "--gen-repeats", "0",
                                           "--json", str(tmp_path / "suite.json")]
    out = bench.main(argv)
    printed = capsys.readouterr()
    assert "note: --suite on cpu times the GPU shapes (t1, t2), which take hours there" in printed.err
    assert f"wrote {path} (1 of 3 parts)" in printed.out and printed.out.endswith(f"wrote {path} (3 of 3 parts)\n")
    assert [part["part"] for part in out["suite"]] == ["t1: kernels", "t1: none,lime", "t2: first-2"]
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert [(c[c.index("--shape") + 1], c[-5]) for c in commands] == [
        ("t1", "none"), ("t1", "lime"), ("t2", "first-2")]  # each model in its own process
    rows = out["suite"][1]["results"]
    assert [r["router"] for r in rows] == ["none", "lime"] and rows[1]["step_ratio"] > 0
    assert [r["op"] for r in out["suite"][0]["kernels"]] == ["copy", "forward, layer 0", "backward, layer 0",
                                                              "forward, layer 1", "backward, layer 1"]  # each once
    assert bench.kernel_rows(out["suite"][0]["kernels"]) and not bench.kernel_rows("garbage")  # (kept: checked)
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "suite": saved["suite"][:2]}))  # as if cut during the last part
    commands.clear()
    again = bench.main(argv)
    assert [c[-5] for c in commands] == ["first-2"] and again["suite"][:2] == saved["suite"][:2]
    assert "t1: none,lime: kept from" in capsys.readouterr().out
    # a model of the second part measured again (its figure damaged), and the run cut there (a time limit's SIGTERM):
    # the parts after it stay in the file (it was written without them: measured again only once reached)
    part = saved["suite"][1]
    damaged = {**part, "results": [part["results"][0], {**part["results"][1], "ms_per_step": "x"}]}
    path.write_text(json.dumps({**saved, "suite": [saved["suite"][0], damaged, saved["suite"][2]]}))
    in_this_process = bench.subprocess.run
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert json.loads(path.read_text())["suite"] == [saved["suite"][0], damaged, saved["suite"][2]]
    # its process failed instead (out of memory, say): the suite goes on to the parts after it, and says so at the end
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 137) if "lime" in cmd
                        else in_this_process(cmd))
    path.write_text(json.dumps({**saved, "suite": [saved["suite"][0], damaged]}))  # (the last part to measure)
    commands.clear()
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 1 and capsys.readouterr().err.endswith(
        "\nbench.py: t1: none,lime: lime: the lime process failed (exit code 137); its output is above; the suite goes "
        "on\nbench.py: error: 1 model(s) failed (above), the rest measured and saved; run again to measure them: t1: "
        "none,lime: lime\n")
    assert [c[-5] for c in commands] == ["first-2"]  # (the model after it, measured)
    held = json.loads(path.read_text())["suite"]
    assert [[r["router"] for r in p["results"]] for p in held[1:]] == [["none"], ["first-2"]]
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 137))  # every model
    path.write_text(json.dumps({**saved, "suite": saved["suite"][:1]}))
    with pytest.raises(SystemExit):  # (a part of no figures: no table, and no traceback for it)
        bench.main(argv)
    assert capsys.readouterr().err.endswith("run again to measure them: t1: none,lime: none, t1: none,lime: lime, "
                                            "t2: first-2: first-2\n")
    monkeypatch.setattr(bench.subprocess, "run", in_this_process)
    path.write_text(json.dumps(saved))
    # the routing op timed over other tiles (a --sweep, or an older TILES) is not this run's figure: timed again
    retiled = [{**again["suite"][0], "tiles": [[64, 8, 16]]}, *again["suite"][1:]]
    path.write_text(json.dumps({**again, "suite": retiled}))
    bench.main(argv)
    out = capsys.readouterr().out
    assert "t1: kernels: kept" not in out and "t1: none,lime: kept from" in out
    assert json.loads(path.read_text())["suite"][0]["tiles"] is None
    commands.clear()  # timed over 2 steps now: not beside the file's figures of 1 step, in a part or its ratios
    again = bench.main([*argv[:3], "--steps", "2", *argv[5:]])["suite"]
    assert "kept" not in capsys.readouterr().out and len(commands) == 3
    assert {part.get("measured", {}).get("steps") for part in again} == {2, None} and \
        {r["measured"]["steps"] for part in again[1:] for r in part["results"]} == {2}


def test_bench_a_mode_whose_process_fails_is_one_line(tmp_path, capsys, monkeypatch):
    """A mode's fresh process that fails (its exit code not 0: killed for memory, say) is one line, exit 1, and no
    figures written, even where it wrote its own before it failed."""
    def fails(cmd):
        Path(cmd[-1]).write_text(json.dumps([{"router": "lime"}]))
        return subprocess.CompletedProcess(cmd, 137)

    monkeypatch.setattr(bench.subprocess, "run", fails)
    path = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--routers", "lime", "--fresh-processes", "--json", str(path)])
    assert (e.value.code, capsys.readouterr().err) == (1, "bench.py: error: the lime process failed (exit code 137); "
                                                          "its output is above\n")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(bench, "measure", lambda *args: (_ for _ in ()).throw(RuntimeError("a fault\nits details")))
    with pytest.raises(SystemExit) as e:  # (the modes in this process: torch's own error, its first line)
        bench.main(["--device", "cpu", "--routers", "lime", "--json", str(path)])
    assert (e.value.code, capsys.readouterr().err) == (1, "bench.py: error: a fault\n")
    monkeypatch.setattr(bench, "measure", lambda *args: (_ for _ in ()).throw(RuntimeError()))
    with pytest.raises(SystemExit) as e:  # an error that says nothing: its name
        bench.main(["--device", "cpu", "--routers", "lime", "--json", str(path)])
    assert (e.value.code, capsys.readouterr().err) == (1, "bench.py: error: RuntimeError\n")
    assert list(tmp_path.iterdir()) == []


def test_bench_a_mode_process_that_cannot_write_its_figures_says_which_file(tmp_path, capsys, monkeypatch):
    """A mode's process whose figures cannot be written (its temporary folder on a full disk) names the file, in one
    line (the line its parent's 'its output is above' points to), not the output."""
    class Full(io.BytesIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path, real = tmp_path / "result.json", open

    def full(file, *args, **kwargs):
        return Full() if str(file).startswith(str(path)) else real(file, *args, **kwargs)

    monkeypatch.setattr(bench, "measure", lambda *args: [{"router": "lime"}])
    for module, name in ((builtins, "open"), (io, "open")):
        monkeypatch.setattr(module, name, full)
    assert error_of(bench.main, ["--device", "cpu", "--routers", "lime", "--worker", str(path)], capsys, code=1) == \
        f"bench.py: error: cannot write {path}: No space left on device"


def test_bench_compiled_models_run_each_alone_with_exact_ratios(capsys, monkeypatch):
    """--compile on, on a CPU too: each mode alone in its own process, as on CUDA; the ratios are each mode's figure
    over none's, whichever comes first."""
    def alone(router, shape, args, argv):
        ms, memory = dict(lime=3.0, none=2.0, hc=5.0)[router], dict(lime=10, none=8, hc=6)[router]
        return dict(router=router, ms_per_step=ms, tokens_per_s=1.0, memory_bytes=memory, gen_tokens_per_s=None,
                    mfu=None)

    monkeypatch.setattr(bench, "measure_alone", alone)
    out = bench.main(["--device", "cpu", "--compile", "on", "--routers", "lime,none,hc", "--n-layer", "2"])
    assert [(r["router"], r["step_ratio"], r["memory_ratio"]) for r in out["runs"][0]["results"]] == [
        ("lime", 1.5, 1.25), ("none", 1.0, 1.0), ("hc", 2.5, 0.75)]
    assert "; each mode in its own process" in capsys.readouterr().out


def test_bench_kernels_times_the_routing_op(tmp_path, capsys):
    """--kernels: the op alone for lime's first, middle and last layer, with the slots each moves."""
    path = tmp_path / "kernels.json"
    bench.main(["--device", "cpu", "--kernels", "--n-layer", "4", "--block-size", "16", "--batch-size", "1",
                "--steps", "1", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["runs"] == []  # no models
    rows = saved["kernels"]
    assert [(r["op"], r["slots"]) for r in rows] == [
        ("copy", 2), ("forward, layer 0", 5), ("backward, layer 0", 6), ("forward, layer 2", 5),
        ("backward, layer 2", 4), ("forward, layer 3", 3), ("backward, layer 3", 3)]
    slot_bytes = 1 * 16 * 6 * 128 * 4  # (B, T, n_kv, 2 head_dim) of the cpu shape, float32
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] == pytest.approx(r["slots"] * slot_bytes / r["ms"] / 1e6)
    assert "backward, layer 0" in capsys.readouterr().out


def test_bench_profile_says_where_the_step_goes(tmp_path, capsys, monkeypatch, commands):
    """--profile: each mode's step by kind of work, every op counted once, and the routing lime's alone: the
    matmuls inside lime::route count as routing, so lime calls as many matmuls as none."""
    path = tmp_path / "bench.json"
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=8, batch_size=1))
    bench.main(["--device", "cpu", "--shape", "t", "--routers", "none,lime", "--steps", "1", "--warmup", "0",
                "--gen-repeats", "0", "--profile", "--fresh-processes", "--json", str(path)])
    # (as on CUDA: each profile comes back from its own process with the mode's figures)
    profiles = {r["router"]: r["profile"] for r in json.loads(path.read_text())["runs"][0]["results"]}
    for p in profiles.values():
        assert {"matmul", "attention", "optimizer"} <= set(p["kinds"])
        assert sum(ms for ms, _ in p["kinds"].values()) == pytest.approx(p["busy_ms"])
        assert "unattributed" not in p["kinds"]  # (a CPU's busy time is its ops' own: each tied to one)
    assert "routing" not in profiles["none"]["kinds"] and profiles["lime"]["kinds"]["routing"][0] > 0
    assert profiles["lime"]["kinds"]["matmul"][1] == profiles["none"]["kinds"]["matmul"][1]  # the same calls
    # a --suite file keeps a profile only as profile_steps writes it (else its report fails on it, or it is kept)
    assert all(bench.profiled(p) for p in profiles.values())
    assert not any(bench.profiled({**profiles["lime"], key: "garbage"}) for key in ("kinds", "top", "busy_ms"))
    assert "where a step's time goes" in capsys.readouterr().out
    # the names a GPU gives its kernels (H100, torch.compile), and a CPU's ops
    assert [bench.kind_of(name) for name in [
        "_route_bwd", "pytorch_flash::flash_bwd_kernel<Flash_bwd_kernel_traits>", "nvjet_tst_192x192_64x4_2x1_v_bz_TNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
        "Memcpy DtoD (Device -> Device)", "triton_poi_fused_cat_stack_3", "triton_red_fused__log_softmax_2",
        "aten::scaled_dot_product_attention", "aten::mm", "fmha_cutlassF_f32_aligned_64x64_rf_sm80"]] == [
        "routing", "attention", "matmul", "matmul", "optimizer", "copies", "copies", None, "attention", "matmul",
        "attention"]  # (memory-efficient attention's kernel: cutlass in its name too)


def test_a_regions_span_on_the_gpu_is_not_counted_as_its_kernels_again():
    """On CUDA a record_function region (AdamW's step, an Inductor kernel's launch) is also a span on the GPU's
    timeline, as long as what it holds, and may come back as a kernel of its CPU event: each kernel counts once,
    in the busy time too."""
    def event(name, device, us=0.0, kernels=(), parent=None, span=False):
        return types.SimpleNamespace(name=name, device_type=device, is_async=False, is_user_annotation=span,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us), cpu_parent=parent,
                                     kernels=[types.SimpleNamespace(name=n, duration=d) for n, d in kernels],
                                     self_cpu_time_total=0.0)
    CPU, CUDA = bench.DeviceType.CPU, bench.DeviceType.CUDA
    step = event("Optimizer.step#AdamW.step", CPU, kernels=[("Optimizer.step#AdamW.step", 100.0)], span=True)
    events = [step, event("aten::_fused_adamw_", CPU, kernels=[("multi_tensor_apply_kernel", 100.0)], parent=step),
              event("aten::mm", CPU, kernels=[("sm90_xmma_gemm_bf16", 50.0)]),
              # Inductor's launch of one kernel, a region of the kernel's name: the kernel and its span alike
              event("triton_poi_fused_add_0", CPU, kernels=[("triton_poi_fused_add_0", 10.0)] * 2, span=True),
              event("Optimizer.step#AdamW.step", CUDA, 100.0, span=True),
              event("multi_tensor_apply_kernel", CUDA, 100.0),
              event("sm90_xmma_gemm_bf16", CUDA, 50.0), event("triton_poi_fused_add_0", CUDA, 10.0, span=True),
              event("triton_poi_fused_add_0", CUDA, 10.0)]
    p = bench.by_kind(events, on_gpu=True, steps=1)
    assert p["kinds"] == {"optimizer": (0.1, 1), "matmul": (0.05, 1), "the rest": (0.01, 1)}
    assert p["busy_ms"] == pytest.approx(0.16)
    # per step, over 2 steps; a kernel the profiler tied to no op is the busy time's rest
    events = [event("aten::mm", CPU, kernels=[("gemm", 50.0)]), event("aten::mm", CPU, kernels=[("gemm", 50.0)]),
              event("gemm", CUDA, 50.0), event("gemm", CUDA, 50.0), event("orphan", CUDA, 100.0)]
    p = bench.by_kind(events, on_gpu=True, steps=2)
    assert p["kinds"] == {"matmul": (0.05, 1), "unattributed": (pytest.approx(0.05), 0)}
    assert p["busy_ms"] == pytest.approx(0.1)


def test_a_suite_measures_anew_with_other_warm_up_or_kernel_settings(tmp_path, monkeypatch, capsys):
    """A model's figures are kept only where they were timed as this run times them: not after --warmup changed, nor
    with a LIME_* (or compiler) setting in the environment that was not there."""
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "SUITE", [("t", "none")])
    started = []
    monkeypatch.setattr(bench, "measure_alone", lambda router, shape, args, argv: started.append(router) or dict(
        router=router, ms_per_step=1.0, tokens_per_s=1.0, memory_bytes=1, params=1, gen_tokens_per_s=None, mfu=None,
        measured=bench.measured_as(args)))
    argv = ["--device", "cpu", "--suite", "--steps", "1", "--gen-repeats", "0", "--json", str(tmp_path / "s.json")]
    for extra, env, measured in (([], {}, 1), ([], {}, 1), (["--warmup", "2"], {}, 2),
                                 (["--warmup", "2"], {"LIME_TILE": "128/8/0/4/0"}, 3)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        bench.main([*argv, *extra])
        assert len(started) == measured
    capsys.readouterr()


def test_bench_suite_goes_on_from_its_last_model_on_the_same_machine(tmp_path, capsys, monkeypatch, commands):
    """--suite writes its file after every model: a command cut short inside a part (a time limit, a process that
    failed) goes on from its last model, on the same machine; a part cut short on another machine, or a model
    whose figures are damaged, is measured anew, so that a part's ratios come from one machine."""
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "SUITE", [("t", "none,lime,first-2")])
    path = tmp_path / "suite.json"
    argv = ["--device", "cpu", "--suite", "--steps", "1", "--gen-repeats", "0", "--json", str(path)]
    run = bench.subprocess.run
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 137)
                        if "first-2" in cmd else run(cmd))  # the third model's process killed
    with pytest.raises(SystemExit):
        bench.main(argv)
    cut = json.loads(path.read_text())["suite"]
    assert [r["router"] for r in cut[0]["results"]] == ["none", "lime"]  # (the first two models, written)
    assert "wrote {} (1 of 1 parts; of the last, 2 of 3 models)".format(path) in capsys.readouterr().out
    monkeypatch.setattr(bench.subprocess, "run", run)
    commands.clear()
    out = bench.main(argv)["suite"][0]
    assert [c[-5] for c in commands] == ["first-2"]  # only the model not measured yet
    assert [{k: r[k] for k in was} for r, was in zip(out["results"], cut[0]["results"])] == cut[0]["results"]
    assert out["results"][2]["router"] == "first-2" and out["results"][1]["step_ratio"] > 0  # (ratios over all)
    assert "  none: kept from" in capsys.readouterr().out
    for damage, anew in [(dict(machine="another GPU", results=out["results"][:2]),  # cut short elsewhere: all anew
                          ["none", "lime", "first-2"]),
                         (dict(results=[{**out["results"][0], "ms_per_step": "x"}, *out["results"][1:2]]),
                          ["none", "first-2"])]:  # (a damaged figure: measured again, not a traceback in the table)
        path.write_text(json.dumps({**json.loads(path.read_text()), "suite": [{**out, **damage}]}))
        commands.clear()
        bench.main(argv)
        assert [c[-5] for c in commands] == anew
    kernel = tmp_path / "kernels.py"  # code that the models run, changed between two sessions (a kernel's tile, say)
    kernel.write_text("COLUMNS = 256\n")
    monkeypatch.setattr(bench, "TIMED_CODE", (*bench.TIMED_CODE, str(kernel)))
    argv = argv[:5] + ["--gen-repeats", "1", "--gen-tokens", "1"] + argv[7:]
    for change in (lambda: None,  # measured otherwise: generation timed now, not as the file's models were (none)
                   lambda: kernel.write_text("COLUMNS = 512\n"),
                   lambda: monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")):  # or how torch compiles them
        change()
        commands.clear()
        bench.main(argv)
        assert [c[-5] for c in commands] == ["none", "lime", "first-2"]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME", "TRITON_PTXAS_PATH"):  # places, not settings (the last
        monkeypatch.setenv(name, str(tmp_path))  # set by inductor itself as it compiles): no change in a figure
    commands.clear()
    bench.main(argv)
    assert commands == []


def test_a_suite_part_whose_none_failed_has_no_ratios_until_none_is_measured(tmp_path, capsys, monkeypatch):
    """A part's ratios are to its own `none`, never to another model's figures: where the none process failed, its
    other models keep their figures with no ratios, a line says so, and the same command measures none then (the
    others kept), the ratios with it."""
    failing = {"none"}

    def alone(router, shape, args, argv):
        if router in failing:
            raise RuntimeError(f"the {router} process failed (exit code 137); its output is above")
        return dict(router=router, ms_per_step=dict(none=2.0, lime=3.0, hc=5.0)[router], tokens_per_s=1.0,
                    memory_bytes=dict(none=8, lime=10, hc=6)[router] * 2**20, gen_tokens_per_s=None, mfu=None,
                    params=1, measured=bench.measured_as(args))

    monkeypatch.setattr(bench, "measure_alone", alone)
    monkeypatch.setattr(bench, "SUITE", [("150m", "none,lime,hc")])
    path = tmp_path / "suite.json"
    argv = ["--device", "cpu", "--suite", "--steps", "1", "--gen-repeats", "0", "--json", str(path)]
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 1
    rows = json.loads(path.read_text())["suite"][0]["results"]
    assert [(r["router"], r["step_ratio"], r["memory_ratio"]) for r in rows] == [("lime", None, None),
                                                                                 ("hc", None, None)]
    out = capsys.readouterr().out
    assert out[out.index("150m: none,lime,hc: training"):].splitlines()[1:5] == [
        "   router   ms/step    x none     tok/s    MFU  memory MB    x none  gen tok/s",
        "     lime       3.0         -         1      -       10.0         -          -",
        "       hc       5.0         -         1      -        6.0         -          -",
        "no ratios: none failed (above), and a ratio to another model would read as one to none: run again to "
        "measure it"]
    failing.clear()
    measured = []
    monkeypatch.setattr(bench, "measure_alone", lambda router, *rest: measured.append(router) or alone(router, *rest))
    rows = bench.main(argv)["suite"][0]["results"]
    assert measured == ["none"]  # (the others kept)
    assert [(r["router"], r["step_ratio"], r["memory_ratio"]) for r in rows] == [
        ("none", 1.0, 1.0), ("lime", 1.5, 1.25), ("hc", 2.5, 0.75)]
    assert json.loads(path.read_text())["suite"][0]["results"] == rows


def test_a_figure_is_of_the_code_of_every_method():
    """--suite measures a model anew where the code it times changed: every module of methods.MODULES among it (the
    parts time ablations.py's routers; a fork's module is there once it is in MODULES)."""
    assert {f"{m.replace('.', '/')}.py" for m in methods.MODULES} <= set(bench.TIMED_CODE)


def test_bench_suite_holds_a_part_to_its_gpu_not_to_the_host_name(monkeypatch):
    """A part cut short is finished on the same GPU only: on CUDA the machine is the GPU's UUID, whatever the host is
    called (a container's name changes from one start to the next, on the same GPU); on a CPU it is the host."""
    names = iter(["container-1", "container-2", "container-3", "container-4"])
    monkeypatch.setattr(bench.socket, "gethostname", lambda: next(names))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), dict(uuid="1234"))())
    assert bench.machine_of("cuda") == bench.machine_of("cuda:0") == "GPU-1234"
    assert bench.machine_of("cpu") != bench.machine_of("cpu")  # (the host's name: here, each call another)


def test_bench_suite_keeps_a_part_by_its_shape_too(tmp_path, capsys, monkeypatch):
    """A part of --suite is kept by its name, shape and what it times both: the routing op timed at one shape is not
    kept for another's (the README's suite times it at 150m and at 1b)."""
    tiny = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16, vocab_size=32, block_size=8, batch_size=1)
    monkeypatch.setitem(bench.SHAPES, "t1", tiny)
    monkeypatch.setitem(bench.SHAPES, "t2", {**tiny, "n_layer": 3})
    monkeypatch.setattr(bench, "SUITE", [("t1", "kernels")])
    argv = ["--device", "cpu", "--suite", "--steps", "1", "--json", str(tmp_path / "suite.json")]
    first = bench.main(argv)["suite"]
    monkeypatch.setattr(bench, "SUITE", [("t1", "kernels"), ("t2", "kernels")])
    again = bench.main(argv)["suite"]
    assert again[0] == json.loads(json.dumps(first[0])) and "t1: kernels: kept from" in capsys.readouterr().out
    assert again[1]["part"] == "t2: kernels" and again[1]["kernels"][-1]["op"] == "backward, layer 2"  # (t2's)


def test_bench_suite_goes_on_with_the_routing_op_from_its_last_tile_on_the_same_machine(tmp_path, capsys, monkeypatch):
    """The routing op's part of --suite (a sweep of many tiles on a GPU) is saved after each layer at each tile: cut
    short, it goes on from there on the same machine, its earlier rows kept in their place; on another machine it is
    timed anew, so that its figures come from one."""
    monkeypatch.setitem(bench.SHAPES, "t1", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                                vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "SUITE", [("t1", "kernels")])
    path = tmp_path / "suite.json"
    argv = ["--device", "cpu", "--suite", "--steps", "1", "--json", str(path)]
    first = bench.main(argv)["suite"][0]
    assert first["finished"] and [r["op"] for r in first["kernels"]] == [
        "copy", "forward, layer 0", "backward, layer 0", "forward, layer 1", "backward, layer 1"]
    assert "wrote {} (0 of 1 parts; of the last, 2 rows)".format(path) in capsys.readouterr().out  # (after layer 0)
    cut = {**first, "kernels": first["kernels"][:3]}
    del cut["finished"]  # as a time limit leaves it, after layer 0
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "suite": [cut]}))
    timed = []
    time_op = bench.time_op
    monkeypatch.setattr(bench, "time_op", lambda fn, device, repeats: timed.append(fn) or time_op(fn, device, repeats))
    again = bench.main(argv)["suite"][0]
    assert len(timed) == 3 and again["finished"]  # a copy, then layer 1's forward and backward
    assert again["kernels"][1:3] == json.loads(json.dumps(first["kernels"][1:3])) and len(again["kernels"]) == 5
    path.write_text(json.dumps({**saved, "suite": [{**cut, "machine": "another"}]}))
    timed.clear()
    bench.main(argv)
    assert len(timed) == 5 and "kept" not in capsys.readouterr().out


def test_bench_suite_keeps_the_parts_of_an_earlier_suite_in_its_file(tmp_path, monkeypatch):
    """A --suite file of an earlier SUITE (its routers grouped in other parts: hours of GPU figures) goes on with this
    one's parts, and the earlier parts stay in the file, not dropped by its first write."""
    monkeypatch.setitem(bench.SHAPES, "t1", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                                vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "SUITE", [("t1", "kernels")])
    path = tmp_path / "suite.json"
    earlier = {"part": "t1: none,lime,first-4", "results": [{"router": "none", "ms_per_step": 1.0}]}
    path.write_text(json.dumps({"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
                                "dtype": "float32", "compile": "off", "suite": [earlier]}))
    out = bench.main(["--device", "cpu", "--suite", "--steps", "1", "--json", str(path)])
    assert [part["part"] for part in json.loads(path.read_text())["suite"]] == ["t1: kernels", earlier["part"]]
    assert json.loads(path.read_text())["suite"][1] == earlier == out["suite"][1]


def test_bench_kernels_sweep_times_every_tile_and_keeps_the_chosen_one(monkeypatch, capsys):
    """--kernels --sweep: the Triton kernels (here in Triton's CPU interpreter) at every tile of TILES, a tile that
    packs only where it packs; the kernels' own block sizes are left as they were."""
    pytest.importorskip("triton")
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "TILES", [(32, 2, 8, 1, 0), (32, 2, 8, 1, 1), (48, 4, 16, 1, 0),  # (Triton refuses 48
                                         (64, 8, 16, 2, 0)])                                      # columns)
    monkeypatch.setattr(bench.kernels, "USE_TRITON", "1")
    monkeypatch.setattr(bench, "time_op", lambda fn, device, repeats: [fn(), 1.0][1])  # each once: interpreted
    chosen = [getattr(bench.kernels, name) for name in bench.kernels.KNOBS]
    out = bench.main(["--device", "cpu", "--kernels", "--sweep", "--shape", "t", "--steps", "1"])
    assert [(r["op"], r["tile"]) for r in out["kernels"]][:7] == [
        ("copy", "-"), ("forward, layer 0", "32/2/8/1/0"), ("backward, layer 0", "32/2/8/1/0"),
        ("forward, layer 0", "32/2/8/1/1"), ("backward, layer 0", "32/2/8/1/1"),  # 2 kv heads: 8 positions as one
        ("forward, layer 0", "64/8/16/2/0"), ("backward, layer 0", "64/8/16/2/0")]
    assert [getattr(bench.kernels, name) for name in bench.kernels.KNOBS] == chosen
    printed = capsys.readouterr().out
    assert "64/8/16/2/0" in printed and "layer 0, tile 48/4/16/1/0: failed (" in printed  # the rest of the sweep timed
    out = bench.main(["--device", "cpu", "--kernels", "--sweep", "--shape", "t", "--steps", "1", "--block-size", "4"])
    assert "32/2/8/1/1" not in {r["tile"] for r in out["kernels"]}  # 4 positions: none packed, no tile timed twice
    monkeypatch.setattr(bench.kernels, "PACK", 1)  # (as LIME_TILE=.../1 sets it) where nothing packs: labelled 0
    out = bench.main(["--device", "cpu", "--kernels", "--shape", "t", "--steps", "1", "--block-size", "4"])
    assert {r["tile"] for r in out["kernels"]} == {"-", "/".join(map(str, chosen[:-1] + [0]))}
    with pytest.raises(Exception, match="power of 2"):  # (not in a sweep: a failure is the run's)
        monkeypatch.setattr(bench.kernels, "COLUMNS", 48)
        bench.main(["--device", "cpu", "--kernels", "--shape", "t", "--steps", "1"])


def test_a_tile_that_leaves_the_gpu_in_error_is_saved_as_failed_and_not_tried_again(tmp_path, monkeypatch, capsys):
    """A tile that fails in a sweep (a compile error) is passed over; one that leaves the GPU in error (an illegal
    address: every later launch fails) ends the run, with the part saved and the tile in it as failed, so that the
    same command goes on past it, not into it again (it would fail the sweep's every call, and the suite's parts after
    it). On another machine it is tried again."""
    pytest.importorskip("triton")
    monkeypatch.setitem(bench.SHAPES, "t", dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16,
                                               vocab_size=32, block_size=8, batch_size=1))
    monkeypatch.setattr(bench, "SUITE", [("t", "kernels")])
    monkeypatch.setattr(bench, "TILES", [(32, 2, 8, 1, 0), (64, 2, 8, 1, 0), (16, 2, 8, 1, 0)])
    monkeypatch.setattr(bench.kernels, "USE_TRITON", "1")
    tried, columns = [], bench.kernels.COLUMNS  # (the kernels' own tile, as the copy is timed)

    def time_op(fn, device, repeats):  # the second tile breaks the GPU (the others not run: their launches are
        # tested in the sweep's own test)
        tried.append(bench.kernels.COLUMNS)
        if bench.kernels.COLUMNS == 64:
            monkeypatch.setattr(bench, "usable", lambda device: False)
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return 1.0

    monkeypatch.setattr(bench, "time_op", time_op)
    path = tmp_path / "suite.json"
    argv = ["--device", "cpu", "--suite", "--sweep", "--steps", "1", "--json", str(path)]
    monkeypatch.setattr(bench, "compiles", lambda how, device: False)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 1 and capsys.readouterr().err.endswith("bench.py: error: tile 64/2/8/1/0 left the GPU in "
                                                                  "error (CUDA error: an illegal memory access was "
                                                                  "encountered): run the same command again to go on "
                                                                  "past it\n")
    part = json.loads(path.read_text())["suite"][0]
    assert part["failed"] == {"64/2/8/1/0": "CUDA error: an illegal memory access was encountered"}
    assert "finished" not in part and [r["tile"] for r in part["kernels"]] == ["-", "32/2/8/1/0", "32/2/8/1/0"]
    monkeypatch.setattr(bench, "usable", lambda device: True)  # (a new process: its GPU is well)
    tried.clear()
    again = bench.main(argv)["suite"][0]
    assert tried == [columns, 16, 16, 32, 32, 16, 16] and again["finished"]  # (the copy first) 64 passed over
    assert again["failed"] == part["failed"] and {r["tile"] for r in again["kernels"]} == {"-", "32/2/8/1/0",
                                                                                           "16/2/8/1/0"}
    path.write_text(json.dumps({**json.loads(path.read_text()), "suite": [{**part, "machine": "another"}]}))
    tried.clear()
    assert bench.main(argv)["suite"][0]["failed"] == part["failed"]  # another GPU: its own rows, but the tile that
    assert 64 not in tried  # failed passed over still (a kernel's fault would be there too)
    # a tile that fails at a later layer, the GPU left in error: its rows of the layers before are kept as it resumes
    timed_64 = []

    def flaky(fn, device, repeats):  # tile 64 timed at layer 0, then failing at layer 1
        if bench.kernels.COLUMNS == 64 and len(timed_64) == 2:
            raise RuntimeError("an illegal memory access")
        timed_64.extend([1] * (bench.kernels.COLUMNS == 64))
        return 1.0

    monkeypatch.setattr(bench, "time_op", flaky)
    path.unlink()
    monkeypatch.setattr(bench, "usable", lambda device: False)
    with pytest.raises(SystemExit):
        bench.main(argv)
    cut = json.loads(path.read_text())["suite"][0]
    monkeypatch.setattr(bench, "usable", lambda device: True)
    resumed = bench.main(argv)["suite"][0]
    assert [r for r in resumed["kernels"] if r["tile"] == "64/2/8/1/0"] == \
        [r for r in cut["kernels"] if r["tile"] == "64/2/8/1/0"] != []


def test_bench_never_replaces_figures_without_overwrite(tmp_path, capsys, monkeypatch):
    """An existing --json file is kept: a plain run refuses it, --suite goes on only from its own (same device,
    torch and dtype), and --overwrite replaces it."""
    monkeypatch.setattr(bench, "SUITE", [])  # (a file let through fails at once, without timing the GPU shapes)
    held = tmp_path / "b.json"
    gpu = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "dtype": "bfloat16", "suite": []}
    held.write_text(json.dumps(gpu))
    base = ["--device", "cpu", "--steps", "1", "--gen-repeats", "0", "--json", str(held)]
    quick = base + ["--routers", "none", "--n-layer", "1", "--block-size", "4", "--batch-size", "1"]
    plain = tmp_path / "plain.json"  # the figures of a run without --suite
    plain.write_text(json.dumps({**{k: v for k, v in gpu.items() if k != "suite"}, "runs": []}))
    suite = base + ["--suite"]
    here = f"cpu ({torch.get_num_threads()} threads)"  # this device, under another torch: its figures are kept too
    older = tmp_path / "older.json"
    older.write_text(json.dumps({**gpu, "device": here, "torch": "1.0.0", "dtype": "float32", "compile": "off"}))
    run = tmp_path / "summary.json"  # a run's
    run.write_text(json.dumps({"router": "lime", "val_ppl": 16.0}))
    compiled = tmp_path / "compiled.json"  # this device and torch, its models compiled: not kept beside uncompiled
    compiled.write_text(json.dumps({**gpu, "device": here, "torch": torch.__version__, "dtype": "float32",
                                    "compile": "on"}))
    for flags, message in [(quick, "already holds figures: give another file, or --overwrite"),
                           (suite, "holds the suite of NVIDIA H100 80GB HBM3, torch 2.11.0, bfloat16, compile None: "),
                           (suite + ["--json", str(older)], f"holds the suite of {here}, torch 1.0.0, float32, compile "
                                                            "off: give"),
                           (suite + ["--json", str(compiled)], f"holds the suite of {here}, torch {torch.__version__}, "
                                                               "float32, compile on: give"),
                           (suite + ["--json", str(plain)], "plain.json holds figures that are not a suite's")] + [
            # NOTE --overwrite replaces bench.py's figures alone: not a run's file named by mistake
            (flags + ["--json", str(run), "--overwrite"], f"--json={run} holds no figures of bench.py (a run's "
             "summary.json?), and it replaces only its own: give another file, or move it away")
            for flags in (quick, suite)]:
        with pytest.raises(SystemExit) as e:
            bench.main(flags)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert json.loads(held.read_text()) == gpu and json.loads(run.read_text())["router"] == "lime"
    assert bench.main(suite + ["--overwrite"])["device"] == here  # --suite too: not gone on from (replaced part by
    # part as they are timed: none here)
    bench.main(quick + ["--overwrite"])
    assert json.loads(held.read_text())["runs"][0]["results"][0]["router"] == "none"


def test_bench_keeps_figures_another_process_wrote_while_it_ran(tmp_path, capsys, monkeypatch):
    """--json is checked before the benchmark and written after it: another benchmark that wrote the file meanwhile
    (into one that was not there, or over one --overwrite was to replace) keeps its figures, and the command says so."""
    path = tmp_path / "b.json"
    measure = bench.measure

    def meanwhile(*args, **kwargs):  # (another process, as this one times its modes; each time another size)
        path.write_text(json.dumps({"device": "cpu", "torch": "x", "dtype": "x", "theirs": "x" * len(str(flags))}))
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "measure", meanwhile)
    quick = ["--device", "cpu", "--steps", "1", "--gen-repeats", "0", "--routers", "none", "--n-layer", "1",
             "--block-size", "4", "--batch-size", "1", "--json", str(path)]
    for flags in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as e:
            bench.main(quick + flags)
        assert e.value.code == 2 and capsys.readouterr().err == f"bench.py: error: --json={path} was written by " \
            "another process while this one ran: it keeps that one's figures (this one's are above); give another " \
            "file\n"
        assert json.loads(path.read_text())["theirs"] == "x" * len(str(flags))


def test_bench_defaults_follow_the_device(monkeypatch):
    """A flag left out: on a CPU the cpu shape, 5 timed steps after 1 untimed, nothing compiled; compiled (--compile
    on), 3 untimed; on CUDA the 150m shape, compiled, 10 steps after 3. A generation that just fits its block is
    taken."""
    args, shape = bench.parse_args(["--device", "cpu"])
    assert (args.shape, args.steps, args.warmup, args.compile, shape) == ("cpu", 5, 1, "off", bench.SHAPES["cpu"])
    assert bench.parse_args(["--device", "cpu", "--compile", "on"])[0].warmup == 3
    assert bench.parse_args(["--device", "cpu", "--block-size", "4", "--gen-tokens", "2"])[1]["block_size"] == 4
    monkeypatch.setattr(bench, "pick_device", lambda name: "cuda")  # (no GPU needed: only the flags are read)
    args, shape = bench.parse_args([])
    assert (args.shape, args.steps, args.warmup, args.compile, shape) == ("150m", 10, 3, "on", bench.SHAPES["150m"])
    assert bench.parse_args(["--compile", "off"])[0].warmup == 1


@pytest.mark.parametrize("flags, message", [
    (["--routers", ""], "--routers names no router"),
    (["--routers", ","], "--routers names no router"),
    (["--routers", "none,lime2"], "unknown router 'lime2'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--gen-repeats", "-1"], "--gen-repeats must be 0 or more"),
    (["--gen-tokens", "0"], "--gen-tokens must be at least 1"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--block-size", "4", "--gen-tokens", "3"], "--gen-tokens=3 does not fit after a prompt of half the block of 4"),
    (["--depths", "2,0"], "--n-layer, --batch-size and --depths must be at least 1"),
    (["--depths", f"2,{2**31}"], "--n-layer, --batch-size and --depths must be in 1 .. 2**31 - 1"),
    (["--kernels", "--gen-repeats", "0"], "--kernels times the op alone, no model: not with --gen-repeats"),
    (["--device", "foo"], "--device='foo'"),
    (["--shape", "2b"], "unknown shape '2b'"),
    (["--depths", "12,x"], "--depths='12,x'"),
    (["--kernels", "--profile"], "--profile profiles training steps: not with --kernels"),
    (["--sweep"], "--sweep times the routing op: give --kernels too"),
    (["--kernels", "--suite"], "--suite times the routing op itself: not with --kernels"),
    (["--suite", "--routers", "lime", "--n-layer", "3"], "of SUITE: not with --routers, --n-layer"),
    (["--kernels", "--depths", "2,3"], "--kernels times the op at lime's layers: not with --routers or --depths"),
    (["--kernels", "--sweep"], "--sweep times the Triton kernels, which do not run on cpu"),
    (["--suite", "--sweep"], "--sweep times the Triton kernels, which do not run on cpu"),
    (["--kernels", "--warmup", "2", "--compile", "on"], "--kernels times the op alone, no model: not with --warmup, "
                                                        "--compile"),
    (["--kernels", "--compile", "auto"], "--kernels times the op alone, no model: not with --compile"),  # the default
    (["--json", "TMP/missing/b.json"], "no directory TMP/missing"),  # (TMP: the test's tmp_path, whatever happens)
    (["--json", "TMP/new/"], "--json=TMP/new/: a folder's name, not a file's"),  # (not a file named new)
    (["--json", ""], "argument --json: an empty path (a $VARIABLE that is not set?)"),
] + ([(["--device", "cuda"], "--device=cuda: ")] if not torch.cuda.is_available() else []))
def test_bench_bad_input_is_one_line(flags, message, capsys, tmp_path):
    flags, message = [f.replace("TMP", str(tmp_path)) for f in flags], message.replace("TMP", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("bench.py: error: ") and message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script measures: minutes")
def test_the_gpu_script_without_a_gpu_is_one_line_and_makes_nothing(gpu_script_here):
    done, out = gpu_script_here  # (started as the session began: conftest)
    stdout, stderr = done.communicate(timeout=120)
    assert (done.returncode, stdout, stderr) == (2, "", "no CUDA GPU here: this script measures on one\n")
    assert not out.exists()


def test_the_gpu_script_keeps_what_a_step_saved_when_a_time_limit_ends_it(tmp_path):
    """.ci/gpu ended by the call's time limit (SIGTERM) in the middle of a step: the step told to end, and what it
    saved in $OUT, whole (not only after each step), with its log to its last line. Here with a stand-in python3 that
    sees a GPU, and whose bench.py saves a model, runs on, and as it is stopped saves another half a second later and
    says so (as bench.py does); the script run from a copy, whose results/ and out/ it writes."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "gpu").write_text((Path(bench.__file__).parent / ".ci" / "gpu").read_text())
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python3"
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
    *get_device_name*) printf 'GPU-torch9\ntorch 9 triton 9\n' ;;
    bench.py*) json=${{@: -1}}; echo '{{"suite": "a model"}}' > "$json"
        stop() {{ sleep 0.5; echo '{{"suite": "two models"}}' > "$json"; echo "bench.py: interrupted (SIGTERM)"
                  exit 143; }}
        trap stop TERM; echo $$ > {tmp_path}/pid.tmp && mv {tmp_path}/pid.tmp {tmp_path}/pid; sleep 20 & wait ;;
esac
""")
    fake.chmod(0o755)
    (tmp_path / "out" / "gpu" / "logs").mkdir(parents=True)  # an earlier call's, cut short on this machine
    (tmp_path / "out" / "gpu" / "logs" / "suite-2.log").write_text("wrote results/GPU-torch9.json (8 of 8 parts)\n")
    out, saved = tmp_path / "out-of-the-call", tmp_path / "results" / "GPU-torch9.json"
    script = subprocess.Popen(["bash", str(tmp_path / ".ci" / "gpu")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "OUT": str(out), "PATH": f"{tmp_path / 'bin'}{os.pathsep}"
                                                                          f"{os.environ['PATH']}"})
    try:
        for _ in range(300):  # (the model saved)
            if (tmp_path / "pid").exists():
                break
            time.sleep(0.1)
        else:
            pytest.fail("the stand-in bench.py never started")
        script.terminate()
        rc = script.wait(timeout=10)  # at once, not after the step's 20 s
        assert sorted(os.listdir(out)) == ["GPU-torch9.json", "logs.tgz"] and rc == 143
        assert (out / "GPU-torch9.json").read_text() == saved.read_text() == '{"suite": "two models"}\n'
        with tarfile.open(out / "logs.tgz") as logs:  # this call's logs alone, the step's to its last line
            assert sorted(logs.getnames()) == ["logs", "logs/nvidia-smi.txt", "logs/suite-1.log", "logs/versions.txt"]
            # (its last line: the stand-in's bash may say first that its sleep was Terminated, by timeout's signal)
            assert logs.extractfile("logs/suite-1.log").read().splitlines()[-1] == b"bench.py: interrupted (SIGTERM)"
        for _ in range(50):  # the step ended too (its stand-in's 20 s not waited for)
            try:
                os.kill(int((tmp_path / "pid").read_text()), 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the step under way runs on after the script")
    finally:
        script.kill()  # (and the stand-in's sleep ends by itself)
    assert re.fullmatch(r"suite: 3[0-4]\d s, from its start, into results/GPU-torch9\.json",
                        script.stdout.read().splitlines()[-1])  # (the step cut: no line after it)


def test_the_registers_script_compiles_the_kernels_for_a_gpu_without_one(registers_1b):
    """.ci/registers.py: the kernels compiled here for an sm_90 GPU, as a launch there specializes them (not in Triton's
    interpreter, which these tests set), the registers and spills read off the binary, and the programs a
    multiprocessor holds by them (registers from a quarter's 16384, 8 at a time a thread; 64 warps; 32 programs)."""
    triton = pytest.importorskip("triton")
    path = Path(bench.__file__).parent / ".ci" / "registers.py"
    spec = importlib.util.spec_from_file_location("registers", path)
    registers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registers)  # (imported, not run: it leaves TRITON_INTERPRET as it is)
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert [registers.programs(r, w) for r, w in [(253, 4), (123, 4), (94, 4), (160, 4), (72, 4), (176, 2), (16, 1),
                                                  (40, 8), (255, 8)]] == [2, 4, 5, 3, 7, 4, 32, 6, 1]
    if not registers.CUOBJDUMP.exists():
        pytest.skip(f"Triton {triton.__version__} without its NVIDIA tools")
    stdout, stderr = registers_1b.communicate(timeout=300)  # (started as the session began: conftest)
    assert registers_1b.returncode == 0, stderr
    assert not stderr  # no warning: the kernels say what Triton's defaults would leave open (FP fusion in 3.9)
    lines = stdout.splitlines()
    assert lines[1:2] == ["1b: 8 kv heads of 128 values"] and len(lines) == 3, stdout
    row = re.fullmatch(r" +128/4/8/1/1  forward +(\d+) \((\d+)\) +(\d+) B   backward +(\d+) \((\d+)\) +(\d+) B",
                       lines[2])
    assert row, lines[2]
    for count, held, spilled in (map(int, row.groups()[:3]), map(int, row.groups()[3:])):
        assert 16 <= count <= 255 and held == registers.programs(count, 4) and spilled >= 0
