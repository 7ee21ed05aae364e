"""The puzzle decoders end to end: a tiny TRM overfits four puzzles, then every decoder decodes them through
mode=eval (its JSON line, the forward passes it spent, predictions.csv), and mode=generate solves one given
on the command line. Its own file so that the test runner can run it beside the other TRM tests."""
import json
import os

import jax
import numpy as np

import data
import train
from conftest import BASE, SUDOKU, args, config, metrics


def cfg_for(tmp_path, *overrides):
    return config(tmp_path, *overrides, preset=SUDOKU)


def test_overfits_a_handful_and_eval_keeps_givens(tmp_path, capsys):
    q, a = data.generate_sudoku(4, 45, 0, stream='handful')
    path = str(tmp_path / 'four.csv')
    data.write_sudoku_csv(path, q, a)
    common = [f'dataset_path={path}', f'eval_path={path}', 'augment=false', 'per_device_batch=4', 'd_model=64',
              'mlp_dim=128', 'learning_rate=3e-3', 'weight_decay=0', 'warmup_steps=10', 'trm.ema_decay=0.9',
              'log_every=50', 'trm.halt_explore_prob=1',  # every puzzle trains both supervision steps
              'trm.eval_halt=false']  # decoder=trm runs every step (halting: test_trm.py)
    s = train.run(cfg_for(tmp_path, *common, 'steps=200', 'checkpoint_every=0', 'eval_every=200'), jax.devices()[:1])
    assert s['eval_exact_accuracy'] == 1.0  # the TRM decoder (the in-training eval): all N_sup=2 steps
    row = metrics(s['run_dir'])[-1]
    assert row['eval_decoder'] == 'trm' and row['eval_forward_passes'] == 2
    assert len(row['eval_exact_accuracy_per_step']) == 2 and 0 < row['eval_cell_accuracy'] <= 1

    # mode=eval on the same checkpoint with every decoder: its JSON line (the same as eval.json), the forward
    # passes it spent, and predictions.csv keeping the givens.
    def evaluate(decoder):
        capsys.readouterr()
        assert train.main(['train.py', BASE, *eval_args, f'run_name=ev-{decoder}', f'decoder={decoder}']) == 0
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert r == json.load(open(os.path.join(tmp_path, f'ev-{decoder}', 'eval.json')))
        assert r['decoder'] == decoder and r['num_puzzles'] == 4 and r['step'] == 200 and 0 <= r['value_auroc'] <= 1
        got_q, got_grid = data.read_sudoku_csv(os.path.join(tmp_path, f'ev-{decoder}', 'predictions.csv'))
        np.testing.assert_array_equal(got_q, q)
        assert ((got_grid == q) | (q == 0)).all()
        return r

    eval_args = args(tmp_path, *common, 'mode=eval', f'load_params={s["run_dir"]}', preset=SUDOKU)
    trm = evaluate('trm')
    assert trm['exact_accuracy'] == 1.0 and trm['forward_passes'] == 2 and len(trm['exact_accuracy_per_step']) == 2
    # The policy's answer at the root already obeys the rules (the net memorised these four), so greedy and
    # every search stop there: one pass of one supervision step (tot.policy_steps = tot.value_step = 1).
    for decoder in ('greedy', 'tot'):  # beam_logp and tot_shuffled differ from tot only in the ranking (test_tot.py)
        r = evaluate(decoder)
        assert r['exact_accuracy'] == 1.0 and r['forward_passes'] == 1 and 'exact_accuracy_per_step' not in r
    # mode=generate solves one puzzle given on the command line, keeping its givens.
    puzzle = ''.join('.' if d == 0 else str(d) for d in q[0])
    assert train.main(['train.py', BASE, *args(tmp_path, *common, 'mode=generate', 'run_name=gen',
                                               f'load_params={s["run_dir"]}', f'prompt={puzzle}', preset=SUDOKU)]) == 0
    assert 'a valid solution' in capsys.readouterr().out
    assert open(os.path.join(tmp_path, 'gen', 'solution.txt')).read().strip() == ''.join(map(str, a[0]))
