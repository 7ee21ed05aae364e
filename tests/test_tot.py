"""ToT head: the value head's training states and range, the search against greedy decoding and an
oracle value, one compile per batch shape, and the eval JSON of every decoder."""
import jax
import jax.numpy as jnp
import numpy as np

import data
import model as model_lib
import train
from test_trm import cfg_for, init, puzzles


def oracle(a_BL, uniform=True):
    """A perfect value function (log 1 while every digit agrees with the solution, else ~log 0) with a
    uniform policy: it alone has to find the digits."""
    def evaluate(g_NL):
        a_NL = jnp.repeat(a_BL, g_NL.shape[0] // a_BL.shape[0], axis=0)
        right_N = jnp.all((g_NL == 0) | (g_NL == a_NL), axis=-1)
        return jnp.full(g_NL.shape + (9,), -jnp.log(9.0)), jnp.where(right_N, 0.0, -1e9)
    return evaluate


def easy(n, seed=0, blanks=30):
    q, a = data.generate_sudoku(n, blanks, seed, stream='tot')
    return jnp.asarray(q, jnp.int32), jnp.asarray(a, jnp.int32)


def test_oracle_value_solves_easy_puzzles_and_log_prob_alone_does_not():
    for blanks in (30, 58):
        q, a = easy(4, blanks=blanks)
        search = lambda score: model_lib.tree_search(oracle(a), q, 2, 9, 1, 81, 10_000, score)
        grids, evals = jax.jit(lambda: search('value'))()
        np.testing.assert_array_equal(grids, a)
        assert bool(model_lib.solved(grids).all()) and (np.asarray(evals) <= 10_000).all()
    # Same search ranked by the (uniform) policy's log-prob: it keeps the first legal digits it tries, and
    # on sparse puzzles the rule checks alone do not rescue it.
    grids, _ = jax.jit(lambda: search('logp'))()
    assert not bool((grids == a).all(-1).any())


def test_width_one_reproduces_greedy_and_compiles_once(tmp_path):
    cfg = cfg_for(tmp_path, 'd_model=32')
    b = puzzles(3)
    m, params, _ = init(cfg, b)
    evaluate = lambda g: train.trm_steps(cfg, m, params, g, 1)[1:]  # an untrained net: arbitrary but fixed
    q_BL = b['inputs'] - 1
    greedy, passes = jax.jit(lambda q: model_lib.greedy_fill(evaluate, q))(q_BL)
    search = jax.jit(lambda q: model_lib.tree_search(evaluate, q, 1, 1, 1, 81, 10_000))
    grids, evals = search(q_BL)
    np.testing.assert_array_equal(grids, greedy)
    np.testing.assert_array_equal(evals, passes)
    assert (np.asarray(passes) <= (q_BL == 0).sum(1) + 1).all()  # the puzzle + one per move at most
    assert ((greedy == q_BL) | (q_BL == 0)).all() and (greedy > 0).all()  # givens kept, every blank filled
    # Other puzzles with other numbers of blanks: the same compiled search (shapes depend on the batch only).
    q2 = jnp.asarray(data.generate_sudoku(3, 60, 1, stream='tot')[0], jnp.int32)
    search(q2)
    assert search._cache_size() == 1


def test_partial_states_labels_and_value_range(tmp_path):
    q, a = data.generate_sudoku(64, 45, 0, stream='partial')
    q, a = jnp.asarray(q, jnp.int32), jnp.asarray(a, jnp.int32)
    g, label = train.partial_states(jax.random.key(3), q, a)
    filled = g != 0
    wrong = (filled & (g != a)).sum(1)
    blanked = np.asarray((q != 0) & (g == 0)).any(1)           # givens blanked: odd rows only (sparser states)
    assert not blanked[::2].any() and blanked[1::2].mean() > 0.7
    assert ((g == q) | (q == 0) | (g == 0) | ~label[:, None]).all()  # a right grid keeps every given it shows
    np.testing.assert_array_equal(wrong, np.where(label, 0, 1))  # right grids have no wrong digit, others one
    assert 0.3 < float(label.mean()) < 0.7
    # Wrong digits avoid clashing with the grid where some digit allows it (a solver's kind of mistake).
    clash = jnp.take_along_axis(model_lib.digits_seen(g), jnp.maximum(g - 1, 0)[..., None], -1)[..., 0] & filled
    assert int(clash.any(1).sum()) < int((~label).sum()) // 2
    cfg = cfg_for(tmp_path)
    m, params, _ = init(cfg, puzzles(2))
    v = jnp.exp(train.trm_steps(cfg, m, params, g, 1)[2])
    assert v.shape == (64,) and bool(((v >= 0) & (v <= 1)).all())
    bce = train.value_bce(jnp.log(jnp.array([0.9, 0.9])), jnp.array([True, False]))
    np.testing.assert_allclose(bce, [-np.log(0.9), -np.log(0.1)], rtol=1e-5)
    assert train.auroc(np.array([0.9, 0.8, 0.1]), np.array([True, True, False])) == 1.0
