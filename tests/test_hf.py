"""Fine-tuning what exists, without torch or network: Hugging Face checkpoints of the three families (Llama 3 with
llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms) written here as transformers writes them (sharded,
bf16 / f16 / f32), read against a numpy forward written from transformers' equations; their tokenizer.json with
its special tokens and chat template; SFT rows with the prompt masked, packed, counted in epochs; the hub's offline
cache; and the way back (export)."""

import functools
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import safetensors.numpy
import yaml
from conftest import BASE, ENV, LM, ROOT, args, read_checkpoint
from conftest import config as lm_config
from flax import nnx

import model as model_lib
import train

DATA = train.data
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 96,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
}
FAMILIES = {
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rope_theta": 1e6,
        "head_dim": 32,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}
DTYPES = {"bf16": jax.numpy.bfloat16, "f16": np.float16, "f32": np.float32}
TINY = ["dtype=float32", "max_target_length=64", "log_every=1", "eval_every=0", "prefetch=0"]
# The tests' tiny LM without its shape: a checkpoint's config.json sets that.
PRESET = [o for o in LM if o.split("=")[0] not in model_lib.HF_KEYS]


def config(tmp_path, *overrides):
    return lm_config(tmp_path, *overrides, preset=PRESET)


def shapes(conf):
    """HF tensor name -> shape, as transformers lays out this config's model."""
    D, F, V = conf["hidden_size"], conf["intermediate_size"], conf["vocab_size"]
    H, G = conf["num_attention_heads"], conf["num_key_value_heads"]
    K = conf.get("head_dim") or D // H
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not conf["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, D)
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (H * K, D),
                p + "self_attn.k_proj.weight": (G * K, D),
                p + "self_attn.v_proj.weight": (G * K, D),
                p + "self_attn.o_proj.weight": (D, H * K),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        if conf["model_type"] == "qwen2":
            out.update(
                {
                    p + "self_attn.q_proj.bias": (H * K,),
                    p + "self_attn.k_proj.bias": (G * K,),
                    p + "self_attn.v_proj.bias": (G * K,),
                }
            )
        if conf["model_type"] == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (K,), p + "self_attn.k_norm.weight": (K,)})
    return out


def write_checkpoint(folder, family, dtype="f32", shards=1, seed=0, **extra):
    """A random checkpoint of `family` as transformers writes one: config.json, the tensors in `dtype` in `shards`
    files (with model.safetensors.index.json past one). Norm weights near 1 and biases away from 0, so a mapping
    that dropped one would show. Returns (config, {name: the float32 values written})."""
    conf = {**SHAPE, **FAMILIES[family], **extra}
    rng, tensors = np.random.default_rng(seed), {}
    for name, shape in shapes(conf).items():
        norm = name.endswith("norm.weight")
        tensors[name] = (
            (1.0 if norm else 0.0) + rng.normal(0, 0.1 if norm else 0.2, shape)
        ).astype(DTYPES[dtype])
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    files = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for k, members in enumerate(files):
        file = (
            "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        )
        safetensors.numpy.save_file(
            {n: tensors[n] for n in members}, os.path.join(folder, file), metadata={"format": "pt"}
        )
        weight_map.update({n: file for n in members})
    if shards > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    return conf, {k: v.astype(np.float32) for k, v in tensors.items()}


def reference_logits(conf, t, ids):
    """transformers' forward of Llama / Qwen2 / Qwen3 written out in numpy (float64): rotate-half RoPE with the
    llama3 frequency rule, q/k/v biases, per-head q/k RMSNorm before RoPE, repeat_kv, causal softmax, SwiGLU."""
    D, H, G, eps = (
        conf["hidden_size"],
        conf["num_attention_heads"],
        conf["num_key_value_heads"],
        conf["rms_norm_eps"],
    )
    K, (B, L) = conf.get("head_dim") or D // H, ids.shape
    w = {k: v.astype(np.float64) for k, v in t.items()}
    rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g
    inv = 1.0 / conf["rope_theta"] ** (np.arange(0, K, 2) / K)
    if (s := conf.get("rope_scaling")) and s["rope_type"] == "llama3":
        old, lo, hi, factor = (
            s["original_max_position_embeddings"],
            s["low_freq_factor"],
            s["high_freq_factor"],
            s["factor"],
        )
        new = []
        for f in inv:
            wavelength = 2 * np.pi / f
            if wavelength < old / hi:
                new.append(f)
            elif wavelength > old / lo:
                new.append(f / factor)
            else:
                smooth = (old / wavelength - lo) / (hi - lo)
                new.append((1 - smooth) * f / factor + smooth * f)
        inv = np.array(new)
    angles = np.arange(L)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    rotate = lambda x: (
        x * cos[:, None] + np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], -1) * sin[:, None]
    )
    x = w["model.embed_tokens.weight"][ids]
    for i in range(conf["num_hidden_layers"]):
        p = lambda n, i=i: w[f"model.layers.{i}.{n}"]
        h = rms(x, p("input_layernorm.weight"))
        proj = lambda n, heads, h=h, p=p: (
            h @ p(f"self_attn.{n}_proj.weight").T
            + (p(f"self_attn.{n}_proj.bias") if conf["model_type"] == "qwen2" else 0)
        ).reshape(B, L, heads, K)
        q, k, v = proj("q", H), proj("k", G), proj("v", G)
        if conf["model_type"] == "qwen3":
            q, k = rms(q, p("self_attn.q_norm.weight")), rms(k, p("self_attn.k_norm.weight"))
        q, k = rotate(q), rotate(k)
        k, v = (
            np.repeat(k, H // G, axis=2),
            np.repeat(v, H // G, axis=2),
        )  # head h reads kv head h // (H / G)
        s = np.einsum("blhk,bthk->bhlt", q, k) / np.sqrt(K) + np.triu(np.full((L, L), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("bhlt,bthk->blhk", a / a.sum(-1, keepdims=True), v).reshape(B, L, H * K)
        x = x + o @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        gate = h @ p("mlp.gate_proj.weight").T
        x = (
            x
            + (gate / (1 + np.exp(-gate)) * (h @ p("mlp.up_proj.weight").T))
            @ p("mlp.down_proj.weight").T
        )
    head = w["model.embed_tokens.weight"] if conf["tie_word_embeddings"] else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


def loaded(tmp_path, folder, *keys):
    """(cfg, params) as a run makes them from load_hf=folder: the keys from its config.json, the tensors placed."""
    cfg = config(tmp_path, f"load_hf={folder}", *TINY, "dataset=synthetic", *keys)
    cfg = train.resolve(train.pretrained(cfg), model_lib.TASKS["lm"], "cpu")
    mesh = train.make_mesh(cfg, jax.devices()[:2])
    layout = train.state_layout(cfg, model_lib.TASKS["lm"], mesh, train.make_optimizer(cfg)[0], 2)
    with jax.set_mesh(mesh):
        return cfg, model_lib.load_hf(cfg, str(folder), layout.abstract["params"])


def forward(cfg, params, ids):
    graph = model_lib.abstract(cfg)[0]
    return np.asarray(
        nnx.merge(graph, params)(
            ids, np.broadcast_to(np.arange(ids.shape[1]), ids.shape), np.ones_like(ids)
        )
    )


@pytest.mark.parametrize(
    "family,dtype,shards,scan",
    [("llama3", "bf16", 3, "true"), ("qwen2", "f16", 1, "false"), ("qwen3", "f32", 2, "true")],
)
def test_each_family_loads_and_gives_transformers_logits(tmp_path, family, dtype, shards, scan):
    """A checkpoint of each family, sharded or not, in bf16 / f16 / f32: its config.json sets every model key, the
    weights are placed over 2 devices (fsdp), and our logits equal the numpy reference's to float32 rounding. Then
    the export (the family its options make, over the source config) reads back to the same parameters."""
    conf, tensors = write_checkpoint(tmp_path / "hf", family, dtype, shards)
    cfg, params = loaded(tmp_path, tmp_path / "hf", f"scan_layers={scan}")
    assert (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (64, 4, 2, 96)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings) == (
        family == "qwen2",
        family == "qwen3",
        conf["tie_word_embeddings"],
    )
    assert cfg.rope_scaling.type == ("llama3" if family == "llama3" else "none") and model_lib.dims(
        cfg
    ) == (32 if family == "qwen3" else 16)
    ids = np.random.default_rng(1).integers(0, 96, (2, 40)).astype(np.int32)
    want = reference_logits(conf, tensors, ids)
    got = forward(cfg, params, ids)
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max(), np.abs(got - want).max()
    out = tmp_path / "export"
    written = model_lib.save_hf(cfg, jax.tree.map(np.asarray, params), str(out), source=conf)
    assert set(written) == set(tensors)
    back = json.loads((out / "config.json").read_text())
    assert back["architectures"] == conf["architectures"] and back.get("rope_scaling") == conf.get(
        "rope_scaling"
    )
    assert (
        back["max_position_embeddings"] == 128
        and back["tie_word_embeddings"] == conf["tie_word_embeddings"]
    )
    _, again = loaded(tmp_path, out, f"scan_layers={scan}")
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, again
    )


def test_config_json_sets_the_keys_and_refuses_what_it_cannot_run(tmp_path):
    """What the checkpoint decides cannot be contradicted (one line, both values); what this Transformer cannot run
    is one line naming it; damaged or hostile files are errors, not allocations."""
    folder = tmp_path / "hf"
    write_checkpoint(folder, "qwen2")
    with pytest.raises(
        train.ConfigError,
        match=r"^load_hf=.*: its config.json has hidden_size=64 but d_model=32 is "
        r"set; drop d_model= \(the checkpoint decides it\)$",
    ):
        train.pretrained(config(tmp_path, f"load_hf={folder}", "d_model=32"))
    with pytest.raises(train.ConfigError, match="qkv_bias=True but qkv_bias=False is set"):
        train.pretrained(config(tmp_path, f"load_hf={folder}", "qkv_bias=false"))
    refused = {
        "architectures": (
            ["MistralForCausalLM"],
            "architecture MistralForCausalLM is not one this trainer runs",
        ),
        "use_sliding_window": (True, "Qwen2ForCausalLM with sliding-window attention"),
        "rope_scaling": ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling of type 'yarn'"),
        "hidden_act": ("gelu", "hidden_act='gelu'"),
    }
    for key, (value, says) in refused.items():
        conf = {**SHAPE, **FAMILIES["qwen2"], key: value}
        with pytest.raises(ValueError, match=says):
            model_lib.hf_keys(conf)
    with pytest.raises(ValueError, match="LlamaForCausalLM with attention_bias=true"):
        model_lib.hf_keys({**SHAPE, **FAMILIES["llama3"], "attention_bias": True})
    with pytest.raises(ValueError, match="config.json has no rope_scaling.factor"):
        model_lib.hf_keys({**SHAPE, **FAMILIES["llama3"], "rope_scaling": {"rope_type": "llama3"}})
    # transformers 5 nests the RoPE settings in rope_parameters
    nested = {
        **SHAPE,
        **FAMILIES["llama3"],
        "rope_scaling": None,
        "rope_theta": None,
        "rope_parameters": {**FAMILIES["llama3"]["rope_scaling"], "rope_theta": 5e5},
    }
    assert model_lib.hf_keys(nested) == model_lib.hf_keys({**SHAPE, **FAMILIES["llama3"]})
    # A tensor missing, a header claiming more than the file, a dtype not read: each one line naming the file.
    cfg, _params = loaded(tmp_path, folder)
    layout = lambda cfg: train.state_layout(
        cfg,
        model_lib.TASKS["lm"],
        train.make_mesh(cfg, jax.devices()[:1]),
        train.make_optimizer(cfg)[0],
        1,
    ).abstract["params"]
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    safetensors.numpy.save_file(
        {k: v for k, v in tensors.items() if "v_proj.bias" not in k}, folder / "model.safetensors"
    )
    with pytest.raises(DATA.DataError, match="has no tensor model.layers.0.self_attn.v_proj.bias"):
        model_lib.load_hf(cfg, str(folder), layout(cfg))
    (folder / "model.safetensors").write_bytes((40 * 2**30).to_bytes(8, "little") + b"{}")
    with pytest.raises(
        DATA.DataError, match=r"damaged \(.*its header claims 42,949,672,960 bytes of 10\)"
    ):
        model_lib.load_hf(cfg, str(folder), layout(cfg))
    safetensors.numpy.save_file(
        {"model.norm.weight": np.zeros(64, np.int8)}, folder / "model.safetensors"
    )
    with pytest.raises(
        DATA.DataError, match="tensor model.norm.weight is I8; load_hf reads BF16, F16 and F32"
    ):
        model_lib.load_hf(cfg, str(folder), layout(cfg))


# ---- tokenizers -----------------------------------------------------------------------------------------------
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder, bos=False, template=CHATML, vocab=300):
    """A byte-level BPE tokenizer.json trained here (as Qwen's and Llama 3's are built), with the chat model's
    special tokens: eos <|im_end|> (tokenizer_config.json), generation also stopping at <|endoftext|>
    (generation_config.json); with bos, a post-processor that prepends <|endoftext|> as Llama 3's prepends its bos."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "Question: what is the capital of France?\nAnswer: Paris",
        "def main(argv): return argv[0]",
    ] * 20
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
    os.makedirs(folder, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "bos_token": "<|endoftext|>" if bos else None,
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tok


def test_tokenizer_json_with_its_special_tokens_and_template(tmp_path):
    """tokenizer.json through `tokenizers`: its size, eos from tokenizer_config.json, every stop id of
    generation_config.json, bos only where the checkpoint's tokenizer prepends one, the chat template; a damaged
    file or an eos that is not a token is one line."""
    base = tmp_path / "hf"
    ref = write_tokenizer(base, vocab=300)  # more tokens than the model's vocab_size below
    with pytest.raises(
        DATA.DataError,
        match=r"vocab_size=96 but tokenizer .* has \d+ tokens: set vocab_size=\d+ or more",
    ):
        DATA.load_tokenizer(str(base), config(tmp_path, "vocab_size=96"))
    tok = DATA.load_tokenizer(str(base / "tokenizer.json"), config(tmp_path, "vocab_size=300"))
    assert (tok.eos_id, tok.stop_ids, tok.bos_id, tok.chat_template) == (2, (2, 0), None, CHATML)
    assert tok.size == ref.get_vocab_size() and tok.primary == "tokenizer.json"
    text = "Question: what is the capital of France?"
    assert (
        tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
        and tok.decode(tok.encode(text)) == text
    )
    assert (
        tok.encode("<|im_start|>user")[0] == 1
    )  # special tokens in text are the tokens, as transformers reads them
    write_tokenizer(tmp_path / "bos", bos=True, vocab=300)
    assert (
        DATA.load_tokenizer(str(tmp_path / "bos"), config(tmp_path, "vocab_size=300")).bos_id == 0
    )
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(
        DATA.DataError, match=r"tokenizer_config.json: eos_token '<\|nope\|>' is not a token"
    ):
        DATA.load_tokenizer(str(base), config(tmp_path, "vocab_size=300"))
    (base / "tokenizer.json").write_text('{"broken"')
    with pytest.raises(DATA.DataError, match="tokenizer.json: not a Hugging Face tokenizer"):
        DATA.load_tokenizer(str(base), config(tmp_path, "vocab_size=300"))


# ---- supervised fine-tuning ------------------------------------------------------------------------------------
def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def sft(tmp_path, folder, files, *keys):
    """The config of an SFT run from the checkpoint in `folder` on jsonl `files` (dataset=hf, the json builder)."""
    return config(
        tmp_path,
        f"load_hf={folder}",
        "dataset=hf",
        "hf_path=json",
        f"hf_data_files={files}",
        *TINY,
        *keys,
    )


def qa_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"prompt": f"Question: what is {a} + {b}?\nAnswer: ", "completion": str(a + b)}
        for a, b in rng.integers(0, 50, (n, 2))
    ]


def test_sft_loss_is_the_mean_over_answer_tokens_and_packing_changes_nothing(tmp_path, qwen):
    """An SFT batch's loss (the trainer's loss summed, divided by its weight) equals the mean cross-entropy over the
    answer tokens (completion + eos) computed here from each example alone, tokenized independently; packed rows
    and one example per row give the same loss over the same examples; completion_only=false counts every token."""
    rows = qa_rows(320)
    files = write_rows(tmp_path / "qa.jsonl", rows)
    cfg, params = loaded(tmp_path, qwen)
    tok = DATA.load_tokenizer(str(qwen), cfg)
    graph = model_lib.abstract(cfg)[0]
    sums = {}
    for packing in ("true", "false"):
        ds = DATA.make_dataset(
            sft(tmp_path, qwen, files, f"packing={packing}", "per_device_batch=4")
        )
        batches = ds.eval_batches(4, 4)  # the held-out examples (every 32nd row: 10), then padding
        outs = [model_lib.lm_eval_step(cfg, graph, params, b) for b in batches]
        sums[packing] = (sum(float(o["loss"]) for o in outs), sum(float(o["tokens"]) for o in outs))
    assert sums["true"][1] == sums["false"][1] and sums["true"][0] == pytest.approx(
        sums["false"][0], rel=1e-5
    )
    ds = DATA.make_dataset(sft(tmp_path, qwen, files, "per_device_batch=4"))
    batch = next(ds.train_iter(4))
    got = model_lib.lm_loss(cfg, graph, params, batch)
    loss, weight = float(got[0]), float(got[1]["weight"])
    want, n = 0.0, 0
    for r in range(4):
        for s in range(1, batch["segment_ids"][r].max() + 1):  # each example of the row, alone
            at = np.flatnonzero(batch["segment_ids"][r] == s)
            ids = np.append(batch["inputs"][r, at], batch["targets"][r, at[-1]])
            row = next(x for x in rows if x["prompt"] + x["completion"] == tok.decode(ids.tolist()))
            # the targets that count: from where the whole text's tokens leave the prompt's own,
            # through eos (trl's rule: prompt and completion tokenized as one text)
            whole, alone = tok.encode(row["prompt"] + row["completion"]), tok.encode(row["prompt"])
            start = next((k for k, (a, b) in enumerate(zip(whole, alone)) if a != b), len(alone))
            answer = len(whole) + 1 - start
            assert ids[-1] == tok.eos_id
            logits = forward(cfg, params, ids[None, :-1])[0].astype(np.float64)
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            want -= sum(logp[t, ids[t + 1]] for t in range(len(ids) - 1 - answer, len(ids) - 1))
            n += answer
    assert weight == n and loss / weight == pytest.approx(want / n, abs=1e-5)
    every = DATA.make_dataset(
        sft(tmp_path, qwen, files, "per_device_batch=4", "completion_only=false")
    )
    first = next(every.train_iter(4))
    assert first["loss_mask"].sum() == (first["segment_ids"] > 0).sum()


def test_chat_messages_mark_the_assistant_turns_and_bad_rows_are_one_line(tmp_path, qwen):
    """messages rows go through the checkpoint's chat template; the answer tokens are exactly each assistant turn's
    content and its end-of-turn (the model learns to stop), never the user's. A row without an answer, a template
    that fails, a missing column: one line naming the row."""
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome"},
    ]
    files = write_rows(tmp_path / "chat.jsonl", [{"messages": turns}] * 40)
    ds = DATA.make_dataset(
        sft(tmp_path, qwen, files, "per_device_batch=2", "max_target_length=128")
    )
    tok = ds.tokenizer
    ids, answer = ds.train_tokens[0]
    whole = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)
    assert ids.tolist() == tok.encode(whole)
    marked = [tok.encode(text) for text in ("Paris<|im_end|>\n", "Rome<|im_end|>\n")]
    assert ids[answer].tolist() == marked[0] + marked[1]
    prompt, reference = ds.eval_examples[
        0
    ]  # the last answer, its prompt ending in the generation prompt
    assert (
        tok.decode(prompt.tolist()).endswith("And of Italy?\nassistant\n") and reference == "Rome"
    )
    bad = {
        "no answer": ({"messages": turns[:2]}, r"row 3: no assistant turn to learn from"),
        "no column": (
            {"text_only": "x"},
            (
                r"row 3: an SFT row holds messages, or prompt and completion \(this one "
                r"has \['text_only'\]\)"
            ),
        ),
        "empty": ({"messages": turns[:2] + [{"role": "assistant", "content": ""}]}, None),
    }
    for name, (row, says) in bad.items():
        files = write_rows(tmp_path / f"{name}.jsonl", [{"messages": turns}] * 3 + [row])
        if (
            says is None
        ):  # ChatML still writes the end of turn: an empty answer that teaches to stop is allowed
            DATA.make_dataset(sft(tmp_path, qwen, files, "max_target_length=128"))
            continue
        with pytest.raises(DATA.DataError, match=says):
            DATA.make_dataset(sft(tmp_path, qwen, files, "max_target_length=128"))
    raising = "{{ raise_exception('only user and assistant roles') }}"
    write_tokenizer(qwen, template=raising)
    with pytest.raises(
        DATA.DataError, match=r"row \d+: the chat template failed \(TemplateError: only user and "
    ):
        DATA.make_dataset(sft(tmp_path, qwen, tmp_path / "chat.jsonl", "max_target_length=128"))


def test_epochs_read_every_example_exactly_so_often_and_resume_exactly(tmp_path, qwen, capsys):
    """epochs=2: steps from the data's size; every training example appears in exactly 2 rows over them, the rest of
    the rows are padding; an example longer than a row is skipped and counted; a lane's state resumes exactly."""
    rows = qa_rows(40) + [{"prompt": "x " * 200, "completion": "too long"}]
    files = write_rows(tmp_path / "qa.jsonl", rows)
    ds = DATA.make_dataset(
        sft(tmp_path, qwen, files, "epochs=2", "per_device_batch=2", "grad_accum=2"), log=print
    )
    assert (
        "skipped 1 of 39 examples of hf_split=train longer than max_target_length=64 tokens"
        in capsys.readouterr().out
    )
    steps = ds.epoch_steps(2, 2, 2)
    it, seen = ds.train_iter(2), []
    batches = [next(it) for _ in range(steps * 2)]
    for b in batches:
        for r in range(2):
            for s in range(1, b["segment_ids"][r].max() + 1):
                seen.append(tuple(b["inputs"][r][b["segment_ids"][r] == s]))
    counts = {}
    for example in seen:
        counts[example] = counts.get(example, 0) + 1
    assert sorted(counts.values()) == [2] * len(ds.train_ids) and len(ds.train_ids) == 38
    assert next(it)["segment_ids"].max() == 0  # past the last example: padding
    state = ds.train_iter(2)
    for _ in range(3):
        next(state)
    again = ds.train_iter(2, state={"lanes": state.state(), "source": ds.identity})
    for want in batches[3:6]:
        np.testing.assert_array_equal(next(again)["inputs"], want["inputs"])


def test_left_padded_prompts_generate_what_each_gives_alone(tmp_path, qwen):
    """Prompts of several lengths in one batch, padded on the left, give the same greedy tokens as each alone."""
    cfg, params = loaded(tmp_path, qwen, "temperature=0", "max_new_tokens=6")
    graph = model_lib.abstract(cfg)[0]
    prompts = [[5, 9, 13, 20, 31, 7, 3], [44, 2, 71], [8]]
    batch, real = np.zeros((3, 7), np.int32), np.zeros((3, 7), np.int32)
    for b, p in enumerate(prompts):
        batch[b, 7 - len(p) :], real[b, 7 - len(p) :] = p, 1
    together = np.asarray(model_lib.generate(cfg, graph, params, batch, jax.random.key(0), real))
    for b, p in enumerate(prompts):
        alone = np.asarray(
            model_lib.generate(cfg, graph, params, np.asarray([p], np.int32), jax.random.key(0))
        )
        np.testing.assert_array_equal(together[b], alone[0])


@pytest.mark.slow
def test_sft_run_answers_exports_and_the_export_loads(tmp_path, qwen):
    """From the command line's run(): SFT on chat rows from the Qwen2 checkpoint; mode=eval scores held-out answers
    by exact match into answers.jsonl; mode=export writes Qwen2 with its tokenizer, template and stop ids; the
    export loads back as load_hf to the run's parameters."""
    turns = lambda a, b: [
        {"role": "user", "content": f"{a} plus {b}?"},
        {"role": "assistant", "content": str(a + b)},
    ]
    files = write_rows(
        tmp_path / "chat.jsonl", [{"messages": turns(a, b)} for a in range(9) for b in range(9)]
    )
    keys = [
        "per_device_batch=2",
        "run_name=sft",
        "checkpoint_every=0",
        "eval_batches=1",
        "learning_rate=1e-2",
    ]
    run = lambda *more: train.run(sft(tmp_path, qwen, files, *keys, *more), jax.devices()[:2])
    out = run("epochs=1")
    assert out["step"] == train.data.make_dataset(sft(tmp_path, qwen, files, *keys)).epoch_steps(
        4, 1, 1
    )
    result = run("mode=eval", "eval_answers=3", "max_new_tokens=4")
    answers = [
        json.loads(line) for line in (tmp_path / "sft" / "answers.jsonl").read_text().splitlines()
    ]
    assert len(answers) == result["answered"] == 3 and 0 <= result["exact_match"] <= 1
    assert result["exact_match"] == np.mean(
        [a["answer"].strip() == a["reference"] for a in answers]
    )
    assert [a["reference"] for a in answers] == [
        str(a + b) for a, b in [(0, 0), (3, 5), (7, 1)]
    ]  # rows 0, 32, 64
    run("mode=export", f"export_dir={tmp_path}/out")
    exported = sorted(os.listdir(tmp_path / "out"))
    assert exported == [
        ".exported.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen2ForCausalLM"] and conf["eos_token_id"] == [2, 0]
    assert (
        json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"]
        == CHATML
    )
    _, params = loaded(tmp_path, tmp_path / "out")
    trained = read_checkpoint(tmp_path / "sft", out["step"])["train_state"]["params"]
    by_path = lambda tree: {
        tuple(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    mine, theirs = (
        by_path(params),
        by_path(trained),
    )  # orbax names the layer list's entries '0', '1'
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
def test_a_hub_id_loads_from_the_hub_cache_offline(tmp_path):
    """load_hf=org/name fetches through huggingface_hub into its cache; offline (HF_HUB_OFFLINE=1) a cached model
    loads and generates, an uncached one is one line and exit 2."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen" / "snapshots" / ("0" * 40)
    write_checkpoint(snapshot, "qwen2", vocab_size=320)
    write_tokenizer(snapshot)
    (cache / "models--tiny-org--tiny-qwen" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen" / "refs" / "main").write_text("0" * 40)
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "home"),
    }
    common = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        BASE,
        f"output_dir={tmp_path}",
        *TINY,
        f"cache_dir={tmp_path}/cache",
        "dataset=synthetic",
        "mode=generate",
        "prompt=Question:",
        "temperature=0",
        "max_new_tokens=4",
        "mesh=1,1,1",
    ]
    done = subprocess.run(
        common + ["load_hf=tiny-org/tiny-qwen"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "loaded Hugging Face checkpoint tiny-org/tiny-qwen" in done.stdout
        and "continuation:" in done.stdout
    )
    done = subprocess.run(
        common + ["load_hf=tiny-org/not-cached"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        "error: load_hf=tiny-org/not-cached: no such directory, and the Hugging Face hub "
        "did not give that model ("
    )


# ---- fine-tuning where users step -----------------------------------------------------------------------------
def lm_batch(cfg, rows=2, length=16, seed=0):
    """One step's batch [1 microbatch, rows, length] of random tokens, every target counting."""
    ids = (
        np.random.default_rng(seed)
        .integers(0, cfg.vocab_size, (1, rows, length + 1))
        .astype(np.int32)
    )
    ones = np.ones((1, rows, length), np.int32)
    return {
        "inputs": ids[..., :-1],
        "targets": ids[..., 1:],
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32), ones.shape).copy(),
        "segment_ids": ones,
        "loss_mask": ones.astype(np.float32),
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
@pytest.mark.slow
def test_every_family_tied_or_not_trains_evaluates_generates_and_exports_in_each_dtype(
    tmp_path, family, dtype
):
    """Each family, its embeddings tied and untied, in bfloat16 (what dtype=auto picks on CPUs with bf16
    instructions) and float32: two train steps (finite, the second loss below the first), an eval step, a
    generation, and an export that reads back to the trained parameters. Before: a tied model in bfloat16 crashed
    at its first step (UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32, XLA:CPU's
    backward dot of the embedding's transpose)."""
    task = model_lib.TASKS["lm"]
    for tied in (True, False):
        folder = tmp_path / f"hf-{tied}"
        conf, _ = write_checkpoint(folder, family, tie_word_embeddings=tied)
        keys = [f"dtype={dtype}", "learning_rate=1e-2", "warmup_steps=0", "max_new_tokens=3"]
        cfg, params = loaded(tmp_path, folder, *keys)
        assert cfg.tie_embeddings is tied and cfg.dtype == dtype
        graph, tx = model_lib.abstract(cfg)[0], train.make_optimizer(cfg)[0]
        mesh = train.make_mesh(cfg, jax.devices()[:2])
        layout = train.state_layout(cfg, task, mesh, tx, 2)
        batch, losses = lm_batch(cfg), []
        with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
            state = train.init_state(cfg, layout, params)
            step = jax.jit(train.make_train_step(cfg, task, graph, tx))
            for _ in range(2):
                state, out = step(state, batch)
                losses.append(float(out["loss"]))
            evaluate = functools.partial(model_lib.lm_eval_step, cfg, graph)
            evaluated = jax.jit(evaluate)(state["params"], {k: v[0] for k, v in batch.items()})
        assert np.isfinite(losses).all() and losses[1] < losses[0], (tied, losses)
        assert np.isfinite(float(evaluated["loss"])) and float(evaluated["tokens"]) == 32
        tokens = model_lib.generate(
            cfg, graph, state["params"], batch["inputs"][0], jax.random.key(0)
        )
        assert (
            tokens.shape == (2, 3) and 0 <= int(tokens.min()) and int(tokens.max()) < cfg.vocab_size
        )
        trained = jax.tree.map(np.asarray, state["params"])
        model_lib.save_hf(cfg, trained, str(tmp_path / f"out-{tied}"), source=conf)
        _, back = loaded(tmp_path, tmp_path / f"out-{tied}", *keys)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), trained, back)


def test_prompt_completion_rows_tokenize_as_one_text_as_trl_does(tmp_path, qwen):
    """trl's rule for prompt + completion rows: bos, the two as one text, eos; the answer starts where those tokens
    leave the prompt's own. A prompt ending in a space gives the space to the answer's first token ('ĠPar'), the
    sequence the model sees at inference. Before: the two were tokenized apart ('Ġ' | 'Par' 'is')."""
    prompt = "Question: what is the capital of France?\nAnswer: "
    files = write_rows(tmp_path / "qa.jsonl", [{"prompt": prompt, "completion": "Paris"}] * 40)
    ds = DATA.make_dataset(sft(tmp_path, qwen, files, "per_device_batch=2"))
    tok, (ids, answer) = ds.tokenizer, ds.train_tokens[0]
    whole, alone = tok.encode(prompt + "Paris"), tok.encode(prompt)
    start = next(k for k, (a, b) in enumerate(zip(whole, alone)) if a != b)
    assert ids.tolist() == whole + [tok.eos_id] and start == len(alone) - 1  # the space moved over
    assert answer.tolist() == [False] * start + [True] * (len(whole) + 1 - start)
    assert tok.decode(ids[answer].tolist()) == " Paris"
    assert ds.eval_examples[0][1] == " Paris"  # the reference answer, scored after strip()


def test_sft_eval_scores_every_held_out_row_unless_told_and_says_how_many(tmp_path, qwen, capsys):
    """Held-out rows from their own file (hf_eval_files): every one of them scored by default, in training's eval
    and in mode=eval, each eval saying how many rows and answer tokens it scored of how many; eval_batches=4 scores
    4 batches, and says it (8 of 40 rows here). Before: eval_batches=4 scored 8 of 40 rows without a word."""
    files = write_rows(tmp_path / "train.jsonl", qa_rows(64))
    held = write_rows(tmp_path / "held.jsonl", qa_rows(40, seed=1))
    keys = ["per_device_batch=2", "packing=false", f"hf_eval_files={held}", "steps=1"]
    unset = [o for o in PRESET if not o.startswith("eval_batches=")]  # base.yml's, not set
    cfg = lambda *more: lm_config(
        tmp_path,
        f"load_hf={qwen}",
        "dataset=hf",
        "hf_path=json",
        f"hf_data_files={files}",
        *TINY,
        *keys,
        *more,
        preset=unset,
    )
    run = lambda *more: train.run(cfg(*more), jax.devices()[:1])
    out = run("eval_every=1")
    assert (out["eval_rows"], out["eval_rows_of"]) == (40, 40)
    assert out["eval_tokens"] == out["eval_tokens_of"] > 40
    assert (
        f"on 40/40 rows ({out['eval_tokens']:.0f}/{out['eval_tokens']:.0f} tokens)"
        in capsys.readouterr().out
    )
    every = run("mode=eval")
    some = run("mode=eval", "eval_batches=4")
    assert (every["rows"], some["rows"], some["rows_of"]) == (40, 8, 40)
    assert some["tokens"] < some["tokens_of"] == every["tokens"] and some["loss"] != every["loss"]
    ds = DATA.make_dataset(sft(tmp_path, qwen, files, *keys))
    assert len(ds.train_ids) == 64 and len(ds.eval_examples) == 40  # no row of train.jsonl held out
    want = sorted(row["completion"] for row in qa_rows(40, seed=1))
    assert sorted(answer.strip() for _, answer in ds.eval_examples) == want
    both = sft(tmp_path, qwen, files, *keys, "hf_eval_split=test")
    with pytest.raises(
        train.ConfigError, match="hf_eval_files=.* and hf_eval_split=test both name"
    ):
        train.check(both, model_lib.TASKS["lm"])
    with pytest.raises(DATA.DataError, match=r"hf_eval_files=.*nope.jsonl: no such file"):
        train.check(
            sft(tmp_path, qwen, files, f"hf_eval_files={tmp_path}/nope.jsonl"), model_lib.LM
        )


def test_generate_renders_the_prompt_as_the_model_was_fine_tuned(tmp_path, qwen):
    """mode=generate on a checkpoint whose tokenizer has a chat template: prompt= is one user turn with the
    generation prompt, messages (from a YAML file) a whole conversation; chat_template=false keeps the raw text.
    Before: the raw text only, out of the fine-tuned distribution."""
    mine = tmp_path / "chat.yml"
    mine.write_text(
        "messages:\n  - {role: system, content: Be brief.}\n  - {role: user, content: Hi}\n"
    )

    _, params = loaded(tmp_path, qwen)

    def generated(*keys, files=()):
        more = args(tmp_path, f"load_hf={qwen}", *TINY, "dataset=synthetic", *keys, preset=PRESET)
        cfg = train.load_config([BASE, *map(str, files)], more)
        cfg = train.resolve(train.pretrained(cfg), model_lib.LM, "cpu")
        graph = model_lib.abstract(cfg)[0]
        return model_lib.lm_generate(cfg, graph, params, DATA.make_dataset(cfg), 1)[0]

    common = ["mode=generate", "prompt=Capital of France?", "temperature=0", "max_new_tokens=2"]
    assert generated(*common)["prompt"] == (
        "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert generated(*common, "chat_template=false")["prompt"] == "Capital of France?"
    assert generated(*common[:1], *common[2:], files=[mine])["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


# A template that renders an assistant turn otherwise once a user turn follows it, as Qwen3's does: the turns after
# the last user turn get an empty reasoning block, the earlier ones lose theirs.
REASONING = (
    "{%- set ns = namespace(last=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last -%}{{ '<think>\\n\\n</think>\\n\\n' + m.content }}"
    "{%- elif m.role == 'assistant' -%}{{ m.content.split('</think>')[-1] }}"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# ChatML marking its answers itself, as trl's training templates do ({% generation %}), here from the newline
# after the role on (what a plain prefix reading would not give).
MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_multi_turn_rows_are_marked_where_the_whole_conversation_renders_each_answer(
    tmp_path, qwen
):
    """Each assistant turn is marked where the whole conversation renders it, through its end-of-turn: under a
    template that drops an earlier turn's reasoning once a user turn follows (as Qwen3's), the earlier answer is its
    content as rendered there and the last one its reasoning block too; under one with {% generation %} blocks,
    what they render. Before: such rows were refused ('renders turn 1 differently')."""
    turns = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "<think>It is Paris.</think>Paris"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome"},
    ]
    files = write_rows(tmp_path / "chat.jsonl", [{"messages": turns}] * 40)
    for template, answers in (
        (REASONING, ["Paris<|im_end|>\n", "<think>\n\n</think>\n\nRome<|im_end|>\n"]),
        (MARKED, ["\n<think>It is Paris.</think>Paris<|im_end|>\n", "\nRome<|im_end|>\n"]),
    ):
        write_tokenizer(qwen, template=template)
        ds = DATA.make_dataset(sft(tmp_path, qwen, files, "max_target_length=128"))
        tok, (ids, answer) = ds.tokenizer, ds.train_tokens[0]
        assert ids.tolist() == tok.encode(tok.render(turns, False))
        assert ids[answer].tolist() == tok.encode(answers[0]) + tok.encode(answers[1]), template
        assert ds.eval_examples[0][1] == answers[1].split("<|im_end|>")[0]  # cut at the stop token


DATED = (
    "{{ '<|im_start|>system\\nToday is ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}" + CHATML
)


def test_a_template_that_reads_the_date_renders_the_run_s_day_on_resume(tmp_path, qwen):
    """strftime_now renders chat_date, fixed once per run: its first day, kept in RUN_DIR/config.yml, read back by a
    resume (here: as if the first run had been on 6 May 2020), so its rows, lengths and packing stay the run's.
    Before: the day the process ran."""
    say = DATA.chat_renderer(DATED, {}, "2026-01-02", "here")(
        [{"role": "user", "content": "Hi"}], False
    )
    assert say.startswith("<|im_start|>system\nToday is 02 Jan 2026<|im_end|>\n")
    write_tokenizer(qwen, template=DATED)
    files = write_rows(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                ]
            }
        ]
        * 40,
    )
    cfg = sft(tmp_path, qwen, files, "steps=1", "max_target_length=128", "learning_rate=1e-3")
    train.run(cfg, jax.devices()[:1])
    kept = tmp_path / "default" / "config.yml"
    assert yaml.safe_load(kept.read_text())["chat_date"] == time.strftime("%Y-%m-%d")
    kept.write_text(
        kept.read_text().replace(
            f"chat_date: '{time.strftime('%Y-%m-%d')}'", "chat_date: '2020-05-06'"
        )
    )
    resumed = train.as_run(cfg, model_lib.LM, jax.devices()[:1])[0]
    prompt = DATA.make_dataset(resumed).eval_examples[0][0]
    assert resumed.chat_date == "2020-05-06" and "Today is 06 May 2020" in resumed_text(
        resumed, prompt
    )
    afresh = train.as_run(
        sft(tmp_path, qwen, files, "resume=false"), model_lib.LM, jax.devices()[:1]
    )[0]
    assert afresh.chat_date == time.strftime("%Y-%m-%d")


def resumed_text(cfg, ids):
    return DATA.load_tokenizer(DATA.tokenizer_source(cfg), cfg).decode(ids.tolist())


def test_a_load_hf_run_at_the_pretraining_rate_says_so_once(tmp_path, qwen, capsys):
    """base.yml's learning rate is a pretraining recipe; a load_hf run that keeps it says so in one warning line
    with the rate the README's fine-tuning command uses; one that sets it says nothing."""
    files = write_rows(tmp_path / "qa.jsonl", qa_rows(40))
    train.as_run(sft(tmp_path, qwen, files), model_lib.LM, jax.devices()[:1])
    warned = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert (
        len(warned) == 1
        and "learning_rate=0.003" in warned[0]
        and "learning_rate=2e-5" in warned[0]
    )
    train.as_run(sft(tmp_path, qwen, files, "learning_rate=2e-5"), model_lib.LM, jax.devices()[:1])
    assert "WARNING" not in capsys.readouterr().out


def test_an_export_over_an_earlier_one_leaves_nothing_of_it(tmp_path, qwen, monkeypatch):
    """An export into a directory holding an earlier export of this trainer (here in shards, with an index) removes
    every file of it first, so load_hf of the directory reads the new model; a directory holding a checkpoint no
    export of ours wrote is refused, nothing removed; other files (a note) stay. Before: the old shards and index
    stayed beside the new model.safetensors, and load_hf read the old model."""
    cfg, params = loaded(tmp_path, qwen)
    old = jax.tree.map(np.asarray, params)
    out = tmp_path / "out"
    monkeypatch.setattr(model_lib, "SHARD_BYTES", 20_000)
    model_lib.save_hf(cfg, old, str(out))
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    (out / "NOTES.md").write_text("mine")
    monkeypatch.setattr(model_lib, "SHARD_BYTES", 5 * 2**30)
    new = jax.tree.map(lambda x: x + 1, old)
    model_lib.save_hf(cfg, new, str(out))
    assert sorted(os.listdir(out)) == [
        ".exported.json",
        "NOTES.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), new, loaded(tmp_path, out)[1]
    )
    before = {p.name: p.read_bytes() for p in qwen.iterdir()}
    with pytest.raises(
        ValueError, match=r"holds config.json, which no export of this trainer wrote"
    ):
        model_lib.save_hf(cfg, new, str(qwen))
    assert {p.name: p.read_bytes() for p in qwen.iterdir()} == before


GOOD = json.dumps({"prompt": "Question: 1 + 1?\nAnswer: ", "completion": "2"})


@pytest.mark.parametrize(
    "name,text,says",
    [
        (
            "bad.jsonl",
            f'{GOOD}\n{GOOD}\n{{"prompt": [}}\n{GOOD}\n',
            r"bad.jsonl:3: not JSON \(Expecting value at column 13\)$",
        ),
        (
            "twice.jsonl",
            f'{GOOD}\n{{"prompt": "a", "prompt": "b", "completion": "c"}}\n',
            r"twice.jsonl:2: key 'prompt' is set twice in one row; keep one$",
        ),
        (
            "rows.csv",
            "prompt,completion\nhello,world\n",
            r"rows.csv:1: not JSON \(Expecting value at column 1\); for this kind of file give hf_path=csv$",
        ),
        (
            "empty.jsonl",
            "",
            r"empty.jsonl: empty, no rows; remove it from the list, or give it rows$",
        ),
    ],
)
def test_json_rows_datasets_cannot_read_name_the_file_line_and_what_is_wrong(
    tmp_path, qwen, name, text, says
):
    """A malformed line, a key set twice, a CSV given to the json builder, an empty file: one line naming the file,
    the line and what is wrong. Before: 'DatasetGenerationError: An error occurred while generating the dataset'
    for the first three, 'StopIteration: ' for the last."""
    (tmp_path / name).write_text(text)
    with pytest.raises(DATA.DataError, match=r"^hf_data_files: .*" + says):
        DATA.make_dataset(sft(tmp_path, qwen, tmp_path / name))


def test_a_wrong_row_is_named_with_what_is_wrong_in_it(tmp_path, qwen):
    """A row whose turn holds a list or a number where the others hold text, or whose completion is a number: the
    error names that row and the field, with what it holds. Before: 'an SFT row holds messages, or prompt and
    completion (this one has ['completion', 'prompt'])' for a row that has both."""
    turn = lambda content: {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}]
    }
    for bad, says in (
        (turn([1, 2]), r"row 5: messages\[0\].content is a list \(\[1, 2\]\), expected text$"),
        (turn(7), r"row 5: messages\[0\].content is a number \(7\), expected text$"),
        (
            {"prompt": "p", "completion": 42},
            r"row 5: completion is a number \(42\), expected text \(or a list of turns\)$",
        ),
        ({"prompt": "p"}, r"row 5: completion is missing, expected text \(or a list of turns\)$"),
    ):
        first = turn("q") if "messages" in bad else {"prompt": "p", "completion": "c"}
        files = write_rows(tmp_path / "rows.jsonl", [first] * 5 + [bad] + [first] * 4)
        with pytest.raises(DATA.DataError, match=r"^hf_split=train: " + says):
            DATA.make_dataset(sft(tmp_path, qwen, files))


def test_a_template_that_does_not_compile_is_missing_or_never_ends_is_one_line(
    tmp_path, qwen, monkeypatch
):
    """A chat template that does not compile names its file and line; messages rows with a tokenizer that has no
    template say so; a template that renders a row for longer than data.ROW_SECONDS is stopped, naming the row.
    Before: a TemplateSyntaxError traceback, "'NoneType' object is not callable", and no bound at all (data
    preparation runs before the watchdog)."""
    files = write_rows(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                ]
            }
        ]
        * 40,
    )
    write_tokenizer(qwen, template="{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(
        DATA.DataError,
        match=r"qwen/tokenizer_config.json: the chat template does not compile \(line 1: Unexpected end of template",
    ):
        DATA.make_dataset(sft(tmp_path, qwen, files))
    write_tokenizer(qwen, template=None)
    with pytest.raises(
        DATA.DataError,
        match=r"row \d+: chat rows go through the tokenizer's chat template, and it has none",
    ):
        DATA.make_dataset(sft(tmp_path, qwen, files))
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    write_tokenizer(qwen, template=forever)
    monkeypatch.setattr(DATA, "ROW_SECONDS", 1)
    with pytest.raises(
        DATA.DataError,
        match=r"row \d+: took over 1s to render and tokenize \(a chat template that loops\?\)",
    ):
        DATA.make_dataset(sft(tmp_path, qwen, files))


def test_a_tokenizer_larger_than_the_checkpoint_advises_what_a_load_hf_run_takes(tmp_path):
    """A tokenizer with more tokens than the checkpoint's embedding rows: the advice names another tokenizer, not
    vocab_size=N, which the checkpoint decides. Before: 'set vocab_size=300 or more', refused by the next run."""
    folder = tmp_path / "hf"
    write_checkpoint(folder, "qwen2")  # 96 rows
    write_tokenizer(folder, vocab=300)
    cfg = train.pretrained(config(tmp_path, f"load_hf={folder}"))
    with pytest.raises(
        DATA.DataError,
        match=r"has \d+ tokens but load_hf=.* has 96 embedding rows \(its config.json vocab_size\): give the tokenizer that checkpoint was trained with",
    ):
        DATA.load_tokenizer(str(folder), cfg)


def test_data_copied_elsewhere_is_the_same_data_and_another_epochs_is_one_line(tmp_path, qwen):
    """The data's identity (what a checkpoint's position counts in) follows the files' contents: a copy in another
    place with a new modification time resumes where the run was, exactly; other contents are other data. A resume
    with another epochs is one line. Before: a copy restarted the data order; epochs=1 -> 2 read some examples
    once."""
    (tmp_path / "a").mkdir()
    first = write_rows(tmp_path / "a" / "qa.jsonl", qa_rows(40))
    copy = tmp_path / "b" / "qa.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    os.utime(copy, (time.time() + 3600, time.time() + 3600))
    ds, moved = (DATA.make_dataset(sft(tmp_path, qwen, f, "epochs=1")) for f in (first, copy))
    assert ds.identity == moved.identity
    it = ds.train_iter(2)
    for _ in range(3):
        next(it)
    state = {"lanes": it.state(), "source": ds.identity}
    np.testing.assert_array_equal(
        next(moved.train_iter(2, state=state))["inputs"], next(it)["inputs"]
    )
    copy.write_text(copy.read_text().replace('"completion": "', '"completion": " ', 1))
    assert DATA.make_dataset(sft(tmp_path, qwen, copy, "epochs=1")).identity != ds.identity
    more = DATA.make_dataset(sft(tmp_path, qwen, first, "epochs=2"))
    with pytest.raises(
        DATA.DataError,
        match=r"^epochs=2: this run's checkpoint planned its data for epochs=1, .*resume with epochs=1",
    ):
        more.train_iter(2, state=state)


def test_a_row_far_longer_than_any_row_is_skipped_without_being_tokenized(
    tmp_path, qwen, monkeypatch
):
    """A row whose text alone is longer than a row could hold (4 x max_target_length x the tokenizer's longest
    token, in bytes) is skipped and counted without being tokenized. Before: a 100 MB line took 5 minutes and 19
    GB of memory to tokenize (and aborted the process where memory ran out), only to be skipped."""
    rows = qa_rows(40)
    rows[7] = {"prompt": "x", "completion": "y" * 2_000_000}
    files = write_rows(tmp_path / "qa.jsonl", rows)
    read, real = [], DATA.hf_tokenizer
    spy = lambda tok: tok._replace(encode=lambda text: read.append(len(text)) or tok.encode(text))
    monkeypatch.setattr(DATA, "hf_tokenizer", lambda *a: spy(real(*a)))
    logged = []
    ds = DATA.make_dataset(sft(tmp_path, qwen, files), log=logged.append)
    assert len(ds.train_ids) + len(ds.eval_examples) == 39 and max(read) < 1000
    assert any("1 of them by their bytes alone, not tokenized" in line for line in logged), logged


def test_eval_answers_compile_the_generation_once_for_every_batch_of_prompts(tmp_path, qwen):
    """eval_answers answers 16 prompts a call: 40 prompts (three calls) lower the generation program as often as 16
    (one call) do. Before: a fresh jitted function per call, so 40 prompts compiled it three times."""
    files = write_rows(tmp_path / "train.jsonl", qa_rows(40))
    held = write_rows(tmp_path / "held.jsonl", qa_rows(40, seed=1))
    cfg, params = loaded(tmp_path, qwen, "max_new_tokens=2")
    ds = DATA.make_dataset(sft(tmp_path, qwen, files, f"hf_eval_files={held}"))
    graph, lowered = model_lib.abstract(cfg)[0], []
    event = "/jax/core/compile/jaxpr_to_mlir_module_duration"
    listen = lambda name, *_, **__: lowered.append(name) if name == event else None
    answer = lambda n: model_lib.lm_answers(
        cfg.model_copy(update={"eval_answers": n}), graph, params, ds, str(tmp_path)
    )
    answer(16)  # what runs once per process (a random key's program, ...)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        counts = []
        for n in (16, 40):
            lowered.clear()
            assert answer(n)["answered"] == n
            counts.append(len(lowered))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counts[0] == counts[1] >= 1, counts
