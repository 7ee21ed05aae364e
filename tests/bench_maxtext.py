"""Per-device memory of the compiled train step, ours against MaxText's, on the same model and the same XLA.

Both sides compile ahead of time for a TPU slice on this machine (no TPU needed): ours with compile_topology=,
MaxText with its train_compile module. The model is the README's 0.9B preset (identical parameter counts),
per_device_batch 16, remat full, FSDP over the slice, splash attention on both; each row is the LM head untiled
or tiled on both sides. Prints the machine, the date and one line per row. Run ours on the Python whose JAX and
libtpu MaxText's environment has (MaxText 0.2.5 installs on Python 3.12 only):

    python3.12 -m venv ~/mt && ~/mt/bin/pip install "maxtext[tpu]==0.2.5" jax==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.51
    python tests/bench_maxtext.py --maxtext-python ~/mt/bin/python --topology v4-8 --vocab 32768 128256
"""

import argparse
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = {"v4-8": "1,4,1", "v5e-8": "1,8,1", "v5p-8": "1,4,1", "v6e-8": "1,8,1"}
MODEL = [
    "d_model=2048",
    "num_layers=16",
    "num_heads=16",
    "num_kv_heads=8",
    "mlp_dim=5632",
    "max_target_length=2048",
]
THEIRS = [
    "base_emb_dim=2048",
    "base_num_decoder_layers=16",
    "base_num_query_heads=16",
    "base_num_kv_heads=8",
    "base_mlp_dim=5632",
    "head_dim=128",
    "max_target_length=2048",
    "per_device_batch_size=16",
    "dtype=bfloat16",
    "weight_dtype=float32",
    "remat_policy=full",
    "scan_layers=true",
    "ici_fsdp_parallelism=-1",
    "attention=flash",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "run_name=bench",
]
ENV = {**os.environ, "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def ours(topology, vocab, tile):
    cmd = [
        sys.executable,
        "train.py",
        "base.yml",
        f"compile_topology={topology}",
        f"mesh={MESH[topology]}",
        "per_device_batch=16",
        "grad_accum=1",
        "dtype=bfloat16",
        "remat=full",
        "attention=splash",
        *MODEL,
        f"vocab_size={vocab}",
        f"vocab_tile={tile}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV, check=False)
    found = re.search(r"= ([\d.]+) GiB of", out.stdout)
    return float(found.group(1)) if found else None


def maxtext(python, topology, vocab, tiles, workdir):
    config = (
        subprocess.run(
            [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        + "/configs/base.yml"
    )
    cmd = [
        python,
        "-m",
        "maxtext.trainers.pre_train.train_compile",
        config,
        f"compile_topology={topology}",
        "compile_topology_num_slices=1",
        f"base_output_directory={workdir}",
        *THEIRS,
        f"vocab_size={vocab}",
        f"num_vocab_tiling={tiles}",
    ]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=ENV, check=False)
    m = {k: int(v) for k, v in re.findall(r"(\w+)_size_in_bytes=(\d+)", out.stdout + out.stderr)}
    return (m["argument"] + m["temp"] + m["output"] - m["alias"]) / 2**30 if m else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--maxtext-python",
        required=True,
        help="the python of an environment with maxtext[tpu] installed",
    )
    p.add_argument("--topology", default="v4-8", choices=sorted(MESH))
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 128256])
    p.add_argument("--workdir", default="/tmp/bench_maxtext")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    print(
        f"{datetime.date.today()} {platform.node()} ({cpu}); per-device GiB of the compiled step on {a.topology}"
    )
    for vocab in a.vocab:
        tile = max(
            t for t in range(1, 4097) if vocab % t == 0
        )  # the largest tile up to 4096 that divides it
        for name, ours_tile, their_tiles in (
            ("untiled", 0, 1),
            (f"tiled ({tile} / 8 tiles)", tile, 8),
        ):
            mine, theirs = (
                ours(a.topology, vocab, ours_tile),
                maxtext(a.maxtext_python, a.topology, vocab, their_tiles, a.workdir),
            )
            ratio = f"{mine / theirs:.2f}x" if mine and theirs else "-"
            print(
                f"vocab {vocab:,} head {name}: ours {mine} GiB, MaxText {theirs and round(theirs, 2)} GiB, {ratio}",
                flush=True,
            )


if __name__ == "__main__":
    main()
