"""DPO (task=dpo): preference pairs read in trl's formats, the loss and trl's reward metrics against a numpy
computation of the same formula, and a run that trains, evaluates and resumes. torch and trl are not in the suite:
tests/check_hf.py compares with trl's DPOTrainer by hand."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import args, host_env, losses, metrics, start_trainer, trainer_results
from conftest import config as lm_config
from flax import nnx
from test_hardware import free_port
from test_hf import PRESET, TINY, forward, write_rows
from test_lora import built, kicked

import model as model_lib
import train

DPO = model_lib.DPO


def text_pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"prompt": f"What is {a} + {b}? ", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a, b in rng.integers(0, 50, (n, 2))
    ]


def chat_pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    turn = lambda role, text: [{"role": role, "content": text}]
    return [
        {
            "prompt": turn("user", f"What is {a} + {b}?"),
            "chosen": turn("assistant", str(a + b)),
            "rejected": turn("assistant", str(a - b)),
        }
        for a, b in rng.integers(0, 50, (n, 2))
    ]


def dpo_keys(tmp_path, qwen, rows, *keys, rank=4):
    files = write_rows(tmp_path / "pairs.jsonl", rows)
    return [
        f"load_hf={qwen}",
        "dataset=hf",
        "hf_path=json",
        f"hf_data_files={files}",
        *TINY,
        "task=dpo",
        f"lora.rank={rank}",
        "per_device_batch=2",
        *keys,
    ]


def pairs_of(tmp_path, qwen, rows):
    """The DPOData of these rows (a run's config, resolved) and its tokenizer."""
    cfg = lm_config(tmp_path, *dpo_keys(tmp_path, qwen, rows), preset=PRESET)
    cfg = train.resolve(train.pretrained(cfg), DPO, "cpu")
    ds = train.data.make_dataset(cfg, source=DPO.dataset)
    return ds, ds.tokenizer


def test_preference_rows_tokenize_as_trl_does(tmp_path, qwen):
    """Text pairs: the prompt and each answer as one text, eos after it (not twice where it ends in eos); chat pairs
    through the template whole, the prompt with its generation prompt; a row without a prompt shares theirs (the
    characters or turns chosen and rejected start with, a space before they part going to the answers). The answer
    mask starts where both sides' tokens leave the prompt's own; a pair is one row, chosen then rejected."""
    eos = "<|im_end|>"  # the tokenizer's eos_token
    rows = [{"prompt": "What is 2 + 2? ", "chosen": "4", "rejected": "5" + eos}] * 40
    ds, tok = pairs_of(tmp_path, qwen, rows)
    assert tok.special["eos_token"] == eos
    (c_ids, c_mask), (r_ids, r_mask) = ds.train_tokens[0]
    prompt = tok.encode("What is 2 + 2? ")
    assert c_ids.tolist() == tok.encode("What is 2 + 2? 4") + [tok.eos_id]
    assert r_ids.tolist() == tok.encode("What is 2 + 2? 5") + [tok.eos_id]  # one eos
    same = lambda ids: next((k for k, (a, b) in enumerate(zip(ids, prompt)) if a != b), len(prompt))
    start = min(same(c_ids.tolist()), same(r_ids.tolist()))
    assert c_mask.tolist() == [k >= start for k in range(len(c_ids))]
    # the space is its own token in this small BPE: it stays the prompt's
    assert tok.decode(c_ids[c_mask].tolist()) == "4" and tok.decode(r_ids[r_mask].tolist()) == "5"
    row = ds._row([ds.train_tokens[0]])
    n = len(c_ids) - 1
    assert row["segment_ids"][: n + len(r_ids) - 1].tolist() == [1] * n + [2] * (len(r_ids) - 1)
    assert row["positions"][n] == 0 and row["inputs"][n] == r_ids[0]

    chat = chat_pairs(40)
    ds, tok = pairs_of(tmp_path, qwen, chat)
    (c_ids, c_mask), _ = ds.train_tokens[0]
    render = lambda text: tok.encode(text)
    first = chat[1]  # row 0 is held out (every 32nd)
    user = f"<|im_start|>user\n{first['prompt'][0]['content']}<|im_end|>\n"
    answer = f"<|im_start|>assistant\n{first['chosen'][0]['content']}<|im_end|>\n"
    assert c_ids.tolist() == render(user + answer)
    head = len(render(user + "<|im_start|>assistant\n"))
    assert c_mask.tolist() == [k >= head for k in range(len(c_ids))]

    shared = [{"chosen": "Sky: blue", "rejected": "Sky: grey"}] * 40
    ds, tok = pairs_of(tmp_path, qwen, shared)
    (c_ids, c_mask), (r_ids, r_mask) = ds.train_tokens[0]
    assert (
        tok.decode(c_ids[c_mask].tolist()) == " blue"
        and tok.decode(r_ids[r_mask].tolist()) == " grey"
    )
    turns = [
        {"chosen": c["prompt"] + c["chosen"], "rejected": c["prompt"] + c["rejected"]} for c in chat
    ]
    ds, _ = pairs_of(tmp_path, qwen, turns)
    assert [a.tolist() for side in ds.train_tokens[0] for a in side] == [
        a.tolist() for side in pairs_of(tmp_path, qwen, chat)[0].train_tokens[0] for a in side
    ]


@pytest.mark.parametrize(
    "row,says",
    [
        ({"prompt": "Q? ", "chosen": "A"}, r"row 1: a preference row holds chosen and rejected"),
        ({"prompt": "Q? ", "chosen": "A", "rejected": 5}, r"row 1: rejected is a number \(5\)"),
        (
            {"prompt": [{"role": "user", "content": "Q?"}], "chosen": "A", "rejected": "B"},
            r"row 1: chosen is text \(\"A\"\), expected a list of turns",
        ),
    ],
)
def test_a_wrong_preference_row_is_one_line_naming_it(tmp_path, qwen, row, says):
    with pytest.raises(train.data.DataError, match=r"^hf_split=train: " + says):
        pairs_of(tmp_path, qwen, [row] * 40)


def logp(c, params, ids, mask):
    """An answer's summed log-probability, by numpy from the model's logits of its sequence alone."""
    logits = forward(c, params, ids[None, :-1])[0].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.sum(logprobs[np.arange(len(ids) - 1), ids[1:]] * mask[1:]))


@pytest.mark.slow
def test_the_dpo_loss_and_rewards_equal_a_numpy_computation(tmp_path, qwen):
    """With the adapters moved off zero: each side's log-probability summed over its answer's tokens, from logits of
    the chosen and the rejected sequence run alone (no pair packed in a row), for the adapted model and for the base
    (the reference); the loss the mean over pairs of -log sigmoid(beta x the margin), trl's rewards beta (pi - ref),
    margins their difference, accuracies how often chosen's is strictly the higher."""
    rows = text_pairs(40) + [{"prompt": "Q: ", "chosen": "yes", "rejected": "no, not at all"}]
    keys = dpo_keys(tmp_path, qwen, rows, "dpo.beta=0.5")
    cfg, mesh, _, state = built(tmp_path, qwen, *keys[1:])
    ds = train.data.make_dataset(cfg, source=DPO.dataset)
    state = kicked(state, scale=0.3)
    pairs = [ds.train_tokens[i] for i in ds.train_ids[:6]]
    batch = {k: np.stack([ds._row([p])[k] for p in pairs]) for k in ds.fields}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
        graph = model_lib.abstract(cfg)[0]
        loss, sums = jax.jit(lambda p, b: model_lib.dpo_loss(cfg, graph, p, b))(
            train.weights(state, DPO), batch
        )
    plain_cfg, _, _, plain = built(tmp_path, qwen)

    policy = np.array([[logp(cfg, train.weights(state, DPO), *side) for side in p] for p in pairs])
    reference = np.array([[logp(plain_cfg, plain["params"], *side) for side in p] for p in pairs])
    rewards = 0.5 * (policy - reference)
    margin = rewards[:, 0] - rewards[:, 1]
    want = np.mean(np.log1p(np.exp(-margin)))
    assert abs(float(rewards[:, 0].std())) > 1e-3  # the adapters moved the policy
    metrics_ = model_lib.dpo_rewards(sums, sums["weight"])
    assert float(sums["weight"]) == 6
    np.testing.assert_allclose(float(loss) / 6, want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics_["rewards/chosen"]), rewards[:, 0].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics_["rewards/rejected"]), rewards[:, 1].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics_["rewards/margins"]), margin.mean(), rtol=1e-4)
    assert float(metrics_["rewards/accuracies"]) == pytest.approx(np.mean(margin > 0))
    np.testing.assert_allclose(float(metrics_["logps/chosen"]), policy[:, 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics_["logps/rejected"]), policy[:, 1].mean(), rtol=1e-5)


def test_a_dpo_run_trains_evaluates_and_names_trl_s_metrics(tmp_path, qwen):
    """task=dpo on chat pairs, LoRA on: step 1 is trl's starting point (loss ln 2, rewards 0, accuracy 0: the policy
    is the reference); the loss falls on pairs it sees again; metrics.jsonl carries rewards/chosen, /rejected,
    /margins, /accuracies every logged step and eval_ each on the held-out pairs; mode=eval scores every held-out
    pair."""
    keys = dpo_keys(
        tmp_path,
        qwen,
        chat_pairs(64),
        "steps=12",
        "learning_rate=3e-2",
        "warmup_steps=0",
        "eval_every=6",
    )
    unset = [o for o in PRESET if not o.startswith("eval_batches=")]  # every held-out pair
    out = train.run(lm_config(tmp_path, *keys, preset=unset), jax.devices()[:1])
    rows = metrics(out["run_dir"])
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    # the policy's forward and the reference's compile apart: equal to float rounding
    assert rows[0]["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    names = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert all(names <= set(r) for r in rows)
    assert {f"eval_{n}" for n in names} <= set(rows[5])
    assert rows[-1]["loss"] < rows[0]["loss"]
    json.dumps(rows)


@pytest.mark.slow
def test_a_full_fine_tune_s_reference_is_computed_once_kept_and_resumed_exactly(tmp_path, qwen):
    """Without LoRA the reference is the starting weights: one pass before step 1 writes every pair's log-probabilities
    to RUN_DIR/dpo_reference.npz (numpy's of the checkpoint, held-out pairs too), step 1 is trl's start (ln 2), and a
    resume reads them back rather than computing them from the weights it has then: 2 steps on two devices resumed to
    5 on one equal 5 straight (to float rounding; a constant rate, so the cut run's schedule is the same). mode=eval
    scores the held-out pairs against the same reference; a missing or another data's reference is one line."""
    keys = dpo_keys(
        tmp_path,
        qwen,
        text_pairs(70),
        "learning_rate=1e-2",
        "warmup_steps=0",
        "min_lr_ratio=1.0",
        rank=0,
    )
    keys = [k for k in keys if not k.startswith("per_device_batch=")]
    unset = [o for o in PRESET if not o.startswith("eval_batches=")]  # every held-out pair
    run = lambda name, n, *more: train.run(
        lm_config(
            tmp_path, *keys, f"run_name={name}", f"per_device_batch={2 // n}", *more, preset=unset
        ),
        jax.devices()[:n],
    )
    straight = run("straight", 1, "steps=5")
    rows = metrics(straight["run_dir"])
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05 and rows[-1]["rewards/margins"] > 0
    run("cut", 2, "steps=2")
    again = run("cut", 1, "steps=5")
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(again["run_dir"])], [r["loss"] for r in rows], rtol=1e-5
    )
    stored = np.load(tmp_path / "cut" / "dpo_reference.npz")
    ds, _ = pairs_of(tmp_path, qwen, text_pairs(70))
    cfg, _, _, start = built(tmp_path, qwen)
    for table, tokens, ids in (
        (stored["train"], ds.train_tokens, ds.train_ids[:3]),
        (stored["held"], ds.eval_tokens, ds.eval_ids),
    ):
        want = [[logp(cfg, start["params"], *side) for side in tokens[i]] for i in ids]
        np.testing.assert_allclose(table[ids], want, rtol=1e-5)

    evaluated = run("cut", 1, "mode=eval")
    assert evaluated["pairs"] == len(ds.eval_ids)
    assert evaluated["rewards/margins"] == pytest.approx(
        metrics(again["run_dir"])[-1]["eval_rewards/margins"], rel=1e-5
    )
    os.remove(tmp_path / "cut" / "dpo_reference.npz")
    with pytest.raises(
        train.data.DataError, match=r"dpo_reference.npz is missing: the reference log-prob"
    ):
        run("cut", 1, "steps=6")
    np.savez(tmp_path / "cut" / "dpo_reference.npz", **{**stored, "train_pairs": "other"})
    with pytest.raises(
        train.data.DataError,
        match=r"dpo_reference.npz: its reference log-probabilities are of other",
    ):
        run("cut", 1, "steps=6")


@pytest.mark.slow
def test_two_processes_compute_the_reference_a_single_one_does(tmp_path, qwen):
    """A full fine-tune on 2 processes x 1 CPU device (gloo on loopback): the reference pass splits the pairs between
    the processes and gathers every pair's, so both write the dpo_reference.npz one process on 2 devices writes (to
    float rounding), and train to its losses."""
    keys = dpo_keys(tmp_path, qwen, text_pairs(70), "steps=3", "per_device_batch=1", rank=0)
    keys += ["learning_rate=1e-2", "warmup_steps=0"]

    def run(name, processes):
        port = free_port()
        env = lambda i: {"JAX_NUM_CPU_DEVICES": str(2 // processes), **host_env(port, processes, i)}
        line = ["base.yml", *args(tmp_path, *keys, f"run_name={name}", preset=PRESET)]
        procs = [start_trainer([line], **env(i)) for i in range(processes)]
        try:
            done = [trainer_results(p)[1][0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert [code for code, _ in done] == [0] * processes, [err[-2000:] for _, err in done]
        return np.load(tmp_path / name / "dpo_reference.npz")

    one, two = run("one", 1), run("two", 2)
    assert np.any(one["train"] != 0) and np.any(one["held"] != 0)
    for part in ("train", "held"):
        np.testing.assert_allclose(one[part], two[part], rtol=1e-6)
        assert str(one[f"{part}_pairs"]) == str(two[f"{part}_pairs"])  # the same pairs' digests
    assert losses(tmp_path / "one") == pytest.approx(losses(tmp_path / "two"), rel=1e-5)
