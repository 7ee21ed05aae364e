"""Hugging Face Llama export / import (safetensors, no torch) and KV-cache generation."""

import itertools
import json
import os
import pathlib
import struct

import jax
import numpy as np
import pytest
from conftest import (
    TEXT,
    config,
    init_model,
    read_checkpoint,
    train_state,
    write_corpus,
)
from flax import nnx

import model as model_lib
import train

DEVICES = 4  # fsdp=4: export gathers sharded parameters, import places them back sharded


def _greedy_full_recompute(cfg, params, prompt_BP, n):
    """The reference: rerun the whole sequence for every new token, no cache. Causal, so a fixed padded
    length (one compile) gives the same logits at each filled position."""
    B, P = prompt_BP.shape
    seq = np.zeros((B, P + n), np.int32)
    seq[:, :P] = prompt_BP
    pos = np.broadcast_to(np.arange(P + n), seq.shape)
    graph = model_lib.abstract(cfg)[0]
    logits = jax.jit(lambda p, s: nnx.merge(graph, p)(s, pos, np.ones_like(seq)))
    for t in range(P, P + n):
        seq[:, t] = np.argmax(np.asarray(logits(params, seq))[:, t - 1], -1)
    return seq[:, P:]


@pytest.mark.parametrize("scan,tie", [("true", "false"), ("false", "true")])
def test_export_layout_and_round_trip(tmp_path, scan, tie):
    """Exported names/shapes/dtypes are Llama's; re-import gives identical parameters and logits."""
    keys = [f"scan_layers={scan}", f"tie_embeddings={tie}", "seed=3"]
    cfg = config(tmp_path, *keys)
    _mesh, layout, state, _ = train_state(cfg, jax.devices()[:DEVICES])
    ours = state["params"]  # sharded over fsdp=4
    hf = str(tmp_path / "hf")
    model_lib.export_hf(cfg, ours, train.data.make_dataset(cfg).tokenizer, hf)

    # The safetensors header, parsed by hand: 8-byte size, JSON, 8-byte aligned, contiguous byte ranges.
    with open(os.path.join(hf, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, body = json.loads(f.read(n)), f.read()
    assert n % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    D, F, V, H, G, K = 64, 128, 128, 4, 2, 16
    want = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
    if tie == "false":
        want["lm_head.weight"] = [V, D]
    for i in range(2):
        want.update(
            {
                f"model.layers.{i}.self_attn.q_proj.weight": [H * K, D],
                f"model.layers.{i}.self_attn.k_proj.weight": [G * K, D],
                f"model.layers.{i}.self_attn.v_proj.weight": [G * K, D],
                f"model.layers.{i}.self_attn.o_proj.weight": [D, H * K],
                f"model.layers.{i}.mlp.gate_proj.weight": [F, D],
                f"model.layers.{i}.mlp.up_proj.weight": [F, D],
                f"model.layers.{i}.mlp.down_proj.weight": [D, F],
                f"model.layers.{i}.input_layernorm.weight": [D],
                f"model.layers.{i}.post_attention_layernorm.weight": [D],
            }
        )
    assert {k: h["shape"] for k, h in header.items()} == want
    assert {h["dtype"] for h in header.values()} == {"F32"}
    ranges = sorted(h["data_offsets"] for h in header.values())
    assert ranges[0][0] == 0 and ranges[-1][1] == len(body)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    conf = json.loads(pathlib.Path(hf, "config.json").read_text())
    assert (
        conf["model_type"] == "llama" and conf["num_key_value_heads"] == G and conf["head_dim"] == K
    )
    assert conf["tie_word_embeddings"] == (tie == "true")

    # Round trip: the same parameters in the same placement, so the same logits.
    back = jax.device_put(
        model_lib.load_hf(cfg, hf, layout.abstract["params"]), layout.shardings["params"]
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ours, back
    )
    assert jax.tree.map(lambda a: a.sharding.spec, ours) == jax.tree.map(
        lambda a: a.sharding.spec, back
    )
    tokens = np.random.default_rng(0).integers(0, V, (2, 32)).astype(np.int32)
    pos = np.broadcast_to(np.arange(32), tokens.shape)
    graph = model_lib.abstract(cfg)[0]
    apply = jax.jit(lambda p: nnx.merge(graph, p)(tokens, pos, np.ones_like(tokens)))
    np.testing.assert_array_equal(np.asarray(apply(ours)), np.asarray(apply(back)))

    # A config that disagrees with the checkpoint is one line naming the key; so is a missing directory.
    with pytest.raises(
        train.ConfigError,
        match="its config.json has hidden_size=64 but d_model=32 is set; drop d_model=",
    ):
        train.pretrained(config(tmp_path, *keys, "d_model=32", f"load_hf={hf}"))
    assert (
        train.pretrained(config(tmp_path, *keys, "d_model=64", f"load_hf={hf}")).d_model == 64
    )  # agrees
    with pytest.raises(train.data.DataError, match="cannot read .*nope"):
        model_lib.load_hf(cfg, str(tmp_path / "nope"), layout.abstract["params"])
    # Tensors that disagree with their own config.json (a hand-edited or half-converted checkpoint).
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(os.path.join(hf, "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    safetensors.numpy.save_file(tensors, os.path.join(hf, "model.safetensors"))
    with pytest.raises(
        train.data.DataError,
        match=r"disagrees with its config.json: model.norm.weight is \[63\] where "
        r"the config makes \[64\]",
    ):
        model_lib.load_hf(cfg, hf, layout.abstract["params"])


@pytest.mark.parametrize("scan", ["true", "false"])
def test_kv_cache_generation_equals_full_recompute(tmp_path, scan):
    """Greedy decoding with the cache gives the same tokens as recomputing the whole prefix each time."""
    cfg = config(tmp_path, f"scan_layers={scan}", "temperature=0", "max_new_tokens=12")
    graph, params = init_model(cfg, seed=1)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 5)).astype(np.int32)
    got = np.asarray(model_lib.generate(cfg, graph, params, prompt, jax.random.key(0)))
    np.testing.assert_array_equal(got, _greedy_full_recompute(cfg, params, prompt, 12))
    if scan == "false":
        return
    # Sampling with top_k=1 is greedy whatever the temperature.
    hot = config(tmp_path, f"scan_layers={scan}", "max_new_tokens=12", "temperature=2.0", "top_k=1")
    np.testing.assert_array_equal(
        np.asarray(model_lib.generate(hot, graph, params, prompt, jax.random.key(0))), got
    )


def test_top_k_sampling_draws_among_the_k_likeliest(tmp_path):
    """temperature > 0 with top_k=5: every sampled token is among the 5 highest logits at its position (the
    full forward of prompt + samples, no cache, recomputes them), the samples are not all the argmax, a key
    gives the same tokens every time and other keys others."""
    k, O = 5, 16
    cfg = config(tmp_path, "temperature=1.5", f"top_k={k}", f"max_new_tokens={O}")
    graph, params = init_model(cfg, seed=1)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (4, 3)).astype(np.int32)
    draw = lambda seed: np.asarray(
        model_lib.generate(cfg, graph, params, prompt, jax.random.key(seed))
    )
    got = draw(0)
    assert got.shape == (4, O)
    np.testing.assert_array_equal(draw(0), got)
    assert not np.array_equal(draw(1), got) and not np.array_equal(draw(2), draw(1))
    seq = np.concatenate([prompt, got], axis=1)
    logits = np.asarray(
        jax.jit(
            lambda p: nnx.merge(graph, p)(
                seq, np.broadcast_to(np.arange(seq.shape[1]), seq.shape), np.ones_like(seq)
            )
        )(params)
    )
    before = logits[
        :, prompt.shape[1] - 1 : -1
    ]  # [B, O, V]: the logits each sampled token was drawn from
    chosen = np.take_along_axis(before, got[..., None], -1)[..., 0]
    kth = np.sort(before, -1)[..., -k]
    outside = np.argwhere(chosen < kth - 1e-4)  # (the cache and the full forward may round apart)
    assert not len(outside), (
        f"{len(outside)} of {got.size} samples not among the top {k}: {outside[:5].tolist()}"
    )
    assert (got != before.argmax(-1)).mean() > 0.2  # sampled, not greedy


def test_cli_export_and_generate(tmp_path, capsys):
    """On a text run: mode=export (here from load_hf) writes the same tensors plus the tokenizer;
    mode=generate writes exactly the continuation to generation.txt."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 12, "train", 0)
    text = lambda *overrides: config(
        tmp_path, f"dataset_path={corpus}/*.txt", *overrides, preset=TEXT
    )
    cfg = text()
    params = train_state(cfg, jax.devices()[:1])[2]["params"]
    first, hf = str(tmp_path / "first"), str(tmp_path / "hf")
    model_lib.export_hf(cfg, params, train.data.make_dataset(cfg).tokenizer, first)
    train.run(text("mode=export", f"load_hf={first}", f"export_dir={hf}"), jax.devices()[:1])
    assert sorted(os.listdir(hf)) == [
        ".exported.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    for name in os.listdir(hf):
        assert pathlib.Path(hf, name).read_bytes() == pathlib.Path(first, name).read_bytes(), name
    cfg = text(
        "mode=generate",
        f"load_hf={hf}",
        "prompt=train 3\nab",
        "temperature=0",
        "max_new_tokens=16",
        "run_name=gen",
    )
    out = train.run(cfg, jax.devices()[:1])
    with open(os.path.join(out["run_dir"], "generation.txt"), newline="") as f:
        written = f.read()
    tokenizer = train.data.make_dataset(cfg).tokenizer
    assert written == out["generation"] == tokenizer.decode(out["tokens"])
    assert tokenizer.eos_id not in out["tokens"] and len(out["tokens"]) <= 16
    assert "prompt: train 3\nab" in capsys.readouterr().out


def test_load_hf_starts_training_from_the_imported_weights(tmp_path):
    """load_hf=DIR in mode=train: a fresh run (step 0, new optimizer) from the exported weights. The first
    update is warmup's learning rate 0, so the step-1 checkpoint holds exactly the parameters exported."""
    train.run(config(tmp_path, "steps=2", "run_name=src", "seed=5"), jax.devices()[:1])
    train.run(
        config(tmp_path, "mode=export", "run_name=src", f"export_dir={tmp_path}/hf"),
        jax.devices()[:1],
    )
    cfg = config(tmp_path, "steps=1", "run_name=tuned", f"load_hf={tmp_path}/hf")
    train.run(cfg, jax.devices()[:1])
    read = lambda run, step: read_checkpoint(tmp_path / run, step)["train_state"]
    src, tuned = read("src", 2), read("tuned", 1)
    assert int(tuned["step"]) == 1
    jax.tree.map(np.testing.assert_array_equal, src["params"], tuned["params"])
