"""Train a GQA transformer with JAX: python train.py base.yml [key=value ...]

Reads top to bottom in execution order: config, devices + mesh, sharding, model + optimizer, sharded
init, the step, metrics, the loop. Every knob lives in base.yml; hardware variants are overrides.
"""
import difflib
import functools
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

    def __getitem__(self, key):  # cfg['trm.T'] reaches into sections
        node = self
        for part in key.split('.'):
            node = node.__dict__[part]
        return node

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


CHOICES = {'task': ('lm', 'sudoku'), 'mode': ('train', 'eval', 'export', 'generate'),
           'remat': ('none', 'full', 'save_dots'),
           'dtype': ('float32', 'bfloat16', 'float16'), 'weight_dtype': ('float32', 'bfloat16'),
           'attention': ('xla', 'cudnn', 'einsum'), 'dataset': ('stdlib', 'files', 'tfds', 'synthetic'),
           'platform': ('', 'cpu', 'gpu', 'tpu'),
           'decoder': ('trm', 'oneshot', 'greedy', 'beam_logp', 'tot', 'tot_shuffled')}


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
    a, b = (list(cfg.profile_steps) + [-1, -1])[:2]
    if len(cfg.profile_steps) != 2 or [a, b] != [0, 0] and not 1 <= a <= b <= cfg.steps:
        raise ConfigError(f'profile_steps={",".join(map(str, cfg.profile_steps))}: give two steps a,b with '
                          f'1 <= a <= b <= steps={cfg.steps} (0,0 = off)')
    t = cfg.trm
    if t.mixer not in ('attention', 'mlp'):
        raise ConfigError(f"trm.mixer={t.mixer!r}: choose one of 'attention', 'mlp'")
    if min(t.T, t.n, t.N_sup) < 1 or not 0 <= t.ema_decay < 1 or not 0 <= t.halt_explore_prob <= 1:
        raise ConfigError(f'trm: T={t.T}, n={t.n}, N_sup={t.N_sup} must be >= 1, ema_decay={t.ema_decay} in [0, 1), '
                          f'halt_explore_prob={t.halt_explore_prob} in [0, 1]')
    for key in ('beam_width', 'thoughts_per_step', 'max_depth', 'max_thoughts', 'thought_cells', 'tot.policy_steps',
                'tot.value_step'):
        if cfg[key] < 1:
            raise ConfigError(f'{key}={cfg[key]}: must be >= 1')
    if cfg.tot.frontier < 0:
        raise ConfigError(f'tot.frontier={cfg.tot.frontier}: must be >= 0 (0 = beam_width)')
    if cfg.thought_cells > 81 or cfg.thoughts_per_step > 9:
        raise ConfigError(f'thought_cells={cfg.thought_cells} must be <= 81 and thoughts_per_step='
                          f'{cfg.thoughts_per_step} <= 9 (the digits a cell can take)')


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


def lm_loss(cfg, model, params, mb, carry, key, step=0):
    """loss_sums in the step's shape: (loss sum, (sums: weight = the divisor, ...), carry)."""
    loss, tokens = loss_sums(model, params, mb)
    return loss, ({'weight': tokens, 'tokens': tokens}, carry)


def trm_loss(cfg, model, params, mb, carry, key, step=0):
    """One supervision step for every slot of the carry (deep supervision with a fixed-shape batch).

    Slots that halted last step take this step's fresh example from `mb` and restart from y_init/z_init;
    the others keep their puzzle and carry, so shapes never change and nothing recompiles. Loss per
    slot: mean cell cross-entropy + halt_loss_weight x BCE(q, whole grid right)."""
    t, fresh_B = cfg.trm, carry['halted']
    pick = lambda new, old: jnp.where(fresh_B.reshape(-1, *[1] * (old.ndim - 1)), new, old)
    inputs_BL, targets_BL = pick(mb['inputs'], carry['inputs']), pick(mb['targets'], carry['targets'])
    steps_B = jnp.where(fresh_B, 0, carry['steps']) + 1
    y_BLD, z_BLD, logits_BLV, q_B, _ = model.apply({'params': params}, inputs_BL, mb['positions'],
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
    loss = jnp.sum(ce_B) + t.halt_loss_weight * jnp.sum(halt_bce_B)
    if cfg.tot.loss_weight:  # ToT value head, on partial grids made from this microbatch's fresh puzzles
        half = max(B // 2, 1)  # half the rows: 2/3 of the extra step time is enough examples for one bit

        def value_loss(_):
            grids_BL, label_B = partial_states(jax.random.fold_in(key, 1), mb['inputs'][:half] - 1,
                                               mb['targets'][:half] - 1)
            log_v_B = trm_steps(cfg, model, params, grids_BL, cfg.tot.value_step)[2]
            return jnp.sum(value_bce(log_v_B, label_B)), jnp.sum((log_v_B > jnp.log(0.5)) == label_B)
        # From tot.start_step on only: a real branch, so earlier steps do not pay for the value pass.
        on = step >= cfg.tot.start_step
        v_loss, v_acc = jax.lax.cond(on, value_loss, lambda _: (0.0, 0), None)
        sums.update(value_acc=v_acc, value_rows=jnp.where(on, half, 0.0))
        loss += cfg.tot.loss_weight * v_loss
    return loss, (sums, new_carry)


def partial_states(key, q_BL, a_BL, sparse_B=None):
    """ToT value-head examples from puzzles and solutions (digit grids): in half of the rows (odd rows, or
    `sparse_B`) up to a third of the givens blanked (states as sparse as the hardest puzzles'), then a
    random share of the blanks filled from the solution, and in half of the rows one blank set to a wrong
    digit, one that breaks no rule where the grid allows it (the mistakes a solver makes). Label: True =
    every digit agrees with the solution (for a unique-solution puzzle: the grid can still be completed)."""
    k_frac, k_fill, k_bad, k_cell, k_digit, k_drop = jax.random.split(key, 6)
    B, L = q_BL.shape
    sparse_B = jnp.arange(B) % 2 == 1 if sparse_B is None else sparse_B
    drop_BL = jax.random.uniform(k_drop, (B, L)) < jnp.where(sparse_B, 1 / 3, 0.0)[:, None]
    q_BL = jnp.where(drop_BL, 0, q_BL)
    blank_BL, rows = q_BL == 0, jnp.arange(B)
    fill_BL = blank_BL & (jax.random.uniform(k_fill, (B, L)) < jax.random.uniform(k_frac, (B, 1)))
    g_BL = jnp.where(fill_BL, a_BL, q_BL)
    bad_B = jax.random.bernoulli(k_bad, 0.5, (B,))
    # The wrong cell: a random blank, preferring filled ones (so right and wrong grids have as many digits:
    # the count must not give the label away) where some wrong digit clashes with no peer (a quiet mistake).
    wrong_BLC = jnp.arange(1, 10) != a_BL[..., None]
    quiet_BLC = wrong_BLC & ~model_lib.digits_seen(g_BL)
    pref_BL = blank_BL * (1.0 + 2.0 * fill_BL + jnp.any(quiet_BLC, axis=-1))
    cell_B = jnp.argmax(pref_BL + jax.random.uniform(k_cell, (B, L)), axis=1)
    pool_BC = jnp.where(jnp.any(quiet_BLC[rows, cell_B], axis=1, keepdims=True), quiet_BLC[rows, cell_B],
                        wrong_BLC[rows, cell_B])
    digit_B = jnp.argmax(jnp.where(pool_BC, jax.random.uniform(k_digit, (B, 9)), -1.0), axis=1) + 1
    g_BL = jnp.where(bad_B[:, None] & (jnp.arange(L) == cell_B[:, None]), digit_B[:, None], g_BL)
    return g_BL, ~bad_B


def puzzle_partial_states(key, q_BL, a_BL):
    """partial_states drawn per puzzle (its key folded with a hash of its givens, a coin for sparse or
    not), so eval's value_auroc does not depend on the batch size or on which rows a puzzle shares."""
    def one(q_L, a_L):
        k = jax.random.fold_in(key, model_lib.puzzle_hash(q_L))
        sparse = jax.random.bernoulli(jax.random.fold_in(k, 1))  # half the states sparse, as in training
        g, label = partial_states(k, q_L[None], a_L[None], sparse[None])
        return g[0], label[0]
    return jax.vmap(one)(q_BL, a_BL)


def value_bce(log_v_B, label_B):
    """Binary cross-entropy from log P(right): -log p for right grids, -log(1 - p) for wrong ones."""
    return -jnp.where(label_B, log_v_B, jnp.log(-jnp.expm1(jnp.minimum(log_v_B, -1e-6))))


def trm_steps(cfg, model, params, grids_NL, steps):
    """`steps` supervision steps from a fresh carry on digit grids (0 = blank): (predicted tokens after
    each step [S, N, L], digit log-probs [N, L, 9] after the last, log value [N] after step
    v = min(tot.value_step, steps)). Only step v is differentiable: the value loss trains through it."""
    N, L = grids_NL.shape
    rows = lambda x: jnp.broadcast_to(x, (N, L)).astype(jnp.int32)
    tokens, pos, seg = rows(grids_NL + 1), rows(jnp.arange(L)), rows(grids_NL >= 0)  # padding rows: -1
    v = min(cfg.tot.value_step, steps)

    def sup(p):
        def one(carry, fresh_N):
            y, z, logits_NLV, _, log_v_N = model.apply({'params': p}, tokens, pos, seg, *carry, fresh_N)
            carry = jax.lax.stop_gradient((y.astype(jnp.float32), z.astype(jnp.float32)))
            return carry, (jnp.argmax(logits_NLV, -1), logits_NLV, log_v_N)
        return one
    fixed = sup(jax.lax.stop_gradient(params))
    fresh = lambda n: (jnp.arange(n) == 0)[:, None] & jnp.ones((1, N), bool)  # [n, N]: step 0 starts fresh
    yz = jnp.zeros((N, L, cfg.d_model), jnp.float32)
    carry, (p_before, _, _) = jax.lax.scan(fixed, (yz, yz), fresh(v - 1))
    carry, (p_v, logits_NLV, log_v_N) = sup(params)(carry, jnp.full(N, v == 1))
    _, (p_after, l_after, _) = jax.lax.scan(fixed, carry, jnp.zeros((steps - v, N), bool))
    logits_NLV = l_after[-1] if steps > v else logits_NLV
    preds = jnp.concatenate([p_before, p_v[None], p_after])
    # Digit d is token d + 1: the nine digit logits are tokens 2..10.
    return preds, jax.nn.log_softmax(logits_NLV[..., 2:11], axis=-1), log_v_N


def make_train_step(cfg, model, tx):
    loss_fn = lm_loss if cfg.task == 'lm' else trm_loss

    def train_step(state, batch_ABL):
        params = state['params']
        grad_fn = jax.value_and_grad(lambda p, mb, c, k: loss_fn(cfg, model, p, mb, c, k, state['step']),
                                     has_aux=True)

        def micro(acc, xs):
            grads, loss = acc
            mb, carry, key = xs
            (l, (sums, carry)), g = grad_fn(params, mb, carry, key)
            return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), loss + l), (sums, carry)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        # Random draws (TRM's halting exploration) are a function of (seed, step): resume stays exact.
        A = jax.tree.leaves(batch_ABL)[0].shape[0]  # microbatches in this step (the batch ramp varies it)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state['step']), A)
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
            if 'value_acc' in sums:  # share of partial grids the value head calls right (p > 0.5 iff right)
                out['value_acc'] = sums['value_acc'] / jnp.maximum(sums['value_rows'], 1)
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

    def sudoku_eval_step(params, b):
        """Decodes a batch with cfg.decoder: (predicted tokens [S, B, L] (S = supervision steps for oneshot
        and trm, 1 for the searches), forward passes per puzzle [B], value-head log values and labels of
        partial grids made from the batch (for its AUROC))."""
        q_BL, B = b['inputs'] - 1, b['inputs'].shape[0]
        steps = {'oneshot': 1, 'trm': cfg.trm.N_sup}.get(cfg.decoder, max(cfg.tot.policy_steps, cfg.tot.value_step))
        evaluate = lambda g_NL: trm_steps(cfg, model, params, g_NL, steps)[1:]
        if cfg.decoder in ('oneshot', 'trm'):
            preds_SBL, passes_B = trm_steps(cfg, model, params, q_BL, steps)[0], jnp.full(B, steps)
        elif cfg.decoder == 'greedy':
            grids_BL, passes_B = model_lib.greedy_fill(evaluate, q_BL)
            preds_SBL, passes_B = grids_BL[None] + 1, passes_B * steps
        else:
            score = {'beam_logp': 'logp', 'tot': 'value', 'tot_shuffled': 'shuffled'}[cfg.decoder]
            grids_BL, passes_B = model_lib.tree_search(
                evaluate, q_BL, cfg.beam_width, cfg.thoughts_per_step, cfg.thought_cells, cfg.max_depth,
                cfg.max_thoughts, score, cfg.tot.logp_weight, jax.random.key(cfg.seed), cfg.tot.frontier)
            preds_SBL, passes_B = grids_BL[None] + 1, passes_B * steps
        partial_BL, label_B = puzzle_partial_states(jax.random.key(cfg.seed), q_BL, b['targets'] - 1)
        return preds_SBL, passes_B, trm_steps(cfg, model, params, partial_BL, cfg.tot.value_step)[2], label_B
    return sudoku_eval_step


def auroc(scores, labels):
    """Area under the ROC curve: the chance a random positive scores above a random negative."""
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return float('nan')
    return float(np.mean((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])))


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
    valid_SB = data.solved(grids_SBL.reshape(-1, data.SUDOKU_LEN)).reshape(S, B)
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


@functools.lru_cache  # once per process: tests and notebooks call run() many times
def device_peak_flops(dtype, device):
    """bf16 peak from the table; on CPU measured now with a matmul in the compute dtype (the machine is
    shared and noisy, so MFU is only meaningful against a peak taken in the same process)."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops, f'{device.device_kind} spec sheet'
    n, dt = 2048, jnp.dtype(dtype)
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
    if device.process_index != jax.process_index():  # on multi-host runs only local devices report memory
        device = jax.local_devices()[0]
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
# Hardware: multi-host start, TPU shape advice, the batch ramp, and the AOT fit check for TPU slices.
# ==================================================================================================
GiB = 2 ** 30
TPU_SLICES = {  # slice name: (libtpu topology, chip config, HBM per JAX device). DESIGN.md section 3.
    'v2-8': ('v2:2x2', 'default', 8 * GiB), 'v3-8': ('v3:2x2', 'default', 16 * GiB),
    'v4-8': ('v4:2x2x1', 'megacore', 32 * GiB), 'v4-32': ('v4:2x2x4', 'megacore', 32 * GiB),
    'v4-64': ('v4:2x4x4', 'megacore', 32 * GiB), 'v5e-8': ('v5e:2x4', 'default', 16 * GiB),
    'v5p-8': ('v5p:2x2x1', 'megacore', 95 * GiB), 'v6e-8': ('v6e:2x4', 'default', 32 * GiB),
}
DOES_NOT_FIT = 4  # exit code of compile_topology when the step needs more HBM than the slice has


def init_distributed():
    """Join a multi-process JAX system before any device is touched. Explicit JAX_* variables win;
    otherwise only where JAX can detect the cluster itself (SLURM with several tasks, a Cloud TPU VM),
    since initialize() with no arguments on a plain machine has nothing to find."""
    names = ('JAX_COORDINATOR_ADDRESS', 'JAX_PROCESS_COUNT', 'JAX_PROCESS_INDEX')
    given = [n for n in names if os.environ.get(n)]
    if given and len(given) < len(names):
        missing = ', '.join(n for n in names if n not in given)
        raise ConfigError(f'{", ".join(given)} set but {missing} not: set all three for a multi-process run, or none')
    if given:
        try:
            count, index = int(os.environ['JAX_PROCESS_COUNT']), int(os.environ['JAX_PROCESS_INDEX'])
        except ValueError:
            raise ConfigError('JAX_PROCESS_COUNT and JAX_PROCESS_INDEX must be integers') from None
        jax.distributed.initialize(os.environ['JAX_COORDINATOR_ADDRESS'], count, index)
        return
    try:  # JAX sets this at import when the host has TPU chips and libtpu; the pod's hosts come from metadata
        from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm as tpu_vm
    except ImportError:
        tpu_vm = False
    slurm = 'SLURM_JOB_ID' in os.environ and int(os.environ.get('SLURM_NTASKS', '1')) > 1
    if slurm or tpu_vm:
        jax.distributed.initialize()


def validate_hardware(cfg):
    if cfg.compile_topology and cfg.compile_topology not in TPU_SLICES:
        raise ConfigError(f'compile_topology={cfg.compile_topology}: choose one of {", ".join(TPU_SLICES)}')
    if cfg.batch_ramp_start and cfg.task != 'lm':
        raise ConfigError('batch_ramp_start: the ramp is for task=lm (the TRM carry holds grad_accum microbatches)')
    if not 0 <= cfg.batch_ramp_start <= cfg.grad_accum or (cfg.batch_ramp_start and cfg.batch_ramp_every <= 0):
        raise ConfigError(f'batch_ramp_start={cfg.batch_ramp_start} batch_ramp_every={cfg.batch_ramp_every}: the '
                          f'ramp starts at 1..grad_accum={cfg.grad_accum} microbatches and doubles every >0 steps')


def warn_tpu_dims(cfg):
    """The TPU MXU works on 128 x 128 tiles: other sizes pad and waste compute, silently."""
    sizes = {'d_model': cfg.d_model, 'mlp_dim': cfg.mlp_dim, 'vocab_size': cfg.vocab_size,
             'num_heads x head dim': cfg.num_heads * model_lib.dims(cfg)}
    odd = [f'{k}={v}' for k, v in sizes.items() if v % 128]
    if odd:
        log(f'WARNING: on TPU, {", ".join(odd)} not a multiple of 128 (the MXU tile): pad them up to one '
            '(change d_model / mlp_dim / vocab_size / num_heads or head_dim)')


def accum_at(cfg, step):
    """Microbatches in update `step` (0-based). The ramp grows the batch through accumulation, so the
    microbatch shape never changes and each distinct count compiles once."""
    if not cfg.batch_ramp_start:
        return cfg.grad_accum
    return min(cfg.grad_accum, cfg.batch_ramp_start * 2 ** (step // cfg.batch_ramp_every))


def memory_estimate(cfg, abstract, mesh):
    """Per-device bytes predicted from the config, to set beside the compiler's figures: the state as
    sharded, float32 gradients, and the activations one microbatch keeps for the backward pass."""
    shard = lambda x, size=None: math.prod(x.sharding.shard_shape(x.shape)) * (size or x.dtype.itemsize)
    params = sum(shard(x) for x in jax.tree.leaves(abstract['params']))
    splits = lambda logical, shape: math.prod(mesh.shape[a] for s in mesh_spec(logical, shape, cfg, mesh)
                                             for a in ((s,) if isinstance(s, str) else s or ()))
    L, D, F, H, G, K = (cfg.max_target_length, cfg.d_model, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads,
                        model_lib.dims(cfg))
    rows = cfg.per_device_batch * mesh.size
    tokens = rows * L / splits(('batch', 'length'), (rows, L))
    t = splits(('heads',), (H,))
    per_layer = {  # values kept per token per layer, in the compute dtype
        'full': D,  # only the layer input; everything else is recomputed
        'save_dots': 3 * D + ((H + 2 * G) * K + H * K + 2 * F) / t,
        'none': 6 * D + (2 * (H + 2 * G) * K + H * K + 4 * F + 2 * H * L) / t}[cfg.remat]
    acts = tokens * (cfg.num_layers * per_layer * jnp.dtype(cfg.dtype).itemsize
                     + 3 * 4 * cfg.vocab_size / splits(('vocab',), (cfg.vocab_size,)))  # f32 logits, softmax, grad
    return {'params': params, 'optimizer': sum(shard(x) for x in jax.tree.leaves(abstract['opt_state'])),
            'gradients': sum(shard(x, 4) for x in jax.tree.leaves(abstract['params'])), 'activations': int(acts)}


def abstract_batch(cfg, A, rows, L, sharding):
    """The step's [A, rows, L] batch as shapes only: to compile ahead of time, nothing read."""
    return {k: jax.ShapeDtypeStruct((A, rows, L), jnp.float32 if k == 'loss_mask' else jnp.int32, sharding=sharding)
            for k in ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')}


def estimate_line(cfg, est):
    GB = lambda b: f'{b / GiB:.2f} GiB'
    return ('estimate per device: ' + ', '.join(f'{k} {GB(v)}' for k, v in est.items()) +
            f' (remat={cfg.remat}) = {GB(sum(est.values()))}')


def compiled_line(m):
    """(the compiler's memory_analysis() per device as a log line, total bytes). Donated state buffers are
    reused for the new state (alias), so they count once."""
    GB = lambda b: f'{b / GiB:.2f} GiB'
    need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return (f'compiled per device: arguments (params + optimizer state + batch) {GB(m.argument_size_in_bytes)}, '
            f'temporaries {GB(m.temp_size_in_bytes)}, outputs {GB(m.output_size_in_bytes)} '
            f'({GB(m.alias_size_in_bytes)} reusing donated arguments) = {GB(need)}', need)


def compile_for_topology(cfg):
    """compile_topology=v4-64: lower and compile the real train step for that TPU slice on this machine
    (libtpu describes the chips; no TPU needed), and say whether it fits the slice's HBM. Nothing runs."""
    topology, chips, hbm = TPU_SLICES[cfg.compile_topology]
    try:
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(topology_name=topology, platform='tpu',
                                               chip_config_name=chips).devices
    except Exception as e:  # no libtpu, or another process holding it: a plain RuntimeError/ValueError
        raise ConfigError(f'compile_topology={cfg.compile_topology}: libtpu cannot describe the slice (is the '
                          f'wheel installed? pip install -r tests/requirements.txt): {str(e).splitlines()[0][:200]}'
                          ) from None
    GB = lambda b: f'{b / GiB:.2f} GiB'
    log(f'AOT compile for {cfg.compile_topology}: {len(devices)} x {devices[0].device_kind}, {GB(hbm)} HBM each')
    warn_tpu_dims(cfg)
    mesh = make_mesh(cfg, devices)
    model, (tx, _) = model_lib.Transformer(cfg), make_optimizer(cfg)
    _, state_sh, abstract = state_layout(cfg, mesh, model, tx)
    est = memory_estimate(cfg, abstract, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(abstract['params']))
    log(f'model: {n_params / 1e6:.1f}M parameters; mesh {dict(mesh.shape)}; ' + estimate_line(cfg, est))
    rows, L = cfg.per_device_batch * len(devices), cfg.max_target_length
    step_sh = NamedSharding(mesh, P(None, *mesh_spec(('batch', 'length'), (rows, L), cfg, mesh)))
    batch = abstract_batch(cfg, cfg.grad_accum, rows, L, step_sh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(cfg)):
        lowered = jax.jit(make_train_step(cfg, model, tx), in_shardings=(state_sh, step_sh),
                          out_shardings=(state_sh, None), donate_argnums=0).lower(abstract, batch)
    try:
        m = lowered.compile().memory_analysis()
        line, need = compiled_line(m)
        memory = {k: getattr(m, f'{k}_size_in_bytes') for k in ('argument', 'temp', 'output', 'alias')}
        fits = need <= hbm
        log(f'compiled in {time.perf_counter() - t0:.1f}s; {line} of {GB(hbm)} HBM: '
            f'{"fits" if fits else "does not fit"}')
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler itself refuses a program over its HBM
        if 'RESOURCE_EXHAUSTED' not in str(e):
            raise
        need, memory, fits = None, None, False
        log(f'compiler: {str(e).splitlines()[0]}\nper device: more than the {GB(hbm)} HBM: does not fit')
    if not fits:
        tips = [f'remat=full (now {cfg.remat}): keep only each layer input, recompute the rest'] \
            if cfg.remat != 'full' else []
        if cfg.per_device_batch > 1:
            tips.append(f'per_device_batch={cfg.per_device_batch // 2} grad_accum={cfg.grad_accum * 2}: the same '
                        'batch per update in half-size microbatches')
        if 'fsdp' in mesh.shape and mesh.shape['fsdp'] < len(devices):
            tips.append(f'more fsdp (now {mesh.shape["fsdp"]} of {len(devices)} devices), e.g. mesh=1,-1,1: '
                        'parameters and optimizer state sharded over every device')
        tips.append('or a smaller model (d_model, num_layers, mlp_dim) / a larger slice')
        log('to fit, try: ' + '; '.join(tips))
    return {'fits': fits, 'bytes_per_device': need, 'hbm_bytes': hbm, 'estimate': est, 'memory': memory}


# ==================================================================================================
# Hugging Face Llama export and import (numpy only: no torch), and text generation with a KV cache.
# ==================================================================================================
# Our layer parameter -> HF tensor under model.layers.{i}. HF Linear weights are [out, in]; ours keep the
# input axis first ('in': wq [D,H,K]) or the output axis last ('out': wo [H,K,D]). Both use rotate-half
# RoPE, so q and k need no permutation.
_HF_LAYER = (('self_attn.q_proj', ('attn', 'wq'), 'in'), ('self_attn.k_proj', ('attn', 'wk'), 'in'),
             ('self_attn.v_proj', ('attn', 'wv'), 'in'), ('self_attn.o_proj', ('attn', 'wo'), 'out'),
             ('mlp.gate_proj', ('mlp', 'w_gate'), 'in'), ('mlp.up_proj', ('mlp', 'w_up'), 'in'),
             ('mlp.down_proj', ('mlp', 'w_down'), 'out'), ('input_layernorm', ('attn_norm', 'scale'), None),
             ('post_attention_layernorm', ('mlp_norm', 'scale'), None))
_HF_KEYS = {'d_model': 'hidden_size', 'mlp_dim': 'intermediate_size', 'num_heads': 'num_attention_heads',
            'num_kv_heads': 'num_key_value_heads', 'head_dim': 'head_dim', 'num_layers': 'num_hidden_layers',
            'vocab_size': 'vocab_size', 'norm_eps': 'rms_norm_eps', 'rope_theta': 'rope_theta',
            'tie_embeddings': 'tie_word_embeddings'}
_ST_DTYPES = {'F32': np.float32, 'BF16': jnp.bfloat16, 'F16': np.float16}


def hf_names(cfg):
    """[(HF tensor name, our params path, index in the scanned layer stack or None, layout)]."""
    out = [('model.embed_tokens.weight', ('embed',), None, None),
           ('model.norm.weight', ('final_norm', 'scale'), None, None)]
    if not cfg.tie_embeddings:
        out.append(('lm_head.weight', ('lm_head',), None, 'in'))
    for i in range(cfg.num_layers):
        layer, idx = ('layers', i) if cfg.scan_layers else (f'layers_{i}', None)
        out += [(f'model.layers.{i}.{hf}.weight', ('trunk', layer, *ours), idx, how) for hf, ours, how in _HF_LAYER]
    return out


def write_safetensors(path, tensors):
    """The safetensors format: 8-byte little-endian header size, a JSON header (dtype, shape, byte range of
    each tensor) padded with spaces to a multiple of 8 so the data stays aligned, then the raw bytes."""
    names = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
    header, offset = {'__metadata__': {'format': 'pt'}}, 0  # transformers wants format=pt
    for name, w in tensors.items():
        header[name] = {'dtype': names[w.dtype], 'shape': list(w.shape), 'data_offsets': [offset, offset + w.nbytes]}
        offset += w.nbytes
    raw = json.dumps(header, separators=(',', ':')).encode()
    raw += b' ' * (-len(raw) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(raw)) + raw)
        for w in tensors.values():
            f.write(np.ascontiguousarray(w).tobytes())


def read_safetensors(path):
    with open(path, 'rb') as f:
        header = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))
        buf = f.read()
    header.pop('__metadata__', None)
    out = {}
    for name, h in header.items():
        if h['dtype'] not in _ST_DTYPES:
            raise ConfigError(f'{path}: tensor {name} has dtype {h["dtype"]}; supported: {", ".join(_ST_DTYPES)}')
        out[name] = np.frombuffer(buf[slice(*h['data_offsets'])], _ST_DTYPES[h['dtype']]).reshape(h['shape'])
    return out


def export_hf(cfg, params, ds, out_dir):
    """mode=export: config.json, model.safetensors (weight dtype), tokenizer.model (+ tokenizer_config.json)."""
    host = multihost_utils.process_allgather(params, tiled=True)  # whole arrays on every host
    tensors = {}
    for name, path, i, how in hf_names(cfg):
        w = host
        for k in path:
            w = w[k]
        w = w if i is None else w[i]
        if how:  # to HF's [out, in]: flatten the head axes on the non-embedding side, then transpose
            w = (w.reshape(w.shape[0], -1) if how == 'in' else w.reshape(-1, w.shape[-1])).T
        tensors[name] = w
    bos, eos = (ds.bos_id, ds.eos_id) if ds.tokenizer else (None, None)
    conf = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_act': 'silu',
            'attention_bias': False, 'mlp_bias': False, 'max_position_embeddings': cfg.max_target_length,
            'torch_dtype': cfg.weight_dtype, 'bos_token_id': bos, 'eos_token_id': eos,
            **{hf: model_lib.dims(cfg) if ours == 'head_dim' else cfg[ours] for ours, hf in _HF_KEYS.items()}}
    if jax.process_index() == 0:
        os.makedirs(out_dir, exist_ok=True)
        write_safetensors(os.path.join(out_dir, 'model.safetensors'), tensors)
        with open(os.path.join(out_dir, 'config.json'), 'w') as f:
            json.dump(conf, f, indent=2)
        if ds.tokenizer:
            with open(os.path.join(out_dir, 'tokenizer.model'), 'wb') as f:
                f.write(ds.tokenizer.serialized_model_proto())
            piece = ds.tokenizer.id_to_piece
            with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
                json.dump({'tokenizer_class': 'LlamaTokenizer', 'bos_token': piece(bos), 'eos_token': piece(eos),
                           'unk_token': piece(ds.tokenizer.unk_id()), 'add_bos_token': True, 'add_eos_token': False,
                           'add_prefix_space': False,  # ours is trained without sentencepiece's dummy prefix
                           'model_max_length': cfg.max_target_length}, f, indent=2)
    log(f'exported {len(tensors)} tensors ({cfg.weight_dtype}) as a Hugging Face Llama checkpoint to {out_dir}'
        + ('' if ds.tokenizer else ' (no tokenizer: dataset=synthetic has none)'))
    return tensors


def load_hf(path, abstract_params, cfg):
    """load_hf=DIR: a Hugging Face Llama checkpoint -> our params in the run's shardings (fine-tuning)."""
    if cfg.load_params:
        raise ConfigError('load_params and load_hf are both set; keep one')
    try:
        with open(os.path.join(path, 'config.json')) as f:
            conf = json.load(f)
        tensors = read_safetensors(os.path.join(path, 'model.safetensors'))
    except OSError as e:
        raise ConfigError(f'load_hf={path}: cannot read {e.filename} ({e.strerror}); give a directory with '
                          'config.json and one model.safetensors') from None
    conf.setdefault('rope_theta', (conf.get('rope_parameters') or {}).get('rope_theta'))  # transformers 5 nests it
    conf.setdefault('head_dim', conf.get('hidden_size', 0) // conf.get('num_attention_heads', 1))
    conf.setdefault('tie_word_embeddings', False)  # LlamaConfig's default
    for ours, hf in _HF_KEYS.items():
        want = model_lib.dims(cfg) if ours == 'head_dim' else cfg[ours]
        if not (conf.get(hf) == want or isinstance(want, float) and math.isclose(conf.get(hf) or 0, want)):
            raise ConfigError(f'load_hf={path}: config.json has {hf}={conf.get(hf)} but {ours}={want}; '
                              f'set {ours}={conf.get(hf)}')
    for key, plain in (('hidden_act', 'silu'), ('attention_bias', False), ('mlp_bias', False), ('rope_scaling', None)):
        if conf.get(key, plain) != plain:
            raise ConfigError(f'load_hf={path}: {key}={conf[key]!r} is not supported (plain Llama: {plain!r})')
    flat = {}
    for name, p, i, how in hf_names(cfg):
        if name not in tensors:
            raise ConfigError(f'load_hf={path}: model.safetensors has no tensor {name}')
        w = tensors[name] if how is None else tensors[name].T  # reshaped to our layout below
        flat[p] = w if i is None else flat.get(p, []) + [w]

    def place(keypath, a):
        w = np.asarray(flat[tuple(k.key for k in keypath)])  # a list of layers stacks on a leading axis
        return jax.device_put(w.reshape(a.shape).astype(a.dtype), a.sharding)
    log(f'loaded Hugging Face checkpoint {path}')
    return jax.tree_util.tree_map_with_path(place, abstract_params)


def generate(cfg, params, prompt_BP, key):
    """prompt [B, P] -> [B, max_new_tokens] sampled tokens. The prompt fills the KV cache in one pass
    (prefill); then a jitted scan of single-token steps: each new token costs one position, not the
    whole prefix. Shapes are static (cache length P + max_new_tokens), so it compiles once."""
    B, P = prompt_BP.shape
    N, V = cfg.max_new_tokens, cfg.vocab_size
    # One query per step needs no recompute and no flash kernel: plain XLA attention over the cache.
    model = model_lib.Transformer(Config(**{**cfg.__dict__, 'decode_len': P + N, 'remat': 'none',
                                            'attention': 'xla'}))

    def sample(logits_BV, key):
        if cfg.temperature == 0:
            return jnp.argmax(logits_BV, -1).astype(jnp.int32)
        if 0 < cfg.top_k < V:
            kth_B1 = jax.lax.top_k(logits_BV, cfg.top_k)[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
        return jax.random.categorical(key, logits_BV / cfg.temperature).astype(jnp.int32)

    def run_all(params, prompt_BP, key):
        ones = lambda L: jnp.ones((B, L), jnp.int32)
        logits_BPV, cache = model.apply({'params': params}, prompt_BP, jnp.arange(P) * ones(P), ones(P),
                                        mutable=['cache'])
        keys = jax.random.split(key, N)

        def step(carry, key):  # feed the last sampled token, sample the next
            cache, tok_B, pos = carry
            logits_B1V, cache = model.apply({'params': params, **cache}, tok_B[:, None], pos * ones(1), ones(1),
                                            mutable=['cache'])
            return (cache, sample(logits_B1V[:, -1], key), pos + 1), tok_B

        (_, last_B, _), toks_NB = jax.lax.scan(step, (cache, sample(logits_BPV[:, -1], keys[0]), P), keys[1:])
        return jnp.concatenate([toks_NB.T, last_B[:, None]], axis=1)
    return jax.jit(run_all)(params, jnp.asarray(prompt_BP, jnp.int32), key)


def solve_puzzle(cfg, model, params, run_dir, mesh):
    """task=sudoku mode=generate: the TRM's grid for one puzzle given as prompt= (81 characters, '.' or '0'
    for blanks), givens kept, checked against the rules; printed and written to solution.txt."""
    text = cfg.prompt.replace('\n', '').replace(' ', '')
    if len(text) != data.SUDOKU_LEN or any(c not in '.0123456789' for c in text):
        raise ConfigError(f'prompt={cfg.prompt!r}: give the puzzle as 81 characters, digits 1-9 and . or 0 '
                          'for blanks, row by row')
    q_L = np.array([0 if c == '.' else int(c) for c in text], np.int32)
    rows = mesh.size  # the same puzzle on every device keeps the batch divisible by the mesh
    tile = lambda x: np.tile(x, (rows, 1)).astype(np.int32)
    batch = {'inputs': tile(q_L + 1), 'targets': tile(q_L + 1)}  # targets: unknown (only the value AUROC reads them)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(cfg)):
        preds_L = np.asarray(jax.jit(make_eval_step(cfg, model))(params, batch)[0])[-1, 0] - 1
    grid_L = np.where(q_L == 0, np.clip(preds_L, 0, 9), q_L)
    valid = bool(data.solved(grid_L[None])[0])
    shown = '\n'.join(' '.join(map(str, grid_L[r * 9:(r + 1) * 9])) for r in range(9))
    log(f'{shown}\n{"a valid solution" if valid else "NOT a valid solution"} (decoder={cfg.decoder})')
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, 'solution.txt'), 'w') as f:
            f.write(''.join(map(str, grid_L)) + '\n')
    return {'solution': ''.join(map(str, grid_L)), 'valid': valid, 'run_dir': run_dir}


def export_or_generate(cfg, params, ds, run_dir, mesh, model):
    """mode=export / mode=generate on loaded parameters."""
    if cfg.task == 'sudoku' and cfg.mode == 'generate':
        return solve_puzzle(cfg, model, params, run_dir, mesh)
    if cfg.task != 'lm':
        raise ConfigError(f'mode={cfg.mode} supports task=lm only (a TRM solver has no Llama export)')
    if cfg.mode == 'export':
        out_dir = cfg.export_dir or os.path.join(run_dir, 'hf')
        export_hf(cfg, params, ds, out_dir)
        return {'export_dir': out_dir}
    if ds.tokenizer is None:
        raise ConfigError('mode=generate needs a tokenizer: use a text dataset (dataset=synthetic has none)')
    prompt = np.asarray([[ds.bos_id] + ds.tokenizer.encode(cfg.prompt)], np.int32)
    if prompt.shape[1] + cfg.max_new_tokens > cfg.max_target_length:
        log(f'WARNING: prompt + max_new_tokens = {prompt.shape[1] + cfg.max_new_tokens} tokens, more than the '
            f'max_target_length={cfg.max_target_length} the model was trained on')
    with jax.set_mesh(mesh):
        tokens = np.asarray(generate(cfg, params, prompt, jax.random.key(cfg.seed)))[0].tolist()
    tokens = tokens[:tokens.index(ds.eos_id)] if ds.eos_id in tokens else tokens  # eos ends the document
    text = ds.tokenizer.decode(tokens)
    log(f'prompt: {cfg.prompt}\ncontinuation: {text}')
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, 'generation.txt'), 'w', newline='') as f:
            f.write(text)
    return {'prompt': cfg.prompt, 'tokens': tokens, 'generation': text, 'run_dir': run_dir}


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
        name = 'config.yml' if cfg.mode == 'train' else f'config.{cfg.mode}.yml'  # keep the training record
        with open(os.path.join(run_dir, name), 'w') as f:
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
    validate_hardware(cfg)
    if cfg.compile_cache_dir:  # before the first compile; every program is cached, however quick to compile
        jax.config.update('jax_compilation_cache_dir', os.path.abspath(cfg.compile_cache_dir))
        jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    if cfg.task == 'sudoku':  # the puzzle tokens fix the vocabulary; vocab_size is the text tokenizer's
        cfg.vocab_size = data.SUDOKU_VOCAB
    if cfg.compile_topology:
        return compile_for_topology(cfg)
    devices = devices or pick_devices(cfg)
    if devices[0].platform == 'tpu':
        warn_tpu_dims(cfg)
    mesh = make_mesh(cfg, devices)
    n_dev, n_proc, proc = len(devices), jax.process_count(), jax.process_index()
    run_dir = prepare_run_dir(cfg)

    # ---- derived sizes, computed once and printed ----
    micro_rows = cfg.per_device_batch * n_dev            # examples per microbatch, whole system
    step_rows = micro_rows * cfg.grad_accum              # examples per optimizer update
    local_micro = micro_rows // n_proc                   # this process's share of a microbatch
    L = cfg.max_target_length if cfg.task == 'lm' else 81
    log(f'devices: {n_dev} x {devices[0].device_kind} ({devices[0].platform}), {n_proc} process(es); '
        f'mesh {dict(mesh.shape)}')
    log(f'batch: {cfg.per_device_batch}/device x {n_dev} devices x {cfg.grad_accum} accum = {step_rows} '
        f'examples = {step_rows * L} tokens per step')
    if cfg.batch_ramp_start:
        log(f'batch ramp: {cfg.batch_ramp_start} accum at step 0, x2 every {cfg.batch_ramp_every} steps up to '
            f'{cfg.grad_accum}')

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
        if cfg.load_params and trm and cfg.mode in ('eval', 'generate'):  # TRM evaluates its EMA weights
            loaded_step, state['ema'] = load_params(cfg.load_params, abstract, mesh, cfg, 'ema')
            state['step'] = jnp.int32(loaded_step)  # reported with the eval: which training step this is
        elif cfg.load_params:
            state['params'] = load_params(cfg.load_params, abstract, mesh, cfg)[1]
            if trm:
                state['ema'] = state['params']
        if cfg.load_hf:
            state['params'] = load_hf(cfg.load_hf, abstract['params'], cfg)
    n_params = sum(x.size for x in jax.tree.leaves(state['params']))
    flops_tok = model_lib.flops_per_token(cfg)
    log(f'model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOPs per token (train)')
    if cfg.print_sharding:
        log(sharding_table(state['params'], state_sh['params']))
    if cfg.mode in ('export', 'generate'):  # issue 9: use the parameters, no training
        if not (restored or cfg.load_params or cfg.load_hf):
            raise ConfigError(f'mode={cfg.mode} needs trained parameters: set load_params=RUN_DIR, load_hf=DIR, '
                              f'or run_name= a run with checkpoints')
        return export_or_generate(cfg, state['ema'] if trm else state['params'], ds, run_dir, mesh, model)

    batch_spec = mesh_spec(('batch', 'length'), (micro_rows, L), cfg, mesh)
    step_sh = NamedSharding(mesh, P(None, *batch_spec))   # [A, B, L]: microbatch axis unsharded
    eval_sh = NamedSharding(mesh, batch_spec)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        train_step = jax.jit(make_train_step(cfg, model, tx), in_shardings=(state_sh, step_sh),
                             out_shardings=(state_sh, None), donate_argnums=0)
        eval_step = jax.jit(make_eval_step(cfg, model), in_shardings=(state_sh['params'], eval_sh))

    def evaluate(state, n_batches=cfg.eval_batches):
        if not n_batches:
            return {}
        batches, t0 = ds.eval_batches(micro_rows // n_proc, n_batches), time.perf_counter()
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            params = state['ema'] if trm else state['params']
            sums = [eval_step(params, global_batch(b, eval_sh, micro_rows)) for b in batches]
        if trm:  # scored on the host; every process gathers all rows (puzzles, predictions) in process order
            gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
            outs = [[gather(x) for x in o] for o in sums]
            real = [gather(b['segment_ids'])[:, 0] > 0 for b in batches]
            scores = [sudoku_scores(o[0], {k: gather(b[k]) for k in ('inputs', 'targets', 'segment_ids')})
                      for o, b in zip(outs, batches)]
            exact_S, cells_S, blanks, n = (sum(s[i] for s in scores) for i in range(4))
            if cfg.mode == 'eval' and proc == 0:  # the answers themselves, givens as in the puzzle
                data.write_sudoku_csv(os.path.join(run_dir, 'predictions.csv'), ds.eval_q,
                                      np.concatenate([s[4] for s in scores])[:len(ds.eval_q)])
            exact_S, cells_S = exact_S / max(n, 1), cells_S / max(blanks, 1)
            cat = lambda i: np.concatenate([o[i][r] for o, r in zip(outs, real)])
            result = {'exact_accuracy': float(exact_S[-1]), 'cell_accuracy': float(cells_S[-1]),
                      'num_puzzles': int(n), 'decoder': cfg.decoder, 'forward_passes': float(np.mean(cat(1))),
                      'value_auroc': auroc(cat(2), cat(3).astype(bool)), 'seconds': time.perf_counter() - t0}
            if len(exact_S) > 1:  # does recursion help? accuracy after each supervision step
                result.update(exact_accuracy_per_step=[round(float(e), 4) for e in exact_S],
                              cell_accuracy_per_step=[round(float(c), 4) for c in cells_S])
            return result
        loss = float(sum(s[0] for s in sums)) / max(float(sum(s[1] for s in sums)), 1.0)
        return {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 50.0))}

    if cfg.mode == 'eval':
        if not (restored or cfg.load_params or cfg.load_hf):
            raise ConfigError(f'mode=eval needs trained parameters: set load_params=RUN_DIR, or run_name= a run '
                              f'with checkpoints (none in {run_dir}/checkpoints)')
        n_batches = -(-len(ds.eval_records) // (micro_rows // n_proc)) if trm else cfg.eval_batches  # TRM: all
        result = {'step': int(state['step']), **evaluate(state, n_batches)}
        if proc == 0:
            with open(os.path.join(run_dir, 'eval.json'), 'w') as f:
                json.dump(result, f)
        log(json.dumps(result))
        return result

    peak, peak_src = device_peak_flops(cfg.dtype, devices[0])
    # On CPU the simulated devices share one processor: the measured peak is for the whole machine.
    peak_total = peak if devices[0].platform == 'cpu' else peak * n_dev
    log(f'peak: {peak / 1e12:.3f} TFLOP/s per device ({peak_src})')
    t_xla, compiled_gb = 0.0, None
    if cfg.task == 'lm':  # compile before step 1 (the first call reuses it) to show the memory it will take
        t0 = time.perf_counter()
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            batch = abstract_batch(cfg, accum_at(cfg, int(state['step'])), micro_rows, L, step_sh)
            m = train_step.lower(state, batch).compile().memory_analysis()
        t_xla = time.perf_counter() - t0
        log(f'step compiled in {t_xla:.1f}s; ' + estimate_line(cfg, memory_estimate(cfg, abstract, mesh)))
        if m is not None:
            line, compiled_gb = compiled_line(m)
            log(line)
    metrics_file = open(os.path.join(run_dir, 'metrics.jsonl'), 'a') if proc == 0 else None
    tb = TensorBoard(run_dir) if proc == 0 else None

    # ---- signals: SIGTERM (preemption, schedulers) and SIGINT finish the step, checkpoint, exit ----
    caught = []
    handlers = {sig: signal.signal(sig, lambda signum, _: caught.append(signal.Signals(signum).name))
                for sig in (signal.SIGTERM, signal.SIGINT)
                if threading.current_thread() is threading.main_thread() and not (n_proc > 1 and sig == signal.SIGTERM)}

    # ---- the loop ----
    # Data is read in microbatch units, so the batch ramp changes only how many a step takes.
    it = ds.train_iter(local_micro, state=data_state)
    def next_step(A):  # A microbatches as one [A, B, L] global batch
        if cfg.batch_ramp_start and step % cfg.batch_ramp_every == 0:
            log(f'batch ramp: step {step + 1} on: {A} x {micro_rows} = {A * micro_rows} examples per step')
        mbs = [next(it) for _ in range(A)]
        return global_batch({k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]}, step_sh, micro_rows)
    summary, window, extras, t_compile, skipped = {}, [], [], None, 0
    t_last, tokens_since, wait_last, timed_steps = time.perf_counter(), 0.0, 0.0, 0
    step = saved = int(state['step'])
    pending, step_times, t_done, last = [], [], None, {}  # pending: steps dispatched, not yet read on the host

    def drain(keep):
        """Read finished steps' outputs on the host, oldest first, until `keep` remain in flight. Keeping
        one lets the host dispatch step n+1 while step n runs; a non-finite loss then stops one step later,
        but every log line, eval and checkpoint drains fully first, so none of them sees an unchecked step."""
        nonlocal t_compile, t_done, t_last, wait_last, tokens_since, timed_steps, skipped
        while len(pending) > keep:
            s, t0, out = pending.pop(0)
            out = last['out'] = jax.device_get(out)
            now = time.perf_counter()
            if t_compile is None:
                t_compile = now - t0
                log(f'first step ({"run" if t_xla else "compile + run"}): {t_compile:.1f}s')
                t_last, wait_last = now, it.wait_seconds
            else:
                tokens_since += float(out['tokens'])
                timed_steps += 1
                step_times.append(now - max(t_done, t0))  # from the previous step's end, or this one's dispatch
            t_done = now
            if not np.isfinite(out['loss']) or not np.isfinite(out['grad_norm']):
                skipped += 1
                if skipped > cfg.skip_nonfinite_steps:
                    raise FloatingPointError(
                        f'loss is {out["loss"]} at step {s}; stopping (checkpoints up to step {saved} are '
                        'intact; lower learning_rate, raise warmup_steps, or set skip_nonfinite_steps)')
                log(f'WARNING: non-finite loss at step {s}: update skipped ({skipped} of '
                    f'skip_nonfinite_steps={cfg.skip_nonfinite_steps})')
            else:
                window.append(float(out['loss']))
                extras.append({k: float(out[k]) for k in ('halt_rate', 'sup_steps', 'train_exact', 'value_acc')
                               if k in out and (k != 'value_acc' or s > cfg.tot.start_step)})  # (value pass on)
        return last.get('out')
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            while step < cfg.steps:
                if step + 1 == cfg.profile_steps[0]:
                    drain(0)
                    jax.profiler.start_trace(os.path.join(run_dir, 'profile'))
                t0 = time.perf_counter()
                state, out = train_step(state, next_step(accum_at(cfg, step)))
                step += 1
                pending.append((step, t0, out))
                drain(1)
                if step == cfg.profile_steps[1]:
                    drain(0)
                    jax.profiler.stop_trace()
                    log(f'profile of steps {cfg.profile_steps[0]}-{step}: {run_dir}/profile')
                if step % cfg.log_every == 0 or step == cfg.steps:
                    out = drain(0)
                    now = time.perf_counter()
                    dt = max(now - t_last, 1e-9)
                    tps = tokens_since / dt
                    m = {'step': step, 'loss': float(np.mean(window)) if window else float('nan'),
                         'learning_rate': float(schedule(step - 1)), 'grad_norm': float(out['grad_norm']),
                         'tokens_per_sec': tps, 'tokens_per_sec_per_device': tps / n_dev,
                         'tflops_per_device': tps * flops_tok / n_dev / 1e12, 'mfu': tps * flops_tok / peak_total,
                         'step_seconds': dt / max(timed_steps, 1), 'tokens_per_step': float(out['tokens']),
                         'data_wait_fraction': (it.wait_seconds - wait_last) / dt, 'host_rss_gb': host_rss_gb()}
                    m.update({k: float(np.mean([e[k] for e in extras if k in e]))  # TRM
                              for k in dict.fromkeys(k for e in extras for k in e)})
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
                    drain(0)  # a checkpoint holds only checked steps
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
    summary.update({'run_dir': run_dir, 'compile_seconds': t_xla + (t_compile or 0),
                    'step_variants': train_step._cache_size()})
    if step_times:  # the benchmark summary: medians over every timed step (the first, compiling, excluded)
        med = float(np.median(step_times))
        tps = float(summary['tokens_per_step']) / med
        summary.update(median_step_seconds=med, median_tokens_per_sec=tps, median_mfu=tps * flops_tok / peak_total)
        log(f'benchmark: {len(step_times)} timed steps, median {med:.3f} s/step = {tps:,.0f} tokens/s, '
            f'{tps * flops_tok / n_dev / 1e12:.3f} TFLOP/s per device, MFU {tps * flops_tok / peak_total:.1%} of '
            f'{peak / 1e12:.3f} TFLOP/s ({peak_src}); compile + first step {summary["compile_seconds"]:.1f}s; '
            f'host RSS {host_rss_gb():.2f} GiB' + (f', device peak {mem:.2f} GiB' if (mem := device_peak_memory_gb(
                devices[0])) is not None else '') + (f', compiled step {compiled_gb / GiB:.2f} GiB' if compiled_gb else ''))
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
        cfg = load_config(argv[1], argv[2:])
        init_distributed()
        if run(cfg).get('fits') is False:
            return DOES_NOT_FIT
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
