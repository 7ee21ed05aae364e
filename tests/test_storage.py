"""Runs that live in a bucket: output_dir=gs://... and inputs from gs://, against a real GCS emulator (the Go
fake-gcs-server, conftest's `gcs` fixture): exact resume after kill -9, two processes that share nothing but the
bucket, one owner per run directory, faults in one line, and every input and output path of every mode."""

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest
from conftest import (
    BASE,
    HF,
    ROOT,
    SUDOKU,
    TEXT,
    args,
    read_checkpoint,
    write_corpus,
    write_parquet,
)

import train

# A run slow enough to be interrupted at a chosen point: each step sleeps 0.15 s first (the math is untouched), and
# the 0-based steps listed in GATES wait until a file of that name exists in GATE_DIR.
SLOW = """
import os, sys, time
import train
next_batch, taken = train.next_batch, []
def slow(feed, it, *rest):
    step = len(taken)
    taken.append(step)
    time.sleep(0.15)
    while str(step) in os.environ.get('GATES', '').split(',') and not os.path.exists(f"{os.environ['GATE_DIR']}/{step}"):
        time.sleep(0.05)
    return next_batch(feed, it, *rest)
train.next_batch = slow
if os.environ.get('FAST_RETRIES'):  # gcsfs's retry waits 1+2+4+8+16 s (measured: ~35 s to the error); a tenth here
    import asyncio, types, gcsfs.retry
    gcsfs.retry.asyncio = types.SimpleNamespace(sleep=lambda s: asyncio.sleep(s / 10))
sys.exit(train.main(['train.py', *sys.argv[1:]]))
"""
RUN = ["steps=12", "checkpoint_every=4", "keep_checkpoints=0", "per_device_batch=2", "grad_accum=2"]


def gs():
    return fsspec.filesystem("gs")


def launch(argv, env, cwd=ROOT, slow=True):
    cmd = (
        [sys.executable, "-c", SLOW, BASE, *argv]
        if slow
        else [sys.executable, f"{ROOT}/train.py", BASE, *argv]
    )
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "PYTHONPATH": ROOT},
    )


def finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def ended(procs):
    """Every process's stderr tail, each stopped first: what a failed wait shows (not only the first's)."""
    for p in procs:
        p.kill()
    return "\n".join(f"process {i}: {finish(p)[2][-3000:]}" for i, p in enumerate(procs))


def wait_for(path, process, timeout=240):
    """Until `path` exists in the bucket (a checkpoint's commit marker); False if the process ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        gs().invalidate_cache()
        if gs().exists(path):
            return True
        time.sleep(0.05)
    return False


def bucket_rows(run_dir):
    """metrics.jsonl of a run in the bucket, checked to hold one row per step, in order."""
    gs().invalidate_cache()
    rows = [
        json.loads(line) for line in gs().cat_file(f"{run_dir}/metrics.jsonl").decode().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), [r["step"] for r in rows]
    return rows


def event_steps(run_dir, tmp_path):
    """The steps of the `loss` scalars in the run's TensorBoard event files, read back by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    local = tmp_path / "events"
    local.mkdir(exist_ok=True)
    for f in gs().glob(f"{run_dir}/events.out.tfevents.*"):
        (local / os.path.basename(f)).write_bytes(gs().cat_file(f))
    acc = EventAccumulator(str(local))
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")]


@pytest.mark.slow
def test_two_hosts_sharing_only_a_bucket_have_one_owner_and_resume_exactly_after_kill_9(
    gcs, tmp_path
):
    """Two processes as two hosts (separate working directories and caches, no shared local path), output_dir on the
    emulator. The same command started beside them stops in one line naming the holder; kill -9 both once checkpoint
    8 is committed, rerun both: the losses equal an uninterrupted one-process run's on the same bucket layout,
    metrics.jsonl and TensorBoard hold every step once, nothing was written locally; the compile cache fills in the
    bucket."""
    bucket, gates = gcs.bucket(), {"GATES": "4,9", "GATE_DIR": str(tmp_path)}
    keys = [*RUN, "mesh=2,-1,1", "per_device_batch=1", "prefetch=1"]
    hosts = [tmp_path / f"host{i}" for i in range(2)]
    for h in hosts:
        h.mkdir()

    def pair(**env):
        port = free_port()
        return [
            launch(
                args(h, *keys, f"output_dir={bucket}/two"),
                {
                    **gcs.env,
                    "JAX_NUM_CPU_DEVICES": "2",
                    "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                    "JAX_PROCESS_COUNT": "2",
                    "JAX_PROCESS_INDEX": str(i),
                    **env,
                },
                cwd=h,
                slow=bool(env),
            )
            for i, h in enumerate(hosts)
        ]

    four = {**gcs.env, "JAX_NUM_CPU_DEVICES": "4"}
    one = launch(
        args(tmp_path, *keys, f"output_dir={bucket}/one", f"compile_cache_dir={bucket}/xla"),
        four,
        slow=False,
    )
    procs = killed = pair(**gates)
    try:
        assert wait_for(f"{bucket}/two/default/checkpoints/4/commit_success.txt", procs[0]), ended(
            procs
        )
        code, _, err = finish(
            launch(args(tmp_path, *keys, f"output_dir={bucket}/two"), four, slow=False)
        )
        (tmp_path / "4").touch()
        assert wait_for(f"{bucket}/two/default/checkpoints/8/commit_success.txt", procs[0]), ended(
            procs
        )
        for p in procs:  # both wait at step 10 (gate 9): kill -9 while they hold the lock
            p.send_signal(signal.SIGKILL)
        assert [finish(p)[0] for p in procs] == [-signal.SIGKILL] * 2
        procs = pair()
        results = [finish(p) for p in procs + [one]]
    finally:
        for p in procs + [one]:
            p.kill()
    assert code == 2 and said(err).count("\n") == 1, err[
        -2000:
    ]  # the same command beside them: one owner
    assert said(err).startswith(
        f"error: {bucket}/two/default is in use by process {killed[0].pid} on "
    ), err
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-2000:] for r in results]
    assert (
        "resuming from checkpoint" in results[0][1]
        and "resuming from checkpoint" not in results[2][1]
    )
    assert (
        f"took over the lock of process {killed[0].pid} on " in results[0][1]
    )  # gone: no wait for its lease
    assert not any(
        os.listdir(h / "default") if (h / "default").exists() else [] for h in hosts
    )  # nothing local
    want, got = bucket_rows(f"{bucket}/one/default"), bucket_rows(f"{bucket}/two/default")
    worst = np.max(np.abs(np.subtract([r["loss"] for r in want], [r["loss"] for r in got])))
    print(f"two processes vs one, after kill -9 and resume: worst loss difference {worst:.3g}")
    assert len(got) == 12 and worst < 1e-5
    assert event_steps(f"{bucket}/two/default", tmp_path) == list(range(1, 13))
    assert gs().exists(f"{bucket}/two/default/config.yml") and gs().find(f"{bucket}/xla")


def said(err):
    """stderr less tensorstore's note that it uses the emulator's dummy token (GOOGLE_AUTH_TOKEN_FOR_TESTING, a test
    setting: no real run has it)."""
    return "".join(
        line
        for line in err.splitlines(keepends=True)
        if "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in line
    )


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bucket_lease_expires_and_is_taken_over_once(gcs):
    import socket

    """The lock object of a run on another host: refused while its lease runs, taken over once it has run out
    (conditionally: a second newcomer loses); on this host a holder whose process is gone is taken over at once."""
    bucket = gcs.bucket()
    path = f"{bucket}/run/.lock"
    other = {
        "holder": "process 7 on elsewhere since then",
        "pid": 7,
        "host": "elsewhere",
        "until": time.time() + 60,
    }
    gs().pipe_file(path, json.dumps(other).encode())
    assert train.data.BucketLease(path).acquire() == other["holder"]
    gs().pipe_file(path, json.dumps({**other, "until": time.time() - 1}).encode())
    stale = gs().info(path)["generation"]
    winner = train.data.BucketLease(path)
    assert winner.acquire() == ""
    with pytest.raises(
        FileExistsError
    ):  # a second newcomer that read the same stale lease: its takeover fails
        train.data.BucketLease(path).put(stale)
    assert (
        train.data.BucketLease(path).acquire().startswith(f"process {os.getpid()} on ")
    )  # the winner holds it
    assert json.loads(gs().cat_file(path))["pid"] == os.getpid()
    winner.close()
    assert not gs().exists(path)
    gs().pipe_file(
        path, b'{"holder": "a run cut off mid-write'
    )  # not the JSON a run writes: taken over, said once
    said_once = []
    assert train.data.BucketLease(path, log=said_once.append).acquire() == ""
    assert said_once == [
        (
            "took over the lock of an unreadable lease object (its lease ran out, its process is gone, or "
            "it was unreadable)"
        )
    ], said_once
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=False,
    )
    gs().pipe_file(
        path, json.dumps({**other, "pid": int(dead.stdout), "host": socket.gethostname()}).encode()
    )
    assert train.data.BucketLease(path).acquire() == ""


@pytest.mark.slow
def test_missing_bucket_and_missing_credentials_are_one_line(gcs, tmp_path):
    """Exit 74 and one line, before anything trains; gcsfs would otherwise create the bucket a typo names."""
    code, _, err = finish(
        launch(
            args(tmp_path, "steps=2", "output_dir=gs://no-such-bucket/runs"), gcs.env, slow=False
        )
    )
    assert (
        code == 74 and err.count("\n") == 1 and "bucket gs://no-such-bucket does not exist" in err
    ), err
    assert not gs().exists("no-such-bucket")
    print(f"no bucket: exit {code}: {err.strip()}")
    env = {
        k: v
        for k, v in gcs.env.items()
        if k not in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
    }
    env["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "no-key.json")
    code, _out, err = finish(
        launch(args(tmp_path, "steps=2", "output_dir=gs://any/runs"), env, slow=False)
    )
    assert code == 74 and err.count("\n") == 1 and "no Google credentials found" in err, err
    print(f"no credentials: exit {code}: {err.strip()}")
    assert "gcloud auth application-default login" in err


@pytest.mark.slow
def test_storage_going_away_mid_run_ends_in_one_line_and_keeps_checkpoints(gcs, tmp_path):
    """The emulator stops after checkpoint 4 (the run waiting at step 5 meanwhile): bounded retries (gcsfs's, their
    waits cut to a tenth here), then one line and exit 74, no traceback; once the emulator is back, checkpoint 4 is
    committed and reads back."""
    bucket = gcs.bucket()
    run = launch(
        args(tmp_path, *RUN, f"output_dir={bucket}/runs"),
        {**gcs.env, "GATES": "4", "GATE_DIR": str(tmp_path), "FAST_RETRIES": "1"},
    )
    try:
        assert wait_for(f"{bucket}/runs/default/checkpoints/4/commit_success.txt", run), finish(
            run
        )[2][-3000:]
        gcs.stop()
        (tmp_path / "4").touch()
        t0 = time.time()
        code, _, err = finish(run, timeout=240)
        took = time.time() - t0
    finally:
        run.kill()
        if gcs.process.poll() is not None:
            gcs.start()
    err = said(err)
    assert code == 74 and err.count("\n") == 1 and err.startswith("error: gs://"), err[-3000:]
    assert "intact" in err or "the ones written before stay as they are" in err, err
    assert took < 60, took
    print(f"storage gone: exit {code} after {took:.0f} s: {err.strip()}")
    assert read_checkpoint(f"{bucket}/runs/default", 4)["train_state"]["step"] == 4


@pytest.mark.slow
def test_every_input_and_output_path_on_a_bucket(gcs, tmp_path):
    """Text files, a tokenizer, Hugging Face parquet files, Sudoku CSVs, load_params and load_hf read from gs://;
    config.yml, metrics.jsonl, TensorBoard events, checkpoints, export, eval.json and
    generation.txt written there; nothing of a run on local disk."""
    import jax
    from conftest import config

    bucket = gcs.bucket()
    write_corpus(tmp_path / "corpus", 8, "doc", 0)
    write_parquet(str(tmp_path / "hf" / "train.parquet"), 8, "doc", 0)
    q, a = train.data.generate_sudoku(48, 45, 0, stream="test")
    train.data.write_sudoku_csv(str(tmp_path / "puzzles.csv"), q, a)
    gs().put(str(tmp_path / "corpus"), f"{bucket}/corpus", recursive=True)
    gs().put(str(tmp_path / "hf" / "train.parquet"), f"{bucket}/hf/train.parquet")
    gs().put(str(tmp_path / "puzzles.csv"), f"{bucket}/sudoku.csv")
    runs, one = f"{bucket}/runs", jax.devices()[:1]
    text = lambda *o: config(
        tmp_path, f"dataset_path={bucket}/corpus/*.txt", f"output_dir={runs}", *o, preset=TEXT
    )
    train.run(text("steps=2", "run_name=a"), one)
    train.run(text("mode=export", "run_name=a", f"export_dir={bucket}/export"), one)
    train.run(text("mode=eval", "run_name=e", f"load_params={runs}/a", "eval_batches=1"), one)
    train.run(
        text(
            "mode=generate",
            "run_name=g",
            f"load_hf={bucket}/export",
            "prompt=doc",
            "max_new_tokens=4",
            "temperature=0",
            f"tokenizer_path={bucket}/export/tokenizer.model",
        ),
        one,
    )
    train.run(
        config(
            tmp_path,
            f"hf_data_files={bucket}/hf/train.parquet",
            f"output_dir={runs}",
            "run_name=h",
            "steps=1",
            "eval_batches=0",
            preset=HF,
        ),
        one,
    )
    train.run(
        config(
            tmp_path,
            f"dataset_path={bucket}/sudoku.csv",
            f"eval_path={bucket}/sudoku.csv",
            f"output_dir={runs}",
            "run_name=s",
            "steps=1",
            preset=SUDOKU,
        ),
        one,
    )
    gs().invalidate_cache()
    have = {p.removeprefix(bucket[5:] + "/") for p in gs().find(bucket)}
    for want in (
        "runs/a/config.yml",
        "runs/a/metrics.jsonl",
        "runs/a/checkpoints/2/commit_success.txt",
        "export/model.safetensors",
        "export/config.json",
        "export/tokenizer.model",
        "export/tokenizer_config.json",
        "runs/e/eval.json",
        "runs/g/generation.txt",
        "runs/h/checkpoints/1/commit_success.txt",
        "runs/s/metrics.jsonl",
    ):
        assert want in have, sorted(have)
    assert any(p.startswith("runs/a/events.out.tfevents.steps-") for p in have)
    assert not (tmp_path / "runs").exists() and not os.path.exists(os.path.join(ROOT, "gs:"))
