"""TRM head: gradient only through the last cycle, the deep-supervision carry, halting targets, EMA,
host-side scoring, and exact resume with the carry (end to end decoding: test_tot.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SUDOKU, config, init_trm, metrics, sudoku_batch
from flax import nnx

import data
import model as model_lib
import train


def cfg_for(tmp_path, *overrides):
    return config(tmp_path, *overrides, preset=SUDOKU)


def test_gradient_flows_only_through_the_last_cycle(tmp_path):
    b = sudoku_batch(2)
    cfg = cfg_for(tmp_path, "trm.T=3", "trm.n=1")
    m, params, yz = init_trm(cfg, b)
    fresh = jnp.zeros(2, bool)

    def loss(p, y, z, model=m):
        logits = nnx.merge(model, p)(b["inputs"], b["positions"], b["segment_ids"], y, z, fresh)[2]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    # A perturbation of the state entering the recursion (the carry, then the T-1 no-grad cycles) gets
    # no gradient ...
    got, gy, gz = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, yz, yz)
    assert not jnp.any(gy) and not jnp.any(gz)
    # ... while the parameters do: exactly those of one cycle (T=1) run from the state after T-1 cycles.
    one = model_lib.abstract(cfg_for(tmp_path, "trm.T=1", "trm.n=1"))[0]
    cycle = jax.jit(
        lambda y, z: nnx.merge(one, params)(
            b["inputs"], b["positions"], b["segment_ids"], y, z, fresh
        )[:2]
    )
    want = jax.jit(jax.grad(lambda p, y, z: loss(p, y, z, one)))(params, *cycle(*cycle(yz, yz)))
    assert all(
        jnp.any(g) for k in ("embed", "net", "head") for g in jax.tree.leaves(want[k])
    )  # (not the
    # halting head or y/z_init: they are not in this loss)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4), got, want)


class FakeModel(nnx.Module):
    """Stands in for TRM in trm_loss: y <- (0 if fresh else y) + 1, chosen logits and halting logits."""

    def __init__(self, logits, q):
        self.logits, self.q = nnx.Variable(logits), nnx.Variable(q)

    def __call__(self, inputs, positions, segment_ids, y, z, fresh, noise=None):
        y = jnp.where(fresh[:, None, None], 0.0, y) + 1
        return y, z, self.logits[...], self.q[...], jnp.zeros(len(self.q[...]))


def test_carry_refills_halted_slots_and_halting_targets(tmp_path):
    cfg = cfg_for(
        tmp_path,
        "trm.N_sup=3",
        "trm.halt_explore_prob=0",
        "trm.halt_loss_weight=0.5",
        "tot.loss_weight=0",
    )
    new, old = sudoku_batch(4, seed=1), sudoku_batch(4, seed=2)
    carry = {
        "y": jnp.full((4, 81, 32), 5.0),
        "z": jnp.zeros((4, 81, 32)),
        "inputs": old["inputs"],
        "targets": old["targets"],
        "steps": jnp.array([7, 1, 2, 1]),
        "halted": jnp.array([True, False, False, False]),
    }
    # Slot 0 (refilled) and slot 1 are predicted exactly; slots 2 and 3 get one cell wrong.
    targets = jnp.concatenate([new["targets"][:1], old["targets"][1:]])
    logits = 20.0 * jax.nn.one_hot(targets.at[2:, 0].set(targets[2:, 0] % 10 + 1), 11)
    q = jnp.array([0.5, -1.0, -1.0, 2.0])
    mb = {**new, "carry": carry, "key": jax.random.key(0), "step": 0}
    loss, sums = model_lib.trm_loss(cfg, *nnx.split(FakeModel(logits, q)), mb)
    c = sums["carry"]
    np.testing.assert_array_equal(c["inputs"][0], new["inputs"][0])  # halted slot: fresh puzzle
    np.testing.assert_array_equal(c["inputs"][1:], old["inputs"][1:])  # the others keep theirs
    np.testing.assert_array_equal(c["targets"][1:], old["targets"][1:])
    np.testing.assert_array_equal(c["steps"], [1, 2, 3, 2])
    np.testing.assert_array_equal(
        c["y"][:, 0, 0], [1, 6, 6, 6]
    )  # fresh from y_init, others from their carry
    # Halts: q > 0 (slots 0, 3) or N_sup reached (slot 2).
    np.testing.assert_array_equal(c["halted"], [True, False, True, True])
    # Halting target: 1 where the whole grid is right (slots 0, 1), else 0.
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(1)
    bce = optax.sigmoid_binary_cross_entropy(q, jnp.array([1.0, 1.0, 0.0, 0.0]))
    np.testing.assert_allclose(loss, jnp.sum(ce) + 0.5 * jnp.sum(bce), rtol=1e-6)
    assert sums["exact"] == 2 and sums["halted"] == 3 and sums["halt_steps"] == 1 + 3 + 2


def test_train_noise_kicks_the_latent(tmp_path):
    """trm.train_noise=s: in training z gets s x N(0, 1) after its update (T=1, n=1: the z returned), its own
    draw per row, the same again for the same key; s=0 is the plain step, whatever the key."""
    b, carry = (
        sudoku_batch(4),
        jax.tree.map(lambda x: x[0], model_lib.trm_carry(cfg_for(tmp_path), 1, 4)),
    )
    graph, params, _ = init_trm(cfg_for(tmp_path, "trm.T=1", "trm.n=1"), b)

    def z_after(scale, seed):
        cfg = cfg_for(tmp_path, "trm.T=1", "trm.n=1", f"trm.train_noise={scale}")
        mb = {**b, "carry": carry, "key": jax.random.key(seed), "step": 0}
        return model_lib.trm_loss(cfg, graph, params, mb)[1]["carry"]["z"]

    plain = z_after(0, 0)
    np.testing.assert_array_equal(z_after(0, 1), plain)
    kick = z_after(0.5, 0) - plain
    np.testing.assert_array_equal(z_after(0.5, 0) - plain, kick)
    assert abs(float(jnp.std(kick)) - 0.5) < 0.02 and abs(float(jnp.mean(kick))) < 0.02
    assert not np.allclose(kick[0], kick[1]) and not np.allclose(z_after(0.5, 1) - plain, kick)


def test_ema_update():
    ema, p = {"w": jnp.full(3, 2.0)}, {"w": jnp.full(3, 4.0)}
    np.testing.assert_allclose(model_lib.ema_update(0.9, 100, ema, p)["w"], 0.9 * 2 + 0.1 * 4)
    np.testing.assert_allclose(
        model_lib.ema_update(0.999, 0, ema, p)["w"], 0.1 * 2 + 0.9 * 4
    )  # warmup: (1+0)/(10+0)


def test_halting_head_stops_decoding():
    # Three puzzles, four steps, one trajectory. 'first': the first puzzle halts at step 2 (its first q > 0), the
    # second never (keeps the last step's answer), the third at step 1 even though q dips below 0 later.
    # 'best': each step keeps the answer with the highest q so far (the third moves to step 3's, q 3 > 2;
    # ties keep the earlier step, so the second keeps step 1's).
    preds = (
        jnp.arange(4)[:, None, None] * 10 + jnp.arange(3)[None, :, None] + jnp.zeros((4, 3, 2), int)
    )
    q = jnp.array([[-1.0, -1.0, 2.0], [3.0, -1.0, -5.0], [-2.0, -1.0, 3.0], [1.0, -1.0, 1.0]])
    pick = lambda rule: model_lib.pick_answers(preds[:, :, None], q[:, :, None], rule)
    got, passes = pick("first")
    np.testing.assert_array_equal(passes, [2, 4, 1])
    np.testing.assert_array_equal(got[:, :, 0], [[0, 1, 2], [10, 11, 2], [10, 21, 2], [10, 31, 2]])
    got, passes = pick("best")
    np.testing.assert_array_equal(passes, [4, 4, 4])
    np.testing.assert_array_equal(got[:, :, 0], [[0, 1, 2], [10, 1, 2], [10, 1, 22], [10, 1, 22]])
    np.testing.assert_array_equal(pick("last")[0], preds)


def test_vote_picks_the_answer_most_steps_call_right():
    """trm.eval_halt=vote over (step, trajectory) pairs: the answer given most often with q > 0 wins over a
    single surer one; ties go to the highest q, and with no q > 0 it is the highest q (best's answer)."""
    # One puzzle, three steps, two trajectories: answers 7 (q 5 at step 0), 8 (q 1 at steps 1, 2 of trajectory
    # 0 and q 2 at step 2 of trajectory 1), 9 with q < 0.
    preds = jnp.array([[7, 9], [8, 9], [8, 8]])[:, None, :, None] + jnp.zeros((3, 1, 2, 4), int)
    q = jnp.array([[5.0, -1.0], [1.0, -2.0], [1.0, 2.0]])[:, None]
    got, passes = model_lib.pick_answers(preds, q, "vote")
    np.testing.assert_array_equal(
        got[:, 0, 0], [7, 7, 8]
    )  # step 1: 7 and 8 one vote each, 7 surer; step 2: 8 x 3
    assert passes[0] == 6
    got, _ = model_lib.pick_answers(
        preds, -jnp.abs(q) - jnp.array([0.0, 1.0, 2.0])[:, None, None], "vote"
    )
    np.testing.assert_array_equal(got[:, 0, 0], [9, 9, 9])  # no q > 0: the highest q, -1 at step 0
    np.testing.assert_array_equal(got, model_lib.pick_answers(preds, -jnp.abs(q), "best")[0])


@pytest.mark.slow
def test_parallel_trajectories_are_picked_by_the_halting_head(tmp_path):
    """decoder=trm_parallel: without noise every trajectory is the plain TRM (stopped by its halting head),
    so K=4 decodes as the plain TRM does; with noise the pick differs from the plain run, each trajectory's
    steps count as passes, and a puzzle's draws do not depend on the batch around it."""
    b = sudoku_batch(4)
    q = b["inputs"] - 1
    cfg = cfg_for(tmp_path, "trm.N_sup=3", "parallel.trajectories=1")
    m, params, _ = init_trm(cfg, b)
    decode = lambda *o: jax.jit(
        lambda q: model_lib.parallel_decode(cfg_for(tmp_path, "trm.N_sup=3", *o), m, params, q, 3)
    )
    preds, _, _, q_SN = model_lib.trm_steps(cfg, m, params, q, 3)
    want, halts = model_lib.pick_answers(preds[:, :, None], q_SN[:, :, None], cfg.trm.eval_halt)
    got, passes = decode("parallel.trajectories=4", "parallel.noise=0")(q)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(passes, 4 * halts)
    noisy = decode("parallel.trajectories=4", "parallel.noise=1")
    got, passes = noisy(q)
    assert (np.asarray(got) != np.asarray(want)).any() and (np.asarray(passes) >= 4).all()
    np.testing.assert_array_equal(noisy(q[1:3])[0], got[:, 1:3])


@pytest.mark.slow
def test_adaptive_width_pays_only_for_unsure_puzzles(tmp_path):
    """parallel.extra_trajectories E: a puzzle whose answer is unsure after J trajectories is picked from all
    J + E exactly as J + E trajectories at once would pick it, and pays for them; a sure one (parallel.sure_votes
    pairs with q > 0 give its answer) pays for J only; a puzzle's result does not depend on the batch around it."""
    b = sudoku_batch(4)
    q = b["inputs"] - 1
    cfg = cfg_for(tmp_path, "trm.N_sup=3")
    m, params, _ = init_trm(cfg, b)
    decode = lambda *o: jax.jit(
        lambda q: model_lib.parallel_decode(
            cfg_for(tmp_path, "trm.N_sup=3", "trm.eval_halt=vote", *o), m, params, q, 3
        )
    )
    wide, wide_passes = decode("parallel.trajectories=6", "parallel.noise=1")(q)
    got, passes = decode(
        "parallel.trajectories=2",
        "parallel.extra_trajectories=4",
        "parallel.noise=1",
        "parallel.sure_votes=99",
    )(q)  # every puzzle unsure
    np.testing.assert_array_equal(got, wide)
    np.testing.assert_array_equal(passes, wide_passes)
    # Without noise both trajectories agree; the halting bias moved so that two puzzles' answers get q > 0 at
    # some step (2 votes: sure) and two never (unsure).
    q_SN = model_lib.trm_steps(cfg, m, params, q, 3).halt_SN
    bias = lambda path, x: (
        x - jnp.median(q_SN.max(0)) if "halt_bias" in jax.tree_util.keystr(path) else x
    )
    params = jax.tree_util.tree_map_with_path(bias, params)
    adaptive = decode(
        "parallel.trajectories=2",
        "parallel.extra_trajectories=4",
        "parallel.noise=0",
        "parallel.sure_votes=2",
    )
    got, passes = adaptive(q)
    np.testing.assert_array_equal(passes, np.where(q_SN.max(0) > jnp.median(q_SN.max(0)), 6, 18))
    np.testing.assert_array_equal(got, decode("parallel.trajectories=6", "parallel.noise=0")(q)[0])
    np.testing.assert_array_equal(adaptive(q[1:3])[0], got[:, 1:3])


def test_the_budget_caps_the_mean_passes_and_widens_the_least_sure_first(tmp_path):
    """parallel.budget: the unsure puzzles widen fewest votes first, as many as the batch's mean passes
    per real puzzle can pay for; a sure puzzle and a padding row never do; through parallel_decode every
    puzzle unsure, the mean stays within the budget."""
    votes, unsure = jnp.array([5, 1, 3, 9, 0]), jnp.array([True, True, True, False, True])
    real, passes = jnp.array([True, True, True, True, False]), jnp.full(5, 10)
    widen = lambda budget: np.asarray(
        model_lib.within_budget(budget, votes, unsure, passes, real, 10)
    ).tolist()
    assert widen(15) == [False, True, True, False, False]  # (15 - 10) x 4 real = 2 widenings
    assert widen(13) == [False, True, False, False, False]  # 12 spare: one
    assert widen(40) == [True, True, True, False, False] and widen(10) == [False] * 5
    b = sudoku_batch(4)
    cfg = cfg_for(tmp_path, "trm.N_sup=3")
    m, params, _ = init_trm(cfg, b)
    o = ("parallel.trajectories=2", "parallel.extra_trajectories=4", "parallel.sure_votes=99")
    capped = cfg_for(tmp_path, "trm.N_sup=3", *o, "parallel.budget=12")
    _, passes = jax.jit(lambda q: model_lib.parallel_decode(capped, m, params, q, 3))(
        b["inputs"] - 1
    )
    assert sorted(np.asarray(passes).tolist()) == [6, 6, 18, 18]  # 4 x 12 = 48 passes: 24 + 2 x 12


def test_scoring_overwrites_givens_and_checks_rules():
    q, a = data.generate_sudoku(3, 45, 0, stream="score")
    b = data._sudoku_batch(q, a, 4)  # row 3 is padding and must be skipped
    preds = np.array(b["targets"])[None].repeat(2, 0)  # [S=2, B, L]: every blank right ...
    preds[:, 0, q[0] != 0] = 2  # ... but row 0's givens predicted wrong: overwritten, still solved
    preds[1, 1, :81][q[1] == 0] = 2  # step 2: row 1's blanks all "1": wrong and against the rules
    sc = model_lib.sudoku_scores(preds, b)
    exact_S, cells_S, grids, blanks = sc["exact_S"], sc["cells_S"], sc["grids_BL"], sc["blanks"]
    assert sc["puzzles"] == 3 and blanks == (q == 0).sum()
    np.testing.assert_array_equal(exact_S, [3, 2])
    np.testing.assert_array_equal(grids[0], a[0])
    assert (
        cells_S[0] == blanks
        and cells_S[1] == blanks - (q[1] == 0).sum() + (a[1][q[1] == 0] == 1).sum()
    )


@pytest.mark.slow
def test_carry_is_checkpointed_and_resume_is_exact(tmp_path):
    args = [
        "per_device_batch=4",
        "steps=6",
        "checkpoint_every=3",
        "trm.halt_explore_prob=0.5",
        "tot.loss_weight=0.2",
        "tot.start_step=2",
        "tot.value_step=2",
    ]  # value pass on mid-run, read at step 2
    ref = train.run(cfg_for(tmp_path, *args, "run_name=ref"), jax.devices()[:1])
    train.run(cfg_for(tmp_path, *args, "steps=3"), jax.devices()[:1])
    train.run(cfg_for(tmp_path, *args), jax.devices()[:1])
    want, got = metrics(ref["run_dir"]), metrics(tmp_path / "default")
    assert [(r["loss"], r["halt_rate"]) for r in got] == [(r["loss"], r["halt_rate"]) for r in want]
    # value_acc is logged once the value pass runs: state step 2 (tot.start_step) is logged as step 3.
    assert ["value_acc" in r for r in want] == [False, False, True, True, True, True]
    assert all(0 <= r["value_acc"] <= 1 for r in want[2:])
