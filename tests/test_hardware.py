"""Hardware: README presets AOT-compiled for their TPU slices, multi-process runs, device fallback,
the batch-size ramp."""
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import jax
import pytest

import train
from conftest import ROOT
from test_train import BASE, TINY, logged_losses, tiny


def readme_presets():
    """(slice, overrides) for every TPU row of README's preset table: the test reads the README, so
    the commands users copy are the ones compiled here."""
    rows = re.findall(r'^\| TPU (v\S+) \|.*?`python train\.py base\.yml ([^`]*)`', open(os.path.join(ROOT, 'README.md')).read(),
                      re.M)
    return [(name, shlex.split(args)) for name, args in rows]


def test_readme_has_every_preset():
    names = [name for name, _ in readme_presets()]
    assert names == list(train.TPU_SLICES), names


@pytest.fixture
def fast_tpu_compiles():
    """libtpu compiles for any TPU slice on this CPU. Least compiler effort makes it ~5x faster and the
    reported memory slightly larger (so a fit here is a fit there); it is a JAX option, not a config key."""
    pytest.importorskip('libtpu', reason='libtpu is not installed: pip install -r tests/requirements.txt')
    old = jax.config.jax_exec_time_optimization_effort
    jax.config.update('jax_exec_time_optimization_effort', -1.0)
    yield
    jax.config.update('jax_exec_time_optimization_effort', old)


# Every CI run compiles the two rows at the ends of the table (the 8 GiB v2 core and the
# multi-host v4-64 pod); ALL_TPU_PRESETS=1 compiles all eight (~2 minutes more: the suite's time budget).
CI_PRESETS = ('v2-8', 'v4-64')
PRESETS = [p for p in readme_presets() if os.environ.get('ALL_TPU_PRESETS') or p[0] in CI_PRESETS]


@pytest.mark.parametrize('name,overrides', PRESETS, ids=[n for n, _ in PRESETS])
def test_readme_preset_fits_its_tpu_slice(name, overrides, fast_tpu_compiles, capsys):
    result = train.run(train.load_config(BASE, overrides + [f'compile_topology={name}']))
    out = capsys.readouterr().out
    assert result['fits'], out
    assert result['bytes_per_device'] <= result['hbm_bytes'] and 'fits' in out and 'temporaries' in out


def test_oversized_config_does_not_fit_v2_8(fast_tpu_compiles, capsys):
    """A 375M model without remat at batch 16 x 1024 per core needs about twice a v2 core's 8 GiB."""
    code = train.main(['train.py', BASE, 'compile_topology=v2-8', 'mesh=1,8,1', 'per_device_batch=16',
                       'remat=none', 'd_model=1024', 'num_layers=24', 'num_heads=16', 'num_kv_heads=16',
                       'mlp_dim=2816', 'vocab_size=32768', 'max_target_length=1024'])
    out = capsys.readouterr().out
    assert code == train.DOES_NOT_FIT, out
    assert 'does not fit' in out and 'remat=full' in out and 'per_device_batch=8 grad_accum=2' in out


def test_mesh_that_needs_another_slice_says_so():
    """A v4-32 is 16 devices: mesh=4,4,2 is a v4-64's mesh. Fails before compiling, libtpu or not."""
    pytest.importorskip('libtpu', reason='libtpu is not installed: pip install -r tests/requirements.txt')
    with pytest.raises(train.ConfigError, match='needs 32 devices but JAX sees 16 tpu'):
        train.run(train.load_config(BASE, ['compile_topology=v4-32', 'mesh=4,4,2']))


# ---- multi-host -------------------------------------------------------------------------------------
def test_two_processes_train_like_one(tmp_path):
    """2 processes x 4 CPU devices on loopback (gloo collectives) log the same losses as 1 x 8."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    args = [a for a in TINY if not a.startswith('prefetch')] + [
        f'output_dir={tmp_path}', 'mesh=2,-1,1', 'per_device_batch=2', 'grad_accum=2', 'steps=4', 'prefetch=1']
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
    launch = lambda run, devices, extra_env: subprocess.Popen(
        [sys.executable, 'train.py', 'base.yml', *args, f'run_name={run}'], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, 'JAX_NUM_CPU_DEVICES': str(devices), **extra_env})
    procs = [launch('one', 8, {})] + [
        launch('two', 4, {'JAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}', 'JAX_PROCESS_COUNT': '2',
                          'JAX_PROCESS_INDEX': str(i)}) for i in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert '8 x cpu (cpu), 2 process(es)' in outs[1]
    assert 'devices:' not in outs[2] and 'step=' not in outs[2]  # only process 0 prints (gloo's C++ lines aside)
    one, two = ({'run_dir': os.path.join(tmp_path, r)} for r in ('one', 'two'))
    assert len(logged_losses(one)) == 4
    assert logged_losses(one) == pytest.approx(logged_losses(two), rel=1e-5)


def test_half_set_distributed_env_is_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', '127.0.0.1:1234')
    monkeypatch.delenv('JAX_PROCESS_COUNT', raising=False)
    monkeypatch.delenv('JAX_PROCESS_INDEX', raising=False)
    assert train.main(['train.py', BASE]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count('\n') == 0 and 'JAX_PROCESS_COUNT' in err and 'JAX_PROCESS_INDEX' in err, err


# ---- devices ----------------------------------------------------------------------------------------
def test_absent_platform_falls_back_with_a_warning(tmp_path, capsys):
    devices = train.pick_devices(tiny(tmp_path, 'platform=tpu'))
    assert devices[0].platform == 'cpu'
    assert 'WARNING: platform=tpu' in capsys.readouterr().out


def test_absent_platform_strict_is_an_error(tmp_path, capsys):
    assert train.main(['train.py', BASE, 'platform=tpu', 'platform_strict=true', f'output_dir={tmp_path}']) == 2
    assert 'platform=tpu: no tpu devices' in capsys.readouterr().err


def test_tpu_dims_warning_names_the_keys(tmp_path, capsys):
    train.warn_tpu_dims(tiny(tmp_path, 'd_model=96', 'num_heads=4', 'mlp_dim=256', 'vocab_size=1000'))
    out = capsys.readouterr().out
    assert 'd_model=96' in out and 'vocab_size=1000' in out and 'mlp_dim' not in out.split('(')[0]


# ---- batch-size ramp --------------------------------------------------------------------------------
def test_ramp_schedule(tmp_path):
    cfg = tiny(tmp_path, 'grad_accum=8', 'batch_ramp_start=1', 'batch_ramp_every=3')
    assert [train.accum_at(cfg, s) for s in range(12)] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8]
    assert train.accum_at(tiny(tmp_path, 'grad_accum=8'), 0) == 8  # no ramp: always grad_accum


def test_ramp_follows_schedule_compiles_few_variants_and_resumes_exactly(tmp_path):
    ramp = ['grad_accum=4', 'batch_ramp_start=1', 'batch_ramp_every=1', 'steps=4', 'checkpoint_every=3',
            'keep_checkpoints=5', 'per_device_batch=2', 'mesh=1,1,1']
    summary = train.run(tiny(tmp_path, *ramp), jax.devices()[:1])
    rows = [json.loads(line) for line in open(os.path.join(summary['run_dir'], 'metrics.jsonl'))]
    assert [r['tokens_per_step'] for r in rows] == [a * 2 * 32 for a in (1, 2, 4, 4)]
    assert summary['step_variants'] == 3  # one compile per distinct microbatch count
    # Resume from the step-3 checkpoint: step 4 (4 microbatches, data read on from mid-ramp) is bit-identical.
    losses = logged_losses(summary)
    shutil.rmtree(os.path.join(summary['run_dir'], 'checkpoints', '4'))
    again = train.run(tiny(tmp_path, *ramp), jax.devices()[:1])
    assert logged_losses(again) == losses
