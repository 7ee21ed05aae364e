"""Train a GQA transformer with JAX: python train.py base.yml [key=value ...]

Reads top to bottom in execution order: config, devices + mesh, sharding, model + optimizer, sharded
init, the step, metrics, the loop. Every knob lives in base.yml; hardware variants are overrides.
"""
import difflib
import json
import math
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import data
import model as model_lib


class ConfigError(Exception):
    """A user mistake in the config or command line: printed as one line, no traceback."""


# ==================================================================================================
# Config: base.yml + key=value overrides, typed by the defaults, strict about names.
# ==================================================================================================
class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML silently keeps the last of two equal keys; a config that sets a key twice is a mistake."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f'{node.start_mark.name}: key {key!r} is set twice (line '
                                  f'{key_node.start_mark.line + 1}); keep one')
            seen.add(key)
        return super().construct_mapping(node, deep)


class Config:
    """The resolved keys as attributes (cfg.steps; nested sections: cfg.trm.T). Not a dict on purpose:
    Flax freezes dict-valued module fields, and a plain object passes through untouched."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getitem__(self, key):
        return self.__dict__[key]

    def to_dict(self):
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.__dict__.items()}


def _flatten(d, prefix=''):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f'{prefix}{k}.'))
        else:
            out[f'{prefix}{k}'] = v
    return out


def _parse(key, text, default):
    """Parse an override string into the type of the key's default."""
    def fail(kind):
        raise ConfigError(f'{key}={text}: expected {kind} (the default is {default!r})')
    if isinstance(default, bool):
        if text.lower() in ('true', '1', 'yes'):
            return True
        if text.lower() in ('false', '0', 'no'):
            return False
        fail('true or false')
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            fail('an integer')
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            fail('a number')
    if isinstance(default, list):
        if text.startswith('['):  # YAML for nested lists such as logical_axis_rules
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                fail('a YAML list')
            return value if isinstance(value, list) else fail('a YAML list')
        elem = type(default[0]) if default else str
        return [_parse(key, t.strip(), elem(0) if elem in (int, float) else '') for t in text.split(',')]
    return text


def load_config(path, overrides=()):
    """base.yml + ['key=value', ...] -> Config. Raises ConfigError naming the key on any mistake."""
    try:
        with open(path) as f:
            raw = yaml.load(f, _UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f'cannot read config file {path}: {e.strerror}') from None
    except yaml.YAMLError as e:
        raise ConfigError(f'{path} is not valid YAML: {str(e).splitlines()[0]}') from None
    flat, given = _flatten(raw or {}), set()
    for item in overrides:
        key, eq, text = item.partition('=')
        if not eq:
            raise ConfigError(f'argument {item!r} is not key=value')
        if key in given:
            raise ConfigError(f'{key} is given twice on the command line; keep one')
        if key not in flat:
            close = difflib.get_close_matches(key, list(flat), n=1)
            hint = f'; did you mean {close[0]}?' if close else f'; the keys are listed in {path}'
            raise ConfigError(f'unknown key {key!r}{hint}')
        given.add(key)
        flat[key] = _parse(key, text, flat[key])
    cfg = Config()
    for key, value in flat.items():  # unflatten dotted keys into nested sections
        node = cfg
        *parents, leaf = key.split('.')
        for p in parents:
            node = node.__dict__.setdefault(p, Config())
        setattr(node, leaf, value)
    return cfg


CHOICES = {'task': ('lm', 'sudoku'), 'mode': ('train', 'eval'), 'remat': ('none', 'full', 'save_dots'),
           'dtype': ('float32', 'bfloat16', 'float16'), 'weight_dtype': ('float32', 'bfloat16'),
           'attention': ('xla', 'cudnn'), 'dataset': ('stdlib', 'files', 'tfds', 'synthetic'),
           'platform': ('', 'cpu', 'gpu', 'tpu')}


def validate(cfg):
    """Checks that need no devices; each message says what to change."""
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            raise ConfigError(f'{key}={cfg[key]!r}: choose one of {", ".join(repr(a) for a in allowed)}')
    for key in ('steps', 'log_every', 'per_device_batch', 'grad_accum', 'num_layers', 'd_model',
                'num_heads', 'num_kv_heads', 'mlp_dim', 'max_target_length', 'vocab_size'):
        if cfg[key] <= 0:
            raise ConfigError(f'{key}={cfg[key]}: must be positive')
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f'num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}')
    if not cfg.head_dim and cfg.d_model % cfg.num_heads:
        raise ConfigError(f'd_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}; '
                          'change one, or set head_dim explicitly')
    if model_lib.dims(cfg) % 2:
        raise ConfigError(f'head dim {model_lib.dims(cfg)} must be even for RoPE; set head_dim')
    if len(cfg.mesh) != len(cfg.mesh_axes):
        raise ConfigError(f'mesh={cfg.mesh} has {len(cfg.mesh)} entries but mesh_axes={cfg.mesh_axes} '
                          f'names {len(cfg.mesh_axes)}')
    if cfg.mesh.count(-1) > 1 or any(m == 0 or m < -1 for m in cfg.mesh):
        raise ConfigError(f'mesh={",".join(map(str, cfg.mesh))}: use positive sizes and at most one -1')
    t = cfg.trm
    if t.mixer not in ('attention', 'mlp'):
        raise ConfigError(f"trm.mixer={t.mixer!r}: choose one of 'attention', 'mlp'")
    if min(t.T, t.n, t.N_sup) < 1 or not 0 <= t.ema_decay < 1 or not 0 <= t.halt_explore_prob <= 1:
        raise ConfigError(f'trm: T={t.T}, n={t.n}, N_sup={t.N_sup} must be >= 1, ema_decay={t.ema_decay} in [0, 1), '
                          f'halt_explore_prob={t.halt_explore_prob} in [0, 1]')


# ==================================================================================================
# Devices and mesh. Only this file builds the mesh.
# ==================================================================================================
def pick_devices(cfg):
    """What JAX finds (TPU, then GPU, then CPU), or the platform asked for, with a loud fallback."""
    if cfg.platform:
        try:
            return jax.devices(cfg.platform)
        except RuntimeError:
            found = jax.default_backend()
            if cfg.platform_strict:
                raise ConfigError(f'platform={cfg.platform}: no {cfg.platform} devices here (JAX found '
                                  f'{found}); drop platform= or set platform_strict=false') from None
            log(f'WARNING: platform={cfg.platform} asked for, but JAX sees no such device; '
                f'falling back to {found}')
    return jax.devices()


def make_mesh(cfg, devices):
    n, shape = len(devices), list(cfg.mesh)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = n // known if n % known == 0 else -1
    if math.prod(shape) != n or -1 in shape:
        axes = ','.join(cfg.mesh_axes)
        raise ConfigError(f'mesh={",".join(map(str, cfg.mesh))} ({axes}) needs {abs(math.prod(shape))} devices '
                          f'but JAX sees {n} {devices[0].platform} device(s); use e.g. mesh=1,{n},1 '
                          f'or mesh=1,-1,1')
    # Auto axes: the compiler propagates shardings from our annotations (Explicit is make_mesh's default now).
    return jax.make_mesh(shape, cfg.mesh_axes, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


# ==================================================================================================
# Sharding: logical axis names -> mesh axes, through the one table in base.yml.
# ==================================================================================================
def axis_rules(cfg):
    """logical_axis_rules as flax wants them: ((logical, mesh_axes_or_None), ...)."""
    return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in cfg.logical_axis_rules)


def mesh_spec(logical, shape, cfg, mesh):
    """One array's PartitionSpec. A dimension keeps the longest prefix of its mesh axes that divides it
    (and no mesh axis twice), so odd sizes stay replicated instead of failing."""
    rules, used, out = dict(axis_rules(cfg)), set(), []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        if name is not None and name not in rules:
            raise ConfigError(f'logical axis {name!r} has no entry in logical_axis_rules; add [{name}, null]')
        axes = rules.get(name) or ()
        axes = (axes,) if isinstance(axes, str) else axes
        axes = [a for a in axes if a not in used and mesh.shape[a] > 1]
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*out)


def shardings_for(abstract_boxed, cfg, mesh):
    """NamedShardings for a tree whose parameters are flax LogicallyPartitioned boxes (others replicate)."""
    logical = nn.get_partition_spec(abstract_boxed)
    shapes = nn.unbox(abstract_boxed)
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, mesh_spec(spec, x.shape, cfg, mesh)),
                        logical, shapes, is_leaf=lambda x: isinstance(x, P))


def sharding_table(params, shardings):
    rows = [f'{"parameter":52s} {"shape":>20s}  sharding']
    for (path, x), (_, s) in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves_with_path(shardings)):
        rows.append(f'{jax.tree_util.keystr(path):52s} {str(x.shape):>20s}  {s.spec}')
    return '\n'.join(rows)


# ==================================================================================================
# Model, optimizer, and the sharded initial state.
# ==================================================================================================
def make_optimizer(cfg):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # no decay on norm scales
    adamw = optax.adamw(schedule, cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw
    return tx, schedule


def trm_carry(cfg, A, B):
    """The deep-supervision carry of task=sudoku, one slot per example row of the step ([A, B, ...]): its
    puzzle, answer state y, latent z, supervision steps taken, and whether it halted (all start halted,
    so the first step fills every slot). Boxed with logical axes so it shards over the batch like data."""
    box = lambda x, *names: nn.LogicallyPartitioned(x, (None, 'batch', 'length', 'embed')[:len(names) + 2])
    yz = jnp.zeros((A, B, data.SUDOKU_LEN, cfg.d_model), jnp.float32)
    grid = jnp.zeros((A, B, data.SUDOKU_LEN), jnp.int32)
    return {'y': box(yz, 1, 1), 'z': box(yz, 1, 1), 'inputs': box(grid, 1), 'targets': box(grid, 1),
            'steps': box(jnp.zeros((A, B), jnp.int32)), 'halted': box(jnp.ones((A, B), bool))}


def state_layout(cfg, mesh, model, tx):
    """(init function, shardings, abstract state): the state's shapes and placement, nothing allocated."""
    def init(rng):
        tokens = jnp.zeros((1, cfg.max_target_length), jnp.int32)
        if cfg.task == 'lm':
            params = model.init(rng, tokens, tokens, tokens + 1)['params']
            return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params)}
        tokens, yz = tokens[:, :data.SUDOKU_LEN], jnp.zeros((1, data.SUDOKU_LEN, cfg.d_model))
        params = model.init(rng, tokens, tokens, tokens + 1, yz, yz, jnp.ones(1, bool))['params']
        # The EMA and the carry are train state: checkpointed with it, so a resumed run continues exactly.
        return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params), 'ema': params,
                'carry': trm_carry(cfg, cfg.grad_accum, cfg.per_device_batch * mesh.size)}

    boxed = jax.eval_shape(init, jax.random.key(cfg.seed))
    shardings = shardings_for(boxed, cfg, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            nn.unbox(boxed), shardings)
    return init, shardings, abstract


def init_state(cfg, mesh, model, tx):
    """Build the train state directly in its sharding: no full copy ever sits on one device."""
    init, shardings, _ = state_layout(cfg, mesh, model, tx)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(cfg)):
        state = jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(jax.random.key(cfg.seed))
    return state, shardings


# ==================================================================================================
# The step: scan over grad_accum microbatches, token-weighted, then clip + AdamW in one jit.
# ==================================================================================================
def loss_sums(model, params, mb):
    """(summed cross-entropy over real target tokens, number of those tokens) for one microbatch."""
    logits_BLV = model.apply({'params': params}, mb['inputs'], mb['positions'], mb['segment_ids'])
    ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, mb['targets'])
    return jnp.sum(ce_BL * mb['loss_mask']), jnp.sum(mb['loss_mask'])


def lm_loss(cfg, model, params, mb, carry, key):
    """loss_sums in the step's shape: (loss sum, (sums: weight = the divisor, ...), carry)."""
    loss, tokens = loss_sums(model, params, mb)
    return loss, ({'weight': tokens, 'tokens': tokens}, carry)


def trm_loss(cfg, model, params, mb, carry, key):
    """One supervision step for every slot of the carry (deep supervision with a fixed-shape batch).

    Slots that halted last step take this step's fresh example from `mb` and restart from y_init/z_init;
    the others keep their puzzle and carry, so shapes never change and nothing recompiles. Loss per
    slot: mean cell cross-entropy + halt_loss_weight x BCE(q, whole grid right)."""
    t, fresh_B = cfg.trm, carry['halted']
    pick = lambda new, old: jnp.where(fresh_B.reshape(-1, *[1] * (old.ndim - 1)), new, old)
    inputs_BL, targets_BL = pick(mb['inputs'], carry['inputs']), pick(mb['targets'], carry['targets'])
    steps_B = jnp.where(fresh_B, 0, carry['steps']) + 1
    y_BLD, z_BLD, logits_BLV, q_B = model.apply({'params': params}, inputs_BL, mb['positions'],
                                                mb['segment_ids'], carry['y'], carry['z'], fresh_B)
    ce_B = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean(axis=1)
    correct_B = jnp.all(jnp.argmax(logits_BLV, axis=-1) == targets_BL, axis=1)
    halt_bce_B = optax.sigmoid_binary_cross_entropy(q_B, correct_B.astype(jnp.float32))
    # Halt when the head says "right" (q > 0) or at N_sup. With halt_explore_prob a slot must first reach a
    # random 2..N_sup steps, so the later supervision steps (and the halting head on them) get trained.
    k_explore, k_steps = jax.random.split(key)
    B = steps_B.shape[0]
    explore_B = jax.random.uniform(k_explore, (B,)) < t.halt_explore_prob
    min_steps_B = jnp.where(explore_B, jax.random.randint(k_steps, (B,), 2, t.N_sup + 1), 1)
    halted_B = (steps_B >= t.N_sup) | ((q_B > 0) & (steps_B >= min_steps_B))
    new_carry = {'y': jax.lax.stop_gradient(y_BLD).astype(jnp.float32),  # detached between supervision steps
                 'z': jax.lax.stop_gradient(z_BLD).astype(jnp.float32), 'inputs': inputs_BL,
                 'targets': targets_BL, 'steps': steps_B, 'halted': halted_B}
    sums = {'weight': jnp.float32(B), 'tokens': jnp.float32(B * data.SUDOKU_LEN), 'halted': jnp.sum(halted_B),
            'halt_steps': jnp.sum(jnp.where(halted_B, steps_B, 0)), 'exact': jnp.sum(correct_B)}
    return jnp.sum(ce_B) + t.halt_loss_weight * jnp.sum(halt_bce_B), (sums, new_carry)


def make_train_step(cfg, model, tx):
    loss_fn = lm_loss if cfg.task == 'lm' else trm_loss

    def train_step(state, batch_ABL):
        params = state['params']
        grad_fn = jax.value_and_grad(lambda p, mb, c, k: loss_fn(cfg, model, p, mb, c, k), has_aux=True)

        def micro(acc, xs):
            grads, loss = acc
            mb, carry, key = xs
            (l, (sums, carry)), g = grad_fn(params, mb, carry, key)
            return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), loss + l), (sums, carry)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        # Random draws (TRM's halting exploration) are a function of (seed, step): resume stays exact.
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state['step']), cfg.grad_accum)
        (grads, loss), (sums_A, carry) = jax.lax.scan(micro, (zeros, 0.0), (batch_ABL, state.get('carry'), keys))
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), sums_A)
        # Sum-then-divide by all real tokens (LM) / examples (TRM) of the step: grad_accum=4 x batch 2 ==
        # grad_accum=1 x batch 8.
        denom = jnp.maximum(sums['weight'], 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        updates, opt_state = tx.update(grads, state['opt_state'], params)
        new_state = {'step': state['step'] + 1, 'params': optax.apply_updates(params, updates),
                     'opt_state': opt_state}
        if cfg.skip_nonfinite_steps:  # a NaN/inf step leaves params and optimizer untouched
            ok = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            new_state.update(params=keep(new_state['params'], params), opt_state=keep(opt_state, state['opt_state']))
        out = {'loss': loss / denom, 'grad_norm': optax.tree.norm(grads), 'tokens': sums['tokens']}
        if cfg.task == 'sudoku':
            new_state.update(carry=carry, ema=ema_update(cfg.trm.ema_decay, state['step'], state['ema'],
                                                         new_state['params']))
            out.update(halt_rate=sums['halted'] / denom, train_exact=sums['exact'] / denom,
                       sup_steps=sums['halt_steps'] / jnp.maximum(sums['halted'], 1))
        return new_state, out
    return train_step


def ema_update(decay, step, ema, params):
    """ema <- d ema + (1 - d) params, with d = min(decay, (1 + step) / (10 + step)): early on the average
    forgets the random init quickly instead of dragging it along for ~1/(1 - decay) steps."""
    d = jnp.minimum(decay, (1.0 + step) / (10.0 + step))
    return jax.tree.map(lambda e, p: (d * e + (1 - d) * p).astype(e.dtype), ema, params)


def make_eval_step(cfg, model):
    if cfg.task == 'lm':
        return lambda params, batch_BL: loss_sums(model, params, batch_BL)

    def trm_eval_step(params, b):
        """All N_sup supervision steps from a fresh carry: predicted tokens after each, [S, B, L]."""
        B = b['inputs'].shape[0]
        yz_BLD = jnp.zeros((B, data.SUDOKU_LEN, cfg.d_model), jnp.float32)

        def sup(carry, fresh_B):
            y_BLD, z_BLD, logits_BLV, _ = model.apply({'params': params}, b['inputs'], b['positions'],
                                                      b['segment_ids'], *carry, fresh_B)
            return (y_BLD.astype(jnp.float32), z_BLD.astype(jnp.float32)), jnp.argmax(logits_BLV, axis=-1)
        fresh_SB = jnp.zeros((cfg.trm.N_sup, B), bool).at[0].set(True)
        return jax.lax.scan(sup, (yz_BLD, yz_BLD), fresh_SB)[1]
    return trm_eval_step


def sudoku_scores(preds_SBL, batch):
    """Host-side scoring of one eval batch: (exact solves per step [S], right blank cells per step [S],
    blank cells, puzzles, final digit grids [B, L]). Padding rows are skipped; givens are copied from the
    puzzle whatever the model said; a grid counts as solved only if it obeys the Sudoku rules and equals
    the label."""
    real = batch['segment_ids'][:, 0] > 0
    q_BL, a_BL = batch['inputs'][real] - 1, batch['targets'][real] - 1  # tokens -> digits, 0 = blank
    blank_BL = q_BL == 0
    grids_SBL = np.where(blank_BL, np.asarray(preds_SBL)[:, real] - 1, q_BL)
    S, B = grids_SBL.shape[:2]
    valid_SB = data._valid_grids(grids_SBL.reshape(-1, data.SUDOKU_LEN)).reshape(S, B)
    exact_S = ((grids_SBL == a_BL).all(-1) & valid_SB).sum(1)
    cells_S = ((grids_SBL == a_BL) & blank_BL).sum((1, 2))
    return exact_S, cells_S, blank_BL.sum(), B, np.clip(grids_SBL[-1], 0, 9)


# ==================================================================================================
# Metrics: FLOPs, the device peak, a JSONL file and TensorBoard events (no TensorFlow needed).
# ==================================================================================================
PEAK_BF16_FLOPS = {  # per JAX device (a v2/v3 device is one core = half a chip)
    'TPU v2': 22.5e12, 'TPU v3': 61.5e12, 'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12,
    'TPU v5p': 459e12, 'TPU v5': 459e12, 'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'TPU7x': 2307e12,
    'A100': 312e12, 'H100': 989e12, 'H200': 989e12, 'H800': 989e12, 'B200': 2250e12,
}


def device_peak_flops(cfg, device):
    """bf16 peak from the table; on CPU measured now with a matmul in the compute dtype (the machine is
    shared and noisy, so MFU is only meaningful against a peak taken in the same process)."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops, f'{device.device_kind} spec sheet'
    n, dt = 2048, jnp.dtype(cfg.dtype)
    a = jax.device_put(jnp.ones((n, n), dt), device)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float('inf')
    for _ in range(5):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best, f'measured {n}x{n} {dt.name} matmul on {device.device_kind}'


def _crc32c(data_bytes, _table=[]):
    if not _table:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _table.append(c)
    crc = 0xFFFFFFFF
    for b in data_bytes:
        crc = _table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


class TensorBoard:
    """Writes scalar summaries in TensorBoard's event-file format by hand: a few protobuf fields inside
    length + masked-CRC32C records. Saves a TensorFlow install for one feature."""

    def __init__(self, logdir):
        name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}'
        self.file = open(os.path.join(logdir, name), 'ab')
        self._write(self._event(0, b'\x1a' + self._bytes(b'brain.Event:2')))

    @staticmethod
    def _varint(n):
        out = b''
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out

    def _bytes(self, b):
        return self._varint(len(b)) + b

    def _event(self, step, body):  # Event{1: wall_time double, 2: step int64, ...body}
        return b'\x09' + struct.pack('<d', time.time()) + b'\x10' + self._varint(step) + body

    def _write(self, rec):
        mask = lambda c: (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
        head = struct.pack('<Q', len(rec))
        self.file.write(head + struct.pack('<I', mask(_crc32c(head))) + rec + struct.pack('<I', mask(_crc32c(rec))))
        self.file.flush()

    def scalars(self, step, values):
        # Summary{1: Value{1: tag, 2: simple_value float}} inside Event field 5.
        summary = b''.join(b'\x0a' + self._bytes(b'\x0a' + self._bytes(k.encode()) + b'\x15' +
                                                 struct.pack('<f', v)) for k, v in values.items())
        self._write(self._event(step, b'\x2a' + self._bytes(summary)))


def log(msg):
    if jax.process_index() == 0:
        print(msg, flush=True)


def host_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux reports KiB


def device_peak_memory_gb(device):
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    return stats.get('peak_bytes_in_use', 0) / 2 ** 30 if stats else None


# ==================================================================================================
# Checkpoints (orbax): async, sharded, atomic. A step directory appears only once complete, so a crash
# or kill -9 mid-write leaves nothing that resume would pick up.
# ==================================================================================================
class Preempted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""


DATA_STATE_BYTES = 1024  # room for one process's data-iterator state as JSON


def checkpoint_manager(directory, cfg, read_only=False):
    opts = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints or None, create=not read_only,
                                        cleanup_tmp_directories=not read_only, read_only=read_only,
                                        enable_async_checkpointing=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts,
                                 item_handlers={'train_state': ocp.PyTreeCheckpointHandler(),
                                                'data_state': ocp.StandardCheckpointHandler()})


def data_state_array(it_state, mesh):
    """Every process's iterator state, as one global uint8 array with a row per device: each process
    fills the rows of its own devices, so orbax saves all hosts' positions (JSON items are written by
    process 0 only, which would lose the other hosts' places on a pod)."""
    raw = json.dumps(it_state).encode()
    assert len(raw) <= DATA_STATE_BYTES, 'data iterator state too large to checkpoint'
    row = np.frombuffer(raw.ljust(DATA_STATE_BYTES), np.uint8)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    local = np.tile(row, (len(mesh.local_devices), 1))
    return jax.make_array_from_process_local_data(sharding, local, (mesh.size, DATA_STATE_BYTES))


def save_checkpoint(mngr, step, state, it, mesh):
    mngr.save(step, args=ocp.args.Composite(
        train_state=ocp.args.PyTreeSave(state),
        data_state=ocp.args.StandardSave({'rows': data_state_array(it.state(), mesh)})))


def _flat_shapes(tree):
    """{('params', 'embed'): shape}: paths as plain strings, since orbax's metadata tree turns optax's
    named tuples into dicts and lists."""
    name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
    return {tuple(map(name, path)): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_shapes(mngr, step, abstract, part):
    """A checkpoint written by a different model config fails here with a message, not deep in orbax."""
    saved = mngr.item_metadata(step)['train_state']
    saved = _flat_shapes(saved[part] if part else saved)
    for path, want in sorted(_flat_shapes(abstract).items(), key=lambda kv: kv[0][0] != 'params'):
        if saved.get(path) != want:
            raise ConfigError(f'checkpoint {mngr.directory}/{step} has {"/".join(path)} of shape {saved.get(path)}, '
                              f'but this config makes {want}: use the model keys of the run that wrote it, '
                              'or a new run_name / resume=false')


def restore_checkpoint(mngr, abstract, mesh, steps=None, part=None):
    """Newest readable checkpoint -> (step, state or its `part` ('params', 'ema'), this process's data
    state). An unreadable (truncated, corrupted) checkpoint is reported and skipped for the one before it."""
    for step in sorted(steps or mngr.all_steps(), reverse=True):
        target = abstract[part] if part else abstract
        _check_shapes(mngr, step, target, part)
        restore = lambda item, **kw: ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), **kw)
        try:
            if part:  # another run's optimizer may differ: read the params subtree alone
                got = mngr.restore(step, args=ocp.args.Composite(
                    train_state=restore({part: target}, partial_restore=True)))
                return step, got['train_state'][part], None
            rows = jax.ShapeDtypeStruct((mesh.size, DATA_STATE_BYTES), np.uint8,
                                        sharding=NamedSharding(mesh, P(mesh.axis_names)))
            got = mngr.restore(step, args=ocp.args.Composite(
                train_state=restore(abstract), data_state=ocp.args.StandardRestore({'rows': rows})))
            mine = np.asarray(got['data_state']['rows'].addressable_shards[0].data)[0]
            return step, got['train_state'], json.loads(mine.tobytes().decode().strip())
        except Exception as e:  # orbax/tensorstore raise bare Exception for unreadable data
            log(f'WARNING: checkpoint {mngr.directory}/{step} is unreadable ({str(e).splitlines()[0][:200]}); '
                'trying the one before it')
    return None


# ==================================================================================================
# The run: everything above, in order.
# ==================================================================================================
def global_batch(local, sharding, rows):
    """Host-local numpy [..., rows_here, L] -> global jax arrays [..., rows, L]: each process passes only
    its own share, so this is correct on multi-host pods."""
    return {k: jax.make_array_from_process_local_data(sharding, v, v.shape[:-2] + (rows, v.shape[-1]))
            for k, v in local.items()}


def prepare_run_dir(cfg):
    """output_dir/run_name with the resolved config in it. resume=false moves an earlier run's
    checkpoints and metrics aside (renamed, never deleted) so the new run starts clean."""
    run_dir = os.path.join(cfg.output_dir, cfg.run_name)
    try:
        os.makedirs(run_dir, exist_ok=True)
        if not cfg.resume and cfg.mode == 'train' and jax.process_index() == 0:
            stamp = time.strftime('%Y%m%d-%H%M%S')
            for name in ('checkpoints', 'metrics.jsonl'):
                if os.path.exists(os.path.join(run_dir, name)):
                    os.rename(os.path.join(run_dir, name), os.path.join(run_dir, f'{name}.replaced-{stamp}'))
                    log(f'resume=false: moved the earlier {name} aside to {name}.replaced-{stamp}')
        with open(os.path.join(run_dir, 'config.yml'), 'w') as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    except OSError as e:
        raise ConfigError(f'output_dir={cfg.output_dir}: cannot write {run_dir} ({e.strerror}); '
                          'choose a writable output_dir') from None
    return run_dir


def load_params(path, abstract, mesh, cfg, part='params'):
    """load_params=PATH: a run directory, its checkpoints/ directory, or one step directory in it."""
    path = path.rstrip('/')
    if os.path.isdir(os.path.join(path, 'checkpoints')):
        path = os.path.join(path, 'checkpoints')
    steps = None
    if os.path.basename(path).isdigit() and os.path.isdir(path):
        path, steps = os.path.dirname(path), [int(os.path.basename(path))]
    mngr = checkpoint_manager(path, cfg, read_only=True) if os.path.isdir(path) else None
    found = mngr and restore_checkpoint(mngr, abstract, mesh, steps or mngr.all_steps(), part=part)
    if not found:
        raise ConfigError(f'load_params={path}: no readable checkpoint there; give a run directory or '
                          'its checkpoints/STEP directory')
    log(f'loaded {part} from {path}/{found[0]}')
    return found[:2]


def run(cfg, devices=None):
    """Train (or evaluate) per cfg; returns the summary dict. `devices` lets tests use a subset."""
    validate(cfg)
    if cfg.task == 'sudoku':  # the puzzle tokens fix the vocabulary; vocab_size is the text tokenizer's
        cfg.vocab_size = data.SUDOKU_VOCAB
    devices = devices or pick_devices(cfg)
    mesh = make_mesh(cfg, devices)
    n_dev, n_proc, proc = len(devices), jax.process_count(), jax.process_index()
    run_dir = prepare_run_dir(cfg)

    # ---- derived sizes, computed once and printed ----
    micro_rows = cfg.per_device_batch * n_dev            # examples per microbatch, whole system
    step_rows = micro_rows * cfg.grad_accum              # examples per optimizer update
    local_rows = step_rows // n_proc                     # this process's share
    L = cfg.max_target_length if cfg.task == 'lm' else 81
    log(f'devices: {n_dev} x {devices[0].device_kind} ({devices[0].platform}), {n_proc} process(es); '
        f'mesh {dict(mesh.shape)}')
    log(f'batch: {cfg.per_device_batch}/device x {n_dev} devices x {cfg.grad_accum} accum = {step_rows} '
        f'examples = {step_rows * L} tokens per step')

    # ---- data ----
    ds = data.make_dataset(cfg, proc, n_proc)
    if ds.vocab_size != cfg.vocab_size and cfg.task == 'lm':
        raise ConfigError(f'vocab_size={cfg.vocab_size} but the data has {ds.vocab_size} tokens; '
                          f'set vocab_size={ds.vocab_size}')

    # ---- model, optimizer, and the state: restored, or initialised in place ----
    trm = cfg.task == 'sudoku'
    model = model_lib.TRM(cfg) if trm else model_lib.Transformer(cfg)
    tx, schedule = make_optimizer(cfg)
    init, state_sh, abstract = state_layout(cfg, mesh, model, tx)
    rules = axis_rules(cfg)
    mngr = checkpoint_manager(os.path.join(run_dir, 'checkpoints'), cfg)
    restored = restore_checkpoint(mngr, abstract, mesh) if cfg.resume and mngr.all_steps() else None
    data_state = None
    if restored:
        start, state, data_state = restored
        log(f'resuming from checkpoint {mngr.directory}/{start}')
        if proc == 0 and os.path.exists(os.path.join(run_dir, 'metrics.jsonl')):  # drop rows past the resume point
            with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
                rows = [r for r in f if json.loads(r)['step'] <= start]
            with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
                f.writelines(rows)
    else:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            state = jax.jit(lambda r: nn.unbox(init(r)), out_shardings=state_sh)(jax.random.key(cfg.seed))
        if cfg.load_params and trm and cfg.mode == 'eval':  # TRM evaluates its EMA weights
            loaded_step, state['ema'] = load_params(cfg.load_params, abstract, mesh, cfg, 'ema')
            state['step'] = jnp.int32(loaded_step)  # reported with the eval: which training step this is
        elif cfg.load_params:
            state['params'] = load_params(cfg.load_params, abstract, mesh, cfg)[1]
            if trm:
                state['ema'] = state['params']
    n_params = sum(x.size for x in jax.tree.leaves(state['params']))
    flops_tok = model_lib.flops_per_token(cfg)
    log(f'model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOPs per token (train)')
    if cfg.print_sharding:
        log(sharding_table(state['params'], state_sh['params']))

    batch_spec = mesh_spec(('batch', 'length'), (micro_rows, L), cfg, mesh)
    step_sh = NamedSharding(mesh, P(None, *batch_spec))   # [A, B, L]: microbatch axis unsharded
    eval_sh = NamedSharding(mesh, batch_spec)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        train_step = jax.jit(make_train_step(cfg, model, tx), in_shardings=(state_sh, step_sh),
                             out_shardings=(state_sh, None), donate_argnums=0)
        eval_step = jax.jit(make_eval_step(cfg, model), in_shardings=(state_sh['params'], eval_sh))

    def evaluate(state, n_batches=cfg.eval_batches):
        batches = ds.eval_batches(micro_rows // n_proc, n_batches)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            params = state['ema'] if trm else state['params']
            sums = [eval_step(params, global_batch(b, eval_sh, micro_rows)) for b in batches]
        if trm:  # scored on the host; every process gathers all rows (puzzles, predictions) in process order
            gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
            scores = [sudoku_scores(gather(p), {k: gather(b[k]) for k in ('inputs', 'targets', 'segment_ids')})
                      for p, b in zip(sums, batches)]
            exact_S, cells_S, blanks, n = (sum(s[i] for s in scores) for i in range(4))
            if cfg.mode == 'eval' and proc == 0:  # the answers themselves, givens as in the puzzle
                data.write_sudoku_csv(os.path.join(run_dir, 'predictions.csv'), ds.eval_q,
                                      np.concatenate([s[4] for s in scores])[:len(ds.eval_q)])
            exact_S, cells_S = exact_S / max(n, 1), cells_S / max(blanks, 1)
            return {'exact_accuracy': float(exact_S[-1]), 'cell_accuracy': float(cells_S[-1]), 'num_puzzles': int(n),
                    'decoder': 'trm', 'supervision_steps': cfg.trm.N_sup,
                    'exact_accuracy_per_step': [round(float(e), 4) for e in exact_S],
                    'cell_accuracy_per_step': [round(float(c), 4) for c in cells_S]}
        loss = float(sum(s[0] for s in sums)) / max(float(sum(s[1] for s in sums)), 1.0)
        return {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 50.0))}

    if cfg.mode == 'eval':
        if not (restored or cfg.load_params):
            raise ConfigError(f'mode=eval needs trained parameters: set load_params=RUN_DIR, or run_name= a run '
                              f'with checkpoints (none in {run_dir}/checkpoints)')
        n_batches = -(-len(ds.eval_records) // (micro_rows // n_proc)) if trm else cfg.eval_batches  # TRM: all
        result = {'step': int(state['step']), **evaluate(state, n_batches)}
        if proc == 0:
            with open(os.path.join(run_dir, 'eval.json'), 'w') as f:
                json.dump(result, f)
        log(json.dumps(result))
        return result

    peak, peak_src = device_peak_flops(cfg, devices[0])
    # On CPU the simulated devices share one processor: the measured peak is for the whole machine.
    peak_total = peak if devices[0].platform == 'cpu' else peak * n_dev
    log(f'peak: {peak / 1e12:.3f} TFLOP/s per device ({peak_src})')
    metrics_file = open(os.path.join(run_dir, 'metrics.jsonl'), 'a') if proc == 0 else None
    tb = TensorBoard(run_dir) if proc == 0 else None

    # ---- signals: SIGTERM (preemption, schedulers) and SIGINT finish the step, checkpoint, exit ----
    caught = []
    handlers = {sig: signal.signal(sig, lambda signum, _: caught.append(signal.Signals(signum).name))
                for sig in (signal.SIGTERM, signal.SIGINT)
                if threading.current_thread() is threading.main_thread() and not (n_proc > 1 and sig == signal.SIGTERM)}

    # ---- the loop ----
    it = ds.train_iter(local_rows, state=data_state)
    A = cfg.grad_accum
    to_device = lambda b: global_batch({k: v.reshape(A, -1, *v.shape[1:]) for k, v in b.items()},
                                       step_sh, micro_rows)
    summary, window, extras, t_compile, skipped = {}, [], [], None, 0
    t_last, tokens_since, wait_last, timed_steps = time.perf_counter(), 0.0, 0.0, 0
    step = saved = int(state['step'])
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            while step < cfg.steps:
                t0 = time.perf_counter()
                state, out = train_step(state, to_device(next(it)))
                step += 1
                out = jax.device_get(out)  # waits for this step: losses are checked every step
                if t_compile is None:
                    t_compile = time.perf_counter() - t0
                    log(f'first step (compile + run): {t_compile:.1f}s')
                    t_last, wait_last = time.perf_counter(), it.wait_seconds
                else:
                    tokens_since += float(out['tokens'])
                    timed_steps += 1
                if not np.isfinite(out['loss']) or not np.isfinite(out['grad_norm']):
                    skipped += 1
                    if skipped > cfg.skip_nonfinite_steps:
                        raise FloatingPointError(
                            f'loss is {out["loss"]} at step {step}; stopping (checkpoints up to step {saved} are '
                            'intact; lower learning_rate, raise warmup_steps, or set skip_nonfinite_steps)')
                    log(f'WARNING: non-finite loss at step {step}: update skipped ({skipped} of '
                        f'skip_nonfinite_steps={cfg.skip_nonfinite_steps})')
                else:
                    window.append(float(out['loss']))
                    extras.append({k: float(out[k]) for k in ('halt_rate', 'sup_steps', 'train_exact') if k in out})
                if step % cfg.log_every == 0 or step == cfg.steps:
                    now = time.perf_counter()
                    dt = max(now - t_last, 1e-9)
                    tps = tokens_since / dt
                    m = {'step': step, 'loss': float(np.mean(window)) if window else float('nan'),
                         'learning_rate': float(schedule(step - 1)), 'grad_norm': float(out['grad_norm']),
                         'tokens_per_sec': tps, 'tokens_per_sec_per_device': tps / n_dev,
                         'tflops_per_device': tps * flops_tok / n_dev / 1e12, 'mfu': tps * flops_tok / peak_total,
                         'step_seconds': dt / max(timed_steps, 1),
                         'data_wait_fraction': (it.wait_seconds - wait_last) / dt, 'host_rss_gb': host_rss_gb()}
                    m.update({k: float(np.mean([e[k] for e in extras])) for k in (extras or [{}])[0]})  # TRM
                    mem = device_peak_memory_gb(devices[0])
                    if mem is not None:
                        m['device_peak_memory_gb'] = mem
                    if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                        m.update({k if k.startswith('eval') else f'eval_{k}': v for k, v in evaluate(state).items()})
                    if tokens_since == 0:  # only the compile step was in this window: no rate to report
                        for k in ('tokens_per_sec', 'tokens_per_sec_per_device', 'tflops_per_device', 'mfu',
                                  'step_seconds'):
                            m.pop(k)
                    log(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in m.items()))
                    if metrics_file:
                        metrics_file.write(json.dumps(m) + '\n')
                        metrics_file.flush()
                        tb.scalars(step, {k: v for k, v in m.items() if k != 'step' and isinstance(v, (int, float))})
                    summary.update(m)
                    window, extras, t_last, tokens_since = [], [], time.perf_counter(), 0.0
                    wait_last, timed_steps = it.wait_seconds, 0
                preempted = caught or (n_proc > 1 and multihost_utils.reached_preemption_sync_point(step))
                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or preempted:
                    save_checkpoint(mngr, step, state, it, mesh)  # async: training goes on while it writes
                    saved = step
                if preempted:
                    raise Preempted(f'{caught[0] if caught else "preemption notice"}: saved checkpoint at step '
                                    f'{step} in {mngr.directory}; rerun the same command to resume')
    finally:
        mngr.wait_until_finished()  # a checkpoint in flight always lands, whatever stopped the loop
        mngr.close()
        it.close()
        for sig, h in handlers.items():
            signal.signal(sig, h)
    summary.update({'run_dir': run_dir, 'compile_seconds': t_compile})
    log('done: ' + json.dumps({k: summary.get(k) for k in ('step', 'loss', 'eval_loss', 'tokens_per_sec',
                                                           'mfu', 'compile_seconds', 'run_dir')}))
    log(f'checkpoints: {mngr.directory}; metrics: {run_dir}/metrics.jsonl '
        f'(TensorBoard: tensorboard --logdir {run_dir})')
    return summary


def main(argv):
    if len(argv) < 2 or argv[1] in ('-h', '--help'):
        print(__doc__.strip().splitlines()[0])
        return 0 if len(argv) >= 2 else 2
    try:
        run(load_config(argv[1], argv[2:]))
    except (ConfigError, data.DataError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f'error: {e}', file=sys.stderr)
        return 3
    except Preempted as e:
        print(f'stopped: {e}', file=sys.stderr)
        return 75  # EX_TEMPFAIL: schedulers can requeue on it
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
