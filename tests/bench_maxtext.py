"""Per-device memory of the compiled train step, ours against MaxText's, on the same model and the same XLA.

Both sides compile ahead of time for a TPU slice on this machine (no TPU needed): ours with compile_topology=,
MaxText with its train_compile module. The model is the README's 0.9B preset (identical parameter counts),
per_device_batch 16, remat full, FSDP over the slice, splash attention on both; each row is the LM head untiled
or tiled on both sides. Prints the machine, the date and one line per row. Run ours on the Python whose JAX and
libtpu MaxText's environment has (MaxText 0.2.5 installs on Python 3.12 only):

    python3.12 -m venv ~/mt && ~/mt/bin/pip install "maxtext[tpu]==0.2.5" jax==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.51
    python tests/bench_maxtext.py --maxtext-python ~/mt/bin/python --topology v4-8 --vocab 32768 128256

--lora DIR (a directory holding Llama 3 8B's published config.json; no weights are read): LoRA instead, rank 16 on
all seven projections, the base bf16 and frozen, at 2,048 tokens, per_device_batch 4, remat full, FSDP over the slice.
MaxText's LoRA lives in its SFT trainer (qwix, maxtext/utils/lora_utils.py); its train_compile builds the model
without adapters (the optimizer over nn.LoRAParam then holds nothing), so this file, run by MaxText's Python with
--maxtext-side, applies qwix's LoRA to train_compile's abstract model as the SFT trainer does, then runs
train_compile unchanged and prints the adapters' and the optimizer's sizes (the step must train 41.9M values):

    python tests/bench_maxtext.py --maxtext-python ~/mt/bin/python --topology v5e-8 --lora ~/llama3-8b
"""

import argparse
import datetime
import math
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
LORA_OURS = [
    "per_device_batch=4",
    "grad_accum=1",
    "dtype=bfloat16",
    "weight_dtype=bfloat16",
    "remat=full",
    "attention=splash",
    "max_target_length=2048",
    "lora.rank=16",
    "lora.alpha=16",
]
# MaxText's attention stays autoselected (flash on the TPU mesh): qwix finds the projections by a forward of one
# token, which the flash kernel refuses (its block must be a multiple of 128).
LORA_THEIRS = [
    "model_name=llama3-8b",
    "max_target_length=2048",
    "per_device_batch_size=4",
    "gradient_accumulation_steps=1",
    "dtype=bfloat16",
    "weight_dtype=bfloat16",
    "remat_policy=full",
    "scan_layers=true",
    "ici_fsdp_parallelism=-1",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "jax_cache_dir=",
    "run_name=bench",
]
LORA_YML = """base_config: "base.yml"
lora:
  enable_lora: true
  lora_rank: 16
  lora_alpha: 16.0
"""


def ours(topology, vocab, tile):
    return compiled(
        topology,
        "per_device_batch=16",
        "grad_accum=1",
        "dtype=bfloat16",
        "remat=full",
        "attention=splash",
        *MODEL,
        f"vocab_size={vocab}",
        f"vocab_tile={tile}",
    )


def compiled(topology, *keys):
    """Our step for the slice: GiB per device as the trainer prints it, or None."""
    cmd = [
        sys.executable,
        "train.py",
        "base.yml",
        f"compile_topology={topology}",
        f"mesh={MESH[topology]}",
        *keys,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV, check=False)
    found = re.search(r"= ([\d.]+) GiB of", out.stdout)
    return float(found.group(1)) if found else None


def maxtext(python, topology, vocab, tiles, workdir):
    return theirs(
        python,
        workdir,
        ["-m", "maxtext.trainers.pre_train.train_compile", configs(python) + "/base.yml"],
        topology,
        *THEIRS,
        f"vocab_size={vocab}",
        f"num_vocab_tiling={tiles}",
    )[0]


def configs(python):
    """MaxText's configs directory in the environment of `python`."""
    return (
        subprocess.run(
            [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        + "/configs"
    )


def theirs(python, workdir, entry, topology, *keys):
    """MaxText's compiled step for the slice: (GiB per device or None, its whole output)."""
    cmd = [
        python,
        *entry,
        f"compile_topology={topology}",
        "compile_topology_num_slices=1",
        f"base_output_directory={workdir}",
        *keys,
    ]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=ENV, check=False)
    m = {k: int(v) for k, v in re.findall(r"(\w+)_size_in_bytes=(\d+)", out.stdout + out.stderr)}
    gib = (m["argument"] + m["temp"] + m["output"] - m["alias"]) / 2**30 if m else None
    return gib, out.stdout + out.stderr


def lora_rows(python, topology, folder, workdir):
    """Ours and MaxText's LoRA step on Llama 3 8B (config.json in `folder`), LM head untiled and tiled."""
    yml = os.path.join(workdir, "lora.yml")
    pathlib.Path(yml).write_text(LORA_YML)
    mine = compiled(topology, f"load_hf={folder}", *LORA_OURS)
    for tiles in (1, 8):
        gib, out = theirs(
            python,
            workdir,
            [os.path.abspath(__file__), "--maxtext-side", yml],
            topology,
            *LORA_THEIRS,
            f"num_vocab_tiling={tiles}",
        )
        counts = re.search(r"^adapters: .*$", out, re.MULTILINE)
        ratio = f"{mine / gib:.2f}x" if mine and gib else "-"
        print(
            f"Llama 3 8B LoRA r16, MaxText num_vocab_tiling={tiles}: ours {mine} GiB, MaxText "
            f"{gib and round(gib, 2)} GiB, {ratio} ({counts and counts.group(0)})",
            flush=True,
        )


def maxtext_side(argv):
    """Run by MaxText's Python: train_compile with qwix's LoRA applied to the abstract model it builds, as the SFT
    trainer applies it (lora_utils.apply_lora_to_model), less what needs concrete arrays: no reshard, the abstract
    mesh instead of set_mesh (refused under nnx.eval_shape), the adapters replicated as lora_utils makes them."""
    import jax
    import qwix
    from flax import nnx
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import lora_utils

    def with_lora(model, mesh, config):
        provider = lora_utils._build_lora_provider(config)
        decoder = getattr(model, "decoder", model)
        tokens, positions = lora_utils._prepare_dummy_inputs(mesh)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            model = qwix.apply_lora_to_model(
                model,
                provider,
                decoder_input_tokens=tokens,
                decoder_positions=positions,
                rngs=getattr(decoder, "rngs", None),
            )
        nnx.pop(
            model, nnx.Intermediate
        )  # the discovery forward's sown values, as train_sft pops them
        for _, value in nnx.iter_graph(model):
            if hasattr(value, "__dict__") and "qwix_rngs" in value.__dict__:
                del value.qwix_rngs
            if isinstance(value, nnx.LoRAParam):
                value.set_metadata(
                    sharding=jax.sharding.PartitionSpec(), out_sharding=None, sharding_names=None
                )
        return model

    create_abstract = train_compile.model_creation_utils.create_nnx_abstract_model
    shaped_inputs = train_compile.get_shaped_inputs

    def create(config, mesh=None, *args, **kwargs):
        make, abstract = create_abstract(config, mesh, *args, **kwargs)
        return (lambda: with_lora(make(), mesh, config)), abstract

    def shaped(mesh, config):
        out = shaped_inputs(mesh, config)
        sizes = {"adapters": 0, "optimizer": 0}
        for path, x in jax.tree_util.tree_leaves_with_path(out[0][0]):
            name = jax.tree_util.keystr(path)
            kind = "optimizer" if name.startswith("['optimizer']") else "adapters"
            if kind == "optimizer" or "lora" in name:
                sizes[kind] += math.prod(x.shape)
        print(f"adapters: {sizes['adapters']:,} values, optimizer state {sizes['optimizer']:,}")
        return out

    train_compile.model_creation_utils.create_nnx_abstract_model = create
    train_compile.get_shaped_inputs = shaped
    train_compile.main([sys.argv[0], *argv])


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
    p.add_argument("--lora", metavar="DIR", help="LoRA on Llama 3 8B: DIR holds its config.json")
    if sys.argv[1:2] == ["--maxtext-side"]:  # MaxText's Python, started by lora_rows
        return maxtext_side(sys.argv[2:])
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
    if a.lora:
        return lora_rows(a.maxtext_python, a.topology, os.path.abspath(a.lora), a.workdir)
    for vocab in a.vocab:
        tile = max(
            t for t in range(1, 4097) if vocab % t == 0
        )  # the largest tile up to 4096 that divides it
        for name, ours_tile, their_tiles in (
            ("untiled", 0, 1),
            (f"tiled ({tile} / 8 tiles)", tile, 8),
        ):
            mine = ours(a.topology, vocab, ours_tile)
            them = maxtext(a.maxtext_python, a.topology, vocab, their_tiles, a.workdir)
            ratio = f"{mine / them:.2f}x" if mine and them else "-"
            print(
                f"vocab {vocab:,} head {name}: ours {mine} GiB, MaxText {them and round(them, 2)} GiB, {ratio}",
                flush=True,
            )


if __name__ == "__main__":
    main()
