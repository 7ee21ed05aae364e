"""Bad input, as a user meets it: every case below runs through the command line and must exit non-zero
with one line on stderr (file descriptor 2, so C++ libraries count too) and no traceback."""

import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import safetensors.numpy
import yaml
from conftest import (
    BASE,
    ENV,
    LM,
    ROOT,
    TEXT,
    args,
    config,
    metrics,
    start_trainer,
    trainer_results,
    write_corpus,
)

import train

# (arguments after `python train.py`, the line stderr shows); {tmp} is a scratch directory the fixture
# fills with the files some cases need. A first argument ending in .yml replaces base.yml (more may follow it).
CASES = [
    (["stepz=5"], "error: unknown key 'stepz'; did you mean steps?"),
    (["steps=many"], "error: steps=many: expected an integer"),
    (["steps=5", "steps=6"], "error: steps is given twice on the command line; keep one"),
    (["steps"], "error: argument 'steps' is not key=value"),
    (["remat=some"], "error: remat='some': choose one of 'none', 'full', 'save_dots'"),
    (["steps=0"], "error: steps=0: must be >= 1"),
    (["learning_rate=-1"], "error: learning_rate=-1: must be > 0"),
    (["min_lr_ratio=1.5"], "error: min_lr_ratio=1.5: must be <= 1"),
    (["adam_b2=1"], "error: adam_b2=1: must be < 1"),
    (["grad_clip=-1"], "error: grad_clip=-1: must be >= 0"),
    (["per_device_batch=0"], "error: per_device_batch=0: must be >= 1"),
    (["trm.halt_explore_prob=2"], "error: trm.halt_explore_prob=2: must be <= 1"),
    (["thoughts_per_step=10"], "error: thoughts_per_step=10: must be <= 9"),
    (["num_kv_heads=3"], "error: num_heads=8 must be a multiple of num_kv_heads=3"),
    (["head_dim=7"], "error: head dim 7 must be even for RoPE; set head_dim"),
    (["mesh=0,1,1"], "error: mesh=0,1,1: use positive sizes and at most one -1"),
    (
        ["mesh=3,1,1"],
        (
            "error: mesh=3,1,1 (data,fsdp,tensor) needs 3 devices but JAX sees 1 cpu device(s); "
            "use e.g. mesh=1,1,1 or mesh=1,-1,1"
        ),
    ),
    (
        ["num_slices=2"],
        "error: num_slices=2: the devices are in 1 slice(s) (processes off TPU); set it to 1",
    ),
    (
        ["dcn_mesh=2,1,1"],
        (
            "error: dcn_mesh=2,1,1: give the slices of each axis of mesh=1,1,1 (data,fsdp,tensor), 1 in "
            "all, each a divisor of its axis; e.g. mesh=1,-1,1"
        ),
    ),
    (
        ["profile_steps=3,2"],
        "error: profile_steps=3,2: give two steps a,b with 1 <= a <= b <= steps=200 (0,0 = off)",
    ),
    (
        ["compile_topology=v9-8"],
        (
            "error: compile_topology='v9-8': choose one of '', 'v2-8', 'v3-8', 'v4-8', 'v4-32', "
            "'v4-64', 'v5e-1', 'v5e-8', 'v5p-8', 'v6e-1', 'v6e-8', 'tpu7x-8'"
        ),
    ),
    (
        ["load_params={tmp}/no-run"],
        (
            "error: load_params={tmp}/no-run: no such directory; fix the path "
            "(or set load_params= to leave it out)"
        ),
    ),
    (
        ["load_hf={tmp}/no-hf"],
        (
            "error: load_hf={tmp}/no-hf: no such directory; fix the path (or set load_hf= "
            "to leave it out)"
        ),
    ),
    (
        ["load_params={tmp}", "load_hf={tmp}"],
        "error: load_params and load_hf are both set; keep one",
    ),
    (
        ["data_dir=gs://b/tfds"],
        (
            "error: data_dir=gs://b/tfds: prepared datasets are read through a local file layer; "
            "give a local directory (copy the data down with `gcloud storage cp -r`, or mount the "
            "bucket with gcsfuse)"
        ),
    ),
    (
        ["tokenizer_path={tmp}/no.model"],
        (
            "error: tokenizer_path={tmp}/no.model: no such file; fix the path "
            "(or set tokenizer_path= to leave it out)"
        ),
    ),
    (
        ["dataset=files", "dataset_path={tmp}/none/*.txt"],
        (
            "error: dataset_path={tmp}/none/*.txt: matches no files; "
            "fix the path (or set dataset_path= to leave it out)"
        ),
    ),
    (
        ["task=sudoku", "dataset_path={tmp}/no.csv"],
        (
            "error: dataset_path={tmp}/no.csv: no such file; fix the path "
            "(or set dataset_path= to leave it out)"
        ),
    ),
    (
        ["task=sudoku", "sudoku_train_puzzles=8", "eval_path={tmp}/bad.csv"],
        "error: {tmp}/bad.csv:3: q has 80 characters, expected 81",
    ),
    (
        ["mode=eval", "dataset=synthetic", "run_name=never-trained"],
        (
            "error: mode=eval needs trained parameters: set load_params=RUN_DIR, load_hf=DIR, or run_name= a run with "
            "checkpoints (none in {tmp}/runs/never-trained/checkpoints)"
        ),
    ),
    (
        ["output_dir={tmp}/a-file/runs"],
        (
            "error: output_dir={tmp}/a-file/runs: cannot write in {tmp}/a-file/runs/default "
            "(Not a directory); choose a writable output_dir"
        ),
    ),
    (
        ["cache_dir={tmp}/a-file/cache"],
        (
            "error: cache_dir={tmp}/a-file/cache: cannot create it (Not a directory); "
            "choose a writable cache_dir"
        ),
    ),
    (["{tmp}/no.yml"], "error: cannot read config file {tmp}/no.yml: No such file or directory"),
    (
        ["{tmp}/broken.yml"],
        "error: {tmp}/broken.yml is not valid YAML: while parsing a flow sequence",
    ),
    (
        ["run_name="],
        "error: run_name='': give a plain directory name, printable, no / (the run goes to output_dir/run_name)",
    ),
    (
        ["logical_axis_rules=[[batch]]"],
        (
            "error: logical_axis_rules=[[batch]]: give a list of [logical axis, mesh axis "
            "or list of them or null] pairs, e.g. [[batch, [data, fsdp]], [embed, fsdp]]"
        ),
    ),
    (
        ["mesh_axes=data,fsdp,model"],
        (
            "error: logical_axis_rules maps 'heads' to mesh axis 'tensor', which "
            "mesh_axes=data,fsdp,model does not name"
        ),
    ),
    (
        ["load_params={tmp}"],
        (
            "error: load_params={tmp}: no checkpoint there; give a run directory, its checkpoints/ "
            "directory or one checkpoints/STEP directory"
        ),
    ),
    (
        ["task=sudoku", "decoder=trm_parallel", "parallel.budget=100"],
        (
            "error: parallel.budget=100: below the 512 forward passes every puzzle runs "
            "(parallel.trajectories x trm.eval_steps or trm.N_sup); raise it or run fewer trajectories"
        ),
    ),
    (
        ["task=sudoku", "mode=generate", "prompt=123"],
        (
            "error: prompt='123': give the puzzle as 81 characters, digits "
            "1-9 and . or 0 for blanks, row by row"
        ),
    ),
    (
        [
            "output_dir={tmp}/damaged",
            *LM,
        ],  # the run the fixture trained, its checkpoints then garbled
        (
            "error: no readable checkpoint in {tmp}/damaged/default/checkpoints (steps 2, 4 are damaged, see the "
            "warnings): move them away to start over, or set resume=false"
        ),
    ),
    # Config files: the schema checks them as it checks the command line; your own file layers on base.yml.
    (
        ["{tmp}/list.yml"],
        "error: {tmp}/list.yml: expected key: value lines at the top level, as in base.yml",
    ),
    (
        ["{tmp}/binary.yml"],
        (
            "error: {tmp}/binary.yml is not valid YAML: unacceptable character #x0000: special "
            "characters are not allowed"
        ),
    ),
    (
        ["{tmp}/partial.yml"],
        (
            "error: {tmp}/partial.yml: key task is missing; list base.yml first to take it "
            "from there: train.py base.yml {tmp}/partial.yml"
        ),
    ),
    (["base.yml", "{tmp}/partial.yml", "{tmp}/yes.yml"], "error: steps=true: expected a number"),
    (
        ["base.yml", "{tmp}/scalar.yml"],
        "error: {tmp}/scalar.yml: trm is a section of keys, not a value",
    ),
    (
        ["base.yml", "{tmp}/typo.yml"],
        "error: {tmp}/typo.yml: unknown key 'stepz'; did you mean steps?",
    ),
    (["seed=99999999999"], "error: seed=99999999999: must be <= 2147483647"),
    (["learning_rate=1e39"], "error: learning_rate=1e39: must be <= 3.40282e+38"),  # inf in float32
    (
        ["output_dir=gs://bucket/exp#3"],
        (
            "error: output_dir=gs://bucket/exp#3: tensorstore reads a gs:// path as a URL "
            "(it cuts ? and # and decodes %XX), so arrays would land outside it; choose a name without ?, # or %"
        ),
    ),
    # Paths that exist but hold the wrong thing.
    (
        [*TEXT, "dataset_path={tmp}/corpus/*.txt", "tokenizer_path={tmp}/text.model"],
        (
            "error: tokenizer_path={tmp}/text.model: not a sentencepiece model (INTERNAL: could not parse ModelProto from "
            "{tmp}/text.model); give a .model file or a tokenizer.json, or '' to train one"
        ),
    ),
    (
        ["load_hf={tmp}/hf-list"],
        "error: {tmp}/hf-list/config.json: holds a JSON list, not the object of a model config",
    ),
    (
        ["task=sudoku", "sudoku_train_puzzles=8", "eval_path={tmp}/puzzles.csv.gz"],
        "error: eval_path='{tmp}/puzzles.csv.gz': not a text CSV (compressed? decompress it first)",
    ),
    (
        ["task=sudoku", "sudoku_train_puzzles=8", "eval_path={tmp}/long.csv"],
        "error: {tmp}/long.csv:2: field larger than field limit (131072)",
    ),
    (
        ["run_name=a\\b"],
        (
            "error: run_name=a\\b: the checkpoint library cannot write under a path with a backslash; "
            "choose a name without one"
        ),
    ),
    (
        ["output_dir={tmp}/ckfile", *LM],
        (
            "error: {tmp}/ckfile/default/checkpoints is a file, where the run keeps its "
            "checkpoints: move it away"
        ),
    ),
    # Hugging Face datasets and Weights & Biases, without the network or an account (HF_HUB_OFFLINE=1 here).
    (
        ["dataset=hf"],
        (
            "error: dataset=hf needs hf_path: a hub dataset (roneneldan/TinyStories), or a builder (json, "
            "parquet, text, csv) with hf_data_files"
        ),
    ),
    (
        ["dataset=hf", "hf_path=roneneldan/TinyStories"],
        (
            "error: hf_path=roneneldan/TinyStories: Couldn't reach "
            "'roneneldan/TinyStories' on the Hub (OfflineModeIsEnabled) (offline, only datasets in cache_dir load; a private "
            "one needs HF_TOKEN)"
        ),
    ),
    (
        ["dataset=hf", "hf_path=parquet", "hf_data_files={tmp}/bad.csv"],
        (
            "error: hf_data_files={tmp}/bad.csv: ArrowInvalid: Parquet magic bytes not found in footer. Either the file is "
            "corrupted or this is not a parquet file."
        ),
    ),
    (
        ["wandb_project=p", *LM],
        (
            "error: wandb_project=p: W&B refused the run (UsageError: No API key configured. Use "
            "`wandb login` to log in.): log in with `wandb login` (or set WANDB_API_KEY), log "
            "offline with WANDB_MODE=offline, or set wandb_project="
        ),
    ),
    # Values past every bound, malformed lists, dotted keys in a file (read as the nested key), text not UTF-8.
    (
        ["mesh=[1,-1"],
        "error: mesh=[1,-1: expected a list: 4,4,2 or [4, 4, 2] with its brackets closed",
    ),
    (["steps=99999999999"], "error: steps=99999999999: must be <= 2147483647"),
    (["seed=1e400"], "error: seed=1e400: expected an integer"),
    (["base.yml", "{tmp}/dotted.yml"], "error: trm.T=0: must be >= 1"),
    (
        ["mode=generate", "prompt=\udcff\udcfeab"],
        "error: prompt=: the value is not UTF-8 text; retype it, or set the terminal to UTF-8",
    ),
    (
        ["attention=cudnn", *LM],
        (
            "error: attention=cudnn: cuDNN's kernel runs on NVIDIA GPUs, not on cpu; use "
            "attention=auto"
        ),
    ),
    # A stream fails as the same file read whole does; a damaged W&B run id is not a login problem.
    (
        [
            "dataset=hf",
            "hf_path=json",
            "hf_data_files={tmp}/bad.jsonl",
            "hf_streaming=true",
            "eval_batches=0",
        ],
        "error: hf_data_files: {tmp}/bad.jsonl:2: not JSON (Expecting value at column 1)",
    ),
    (
        ["wandb_project=p", "output_dir={tmp}/wandb", *LM],
        (
            "error: {tmp}/wandb/default/wandb_id: not a W&B run id (a run "
            "writes 12 hex digits there); restore it to keep logging to the same W&B run, or delete it to start a new one"
        ),
    ),
]


def command(case, tmp):
    """A case's arguments as its command line after `python train.py`: base.yml first unless it names another
    config file, the run directories under tmp unless it names its own."""
    argv = [a.replace("{tmp}", str(tmp)) for a in case]
    argv = argv if argv[0].endswith(".yml") else ["base.yml", *argv]
    for key, value in (("output_dir", f"{tmp}/runs"), ("cache_dir", f"{tmp}/cache")):
        if not any(a.startswith(f"{key}=") for a in argv):
            argv.append(f"{key}={value}")
    return argv


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case through `train.main` in one fresh one-device process (a process per case spent ~2 s a
    case importing JAX), each case's file descriptor 2 captured on its own."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "a-file").write_text("")
    (tmp / "broken.yml").write_text("steps: [1, 2\n")
    good = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
    (tmp / "bad.csv").write_text(
        f"source,q,a,rating\nok,{good[:40] + '.' * 41},{good},1\nbad,{'.' * 80},{good},1\n"
    )
    (tmp / "list.yml").write_text("- steps\n- 5\n")
    (tmp / "binary.yml").write_bytes(b"steps: 5\x00\x01")
    (tmp / "partial.yml").write_text("steps: 5\n")
    (tmp / "yes.yml").write_text("steps: yes\n")
    (tmp / "scalar.yml").write_text("trm: 3\n")
    (tmp / "typo.yml").write_text("stepz: 5\n")
    (tmp / "dotted.yml").write_text("trm.T: 0\n")
    (tmp / "bad.jsonl").write_text('{"text": "a"}\nnot json at all\n')
    (tmp / "wandb" / "default").mkdir(parents=True)
    (tmp / "wandb" / "default" / "wandb_id").write_bytes(b"\xff\x00 torn")
    write_corpus(tmp / "corpus", 6, "doc", 0)
    (tmp / "text.model").write_text("not a model\n")
    (tmp / "hf-list").mkdir()
    (tmp / "hf-list" / "config.json").write_text("[1, 2]")
    safetensors.numpy.save_file(
        {"x": np.zeros(1, np.float32)}, str(tmp / "hf-list" / "model.safetensors")
    )
    (tmp / "puzzles.csv.gz").write_bytes(gzip.compress((tmp / "bad.csv").read_bytes()))
    (tmp / "long.csv").write_text(f"source,q,a,rating\nx,{'.' * 200_000},{good},1\n")
    (tmp / "ckfile" / "default").mkdir(parents=True)
    (tmp / "ckfile" / "default" / "checkpoints").write_text("")
    train.run(
        config(tmp / "damaged", "steps=4", "checkpoint_every=2"), jax.devices()[:1]
    )  # then both steps garbled
    for step in ("2", "4"):
        (
            tmp / "damaged" / "default" / "checkpoints" / step / "train_state" / "_sharding"
        ).write_text("garbage")
    process = start_trainer(
        [command(case, tmp) for case, _ in CASES],
        JAX_NUM_CPU_DEVICES="1",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="online",
        WANDB_API_KEY="",
    )
    return tmp, trainer_results(process)[1]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(a) for a, _ in CASES])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(results, case):
    tmp, got = results
    code, stderr = got[case]
    assert code == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [CASES[case][1].replace("{tmp}", str(tmp))]


def test_the_real_command_line():
    r = subprocess.run(
        [sys.executable, "train.py", "base.yml", "stepz=5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**ENV, "JAX_NUM_CPU_DEVICES": "1"},
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and r.stderr == "error: unknown key 'stepz'; did you mean steps?\n", (
        r.stderr
    )


@pytest.mark.slow
def test_a_cpu_run_prints_nothing_on_stderr(tmp_path):
    """A successful run on this machine, libtpu installed by tests/requirements.txt and JAX_PLATFORMS not
    set: libtpu stays out of a host without TPU chips, and tfds (a files dataset built here), sentencepiece
    and orbax (a checkpoint written) say nothing on stderr. (A resume's stderr: test_checkpoint.py.)"""
    write_corpus(tmp_path / "corpus", 6, "doc", 0)
    env = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
    argv = [
        sys.executable,
        "train.py",
        "base.yml",
        *args(
            tmp_path,
            "eval_batches=1",
            "steps=2",
            f"dataset_path={tmp_path}/corpus/*.txt",
            preset=TEXT,
        ),
    ]
    r = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "JAX_NUM_CPU_DEVICES": "1"},
        check=False,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    assert "building the text dataset" in r.stdout and "step 2/2" in r.stdout, r.stdout


def test_a_platform_jax_cannot_start_is_one_line():
    r = subprocess.run(
        [sys.executable, "train.py", "base.yml", "steps=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**ENV, "JAX_PLATFORMS": "cuda"},
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and r.stderr.startswith(
        "error: JAX_PLATFORMS=cuda: JAX cannot start it on this host"
    ), r.stderr[-2000:]


@pytest.mark.parametrize("length, ok", [(32, True), (1024, True), (768, True), (700, False)])
def test_splash_attention_needs_lengths_its_blocks_divide(tmp_path, length, ok):
    """Checked before compiling, against the kernel's 128-token blocks (a length up to 512 is one block)."""
    cfg = train.load_config(BASE, args(tmp_path, "attention=splash", f"max_target_length={length}"))
    resolve = lambda: train.resolve(cfg, train.model_lib.TASKS["lm"], "tpu", "TPU v4")
    if ok:
        assert resolve().attention == "splash"
    else:
        with pytest.raises(
            train.ConfigError, match="max_target_length=700 is not a multiple of the kernel"
        ):
            resolve()


@pytest.mark.parametrize(
    "keys, what",
    [
        (
            ["d_model=8192", "num_layers=64", "num_heads=64", "num_kv_heads=64", "mlp_dim=32768"],
            "the train state",
        ),
        (
            ["per_device_batch=32768", "max_target_length=4096", "remat=none", "scan_layers=false"],
            "the step",
        ),
    ],
)
def test_a_run_past_the_hosts_memory_stops_before_it_allocates(
    tmp_path, capsys, monkeypatch, keys, what
):
    """On CPU the devices' memory is the host's: a 68B-parameter model's state, or a step whose compiled figures pass
    what the host has free, is one line naming it and what to lower (before: a silent hang after the parameter count,
    or a 40-line RESOURCE_EXHAUSTED traceback)."""
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *_: one)
    assert (
        train.main(["train.py", BASE, *args(tmp_path, *keys, "steps=1", "dataset=synthetic")]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(
        rf"error: {what} needs [\d.]+ GiB of host memory on CPU and [\d.]+ GiB "
        r"is free: (train a smaller model|lower per_device_batch, or remat=full)\n",
        err,
    ), err


# ---- hostile Hugging Face checkpoints: one line naming the file, before anything is allocated -------------------
def header_file(folder, header):
    """model.safetensors in `folder` whose header is `header` (bytes, or JSON), then 16 zero bytes of data."""
    folder.mkdir(exist_ok=True)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(16))
    return folder


@pytest.mark.parametrize(
    "header, says",
    [
        (b"[" * 100_000 + b"]" * 100_000, "not a safetensors file (its header nests too deep)"),
        ([1, 2], "not a safetensors file (its header is a JSON list)"),
        ({"a": 3}, "tensor a is described by no JSON object (damaged)"),
        (
            {"a": {"dtype": "F32", "shape": [-4], "data_offsets": [16, 0]}},
            "tensor a has no valid shape and data_offsets (damaged)",
        ),
        (  # a header that fits, its tensor claiming 40 GiB of a 16-byte file
            {"a": {"dtype": "F32", "shape": [10 * 2**30], "data_offsets": [0, 40 * 2**30]}},
            "tensor a runs past the file (damaged or cut short)",
        ),
    ],
    ids=["nested", "list", "entry", "negative", "40GiB"],
)
def test_a_hostile_safetensors_header_is_one_line_naming_the_file(tmp_path, header, says):
    """Before: a RecursionError, an AttributeError (a list, an entry not an object) as a traceback; the sizes
    were already checked against the file's before a read or an allocation."""
    folder = header_file(tmp_path / "hf", header)
    cfg = config(tmp_path)
    with pytest.raises(train.data.DataError) as e:
        train.model_lib.load_hf(cfg, str(folder), None)  # fails on the headers, before the params
    assert str(e.value) == (
        f"load_hf={folder}: the checkpoint is damaged ({folder}/model.safetensors: {says}); copy or "
        "download it again, or give load_hf= another checkpoint"
    )


def test_a_hostile_config_json_is_one_line_naming_it(tmp_path):
    """config.json nested past json's parser: the file named (a DataError); vocab_size=10^12: the bound the
    trainer itself checks (vocab_size is an int32 count), not an allocation."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    cfg = train.load_config(BASE, args(tmp_path, f"load_hf={folder}", preset=[]))
    with pytest.raises(train.data.DataError, match=rf"^{folder}/config.json: not valid JSON \(max"):
        train.pretrained(cfg)
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10**12,
    }
    (folder / "config.json").write_text(json.dumps(llama))
    with pytest.raises(train.ConfigError) as e:
        train.pretrained(cfg)
    assert str(e.value) == (
        f"load_hf={folder}: config.json gives vocab_size=1000000000000: must be <= {train.INT_MAX}"
        ": a model this trainer cannot hold, or a damaged file; give load_hf= another checkpoint"
    )


# ---- damaged files in a run directory, then the same command again: one line or a warning, nothing lost ------
@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny text run at its step-2 checkpoint, its tokenizer kept beside it; each test resumes a copy."""
    tmp = tmp_path_factory.mktemp("text-run")
    write_corpus(tmp / "corpus", 6, "doc", 0)
    train.run(config(tmp, "steps=2", *text_keys(tmp), preset=TEXT), jax.devices()[:1])
    return tmp


def text_keys(run):
    return [f"dataset_path={run}/corpus/*.txt", f"cache_dir={run}/cache"]


def resume_copy(text_run, tmp_path, monkeypatch, capsys, damage, *keys):
    """text_run's run directory copied under tmp_path, `damage`d ({file name: bytes}), then the same command run
    in this process on one device (steps=2: restored, nothing to train). Returns (exit code, stdout, stderr)."""
    shutil.copytree(text_run / "default", tmp_path / "default")
    for name, content in damage.items():
        (tmp_path / "default" / name).write_bytes(content)
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *_: one)
    capsys.readouterr()
    keys = args(tmp_path, "steps=2", *text_keys(text_run), *keys, preset=TEXT)
    code = train.main(["train.py", BASE, *keys])
    out, err = capsys.readouterr()
    return code, out, err


DAMAGED_CONFIG = {
    "cut": b"steps: 2\nlog_every: [1,\n",
    "binary": b"\x00\xff\xfejunk\x00",
    "list": b"- steps\n- 2\n",
}


@pytest.mark.parametrize("kind", DAMAGED_CONFIG)
def test_a_damaged_config_yml_is_kept_aside_and_the_run_goes_on(
    text_run, tmp_path, monkeypatch, capsys, kind
):
    """config.yml is the run's record of its config, not an input: a damaged one is renamed aside with a warning
    and written anew. Before: kept silently overwritten, and a resume that compared with it (a changed model or
    tokenizer) ended in a UnicodeDecodeError or RecursionError traceback."""
    run_dir = tmp_path / "default"
    damaged = DAMAGED_CONFIG[kind]
    shutil.copytree(text_run / "default", tmp_path / "copy")
    (tmp_path / "copy" / "config.yml").write_bytes(damaged)
    assert train.data.config_changes(str(tmp_path / "copy"), config(tmp_path, preset=TEXT)) == []
    code, out, err = resume_copy(text_run, tmp_path, monkeypatch, capsys, {"config.yml": damaged})
    assert code == 0 and err == "", err
    aside = [f for f in os.listdir(run_dir) if f.startswith("config.yml.damaged-")]
    assert len(aside) == 1 and (run_dir / aside[0]).read_bytes() == damaged
    warning = next(line for line in out.splitlines() if line.startswith("WARNING"))
    assert re.fullmatch(
        rf"WARNING: {run_dir}/config.yml: damaged \(.+\); kept it aside as {aside[0]}, and this run "
        "writes its config anew",
        warning,
    ), warning
    assert "steps" in yaml.safe_load((run_dir / "config.yml").read_text())


@pytest.mark.parametrize("kind", ["empty", "cut", "junk"])
def test_a_damaged_kept_tokenizer_is_named_not_blamed_on_a_change(
    text_run, tmp_path, monkeypatch, capsys, kind
):
    """Before: 'this run's tokenizer would change with the training text (its files changed ...)' and advice to set
    tokenizer_path= to the damaged file; nothing had changed."""
    model = (text_run / "default" / "tokenizer.model").read_bytes()
    damaged = {"empty": b"", "cut": model[:1000], "junk": b"junk\n"}[kind]
    code, _, err = resume_copy(
        text_run, tmp_path, monkeypatch, capsys, {"tokenizer.model": damaged}
    )
    path = tmp_path / "default" / "tokenizer.model"
    assert code == 2 and err == (
        f"error: {path}: damaged (not a sentencepiece tokenizer); the checkpoint's token ids are "
        "this file's tokenizer: restore it from a copy, or move it away to go on with the "
        "tokenizer this run has now (the same one unless the training text, tokenizer_path, "
        "vocab_size or load_hf changed)\n"
    )
    assert path.read_bytes() == damaged  # kept as it is


ROWS = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
GOOD = "".join(json.dumps(r) + "\n" for r in ROWS)


@pytest.mark.parametrize(
    "line",
    [
        b"garbage{{\n",
        b'{"loss": 1.0}\n',
        b"[1, 2]\n",
        b"\xff\xfe\x00\x01\n",
        b"[" * 5000 + b"]" * 5000 + b"\n",
        b'{"step": "3"}\n',
    ],
    ids=["junk", "no-step", "list", "not-utf8", "nested", "text-step"],
)
def test_metrics_jsonl_damaged_inside_is_kept_aside_and_the_run_goes_on(tmp_path, line):
    """A line not a row before the last one: the file is kept aside whole and a new one holds the rows it could
    read, up to the checkpoint (metrics are a log: a stop would fail every restart of a scheduler). Before: a
    JSONDecodeError, KeyError, TypeError or UnicodeDecodeError traceback on every resume."""
    path = tmp_path / "metrics.jsonl"
    damaged = (
        json.dumps(ROWS[0]).encode()
        + b"\n"
        + line
        + "".join(json.dumps(r) + "\n" for r in ROWS[1:]).encode()
    )
    path.write_bytes(damaged)
    said = []
    assert train.data.resume_metrics(str(tmp_path), 3, said.append) == 4
    aside = [f for f in os.listdir(tmp_path) if f.startswith("metrics.jsonl.damaged-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == damaged
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3]
    assert len(said) == 1 and said[0].startswith(f"WARNING: {path}: line 2 is not a metrics row (")
    assert said[0].endswith(
        f"kept the file aside as {aside[0]} and went on with its 4 readable rows"
    )


@pytest.mark.parametrize("tail", [b'{"step": 5, "lo', b"\x00" * 300, b"garbage\n"])
def test_metrics_jsonl_with_a_damaged_last_line_drops_it_with_a_warning(tmp_path, tail):
    """The last line only: a write cut short (a kill, a crash, a disk that zero-fills), dropped, nothing set aside."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(GOOD.encode() + tail)
    said = []
    assert train.data.resume_metrics(str(tmp_path), 4, said.append) == 4
    assert os.listdir(tmp_path) == ["metrics.jsonl"] and path.read_text() == GOOD
    assert len(said) == 1
    assert said[0].startswith(f"WARNING: {path}: dropped its last line, written only in part: ")


def test_a_resume_goes_on_past_a_damaged_metrics_jsonl(text_run, tmp_path, monkeypatch, capsys):
    """The same through the command line, one more step trained: no traceback, every step logged once."""
    rows = (text_run / "default" / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    damaged = rows[0] + b"\xff junk\n" + b"".join(rows[1:])
    code, out, err = resume_copy(
        text_run, tmp_path, monkeypatch, capsys, {"metrics.jsonl": damaged}, "steps=3"
    )
    assert code == 0 and err == "", err
    assert "line 2 is not a metrics row" in out
    assert [r["step"] for r in metrics(tmp_path / "default")] == [1, 2, 3]


# ---- runs sharing one cache_dir ------------------------------------------------------------------------------
# A run's data preparation in a process of its own, started with the others: ready, then waiting for the go file
# (argv: base.yml, its keys as JSON, the go file); prints the sha1 of the tokenizer it got.
COLD_CACHE = """
import hashlib, json, os, sys, time
import train
cfg = train.load_config(sys.argv[1], json.loads(sys.argv[2]))
open(f"{sys.argv[3]}.{os.getpid()}", "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
tokenizer = train.data.make_dataset(cfg).tokenizer
print(hashlib.sha1(tokenizer.files["tokenizer.model"]).hexdigest())
"""


@pytest.mark.slow
def test_runs_started_together_on_one_cold_cache_prepare_it_once(tmp_path):
    """Runs at the same moment on one cold cache_dir (two here; three through the command line cost a minute): each
    gets the same tokenizer, and the cache ends with one prepared dataset and one tokenizer, no temporary file (a
    lock serialises the preparation; every cache file is written whole, then renamed into place)."""
    write_corpus(tmp_path / "corpus", 6, "doc", 0)
    keys = args(tmp_path, f"dataset_path={tmp_path}/corpus/*.txt", preset=TEXT)
    go = tmp_path / "go"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", COLD_CACHE, BASE, json.dumps(keys), str(go)],
            cwd=ROOT,
            env={**ENV, "JAX_NUM_CPU_DEVICES": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.time() + 120
    while len(glob.glob(f"{go}.*")) < 2 and time.time() < deadline:
        time.sleep(0.05)
    go.touch()
    done = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in done]
    assert len({out for out, _ in done}) == 1
    cache = tmp_path / "cache"
    assert len(glob.glob(f"{cache}/tokenizer_*.model")) == 1
    assert len(glob.glob(f"{cache}/text_files/files_*/1.0.0")) == 1
    assert not [f for f in glob.glob(f"{cache}/**", recursive=True) if ".tmp" in f]


def test_a_damaged_cached_tokenizer_is_kept_aside_and_trained_again(tmp_path, capsys):
    """Before: 'tokenizer_path=CACHE/tokenizer_....model: not a sentencepiece model ...; give a .model file or a
    tokenizer.json, or '' to train one', naming a key nobody set, on every run sharing the cache."""
    write_corpus(tmp_path / "corpus", 6, "doc", 0)
    cfg = config(tmp_path, f"dataset_path={tmp_path}/corpus/*.txt", preset=TEXT)
    train.data.make_dataset(cfg)
    (found,) = glob.glob(f"{tmp_path}/cache/tokenizer_*.model")
    path = pathlib.Path(found)
    model = path.read_bytes()
    path.write_bytes(b"junk\n")
    capsys.readouterr()
    train.data.make_dataset(cfg, log=print)
    (aside,) = glob.glob(f"{path}.damaged-*")
    assert (
        f"WARNING: {path}: damaged (not a sentencepiece tokenizer); kept aside as {aside}, trained "
        "again\ntraining a 320-piece BPE tokenizer"
    ) in capsys.readouterr().out
    assert pathlib.Path(aside).read_bytes() == b"junk\n" and path.read_bytes() == model
