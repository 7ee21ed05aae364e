"""What keeping a run in a bucket costs, measured against local disk on the GCS emulator (fake-gcs-server, as the
tests use it). Run by hand (pytest does not collect it):

    python tests/bench_storage.py            # checkpoint save and stall: the default model and a larger one
    python tests/bench_storage.py --uploads  # bytes uploaded for metrics.jsonl and TensorBoard over 1,000 steps

Checkpoints: the train state of each model is saved 5 times through the trainer's own CheckpointManager; `stall` is
the time save_checkpoint() blocks the loop (the device-to-host copy and the dispatch; the write itself is async),
`commit` the time until the step is committed. Medians. Uploads: a 1,000-step run of the tiny test model on the
emulator, counting the bytes the trainer hands to write() and append() per file, beside each file's final size
(equal means every byte went up once: no O(N^2) re-upload). The first line names the machine and the date.
"""

import argparse
import collections
import datetime
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
from conftest import BASE, LM, ROOT, Emulator

import train

MODELS = {
    "default (base.yml)": [],
    "larger (d=1024, 8 layers, mlp 2816)": [
        "d_model=1024",
        "num_layers=8",
        "num_heads=16",
        "num_kv_heads=4",
        "mlp_dim=2816",
    ],
}
COUNT = """
import collections, json, sys
import train
sent = collections.Counter()
write, append = train.data.write, train.data.append
def count(f):
    def counted(path, data):
        sent[str(path).rsplit('/', 1)[-1].split('.steps-')[0]] += len(data if isinstance(data, bytes) else data.encode())
        return f(path, data)
    return counted
train.data.write, train.data.append = count(write), count(append)
code = train.main(['train.py', *sys.argv[1:]])
print('SENT ' + json.dumps(sent))
sys.exit(code)
"""


def machine():
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu}, {os.cpu_count()} cores"
    )


def checkpoint_costs(emulator, work):
    print(
        "| model | parameters | where | stall (median) | commit (median) |\n|---|---|---|---|---|"
    )
    for name, keys in MODELS.items():
        cfg = train.resolve(
            train.load_config(BASE, ["mesh=1,1,1", *keys]), train.model_lib.TASKS["lm"], "cpu"
        )
        task, devices = train.model_lib.TASKS["lm"], jax.devices()[:1]
        built = train.build(cfg, task, devices)
        with jax.set_mesh(built.mesh), train.nnx.logical_axis_rules(cfg.logical_axis_rules):
            state = train.init_state(cfg, built.layout)
        it = types.SimpleNamespace(
            state=lambda built=built: [{"row": 0}] * built.feed.rows, source="bench"
        )
        n = sum(x.size for x in jax.tree.leaves(state["params"]))
        for where in (os.path.join(work, name[:5]), f"{emulator.bucket()}/bench"):
            stall, commit = [], []
            with train.checkpoints(os.path.join(where, "checkpoints"), cfg) as mngr:
                for step in range(1, 6):
                    t0 = time.perf_counter()
                    train.save_checkpoint(mngr, step, state, it)
                    stall.append(time.perf_counter() - t0)
                    mngr.wait_until_finished()
                    commit.append(time.perf_counter() - t0)
            print(
                f"| {name} | {n / 1e6:.1f}M | {'gs:// emulator' if '://' in where else 'local disk'} | "
                f"{np.median(stall) * 1e3:.0f} ms | {np.median(commit) * 1e3:.0f} ms |",
                flush=True,
            )


def uploads(emulator):
    run = f"{emulator.bucket()}/runs"
    argv = [
        *(o for o in LM if not o.startswith("log_every=")),
        "steps=1000",
        "log_every=10",
        "checkpoint_every=100",
        f"output_dir={run}",
    ]
    r = subprocess.run(
        [sys.executable, "-c", COUNT, BASE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    import fsspec

    sent = json.loads(r.stdout.split("SENT ")[-1])
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    final = collections.Counter()
    for path in fs.find(f"{run}/default"):
        if "/checkpoints/" not in path:
            final[path.rsplit("/", 1)[-1].split(".steps-")[0]] += fs.info(path)["size"]
    print("| file | bytes uploaded | final size |\n|---|---|---|")
    for name in sorted(set(sent) | set(final)):
        print(f"| {name} | {sent.get(name, 0):,} | {final.get(name, 0):,} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--uploads", action="store_true")
    a = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as work:
        emulator = Emulator(work)
        os.environ.update(emulator.env)
        try:
            uploads(emulator) if a.uploads else checkpoint_costs(emulator, work)
        finally:
            emulator.stop()


if __name__ == "__main__":
    main()
