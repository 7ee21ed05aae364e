"""Fine-tuning what exists, without torch or network: Hugging Face checkpoints of the three families (Llama 3 with
llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms) written here as transformers writes them (sharded,
bf16 / f16 / f32), read against a numpy forward written from transformers' equations; their tokenizer.json with
its special tokens and chat template; SFT rows with the prompt masked, packed, counted in epochs; the hub's offline
cache; and the way back (export)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import BASE, ENV, LM, ROOT, read_checkpoint
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
    cfg = train.resolve(train.checkpoint_keys(cfg), model_lib.TASKS["lm"], "cpu")
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
        train.checkpoint_keys(config(tmp_path, f"load_hf={folder}", "d_model=32"))
    with pytest.raises(train.ConfigError, match="qkv_bias=True but qkv_bias=False is set"):
        train.checkpoint_keys(config(tmp_path, f"load_hf={folder}", "qkv_bias=false"))
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


@pytest.fixture
def qwen(tmp_path):
    """A tiny Qwen2 checkpoint with a byte-level tokenizer and ChatML template (vocab 320 rows, tokenizer 300)."""
    folder = tmp_path / "qwen"
    write_checkpoint(folder, "qwen2", vocab_size=320)
    write_tokenizer(folder)
    return folder


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
    got = model_lib.lm_loss(cfg, graph, params, batch, None, None)
    loss, weight = float(got[0]), float(got[1][0]["weight"])
    want, n = 0.0, 0
    for r in range(4):
        for s in range(1, batch["segment_ids"][r].max() + 1):  # each example of the row, alone
            at = np.flatnonzero(batch["segment_ids"][r] == s)
            ids = np.append(batch["inputs"][r, at], batch["targets"][r, at[-1]])
            row = next(x for x in rows if x["prompt"] + x["completion"] == tok.decode(ids.tolist()))
            answer = (
                len(tok.encode(row["completion"])) + 1
            )  # the completion and eos are the targets that count
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
