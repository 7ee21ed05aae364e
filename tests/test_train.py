"""Core trainer: config strictness, mesh/sharding, the accumulate/clip/update step, the model's math,
and what a run writes (config, metrics, TensorBoard events)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    BASE,
    DIFFERS,
    ENV,
    HF,
    LM,
    ROOT,
    SUDOKU,
    TEXT,
    args,
    config,
    init_model,
    losses,
    metrics,
    read_checkpoint,
    sudoku_batch,
    train_state,
    train_step,
)
from flax import nnx

import model as model_lib
import train


# ---- the step's math ------------------------------------------------------------------------------
@pytest.mark.slow
def test_mesh_invariance(tmp_path):
    """The same global batch on 1 device and on 8 (data, fsdp and tensor axes all 2) gives the same losses
    (float32, 1e-5 relative). mesh=4,4,2 is checked for its sharding in test_big_parameters_are_sharded."""
    runs = {}
    for mesh, pdb, n in [("1,1,1", 32, 1), ("2,2,2", 4, 8)]:
        cfg = config(
            tmp_path,
            f"mesh={mesh}",
            f"per_device_batch={pdb}",
            "steps=3",
            f"run_name=mesh{n}",
            "scan_layers=true",
        )  # the default, pods' layout
        runs[mesh] = losses(train.run(cfg, jax.devices()[:n])["run_dir"])
    ref = np.array(runs["1,1,1"])
    assert len(ref) == 3 and len(set(ref)) == 3  # three distinct steps, not one repeated
    for mesh, got in runs.items():
        np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=mesh)


def _state_and_step(cfg, n_devices=1):
    mesh, _, state, tx = train_state(cfg, jax.devices()[:n_devices])
    return mesh, state, train_step(cfg, mesh, tx)


def _batch(cfg, rows, seed=0):
    """Random tokens with ragged loss masks, so token weighting matters."""
    rng = np.random.default_rng(seed)
    L = cfg.max_target_length
    mask = (np.arange(L)[None] < rng.integers(1, L + 1, (rows, 1))).astype(np.float32)
    return {
        "inputs": rng.integers(0, cfg.vocab_size, (rows, L)).astype(np.int32),
        "targets": rng.integers(0, cfg.vocab_size, (rows, L)).astype(np.int32),
        "segment_ids": np.ones((rows, L), np.int32),
        "positions": np.tile(np.arange(L, dtype=np.int32), (rows, 1)),
        "loss_mask": mask,
    }


def test_grad_accumulation_is_exact(tmp_path):
    """grad_accum=4 x 2 rows == grad_accum=1 x 8 rows, with ragged masks (token-weighted, not mean of means)."""
    b = _batch(config(tmp_path), 8)
    results = []
    for accum in (1, 4):
        cfg = config(tmp_path, f"grad_accum={accum}")
        mesh, state, step = _state_and_step(cfg)
        with jax.set_mesh(mesh):
            for _ in range(3):
                state, out = step(
                    state, {k: v.reshape(accum, -1, *v.shape[1:]) for k, v in b.items()}
                )
        results.append((state["params"], out))
    (p1, o1), (p4, o4) = results
    np.testing.assert_allclose(o1["loss"], o4["loss"], rtol=1e-5)
    np.testing.assert_allclose(o1["grad_norm"], o4["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)


@pytest.mark.slow
def test_a_batch_ramp_equals_the_run_done_in_pieces_by_hand(tmp_path, capsys, caplog):
    """batch_ramp=3:2: steps 1-3 sum one microbatch of 4 rows, steps 4-6 two. Every loss, gradient norm,
    learning rate and parameter equals, bit for bit, a run of grad_accum=1 to step 3 resumed with
    grad_accum=2 to step 6; the learning rate is the ramp-free schedule's (min_lr_ratio=1 keeps the cosine's
    end, which moves with steps=, out of the pieces' comparison); the step compiles once per count, ahead."""
    keys = ["per_device_batch=2", "min_lr_ratio=1", "checkpoint_every=0"]
    devices = jax.devices()[:2]
    with jax.log_compiles(True):
        train.run(config(tmp_path, *keys, "steps=6", "batch_ramp=3:2", "run_name=ramp"), devices)
    compiled = [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
    assert "batch ramp: from step 4, 2 microbatches per update" in capsys.readouterr().out
    train.run(config(tmp_path, *keys, "steps=3", "run_name=hand"), devices)
    train.run(config(tmp_path, *keys, "steps=6", "grad_accum=2", "run_name=hand"), devices)
    ramped, by_hand = metrics(tmp_path / "ramp"), metrics(tmp_path / "hand")
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_step"):
        assert [r[key] for r in ramped] == [r[key] for r in by_hand], key
    tokens = [r["tokens_per_step"] for r in ramped]
    assert tokens[3:] == [2 * t for t in tokens[:3]]  # synthetic rows: every token counts
    assert len(compiled) == 2, [r.getMessage()[:80] for r in compiled]
    ramp, hand = read_checkpoint(tmp_path / "ramp", 6), read_checkpoint(tmp_path / "hand", 6)
    same = jax.tree.map(np.array_equal, ramp["train_state"], hand["train_state"])
    assert all(jax.tree.leaves(same))
    assert train.load_config(BASE, ["batch_ramp=[[2000, 2], [4000, 4]]"]).batch_ramp == (
        (2000, 2),
        (4000, 4),
    )
    with pytest.raises(train.ConfigError, match="batch_ramp.*rising order"):
        train.load_config(BASE, ["batch_ramp=4000:4,2000:2"])


@pytest.mark.slow
def test_clipping_clips(tmp_path):
    """The gradient reaching AdamW has norm grad_clip; grad_norm reports the norm before clipping."""
    for clip in (1e-3, 0.0):
        cfg = config(tmp_path, f"grad_clip={clip}")
        mesh, state, step = _state_and_step(cfg)
        with jax.set_mesh(mesh):
            state, out = step(state, {k: v[None] for k, v in _batch(cfg, 4).items()})
        mu = state["opt_state"][0].mu  # after one step mu = (1 - b1) * (gradient given to AdamW)
        seen = float(optax.tree.norm(mu)) / (1 - cfg.adam_b1)
        assert float(out["grad_norm"]) > 0.1
        if clip:
            np.testing.assert_allclose(seen, clip, rtol=1e-4)
        else:
            np.testing.assert_allclose(seen, float(out["grad_norm"]), rtol=1e-4)


@pytest.mark.slow
def test_remat_saves_memory_without_changing_the_math(tmp_path):
    """remat=full keeps only each layer's input for the backward pass, save_dots (the default) also the
    projections' outputs: the compiled step needs less temporary memory than remat=none, full least of all,
    and full with the MLP in 4 slices of the sequence (mlp_chunks, the default) less than in one, while the
    loss and the gradients stay the same (float32)."""
    b = {k: v[None] for k, v in _batch(config(tmp_path, "max_target_length=64"), 8).items()}
    temp, outs, grads = {}, {}, {}
    for remat in ("none", "full", "full mlp_chunks=1", "save_dots"):
        cfg = config(
            tmp_path, *f"remat={remat}".split(), "scan_layers=true", "max_target_length=64"
        )
        mesh, state, step = _state_and_step(cfg)
        model = model_lib.abstract(cfg)[0]
        loss = lambda p, cfg=cfg, model=model: model_lib.lm_loss(
            cfg, model, p, {k: v[0] for k, v in b.items()}
        )[0]
        with jax.set_mesh(mesh):
            grads[remat] = jax.jit(jax.grad(loss))(state["params"])
            compiled = step.lower(state, b).compile()
            temp[remat] = compiled.memory_analysis().temp_size_in_bytes
            outs[remat] = compiled(state, b)[1]
    assert temp["full"] < temp["full mlp_chunks=1"] < temp["save_dots"] < temp["none"], temp
    for remat in ("full", "full mlp_chunks=1", "save_dots"):
        np.testing.assert_allclose(
            outs[remat]["loss"], outs["none"]["loss"], rtol=1e-6, err_msg=remat
        )
        np.testing.assert_allclose(
            outs[remat]["grad_norm"], outs["none"]["grad_norm"], rtol=1e-5, err_msg=remat
        )
        jax.tree.map(
            lambda a, b, remat=remat: np.testing.assert_allclose(
                a, b, rtol=1e-4, atol=1e-5, err_msg=remat
            ),
            grads[remat],
            grads["none"],
        )


@pytest.mark.parametrize("scan", ["true", "false"])
def test_weight_decay_reaches_matrices_never_norms_or_biases(tmp_path, scan):
    """AdamW with zero gradients is pure decoupled decay: every weight matrix and embedding moves by -lr x
    weight_decay x itself, and no norm scale or bias moves at all, as transformers' Trainer (so trl) decays:
    by what a parameter is, under the default scan_layers=true (every norm scale a [layers, D] matrix there,
    every q/k/v bias at least 2-D) as without it."""
    cfg = config(
        tmp_path,
        "weight_decay=0.1",
        "warmup_steps=1",
        "qkv_bias=true",
        "qk_norm=true",
        f"scan_layers={scan}",
    )
    tx, schedule = train.make_optimizer(cfg)
    params = init_model(cfg)[1]
    zeros, update = jax.tree.map(jnp.zeros_like, params), jax.jit(tx.update)
    opt = update(zeros, tx.init(params), params)[1]  # warmup's first update, at learning rate 0
    updates = update(zeros, opt, params)[0]  # the second, at the peak learning rate
    kept = set()
    for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)):
        name = path[-1].key
        still = name == "scale" or name in ("bq", "bk", "bv")
        want = np.zeros_like(p) if still else -schedule(1) * 0.1 * np.asarray(p)
        np.testing.assert_allclose(u, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
        kept |= {(name, p.ndim)} if still else set()
    stacked = int(scan == "true")  # the layers axis
    assert kept == {
        ("scale", 1),
        ("scale", 1 + stacked),
        *{(b, 2 + stacked) for b in ("bq", "bk", "bv")},
    }


def test_the_presets_set_only_what_conftest_explains():
    """Every key the suite's presets set is in conftest.DIFFERS with why it cannot hide a bug; every other key is
    base.yml's default (the presets once set scan_layers=false, and a weight-decay bug of the default hid there)."""
    explained = {key for keys in DIFFERS for key in keys.split()}
    for preset in (LM, TEXT, HF, SUDOKU):
        assert {o.split("=")[0] for o in preset} <= explained, preset


@pytest.fixture(scope="module")
def learning_rates(tmp_path_factory):
    """(config, the learning_rate column of its run's metrics.jsonl, a row per step): 12 steps, 4 of warmup."""
    cfg = config(
        tmp_path_factory.mktemp("lr"),
        "learning_rate=1e-3",
        "warmup_steps=4",
        "steps=12",
        "min_lr_ratio=0.1",
    )
    rows = metrics(train.run(cfg, jax.devices()[:1])["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, 13))
    return cfg, np.array([r["learning_rate"] for r in rows])


def test_learning_rate_warms_up_from_zero_then_decays(learning_rates):
    """The learning rate a run logs for each step: 0 at step 1, rising by equal steps through the warmup to
    learning_rate at the step after the warmup_steps, then falling at every step."""
    cfg, lr = learning_rates
    W = cfg.warmup_steps
    assert lr[0] == 0.0
    np.testing.assert_allclose(lr[: W + 1], cfg.learning_rate * np.arange(W + 1) / W, rtol=1e-6)
    assert np.all(np.diff(lr[W:]) < 0), lr


def test_learning_rate_ends_at_min_lr_ratio_at_the_last_step(learning_rates):
    """The last step (steps) runs at learning_rate x min_lr_ratio, as base.yml documents."""
    cfg, lr = learning_rates
    np.testing.assert_allclose(lr[-1], cfg.learning_rate * cfg.min_lr_ratio, rtol=1e-5)


def test_bfloat16_weights_and_optimizer_state_train(tmp_path):
    """weight_dtype=bfloat16 stores the parameters and AdamW's moments in bfloat16, from init and after every
    update, and a few steps on one batch still train: finite losses, the last well below the first."""
    cfg = config(tmp_path, "weight_dtype=bfloat16", "dtype=bfloat16", "warmup_steps=0")
    mesh, state, step = _state_and_step(cfg)
    batch, lost = {k: v[None] for k, v in _batch(cfg, 8).items()}, []

    def floats(
        tree,
    ):  # {path: dtype} of the floating-point leaves (AdamW's step counts are integers)
        return {
            jax.tree_util.keystr(p): x.dtype
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)
        }

    for i in range(6):
        for part in ("params", "opt_state"):
            dtypes = floats(state[part])
            assert len(dtypes) > 10 and set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}, (
                i,
                part,
                dtypes,
            )
        with jax.set_mesh(mesh):
            state, out = step(state, batch)
        lost.append(float(out["loss"]))
    assert all(np.isfinite(lost)) and lost[-1] < lost[0] - 0.1, lost


# ---- the model ------------------------------------------------------------------------------------
def test_bfloat16_compute_agrees_with_float32(tmp_path):
    """dtype=bfloat16 runs the model's matmuls in bfloat16 (their operands are bf16 in the compiled program;
    the logits differ from float32's) and stays within bf16's precision of the float32 model, the same
    parameters (float32 weights) on the same tokens. bf16 keeps 8 significant bits: each matmul operand is
    rounded by up to u = 2^-8 of itself, accumulation stays float32 (so errors do not grow with the sum's
    length), as do the norms' statistics; the logits are summed in float32, stored in bf16 (their softmax in
    float32). Over 2 layers the logits land ~2u of the largest logit from float32's (measured 0.7%); allowed:
    8u (3.1%). The loss, a mean over 128 tokens whose rounding errors partly cancel, lands ~0.02u off
    (relative); allowed: u (0.39%)."""
    u, L = 2.0**-8, 32
    b = _batch(config(tmp_path), 4)
    b = {**b, "loss_mask": np.ones_like(b["loss_mask"])}
    logits, loss, operands = {}, {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = config(tmp_path, f"dtype={dtype}")
        graph, params = init_model(
            cfg
        )  # float32 weights (weight_dtype): the same parameters for both
        forward = jax.jit(
            lambda p, graph=graph: nnx.merge(graph, p)(
                b["inputs"], b["positions"], b["segment_ids"]
            )
        )
        lm_loss = jax.jit(lambda p, cfg=cfg, graph=graph: model_lib.lm_loss(cfg, graph, p, b))
        logits[dtype] = np.asarray(forward(params)).astype(np.float32)
        assert forward(params).dtype == jnp.dtype(dtype)
        summed, sums = lm_loss(params)
        loss[dtype] = float(summed / sums["weight"])
        dots = [
            line.split(" : (")[1].split(") -> ")[0]
            for line in forward.lower(params).as_text().splitlines()
            if "stablehlo.dot_general" in line
        ]  # each matmul's operand types: tensor<128x64xbf16>, ...
        operands[dtype] = {
            t.rsplit("x", 1)[1].rstrip(">") for types in dots for t in types.split(", ")
        }
        assert len(dots) >= 2 * 3 + 1, (
            dots
        )  # found them: at least each layer's MLP (3 matmuls) and the head
    assert operands == {"float32": {"f32"}, "bfloat16": {"bf16"}}, operands  # every matmul
    assert logits["bfloat16"].shape == (4, L, 128)
    diff, scale = np.abs(logits["bfloat16"] - logits["float32"]), np.abs(logits["float32"]).max()
    assert diff.max() > 0.1 * u * scale, "bfloat16 gave float32's logits: not computed in bf16"
    assert diff.max() <= 8 * u * scale, (diff.max(), scale)
    assert abs(loss["bfloat16"] - loss["float32"]) <= u * loss["float32"], loss


def hlo_dots(text):
    """(lhs type, rhs type, result type) of every dot and convolution in optimized HLO text, those inside
    fusion computations too: an operand's type is read from its definition in the same computation."""
    out, types = [], {}
    for line in text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            types = {}  # a new computation: instruction names are local to it
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[[\d,]*\]\S* ([\w\-]+)\(([^)]*)\)", line)
        if m:
            name, dtype, op, operands = m.groups()
            types[name] = dtype
            if op in ("dot", "convolution"):
                out.append(
                    (*(types.get(o.strip().lstrip("%"), "?") for o in operands.split(",")), dtype)
                )
    return out


def _compiled_step(cfg, batch):
    mesh, state, step = _state_and_step(cfg)
    with jax.set_mesh(mesh):
        return step.lower(state, jax.tree.map(lambda v: v[None], batch)).compile()


@pytest.mark.parametrize("preset", ["lm", "sudoku"])
@pytest.mark.slow
def test_bfloat16_step_runs_every_matmul_in_bfloat16(tmp_path, preset):
    """The dtype=bfloat16 train step (default layout: layers scanned, remat=save_dots) runs every matmul,
    forward and both backward products, as bf16 x bf16 accumulating in float32 in the program XLA:CPU
    compiles, where float32 x bf16 operands would have become float32 x float32. The only float32 dots left
    are the TRM's halting and value heads, matrix-vector products read from float32 y on purpose (a result
    with a unit axis). save_dots keeps bf16 values, so the bf16 step needs well under float32's temporary
    memory (measured 0.53x at this size; before, with the float32 sums it kept, 0.87x)."""
    dots, temp = {}, {}
    for dtype in ("float32", "bfloat16"):
        if preset == "lm":
            cfg = config(tmp_path, f"dtype={dtype}", "scan_layers=true", "remat=save_dots")
            batch = _batch(cfg, 8)
        else:
            cfg = config(
                tmp_path, f"dtype={dtype}", "scan_layers=true", "remat=save_dots", preset=SUDOKU
            )
            batch = {k: np.asarray(v) for k, v in sudoku_batch(cfg.per_device_batch).items()}
        compiled = _compiled_step(cfg, batch)
        dots[dtype], temp[dtype] = (
            hlo_dots(compiled.as_text()),
            compiled.memory_analysis().temp_size_in_bytes,
        )
    assert len(dots["bfloat16"]) >= 4 * 3 * 2, (
        dots
    )  # found them: each layer's MLP, forward and backward
    assert {d for d in dots["float32"]} == {("f32", "f32", "f32")}, dots["float32"]
    narrow = [d for d in dots["bfloat16"] if d != ("bf16", "bf16", "f32")]
    heads = {"lm": 0, "sudoku": 2}[
        preset
    ]  # the halting head's forward and backward (the value head is off)
    assert len(narrow) == heads and set(narrow) <= {("f32", "f32", "f32")}, narrow
    if preset == "lm":
        assert temp["bfloat16"] < 0.7 * temp["float32"], temp


@pytest.mark.parametrize("preset", ["lm", "sudoku"])
def test_counted_flops_never_exceed_the_compiled_steps(tmp_path, preset):
    """MFU's numerator: each task's hand-counted training FLOPs per token are at most what XLA's cost
    analysis counts in the compiled step (which adds elementwise work the count leaves out) and most of it:
    measured 0.91 (LM) and 0.69 (TRM, T=2 n=1, where the halting head and the loss weigh most). The LM's
    layers unrolled: XLA's cost analysis counts a scanned body once, not once per layer."""
    if preset == "lm":
        cfg = config(tmp_path, "remat=none", "scan_layers=false")
        batch, tokens = _batch(cfg, 8), 8 * cfg.max_target_length
    else:
        cfg = config(tmp_path, "remat=none", preset=SUDOKU)
        batch = {k: np.asarray(v) for k, v in sudoku_batch(cfg.per_device_batch).items()}
        tokens = cfg.per_device_batch * batch["inputs"].shape[1]
    cost = _compiled_step(cfg, batch).cost_analysis()
    compiled = (cost[0] if isinstance(cost, list) else cost)["flops"] / tokens
    assert 0.6 * compiled < model_lib.TASKS[cfg.task].flops_per_token(cfg) <= compiled, compiled


@pytest.mark.parametrize("vocab_tile", [0, 32])
@pytest.mark.slow
def test_bfloat16_gradients_agree_with_float32(tmp_path, vocab_tile):
    """The bf16 step's gradients (bf16 products both ways, float32 accumulation and master weights) are the
    float32 step's within bf16's precision, the same parameters on the same tokens, the LM head plain and
    vocabulary-tiled. u = 2^-8: each product's operands are rounded by up to u. The global gradient lands
    ~2.6u (1.0%) from float32's (relative, measured); allowed 5u. Every parameter's gradient points the
    same way: cosine similarity measured > 0.9998; allowed > 0.999."""
    u = 2.0**-8
    b = _batch(config(tmp_path), 8)
    grads = {}
    for dtype in ("float32", "bfloat16"):
        cfg = config(tmp_path, f"dtype={dtype}", f"vocab_tile={vocab_tile}", "scan_layers=true")
        graph, params = init_model(cfg)
        loss = lambda p, cfg=cfg, graph=graph: (
            model_lib.lm_loss(cfg, graph, p, b)[0] / np.sum(b["loss_mask"])
        )
        grads[dtype] = [
            np.asarray(g, np.float64) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params))
        ]
    f32, bf16 = grads["float32"], grads["bfloat16"]
    err = np.sqrt(sum(np.sum((a - c) ** 2) for a, c in zip(f32, bf16))) / np.sqrt(
        sum(np.sum(a**2) for a in f32)
    )
    assert 0.1 * u < err <= 5 * u, err  # not float32's own gradient, and within bf16's precision
    cosines = [np.sum(a * c) / np.linalg.norm(a) / np.linalg.norm(c) for a, c in zip(f32, bf16)]
    assert min(cosines) > 0.999, cosines


def _init(cfg, L=16, seed=0):
    """(forward(params, tokens, positions, segments), params, tokens, positions); forward is jitted, since
    eager op-by-op dispatch would dominate these tests' time."""
    graph, params = init_model(cfg, seed)
    toks = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, L)), jnp.int32)
    pos = jnp.tile(jnp.arange(L), (2, 1))
    return jax.jit(lambda p, *args: nnx.merge(graph, p)(*args)), params, toks, pos


def test_causality(tmp_path):
    cfg = config(tmp_path)
    m, params, toks, pos = _init(cfg)
    seg = jnp.ones_like(toks)
    base = m(params, toks, pos, seg)
    for t in (0, 7, 15):
        changed = m(params, toks.at[:, t].set((toks[:, t] + 1) % cfg.vocab_size), pos, seg)
        np.testing.assert_array_equal(changed[:, :t], base[:, :t])
        assert not np.allclose(changed[:, t:], base[:, t:])


def test_packed_segments_do_not_attend_across(tmp_path):
    """Two documents packed in one row give the same logits as each alone (positions restart)."""
    cfg = config(tmp_path)
    m, params, toks, _ = _init(cfg)
    seg = jnp.array([[1] * 10 + [2] * 6] * 2)
    pos = jnp.array([list(range(10)) + list(range(6))] * 2)
    packed = m(params, toks, pos, seg)
    alone = m(params, toks[:, 10:], pos[:, 10:], seg[:, 10:])
    np.testing.assert_allclose(packed[:, 10:], alone, rtol=1e-5, atol=1e-5)


def _reference_mha(cfg, params, toks, pos):
    """Plain multi-head attention Llama, written independently of model.py (numpy float64)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    toks, pos = np.asarray(toks), np.asarray(pos)
    K = cfg.d_model // cfg.num_heads

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rot(x):
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2) / K)
        ang = pos[..., None, None] * np.concatenate([inv, inv])
        return x * np.cos(ang) + np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], -1) * np.sin(
            ang
        )

    x = p["embed"][toks]
    L = toks.shape[1]
    for i in range(cfg.num_layers):
        lp = p["trunk"]["layers"][i]
        h = norm(x, lp["attn_norm"]["scale"])
        q, k, v = (np.einsum("bld,dhk->blhk", h, lp["attn"][w]) for w in ("wq", "wk", "wv"))
        q, k = rot(q), rot(k)
        s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(K) + np.triu(np.full((L, L), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("bhqs,bshk,hkd->bqd", a, v, lp["attn"]["wo"])
        h = norm(x, lp["mlp_norm"]["scale"])
        g = h @ lp["mlp"]["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ lp["mlp"]["w_up"])) @ lp["mlp"]["w_down"]
    return norm(x, p["final_norm"]["scale"]) @ p["lm_head"]


def test_gqa_with_all_kv_heads_is_plain_mha(tmp_path):
    cfg = config(tmp_path, "num_kv_heads=4", "scan_layers=false")
    m, params, toks, pos = _init(cfg)
    ours = m(params, toks, pos, jnp.ones_like(toks))
    np.testing.assert_allclose(ours, _reference_mha(cfg, params, toks, pos), rtol=2e-4, atol=2e-4)


def test_attention_xla_equals_einsum_with_packing(tmp_path):
    """attention=xla (jax.nn.dot_product_attention) and the default einsum layout: the same logits for the
    same parameters, with two packed documents per row."""
    seg = jnp.repeat(jnp.array([[1, 2], [1, 2]]), 8, axis=1)
    got = {}
    for impl in ("einsum", "xla"):
        m, params, toks, _ = _init(config(tmp_path, f"attention={impl}", "scan_layers=false"))
        got[impl] = m(params, toks, jnp.where(seg == 1, jnp.arange(16), jnp.arange(16) - 8), seg)
    np.testing.assert_allclose(got["xla"], got["einsum"], rtol=1e-5, atol=1e-5)


def test_gqa_shares_kv_heads(tmp_path):
    """G=2 kv heads equals MHA whose 4 kv heads are the 2 repeated (head h uses kv head h // 2)."""
    cfg = config(tmp_path, "scan_layers=false")
    m, params, toks, pos = _init(cfg)
    ours = m(params, toks, pos, jnp.ones_like(toks))
    mha = jax.tree.map(lambda x: x, params)
    for i in range(cfg.num_layers):
        attn = mha["trunk"]["layers"][i]["attn"]
        for w in ("wk", "wv"):
            attn[w] = jnp.repeat(attn[w], 2, axis=1)
    cfg4 = config(tmp_path, "num_kv_heads=4", "scan_layers=false")
    np.testing.assert_allclose(ours, _reference_mha(cfg4, mha, toks, pos), rtol=2e-4, atol=2e-4)


# ---- mesh and sharding ----------------------------------------------------------------------------
def test_big_parameters_are_sharded_on_4_4_2(tmp_path):
    cfg = config(
        tmp_path, "mesh=4,4,2", "d_model=128", "mlp_dim=256", "vocab_size=256", "scan_layers=true"
    )
    mesh, layout, state, _ = train_state(cfg, jax.devices())
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if x.size >= 4096:
            assert not x.sharding.is_fully_replicated, jax.tree_util.keystr(path)
            assert x.addressable_shards[0].data.size < x.size
    table = "\n".join(train.sharding_table(layout, cfg, mesh))
    assert "['embed']" in table and "fsdp" in table and "tensor" in table


@pytest.mark.slow
def test_dimensions_kept_whole_are_printed_at_start(tmp_path, capsys):
    """vocab_size=131 divides by no mesh axis: the embedding and LM head keep their vocabulary dimension whole on
    every device, which the start of the run says (a dividing size shards and is not listed)."""
    train.run(config(tmp_path, "mesh=1,2,2", "vocab_size=131", "steps=1"), jax.devices()[:4])
    out = capsys.readouterr().out
    whole = out.split(
        "parameters kept whole where their size does not divide by their mesh axes:\n"
    )[1].split("\nmodel:")[0]
    assert re.search(r"^\['embed'\] +\(131, 64\) .* dim 0 not over tensor$", whole, re.MULTILINE), (
        out
    )
    assert re.search(
        r"^\['lm_head'\] +\(64, 131\) .* dim 1 not over tensor$", whole, re.MULTILINE
    ), out
    assert "['trunk']" not in whole, out


def test_odd_sizes_keep_a_dividing_prefix_or_replicate(tmp_path):
    """A dimension keeps the longest prefix of its mesh axes that divides it, else stays whole, so every
    placement divides and any size compiles."""
    cfg = config(tmp_path, "mesh=2,4,4")
    mesh = train.make_mesh(cfg, jax.devices())
    spec = lambda logical, shape: tuple(train.mesh_spec(logical, shape, cfg, mesh))
    assert spec(("batch", "length"), (6, 32)) == ("data", None)
    assert spec(("batch", "length"), (16, 32)) == (("data", "fsdp"), None)
    assert spec(("vocab", "embed"), (131, 64)) == (None, "fsdp") and spec(
        ("vocab", "embed"), (132, 6)
    ) == ("tensor", None)


def test_mesh_fill_and_mismatch(tmp_path):
    cfg = config(tmp_path, "mesh=2,-1,2")
    assert dict(train.make_mesh(cfg, jax.devices()).shape) == {"data": 2, "fsdp": 8, "tensor": 2}
    with pytest.raises(train.ConfigError, match="needs 32 devices but JAX sees 8"):
        train.make_mesh(config(tmp_path, "mesh=4,4,2"), jax.devices()[:8])


# ---- config files ---------------------------------------------------------------------------------
def test_duplicate_key_in_yaml(tmp_path):
    path = tmp_path / "dup.yml"
    path.write_text(pathlib.Path(BASE).read_text() + "\nsteps: 7\n")
    with pytest.raises(train.ConfigError, match="key 'steps' is set twice"):
        train.load_config(str(path))


def test_base_yml_and_the_schema_name_the_same_keys():
    """Every key of base.yml (a section's keys as section.key, e.g. trm.T) is declared in train.py's schema
    and every declared key has its default in base.yml; the schema declares each key once."""

    def flat(mapping, prefix=""):
        for key, value in mapping.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]

    with open(BASE) as f:
        keys = list(
            flat(train.yaml.load(f, train._UniqueKeyLoader))
        )  # the loader refuses a key set twice
    repeated = sorted({k for k in train.KEYS if train.KEYS.count(k) > 1})
    assert not repeated, f"declared more than once in base.yml: {repeated}"
    assert not set(keys) - set(train.KEYS), (
        f"in base.yml, not in the schema: {sorted(set(keys) - set(train.KEYS))}"
    )
    assert not set(train.KEYS) - set(keys), (
        f"in the schema, not in base.yml: {sorted(set(train.KEYS) - set(keys))}"
    )


@pytest.mark.slow
def test_a_key_added_on_one_line_of_base_yml_is_typed_documented_and_bounded(tmp_path):
    """A new key is one line of base.yml (issue 85): `key: default  # [kind] doc`. The trainer copied with that
    line added loads it typed, holds its doc, takes a value in bounds and refuses one out of them in one line
    naming the key; a key without a kind, a kind train.py does not know and a key declared twice are one line
    each, naming the line."""
    for name in ("train.py", "model.py", "data.py"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    base = pathlib.Path(BASE).read_text()
    (tmp_path / "base.yml").write_text(
        base + "probe_depth: 3  # [int 1..9] how deep a probe goes\n"
    )
    program = """
import sys, train
print(train.DECLARED["probe_depth"].doc)
for given in ([], ["probe_depth=9"], ["probe_depth=10"], ["probe_depth=0"], ["probe_depth=x"]):
    try:
        print(repr(train.load_config(["base.yml"], given).probe_depth))
    except train.ConfigError as e:
        print(e)
"""
    run = lambda: subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert run().stdout.splitlines() == [
        "how deep a probe goes",
        "3",
        "9",
        "probe_depth=10: must be <= 9",
        "probe_depth=0: must be >= 1",
        "probe_depth=x: expected an integer",
    ]
    lines = base.count("\n")
    for extra, says in (
        ("probe_depth: 3\n", f"base.yml:{lines + 1}: probe_depth needs its kind and doc"),
        (
            "probe_depth: 3  # [depth] deep\n",
            "probe_depth: kind [depth] names no type in train.KINDS",
        ),
        ("steps: 7  # [count] again\n", f"base.yml:{lines + 1}: steps is declared twice"),
    ):
        (tmp_path / "base.yml").write_text(base + extra)
        got = run()
        assert got.returncode != 0 and says in got.stderr, got.stderr[-800:]


def test_train_py_names_nothing_of_the_puzzle():
    """The task owns its keys and words (model.Task: keys, shown, dataset): no puzzle key, decoder or metric
    name appears in train.py's code (its names and strings; comments and docstrings may say what a task is)."""
    import tokenize

    with open(os.path.join(ROOT, "train.py")) as f:
        toks = [
            t.string
            for t in tokenize.generate_tokens(f.readline)
            if t.type in (tokenize.NAME, tokenize.STRING)
        ]
    code = "\n".join(t for t in toks if not t.startswith(('"""', "'''"))).lower()
    lines = (
        pathlib.Path(BASE).read_text().split("\n")
    )  # the puzzle's keys: base.yml's last sections
    start = next(n for n, line in enumerate(lines, 1) if line.startswith("# ---- sudoku"))
    names = [k for k, d in train.DECLARED.items() if d.line > start or k.startswith("dpo.")]
    names += ["sudoku", "DECODERS", "exact", "thought", "halt", "beam", "solved"]
    assert len(names) > 30 and not sorted({n for n in names if n.lower() in code}), names


def test_override_types(tmp_path):
    cfg = config(
        tmp_path,
        "mesh=4,4,2",
        "learning_rate=1",
        "scan_layers=false",
        "logical_axis_rules=[[batch, data]]",
    )
    assert (
        cfg.mesh == (4, 4, 2) and cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    )
    assert cfg.scan_layers is False and cfg.logical_axis_rules == (("batch", "data"),)


@pytest.mark.parametrize(
    "keys, line",
    [
        (["run_name=a\nb"], r"run_name='a\\nb': give a plain directory name, printable, no /"),
        (["run_name=../up"], r"run_name='../up': give a plain directory name"),
        (
            ["mode=export", "export_dir={tmp}/./default/../default/checkpoints/2/hf"],
            r"export_dir=.*: inside the run's checkpoints, where an export would land in a saved",
        ),
        (
            ["mode=eval", "eval_answers=1", "max_new_tokens=2000000000", "max_target_length=32"],
            r"max_new_tokens=2000000000: the KV cache of 2,000,000,032 positions needs .* GiB of host",
        ),
    ],
)
def test_names_and_sizes_out_of_bounds_are_refused_before_anything_is_written(tmp_path, keys, line):
    """A run_name that leaves output_dir or holds a newline, an export into the run's own checkpoints, a
    generation whose KV cache cannot fit (before: ~37 GB allocated, then an out-of-memory traceback): one
    line each, and nothing written anywhere; a NUL in any text key is refused by the schema."""
    cfg = config(tmp_path / "out", *[k.replace("{tmp}", str(tmp_path / "out")) for k in keys])
    with pytest.raises(train.ConfigError, match=line):
        train.run(cfg, jax.devices()[:1])
    assert not list(tmp_path.rglob("default")) and not list(tmp_path.rglob("*.yml"))  # no run dir
    nul = tmp_path / "nul.yml"
    nul.write_text('run_name: "a\\0b"\n')
    with pytest.raises(train.ConfigError, match=r'run_name="a\\u0000b": holds a NUL character'):
        train.load_config([BASE, str(nul)])


def test_eval_batches_past_the_eval_set_evaluate_one_pass(tmp_path, capsys):
    """eval_batches=10^8 evaluates the eval set once and says so (before: 10^8 padding batches built up
    front, 24 GB of host memory, then killed); the loss equals the one of exactly that many batches."""
    train.run(config(tmp_path, "steps=1"), jax.devices()[:1])
    huge = train.run(config(tmp_path, "mode=eval", "eval_batches=100000000"), jax.devices()[:1])
    assert (
        "eval_batches=100000000: the eval set fills 64; evaluating those" in capsys.readouterr().out
    )
    exact = train.run(config(tmp_path, "mode=eval", "eval_batches=64"), jax.devices()[:1])
    assert huge["loss"] == exact["loss"]


def test_run_writes_config_metrics_and_tensorboard(tmp_path):
    """The resolved config reloads; every logged value is in metrics.jsonl and, read back by TensorBoard's
    own event reader, in the event file with its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = train.run(
        config(tmp_path, "steps=3", "run_name=files", "eval_batches=1"), jax.devices()[:1]
    )
    rows = metrics(s["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu", "eval_loss"):
        assert key in rows[-1]
    assert train.load_config(os.path.join(s["run_dir"], "config.yml")).steps == 3
    events = EventAccumulator(s["run_dir"])
    events.Reload()
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss", "tokens_per_sec", "goodput"):
        logged = [(r["step"], r[key]) for r in rows if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in logged], key
        np.testing.assert_allclose(
            [v for _, v in got], [v for _, v in logged], rtol=1e-6, err_msg=key
        )  # float32


def test_goodput_shares_are_measured_and_add_up(tmp_path, capsys):
    """Every row and the last lines split the wall time so far into the steps (goodput) and each badput;
    the shares add up to 1, and the ones another clock also measures agree with it: eval with the eval's own
    seconds, compile with the compile the log reports. A fresh run redoes no step."""
    s = train.run(
        config(tmp_path, "steps=6", "checkpoint_every=2", "eval_every=3", "eval_batches=1"),
        jax.devices()[:1],
    )
    out = capsys.readouterr().out
    kinds = ("startup", "compile", "data", "checkpoint", "eval", "redone")
    for r in [*metrics(s["run_dir"]), s]:
        shares = [r["goodput"]] + [r[f"badput_{k}"] for k in kinds]
        assert all(0 <= x <= 1 for x in shares) and sum(shares) == pytest.approx(1, abs=1e-9), r
    rows = metrics(s["run_dir"])
    assert [r["wall_seconds"] for r in rows] == sorted(r["wall_seconds"] for r in rows)
    evals = sum(r["eval_seconds"] for r in rows if "eval_seconds" in r)
    assert rows[-1]["badput_eval"] * rows[-1]["wall_seconds"] == pytest.approx(evals, rel=0.1)
    compiled = float(re.search(r"step compiled in ([\d.]+)s", out)[1])
    assert s["badput_compile"] * s["wall_seconds"] == pytest.approx(compiled, abs=0.1)
    assert s["badput_startup"] > 0 and s["badput_checkpoint"] > 0 and s["goodput"] > 0
    assert s["badput_redone"] == 0
    assert re.search(r"^goodput: [\d.]+% of [\d.]+s in steps; badput: startup", out, re.MULTILINE)


@pytest.mark.slow
def test_a_long_run_holds_its_file_descriptors_and_memory_flat(tmp_path):
    """400 steps from the command line, a checkpoint every 10 (3 kept): the files open at each row stay
    within a few of the first row's (a save in flight holds some), and from step 200 to 400 the host's peak
    RSS grows by less than 1 MB a checkpoint: a copy of the train state kept per save would be 2.4 MB.
    (By hand, 1,000 steps: 10-13 files, 0.584 -> 0.602 GiB from step 200, ~0.2 MB a save, inside orbax,
    which alone keeps ~22 KB per save of a 2-array state: measured over 1,200 saves.)"""
    keys = ["steps=400", "log_every=100", "checkpoint_every=10"]
    r = subprocess.run(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, *keys)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    rows = metrics(tmp_path / "default")
    assert max(r["open_files"] for r in rows) <= rows[0]["open_files"] + 8, rows
    assert (rows[-1]["host_rss_gb"] - rows[1]["host_rss_gb"]) * 1024 < 20, rows  # 20 saves
    assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == ["380", "390", "400"]


def test_nonfinite_loss_stops_naming_the_step(tmp_path, capsys, monkeypatch):
    """Through the command line: one `error:` line on stderr naming the step, exit code 3."""
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *_: one)  # not the session's 32
    argv = args(tmp_path, "steps=50", "learning_rate=1e12", "warmup_steps=0", "grad_clip=0")
    assert train.main(["train.py", BASE, *argv]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(
        r"error: (loss|gradient norm) is \S+ .*at step \d+: stopped", err[0]
    ), err


def test_ci_runs_the_readme_test_command():
    readme = pathlib.Path(ROOT, "README.md").read_text()
    ci = pathlib.Path(ROOT, ".ci", "run").read_text()
    test_cmd = next(line.strip() for line in readme.splitlines() if "pytest" in line)
    assert test_cmd in ci


# ---- the TPU attention kernel and the tiled LM head, on CPU ------------------------------------------
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.slow
def test_splash_attention_in_interpret_mode_equals_einsum(dtype, tol):
    """attention=splash's Pallas kernel, run by its interpreter here: its outputs and the gradients of q, k and
    v equal the einsum attention's, causal, with two packed documents per row and GQA (4 query heads on 2 kv
    heads, the kv heads not copied), to float32 rounding (1e-5 of each array's largest value) and, in bf16, a
    few of its rounding units (2^-8)."""
    B, L, H, G, K, dt = (
        2,
        128,
        4,
        2,
        32,
        jnp.dtype(dtype),
    )  # the kernel's tiles are 128 wide at least
    q, k, v = (
        jax.random.normal(jax.random.key(i), (B, L, n, K), dt) for i, n in enumerate((H, G, G))
    )
    seg = jnp.array([[1] * 80 + [2] * 48, [1] * 128])
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    einsum = lambda q, k, v: model_lib.gqa_attention(q, k, v, mask, True, dt).astype(jnp.float32)
    splash = lambda q, k, v: model_lib.splash_attention(q, k, v, seg, True, interpret=True).astype(
        jnp.float32
    )
    cot = jax.random.normal(
        jax.random.key(9), (B, L, H, K)
    )  # a fixed output gradient: d(sum(out * cot))
    for got, want in zip(
        jax.vjp(splash, q, k, v)[1](cot) + (splash(q, k, v),),
        jax.vjp(einsum, q, k, v)[1](cot) + (einsum(q, k, v),),
    ):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), (
            np.abs(got - want).max(),
            np.abs(want).max(),
        )


@pytest.mark.slow
def test_tiled_lm_head_equals_the_untiled_one(tmp_path):
    """vocab_tile: the loss and every gradient equal the untiled head's to float32 rounding (the logits taken a
    tile at a time, the log-sum-exp carried across tiles, the target's logit from its tile), tied or not."""
    b = _batch(config(tmp_path), 4)
    for tie in ("false", "true"):
        cfg, tiled = (
            config(tmp_path, f"tie_embeddings={tie}"),
            config(tmp_path, f"tie_embeddings={tie}", "vocab_tile=32"),
        )
        graph, params = init_model(cfg)
        loss = lambda c, graph=graph, params=params: jax.jit(
            jax.value_and_grad(lambda p: model_lib.lm_loss(c, graph, p, b)[0])
        )(params)
        (want, want_g), (got, got_g) = loss(cfg), loss(tiled)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        close = lambda a, w: (
            np.abs(np.asarray(a) - np.asarray(w)).max() <= 1e-5 * np.abs(np.asarray(w)).max()
        )
        assert all(jax.tree.leaves(jax.tree.map(close, got_g, want_g))), tie
