"""ToT head and the puzzle decoders: the value head's training states, the search against greedy decoding
and an oracle value, forced moves, one compile per batch shape, and end to end a tiny TRM that overfits four
puzzles, then every decoder through mode=eval (its JSON line, forward passes, predictions.csv) and
mode=generate."""

import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, SUDOKU, args, config, init_trm, metrics, sudoku_batch

import data
import model as model_lib
import train
from model import Search


def oracle(a_BL):
    """A perfect value function (log 1 while every digit agrees with the solution, else ~log 0) with a
    uniform policy: it alone has to find the digits. It reads only the grid (a state agrees with at most
    its own puzzle's solution), so it holds however the search orders or regroups its rows."""

    def evaluate(g_NL):
        right_N = jnp.any(jnp.all((g_NL[:, None] == 0) | (g_NL[:, None] == a_BL), axis=-1), axis=1)
        return (
            jnp.full(g_NL.shape + (9,), -jnp.log(9.0)),
            jnp.where(right_N, 0.0, -1e9),
            jnp.zeros(len(g_NL)),
        )

    return evaluate


def easy(n, seed=0, blanks=30):
    q, a = data.generate_sudoku(n, blanks, seed, stream="tot")
    return jnp.asarray(q, jnp.int32), jnp.asarray(a, jnp.int32)


def test_oracle_value_solves_easy_puzzles_and_log_prob_alone_does_not():
    for blanks in (30, 58):
        q, a = easy(4, blanks=blanks)
        search = lambda score, q=q, a=a: model_lib.tree_search(
            oracle(a), q, Search(2, 9, 1, 81, 10_000, score)
        )
        grids, evals = jax.jit(functools.partial(search, "value"))()
        np.testing.assert_array_equal(grids, a)
        assert bool(data.solved(grids).all()) and (np.asarray(evals) <= 10_000).all()
    # Same search ranked by the (uniform) policy's log-prob: it keeps the first legal digits it tries, and
    # on sparse puzzles the rule checks alone do not rescue it.
    grids, _ = jax.jit(lambda: search("logp"))()
    assert not bool((grids == a).all(-1).any())


def test_finished_puzzles_leave_the_batch_without_changing_a_result():
    """16 puzzles: 12 end within a few steps, then the 4 left go on in a batch of 4. Each puzzle's grid
    and count equal those of batches of 4 (too small to shrink)."""
    q, a = (jnp.concatenate(x) for x in zip(easy(12, blanks=4), easy(4, seed=1, blanks=40)))

    def as_in_batches_of_4(
        decode,
    ):  # the whole batch's (grids, counts), checked against 4 batches of 4
        decode = jax.jit(decode)
        grids, counts = decode(q)
        parts = [decode(q[i : i + 4]) for i in range(0, 16, 4)]
        np.testing.assert_array_equal(grids, np.concatenate([g for g, _ in parts]))
        np.testing.assert_array_equal(counts, np.concatenate([n for _, n in parts]))
        return grids, counts

    grids, evals = as_in_batches_of_4(
        lambda q: model_lib.tree_search(oracle(a), q, Search(2, 9, 1, 81, 10_000, "value"))
    )
    np.testing.assert_array_equal(grids, a)
    assert int(evals[:12].max()) < int(evals[12:].min())
    # Greedy decoding leaves the batch the same way (with the uniform policy it fills the 4-blank puzzles
    # in 4 moves; the 40-blank ones go on, in the batch of 4, until they hit a dead end).
    _, passes = as_in_batches_of_4(lambda q: model_lib.tree_search(oracle(a), q, Search()))
    assert int(passes[:12].max()) < int(passes[12:].max())


def known_policy(q, a, wrong, halting=False):
    """For 2 puzzles: a policy that knows the solution, except that with `wrong` the first blank's likeliest
    digit is a wrong one (the right one 2nd). Its halting head (with `halting`) is an oracle on the state's
    argmax answer: q > 0 exactly when it is the solution; without, it never halts."""

    def evaluate(g_NL):
        a_NL, q_NL = (jnp.repeat(x, g_NL.shape[0] // 2, axis=0) for x in (a, q))
        rows, blank_N = jnp.arange(len(a_NL)), jnp.argmax(q_NL == 0, axis=1)
        bad_NL = a_NL.at[rows, blank_N].set(
            jnp.where(wrong, a_NL[rows, blank_N] % 9 + 1, a_NL[rows, blank_N])
        )
        logp_NLC = jnp.log(
            jax.nn.one_hot(bad_NL - 1, 9) * 0.5 + jax.nn.one_hot(a_NL - 1, 9) * 0.3 + 0.2 / 9
        )
        right_N = jnp.all(model_lib.fill_argmax(g_NL, logp_NLC) == a_NL, axis=1)
        return logp_NLC, jnp.zeros(g_NL.shape[0]), jnp.where(halting & right_N, 1.0, -1.0)

    return evaluate


def test_a_policy_answer_that_obeys_the_rules_ends_the_search():
    """Every evaluated state's argmax fill is checked: a policy that already knows the solution costs
    the puzzle's one pass, in greedy and in the search; one wrong digit in its answer costs more."""
    q, a = easy(2, blanks=50)
    both = jax.jit(
        lambda w: (
            model_lib.tree_search(known_policy(q, a, w), q, Search(2, 2, 1, 81, 10_000, "value")),
            model_lib.tree_search(known_policy(q, a, w), q, Search()),
        )
    )
    for wrong in (False, True):
        (grids, evals), (greedy, passes) = both(wrong)
        np.testing.assert_array_equal(grids, a)
        np.testing.assert_array_equal(greedy, a)
        assert (
            (np.asarray(evals) > 1).tolist() == (np.asarray(passes) > 1).tolist() == [wrong, wrong]
        )


def test_without_rule_checks_the_halting_head_ends_the_search():
    """tot.rule_checks=false: no rule masks a move and only the halting head says when an answer is done.
    A policy that knows the solution stops at the root if its head says so, else fills every blank (one
    pass per move). With one wrong surest digit, nothing rejects it: greedy commits to it, while the
    search also tries the right sibling, which the halting head accepts."""
    q, a = easy(2, blanks=50)
    decode = jax.jit(
        lambda w, h: (
            model_lib.tree_search(
                known_policy(q, a, w, h), q, Search(2, 2, 1, 81, 10_000, "value", rules=False)
            ),
            model_lib.tree_search(known_policy(q, a, w, h), q, Search(rules=False)),
        )
    )
    (grids, evals), (greedy, passes) = decode(False, True)
    np.testing.assert_array_equal(grids, a)
    np.testing.assert_array_equal(greedy, a)
    assert np.asarray(evals).tolist() == np.asarray(passes).tolist() == [1, 1]
    _, (greedy, passes) = decode(False, False)
    np.testing.assert_array_equal(greedy, a)
    assert np.asarray(passes).tolist() == [51, 51]
    (grids, _), (greedy, _) = decode(True, True)
    np.testing.assert_array_equal(grids, a)
    assert not (np.asarray(greedy) == np.asarray(a)).all(-1).any()


UNITS = (
    [[r * 9 + c for c in range(9)] for r in range(9)]
    + [[r * 9 + c for r in range(9)] for c in range(9)]
    + [
        [(br * 3 + i) * 9 + bc * 3 + j for i in range(3) for j in range(3)]
        for br in range(3)
        for bc in range(3)
    ]
)


def forced_in_plain_python(grid):
    """Independent of model.py: naked and hidden singles, one cell at a time, until none is left."""
    g = list(grid)
    legal = lambda i: (
        set() if g[i] else set(range(1, 10)) - {g[j] for u in UNITS if i in u for j in u}
    )
    changed = True
    while changed:
        changed = False
        for i in range(81):
            if len(legal(i)) == 1:
                g[i], changed = legal(i).pop(), True
        for u in UNITS:
            for d in range(1, 10):
                spots = [i for i in u if d in legal(i)]
                if len(spots) == 1:
                    g[spots[0]], changed = d, True
    return g


def fewest_options(g_NL):
    """A policy from the rules alone: uniform over each cell's legal digits, so a search's surest cell is the
    one with the fewest options (a classic solver's branching). No value, no halting head."""
    ok_NLC = data.legal_digits(g_NL)
    logp_NLC = jnp.where(
        ok_NLC, -jnp.log(jnp.maximum(jnp.sum(ok_NLC, -1, keepdims=True), 1)), -jnp.inf
    )
    return logp_NLC, jnp.zeros(len(g_NL)), jnp.zeros(len(g_NL))


def test_forced_moves_match_plain_python_and_make_a_solver():
    """tot.propagate: fill_forced reaches the same grid as a plain-Python propagation, every digit it fills is
    the solution's, and a best-first search that propagates solves minimal puzzles from a rules-only policy
    in far fewer evaluated states than the same search without it."""
    q, a = (jnp.asarray(x, jnp.int32) for x in data.generate_sudoku(6, 81, seed=5, stream="tot"))
    forced = np.asarray(jax.jit(model_lib.fill_forced)(q))
    assert forced.tolist() == [forced_in_plain_python(g) for g in q.tolist()]
    assert ((forced == 0) | (forced == np.asarray(a))).all() and (forced > 0).sum() > (q > 0).sum()
    search = jax.jit(
        lambda p: model_lib.tree_search(
            fewest_options, q, Search(1, 9, 1, 500, 2_000, "value", frontier=64, propagate=p)
        ),
        static_argnums=0,
    )
    (solver, evals), (_, plain_evals) = search(True), search(False)
    np.testing.assert_array_equal(solver, a)
    assert int(np.sum(evals)) * 4 < int(np.sum(plain_evals)), (evals, plain_evals)


def test_frontier_backtracks_where_the_beam_commits():
    """A decoy: the policy's surest move is a wrong digit that breaks no rule, and the value head rates that
    state highest (0.9), but every state after it low (0.01, as a wrong grid should be). A width-1 beam
    commits to the decoy and fails; with a frontier the search goes back to the right sibling (0.5)."""
    q, a = easy(2, blanks=40)
    legal_wrong = ~data.digits_seen(q) & (jnp.arange(1, 10) != a[..., None]) & (q == 0)[..., None]
    cell_B = jnp.argmax(
        jnp.any(legal_wrong, -1), axis=1
    )  # a blank cell where some wrong digit is legal
    wrong_B = jnp.argmax(legal_wrong[jnp.arange(2), cell_B], axis=1) + 1
    decoy_BL = q.at[jnp.arange(2), cell_B].set(wrong_B)

    def evaluate(g_NL):
        r = g_NL.shape[0] // 2
        a_NL, d_NL, c_N, w_N = (jnp.repeat(x, r, axis=0) for x in (a, decoy_BL, cell_B, wrong_B))
        # Every cell: the right digit 0.42 sure, another 0.43 (so the policy's own fill is no solution).
        p_NLC = jax.nn.one_hot(a_NL - 1, 9) * 0.4 + jax.nn.one_hot(a_NL % 9, 9) * 0.41 + 0.19 / 9
        sure_NC = (
            jax.nn.one_hot(w_N - 1, 9) * 0.5
            + jax.nn.one_hot(a_NL[jnp.arange(len(c_N)), c_N] - 1, 9) * 0.3
        )
        p_NLC = p_NLC.at[jnp.arange(len(c_N)), c_N].set(
            sure_NC + 0.2 / 9
        )  # the decoy 0.5, the right digit 0.3
        v_N = jnp.where(jnp.all((g_NL == 0) | (g_NL == a_NL), -1), 0.5, 0.01)
        v_N = jnp.where(jnp.all(g_NL == d_NL, -1), 0.9, v_N)
        return jnp.log(p_NLC), jnp.log(v_N), jnp.zeros(len(g_NL))

    search = lambda frontier: model_lib.tree_search(
        evaluate, q, Search(1, 2, 1, 500, 10_000, "value", frontier=frontier)
    )
    beam, _ = jax.jit(lambda: search(0))()
    best_first, evals = jax.jit(lambda: search(8))()
    assert not bool((beam == a).all(-1).any())
    np.testing.assert_array_equal(best_first, a)
    assert (np.asarray(evals) <= 2 * 41 + 1).all()  # no wider than two children per filled cell


def test_max_depth_and_max_thoughts_cut_the_search_short():
    """With the oracle value the search solves 40-blank puzzles one cell a step (40 steps); max_depth=3
    stops it after 3 steps (at most 1 + 3 x W x E states), max_thoughts=20 once 20 states were evaluated."""
    q, a = easy(2, blanks=40)
    W, E = 2, 9
    search = jax.jit(
        lambda depth, thoughts: model_lib.tree_search(
            oracle(a), q, Search(W, E, 1, depth, thoughts, "value")
        ),
        static_argnums=(0, 1),
    )
    full, full_evals = search(81, 10_000)
    np.testing.assert_array_equal(full, a)
    assert (np.asarray(full_evals) > 20 + W * E).all()
    for depth, thoughts in ((3, 10_000), (81, 20)):
        grids, evals = (np.asarray(x) for x in search(depth, thoughts))
        assert not (grids == a).all(-1).any(), (depth, thoughts)
        if depth == 3:
            assert (evals <= 1 + 3 * W * E).all() and ((q != grids) & (grids != 1)).sum(
                1
            ).max() <= 3, evals
        else:  # the step that reaches 20 evaluations is the last: it adds at most W x E
            assert ((evals >= 20) & (evals < 20 + W * E)).all(), evals


def hashed_policy(g_NL):
    """Arbitrary but fixed scores, from integer arithmetic on the grid: every (cell, digit) of a row gets its
    own, 0.1 apart (unnormalised: a search only compares them), so no tie lets float rounding pick a move."""
    mix_NLC = jnp.arange(81 * 9).reshape(81, 9) * 271 + jnp.sum(g_NL, -1)[:, None, None] * 13
    return (mix_NLC % 729) / 10.0 - 73.0, *(jnp.zeros(len(g_NL)),) * 2


def plain_greedy(evaluate, q_L):
    """Independent of model.py's search: fill the surest legal (cell, digit), run the policy again, until the
    policy's answer obeys the rules, no legal move is left, or a move leaves a dead end."""
    g, passes = np.asarray(q_L), 1
    logp = np.asarray(evaluate(jnp.asarray(g)[None])[0][0])
    while not data.solved(np.where(g == 0, logp.argmax(-1) + 1, g)[None])[0]:
        legal = np.where(data.legal_digits(g), logp, -np.inf)
        cell, digit = divmod(int(legal.argmax()), 9)
        if (
            np.isinf(legal.max())
            or data.dead_end(np.where(np.arange(81) == cell, digit + 1, g)[None])[0]
        ):
            break
        g, passes = np.where(np.arange(81) == cell, digit + 1, g), passes + 1
        logp = np.asarray(evaluate(jnp.asarray(g)[None])[0][0])
    return np.where(g == 0, logp.argmax(-1) + 1, g), passes


def test_greedy_is_the_width_one_search_and_compiles_once():
    """decoder=greedy runs tree_search with one state and one one-cell thought: it matches a plain-Python
    greedy loop grid for grid and pass for pass, and other puzzles reuse the one compiled search."""
    q, _ = easy(4, blanks=45)
    search = jax.jit(lambda q: model_lib.tree_search(hashed_policy, q, Search()))
    grids, passes = search(q)
    want = [plain_greedy(hashed_policy, q_L) for q_L in q]
    np.testing.assert_array_equal(grids, np.stack([g for g, _ in want]))
    assert np.asarray(passes).tolist() == [p for _, p in want] and max(p for _, p in want) > 3
    search(jnp.asarray(data.generate_sudoku(4, 60, 1, stream="tot")[0], jnp.int32))
    assert search._cache_size() == 1


def plain_dfs(evaluate, q_L, budget):
    """Independent of model.py's search: recursive backtracking, each state filled by singles
    (data.by_singles) and evaluated once, branching at its surest legal cell over the legal digits in
    the policy's order, a dead end skipped. -> (solution or the last state's policy answer, states)."""
    evals, last = [0], [None]

    def visit(g):  # a solution, or None once every branch under g is tried or the budget is spent
        evals[0] += 1
        logp = np.asarray(evaluate(jnp.asarray(g)[None])[0][0])
        last[0] = np.where(g == 0, logp.argmax(-1) + 1, g)
        if data.solved(last[0][None])[0] or evals[0] >= budget:
            return last[0]
        legal = np.where(data.legal_digits(g), logp, -np.inf)
        cell = int(legal.max(-1).argmax())
        for digit in np.argsort(-legal[cell], kind="stable"):
            kid = data.by_singles(np.where(np.arange(81) == cell, digit + 1, g)[None])[0]
            if np.isinf(legal[cell, digit]) or data.dead_end(kid[None])[0]:
                continue
            if (found := visit(kid)) is not None:
                return found
        return None

    root = data.by_singles(np.asarray(q_L)[None])[0]
    if data.dead_end(root[None])[0]:
        evals[0] += 1
        return np.where(
            root == 0, np.asarray(evaluate(jnp.asarray(root)[None])[0][0]).argmax(-1) + 1, root
        ), 1
    visit(root)
    return last[0], evals[0]


def test_depth_first_search_is_complete_and_matches_plain_python():
    """tot.search=dfs: with a policy that knows nothing (hashed scores) it solves every puzzle, hard ones
    (>= 100 guesses of a plain search) too, state for state as a plain-Python backtracking search does,
    whether the puzzles share a batch that shrinks or not; a puzzle with no solution ends with every branch
    tried, unsolved; the budget stops a search where it stands."""
    q, a = (
        jnp.asarray(np.concatenate(x), jnp.int32)
        for x in zip(
            data.generate_sudoku(11, 45, 1, stream="dfs"),
            data.generate_sudoku(4, 81, 1, stream="dfs", min_guesses=100),
        )
    )
    # a legal given that is wrong: no solution, found out only some states down
    broken = next(
        g
        for k in range(11, 15)
        for cell in np.flatnonzero(q[k] == 0)
        for d in range(1, 10)
        if d != a[k, cell] and data.legal_digits(np.asarray(q[k]))[cell, d - 1]
        for g in [np.where(np.arange(81) == cell, d, np.asarray(q[k]))]
        if not data.dead_end(data.by_singles(g[None]))[0] and plain_dfs(hashed_policy, g, 99)[1] > 2
    )
    q = jnp.concatenate([q, jnp.asarray(broken)[None]])
    dfs = jax.jit(
        lambda q, budget: model_lib.depth_first_search(hashed_policy, q, budget), static_argnums=1
    )
    grids, evals = (np.asarray(x) for x in dfs(q, 10_000))
    want = [plain_dfs(hashed_policy, q_L, 10_000) for q_L in q]
    np.testing.assert_array_equal(evals, [e for _, e in want])
    np.testing.assert_array_equal(grids, np.stack([g for g, _ in want]))
    np.testing.assert_array_equal(grids[:15], a)
    assert not data.solved(grids[15:]).any() and evals[11:15].max() > 2 and evals[15] > 2
    for i in range(0, 16, 4):  # batches of 4 never shrink
        np.testing.assert_array_equal(dfs(q[i : i + 4], 10_000)[1], evals[i : i + 4])
    short = np.asarray(dfs(q[11:15], 2)[1])
    assert (short <= 2).all() and (short == np.minimum(evals[11:15], 2)).all()


@pytest.mark.slow
def test_partial_states_labels_and_where_the_value_is_read(tmp_path):
    q, a = data.generate_sudoku(64, 45, 0, stream="partial")
    q, a = jnp.asarray(q, jnp.int32), jnp.asarray(a, jnp.int32)
    g, label = jax.jit(model_lib.partial_states)(jax.random.key(3), q, a)
    filled = g != 0
    wrong = (filled & (g != a)).sum(1)
    blanked = np.asarray((q != 0) & (g == 0)).any(
        1
    )  # givens blanked: odd rows only (sparser states)
    assert not blanked[::2].any() and blanked[1::2].mean() > 0.7
    assert (
        (g == q) | (q == 0) | (g == 0) | ~label[:, None]
    ).all()  # a right grid keeps every given it shows
    np.testing.assert_array_equal(
        wrong, np.where(label, 0, 1)
    )  # right grids have no wrong digit, others one
    assert 0.3 < float(label.mean()) < 0.7
    # Wrong digits avoid clashing with the grid where some digit allows it (a solver's kind of mistake).
    clash = (
        jnp.take_along_axis(data.digits_seen(g), jnp.maximum(g - 1, 0)[..., None], -1)[..., 0]
        & filled
    )
    assert int(clash.any(1).sum()) < int((~label).sum()) // 2
    # Eval draws them per puzzle: a puzzle gets the same state in a batch of 64 as in one of 8 (value_auroc
    # does not depend on the eval batch), still about half of them right and half sparse.
    pg, pl = jax.jit(model_lib.puzzle_partial_states)(jax.random.key(3), q, a)
    pg8, pl8 = jax.jit(model_lib.puzzle_partial_states)(jax.random.key(3), q[8:16], a[8:16])
    np.testing.assert_array_equal(pg[8:16], pg8)
    np.testing.assert_array_equal(pl[8:16], pl8)
    np.testing.assert_array_equal(((pg != 0) & (pg != a)).sum(1), np.where(pl, 0, 1))
    assert 0.3 < float(pl.mean()) < 0.7 and 0.3 < float(((q != 0) & (pg == 0)).any(1).mean()) < 0.7
    # The value is read after supervision step tot.value_step (2 here) however many steps run after it.
    cfg = config(tmp_path, "tot.value_step=2", preset=SUDOKU)
    m, params, _ = init_trm(cfg, sudoku_batch(2))
    log_v = {
        n: jax.jit(lambda g, n=n: model_lib.trm_steps(cfg, m, params, g, n).log_value_N)(g)
        for n in (1, 2, 3)
    }
    assert log_v[2].shape == (64,)
    np.testing.assert_array_equal(log_v[3], log_v[2])
    assert not np.allclose(log_v[1], log_v[2])
    bce = model_lib.value_bce(jnp.log(jnp.array([0.9, 0.9])), jnp.array([True, False]))
    np.testing.assert_allclose(bce, [-np.log(0.9), -np.log(0.1)], rtol=1e-5)
    assert model_lib.auroc(np.array([0.9, 0.8, 0.1]), np.array([True, True, False])) == 1.0


# ---- every decoder end to end --------------------------------------------------------------------
@pytest.mark.slow
def test_overfits_a_handful_and_eval_keeps_givens(tmp_path, capsys, monkeypatch):
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *_: one)  # the command line on one device
    q, a = data.generate_sudoku(4, 45, 0, stream="handful")
    path = str(tmp_path / "four.csv")
    data.write_sudoku_csv(path, q, a)
    common = [
        f"dataset_path={path}",
        f"eval_path={path}",
        "augment=false",
        "per_device_batch=4",
        "d_model=64",
        "mlp_dim=128",
        "learning_rate=3e-3",
        "weight_decay=0",
        "warmup_steps=10",
        "trm.ema_decay=0.9",
        "log_every=50",
        "trm.halt_explore_prob=1",  # every puzzle trains both supervision steps
        "trm.eval_halt=last",
    ]  # decoder=trm runs every step (halting: test_trm.py)
    # Solved from step 50 on (eval every 10 steps, 2026-11-23): 100 steps leave twice that.
    s = train.run(
        config(
            tmp_path, *common, "steps=100", "checkpoint_every=0", "eval_every=100", preset=SUDOKU
        ),
        jax.devices()[:1],
    )
    assert (
        s["eval_exact_accuracy"] == 1.0
    )  # the TRM decoder (the in-training eval): all N_sup=2 steps
    row = metrics(s["run_dir"])[-1]
    assert row["eval_decoder"] == "trm" and row["eval_forward_passes"] == 2
    assert len(row["eval_exact_accuracy_per_step"]) == 2 and 0 < row["eval_cell_accuracy"] <= 1

    # mode=eval on the same checkpoint with every decoder: its JSON line (the same as eval.json), the forward
    # passes it spent, and predictions.csv keeping the givens.
    def evaluate(decoder):
        capsys.readouterr()
        assert (
            train.main(
                ["train.py", BASE, *eval_args, f"run_name=ev-{decoder}", f"decoder={decoder}"]
            )
            == 0
        )
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert r == json.loads(pathlib.Path(tmp_path, f"ev-{decoder}", "eval.json").read_text())
        assert (
            r["decoder"] == decoder
            and r["num_puzzles"] == 4
            and r["step"] == 100
            and 0 <= r["value_auroc"] <= 1
        )
        got_q, got_grid = data.read_sudoku_csv(
            os.path.join(tmp_path, f"ev-{decoder}", "predictions.csv")
        )
        np.testing.assert_array_equal(got_q, q)
        assert ((got_grid == q) | (q == 0)).all()
        return r

    eval_args = args(tmp_path, *common, "mode=eval", f"load_params={s['run_dir']}", preset=SUDOKU)
    trm = evaluate("trm")
    assert (
        trm["exact_accuracy"] == 1.0
        and trm["forward_passes"] == 2
        and len(trm["exact_accuracy_per_step"]) == 2
    )
    # The policy's answer at the root already obeys the rules (the net memorised these four), so the search
    # stops there: one pass of one supervision step (tot.policy_steps = tot.value_step = 1). greedy and beam_logp
    # are the same tree_search with another width or ranking (the tests above).
    r = evaluate("tot")
    assert (
        r["exact_accuracy"] == 1.0
        and r["forward_passes"] == 1
        and "exact_accuracy_per_step" not in r
    )
    # mode=generate solves one puzzle given on the command line, keeping its givens.
    puzzle = "".join("." if d == 0 else str(d) for d in q[0])
    assert (
        train.main(
            [
                "train.py",
                BASE,
                *args(
                    tmp_path,
                    *common,
                    "mode=generate",
                    "run_name=gen",
                    f"load_params={s['run_dir']}",
                    f"prompt={puzzle}",
                    preset=SUDOKU,
                ),
            ]
        )
        == 0
    )
    assert "a valid solution" in capsys.readouterr().out
    assert pathlib.Path(tmp_path, "gen", "generation.txt").read_text().strip() == "".join(
        map(str, a[0])
    )
