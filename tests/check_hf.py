"""Our Hugging Face loader (load_hf) and exporter (mode=export) against transformers itself.

Run by hand (not collected by pytest: the file name does not start with test_). torch and
transformers live in their own virtual environment, never in requirements.txt:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 transformers trl peft
    python tests/check_hf.py --torch-python /tmp/tv/bin/python [--out DIR]
    python tests/check_hf.py --torch-python /tmp/tv/bin/python --export RUN_DIR_OR_EXPORT_DIR

The venv's python (this same file with --worker) builds three tiny random models with transformers,
Llama 3 (llama3 RoPE scaling, GQA, tied embeddings), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, a
head_dim that is not hidden / heads), each saved in several safetensors shards with an index, and
writes their float32 logits on a fixed token batch and a greedy continuation. The main python (the
one with jax) loads each checkpoint as a run with load_hf= does and compares; then exports it with
model.save_hf, and the venv loads the export back and compares with the original's logits.
--export DIR does the same for a directory our mode=export wrote (or its RUN_DIR, holding hf/), and
answers one prompt with its tokenizer (through its chat template, if it has one).

The parts, each a table; an AssertionError at the end lists whatever disagrees:
  Part 1: the three checkpoints, loaded by ours (logits, greedy) and exported back by save_hf.
  Part 2: --export's directory, its logits and its answer to --prompt (only with --export).
  Part 3: SFT rows (prompt-completion, and messages with assistant_only_loss) against trl's
          SFTTrainer: the same token ids and counted tokens, the same loss per token.
  Part 4: LoRA adapters against peft both ways: ours read by PeftModel, peft's read by load_adapter,
          and lora.merge=true's export.
  Part 5: DPO against trl's DPOTrainer, for a tiny Llama 3 and Qwen2 on text and conversational
          pairs, from the same peft adapter (its B drawn nonzero: the policy is not the reference),
          and on text pairs with every weight trained against the precomputed reference: the same
          token ids and answer masks, the same loss and rewards before a step, and over five AdamW
          steps on one batch the same loss, rewards and gradient norm.
"""

import argparse
import datetime
import glob
import json
import os
import pathlib
import platform
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every model's shape: tiny, so each forward costs milliseconds and the check stays light on a
# shared machine. initializer_range 0.1 (about 1 / sqrt(hidden)) rather than transformers' 0.02:
# at 0.02 attention is nearly uniform and the logits nearly flat, hiding a wrong RoPE angle.
# No bos / eos: transformers' greedy decoding then runs all NEW_TOKENS tokens, as ours does.
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
}
# name -> (model class, config class, the config's own keys). RoPE goes in as rope_parameters
# (transformers 5) or rope_scaling + rope_theta (4.x), whichever the installed version takes.
MODELS = {
    "llama3": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            # original 64: at head_dim 16 and theta 5e5 the wavelengths 6, 32 and 167+ positions
            # fall in each of the rule's three bands (kept, blended, divided by factor).
            "rope": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "rope": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {
            "tie_word_embeddings": False,
            "head_dim": 32,
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
}
BATCH = (2, 128)  # token ids for the logits: every position the llama3 bands act on
PROMPT_LEN, NEW_TOKENS = 8, 16  # greedy: ids[:1, :PROMPT_LEN] continued by NEW_TOKENS tokens
SHARD = "100KB"  # each model is ~0.3-0.5 MB in float32: three to five shards and an index
TOLERANCE = 1e-4  # of the largest logit: float32 sums in another order, nothing more
PROMPT = "What is the capital of France?"
# Part 4's and Part 5's peft adapters adapt every projection.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Our export writes shards past model.SHARD_BYTES (5 GiB): lowered for Qwen3 so that its round trip
# goes through shards and an index too, while the other two write one model.safetensors.
EXPORT_SHARD_BYTES = {"qwen3": 100_000}


# ==================================================================================================
# The torch side (runs in the venv: torch, transformers, numpy; not jax nor the repo's modules).
# ==================================================================================================
def torch_setup():
    """torch, transformers and numpy, on one thread (the machine is shared) and seeded."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    return np, torch, transformers


def tiny_config(transformers, name, rope=None):
    """MODELS[name]'s config (`rope`: other RoPE parameters, for the control)."""
    import inspect

    arch, conf_class, keys = MODELS[name]
    keys, conf_class = dict(keys), getattr(transformers, conf_class)
    rope = rope or keys["rope"]
    del keys["rope"]
    if "rope_parameters" in inspect.signature(conf_class.__init__).parameters:
        keys["rope_parameters"] = rope
    else:
        keys["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            keys["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return getattr(transformers, arch), conf_class(**SHAPE, **keys)


def tiny_model(transformers, torch, name):
    """A random model of MODELS[name], its norms and biases moved off 1 and 0 so that a norm or bias
    our loader dropped or misplaced would change the logits."""
    return tiny_model_of(torch, *tiny_config(transformers, name))


def tiny_model_of(torch, arch, conf):
    """A random arch(conf), its norms and biases moved off 1 and 0."""
    model = arch(conf).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def unscaled_logits(transformers, torch, model, ids):
    """The control: Llama 3's weights with plain RoPE (its llama3 scaling dropped), on ids: how far
    off a loader that got the frequency rule wrong would be."""
    arch, conf = tiny_config(
        transformers, "llama3", {"rope_type": "default", "rope_theta": 500000.0}
    )
    plain = arch(conf).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        return plain(ids).logits.float().numpy()


def greedy(torch, model, prompt_1P, new_tokens):
    """model.generate's greedy continuation of prompt_1P (the new tokens only, as a list)."""
    ids = torch.tensor(prompt_1P, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def worker_make(out):
    """Part 1's checkpoints under out/NAME/hf, with their logits on out/ids.npy and their greedy
    continuations of its first row's first PROMPT_LEN tokens; the versions in out/versions.json."""
    np, torch, transformers = torch_setup()
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], BATCH).astype(np.int32)
    np.save(os.path.join(out, "ids.npy"), ids)
    ids_t = torch.tensor(ids, dtype=torch.long)
    for name in MODELS:
        model, folder = tiny_model(transformers, torch, name), os.path.join(out, name, "hf")
        model.save_pretrained(folder, max_shard_size=SHARD)
        with torch.no_grad():
            np.save(os.path.join(out, name, "logits.npy"), model(ids_t).logits.float().numpy())
        if name == "llama3":
            np.save(
                os.path.join(out, "unscaled_logits.npy"),
                unscaled_logits(transformers, torch, model, ids_t),
            )
        np.save(
            os.path.join(out, name, "greedy.npy"),
            np.asarray(greedy(torch, model, ids[:1, :PROMPT_LEN], NEW_TOKENS), np.int32),
        )
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f)


def chat_prompt(tok, prompt):
    """The prompt as token ids: through the tokenizer's chat template if it has one."""
    if tok.chat_template:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in some versions
        return [int(i) for i in ids], True
    return tok(prompt)["input_ids"], False


def worker_load(job_path):
    """Each job entry: the checkpoint `dir` loaded with AutoModelForCausalLM (float32), its logits
    on `ids` saved to `logits`; with `answer`, `prompt` answered greedily with its AutoTokenizer."""
    np, torch, transformers = torch_setup()
    with open(job_path) as f:
        job = json.load(f)
    for entry in job:
        model = transformers.AutoModelForCausalLM.from_pretrained(entry["dir"], dtype=torch.float32)
        ids = torch.tensor(np.load(entry["ids"]), dtype=torch.long)
        with torch.no_grad():
            np.save(entry["logits"], model.eval()(ids).logits.float().numpy())
        if entry.get("answer"):
            tok = transformers.AutoTokenizer.from_pretrained(entry["dir"])
            prompt, templated = chat_prompt(tok, entry["prompt"])
            tokens = greedy(torch, model, [prompt], NEW_TOKENS)
            answer = {
                "prompt_ids": prompt,
                "templated": templated,
                "tokens": tokens,
                "text": tok.decode(tokens, skip_special_tokens=True),
            }
            with open(entry["answer"], "w") as f:
                json.dump(answer, f)


def worker_sft(out):
    """Part 3's trl side: for each SFT_CASES set, SFTTrainer's tokenized rows (input_ids and the mask of
    what counts) and the model's summed cross-entropy over what counts, as trl's loss takes it (the mean
    over a batch's label tokens: here the sum and the count, over every row), into out/sft/NAME.json."""
    _, torch, transformers = torch_setup()
    import datasets
    import trl

    folder = os.path.join(out, "sft", "hf")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    arch, conf = tiny_config(transformers, "qwen2")
    conf.vocab_size = len(tok)  # the tokenizer's (its specials past the byte alphabet)
    arch(conf).save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, (_, trl_keys) in SFT_CASES.items():
        lines = pathlib.Path(out, "sft", f"{name}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        args = trl.SFTConfig(
            output_dir=os.path.join(out, "sft", f"trl-{name}"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            max_length=1024,
            dataset_num_proc=None,
            **trl_keys,
        )
        trainer = trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tok,
        )
        done, total, count = [], 0.0, 0
        for row in trainer.train_dataset:
            ids = row["input_ids"]
            mask = [int(label != -100) for label in row["labels"]]  # trl's labels: -100 uncounted
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1].double()
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
            counts = torch.tensor(mask[1:], dtype=torch.float64)
            total, count = total + float((ce * counts).sum()), count + int(counts.sum())
            done.append({"ids": ids, "mask": mask})
        with open(os.path.join(out, "sft", f"{name}.json"), "w") as f:
            json.dump({"rows": done, "loss_sum": total, "tokens": count, "trl": trl.__version__}, f)


def worker_peft(out):
    """Part 4's peft side, for each of Part 1's checkpoints: our exported adapter (out/NAME/ours) read by
    peft.PeftModel, its logits saved; and an adapter made by peft on every projection (rank 4, alpha 8,
    its B drawn nonzero) saved with save_pretrained, with its logits and the merged model
    (merge_and_unload)'s."""
    np, torch, transformers = torch_setup()
    import peft

    ids = torch.tensor(np.load(os.path.join(out, "ids.npy")), dtype=torch.long)
    for name in MODELS:
        here = lambda *p, name=name: os.path.join(out, name, *p)
        load = lambda here=here: transformers.AutoModelForCausalLM.from_pretrained(
            here("hf"), dtype=torch.float32
        )
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(load(), here("ours")).eval()
            np.save(here("ours_in_peft.npy"), theirs(ids).logits.float().numpy())
            conf = peft.LoraConfig(
                r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
            )
            made = peft.get_peft_model(load(), conf)
            for pname, p in made.named_parameters():
                if "lora_B" in pname:
                    p.add_(0.05 * torch.randn_like(p))
            made.save_pretrained(here("peft"))
            np.save(here("peft_logits.npy"), made.eval()(ids).logits.float().numpy())
        with open(os.path.join(out, "peft_version.json"), "w") as f:
            json.dump({"peft": peft.__version__}, f)


def worker_dpo(out):
    """Part 5's trl side: for each DPO_MODELS architecture, a random model of its tokenizer's
    vocabulary saved to out/dpo/NAME/hf; then trl_dpo on each DPO_ROWS set, into
    out/dpo/NAME-ROWS.json."""
    _, torch, transformers = torch_setup()
    for name in DPO_MODELS:
        folder = os.path.join(out, "dpo", name, "hf")
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        arch, conf = tiny_config(transformers, name)
        conf.vocab_size = len(tok)  # the tokenizer's (its specials past the byte alphabet)
        tiny_model_of(torch, arch, conf).save_pretrained(folder)
        for rows_name, full in DPO_CASES:
            case = os.path.join(out, "dpo", dpo_case_name(name, rows_name, full))
            lines = pathlib.Path(out, "dpo", f"{rows_name}.jsonl").read_text().splitlines()
            found = trl_dpo(torch, folder, tok, case, [json.loads(line) for line in lines], full)
            with open(f"{case}.json", "w") as f:
                json.dump(found, f)


def trl_dpo(torch, folder, tok, case, rows, full=False):
    """DPOTrainer on rows with a new peft adapter on every projection (its lora_B drawn nonzero, so
    that the policy is not the reference; saved to case/adapter for ours), or `full`: every weight
    trained, the reference log-probabilities precomputed (precompute_ref_log_probs): its tokenized
    rows, the prompt tokens a merge moved into the answers, its loss and rewards on the batch of
    every pair before a step, and its DPO_STEPS steps' logs."""
    import datasets
    import peft
    import trl

    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    trainer = trl.DPOTrainer(
        model=folder,
        args=dpo_config(trl, case, len(rows), full),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=None if full else lora,
    )
    if not full:
        kick_lora_b(torch, trainer.model)
        trainer.model.save_pretrained(os.path.join(case, "adapter"))
    examples = list(trainer.train_dataset)
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    tokens = [{k: e[k] for k in keys} for e in examples]
    alone = [tok(r["prompt"])["input_ids"] for r in rows if isinstance(r["prompt"], str)]
    step0 = dpo_step0(torch, trainer, examples)
    trainer.train()
    return {
        "tokens": tokens,
        "merged": sum(len(a) - len(t["prompt_ids"]) for a, t in zip(alone, tokens)),
        "step0": step0,
        "steps": [h for h in trainer.state.log_history if "loss" in h],
        "trl": trl.__version__,
    }


def dpo_config(trl, case, pairs, full):
    """Part 5's DPOConfig: every pair in one batch, DPO_STEPS steps of AdamW at a constant rate, no
    warmup nor weight decay, the gradient clipped to norm 1, float32 on the CPU; `full`: the
    reference's log-probabilities computed once before training."""
    return trl.DPOConfig(
        output_dir=os.path.join(case, "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        learning_rate=DPO_LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        activation_checkpointing=False,  # trl's default recomputes; the same numbers, slower
        per_device_train_batch_size=pairs,
        train_sampling_strategy="sequential",
        max_steps=DPO_STEPS,
        logging_steps=1,
        save_strategy="no",
        beta=DPO_BETA,
        loss_type=["sigmoid"],
        max_length=None,
        dataset_num_proc=None,
        precompute_ref_log_probs=full,
    )


def kick_lora_b(torch, peft_model):
    """Every lora_B drawn 0.05 N(0, 1) (seed 1), in place: the adapted policy then differs from the
    reference (the adapter off) from step 0 on."""
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.05 * torch.randn(p.shape, generator=draw))


def dpo_step0(torch, trainer, examples):
    """trl's loss and reward metrics on the batch of these examples, the adapter as drawn (no step):
    compute_loss without gradients, its metrics logged under eval."""
    inputs = trainer._prepare_inputs(trainer.data_collator(examples))
    trainer.model.eval()
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs).item()
    step0 = {k: sum(v) / len(v) for k, v in trainer._metrics["eval"].items()}
    trainer._metrics["eval"].clear()
    trainer.model.train()
    return {**step0, "loss": loss}


def worker(argv):
    """--worker make OUT | load JOB.json | sft OUT | peft OUT | dpo OUT: the torch side, in the
    venv's python."""
    worker_of = {
        "make": worker_make,
        "load": worker_load,
        "sft": worker_sft,
        "peft": worker_peft,
        "dpo": worker_dpo,
    }
    worker_of[argv[0]](*argv[1:])


# ==================================================================================================
# Our side (the main python: jax and the repo).
# ==================================================================================================
def machine():
    """The CPU, its core count and the time, for the header."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    now = datetime.datetime.now(datetime.UTC)
    return f"{now:%Y-%m-%d %H:%M} UTC, {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def run_worker(torch_python, *argv):
    """This file's worker in the venv; its stderr (transformers' warnings) shown if it fails."""
    p = subprocess.run(
        [torch_python, os.path.abspath(__file__), "--worker", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:
        sys.exit(f"torch worker {' '.join(argv)} failed:\n{p.stderr[-4000:]}")


def load_ours(hf_dir, max_len=BATCH[1]):
    """(cfg, graph, params): the checkpoint as a run with load_hf=hf_dir makes them (its config.json
    setting the model keys), float32 on one device; greedy decoding of NEW_TOKENS tokens."""
    import jax

    import model
    import train

    keys = [
        f"load_hf={hf_dir}",
        "dtype=float32",
        "mesh=1,1,1",
        f"max_target_length={max_len}",
        "temperature=0",
        f"max_new_tokens={NEW_TOKENS}",
        "attention=einsum",  # what attention=auto picks on CPU, without its log line
    ]
    cfg, task = train.load_config(os.path.join(ROOT, "base.yml"), keys), model.TASKS["lm"]
    cfg = train.resolve(train.pretrained(cfg), task, "cpu")
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    layout = train.state_layout(cfg, task, mesh, train.make_optimizer(cfg)[0], 1)
    with jax.set_mesh(mesh):
        params = model.load_hf(cfg, hf_dir, layout.abstract["params"])
    return cfg, model.abstract(cfg)[0], params


def our_logits(graph, params, ids):
    """Our model's float32 logits [B, L, V] on ids, every token in one segment."""
    import numpy as np
    from flax import nnx

    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    return np.asarray(nnx.merge(graph, params)(ids, positions, np.ones_like(ids)))


def our_greedy(cfg, graph, params, prompt_1P):
    """model.generate's greedy continuation (temperature=0), as a list."""
    import jax
    import numpy as np

    import model

    prompt = np.asarray(prompt_1P, np.int32)
    return np.asarray(model.generate(cfg, graph, params, prompt, jax.random.key(0)))[0].tolist()


def compare(ours, theirs):
    """(max |ours - theirs|, that over the largest |logit| of theirs)."""
    import numpy as np

    diff = float(np.abs(ours - theirs).max())
    return diff, diff / float(np.abs(theirs).max())


def same_greedy(ours, theirs):
    """Whether the continuations agree: on every token transformers gave (it stops early at eos)."""
    return len(theirs) > 0 and ours[: len(theirs)] == list(theirs)


def shard_files(folder):
    """The checkpoint's safetensors files, for the table: '3 + index' or '1'."""
    n = len(glob.glob(os.path.join(folder, "*.safetensors")))
    return (
        f"{n} + index"
        if os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
        else str(n)
    )


def tensors(folder):
    """{name: array} of every safetensors file in folder."""
    import safetensors.numpy

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(safetensors.numpy.load_file(path))
    return out


def same_tensors(a, b):
    """Whether two checkpoints hold the same tensor names with bit-identical values."""
    import numpy as np

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def check_model(name, out):
    """Part 1 for one architecture, ours against transformers' files; then its export with save_hf.
    Returns the row (round trip still to fill) and the export's directory."""
    import jax
    import numpy as np

    import model

    folder, export = os.path.join(out, name, "hf"), os.path.join(out, name, "export")
    ids = np.load(os.path.join(out, "ids.npy"))
    cfg, graph, params = load_ours(folder)
    diff, rel = compare(
        our_logits(graph, params, ids), np.load(os.path.join(out, name, "logits.npy"))
    )
    theirs = np.load(os.path.join(out, name, "greedy.npy")).tolist()
    ours = our_greedy(cfg, graph, params, ids[:1, :PROMPT_LEN])
    source = json.loads(pathlib.Path(folder, "config.json").read_text())
    default, model.SHARD_BYTES = model.SHARD_BYTES, EXPORT_SHARD_BYTES.get(name, model.SHARD_BYTES)
    try:
        model.save_hf(cfg, jax.tree.map(np.asarray, params), export, tokenizer=None, source=source)
    finally:
        model.SHARD_BYTES = default
    exported = json.loads(pathlib.Path(export, "config.json").read_text())
    return {
        "name": name,
        "arch": source["architectures"][0],
        "files": shard_files(folder),
        "diff": diff,
        "rel": rel,
        "greedy": same_greedy(ours, theirs),
        "ours": ours,
        "theirs": theirs,
        "arch_kept": exported["architectures"] == source["architectures"],
        "tensors_kept": same_tensors(folder, export),
        "export_files": shard_files(export),
    }, export


def export_dir(path):
    """--export's directory: an export (config.json there), or a RUN_DIR holding hf/."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.exists(os.path.join(path, "hf", "config.json")):
        return os.path.join(path, "hf")
    sys.exit(f"--export {path}: neither it nor {path}/hf holds a config.json")


def check_export(folder, out, theirs_logits, answer):
    """--export: ours against transformers on the batch and on the prompt's greedy answer."""
    import numpy as np

    cfg, graph, params = load_ours(
        folder, max_len=max(BATCH[1], len(answer["prompt_ids"]) + NEW_TOKENS)
    )
    diff, rel = compare(
        our_logits(graph, params, np.load(os.path.join(out, "export_ids.npy"))), theirs_logits
    )
    ours = our_greedy(cfg, graph, params, [answer["prompt_ids"]])
    arch = json.loads(pathlib.Path(folder, "config.json").read_text())["architectures"][0]
    return {
        "name": folder,
        "arch": arch,
        "files": shard_files(folder),
        "diff": diff,
        "rel": rel,
        "greedy": same_greedy(ours, answer["tokens"]),
        "ours": ours,
        "theirs": answer["tokens"],
    }


def table(rows, columns):
    """rows as a | table with the given (title, format) columns, widths fitted."""
    cells = [[title for title, _ in columns]] + [[f(r) for _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


COLUMNS = [
    ("architecture", lambda r: r["arch"]),
    ("checkpoint files", lambda r: r["files"]),
    ("max |logit diff|", lambda r: f"{r['diff']:.3g}"),
    ("of largest", lambda r: f"{r['rel']:.3g}"),
    ("greedy equal", lambda r: f"{'yes' if r['greedy'] else 'NO'} ({len(r['theirs'])} tok)"),
]
ROUND_TRIP = [
    ("export files", lambda r: r["export_files"]),
    ("export round trip diff", lambda r: f"{r['trip']:.3g}"),
    ("architectures kept", lambda r: "yes" if r["arch_kept"] else "NO"),
    ("tensors identical", lambda r: "yes" if r["tensors_kept"] else "NO"),
]


def failures(row):
    """What disagrees in one row beyond TOLERANCE, one line each."""
    bad, name = [], row["name"]
    if not row["rel"] < TOLERANCE:
        bad.append(f"{name}: logits differ by {row['rel']:.3g} of the largest")
    if not row["greedy"]:
        bad.append(f"{name}: greedy ours {row['ours']} vs transformers {row['theirs']}")
    if "trip" in row and not row["trip_rel"] < TOLERANCE:
        bad.append(f"{name}: the export gives logits {row['trip_rel']:.3g} of the largest off")
    if "trip" in row and not (row["arch_kept"] and row["tensors_kept"]):
        bad.append(f"{name}: the export changed its architectures or its tensors")
    return bad


def part1(out, torch_python, export=None, prompt=PROMPT):
    """The three checkpoints checked and exported; the exports (and `export`, if given) read back by
    transformers in one worker call. Returns the rows, round trip filled."""
    import numpy as np

    rows, job = [], []
    for name in MODELS:
        row, folder = check_model(name, out)
        rows.append(row)
        logits = os.path.join(out, name, "export_logits.npy")
        job.append({"dir": folder, "ids": os.path.join(out, "ids.npy"), "logits": logits})
    if export:  # Part 2's transformers side rides along: torch is imported once
        vocab = json.loads(pathlib.Path(export, "config.json").read_text())["vocab_size"]
        ids = np.random.default_rng(1).integers(0, vocab, BATCH).astype(np.int32)
        np.save(os.path.join(out, "export_ids.npy"), ids)
        job.append(
            {
                "dir": export,
                "ids": os.path.join(out, "export_ids.npy"),
                "logits": os.path.join(out, "export_logits.npy"),
                "answer": os.path.join(out, "export_answer.json"),
                "prompt": prompt,
            }
        )
    with open(os.path.join(out, "job.json"), "w") as f:
        json.dump(job, f)
    run_worker(torch_python, "load", os.path.join(out, "job.json"))
    for row in rows:  # the export, read by transformers, against the original's transformers logits
        original = np.load(os.path.join(out, row["name"], "logits.npy"))
        exported = np.load(os.path.join(out, row["name"], "export_logits.npy"))
        row["trip"], row["trip_rel"] = compare(exported, original)
    return rows


def report_part1(rows, out):
    """Part 1's table, and the control that shows the tolerance has teeth."""
    import numpy as np

    print(
        f"\nPart 1: transformers checkpoints ({BATCH[0]} x {BATCH[1]} tokens; greedy "
        f"{NEW_TOKENS} tokens after {PROMPT_LEN}), loaded by ours; exported back by save_hf"
    )
    print(table(rows, COLUMNS + ROUND_TRIP))
    unscaled = np.load(os.path.join(out, "unscaled_logits.npy"))
    control = compare(unscaled, np.load(os.path.join(out, "llama3", "logits.npy")))[1]
    print(
        f"control: the Llama weights with RoPE unscaled (no llama3 rule) move the logits by "
        f"{control:.3g} of the largest, so the tolerance {TOLERANCE:g} would catch a wrong rule"
    )


def part2(folder, out, prompt):
    """--export: ours on the export against transformers' logits and greedy answer; printed."""
    import numpy as np

    answer = json.loads(pathlib.Path(out, "export_answer.json").read_text())
    row = check_export(folder, out, np.load(os.path.join(out, "export_logits.npy")), answer)
    print(f"\nPart 2: {folder} ({BATCH[0]} x {BATCH[1]} random tokens)")
    print(table([row], COLUMNS))
    how = "through its chat template" if answer["templated"] else "as plain text (no template)"
    print(f"prompt {prompt!r} {how}, {len(answer['prompt_ids'])} tokens")
    print(f"transformers answers: {answer['text']!r}")
    return row


# Part 3's row sets: (our keys, trl's SFTConfig keys). Text rows whose prompts end in a space (the
# answer's first token then takes it, as trl tokenizes the whole text), and chat rows of several turns
# under a ChatML template with {% generation %} blocks, which both read as the answers.
SFT_CASES = {
    "prompt_completion": ([], {}),
    "messages": ([], {"assistant_only_loss": True}),
}
MARKED_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def sft_files(out):
    """Part 3's tokenizer (a byte-level BPE tokenizer.json and the marked ChatML template) and rows,
    under out/sft; the worker adds a random Qwen2 of the tokenizer's vocabulary."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = os.path.join(out, "sft", "hf")
    os.makedirs(folder, exist_ok=True)
    words = [
        "the",
        "capital",
        "of",
        "France",
        "is",
        "Paris",
        "and",
        "Italy",
        "Rome",
        "what",
        "plus",
    ]
    rng = random.Random(0)
    text = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, initial_alphabet=alphabet)
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": MARKED_CHATML,
    }
    pathlib.Path(folder, "tokenizer_config.json").write_text(json.dumps(config))
    rows = {
        "prompt_completion": [
            {"prompt": f"what is the capital of {c}? ", "completion": a}
            for c, a in [("France", "Paris"), ("Italy", "Rome")] * 20
        ],
        "messages": [
            {
                "messages": [
                    {"role": "user", "content": f"what is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}"},
                    {"role": "user", "content": "and the capital of France?"},
                    {"role": "assistant", "content": "Paris"},
                ]
            }
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)] * 10
        ],
    }
    for name, these in rows.items():
        with open(os.path.join(out, "sft", f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in these)
    return folder


def part3(out, torch_python):
    """Our SFT rows (every row of each set held out and scored, one a row) against trl's: the same
    token ids, the same tokens counted, the same loss per counted token."""
    import data
    import model
    import train

    folder = sft_files(out)
    run_worker(torch_python, "sft", out)
    rows = []
    for name, (keys, _) in SFT_CASES.items():
        theirs = json.loads(pathlib.Path(out, "sft", f"{name}.json").read_text())
        files = os.path.join(out, "sft", f"{name}.jsonl")
        more = [f"load_hf={folder}", "dataset=hf", "hf_path=json", f"hf_data_files={files}"]
        more += [f"hf_eval_files={files}", "dtype=float32", "mesh=1,1,1", "packing=false"]
        more += ["max_target_length=128", "per_device_batch=4", f"cache_dir={out}/cache", *keys]
        cfg = train.load_config(os.path.join(ROOT, "base.yml"), more)
        cfg = train.resolve(train.pretrained(cfg), model.LM, "cpu")
        ds = data.make_dataset(cfg)
        ours = [(ids.tolist(), answer.tolist()) for ids, answer in ds.eval_tokens]
        same_ids = [ids for ids, _ in ours] == [r["ids"] for r in theirs["rows"]]
        same_mask = [m[1:] for _, m in ours] == [
            [bool(x) for x in r["mask"][1:]] for r in theirs["rows"]
        ]
        _, graph, params = load_ours(folder, max_len=128)
        outs = [model.lm_eval_step(cfg, graph, params, b) for b in ds.eval_batches(4, None)]
        loss = float(sum(o["loss"] for o in outs)) / float(sum(o["tokens"] for o in outs))
        tokens = int(sum(float(o["tokens"]) for o in outs))
        want = theirs["loss_sum"] / theirs["tokens"]
        rows.append(
            {
                "name": name,
                "ids": same_ids,
                "mask": same_mask,
                "tokens": (tokens, theirs["tokens"]),
                "loss": (loss, want),
                "rel": abs(loss - want) / want,
                "trl": theirs["trl"],
            }
        )
    return rows


def report_part3(rows):
    """Part 3's table; the lines of what disagrees."""
    columns = [
        ("rows", lambda r: r["name"]),
        ("token ids equal", lambda r: "yes" if r["ids"] else "NO"),
        ("answer masks equal", lambda r: "yes" if r["mask"] else "NO"),
        ("tokens counted (ours, trl)", lambda r: f"{r['tokens'][0]}, {r['tokens'][1]}"),
        ("loss per token (ours, trl)", lambda r: f"{r['loss'][0]:.7f}, {r['loss'][1]:.7f}"),
        ("relative", lambda r: f"{r['rel']:.2g}"),
    ]
    print(f"\nPart 3: SFT rows, ours against trl {rows[0]['trl']}'s SFTTrainer (float32)")
    print(table(rows, columns))
    return [
        f"{r['name']}: ours and trl's SFT rows differ"
        for r in rows
        if not (r["ids"] and r["mask"] and r["tokens"][0] == r["tokens"][1] and r["rel"] < 1e-5)
    ]


def lora_ours(hf_dir, *keys):
    """(cfg, whole weights) of load_hf=hf_dir with LoRA keys, as a run builds them, float32."""
    import jax
    from flax import nnx

    import model
    import train

    keys = [
        f"load_hf={hf_dir}",
        "dtype=float32",
        "mesh=1,1,1",
        f"max_target_length={BATCH[1]}",
        *keys,
    ]
    cfg, task = train.load_config(os.path.join(ROOT, "base.yml"), keys), model.TASKS["lm"]
    cfg = train.resolve(train.pretrained(cfg), task, "cpu")
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    layout = train.state_layout(cfg, task, mesh, train.make_optimizer(cfg)[0], 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
        state = train.init_state(cfg, layout, model.load_pretrained(cfg, layout.abstract))
    return cfg, state


def part4(out, torch_python):
    """peft both ways, for each architecture: our adapters (B drawn nonzero) exported by mode=export's
    save_hf and read by peft.PeftModel give our logits; an adapter peft made, read by load_adapter, gives
    peft's; lora.merge=true's export read by transformers gives the adapted model's."""
    import jax
    import numpy as np

    import model
    import train

    ids = np.load(os.path.join(out, "ids.npy"))
    rows = []
    job = []
    for name in MODELS:
        cfg, state = lora_ours(os.path.join(out, name, "hf"), "lora.rank=4", "lora.alpha=8")
        rng = np.random.default_rng(0)
        kick = lambda p, x, rng=rng: (
            x + 0.05 * rng.standard_normal(x.shape) if p[-1].key.endswith("_b") else x
        )
        adapters = jax.tree_util.tree_map_with_path(kick, jax.tree.map(np.asarray, state["params"]))
        whole = model.joined(jax.tree.map(np.asarray, state["base"]), adapters)
        graph = model.abstract(cfg)[0]
        np.save(os.path.join(out, name, "ours_lora.npy"), our_logits(graph, whole, ids))
        model.save_hf(cfg, whole, os.path.join(out, name, "ours"))
        merged = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"merge": True})})
        model.save_hf(merged, whole, os.path.join(out, name, "merged"))
        job.append(
            {
                "dir": os.path.join(out, name, "merged"),
                "ids": os.path.join(out, "ids.npy"),
                "logits": os.path.join(out, name, "merged_logits.npy"),
            }
        )
    run_worker(torch_python, "peft", out)
    with open(os.path.join(out, "job4.json"), "w") as f:
        json.dump(job, f)
    run_worker(torch_python, "load", os.path.join(out, "job4.json"))
    for name in MODELS:
        here = lambda *p, name=name: os.path.join(out, name, *p)
        mine = np.load(here("ours_lora.npy"))
        cfg, state = lora_ours(here("hf"), f"load_adapter={here('peft')}")
        theirs_made = our_logits(model.abstract(cfg)[0], train.weights(state, model.LM), ids)
        rows.append(
            {
                "name": name,
                "export": compare(mine, np.load(here("ours_in_peft.npy")))[1],
                "import": compare(theirs_made, np.load(here("peft_logits.npy")))[1],
                "merged": compare(np.load(here("merged_logits.npy")), mine)[1],
                "moved": compare(mine, np.load(here("logits.npy")))[1],
            }
        )
    return rows, json.loads(pathlib.Path(out, "peft_version.json").read_text())["peft"]


def report_part4(rows, version):
    """Part 4's table; the lines of what disagrees."""
    columns = [
        ("architecture", lambda r: r["name"]),
        ("ours read by peft", lambda r: f"{r['export']:.2g}"),
        ("peft's read by ours", lambda r: f"{r['import']:.2g}"),
        ("merged export", lambda r: f"{r['merged']:.2g}"),
        ("the adapter moves the logits by", lambda r: f"{r['moved']:.2g}"),
    ]
    print(
        f"\nPart 4: LoRA adapters against peft {version} (|logit difference| of the largest logit)"
    )
    print(table(rows, columns))
    keys = ("export", "import", "merged")
    return [f"{r['name']}: LoRA differs from peft" for r in rows if max(r[k] for k in keys) >= 1e-5]


# Part 5's cases: Part 1's Llama 3 and Qwen2 (name -> whether its tokenizer prepends a bos, as
# Llama 3's does), each on text pairs and on conversational ones (under a ChatML template), four a
# set. The text set holds a chosen whose first token takes the prompt's last character (" Par", the
# prompt ending in a space: both answers start where either leaves the prompt's own tokens) and a
# rejected that ends in the eos string already (trl adds none then); the conversational one a
# system turn and a prompt of three turns. The worker counts the prompt tokens a merge moved into
# the answers.
DPO_MODELS = {"llama3": True, "qwen2": False}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_turn = lambda role, text: [{"role": role, "content": text}]
DPO_ROWS = {
    "text": [
        {
            "prompt": "Question: what is the capital of France?\nAnswer: ",
            "chosen": "Paris",
            "rejected": " Lyon, I think",
        },
        {"prompt": "def main(argv):", "chosen": " return argv[0]", "rejected": " pass"},
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.<|im_end|>"},
        {"prompt": "Two plus two equals ", "chosen": "four.", "rejected": "five, obviously."},
    ],
    "chat": [
        {
            "prompt": _turn("user", "what is the capital of France?"),
            "chosen": _turn("assistant", "Paris"),
            "rejected": _turn("assistant", "Lyon, I think"),
        },
        {
            "prompt": _turn("user", "def main(argv):"),
            "chosen": _turn("assistant", "return argv[0]"),
            "rejected": _turn("assistant", "pass"),
        },
        {
            "prompt": _turn("system", "Be brief.") + _turn("user", "The sky is?"),
            "chosen": _turn("assistant", "blue."),
            "rejected": _turn("assistant", "green, obviously."),
        },
        {
            "prompt": _turn("user", "Two plus two?")
            + _turn("assistant", "Four.")
            + _turn("user", "And three plus three?"),
            "chosen": _turn("assistant", "Six."),
            "rejected": _turn("assistant", "Seven."),
        },
    ],
}
DPO_STEPS, DPO_LR, DPO_BETA = 5, 1e-3, 0.1
REWARDS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
# (rows, full fine-tune): each row set from a peft adapter, and the text pairs with every weight
# trained against the precomputed reference
DPO_CASES = [(rows_name, False) for rows_name in DPO_ROWS] + [("text", True)]


def dpo_case_name(name, rows_name, full):
    return f"{name}-{rows_name}" + ("-full" if full else "")


def dpo_tokenizer(folder, bos):
    """A byte-level BPE tokenizer.json (300 tokens; with `bos`, <|endoftext|> prepended by its
    post-processor) and CHATML, eos <|im_end|>, pad <|endoftext|>, into folder."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(folder, exist_ok=True)
    text = ["Question: what is the capital of France?\nAnswer: Paris"] * 20
    text += ["def main(argv): return argv[0]"] * 20
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(text, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": "<|endoftext|>" if bos else None,
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    pathlib.Path(folder, "tokenizer_config.json").write_text(json.dumps(config))


def dpo_files(out):
    """Part 5's tokenizers (out/dpo/NAME/hf; the worker adds the models) and pair files."""
    for name, bos in DPO_MODELS.items():
        dpo_tokenizer(os.path.join(out, "dpo", name, "hf"), bos)
    for rows_name, rows in DPO_ROWS.items():
        with open(os.path.join(out, "dpo", f"{rows_name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def dpo_keys(out, name, rows_name, full):
    """Our run of one Part 5 case, as dpo_config's: trl's adapter loaded (`full`: none, every weight
    trained), every pair in one batch, DPO_STEPS steps of AdamW at a constant rate, the gradient
    clipped to norm 1, float32."""
    case = os.path.join(out, "dpo", dpo_case_name(name, rows_name, full))
    pairs = len(DPO_ROWS[rows_name])
    files = os.path.join(out, "dpo", f"{rows_name}.jsonl")
    keys = ["task=dpo", f"load_hf={out}/dpo/{name}/hf"]
    keys += [] if full else [f"load_adapter={case}/adapter"]
    keys += ["dataset=hf", "hf_path=json", f"hf_data_files={files}", f"hf_eval_files={files}"]
    keys += [f"per_device_batch={pairs}", f"steps={DPO_STEPS}", f"learning_rate={DPO_LR}"]
    keys += ["warmup_steps=0", "min_lr_ratio=1", "weight_decay=0", "grad_clip=1.0", "adam_b2=0.999"]
    keys += ["dtype=float32", "mesh=1,1,1", "attention=einsum", "max_target_length=256"]
    keys += [f"dpo.beta={DPO_BETA}", "log_every=1", "eval_every=0", "eval_batches=0", "prefetch=0"]
    keys += [f"output_dir={case}", "run_name=ours", f"cache_dir={out}/cache", "resume=false"]
    return keys


def our_dpo(keys, log_path):
    """Our side of one case: (the pairs it trains on, each [(ids, answer mask)] for chosen and
    rejected, in the file's order; the metrics rows of its DPO_STEPS steps); train.run's lines go to
    log_path."""
    import contextlib

    import jax

    import data
    import model
    import train

    cfg = train.load_config(os.path.join(ROOT, "base.yml"), keys)
    cfg = train.resolve(train.pretrained(cfg), model.DPO, "cpu")
    ds = data.make_dataset(cfg, source=model.DPO.dataset)
    pairs = [ds.train_tokens[i] for i in ds.train_ids]  # those it trains on: none too long skipped
    tokens = [[(ids.tolist(), answer.astype(int).tolist()) for ids, answer in p] for p in pairs]
    with open(log_path, "w") as f, contextlib.redirect_stdout(f):
        summary = train.run(
            train.load_config(os.path.join(ROOT, "base.yml"), keys), jax.devices()[:1]
        )
    lines = pathlib.Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return tokens, [row for row in map(json.loads, lines) if "loss" in row]


def relative(ours, theirs):
    """|ours - theirs| over |theirs| (the difference itself where theirs is 0)."""
    return abs(ours - theirs) / abs(theirs) if theirs else abs(ours - theirs)


def trl_pairs(tokens):
    """trl's tokenized rows as ours holds them: per pair, chosen's and rejected's (ids, answer mask),
    the prompt's tokens followed by the answer's."""
    side = lambda t, k: (t["prompt_ids"] + t[k], [0] * len(t["prompt_ids"]) + [1] * len(t[k]))
    return [[side(t, "chosen_ids"), side(t, "rejected_ids")] for t in tokens]


def dpo_case(out, name, rows_name, full):
    """One Part 5 row: ours against trl's tokens, step-0 loss and rewards, and DPO_STEPS steps. A
    full fine-tune starts as its reference (rewards 0 to float rounding, accuracies noise): its
    step-0 accuracies are not compared, its steps' rewards and accuracies compare from step 2."""
    case = os.path.join(out, "dpo", dpo_case_name(name, rows_name, full))
    theirs = json.loads(pathlib.Path(f"{case}.json").read_text())
    tokens, steps = our_dpo(dpo_keys(out, name, rows_name, full), f"{case}.log")
    step0, first = theirs["step0"], steps[0]  # our step 1's metrics: before its update
    near = lambda k: abs(first[k] - step0[k]) <= max(1e-6, 1e-4 * abs(step0[k]))
    # a full fine-tune's step-0 margins are float rounding (~1e-7): which pairs count as right is noise
    step0_keys = REWARDS[:3] if full else REWARDS
    pairs = list(zip(steps, theirs["steps"]))
    each = lambda keys, skip=0: max(relative(o[k], t[k]) for o, t in pairs[skip:] for k in keys)
    return {
        "name": f"{name} {rows_name}" + (" full" if full else " LoRA"),
        "tokens": tokens == trl_pairs(theirs["tokens"]),
        "merged": theirs["merged"],
        "loss0": (first["loss"], step0["loss"]),
        "loss0_rel": relative(first["loss"], step0["loss"]),
        "margin0": step0["rewards/margins"],
        "rewards0_rel": max(relative(first[k], step0[k]) for k in step0_keys),
        "rewards0_near": all(near(k) for k in step0_keys),
        "steps": (len(steps), len(theirs["steps"])),
        "loss_rel": each(["loss"]),
        "rewards_rel": each(REWARDS[:3], skip=int(full)),
        "grad_rel": each(["grad_norm"]),
        "accuracies": all(
            o["rewards/accuracies"] == t["rewards/accuracies"] for o, t in pairs[int(full) :]
        ),
        "trl": theirs["trl"],
    }


def part5(out, torch_python):
    """Our DPO against trl's DPOTrainer, for each architecture and row set, from the same peft
    adapter (its B nonzero): the same token ids and answer masks, the same loss and rewards before a
    step, and the same loss, rewards and gradient norm over DPO_STEPS AdamW steps on the same
    batch."""
    dpo_files(out)
    run_worker(torch_python, "dpo", out)
    return [dpo_case(out, name, *case) for name in DPO_MODELS for case in DPO_CASES]


def report_part5(rows):
    """Part 5's table; the lines of what disagrees."""
    columns = [
        ("case", lambda r: r["name"]),
        ("ids, masks equal", lambda r: "yes" if r["tokens"] else "NO"),
        ("prompt tokens merged", lambda r: str(r["merged"])),
        ("step-0 loss (ours, trl)", lambda r: f"{r['loss0'][0]:.7f}, {r['loss0'][1]:.7f}"),
        ("relative", lambda r: f"{r['loss0_rel']:.2g}"),
        ("step-0 margin (trl)", lambda r: f"{r['margin0']:.4f}"),
        ("step-0 rewards rel", lambda r: f"{r['rewards0_rel']:.2g}"),
        (
            f"{DPO_STEPS} steps rel: loss, rewards, grad norm",
            lambda r: f"{r['loss_rel']:.2g}, {r['rewards_rel']:.2g}, {r['grad_rel']:.2g}",
        ),
        ("accuracies equal", lambda r: "yes" if r["accuracies"] else "NO"),
    ]
    print(
        f"\nPart 5: DPO, ours against trl {rows[0]['trl']}'s DPOTrainer from the same peft adapter "
        "(B drawn nonzero: policy != reference), or every weight trained against the reference "
        f"computed once (full); float32: step 0, then {DPO_STEPS} AdamW steps"
    )
    print(table(rows, columns))
    return [line for r in rows for line in dpo_failures(r)]


def dpo_failures(row):
    """What of one Part 5 case disagrees with trl, one line: the token ids or masks; the step-0 loss
    beyond 1e-5 relative, a reward beyond 1e-6 absolute and 1e-4 relative (a reward is beta times a
    difference of sums of float32 log-probabilities: 1e-5 relative is float32's own noise); over
    the steps, a loss, reward or gradient norm beyond 1e-3 relative, an accuracy not equal."""
    worst = max(row["loss_rel"], row["rewards_rel"], row["grad_rel"])
    checks = {
        "token ids or answer masks": row["tokens"],
        "step-0 loss": row["loss0_rel"] <= 1e-5,
        "step-0 rewards": row["rewards0_near"],
        "step count": row["steps"] == (DPO_STEPS, DPO_STEPS),
        "per-step loss, rewards or grad norm": worst <= 1e-3,
        "per-step accuracies": row["accuracies"],
    }
    wrong = [what for what, ok in checks.items() if not ok]
    return [f"{row['name']}: DPO differs from trl's in {', '.join(wrong)}"] if wrong else []


def parse(argv):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-python", help="a python with torch and transformers (the venv's)")
    parser.add_argument("--out", help="where checkpoints and logits go (default: a temporary dir)")
    parser.add_argument("--export", help="also check this mode=export dir, or a RUN_DIR with hf/")
    parser.add_argument("--prompt", default=PROMPT, help="what --export's model answers (greedy)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.worker or args.torch_python):
        parser.error("--torch-python is required (the venv with torch and transformers)")
    return args


def main(argv):
    """Every part, the summary, and an AssertionError listing whatever disagrees."""
    args = parse(argv)
    if args.worker:
        return worker(args.worker)
    # A float32 parity check: on CPU the matmuls are exact float32 (no TF32 as on a GPU).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    import jax

    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="check-hf-"))
    export = args.export and export_dir(os.path.abspath(args.export))
    os.makedirs(out, exist_ok=True)
    start = time.time()
    run_worker(args.torch_python, "make", out)
    versions = json.loads(pathlib.Path(out, "versions.json").read_text())
    print(machine())
    print(
        f"python {platform.python_version()}, jax {jax.__version__}, torch {versions['torch']}, "
        f"transformers {versions['transformers']}; files in {out}"
    )
    rows = part1(out, args.torch_python, export, args.prompt)
    report_part1(rows, out)
    if export:
        rows.append(part2(export, out, args.prompt))
    bad = [failures(row) for row in rows]
    print(
        f"\n{sum(not b for b in bad)} of {len(rows)} checkpoints agree (tolerance {TOLERANCE:g} "
        f"of the largest logit); {time.time() - start:.0f}s"
    )
    bad.append(report_part3(part3(out, args.torch_python)))
    bad.append(report_part4(*part4(out, args.torch_python)))
    bad.append(report_part5(part5(out, args.torch_python)))
    assert not any(bad), "\n".join(line for lines in bad for line in lines)


if __name__ == "__main__":
    main(sys.argv[1:])
