"""Checkpoints: exact resume after SIGKILL and SIGTERM, atomicity, corruption, resharding, bad input."""

import glob
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest
from conftest import (
    BASE,
    ENV,
    HF,
    ROOT,
    TEXT,
    args,
    config,
    losses,
    metrics,
    read_checkpoint,
    start_trainer,
    trainer_results,
    write_parquet,
)

import train

# The text run interrupted below: real code (the first 40 stdlib modules, documents spanning many rows), two
# microbatches per step and three from step 6 on (batch_ramp: every resume is mid-ramp), a checkpoint every
# 10 steps, the data read ahead on the prefetch thread. The signal goes at step 15: 25 steps before the end,
# so a fast machine cannot finish before it lands.
INTERRUPTED = [
    "vocab_size=512",
    "max_target_length=64",
    "per_device_batch=4",
    "grad_accum=2",
    "batch_ramp=5:3",
    "eval_batches=1",
    "checkpoint_every=10",
    "steps=40",
    "prefetch=2",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]:
        shutil.copy(f, d)
    return d


def cli(corpus, out, *extra):
    return [
        sys.executable,
        "train.py",
        "base.yml",
        *args(out, f"dataset_path={corpus}/*.py", *INTERRUPTED, *extra, preset=TEXT),
    ]


def run_losses(out, run="default"):
    rows = metrics(os.path.join(out, run))
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), (
        "one row per step, none missing"
    )
    return [r["loss"] for r in rows]


def run_to_end(cmd):
    """The trainer run to its end: its result (exit code, stdout, stderr)."""
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV, check=False
    )


def run_until(cmd, out, step, sig, env=ENV):
    """Start the trainer, wait until it has logged `step`, send `sig`; returns the process result."""
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    return signal_at(p, out, step, sig)


def signal_at(p, out, step, sig):
    """Wait until the trainer `p` has logged `step` (after its step-10 checkpoint), send `sig`; returns
    (exit code, stdout, stderr)."""
    metrics, deadline = os.path.join(out, "default", "metrics.jsonl"), time.time() + 600
    first_ckpt = os.path.join(out, "default", "checkpoints", "10")  # appears only once complete
    while time.time() < deadline and p.poll() is None:
        if (
            os.path.isdir(first_ckpt)
            and len(pathlib.Path(metrics).read_text().splitlines()) >= step
        ):
            p.send_signal(sig)
            break
        time.sleep(0.005)
    stdout, stderr = p.communicate(timeout=600)
    return p.returncode, stdout, stderr


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce exactly."""
    out = tmp_path_factory.mktemp("ref")
    r = run_to_end(cli(corpus, out))
    assert r.returncode == 0, r.stderr
    return run_losses(out)


# SIGINT (Ctrl-C) takes SIGTERM's handler: in the loop it is the same; before the loop it is tested below.
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_interrupted_run_resumes_exactly(corpus, reference, tmp_path, sig):
    code, _, err = run_until(cli(corpus, tmp_path), tmp_path, 15, sig)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:
        assert code == 75 and "saved checkpoint at step" in err, err
        saved = int(err.split("saved checkpoint at step ")[1].split()[0])
        assert saved in [int(s) for s in os.listdir(tmp_path / "default" / "checkpoints")]
    r = run_to_end(cli(corpus, tmp_path))
    assert r.returncode == 0, r.stderr
    start = int(r.stdout.split("resuming from checkpoint ")[1].split()[0].rsplit("/", 1)[1])
    assert 10 <= start < 40
    assert run_losses(tmp_path) == reference  # bit-for-bit, steps before and after the resume point
    # goodput: the steps the stop lost are named, and their time is badput, not goodput
    redone = re.search(rf"steps {start + 1}-(\d+) ran before the stop and are run again", r.stdout)
    if sig == signal.SIGKILL:  # logged at step 15 or later, saved at 10
        assert redone and int(redone[1]) >= 15, r.stdout
        rows = metrics(tmp_path / "default")
        assert rows[start - 1]["badput_redone"] == 0  # the killed run's own row
        assert all(r["badput_redone"] > 0 for r in rows[start:]), rows[start:]
        assert re.search(r"^goodput: .* redone [1-9]", r.stdout, re.MULTILINE), r.stdout
    else:  # SIGTERM: the checkpoint is at the last step done, nothing is redone
        assert not redone and metrics(tmp_path / "default")[-1]["badput_redone"] == 0


@pytest.mark.slow
def test_a_closed_stdout_and_a_hung_up_terminal_cost_no_step(corpus, reference, tmp_path):
    """`python train.py ... | head -2`, then the terminal closes (SIGHUP) at step 15: the run goes on
    past its closed stdout, answers SIGHUP as it answers SIGTERM (a checkpoint, exit 75, one line, no
    traceback), and the rerun resumes exactly."""
    p = subprocess.Popen(
        cli(corpus, tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    head = [p.stdout.readline(), p.stdout.readline()]
    p.stdout.close()  # as `head -2` does: every later print meets a broken pipe
    p.stdout = None
    code, _, err = signal_at(p, tmp_path, 15, signal.SIGHUP)
    assert all(head) and code == 75 and "SIGHUP: saved checkpoint at step" in err, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    r = run_to_end(cli(corpus, tmp_path))
    assert r.returncode == 0 and "resuming from checkpoint" in r.stdout, r.stderr
    assert run_losses(tmp_path) == reference


def _truncate_biggest(step_dir):  # a finished checkpoint later cut short (disk full, bad copy)
    biggest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)


def _garble(step_dir):  # the index of the arrays and two data files overwritten with garbage
    (step_dir / "train_state" / "_sharding").write_text("garbage")
    for f in sorted((step_dir / "train_state" / "ocdbt.process_0" / "d").iterdir())[:2]:
        f.write_bytes(os.urandom(100))


DAMAGE = {
    "truncated": _truncate_biggest,
    "garbled": _garble,
    "manifest": lambda d: (d / "train_state" / "manifest.ocdbt").write_bytes(b"junk"),
    "no params": lambda d: shutil.rmtree(d / "train_state"),
    "metadata": lambda d: (d / "train_state" / "_METADATA").unlink(),
}


@pytest.mark.slow
def test_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes(tmp_path, capfd):
    """Whatever the damage to the newest step (and a kill -9 mid-write's temporary directory beside it),
    the run warns in one line, renames that step STEP.damaged-TIME (never deleted), resumes from the step
    before and continues exactly as an uninterrupted run; stderr stays empty."""
    ref = train.run(config(tmp_path, "steps=9", "run_name=ref"), jax.devices()[:1])
    train.run(config(tmp_path, "steps=6", "checkpoint_every=3", "run_name=base"), jax.devices()[:1])
    for kind, damage in DAMAGE.items():
        shutil.copytree(tmp_path / "base", tmp_path / kind)
        ckpts = tmp_path / kind / "checkpoints"
        os.makedirs(ckpts / "9.orbax-checkpoint-tmp-1234" / "train_state")  # never a step
        damage(ckpts / "6")
        capfd.readouterr()
        s = train.run(
            config(tmp_path, "steps=9", "checkpoint_every=3", f"run_name={kind}"), jax.devices()[:1]
        )
        out, err = capfd.readouterr()
        assert s["step"] == 9 and err == "", (kind, err[-2000:])
        assert out.count("is damaged") == 1 and f"{ckpts}/6 is damaged" in out, (kind, out)
        assert "resuming from checkpoint " + str(ckpts / "3") in out, kind
        assert len([d for d in os.listdir(ckpts) if d.startswith("6.damaged-")]) == 1, kind
        assert losses(tmp_path / kind) == losses(ref["run_dir"]), (
            kind
        )  # resumed from step 3, continued exactly


def test_no_readable_checkpoint_is_an_error_and_moves_nothing(tmp_path):
    train.run(config(tmp_path, "steps=4", "checkpoint_every=2"), jax.devices()[:1])
    ckpts = tmp_path / "default" / "checkpoints"
    for step in ("2", "4"):
        _garble(ckpts / step)
    with pytest.raises(
        train.ConfigError, match="no readable checkpoint in .*steps 2, 4 are damaged"
    ):
        train.run(config(tmp_path, "steps=6"), jax.devices()[:1])
    assert sorted(os.listdir(ckpts)) == ["2", "4"]


@pytest.mark.slow
def test_restore_onto_a_different_mesh(tmp_path):
    """Saved on mesh=8,1,1 at step 3, resumed on mesh=2,2,2: steps 4-6 match the run that never moved."""
    ref = train.run(
        config(
            tmp_path,
            "mesh=8,1,1",
            "per_device_batch=2",
            "steps=6",
            "checkpoint_every=3",
            "run_name=ref",
        ),
        jax.devices()[:8],
    )
    shutil.copytree(
        os.path.join(ref["run_dir"], "checkpoints", "3"), tmp_path / "moved" / "checkpoints" / "3"
    )
    train.run(
        config(tmp_path, "mesh=2,2,2", "per_device_batch=2", "steps=6", "run_name=moved"),
        jax.devices()[:8],
    )
    got, want = losses(tmp_path / "moved"), losses(ref["run_dir"])[3:]
    assert len(got) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_shape_mismatch_and_load_params(tmp_path):
    train.run(config(tmp_path, "steps=2"), jax.devices()[:1])
    with pytest.raises(
        train.ConfigError,
        match=r"was written by another config: params/.* is \(.*\) there but \(.*\) "
        r"here; changed since: steps \(2 -> 4\), d_model \(64 -> 32\); use",
    ):
        train.run(config(tmp_path, "steps=4", "d_model=32"), jax.devices()[:1])
    # load_params starts a fresh run (step 0, new optimizer) from the other run's weights.
    cfg = config(
        tmp_path,
        "steps=1",
        "run_name=finetune",
        f"load_params={tmp_path}/default",
        "checkpoint_every=0",
    )
    train.run(cfg, jax.devices()[:1])
    a = read_checkpoint(tmp_path / "default", 2)["train_state"]["params"]
    b = read_checkpoint(tmp_path / "finetune", 1)["train_state"]
    assert int(b["step"]) == 1
    jax.tree.map(
        np.testing.assert_array_equal, a, b["params"]
    )  # warmup's first step has lr 0: as loaded


def test_an_eval_of_a_run_while_it_trains_leaves_its_save_in_flight_alone(tmp_path):
    """mode=eval (or generate, export) on a run that is training opens its checkpoints read-only: the
    save the trainer is writing (orbax's temporary step directory) stays, where it was deleted and the
    trainer's next checkpoint failed ('Save failed: 5/5 params are missing .zarray')."""
    train.run(config(tmp_path, "steps=2"), jax.devices()[:1])
    ckpts = tmp_path / "default" / "checkpoints"
    in_flight = ckpts / "3.orbax-checkpoint-tmp-1790000000000000"
    shutil.copytree(ckpts / "2", in_flight)
    train.run(config(tmp_path, "mode=eval", "eval_batches=1"), jax.devices()[:1])
    assert in_flight.is_dir() and sorted(os.listdir(ckpts)) == ["2", in_flight.name]


def test_eval_mode_and_resume_false(tmp_path):
    with pytest.raises(train.ConfigError, match="mode=eval needs trained parameters"):
        train.run(config(tmp_path, "mode=eval", "eval_batches=1"), jax.devices()[:1])
    s = train.run(config(tmp_path, "steps=2", "eval_batches=1"), jax.devices()[:1])
    e = train.run(config(tmp_path, "steps=2", "mode=eval", "eval_batches=1"), jax.devices()[:1])
    assert e["step"] == 2 and abs(e["loss"] - s["eval_loss"]) < 1e-6  # eval.json: the task's names
    # resume=false starts again from step 0 and keeps the earlier run, renamed.
    s = train.run(config(tmp_path, "steps=1", "resume=false"), jax.devices()[:1])
    names = os.listdir(s["run_dir"])
    assert any(n.startswith("checkpoints.replaced-") for n in names) and "checkpoints" in names
    assert [r["step"] for r in metrics(s["run_dir"])] == [1]


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_a_nonfinite_step_names_the_checkpoint_to_go_on_from_and_the_advice_works(tmp_path):
    """learning_rate=1e30 with warmup: update 1 is 0, update 2 makes the parameters huge, and step 3's gradient is
    NaN (its loss stays finite: RMSNorm scales the huge activations back). The line names what was non-finite and the newest checkpoint before the parameters that produced it (step 1; step 2, which
    holds those parameters, is set aside, not deleted), exit 3; the advice (a lower learning_rate, the same command)
    resumes from step 1 and finishes with finite losses."""
    keys = ["steps=6", "warmup_steps=3", "checkpoint_every=1", "keep_checkpoints=0"]
    cmd = lambda lr: ["base.yml", *args(tmp_path, *keys, f"learning_rate={lr}")]
    (code, err), (again, err2) = trainer_results(
        start_trainer([cmd("1e30"), cmd("1e-3")], JAX_NUM_CPU_DEVICES="1")
    )[1]
    assert (
        code == 3
        and err.count("\n") == 1
        and re.fullmatch(
            r"error: gradient norm is nan \(loss [0-9.]+\) at step 3: stopped; the newest checkpoint before it is step 1 "
            r"\(step 2 set aside\); lower learning_rate \(or raise warmup_steps\) and rerun to resume from there\n",
            err,
        )
    ), err
    names = os.listdir(tmp_path / "default" / "checkpoints")
    assert any(n.startswith("2.nonfinite-") for n in names) and "1" in names, names
    assert again == 0 and err2 == "", err2
    rows = metrics(tmp_path / "default")
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(
        math.isfinite(r["loss"]) for r in rows
    ), rows
    assert max(int(n) for n in os.listdir(tmp_path / "default" / "checkpoints") if n.isdigit()) == 6


def test_unwritable_output_dir(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(train.data.DataError, match="output_dir=.*choose a writable output_dir"):
        train.run(config(tmp_path, f"output_dir={tmp_path}/file/sub"), jax.devices()[:1])


def test_keep_checkpoints_deletes_the_oldest(tmp_path):
    """keep_checkpoints=2 with a checkpoint every step: only the two newest step directories remain, and
    the run resumes from the newest."""
    train.run(
        config(tmp_path, "steps=5", "checkpoint_every=1", "keep_checkpoints=2"), jax.devices()[:1]
    )
    assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == ["4", "5"]
    s = train.run(
        config(tmp_path, "steps=6", "checkpoint_every=1", "keep_checkpoints=2"), jax.devices()[:1]
    )
    assert [r["step"] for r in metrics(s["run_dir"])] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == ["5", "6"]


def test_resuming_with_other_rows_per_microbatch_is_an_error(tmp_path):
    """The data position is per row: a resume that reads another number of rows per microbatch stops with a
    message saying what to keep, and the checkpoint stays as it was."""
    train.run(config(tmp_path, "steps=1", "per_device_batch=2"), jax.devices()[:1])
    with pytest.raises(
        train.data.DataError,
        match="holds the data position of 2 rows per microbatch but this run "
        r"reads 4 \(per_device_batch x devices\): keep 2 to resume",
    ):
        train.run(config(tmp_path, "steps=2", "per_device_batch=4"), jax.devices()[:1])
    assert os.listdir(tmp_path / "default" / "checkpoints") == ["1"]


# ---- the run directory: owned by one run, written or stopped in one line, resumed or refused by name ---------
@pytest.mark.slow
def test_two_runs_on_one_run_directory(tmp_path):
    """The same command started twice at once: one trains, the other stops at once with one line naming who
    holds the directory; metrics.jsonl then has every step once."""
    cmd = [
        sys.executable,
        "train.py",
        "base.yml",
        *args(tmp_path, "steps=30", "checkpoint_every=10"),
    ]
    runs = [
        subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        for _ in range(2)
    ]
    results = sorted((p.wait(timeout=300), p.stderr.read()) for p in runs)
    (ok, _ok_err), (refused, refused_err) = results
    assert ok == 0 and refused == 2, results
    assert refused_err.count("\n") == 1 and refused_err.startswith(
        f"error: {tmp_path}/default is in use by process "
    ), refused_err
    assert [r["step"] for r in metrics(tmp_path / "default")] == list(range(1, 31))


# A command with SIGXFSZ ignored (a write past the file-size limit fails with EFBIG instead of killing the
# process) and, given a size, that limit: set by a Python that then execs the command (exec keeps both), not in a
# preexec_fn, for which subprocess forks the multithreaded test process (JAX warns: a fork can deadlock).
LIMITED = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
if int(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
os.execv(sys.argv[2], sys.argv[2:])
"""


def limited(cmd, file_size=0):
    return [sys.executable, "-c", LIMITED, str(file_size), *cmd]


@pytest.mark.slow
def test_a_refused_checkpoint_write_stops_in_one_line_and_keeps_the_rest(tmp_path):
    """A file system that refuses the checkpoint's files mid-run (a full disk, here a file-size limit the
    process sets itself): exit 74 with one line, no hang; the checkpoint before stays and a rerun resumes
    from it to the losses of a run that was never stopped."""
    env = {
        k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"
    }  # for the limited run: cache files are large
    cmd = lambda run, steps: [
        sys.executable,
        "train.py",
        "base.yml",
        *args(tmp_path, f"steps={steps}", "checkpoint_every=2", f"run_name={run}"),
    ]
    ref = subprocess.run(
        cmd("ref", 6), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV, check=False
    )
    assert ref.returncode == 0, ref.stderr
    assert (
        subprocess.run(
            cmd("full", 2),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
            check=False,
        ).returncode
        == 0
    )

    r = subprocess.run(
        limited(cmd("full", 6), 1 << 16),  # writes past 64 KiB fail with EFBIG, the process lives
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert r.returncode == 74 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {tmp_path}/full/checkpoints: "), r.stderr
    assert sorted(d for d in os.listdir(tmp_path / "full" / "checkpoints") if d.isdigit()) == ["2"]
    r = subprocess.run(
        cmd("full", 6), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV, check=False
    )
    assert r.returncode == 0 and "resuming from checkpoint" in r.stdout, r.stderr
    assert losses(tmp_path / "full") == losses(tmp_path / "ref")


@pytest.mark.slow
def test_a_disk_filling_under_a_running_run_is_one_line_naming_the_file(tmp_path):
    """The disk fills mid-run (here: a file-size limit put on the running trainer after its first
    checkpoint, below its metrics.jsonl's size), so the next metrics row is refused: exit 74 and one line
    naming metrics.jsonl. Before: the line blamed no file ('storage failed: File too large'), and
    TensorBoard's writer thread and exit cleanup added two tracebacks. The checkpoint stays; a rerun
    resumes from it."""
    import resource

    cmd = lambda steps: [
        sys.executable,
        "train.py",
        "base.yml",
        *args(tmp_path, f"steps={steps}", "checkpoint_every=20", "log_every=10"),
    ]
    p = subprocess.Popen(
        limited(cmd(3000)),  # EFBIG, not a kill, once the limit is put on it
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"},
    )
    while not (tmp_path / "default" / "checkpoints" / "20").is_dir() and p.poll() is None:
        time.sleep(0.01)
    trainer = subprocess.run(
        ["pgrep", "-P", str(p.pid)], capture_output=True, text=True, check=False
    )
    for pid in [p.pid, *map(int, trainer.stdout.split())]:  # the supervisor and the trainer
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (100, 100))
    _, err = p.communicate(timeout=300)
    assert p.returncode == 74 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {tmp_path}/default/metrics.jsonl: cannot write (File too large)")
    r = run_to_end(cmd(25))
    assert r.returncode == 0 and "resuming from checkpoint" in r.stdout, r.stderr


def fill(path):
    """Writes zeros into `path` until its disk is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass


@pytest.mark.slow
def test_a_disk_that_fills_as_a_checkpoint_is_saved_is_one_line_and_the_rerun_exact(tmp_path):
    """output_dir on a 16 MiB tmpfs, filled to its last byte as the save of step 40 begins: exit 74 and one line
    naming a file of the run directory (the checkpoint it could not write, or the metrics or TensorBoard file the
    next row met), no traceback; step 20 stays, and once the space is freed the rerun resumes to the losses of an
    uninterrupted run. Needs root, to mount the tmpfs."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", disk], check=False
    ).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        keys = ["steps=60", "checkpoint_every=20", "keep_checkpoints=0"]
        cmd = [sys.executable, "train.py", "base.yml", *args(tmp_path, *keys, f"output_dir={disk}")]
        p = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        checkpoints = disk / "default" / "checkpoints"
        saving = lambda: (
            checkpoints.is_dir() and any(n.startswith("40") for n in os.listdir(checkpoints))
        )
        while p.poll() is None and not saving():
            time.sleep(0.001)
        fill(disk / "fill")
        _, err = p.communicate(timeout=300)
        assert p.returncode == 74 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: {disk}/default/"), err
        assert "20" in os.listdir(checkpoints)
        (disk / "fill").unlink()
        rerun = run_to_end(cmd)
        assert rerun.returncode == 0 and "resuming from checkpoint" in rerun.stdout, rerun.stderr
        assert run_to_end(cmd[:3] + args(tmp_path, *keys)).returncode == 0
        assert losses(disk / "default") == losses(tmp_path / "default")
    finally:
        subprocess.run(["umount", "-l", disk], check=False)


def test_an_event_file_the_disk_refuses_is_one_line_naming_it(tmp_path, monkeypatch):
    """TensorBoard's event file refused (a full disk) as a metrics row is flushed: a WriteError naming the run
    directory's event file, so one line and exit 74. Before: its OSError, which says no file, reached the user as
    'storage failed: No space left on device'."""
    cfg = config(tmp_path)
    os.makedirs(tmp_path / "default")
    writer = train.data.MetricsWriter(cfg, str(tmp_path / "default"), 0)

    def full():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.tb, "flush", full)
    with pytest.raises(
        train.data.WriteError,
        match=r"default/events\.out\.tfevents\.[^:/]+: TensorBoard's event file cannot be written "
        r"\(No space left on device\)",
    ):
        writer.write({"step": 1, "loss": 1.0})
    monkeypatch.undo()
    writer.close()


def test_a_changed_model_on_resume_is_named_not_damage(tmp_path):
    """Tying the embeddings under an existing run changes the parameter tree: the run stops naming the
    parameter and the key that changed, and the checkpoints stay as they were (none called damaged)."""
    train.run(config(tmp_path, "steps=2"), jax.devices()[:1])
    before = sorted(os.listdir(tmp_path / "default" / "checkpoints"))
    with pytest.raises(
        train.ConfigError,
        match=r"written by another config: params/lm_head is \(64, 128\) there but "
        r"none here; changed since: tie_embeddings \(False -> True\); use",
    ):
        train.run(config(tmp_path, "steps=2", "tie_embeddings=true"), jax.devices()[:1])
    assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == before == ["2"]


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    """A crash while a metrics row was being written leaves half a line: the resume drops it with a
    warning and every step is in metrics.jsonl once."""
    train.run(config(tmp_path, "steps=4", "checkpoint_every=2"), jax.devices()[:1])
    path = tmp_path / "default" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 5, "lo')
    capsys.readouterr()
    train.run(config(tmp_path, "steps=6", "checkpoint_every=2"), jax.devices()[:1])
    assert "dropped its last line, written only in part" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path / "default")] == [1, 2, 3, 4, 5, 6]


def test_a_changed_data_source_starts_the_data_over(tmp_path, capsys):
    """Resuming a synthetic-token run on text files: the position counted in the other data is not applied;
    one warning says the data order starts over, and the run goes on."""
    from conftest import VOCAB, write_corpus

    write_corpus(tmp_path / "corpus", 6, "doc", 0)
    train.run(config(tmp_path, "steps=2", f"vocab_size={VOCAB}"), jax.devices()[:1])
    capsys.readouterr()
    s = train.run(
        config(tmp_path, "steps=4", f"dataset_path={tmp_path}/corpus/*.txt", preset=TEXT),
        jax.devices()[:1],
    )
    out = capsys.readouterr().out
    assert (
        "the checkpoint's data position is in synthetic, not in this run's data" in out
        and s["step"] == 4
    ), out


# ---- Hugging Face datasets and Weights & Biases across a kill -------------------------------------------
# Read by random access, the same resume is test_hardware.py's elastic resume (dataset=hf, one process to two).
@pytest.mark.parametrize("streaming", ["true"])
@pytest.mark.slow
def test_hf_dataset_run_killed_and_resumed_equals_an_unstopped_one(tmp_path, streaming):
    """A run on a Hugging Face dataset (local parquet through dataset=hf, read by random access or as a stream),
    killed with SIGKILL after its step-10 checkpoint and rerun: its losses are, bit for bit, those of a run
    never stopped (the stream goes on at the document after the checkpoint's)."""
    write_parquet(str(tmp_path / "d.parquet"), 60, "doc", 0)
    cmd = lambda out: [
        sys.executable,
        "train.py",
        "base.yml",
        *args(
            out,
            f"hf_data_files={tmp_path}/d.parquet",
            f"hf_streaming={streaming}",
            "steps=40",
            "checkpoint_every=10",
            "eval_batches=0",
            "prefetch=2",
            preset=HF,
        ),
    ]
    ref = subprocess.run(
        cmd(tmp_path / "ref"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert ref.returncode == 0, ref.stderr
    assert (
        run_until(cmd(tmp_path / "cut"), tmp_path / "cut", 15, signal.SIGKILL)[0] == -signal.SIGKILL
    )
    r = subprocess.run(
        cmd(tmp_path / "cut"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert r.returncode == 0 and "resuming from checkpoint" in r.stdout, r.stderr
    assert run_losses(tmp_path / "cut") == run_losses(tmp_path / "ref")


def wandb_history(run_dir):
    """{step: {key: value}} of every row in the W&B offline runs under run_dir (the .wandb files: LevelDB-log
    records of wandb's protobuf Record), and the number of rows per step."""
    import struct

    from wandb.proto import wandb_internal_pb2

    rows, count = {}, {}
    for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")):
        blob, pos, part = pathlib.Path(path).read_bytes(), 7, b""  # after the file header
        while pos + 7 <= len(blob):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = struct.unpack("<HB", blob[pos + 4 : pos + 7])
            part, pos = part + blob[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(part)
                part = b""
                if record.WhichOneof("record_type") == "history":
                    row = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                    rows[row["_step"]] = row
                    count[row["_step"]] = count.get(row["_step"], 0) + 1
    return rows, count


@pytest.mark.slow
def test_wandb_offline_run_equals_metrics_across_a_resume(tmp_path):
    """wandb_project= with WANDB_MODE=offline, stopped by SIGTERM after its step-10 checkpoint (a checkpoint at
    the step it stops at) and rerun: the W&B run (one id, kept in the run directory) holds every step once, with
    the values metrics.jsonl holds. The home directory is not writable (wandb's cache cannot go there): nothing on
    stderr all the same."""
    (tmp_path / "a-file").touch()
    env = {
        **{k: v for k, v in ENV.items() if k not in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR")},
        "WANDB_MODE": "offline",
        "HOME": str(tmp_path / "a-file" / "home"),
    }
    cmd = [
        sys.executable,
        "train.py",
        "base.yml",
        *args(tmp_path, "steps=40", "checkpoint_every=10", "wandb_project=trainer-test"),
    ]
    assert run_until(cmd, tmp_path, 15, signal.SIGTERM, env)[0] == 75
    r = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    history, count = wandb_history(tmp_path / "default")
    rows = metrics(tmp_path / "default")
    assert sorted(history) == [row["step"] for row in rows] == list(range(1, 41)), sorted(history)
    assert set(count.values()) == {1}, count
    for row in rows:
        for key in ("loss", "grad_norm", "learning_rate", "tokens_per_step"):
            assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-12), (
                row["step"],
                key,
            )
    runs = {
        os.path.basename(p).split("-")[-1]
        for p in glob.glob(str(tmp_path / "default" / "wandb" / "offline-run-*"))
    }
    assert runs == {(tmp_path / "default" / "wandb_id").read_text().strip()}


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_warning_line_and_no_stderr_through_the_command_line(tmp_path):
    """The damage that leaves orbax's reads in flight (garbled data files), resumed by `python train.py`:
    one warning on stdout, nothing on stderr (pytest replaces the process's unraisable-exception hook
    in-process, so only a process of its own shows what a user's terminal would)."""
    cmd = [sys.executable, "train.py", "base.yml", *args(tmp_path, "checkpoint_every=3")]
    assert (
        subprocess.run(
            cmd + ["steps=6"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
            check=False,
        ).returncode
        == 0
    )
    data_files = (
        tmp_path / "default" / "checkpoints" / "6" / "train_state" / "ocdbt.process_0" / "d"
    ).iterdir()
    max(data_files, key=lambda f: f.stat().st_size).write_bytes(
        os.urandom(100)
    )  # the arrays, not the index:
    # the reads start, one fails, the rest are left in flight
    r = subprocess.run(
        cmd + ["steps=9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert r.returncode == 0 and r.stderr == "" and r.stdout.count("is damaged") == 1, r.stderr[
        -3000:
    ]


# A trainer that waits at step 4 (0-based 3) until GATE exists, saying so, and announces the wait for its last save.
SIGNALLED = """
import os, sys, time
import train
next_batch, wait_for_saves, taken = train.next_batch, train.wait_for_saves, []
def gated(feed, it, *rest):
    taken.append(feed)
    if len(taken) == 4:
        print('AT GATE', flush=True)
        while not os.path.exists(os.environ['GATE']):
            time.sleep(0.02)
    return next_batch(feed, it, *rest)
def announced(mngr):
    print('WAITING FOR THE SAVE', flush=True)
    time.sleep(1.0)  # a second signal lands here, while the last checkpoint is being written
    return wait_for_saves(mngr)
train.next_batch, train.wait_for_saves = gated, announced
sys.exit(train.main(['train.py', *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_a_second_sigterm_while_the_last_checkpoint_is_written_loses_nothing(tmp_path):
    """SIGTERM at step 4, then SIGTERM again while that step's checkpoint is being written: the second is noted,
    the save commits, exit 75; the rerun continues from it to the losses of an uninterrupted run, bit for bit."""
    keys = ["steps=8", "checkpoint_every=0", "per_device_batch=2"]
    ref = subprocess.run(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, *keys, "run_name=ref")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    p = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED, "base.yml", *args(tmp_path, *keys)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "GATE": str(tmp_path / "go")},
    )
    for line in p.stdout:
        if line.startswith("AT GATE"):
            p.send_signal(signal.SIGTERM)
            (tmp_path / "go").touch()
        if line.startswith("WAITING FOR THE SAVE"):
            p.send_signal(signal.SIGTERM)
            break
    _out, err = p.communicate(timeout=300)
    assert p.returncode == 75 and "SIGTERM: saved checkpoint at step 4" in err, err[-2000:]
    assert os.listdir(tmp_path / "default" / "checkpoints") == ["4"]
    r = subprocess.run(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, *keys)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert r.returncode == 0 and "resuming from checkpoint" in r.stdout, r.stderr[-2000:]
    assert losses(tmp_path / "default") == losses(tmp_path / "ref")


@pytest.mark.parametrize("sig, line", [(signal.SIGINT, "devices:"), (signal.SIGTERM, "model:")])
@pytest.mark.slow
def test_a_signal_before_the_first_step_exits_75_in_one_line(tmp_path, sig, line):
    """Ctrl-C while the data is prepared, SIGTERM between the restore and the compile: nothing new to save, so the
    run stops at once, with exit 75 and one line (before, SIGTERM there exited 143 silently, SIGINT a traceback)."""
    p = subprocess.Popen(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, "steps=100000")],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    for out in p.stdout:
        if out.startswith(line):
            p.send_signal(sig)
            break
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-2000:]
    assert (
        err
        == f"stopped: {sig.name} before the first step: nothing new to save; rerun the same command to go on\n"
    )


def test_a_run_directory_moved_away_under_a_live_run_stops_it(tmp_path):
    """The run directory renamed and another put at its path mid-run: the run stops at its next write with one line
    and exit 74, and writes nothing into the replacement (before, it went on writing its steps there)."""
    run_dir = tmp_path / "default"
    p = subprocess.Popen(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, "steps=1000000")],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    for out in p.stdout:
        if out.startswith("step 3/"):
            os.rename(run_dir, tmp_path / "moved")
            run_dir.mkdir()
            (run_dir / "another-run").write_text("")
            break
    _, err = p.communicate(timeout=120)
    assert p.returncode == 74 and err.count("\n") == 1, err[-2000:]
    assert f"{run_dir} was moved or replaced under this run" in err
    assert os.listdir(run_dir) == ["another-run"]
    assert metrics(tmp_path / "moved")[0]["step"] == 1  # what it wrote went with its directory


def test_a_resume_whose_tokenizer_would_change_stops_naming_it(tmp_path):
    """The run keeps its tokenizer (RUN_DIR/tokenizer.model). Resumed on text files that changed, a new tokenizer
    would give the checkpoint's token ids another meaning: one line names the change (before: nothing said);
    the same files resume as before."""
    from conftest import write_corpus

    write_corpus(tmp_path / "corpus", 6, "doc", 0)
    keys = [f"dataset_path={tmp_path}/corpus/*.txt", f"cache_dir={tmp_path}/cache"]
    train.run(config(tmp_path, "steps=2", *keys, preset=TEXT), jax.devices()[:1])
    shutil.rmtree(tmp_path / "cache")  # trained again from the same text: the same tokenizer
    assert (
        train.run(config(tmp_path, "steps=3", *keys, preset=TEXT), jax.devices()[:1])["step"] == 3
    )
    assert (tmp_path / "default" / "tokenizer.model").is_file()
    write_corpus(tmp_path / "corpus", 6, "other", 1)
    with pytest.raises(
        train.data.DataError,
        match=r"tokenizer would change with the training text .*start a new run_name",
    ):
        train.run(config(tmp_path, "steps=4", *keys, preset=TEXT), jax.devices()[:1])


def test_a_run_holds_its_directory_whatever_form_its_path_takes(tmp_path, monkeypatch):
    """Under a relative output_dir, a swap is caught on the paths as written and as orbax names them (absolute)."""
    monkeypatch.chdir(tmp_path)
    with train.run_directory(train.load_config(BASE, args(tmp_path, "output_dir=rel"))):
        os.rename("rel/default", "moved")
        os.makedirs("rel/default")
        for path in (
            "rel/default/metrics.jsonl",
            str(tmp_path / "rel" / "default" / "checkpoints"),
        ):
            with pytest.raises(train.data.WriteError, match="was moved or replaced under this run"):
                train.data.check_held(path)
