"""LoRA: low-rank adapters on the projections, the base frozen; checkpoints of the adapters alone; peft's adapter format
out and in. Tiny Hugging Face checkpoints written as test_hf.py writes them, no torch (tests/check_hf.py holds the
comparison with peft itself)."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import BASE, ENV, ROOT, args, metrics, read_checkpoint, train_state
from conftest import config as lm_config
from flax import nnx
from test_hf import (
    PRESET,
    TINY,
    forward,
    qa_rows,
    write_checkpoint,
    write_rows,
    write_tokenizer,
)

import model as model_lib
import train

LM = model_lib.LM


def config(tmp_path, *keys):
    return lm_config(tmp_path, *TINY, "dataset=synthetic", *keys, preset=PRESET)


def built(tmp_path, folder, *keys, devices=1):
    """(cfg, mesh, tx, train state) as a run from load_hf=folder makes them (load_adapter too)."""
    cfg = config(tmp_path, f"load_hf={folder}", *keys)
    cfg = train.resolve(train.pretrained(cfg), LM, "cpu")
    mesh = train.make_mesh(cfg, jax.devices()[:devices])
    tx = train.make_optimizer(cfg)[0]
    layout = train.state_layout(cfg, LM, mesh, tx, 4)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
        state = train.init_state(cfg, layout, model_lib.load_pretrained(cfg, layout.abstract))
    return cfg, mesh, tx, state


def batch(cfg, accum=1, rows=4, seed=0):
    """A step's batch [accum, rows, L] of random tokens, loss masks ragged (token weighting counts)."""
    rng = np.random.default_rng(seed)
    L = cfg.max_target_length
    ids = rng.integers(0, cfg.vocab_size, (accum * rows, L + 1)).astype(np.int32)
    mask = (np.arange(L)[None] < rng.integers(1, L + 1, (accum * rows, 1))).astype(np.float32)
    b = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "positions": np.tile(np.arange(L, dtype=np.int32), (accum * rows, 1)),
        "segment_ids": np.ones((accum * rows, L), np.int32),
        "loss_mask": mask,
    }
    return {k: v.reshape(accum, rows, L) for k, v in b.items()}


def stepped(cfg, mesh, tx, state, b, n=3):
    """n train steps on batch b: (the state, the losses)."""
    step = jax.jit(train.make_train_step(cfg, LM, model_lib.abstract(cfg)[0], tx))
    losses = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
        for _ in range(n):
            state, out = step(state, b)
            losses.append(float(out["loss"]))
    return state, losses


def host(tree):
    return jax.tree.map(np.asarray, tree)


def kicked(state, scale=0.05, seed=1):
    """The state with its adapters' B made nonzero (at init B is zero: every adapter a no-op)."""
    rng = np.random.default_rng(seed)
    move = lambda path, x: (
        np.asarray(x) + scale * rng.standard_normal(x.shape).astype(np.float32)
        if path[-1].key.endswith("_lora_b")
        else x
    )
    return {**state, "params": jax.tree_util.tree_map_with_path(move, state["params"])}


def test_lora_off_keys_change_nothing_in_the_program(tmp_path):
    """lora.rank=0 (the default): the train state is step, params, opt_state as before, and the step's program is
    the same whatever the other lora keys say."""
    programs = []
    for keys in ([], ["lora.alpha=3", "lora.targets=q", "lora.dropout=0.5"]):
        cfg = lm_config(tmp_path, *keys)
        mesh, _, state, tx = train_state(cfg, jax.devices()[:1])
        assert sorted(state) == ["opt_state", "params", "step"]
        with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
            step = jax.jit(train.make_train_step(cfg, LM, model_lib.abstract(cfg)[0], tx))
            programs.append(step.lower(state, batch(cfg)).as_text())
    assert programs[0] == programs[1]


@pytest.mark.parametrize("scan", ["true", "false"])
@pytest.mark.slow
def test_adapters_start_as_the_base_and_learn_alone(tmp_path, qwen, scan):
    """With lora.rank=4 on every projection: step 0's logits are the base model's exactly (B starts at zero); the
    adapters are float32 with the weight's logical axes and the rank's, A drawn U(+-1/sqrt(inputs)) as peft draws
    it; AdamW's state holds moments for the adapters alone; after three steps the base's weights are bit-identical
    and the adapters moved."""
    cfg, mesh, tx, state = built(tmp_path, qwen, "lora.rank=4", f"scan_layers={scan}")
    base_cfg, _, _, base_state = built(tmp_path, qwen, f"scan_layers={scan}")
    ids = np.random.default_rng(2).integers(0, 320, (2, 24)).astype(np.int32)
    whole = train.weights(state, LM)
    np.testing.assert_array_equal(
        forward(cfg, whole, ids), forward(base_cfg, base_state["params"], ids)
    )
    adapters = jax.tree_util.tree_leaves_with_path(state["params"])
    assert len(adapters) == 2 * 7 * (1 if scan == "true" else cfg.num_layers)
    assert all(x.dtype == np.float32 for _, x in adapters)
    a = next(x for p, x in adapters if p[-1].key == "wq_lora_a")
    assert a.shape[-2:] == (64, 4) and 0 < np.abs(a).max() <= 64**-0.5
    axes = train.state_layout(cfg, LM, mesh, tx, 4).logical["params"]
    spec = (
        axes["trunk"]["layers"]["attn"]["wo_lora_a"]
        if scan == "true"
        else axes["trunk"]["layers"][0]["attn"]["wo_lora_a"]
    )
    assert tuple(spec)[-3:] == ("heads", "head_dim", "lora_rank")
    moments = jax.tree.leaves(state["opt_state"])
    assert sum(x.size for x in moments if x.ndim) == 2 * sum(x.size for _, x in adapters)
    before = host(state["base"])
    state, losses = stepped(cfg, mesh, tx, state, batch(cfg), n=3)
    jax.tree.map(np.testing.assert_array_equal, before, host(state["base"]))
    assert losses[2] < losses[0]


def test_adapter_gradients_equal_those_of_a_dense_delta(tmp_path, qwen):
    """The step's gradients for A and B equal the gradients of the same loss computed another way: no adapters, each
    weight replaced by the dense W + (alpha / rank) A B (differentiated through that sum)."""
    cfg, mesh, _, state = built(tmp_path, qwen, "lora.rank=4", "lora.alpha=8", "grad_clip=0")
    state = kicked(state)
    b = {k: v[0] for k, v in batch(cfg).items()}
    graph = model_lib.abstract(cfg)[0]
    dense_cfg = config(tmp_path, f"load_hf={qwen}")
    dense_cfg = train.resolve(train.pretrained(dense_cfg), LM, "cpu")
    dense_graph = model_lib.abstract(dense_cfg)[0]

    def ours(adapters):
        loss, sums = model_lib.lm_loss(cfg, graph, model_lib.joined(state["base"], adapters), b)
        return loss / sums["weight"]

    def dense(adapters):
        params = model_lib.joined(state["base"], adapters)
        folded = model_lib.fold_adapters(cfg, params)  # W + scale A B, differentiable
        loss, sums = model_lib.lm_loss(dense_cfg, dense_graph, folded, b)
        return loss / sums["weight"]

    with jax.set_mesh(mesh):
        g_ours = jax.jit(jax.grad(ours))(state["params"])
        g_dense = jax.jit(jax.grad(dense))(state["params"])
    assert float(np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_ours)])).max()) > 0
    top = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_dense))
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5 * top)
    jax.tree.map(close, g_ours, g_dense)


def sft_keys(tmp_path, qwen, *keys):
    files = write_rows(tmp_path / "qa.jsonl", qa_rows(64))
    return args(
        tmp_path,
        f"load_hf={qwen}",
        "dataset=hf",
        "hf_path=json",
        f"hf_data_files={files}",
        *TINY,
        "per_device_batch=2",
        "learning_rate=1e-2",
        "lora.rank=4",
        *keys,
        preset=PRESET,
    )


@pytest.mark.slow
def test_a_checkpoint_holds_the_adapters_alone_and_names_its_base(tmp_path, qwen):
    """A LoRA run's checkpoint holds the adapters, their optimizer state and the base's fingerprint, not the base;
    a resume loads the base again and goes on; a resume on another base (the same shapes, other weights) is one line
    naming load_hf; an export writes peft's adapter directory, which load_adapter reads back to the same adapters."""
    run = lambda *keys: train.run(
        train.load_config(BASE, sft_keys(tmp_path, qwen, *keys)), jax.devices()[:2]
    )
    run("steps=2", "checkpoint_every=1")
    saved = read_checkpoint(tmp_path / "default", 2)["train_state"]
    assert sorted(saved) == ["base_id", "opt_state", "params", "step"]
    names = {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved["params"])
    }
    assert names and all(n.endswith(("_lora_a']", "_lora_b']")) for n in names), names
    assert run("steps=3")["step"] == 3  # resumed from step 2 on the base loaded again
    other = tmp_path / "other"
    write_checkpoint(other, "qwen2", vocab_size=320, seed=7)
    write_tokenizer(other)
    with pytest.raises(
        train.data.DataError,
        match=r"^load_hf=.*other: this run's adapters were trained on another base",
    ):
        train.run(train.load_config(BASE, sft_keys(tmp_path, other, "steps=4")), jax.devices()[:2])
    run("mode=export", f"export_dir={tmp_path}/adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["lora_dropout"]) == (
        "LORA",
        4,
        16.0,
        0.0,
    )
    assert conf["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert conf["base_model_name_or_path"] == str(qwen)
    tensors = safetensors.numpy.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # A and B, seven projections, two layers
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (
        4,
        64,
    )  # [r, in]
    assert tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"].shape == (
        64,
        4,
    )  # [out, r]
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 96)
    trained = read_checkpoint(tmp_path / "default", 3)["train_state"]["params"]
    _, _, _, back = built(tmp_path, qwen, f"load_adapter={tmp_path}/adapter", devices=2)
    jax.tree.map(np.testing.assert_array_equal, host(trained), host(back["params"]))


def test_a_peft_adapter_someone_else_wrote_is_read_or_refused_in_one_line(tmp_path, qwen):
    """load_adapter on an adapter_config.json as peft writes it: its r, lora_alpha, target_modules and dropout set
    the lora keys; the logits are the base's plus (alpha / r) x A^T B^T's, computed here in numpy; DoRA, rsLoRA, a
    module this model has not and a key set against the adapter are each one line."""
    cfg, _, _, state = built(tmp_path, qwen)
    ref = host(state["params"])
    rng = np.random.default_rng(3)
    tensors, folder = {}, tmp_path / "made"
    folder.mkdir()
    for i in range(2):
        for module, d_in, d_out in (("self_attn.q_proj", 64, 64), ("self_attn.v_proj", 64, 32)):
            name = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.1, (2, d_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.1, (d_out, 2)).astype(np.float32)
    safetensors.numpy.save_file(tensors, folder / "adapter_model.safetensors")
    conf = {
        "peft_type": "LORA",
        "r": 2,
        "lora_alpha": 6,
        "target_modules": ["v_proj", "q_proj"],
        "lora_dropout": 0.1,
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    cfg, _, _, state = built(tmp_path, qwen, f"load_adapter={folder}")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, cfg.lora.dropout) == (
        2,
        6.0,
        ("q", "v"),
        0.1,
    )
    ids = np.random.default_rng(4).integers(0, 320, (2, 24)).astype(np.int32)
    dense = jax.tree.map(np.array, ref)
    for i in range(2):
        layer = dense["trunk"]["layers"]["attn"]
        for ours, module, shape in (
            ("wq", "self_attn.q_proj", (64, 4, 16)),
            ("wv", "self_attn.v_proj", (64, 2, 16)),
        ):
            name = f"base_model.model.model.layers.{i}.{module}"
            delta = tensors[f"{name}.lora_A.weight"].T @ tensors[f"{name}.lora_B.weight"].T
            layer[ours][i] = layer[ours][i] + 3.0 * delta.reshape(shape)
    base_cfg = train.resolve(train.pretrained(config(tmp_path, f"load_hf={qwen}")), LM, "cpu")
    np.testing.assert_allclose(
        forward(cfg, train.weights(state, LM), ids),
        forward(base_cfg, dense, ids),
        rtol=1e-4,
        atol=1e-4,
    )
    for key, value, says in (
        ("use_dora", True, r"use_dora=True is not supported here"),
        ("use_rslora", True, r"use_rslora=True is not supported here"),
        (
            "target_modules",
            ["q_proj", "embed_tokens"],
            r"target_modules has 'embed_tokens'; the projections here are",
        ),
    ):
        (folder / "adapter_config.json").write_text(json.dumps({**conf, key: value}))
        with pytest.raises(train.ConfigError, match=r"^load_adapter=.*" + says):
            train.pretrained(config(tmp_path, f"load_hf={qwen}", f"load_adapter={folder}"))
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(
        train.ConfigError, match=r"makes lora.rank=2 but lora.rank=8 is set; drop lora.rank="
    ):
        train.pretrained(
            config(tmp_path, f"load_hf={qwen}", f"load_adapter={folder}", "lora.rank=8")
        )


def test_a_merged_export_is_the_adapted_model_in_its_own_format(tmp_path, qwen):
    """lora.merge=true: mode=export writes the base with (alpha / r) A B folded into each weight, as its family's
    checkpoint; load_hf of it gives the adapted model's logits."""
    cfg, _, _, state = built(tmp_path, qwen, "lora.rank=4", "lora.merge=true")
    whole = train.weights(kicked(state), LM)
    model_lib.save_hf(cfg, host(whole), str(tmp_path / "merged"))
    assert not any(
        "lora" in name
        for name in safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")
    )
    merged_cfg, _, _, merged = built(tmp_path, tmp_path / "merged")
    ids = np.random.default_rng(5).integers(0, 320, (2, 24)).astype(np.int32)
    np.testing.assert_allclose(
        forward(merged_cfg, merged["params"], ids), forward(cfg, whole, ids), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_lora_keeps_accumulation_meshes_remat_and_dropout_honest(tmp_path, qwen):
    """With LoRA on: grad_accum=2 x 2 rows equals 1 x 4 rows; 8 devices (data, fsdp, tensor 2 each) equal 1;
    remat=full equals remat=none; lora.dropout changes training, never eval."""
    b = batch(built(tmp_path, qwen)[0], rows=4)
    runs = {}
    for name, keys, devices, bb in (
        ("one", [], 1, b),
        ("accum", ["grad_accum=2"], 1, {k: v.reshape(2, 2, -1) for k, v in b.items()}),
        ("mesh", ["mesh=2,2,2"], 8, b),
        ("remat", ["remat=full"], 1, b),
    ):
        cfg, mesh, tx, state = built(tmp_path, qwen, "lora.rank=4", *keys, devices=devices)
        runs[name] = stepped(cfg, mesh, tx, state, bb)
    # The gradients (Adam's moments) are compared to each tensor's largest, to 1e-3 of it: a sharding or accumulation
    # fault moves a gradient by its own size (a missed sum halves it, a wrong weight scales it), rounding by far less.
    # The lora_a gradients are the small ends of cancelling sums (B starts at 0): on 8 devices w_up_lora_a's first
    # moment moved by 2.7e-5 of its largest on an AVX2 EPYC, 1e-5 on an avx512_bf16 Xeon (the rest <2e-6). Adam
    # divides each gradient by its own size, so such an element's update can move by ~1% (seen: 4.1408e-4 against
    # 4.1553e-4 after three steps); params get atol 1e-5, a 15th of one step's move here (~1.5e-4 in the warmup).
    for name in ("accum", "mesh", "remat"):
        np.testing.assert_allclose(runs[name][1], runs["one"][1], rtol=1e-5, err_msg=name)
        jax.tree.map(
            lambda x, y, name=name: np.testing.assert_allclose(
                x, y, rtol=0, atol=1e-3 * np.abs(y).max(), err_msg=name
            ),
            host(runs[name][0]["opt_state"]),
            host(runs["one"][0]["opt_state"]),
        )
        jax.tree.map(
            lambda x, y, name=name: np.testing.assert_allclose(
                x, y, rtol=1e-4, atol=1e-5, err_msg=name
            ),
            host(runs[name][0]["params"]),
            host(runs["one"][0]["params"]),
        )
    cfg, mesh, tx, state = built(
        tmp_path, qwen, "lora.rank=4", "lora.dropout=0.5", "learning_rate=1e-2", "warmup_steps=0"
    )
    dropped = stepped(cfg, mesh, tx, kicked(state), b, n=2)[1]
    kept = stepped(
        *built(tmp_path, qwen, "lora.rank=4", "learning_rate=1e-2", "warmup_steps=0")[:3],
        kicked(state),
        b,
        n=2,
    )[1]
    assert dropped[0] != kept[0]
    graph = model_lib.abstract(cfg)[0]
    evals = [
        float(
            model_lib.lm_eval_step(
                c, graph, train.weights(kicked(state), LM), {k: v[0] for k, v in b.items()}
            )["loss"]
        )
        for c in (
            cfg,
            cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"dropout": 0.0})}),
        )
    ]
    assert evals[0] == evals[1]


@pytest.mark.slow
def test_a_lora_run_killed_resumes_exactly(tmp_path, qwen):
    """kill -9 after the step-4 checkpoint of a LoRA SFT run with adapter dropout, then the same command: every
    step's loss equals an uninterrupted run's. Each process has its own string hash salt (PYTHONHASHSEED), as any
    resumed run or other host does: the dropout's draws must not depend on it (they once did, through hash(name))."""
    keys = ["steps=12", "checkpoint_every=4", "log_every=1", "lora.dropout=0.3"]
    salted = lambda salt: {**ENV, "PYTHONHASHSEED": str(salt)}
    cmd = lambda out: [
        sys.executable,
        "train.py",
        "base.yml",
        *sft_keys(tmp_path, qwen, *keys, f"output_dir={out}"),
    ]
    finish = lambda out, salt: subprocess.run(
        cmd(out),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=salted(salt),
        check=False,
        timeout=600,
    )
    ref = finish(tmp_path / "ref", 1)
    assert ref.returncode == 0, ref.stderr
    p = subprocess.Popen(
        cmd(tmp_path / "cut"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=salted(2),
    )
    metrics = tmp_path / "cut" / "default" / "metrics.jsonl"
    while p.poll() is None and not (
        (tmp_path / "cut" / "default" / "checkpoints" / "4").is_dir()
        and metrics.exists()
        and len(metrics.read_text().splitlines()) >= 6
    ):
        time.sleep(0.005)
    p.kill()
    p.communicate()
    again = finish(tmp_path / "cut", 3)
    assert again.returncode == 0 and "resuming from checkpoint" in again.stdout, again.stderr
    losses = lambda out: [
        json.loads(line)["loss"]
        for line in (out / "default" / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")
    assert os.path.getsize(tmp_path / "ref" / "default" / "metrics.jsonl") > 0


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantization_round_trips_within_its_bound(kind):
    """Blockwise absmax quantization (lora.base_quant): every value comes back within half a step of its block's
    grid: absmax / 127 / 2 for int8, absmax x half the widest gap between NF4 levels for nf4 (two codes a byte);
    a block of zeros stays zero."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 128)).astype(np.float32)
    w[0, 0, :64] = 0.0
    q = model_lib.quantize(w, kind, 64)
    assert q.codes.shape == ((3, 64, 64) if kind == "nf4" else (3, 64, 128)) and q.scales.shape == (
        3,
        64,
        2,
    )
    back = np.asarray(q[...])
    absmax = np.repeat(np.abs(w).reshape(3, 64, 2, 64).max(-1), 64, axis=-1)
    step = 1 / 127 / 2 if kind == "int8" else np.max(np.diff(model_lib.NF4)) / 2
    assert np.all(np.abs(back - w) <= absmax * step + 1e-6)
    assert np.all(back[0, 0, :64] == 0) and back.dtype == np.float32
    assert np.abs(back - w).mean() / np.abs(w).mean() < (0.01 if kind == "int8" else 0.12)


@pytest.mark.slow
def test_a_quantized_base_trains_its_adapters_and_stays_as_it_was(tmp_path, qwen):
    """QLoRA (nf4, blocks of 16): the base's seven projections are stored as codes and scales, the embeddings and
    norms as they are; the first logits are the dequantized base's; three steps lower the loss and leave every code
    as it was."""
    cfg, mesh, tx, state = built(
        tmp_path, qwen, "lora.rank=4", "lora.base_quant=nf4", "lora.block=16"
    )
    layer = state["base"]["trunk"]["layers"]
    assert (
        isinstance(layer["attn"]["wq"], model_lib.Quantized)
        and layer["attn"]["wq"].codes.dtype == np.uint8
    )
    assert not isinstance(state["base"]["embed"], model_lib.Quantized)
    quant = lambda x: isinstance(x, model_lib.Quantized)
    dense = jax.tree.map(
        lambda x: model_lib.dequantize(x) if quant(x) else x, state["base"], is_leaf=quant
    )
    plain_cfg, _, _, plain = built(tmp_path, qwen)  # the base as load_hf gives it, unquantized
    ids = np.random.default_rng(5).integers(0, 320, (2, 24)).astype(np.int32)
    first = forward(cfg, train.weights(state, LM), ids)
    np.testing.assert_allclose(first, forward(plain_cfg, dense, ids), rtol=1e-5, atol=1e-5)
    assert np.abs(first - forward(plain_cfg, plain["params"], ids)).max() > 1e-3  # nf4 is not exact
    codes = host(
        [
            x.codes
            for x in jax.tree.leaves(
                state["base"], is_leaf=lambda x: isinstance(x, model_lib.Quantized)
            )
            if isinstance(x, model_lib.Quantized)
        ]
    )
    state, losses = stepped(cfg, mesh, tx, state, batch(cfg))
    assert losses[2] < losses[0]
    after = [
        x.codes
        for x in jax.tree.leaves(
            state["base"], is_leaf=lambda x: isinstance(x, model_lib.Quantized)
        )
        if isinstance(x, model_lib.Quantized)
    ]
    jax.tree.map(np.testing.assert_array_equal, codes, host(after))
    with pytest.raises(
        train.ConfigError,
        match=r"lora.block=64: must divide the last axis of every quantized weight",
    ):
        train.check(config(tmp_path, "lora.rank=4", "lora.base_quant=nf4"), LM)


@pytest.mark.slow
def test_a_lora_run_resumes_on_another_device_count(tmp_path, qwen):
    """Elastic resume with LoRA: 4 steps on one device (2 rows each), then resumed to 8 on two devices of 1 row
    each (the same global batch): the losses are an uninterrupted one-device run's to float rounding, and the
    adapters were restored, not drawn again (step 5 goes on from step 4's)."""
    keys = sft_keys(tmp_path, qwen, "checkpoint_every=4", "log_every=1")
    keys = [k for k in keys if not k.startswith(("per_device_batch=", "steps="))]
    run = lambda name, steps, n: train.run(
        train.load_config(
            BASE, [*keys, f"run_name={name}", f"steps={steps}", f"per_device_batch={2 // n}"]
        ),
        jax.devices()[:n],
    )
    ref = run("ref", 8, 1)
    run("cut", 4, 1)
    again = run("cut", 8, 2)
    assert len(metrics(again["run_dir"])) == 8
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(again["run_dir"])],
        [r["loss"] for r in metrics(ref["run_dir"])],
        rtol=1e-5,
    )
