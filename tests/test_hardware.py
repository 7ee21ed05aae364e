"""Hardware: the README's presets (every row a valid config, the CPU row trained, the TPU rows AOT-compiled
for their slices and fitting their memory), multi-process runs."""

import functools
import json
import math
import operator
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest
from conftest import (
    BASE,
    ENV,
    HF,
    ROOT,
    SUDOKU,
    TEXT,
    args,
    config,
    dataset,
    host_env,
    losses,
    metrics,
    start_trainer,
    trainer_results,
    write_corpus,
    write_parquet,
)

import train


def readme_presets():
    """{hardware: (overrides, AOT memory cell)} for every row of README's preset table (hardware | devices |
    model | command | AOT memory per device): the tests read the README, so the commands users copy are
    the ones checked here. A row is one whose command cell is a `python train.py base.yml ...` line."""
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = re.findall(
            r"^\| ([^|\n]+?) \|[^|\n]*\|[^|\n]*\| `python train\.py base\.yml ([^`]*)` \| ([^|\n]*?) \|$",
            f.read(),
            re.MULTILINE,
        )
    return {hardware: (shlex.split(command), memory) for hardware, command, memory in rows}


README = readme_presets()
TPU_ROWS = [
    (hw.split()[1], overrides) for hw, (overrides, _) in README.items() if hw.startswith("TPU ")
]  # 'TPU v4-8'


def test_readme_has_every_preset():
    """One row per device kind, every TPU slice the trainer knows, and each row's command a valid config
    (validate() needs no devices, so the GPU and TPU rows are checked here too)."""
    assert [hw.split(" (")[0] for hw in README] == [
        "CPU",
        "1x H100 / H200 GPU",
        *(f"TPU {s}" for s in train.TPU_SLICES),
        "TPU v5e-8 x 2",
    ]  # two slices
    for hardware, (overrides, _) in README.items():
        try:
            cfg = train.load_config(BASE, overrides)
            train.check(cfg, train.model_lib.TASKS[cfg.task])
        except train.ConfigError as e:
            pytest.fail(f"README row {hardware!r}: {e}")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.slow
def test_readme_cpu_row_trains_in_the_dtype_of_the_cpu(tmp_path, monkeypatch, bf16):
    """The README's CPU command (the default 3.5M LM, mesh=1,-1,1, dtype=auto) trains: three steps on synthetic
    tokens give three finite, distinct losses, in float32 on a CPU without bf16 instructions and in bfloat16 on
    one with them (the CPU's flags are patched, so both run here), as config.yml records."""
    monkeypatch.setattr(train, "cpu_has_bf16", lambda: bf16)
    overrides, _ = README["CPU"]
    cfg = train.load_config(
        BASE,
        args(
            tmp_path,
            "steps=3",
            "dataset=synthetic",
            "eval_batches=0",
            "log_every=1",
            preset=overrides,
        ),
    )
    assert cfg.dtype == "auto"
    summary = train.run(cfg, jax.devices()[:1])
    with open(os.path.join(summary["run_dir"], "config.yml")) as f:
        assert re.search(r"^dtype: (\w+)$", f.read(), re.MULTILINE).group(1) == (
            "bfloat16" if bf16 else "float32"
        )
    rows = metrics(summary["run_dir"])
    got = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert all(math.isfinite(x) for x in got) and len(set(got)) == 3, got


def test_dtype_auto_is_bfloat16_on_accelerators_and_explicit_dtypes_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "cpu_has_bf16", lambda: False)
    lm = train.model_lib.TASKS["lm"]
    for platform, want in (("tpu", "bfloat16"), ("gpu", "bfloat16"), ("cpu", "float32")):
        cfg = train.load_config(BASE, args(tmp_path, "dtype=auto"))
        assert train.resolve(cfg, lm, platform).dtype == want and cfg.dtype == "auto", platform
    assert train.resolve(config(tmp_path, "dtype=bfloat16"), lm, "cpu").dtype == "bfloat16"


@pytest.fixture
def fast_tpu_compiles():
    """libtpu compiles for any TPU slice on this CPU. Least compiler effort (jax_optimization_level=O0) makes
    it ~5x faster; its memory figure is not the default level's (the README's v5e-8 row: 7.68 GiB at O0, 8.09
    at the default level on jax 0.10.2, 6.12 on 0.12), so the rows keep a margin below the HBM. It is a JAX
    option, not a config key (JAX 0.12 removed jax_exec_time_optimization_effort)."""
    pytest.importorskip(
        "libtpu", reason="libtpu is not installed: pip install -r tests/requirements.txt"
    )
    old = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", "O0")
    yield
    jax.config.update("jax_optimization_level", old)


# Every CI run compiles the tightest row (the 8 GiB v2 core); ALL_TPU_PRESETS=1 compiles all eight, the
# multi-host v4-64 pod among them (~2.5 minutes more: the suite's 10-minute budget on 2 cores).
CI_PRESETS = ("v2-8",)
PRESETS = [p for p in TPU_ROWS if os.environ.get("ALL_TPU_PRESETS") or p[0] in CI_PRESETS]


@pytest.mark.parametrize("name,overrides", PRESETS, ids=[p[0] for p in PRESETS])
@pytest.mark.slow
def test_readme_preset_fits_its_tpu_slice(name, overrides, fast_tpu_compiles, capsys, monkeypatch):
    """The row's command, compiled for its slice by libtpu, fits the slice's HBM per device (the README's memory
    cell documents the figure; the compiler's own varies with the libtpu version). The compiled program goes into
    no persistent compilation cache (with no TPU client, jax could not load it back: it warned and compiled again)."""
    if name.startswith("tpu7x") and tuple(map(int, jax.__version__.split(".")[:2])) < (0, 12):
        pytest.skip("TPU7x compiles with the current JAX and libtpu 0.0.51 (Python 3.12)")
    written = []
    monkeypatch.setattr(
        jax._src.compilation_cache,
        "put_executable_and_time",
        lambda key, module, *rest: written.append(module),
    )
    result = train.run(train.load_config(BASE, overrides + [f"compile_topology={name}"]))
    out = capsys.readouterr().out
    assert result["fits"], out
    assert not written, written
    assert result["bytes_per_device"] <= result["hbm_bytes"] == train.TPU_SLICES[name][2]
    assert "fits" in out and "temporaries" in out


# Qwen2.5-0.5B's config.json as published (the hub is not reachable from the tests): what the fine-tuning row loads.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
}


def fine_tuning_row(label, config_json, tmp_path):
    """The command of the README fine-tuning table's row that starts with `label`, on a checkpoint
    folder holding `config_json` alone (no weights: the compile reads only shapes)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        row = re.search(
            rf"^\| {re.escape(label)}[^|]* \| `([^`]*)` \|", f.read(), re.MULTILINE
        ).group(1)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config_json))
    return [*shlex.split(row), f"load_hf={tmp_path}/hf", f"output_dir={tmp_path}"]


@pytest.mark.slow
def test_readme_fine_tuning_row_fits_a_v5e_8(tmp_path, fast_tpu_compiles, capsys):
    """The README's Qwen2.5-0.5B SFT row (sequence 1,024, 4 per device, 2 accumulation steps) compiled for a v5e-8
    from the model's config.json alone (no weights read): it fits the 16 GiB per device. Its DPO row, every weight
    trained on the same tokens (2 pairs of 2 x 1,024), holds no frozen reference (precomputed, in the rows): its
    step takes the SFT step's memory, within 2% (a reference model's bf16 copy would add 1 GB / 8 devices)."""
    keys = fine_tuning_row("Qwen2.5-0.5B, v5e-8, every weight", QWEN25_05B, tmp_path)
    keys += ["max_target_length=1024"]
    result = train.run(train.load_config(BASE, keys + ["compile_topology=v5e-8"]))
    out = capsys.readouterr().out
    assert result["fits"] and "model: " not in out, out  # compiled, nothing allocated
    assert result["bytes_per_device"] <= 0.75 * result["hbm_bytes"], out
    (tmp_path / "dpo").mkdir()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q? ", "chosen": "yes", "rejected": "no"}) + "\n")
    keys = fine_tuning_row("Qwen2.5-0.5B DPO, v5e-8, every weight", QWEN25_05B, tmp_path / "dpo")
    keys += ["dataset=hf", "hf_path=json", f"hf_data_files={pairs}", "compile_topology=v5e-8"]
    dpo = train.run(train.load_config(BASE, keys))
    assert dpo["fits"], capsys.readouterr().out
    assert (
        abs(dpo["bytes_per_device"] - result["bytes_per_device"])
        <= 0.02 * result["bytes_per_device"]
    )


def test_oversized_config_does_not_fit_v2_8(fast_tpu_compiles, capsys):
    """A 375M model without remat at batch 16 x 1024 per core needs about twice a v2 core's 8 GiB."""
    code = train.main(
        [
            "train.py",
            BASE,
            "compile_topology=v2-8",
            "mesh=1,8,1",
            "per_device_batch=16",
            "remat=none",
            "d_model=1024",
            "num_layers=24",
            "num_heads=16",
            "num_kv_heads=16",
            "mlp_dim=2816",
            "vocab_size=32768",
            "max_target_length=1024",
        ]
    )
    out = capsys.readouterr().out
    assert code == train.DOES_NOT_FIT, out
    assert "does not fit" in out and "remat=full" in out and "per_device_batch=auto" in out


def test_attention_auto_picks_by_platform_and_chip(tmp_path):
    """attention=auto: the Pallas flash kernel on TPU v4 and later, XLA's attention on v2 and v3 (their Mosaic
    refuses the kernel's bf16 matmuls), cuDNN's on GPU, einsum on CPU; splash asked for where it cannot
    compile is one line naming the chip."""
    lm, cfg = train.model_lib.TASKS["lm"], train.load_config(BASE, args(tmp_path))
    picked = [
        train.resolve(cfg, lm, platform, kind).attention
        for platform, kind in (
            ("tpu", "TPU v2"),
            ("tpu", "TPU v3"),
            ("tpu", "TPU v4"),
            ("tpu", "TPU v5 lite"),
            ("tpu", "TPU7x"),
            ("gpu", "NVIDIA H100 80GB HBM3"),
            ("cpu", "cpu"),
        )
    ]
    assert picked == ["xla", "xla", "splash", "splash", "splash", "cudnn", "einsum"]
    with pytest.raises(
        train.ConfigError,
        match="attention=splash: the Pallas kernel runs on TPU v4 and later, "
        "not on TPU v3; use attention=auto",
    ):
        train.resolve(
            train.load_config(BASE, args(tmp_path, "attention=splash")), lm, "tpu", "TPU v3"
        )


@pytest.mark.slow
def test_splash_compiles_for_a_tpu_slice_and_keeps_no_scores(fast_tpu_compiles):
    """AOT for a v5e-8 at sequence 1024, no remat: with the splash kernel the step's compiled temporaries are
    under half of XLA attention's, which keeps every layer's [B, H, L, L] scores for the backward pass."""
    common = [
        "compile_topology=v5e-8",
        "mesh=1,8,1",
        "per_device_batch=4",
        "d_model=256",
        "num_layers=2",
        "num_heads=4",
        "num_kv_heads=2",
        "head_dim=128",
        "mlp_dim=512",
        "vocab_size=1024",
        "max_target_length=1024",
        "remat=none",
    ]
    got = {
        att: train.run(train.load_config(BASE, common + [f"attention={att}"]))
        for att in ("xla", "splash")
    }
    assert got["xla"]["fits"] and got["splash"]["fits"]
    assert got["splash"]["memory"]["temp"] < got["xla"]["memory"]["temp"] / 2, got


@pytest.mark.slow
def test_per_device_batch_auto_bisects_to_the_largest_that_fits(fast_tpu_compiles, capsys):
    """per_device_batch=auto on a v2-8 (8 GiB a core), 256 examples per device per update of a small model whose
    untiled logits (vocab 32768, sequence 1024, vocab_tile=0) fill the core: bisection over 1, 2, 4, ... 256 with
    remat=full finds the largest size that fits in 90% of the HBM (the next one up does not), then tries less
    recompute at that size, in at most 6 compiles, each one printed, and prints the command to run on the slice."""
    n = 256
    result = train.run(
        train.load_config(
            BASE,
            [
                "compile_topology=v2-8",
                "mesh=1,8,1",
                "per_device_batch=auto",
                f"grad_accum={n}",
                "d_model=256",
                "num_layers=2",
                "num_heads=4",
                "num_kv_heads=4",
                "mlp_dim=512",
                "vocab_size=32768",
                "max_target_length=1024",
                "vocab_tile=0",
            ],
        )
    )
    out = capsys.readouterr().out
    tried = re.findall(
        r"^  per_device_batch=(\d+) grad_accum=(\d+) remat=(\w+): .* -> (fits|no)$",
        out,
        re.MULTILINE,
    )
    b = result["per_device_batch"]
    assert result["fits"] and 1 < b < n and result["grad_accum"] == n // b, (result, out)
    assert (str(b), str(n // b), "full", "fits") in tried and (
        str(2 * b),
        str(n // b // 2),
        "full",
        "no",
    ) in tried, tried
    assert len(tried) <= 6 and all(int(p) * int(a) == n for p, a, _, _ in tried), tried
    assert (
        f"per_device_batch={b} grad_accum={n // b} remat={result['remat']}" in out.splitlines()[-1]
    ), out


TWO_SLICES = [
    "compile_topology=v5e-8",
    "num_slices=2",
    "d_model=256",
    "num_layers=2",
    "num_heads=4",
    "num_kv_heads=2",
    "mlp_dim=512",
    "max_target_length=256",
    "vocab_size=1024",
]


def dcn_transfers(overrides):
    """The transfer types between slices in the compiled step: libtpu compiles one program per slice, whose own
    collectives span its devices only, and hands what crosses slices to its multi-slice runtime (sends
    tagged _xla_megascale_transfer_type)."""
    cfg = train.load_config(BASE, TWO_SLICES + overrides)
    task = train.model_lib.TASKS[cfg.task]
    devices = train.tpu_slice(cfg)
    cfg = train.resolve(cfg, task, "tpu", devices[0].device_kind)
    built = train.build(cfg, task, devices)
    with jax.set_mesh(built.mesh), train.nnx.logical_axis_rules(cfg.logical_axis_rules):
        hlo = (
            built.train_step.lower(built.layout.abstract, train.abstract_batch(built.feed))
            .compile()
            .as_text()
        )
    groups = set(re.findall(r"replica_groups=(\{[{}\d,]*\})", hlo))
    assert groups and all(max(map(int, re.findall(r"\d+", g))) < 8 for g in groups), (
        groups
    )  # within a slice
    return re.findall(r' send\(.*_xla_megascale_transfer_type="(\w+)"', hlo)


@pytest.mark.slow
def test_two_slices_compile_and_cross_only_to_reduce_gradients_over_data(fast_tpu_compiles, capsys):
    """Two v5e-8 slices, mesh=2,8,1 (data across the slices, FSDP inside each): the step compiles for the 16
    devices, and per_device_batch=auto finds a size that fits. Between the slices the step only sums (the data
    axis's gradient reduction, and the loss's sums); FSDP's weight gathers stay inside a slice. The contrast: the
    slices on the fsdp axis (dcn_mesh=1,2,1) gather weights across them, which the same check sees."""
    result = train.run(
        train.load_config(
            BASE, TWO_SLICES + ["mesh=2,8,1", "per_device_batch=auto", "grad_accum=2"]
        )
    )
    out = capsys.readouterr().out
    assert result["fits"] and "AOT compile for 2 x v5e-8: 16 x TPU v5 lite" in out, out
    on_data = dcn_transfers(["mesh=2,8,1", "per_device_batch=2"])
    print("across the slices, slices on data:", on_data)
    assert on_data and set(on_data) == {"ALL_REDUCE"}, on_data
    assert "ALL_GATHER" in dcn_transfers(["mesh=1,16,1", "dcn_mesh=1,2,1", "per_device_batch=2"])


def test_mesh_that_needs_another_slice_says_so():
    """A v4-32 is 16 devices: mesh=4,4,2 is a v4-64's mesh. Fails before compiling, libtpu or not."""
    pytest.importorskip(
        "libtpu", reason="libtpu is not installed: pip install -r tests/requirements.txt"
    )
    with pytest.raises(train.ConfigError, match="needs 32 devices but JAX sees 16 tpu"):
        train.run(train.load_config(BASE, ["compile_topology=v4-32", "mesh=4,4,2"]))


# ---- multi-host -------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one_and_stop_together(tmp_path):
    """2 processes x 4 CPU devices on loopback (gloo collectives) log the same losses as 1 x 8. A SIGTERM
    that reaches only the second process stops both at the same step (JAX's preemption sync point), both
    save that checkpoint and exit 75, and the rerun continues to the same losses, leaving no log file."""
    argv = args(
        tmp_path, "mesh=2,-1,1", "per_device_batch=2", "grad_accum=2", "steps=8", "prefetch=1"
    )
    launch = lambda run, devices, extra_env: subprocess.Popen(
        [sys.executable, "train.py", "base.yml", *argv, f"run_name={run}"],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**ENV, "JAX_NUM_CPU_DEVICES": str(devices), **extra_env},
    )
    pair = lambda port: [
        launch(
            "two",
            4,
            {
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_PROCESS_COUNT": "2",
                "JAX_PROCESS_INDEX": str(i),
            },
        )
        for i in range(2)
    ]
    procs = [launch("one", 8, {})] + pair(free_port())
    try:
        deadline, logged = time.time() + 180, os.path.join(tmp_path, "two", "metrics.jsonl")
        while time.time() < deadline and procs[2].poll() is None:
            if os.path.exists(logged) and len(pathlib.Path(logged).read_text().splitlines()) >= 3:
                procs[2].send_signal(signal.SIGTERM)  # the non-coordinator process only
                break
            time.sleep(0.01)
        outs = [p.communicate(timeout=180)[0] for p in procs]
        assert procs[0].returncode == 0, outs[0][-3000:]
        assert [p.returncode for p in procs[1:]] == [75, 75], outs[1][-3000:] + outs[2][-3000:]
        saved = [int(out.split("saved checkpoint at step ")[1].split()[0]) for out in outs[1:]]
        assert saved[0] == saved[1] < 8 and os.listdir(
            os.path.join(tmp_path, "two", "checkpoints")
        ) == [str(saved[0])]
        procs = pair(free_port())
        again = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], again[0][-3000:] + again[1][-3000:]
    kept = [p.pid for p in procs if os.path.exists(f"{ENV['TMPDIR']}/train-{p.pid}.log")]
    assert not kept, kept  # the C++ libraries wrote nothing: no empty log file left per host
    assert "8 x cpu (cpu), 2 process(es)" in again[0] and "resuming from checkpoint" in again[0]
    assert (
        "devices:" not in again[1] and "step 8/8" not in again[1]
    )  # only process 0 prints (gloo's lines aside)
    one, two = (losses(os.path.join(tmp_path, r)) for r in ("one", "two"))
    assert len(one) == 8
    assert one == pytest.approx(two, rel=1e-5)


@pytest.mark.parametrize("source", ["files", "hf"])
@pytest.mark.slow
def test_elastic_resume_reads_what_an_uninterrupted_run_reads(tmp_path, source):
    """Packed text, 4 rows per step: steps 1-2 on one process, 3-4 resumed on two, 5-6 resumed on one again. The
    global batches read are, bit for bit, those of the data an uninterrupted run reads (no example repeated, skipped
    or moved), documents cut across rows and across the restarts included; from text files and from a Hugging
    Face dataset (local parquet, read by random access)."""
    if source == "files":
        write_corpus(tmp_path / "train", 12, "doc", 0)
        write_corpus(tmp_path / "eval", 2, "eval", 1)  # a record for each process
        keys, preset = (
            [f"dataset_path={tmp_path}/train/*.txt", f"eval_path={tmp_path}/eval/*.txt"],
            TEXT,
        )
    else:
        write_parquet(str(tmp_path / "train.parquet"), 12, "doc", 0)
        keys, preset = [f"hf_data_files={tmp_path}/train.parquet", "eval_batches=0"], HF
    keys += ["num_layers=1", "per_device_batch=2", "checkpoint_every=0", "prefetch=2"]

    def run(steps, processes):
        """Runs (or resumes) the run up to `steps` on 2 devices; returns the global batches it read."""
        rows_file, port = tmp_path / f"rows-{steps}", free_port()
        env = lambda i: {
            "ROWS_FILE": str(rows_file),
            "JAX_NUM_CPU_DEVICES": str(2 // processes),
            **host_env(port, processes, i),
        }
        procs = [
            start_trainer(
                [["base.yml", *args(tmp_path, *keys, f"steps={steps}", preset=preset)]], **env(i)
            )
            for i in range(processes)
        ]
        try:
            done = [trainer_results(p)[1][0] for p in procs]  # [exit code, stderr] of each process
        finally:
            for p in procs:
                p.kill()
        assert [code for code, _ in done] == [0] * processes, [err[-2000:] for _, err in done]
        read = [
            [json.loads(line) for line in pathlib.Path(f"{rows_file}.{i}").read_text().splitlines()]
            for i in range(processes)
        ]
        return [
            {k: functools.reduce(operator.iadd, (b[k] for b in batches), []) for k in batches[0]}
            for batches in zip(*read)
        ]  # process 0 first

    got = run(2, 1) + run(4, 2) + run(6, 1)
    it = dataset(config(tmp_path, *keys, preset=preset)).train_iter(4)
    assert got == [{k: v.tolist() for k, v in next(it).items()} for _ in range(6)]
    it.close()


@pytest.mark.slow
def test_two_processes_evaluate_sudoku_like_one(tmp_path):
    """mode=eval of a trained Sudoku checkpoint on 2 processes x 4 CPU devices (each process feeding its share
    of the eval puzzles, the answers gathered) writes the eval.json (but its seconds) and the predictions.csv
    of 1 process x 8 devices."""
    trained = train.run(
        config(tmp_path, "steps=20", "run_name=trained", preset=SUDOKU), jax.devices()[:1]
    )
    evaluate = args(
        tmp_path,
        "mode=eval",
        f"load_params={trained['run_dir']}",
        "per_device_batch=4",
        preset=SUDOKU,
    )
    port = free_port()
    pair = [
        start_trainer(
            [["base.yml", *evaluate, "run_name=two"]],
            JAX_NUM_CPU_DEVICES="4",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_PROCESS_COUNT="2",
            JAX_PROCESS_INDEX=str(i),
        )
        for i in range(2)
    ]
    try:
        one = train.run(train.load_config(BASE, [*evaluate, "run_name=one"]), jax.devices()[:8])
        done = [trainer_results(p, timeout=120) for p in pair]
    finally:
        for p in pair:
            p.kill()
    assert [r[1][0][0] for r in done] == [0, 0], [
        r[1][0][1][-2000:] for r in done
    ]  # exit codes, stderr
    assert "8 x cpu (cpu), 2 process(es)" in done[0][0] and "devices:" not in done[1][0]
    read = lambda run, name: pathlib.Path(tmp_path, run, name).read_text()
    want, got = (json.loads(read(run, "eval.json")) for run in ("one", "two"))
    assert want.pop("seconds") > 0 and got.pop("seconds") > 0
    assert want == {k: v for k, v in one.items() if k != "seconds"} and want["num_puzzles"] == 32
    assert got == want
    assert read("two", "predictions.csv") == read("one", "predictions.csv")


@pytest.mark.parametrize(
    "address,count,index,says",
    [
        (
            "127.0.0.1:1234",
            None,
            None,
            "JAX_COORDINATOR_ADDRESS set but JAX_PROCESS_COUNT, JAX_PROCESS_INDEX not",
        ),
        ("127.0.0.1:1234", "2", "2", "JAX_PROCESS_INDEX=2: must be 0..N-1 for JAX_PROCESS_COUNT=2"),
        ("127.0.0.1", "2", "0", "JAX_COORDINATOR_ADDRESS=127.0.0.1: give host:port of process 0"),
    ],
)
def test_bad_distributed_env_is_one_line_error(monkeypatch, capsys, address, count, index, says):
    """The multi-process variables are checked before JAX sees them (it answers a bad one with a traceback,
    or waits for a coordinator that never comes)."""
    for name, value in (
        ("JAX_COORDINATOR_ADDRESS", address),
        ("JAX_PROCESS_COUNT", count),
        ("JAX_PROCESS_INDEX", index),
    ):
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    assert train.main(["train.py", BASE]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {says}"), err


# Llama 3 8B's published config.json (meta-llama/Meta-Llama-3-8B): the model the LoRA rows are for.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
}


@pytest.mark.slow
def test_an_8b_model_fine_tunes_with_qlora_on_one_v5e_chip(tmp_path, fast_tpu_compiles, capsys):
    """The README's QLoRA row: Llama 3 8B (its config.json alone, no weights read) at 2,048 tokens, its base stored
    as nf4 with bf16 elsewhere, rank-16 adapters on every projection, compiled for one v5e chip (libtpu describes
    it as a 1x1 topology): it fits the 16 GiB."""
    keys = fine_tuning_row("Llama 3 8B QLoRA nf4, one v5e chip", LLAMA3_8B, tmp_path)
    keys += ["compile_topology=v5e-1"]
    result = train.run(train.load_config(BASE, keys))
    out = capsys.readouterr().out
    assert result["fits"] and "1 x TPU v5 lite" in out, out
