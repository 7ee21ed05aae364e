"""Train a GQA transformer with JAX: python train.py base.yml [your.yml ...] [key=value ...]

The sections, under banners, go from the pieces to the whole: config, devices and mesh, sharding, state, the
step, eval, storage, checkpoints, metrics, the loop, the other modes, the TPU fit check, the run directory and
run(), and last the command line. A run calls them in this order (each name is a function here):
  main -> load_config -> run: check, resolve -> build (make_mesh, make_feed, state_layout) -> data.make_dataset
  -> run_directory -> restore_or_init -> compile_steps (make_train_step) -> train: compile_step -> train_loop
  (next_batch, the step, InFlight / Window -> MetricsWriter, save_checkpoint).
What is trained, the language model or the puzzle heads, is a model.Task picked once in run(); the data
pipelines are in data.py. Shape letters: model.py's header.
"""
import contextlib
import dataclasses
import difflib
import fcntl
import functools
import glob
import importlib.util
import itertools
import json
import logging
import math
import os
import pkgutil
import re
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Annotated, Any, Callable, Literal, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pydantic
import safetensors.numpy
import yaml
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from pydantic import BeforeValidator, Field
from tensorboardX import SummaryWriter

import data
import model as model_lib

GiB = 2 ** 30
gb = lambda n_bytes: f'{n_bytes / GiB:.2f} GiB'


class ConfigError(Exception):
    """A user mistake in the config or command line: printed as one line, no traceback."""


# ==================================================================================================
# Config: every key declared once below with its type and bounds; base.yml holds its default and doc.
# ==================================================================================================
def _number(value):
    """YAML reads yes/true as a boolean, which pydantic would take as 1 for a number key."""
    if isinstance(value, bool):
        raise ValueError('a number')
    return value


def _items(value):
    """A list typed on the command line: 4,4,2 or YAML ([[batch, data]]); from a YAML file as it is."""
    if isinstance(value, str) and value.startswith('['):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError('a list: 4,4,2 or [4, 4, 2] with its brackets closed') from None
    if isinstance(value, str):
        return [v.strip() for v in value.split(',')]
    return value if isinstance(value, (list, tuple)) else [value]  # one value (YAML's 45) is a list of one


Number = BeforeValidator(_number)
INT_MAX = 2 ** 31 - 1  # steps, counts and sizes reach jitted code as int32
Count = Annotated[int, Number, Field(ge=1, le=INT_MAX)]            # at least one
Off = Annotated[int, Number, Field(ge=0, le=INT_MAX)]              # a count where 0 means off, none or all
Positive = Annotated[float, Number, Field(gt=0)]
NonNeg = Annotated[float, Number, Field(ge=0)]
Share = Annotated[float, Number, Field(ge=0, le=1)]    # a probability or fraction
Decay = Annotated[float, Number, Field(ge=0, lt=1)]    # a moving-average decay: 1 would never move
Ints = Annotated[tuple[int, ...], BeforeValidator(_items)]
Names = Annotated[tuple[str, ...], BeforeValidator(_items)]
AxisRule = tuple[str, str | tuple[str, ...] | None]


class Keys(pydantic.BaseModel):
    """Frozen (nothing changes a config once loaded; resolve() makes a new one), strict about names."""
    model_config = pydantic.ConfigDict(frozen=True, extra='forbid', coerce_numbers_to_str=True, allow_inf_nan=False)


KINDS = {'count': Count, 'off': Off, 'positive': Positive, 'nonneg': NonNeg, 'share': Share, 'decay': Decay,
         'bool': bool, 'str': str}


def kind_type(kind):
    """A task's key kind (model.Task.keys) as its type: a name in KINDS, ('int', lo, hi), ('ints', lo, hi) for a
    list of those, or a tuple of the values allowed."""
    if isinstance(kind, str):
        return KINDS[kind]
    if kind[0] in ('int', 'ints'):
        one = Annotated[int, Number, Field(ge=kind[1], le=kind[2])]
        return one if kind[0] == 'int' else Annotated[tuple[one, ...], BeforeValidator(_items), Field(min_length=1)]
    return Literal[kind]


# (type, keys): every key of base.yml, each once, grouped by type; what it means and its default are written
# in base.yml. A dotted key lives in a section (trm.T: `T` of section `trm`). The trainer's keys, then each
# task's own (model.Task.keys).
SCHEMA = [
    (Count, 'steps log_every max_new_tokens vocab_size d_model num_layers num_heads num_kv_heads mlp_dim '
            'max_target_length grad_accum'),
    (Off, 'eval_every eval_batches checkpoint_every keep_checkpoints skip_nonfinite_steps top_k head_dim '
          'warmup_steps prefetch seed'),
    (Positive, 'rope_theta norm_eps learning_rate adam_eps'),
    (NonNeg, 'temperature weight_decay grad_clip'),
    (Share, 'min_lr_ratio'),
    (Decay, 'adam_b1 adam_b2'),
    (bool, 'print_sharding resume tie_embeddings scan_layers hf_streaming'),
    (str, 'run_name output_dir compile_cache_dir load_params export_dir load_hf prompt compile_topology dataset_path '
          'eval_path tfds_name data_dir train_split eval_split text_key tokenizer_path cache_dir wandb_project '
          'wandb_entity hf_path hf_name hf_data_files hf_split hf_eval_split'),
    (Ints, 'mesh profile_steps'),
    (Names, 'mesh_axes'),
    (Annotated[tuple[AxisRule, ...], BeforeValidator(_items)], 'logical_axis_rules'),
    (Count | Literal['auto'], 'per_device_batch'),
    (Off | Literal['auto'], 'vocab_tile'),
    (Literal[tuple(model_lib.TASKS)], 'task'),
    (Literal['train', 'eval', 'export', 'generate'], 'mode'),
    (Literal['auto', 'float32', 'bfloat16', 'float16'], 'dtype'),
    (Literal['float32', 'bfloat16'], 'weight_dtype'),
    (Literal['none', 'full', 'save_dots'], 'remat'),
    (Literal['auto', 'einsum', 'xla', 'cudnn', 'splash'], 'attention'),
    (Literal['stdlib', 'files', 'tfds', 'hf', 'synthetic'], 'dataset'),
] + [(kind_type(kind), keys) for task in model_lib.TASKS.values() for kind, keys in task.keys]
KEYS = [key for _, keys in SCHEMA for key in keys.split()]


def make_schema(table):
    """The config's pydantic model from the table: a field per key, a nested model per section."""
    fields = {}
    for typ, keys in table:
        for key in keys.split():
            section, _, name = key.rpartition('.')
            fields.setdefault(section, {})[name] = (typ, ...)
    sections = {name: (pydantic.create_model(name, __base__=Keys, **f), ...) for name, f in fields.items() if name}
    return pydantic.create_model('Config', __base__=Keys, **fields.pop(''), **sections)


Config = make_schema(SCHEMA)


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


def load_config(paths, overrides=()):
    """YAML files (base.yml, then any files of your own, later keys winning) + ['key=value', ...] -> Config,
    all checked by the one schema. Raises ConfigError naming the key on any mistake."""
    raw = {}
    for path in [paths] if isinstance(paths, str) else paths:
        merge(raw, read_yaml(path), path, '')
    path = paths if isinstance(paths, str) else paths[-1]
    given = set()
    for item in overrides:
        key, eq, text = item.partition('=')
        if not eq:
            raise ConfigError(f'argument {item!r} is not key=value')
        if key in given:
            raise ConfigError(f'{key} is given twice on the command line; keep one')
        try:
            text.encode()
        except UnicodeEncodeError:  # Python keeps bytes that are not UTF-8 as surrogates: the tokenizer cannot
            raise ConfigError(f'{key}=: the value is not UTF-8 text; retype it, or set the terminal to '
                              'UTF-8') from None
        if key not in KEYS:
            raise ConfigError(unknown_key(key, path))
        given.add(key)
        merge(raw, functools.reduce(lambda value, name: {name: value}, reversed(key.split('.')), text), path, '')
    try:
        return Config.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(schema_error(e.errors()[0], path, raw)) from None


def read_yaml(path):
    try:
        with open(path) as f:
            raw = yaml.load(f, _UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f'cannot read config file {path}: {e.strerror}') from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: bytes that are not text
        raise ConfigError(f'{path} is not valid YAML: {first_line(e, typed=False, limit=None)}') from None
    if not isinstance(raw, dict):
        raise ConfigError(f'{path}: expected key: value lines at the top level, as in base.yml')
    return raw


def merge(into, new, path, prefix):
    """The keys of `new` (read from `path`) over `into`, section by section, each checked to be a key."""
    for name, value in new.items():
        if isinstance(name, str) and '.' in name:  # `trm.T: 3` in a file is `trm:` then `T: 3`
            name, _, rest = name.partition('.')
            value = {rest: value}
        key = f'{prefix}{name}'
        if not any(k == key or k.startswith(f'{key}.') for k in KEYS):
            raise ConfigError(f'{path}: {unknown_key(key, path)}')
        section = any(k.startswith(f'{key}.') for k in KEYS)
        if section != isinstance(value, dict):
            raise ConfigError(f'{path}: {key} is {"a section of keys, not a value" if section else "a value, not a section"}')
        if section:
            merge(into.setdefault(name, {}), value, path, f'{key}.')
        else:
            into[name] = value


def unknown_key(key, path):
    close = difflib.get_close_matches(key, KEYS, n=1)
    return f'unknown key {key!r}' + (f'; did you mean {close[0]}?' if close else f'; the keys are listed in {path}')


def schema_error(err, path, raw):
    """pydantic's first complaint as our one line: the key, its value as typed, what it must be."""
    names = [p for p in err['loc'] if isinstance(p, str) and p in {k for key in KEYS for k in key.split('.')}]
    key, kind, value = '.'.join(names), err['type'], raw
    for name in names:  # the whole value of the key (err['input'] is only the bad item of a list)
        value = value.get(name) if isinstance(value, dict) else None
    shown = value if isinstance(value, str) else json.dumps(value, default=str)  # as typed, or as YAML wrote it
    if kind == 'extra_forbidden':
        return unknown_key(key, path)
    if key == 'logical_axis_rules':
        return (f'logical_axis_rules={shown}: give a list of [logical axis, mesh axis or list of them or null] '
                'pairs, e.g. [[batch, [data, fsdp]], [embed, fsdp]]')
    if kind == 'missing':
        return f'{path}: key {key} is missing; list base.yml first to take it from there: train.py base.yml {path}'
    if kind == 'literal_error':
        return f'{key}={value!r}: choose one of {err["ctx"]["expected"].replace(" or ", ", ")}'
    ops = {'greater_than': '>', 'greater_than_equal': '>=', 'less_than': '<', 'less_than_equal': '<='}
    if kind in ops:
        bound = next(iter(err['ctx'].values()))
        return f'{key}={shown}: must be {ops[kind]} {f"{bound:g}" if isinstance(bound, float) else bound}'
    expected = {'int': 'an integer', 'float': 'a number', 'value': 'a number', 'bool': 'true or false', 'string': 'text',
                'model': 'a section of keys', 'dict': 'a section of keys', 'tuple': 'a list', 'list': 'a list',
                'finite': 'a finite number'}
    what = err['ctx']['error'] if kind == 'value_error' else next((v for k, v in expected.items()
                                                                   if kind.startswith(k)), kind)
    return f'{key}={shown}: expected {what}' + (' in each entry' if any(isinstance(p, int) for p in err['loc']) else '')


def check(cfg, task):
    """The rules that tie keys together, and the task's own; each message names the key and the fix."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f'num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}')
    if not cfg.head_dim and cfg.d_model % cfg.num_heads:
        raise ConfigError(f'd_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}; '
                          'change one, or set head_dim explicitly')
    if model_lib.dims(cfg) % 2:
        raise ConfigError(f'head dim {model_lib.dims(cfg)} must be even for RoPE; set head_dim')
    mesh = ','.join(map(str, cfg.mesh))
    if len(cfg.mesh) != len(cfg.mesh_axes):
        raise ConfigError(f'mesh={mesh} has {len(cfg.mesh)} entries but mesh_axes={",".join(cfg.mesh_axes)} '
                          f'names {len(cfg.mesh_axes)}')
    if cfg.mesh.count(-1) > 1 or any(m == 0 or m < -1 for m in cfg.mesh):
        raise ConfigError(f'mesh={mesh}: use positive sizes and at most one -1')
    for name, axes in cfg.logical_axis_rules:
        unknown = [a for a in (axes if isinstance(axes, tuple) else [axes]) if a is not None and a not in cfg.mesh_axes]
        if unknown:
            raise ConfigError(f'logical_axis_rules maps {name!r} to mesh axis {unknown[0]!r}, which mesh_axes='
                              f'{",".join(cfg.mesh_axes)} does not name')
    a, b = (list(cfg.profile_steps) + [-1, -1])[:2]
    if len(cfg.profile_steps) != 2 or [a, b] != [0, 0] and not 1 <= a <= b <= cfg.steps:
        raise ConfigError(f'profile_steps={",".join(map(str, cfg.profile_steps))}: give two steps a,b with '
                          f'1 <= a <= b <= steps={cfg.steps} (0,0 = off)')
    if cfg.compile_topology and cfg.compile_topology not in TPU_SLICES:
        raise ConfigError(f'compile_topology={cfg.compile_topology}: choose one of {", ".join(TPU_SLICES)}')
    if cfg.vocab_tile not in (0, 'auto') and cfg.vocab_size % cfg.vocab_tile:
        raise ConfigError(f'vocab_tile={cfg.vocab_tile}: must divide vocab_size={cfg.vocab_size} (0 = off)')
    if cfg.per_device_batch == 'auto' and not cfg.compile_topology:
        raise ConfigError('per_device_batch=auto is the fit check\'s search: give compile_topology=SLICE, or a number '
                          'to train')
    if cfg.load_params and cfg.load_hf:
        raise ConfigError('load_params and load_hf are both set; keep one')
    if not cfg.run_name or os.sep in cfg.run_name or cfg.run_name in ('.', '..'):
        raise ConfigError(f'run_name={cfg.run_name!r}: give a plain directory name (the run goes to '
                          'output_dir/run_name)')
    for key in ('run_name', 'output_dir'):  # orbax writes the path into a JSON spec without escaping it
        if '\\' in getattr(cfg, key):
            raise ConfigError(f'{key}={getattr(cfg, key)}: the checkpoint library cannot write under a path with a '
                              'backslash; choose a name without one')
    if cfg.wandb_project and importlib.util.find_spec('wandb') is None:
        raise ConfigError(f'wandb_project={cfg.wandb_project}: wandb is not installed: pip install wandb==0.31.0 (or '
                          'set wandb_project=)')
    if message := task.check(cfg):
        raise ConfigError(message)
    check_paths(cfg)


def check_paths(cfg):
    """Every path the user typed must exist, whatever else the run does (a resumable run directory would
    otherwise hide a mistyped load_params). Data paths may be globs; any of them may be on gs://."""
    check_credentials(cfg)
    for key in ('data_dir', 'cache_dir'):  # array_record's own file layer (no TensorFlow) and flock: local only
        if remote(getattr(cfg, key)):
            raise ConfigError(f'{key}={getattr(cfg, key)}: prepared datasets are read through a local file layer; '
                              f'give a local directory (copy the data down with `gcloud storage cp -r`, or mount the '
                              'bucket with gcsfuse)')
    is_dir, is_file = lambda p: stored(p).is_dir(), lambda p: stored(p).is_file()
    matches = lambda pattern: bool(data.expand(pattern))
    listed = lambda files: all(matches(f.strip()) for f in files.split(',') if f.strip())
    wanted = {'load_params': is_dir, 'load_hf': is_dir, 'tokenizer_path': is_file,
              'data_dir': is_dir, 'dataset_path': matches, 'eval_path': matches, 'hf_data_files': listed}
    for key, exists in wanted.items():
        value = getattr(cfg, key)
        if value and not exists(value):
            what = ('no such directory' if exists is is_dir else
                    'matches no files' if any(c in value for c in '*?[,') else 'no such file')
            raise ConfigError(f'{key}={value}: {what}; fix the path (or set {key}= to leave it out)')
    if cfg.load_params and not checkpoint_steps(cfg.load_params)[1]:
        raise ConfigError(f'load_params={cfg.load_params}: no checkpoint there; give a run directory, its '
                          'checkpoints/ directory or one checkpoints/STEP directory')


def resolve(cfg, task, platform, device_kind=''):
    """The config as run: dtype=auto made concrete (bfloat16 on TPU, GPU and CPUs with bf16 instructions,
    float32 on other CPUs, where XLA:CPU's bf16 step is slower), attention=auto (splash on TPU chips whose
    compiler takes the Pallas kernel, v4 on; XLA's on v2 and v3, whose Mosaic refuses its bf16 matmuls;
    cuDNN's on GPU; einsum on CPU), vocab_tile=auto (4096 on TPU, off elsewhere), and the values the task
    decides (the puzzle vocabulary and length).
    Computed once; config.yml records the result."""
    fixed = task.fixed(cfg)
    if cfg.dtype == 'auto':
        bf16 = platform != 'cpu' or cpu_has_bf16()
        fixed['dtype'] = 'bfloat16' if bf16 else 'float32'
        log(f'dtype=auto: {fixed["dtype"]} on {platform}' + ('' if bf16 else ' (a CPU without bf16 instructions)'))
    old_tpu = device_kind.startswith(('TPU v2', 'TPU v3'))
    if cfg.attention == 'auto':
        fixed['attention'] = {'tpu': 'xla' if old_tpu else 'splash', 'gpu': 'cudnn'}.get(platform, 'einsum')
        log(f'attention=auto: {fixed["attention"]} on {device_kind or platform}')
    if cfg.vocab_tile == 'auto':  # on TPU the memory it frees buys batch; XLA:CPU runs the recompute slower
        fixed['vocab_tile'] = 4096 if platform == 'tpu' and cfg.vocab_size % 4096 == 0 else 0
    attention = fixed.get('attention', cfg.attention)
    if attention == 'splash' and (platform != 'tpu' or old_tpu):
        raise ConfigError(f'attention=splash: the Pallas kernel compiles for TPU v4 and later, not for '
                          f'{device_kind or platform}; use attention=auto')
    if attention == 'splash' and not model_lib.splash_block(cfg.max_target_length):
        raise ConfigError(f'attention=splash: max_target_length={cfg.max_target_length} is not a multiple of the '
                          'kernel\'s 128-token blocks (nor 512 or less); use a multiple of 128, or attention=xla')
    if attention == 'cudnn' and platform != 'gpu':
        raise ConfigError(f'attention=cudnn: cuDNN\'s kernel runs on NVIDIA GPUs, not on {device_kind or platform}; '
                          'use attention=auto')
    return cfg.model_copy(update=fixed)


# ==================================================================================================
# Devices and mesh. Only this file builds the mesh.
# ==================================================================================================
def cpu_has_bf16():
    """Whether this CPU has bf16 instructions: avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags."""
    flags = open('/proc/cpuinfo').read().split() if os.path.exists('/proc/cpuinfo') else []
    return 'avx512_bf16' in flags or 'amx_bf16' in flags


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
def mesh_spec(logical, shape, cfg, mesh):
    """One array's PartitionSpec from its logical axis names (model.dividing_spec: a dimension keeps the
    longest prefix of its mesh axes that divides it, so odd sizes stay replicated instead of failing)."""
    rules = dict(cfg.logical_axis_rules)
    for name in logical:
        if name is not None and name not in rules:
            raise ConfigError(f'logical axis {name!r} has no entry in logical_axis_rules; add [{name}, null]')
    return model_lib.dividing_spec(logical, shape, rules, dict(mesh.shape))


def shardings_for(logical, abstract, cfg, mesh):
    """NamedShardings for a tree of arrays from the same-shaped tree of logical PartitionSpecs."""
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, mesh_spec(spec, x.shape, cfg, mesh)),
                        logical, abstract, is_leaf=lambda x: isinstance(x, PartitionSpec))


def sharding_table(params, shardings):
    rows = [f'{"parameter":52s} {"shape":>20s}  sharding']
    for (path, x), (_, s) in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves_with_path(shardings)):
        rows.append(f'{jax.tree_util.keystr(path):52s} {str(x.shape):>20s}  {s.spec}')
    return '\n'.join(rows)


@dataclasses.dataclass(frozen=True)
class Feed:
    """How host batches become global arrays: the microbatches per step (A), the rows of one microbatch across
    every process (B), and the shardings of train batches [A, B, L] (the microbatch axis whole) and of eval
    batches [B, L]."""
    accum: int
    rows: int
    length: int
    step_sharding: NamedSharding
    eval_sharding: NamedSharding


def make_feed(cfg, mesh, rows):
    spec = mesh_spec(('batch', 'length'), (rows, cfg.max_target_length), cfg, mesh)
    return Feed(cfg.grad_accum, rows, cfg.max_target_length, NamedSharding(mesh, PartitionSpec(None, *spec)),
                NamedSharding(mesh, spec))


def global_batch(local, sharding, rows):
    """Host-local numpy [..., rows_here, L] -> global jax arrays [..., rows, L]: each process passes only
    its own share, so this is correct on multi-host pods."""
    return {k: jax.make_array_from_process_local_data(sharding, v, v.shape[:-2] + (rows, v.shape[-1]))
            for k, v in local.items()}


def to_host(tree):
    """Every process gets the whole of each array (gathered across processes), as numpy."""
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


# ==================================================================================================
# State: the optimizer, and the train state created directly in its sharding.
# ==================================================================================================
def make_optimizer(cfg):
    """AdamW on a warmup + cosine schedule. Gradient clipping is not chained in here: the step does it,
    where a reader can see it."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps - 1, cfg.warmup_steps + 1),  # the last update (count steps - 1) at the end value
        end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # no decay on norm scales
    tx = optax.adamw(schedule, cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, weight_decay=cfg.weight_decay,
                     mask=decay_mask)
    return tx, schedule


class Layout(NamedTuple):
    init: Callable        # (rng, params or None) -> the train state
    shardings: dict       # the state's NamedShardings
    abstract: dict        # its shapes, dtypes and shardings, nothing allocated


def state_layout(cfg, task, mesh, tx, rows):
    """The train state's shapes and placement: step, params, the optimizer state and the task's own (the
    TRM's EMA and carry). Parameters take the model's logical axes, the optimizer's moments their
    parameter's, the task's state the axes it declares; the rest replicates."""
    def init(rng, params=None):  # params: start from these (loaded) instead of a fresh init
        params = model_lib.init(cfg, rng)[1] if params is None else params
        return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params),
                **task.state(cfg, params, rows)}

    shapes = jax.eval_shape(init, jax.random.key(cfg.seed))
    params = model_lib.abstract(cfg)[1]
    is_spec = lambda x: isinstance(x, PartitionSpec)
    logical = {'step': PartitionSpec(), 'params': params, **task.state_axes(params),
               'opt_state': optax.tree_map_params(tx, lambda _, spec: spec, shapes['opt_state'], params,
                                                  transform_non_params=lambda _: PartitionSpec(), is_leaf=is_spec)}
    shardings = shardings_for(logical, shapes, cfg, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return Layout(init, shardings, abstract)


def init_state(cfg, layout, params=None):
    """Build the train state directly in its sharding (no full copy ever sits on one device), from a fresh
    init or from given parameters. Called inside the run's mesh and axis rules."""
    init = jax.jit(layout.init, out_shardings=layout.shardings)
    return init(jax.random.key(cfg.seed)) if params is None else init(jax.random.key(cfg.seed), params)


# ==================================================================================================
# The step: scan over the microbatches summing token-weighted gradients, divide once, clip, AdamW.
# ==================================================================================================
def make_train_step(cfg, task, graph, tx):
    """The jitted step: (state, batch [A, B, L]) -> (new state, metrics). The task's loss returns a loss
    summed over the microbatch and the weight it stands for, so summing then dividing once makes
    grad_accum=4 x batch 2 equal grad_accum=1 x batch 8."""
    def train_step(state, batch_ABL):
        params = state['params']
        grad_fn = jax.value_and_grad(lambda p, mb, c, k: task.loss(cfg, graph, p, mb, c, k, state['step']),
                                     has_aux=True)

        def micro(acc, xs):  # one microbatch: add its gradient (float32) and loss to the running sums
            grads, loss = acc
            mb, carry, key = xs
            (l, (sums, carry)), g = grad_fn(params, mb, carry, key)
            return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), loss + l), (sums, carry)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        # Random draws (TRM's halting exploration) are a function of (seed, step): resume stays exact.
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state['step']), cfg.grad_accum)
        (grads, loss), (sums_A, carry) = jax.lax.scan(micro, (zeros, 0.0), (batch_ABL, state.get('carry'), keys))
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), sums_A)
        denom = jnp.maximum(sums['weight'], 1.0)  # all real tokens (LM) / examples (TRM) of the step
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        # Clip by the global norm: scale every gradient by grad_clip / norm when the norm is above it.
        grad_norm = optax.tree.norm(grads)
        if cfg.grad_clip > 0:
            over = grad_norm >= cfg.grad_clip
            grads = jax.tree.map(lambda g: jnp.where(over, g / grad_norm.astype(g.dtype) * cfg.grad_clip, g), grads)
        updates, opt_state = tx.update(grads, state['opt_state'], params)
        new_params = optax.apply_updates(params, updates)
        if cfg.skip_nonfinite_steps:  # a NaN/inf step leaves params and optimizer untouched
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            new_params, opt_state = keep(new_params, params), keep(opt_state, state['opt_state'])
        new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state,
                     **task.after_update(cfg, state, new_params, carry)}
        return new_state, {'loss': loss / denom, 'grad_norm': grad_norm, 'tokens': sums['tokens'],
                           **task.step_metrics(sums, denom)}
    return train_step


# ==================================================================================================
# Eval: the task's eval step on fixed batches, its metrics computed on the host.
# ==================================================================================================
def evaluator(cfg, task, eval_step, ds, feed):
    """evaluate(state, n_batches, save_to=None): the task's eval metrics of the state's eval weights on n fixed
    batches (the same every call, so curves compare; None: the whole eval set), and the seconds they took.
    save_to: a directory for the task's answers (process 0 only)."""
    def evaluate(state, n_batches, save_to=None):
        if n_batches == 0:
            return {}
        t0 = time.perf_counter()
        batches, outs = ds.eval_batches(feed.rows // jax.process_count(), n_batches), []
        for i, b in enumerate(batches):
            outs.append(to_host(eval_step(state[task.eval_weights], global_batch(b, feed.eval_sharding, feed.rows))))
            if len(batches) > 1 and time.perf_counter() - t0 > 10:  # a search can take minutes: say where it is
                log(f'eval: {i + 1}/{len(batches)} batches ({time.perf_counter() - t0:.0f}s)')
        result = task.eval_result(cfg, outs, [to_host(b) for b in batches], ds,
                                  save_to if jax.process_index() == 0 else None)
        return {**result, 'seconds': time.perf_counter() - t0}
    return evaluate


# ==================================================================================================
# Storage: every path, input or output, goes through etils' epath (what orbax uses itself), so each may be
# local or gs://bucket/... (gcsfs underneath, without TensorFlow). GCS has no append and no file locks:
# append() composes objects, and a run owns a gs:// directory through a lease object (BucketLease).
# ==================================================================================================
STORAGE_ERRORS = (OSError,)  # what a disk can raise; a bucket adds gcsfs's HTTP and credential errors (use_gcs)


def remote(path):
    return '://' in str(path)


def stored(path):
    """epath.Path of a local path (absolute: orbax writes it into its metadata) or a gs:// one (as given)."""
    if remote(path):
        use_gcs()
    return epath.Path(path if remote(path) else os.path.abspath(os.path.expanduser(path)))


def use_gcs():
    """gcsfs, loaded by the first gs:// path (its import costs a local run half a second); from then on its HTTP
    and credential errors count as storage errors."""
    global STORAGE_ERRORS
    from gcsfs.retry import HttpError
    from google.auth.exceptions import GoogleAuthError
    STORAGE_ERRORS = (OSError, HttpError, GoogleAuthError)


def gcs():
    """The gcsfs file system epath itself uses (fsspec keeps one instance, so both see one listings cache)."""
    import fsspec
    use_gcs()
    return fsspec.filesystem('gs')


def storage_reason(e):
    """An error from a disk or a bucket as a short reason, with any URL's query string (tokens, signatures) cut."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
    text = re.sub(r'(https?://[^\s?]+)\?\S*', r'\1', text)
    return re.sub(r'(?i)(token|signature|key)=[^\s&]+', r'\1=...', text)


HELD = {}  # run directory -> whether it is still the one this run opened (filled by run_directory)


def check_held(path):
    """A run holds the directory it opened, not its path: one moved away, or replaced by another (a disk's by
    its inode, a bucket's by the run's lease on it), stops the run before it writes into what is there now."""
    path = path if remote(path) else os.path.abspath(path)  # orbax names its directory absolutely
    for run_dir, still_ours in HELD.items():
        if (path == run_dir or path.startswith(run_dir.rstrip('/') + '/')) and not still_ours():
            raise WriteError(f'{run_dir} was moved or replaced under this run: stopped without writing into what is '
                             'there now (what the run wrote went with its directory)')


def write(path, data):
    """Process 0 writes `data` (text or bytes) as the whole of `path`; a refusal stops the run in one line."""
    check_held(path)
    if jax.process_index() == 0:
        try:
            stored(path).write_bytes(data if isinstance(data, bytes) else data.encode())
        except STORAGE_ERRORS as e:
            raise WriteError(f'{path}: cannot write it ({storage_reason(e)})') from None


def append(path, text):
    """Adds text to the end of `path`. A bucket has no append, and rewriting the object each time would upload
    O(N^2) bytes over a run: the new text goes up as its own object, then GCS composes the two server-side."""
    check_held(path)
    try:
        if not remote(path):
            with open(path, 'a') as f:
                f.write(text)
            return
        part = f'{path}.part'
        gcs().pipe_file(part, text.encode())
        gcs().merge(path, [path, part])
        gcs().rm_file(part)
    except STORAGE_ERRORS as e:
        raise WriteError(f'{path}: cannot write ({storage_reason(e)}); the checkpoints written are intact') from None


def set_aside(path, tag):
    """Renames path to path.TAG-TIME (never deletes it); returns the new name."""
    new = f'{path}.{tag}-{time.strftime("%Y%m%d-%H%M%S")}'
    stored(path).rename(stored(new))
    return new


def check_credentials(cfg):
    """gs:// paths need Google credentials: ask for them once, up front, instead of a 401 from a background write
    (gcsfs would fall back to anonymous access silently). An emulator (STORAGE_EMULATOR_HOST) needs none."""
    used = [key for key in PATH_KEYS if remote(getattr(cfg, key))]
    if not used or os.environ.get('STORAGE_EMULATOR_HOST'):
        return
    import google.auth
    use_gcs()
    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise WriteError(f'{used[0]}={getattr(cfg, used[0])}: no Google credentials found ({storage_reason(e)}); on '
                         'a Cloud TPU VM the VM\'s service account is used, elsewhere run `gcloud auth '
                         'application-default login` or set GOOGLE_APPLICATION_CREDENTIALS') from None


PATH_KEYS = ('output_dir', 'load_params', 'load_hf', 'export_dir', 'dataset_path', 'eval_path', 'tokenizer_path',
             'hf_data_files', 'compile_cache_dir')


class BucketLease:
    """One owner per gs:// run directory. GCS has no file locks, but it creates an object only if absent
    (ifGenerationMatch=0): RUN_DIR/.lock is made that way and names its holder and a lease expiry, which the live
    run renews every LEASE_SECONDS / 3 (rewriting it conditional on the generation it last wrote). A killed run
    stops renewing: once its lease has run out, or at once on the same host when its process is gone, the next
    run takes the lock over, again conditional on the generation it read, so two newcomers cannot both win."""
    LEASE_SECONDS = 60

    def __init__(self, path):
        self.path, self.host, self.lost = path, socket.gethostname(), None
        self.holder = f'process {os.getpid()} on {self.host} since {time.strftime("%Y-%m-%d %H:%M:%S")}'
        self.stop = threading.Event()

    def acquire(self):
        """'' once held, else who holds it."""
        try:
            self.generation = self.put(0)
        except FileExistsError:
            old, generation = json.loads(gcs().cat_file(self.path)), gcs().info(self.path)['generation']
            if old['until'] > time.time() and not (old['host'] == self.host and not pid_alive(old['pid'])):
                return old['holder']
            self.generation = self.put(generation)  # a stale lease: FileExistsError if another run just took it
            log(f'took over the lock of {old["holder"]} (its lease ran out or its process is gone)')
        threading.Thread(target=self.renew, daemon=True).start()
        return ''

    def put(self, if_generation):
        """Writes the lease object only if its generation is still `if_generation` (0: absent); the new one."""
        body = json.dumps({'holder': self.holder, 'pid': os.getpid(), 'host': self.host,
                           'until': time.time() + self.LEASE_SECONDS}).encode()
        bucket, key = self.path.removeprefix('gs://').split('/', 1)
        multipart = (b'--==0==\nContent-Type: application/json\n\n' + json.dumps({'name': key}).encode() +
                     b'\n--==0==\nContent-Type: application/json\n\n' + body + b'\n--==0==--')
        out = gcs().call('POST', f'{gcs()._location}/upload/storage/v1/b/{bucket}/o', uploadType='multipart',
                         ifGenerationMatch=str(if_generation), data=multipart, json_out=True,
                         headers={'Content-Type': 'multipart/related; boundary="==0=="'})
        return out['generation']

    def renew(self):
        while not self.stop.wait(self.LEASE_SECONDS / 3):
            try:
                self.generation = self.put(self.generation)
            except Exception as e:  # taken over (FileExistsError) or the bucket unreachable
                self.lost = storage_reason(e)
                log(f'WARNING: {self.path}: could not renew this run\'s lease on its directory ({self.lost})')
                return

    def close(self):
        """Ends the lease: deleted, waiting a few seconds at most (a bucket gone away would keep gcsfs retrying for
        half a minute; the lease then just runs out)."""
        self.stop.set()
        if not self.lost:
            done = threading.Thread(target=self.release, daemon=True)
            done.start()
            done.join(5)

    def release(self):
        with contextlib.suppress(*STORAGE_ERRORS):  # a bucket gone away: the lease runs out by itself
            gcs().rm_file(self.path)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


# ==================================================================================================
# Checkpoints (orbax): async, sharded, atomic. A step directory appears only once complete, so a crash
# or kill -9 mid-write leaves nothing that resume would pick up.
# ==================================================================================================
class Preempted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""


DATA_STATE_BYTES = 1024  # room for one row's data-iterator state as JSON (a lane's, or a piece of a stream host's)


@contextlib.contextmanager
def checkpoints(directory, cfg, read_only=False):
    """The orbax CheckpointManager of a checkpoints/ directory, open for the block. Leaving the block, by
    any path, lets a save still in flight land first, then closes the manager."""
    # The step directory is made before save() returns, so a directory that refuses it fails there and
    # then, not in a background thread that the end of the run would wait on.
    opts = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints or None, create=not read_only,
                                        cleanup_tmp_directories=not read_only, read_only=read_only,
                                        enable_async_checkpointing=True,
                                        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    mngr = ocp.CheckpointManager(stored(directory), options=opts,
                                 item_handlers={'train_state': ocp.PyTreeCheckpointHandler(),
                                                'data_state': ocp.StandardCheckpointHandler()})
    try:
        yield mngr
    finally:
        try:
            wait_for_saves(mngr)
        finally:
            mngr.close()


def wait_for_saves(mngr):
    """Until the save in flight has committed; one that failed in the background (the disk filled up, the mount or
    bucket went away) is a WriteError."""
    try:
        mngr.wait_until_finished()
    except Exception as e:
        raise WriteError(f'{mngr.directory}: the last checkpoint could not be written ({first_line(e)}); the ones '
                         'written before stay as they are') from None


class WriteError(Exception):
    """The run directory refused a write (read-only, full, gone): the run stops with one line; what was
    written before stays."""


first_line = data.first_line


def data_state_array(lane_states):
    """Every lane's iterator state (one per row of the global batch) as a uint8 array with a JSON row each. The
    processes gather their lanes in process order (process p reads rows p * local_rows onward), so each holds the
    whole array, process 0's copy is the one written, and a run on any process count reads every lane back."""
    raw = [json.dumps(s).encode() for s in lane_states]
    assert max(map(len, raw)) <= DATA_STATE_BYTES, 'data iterator state too large to checkpoint'
    local = np.stack([np.frombuffer(r.ljust(DATA_STATE_BYTES), np.uint8) for r in raw])
    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def save_checkpoint(mngr, step, state, it):
    """Step `step`'s train state and data position (with the identity of the data it counts in), saved
    asynchronously: training goes on while it is written."""
    data_state = {'lanes': data_state_array(it.state()), 'source': np.frombuffer(it.source.encode(), np.uint8)}
    check_held(str(mngr.directory))
    try:
        mngr.check_for_errors()  # the save before this one, finished in the background
        mngr.save(step, args=ocp.args.Composite(train_state=ocp.args.PyTreeSave(state),
                                                data_state=ocp.args.StandardSave(data_state)))
    except Exception as e:
        raise WriteError(f'{mngr.directory}: a checkpoint could not be written ({first_line(e)}); the ones '
                         'written before stay as they are') from None


def _flat_shapes(tree):
    """{('params', 'embed'): shape}: paths as plain strings, since orbax's metadata tree turns optax's
    named tuples into dicts and lists."""
    name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
    return {tuple(map(name, path)): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


class Damaged(Exception):
    """A checkpoint step that cannot be read back: truncated, garbled or missing files, bad metadata."""


class Mismatch(Exception):
    """A readable checkpoint whose state has other parameters or shapes than this config makes: not damage."""


def _check_shapes(mngr, step, abstract, part):
    """A checkpoint written by a different model config fails here with a message, not deep in orbax;
    metadata that cannot be read (or holds no parameters) is damage, not a config mistake."""
    try:
        saved = mngr.item_metadata(step)['train_state']
        saved = _flat_shapes(saved[part] if part else saved)
    except Exception as e:  # orbax raises ValueError, KeyError, tensorstore errors ... for unreadable metadata
        raise Damaged(f'its metadata is unreadable: {first_line(e)}')
    if not any(path[0] == 'params' for path in saved) and not part:
        raise Damaged('its metadata lists no parameters')
    want = _flat_shapes(abstract)
    for path in sorted(set(want) | set(saved), key=lambda p: (p[0] != 'params', p)):
        if saved.get(path) != want.get(path):
            show = lambda shape: 'none' if shape is None else shape
            raise Mismatch(f'{"/".join(path)} is {show(saved.get(path))} there but {show(want.get(path))} here')


def _read_step(mngr, step, abstract, part):
    """(state or its `part`, every lane's data state) of one step; Damaged if it cannot be read."""
    target = abstract[part] if part else abstract
    _check_shapes(mngr, step, target, part)
    restore = lambda item, **kw: ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), **kw)
    try:
        if part:  # another run's optimizer may differ: read the params subtree alone
            got = mngr.restore(step, args=ocp.args.Composite(train_state=restore({part: target}, partial_restore=True)))
            return got['train_state'][part], None
        got = mngr.restore(step, args=ocp.args.Composite(train_state=restore(abstract),
                                                         data_state=ocp.args.StandardRestore()))
        data_state = got['data_state']
        if 'lanes' not in data_state or 'source' not in data_state:  # not a position this trainer wrote
            return got['train_state'], {'lanes': [], 'source': 'a data state without per-row positions'}
        return got['train_state'], {'lanes': [json.loads(row.tobytes().decode().strip()) for row in data_state['lanes']],
                                    'source': data_state['source'].tobytes().decode()}
    except Exception as e:  # orbax/tensorstore raise bare Exception for unreadable data
        raise Damaged(first_line(e)) from None


def restore_checkpoint(mngr, abstract, cfg, steps=None, part=None, move_aside=False):
    """Newest readable checkpoint -> (step, state or its `part` ('params', 'ema'), every lane's data
    state), or None. A damaged step is reported in one line and skipped for the one before it; with
    move_aside (the run's own checkpoints) it is renamed STEP.damaged-TIME once a readable one is found,
    never deleted, so the next save of that step has room and nothing is lost. A checkpoint of another
    config is not damage: it stops the run with what differs."""
    damaged = []
    for step in sorted(steps or mngr.all_steps(), reverse=True):
        try:
            state, data_state = _read_step(mngr, step, abstract, part)
        except Mismatch as e:
            changed = config_changes(os.path.dirname(mngr.directory), cfg)
            raise ConfigError(f'checkpoint {mngr.directory}/{step} was written by another config: {e}'
                              + (f'; changed since: {", ".join(changed[:6])}' if changed else '')
                              + '; use the keys of the run that wrote it, or a new run_name / resume=false') from None
        except Damaged as e:
            damaged.append(step)
            log(f'WARNING: checkpoint {mngr.directory}/{step} is damaged ({e}); trying the one before it')
            continue
        if move_aside and damaged:
            if jax.process_index() == 0:
                moved = [set_aside(os.path.join(mngr.directory, str(bad)), 'damaged') for bad in damaged]
                log(f'moved the damaged step(s) aside: {", ".join(moved)}')
            multihost_utils.sync_global_devices('damaged checkpoints moved aside')
            mngr.reload()
        return step, state, data_state
    return None


def config_changes(run_dir, cfg):
    """'key (old -> new)' for each key whose value differs from the config.yml the run in run_dir wrote."""
    flat = lambda d, p='': dict(kv for k, v in d.items() for kv in (flat(v, f'{p}{k}.').items() if isinstance(v, dict)
                                                                    else [(f'{p}{k}', v)]))
    try:
        old = flat(yaml.safe_load(stored(os.path.join(run_dir, 'config.yml')).read_text()))
    except (*STORAGE_ERRORS, yaml.YAMLError, AttributeError):  # none, or not the mapping a run writes
        return []
    new = flat(cfg.model_dump(mode='json'))
    return [f'{k} ({old[k]} -> {new[k]})' for k in new if k in old and old[k] != new[k]]


def checkpoint_steps(path):
    """load_params=PATH (a run directory, its checkpoints/ directory, or one step directory in it) ->
    (the checkpoints directory, the steps found there)."""
    path = path.rstrip('/')
    if stored(os.path.join(path, 'checkpoints')).is_dir():
        path = os.path.join(path, 'checkpoints')
    if os.path.basename(path).isdigit() and stored(path).is_dir():
        return os.path.dirname(path), [int(os.path.basename(path))]
    found = stored(path).iterdir() if stored(path).is_dir() else []
    return path, sorted(int(d.name) for d in found if d.name.isdigit())


def load_params(path, abstract, cfg, part='params'):
    """load_params=PATH (a run directory, its checkpoints/ directory, or one step directory in it) ->
    (step, the state entry `part` of its newest readable checkpoint)."""
    path, steps = checkpoint_steps(path)
    with checkpoints(path, cfg, read_only=True) as mngr:
        found = restore_checkpoint(mngr, abstract, cfg, steps, part=part)
    if not found:
        raise ConfigError(f'load_params={path}: no readable checkpoint there (see the warnings); give a run '
                          'directory or its checkpoints/STEP directory')
    log(f'loaded {part} from {path}/{found[0]}')
    return found[:2]


def restore_or_init(cfg, task, mngr, layout):
    """The train state: the newest readable checkpoint of this run (resume), else a fresh state, from
    load_params / load_hf weights if given. Returns (state, every lane's data state or None, whether the
    state holds trained parameters)."""
    if cfg.resume and mngr.all_steps():
        restored = restore_checkpoint(mngr, layout.abstract, cfg, move_aside=True)
        if not restored:
            raise ConfigError(f'no readable checkpoint in {mngr.directory} (steps {", ".join(map(str, mngr.all_steps()))} '
                              'are damaged, see the warnings): move them away to start over, or set resume=false')
        log(f'resuming from checkpoint {mngr.directory}/{restored[0]}')
        return restored[1], restored[2], True
    if cfg.load_params:  # training starts from another run's params; eval and generate read what the task evaluates
        part = 'params' if cfg.mode == 'train' else task.eval_weights
        step, params = load_params(cfg.load_params, layout.abstract, cfg, part)
        state = init_state(cfg, layout, params)
        if cfg.mode != 'train':  # reported with the eval: which training step this is
            state['step'] = jnp.int32(step)
        return state, None, True
    if cfg.load_hf:
        return init_state(cfg, layout, load_hf(cfg.load_hf, layout.abstract['params'], cfg)), None, True
    return init_state(cfg, layout), None, False


# ==================================================================================================
# Metrics: FLOPs against the device peak, one row per log_every steps to stdout, JSONL and TensorBoard.
# ==================================================================================================
PEAK_BF16_FLOPS = {  # per JAX device (a v2/v3 device is one core = half a chip)
    'TPU v2': 22.5e12, 'TPU v3': 61.5e12, 'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12,
    'TPU v5p': 459e12, 'TPU v5': 459e12, 'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'TPU7x': 1153.5e12,  # a die
    'A100': 312e12, 'H100': 989e12, 'H200': 989e12, 'H800': 989e12, 'B200': 2250e12,
}


@functools.lru_cache  # once per process: the machine's peak does not change between runs in it
def device_peak_flops(dtype, device):
    """bf16 peak from the table; on CPU measured now, in the compute dtype on all cores: the best of two
    matmul shapes, each warmed and then timed eight times (0.1 s; larger squares ran no faster on 2 cores). A busy
    machine still reads low, which `rates` corrects when the step itself runs faster."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops, f'{device.device_kind} spec sheet'
    dt, f, best = jnp.dtype(dtype), jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32)), 0.0
    for n in (512, 1024):
        a = jax.device_put(jnp.ones((n, n), dt), device)
        f(a).block_until_ready()
        for _ in range(8):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best, f'best {dt.name} matmul of 512^2 and 1024^2 on {device.device_kind}'


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


def short_line(m, steps, shown):
    """The line a person reads: progress, loss, speed, time left, and the eval when there is one. The whole
    row (grad norm, learning rate, memory, data wait, ...) is in metrics.jsonl and TensorBoard; `shown`: the
    task's (metric, format) pairs."""
    parts = [f'step {m["step"]}/{steps}', f'loss {m["loss"]:.4f}']
    if 'tokens_per_sec' in m:
        eta = int(m['step_seconds'] * (steps - m['step']))
        parts += [f'{m["tokens_per_sec"]:,.0f} tokens/s', f'MFU {m["mfu"]:.1%}',
                  f'ETA {eta // 3600}h{eta // 60 % 60:02d}m' if eta >= 3600 else f'ETA {eta // 60}m{eta % 60:02d}s']
    return '  '.join(parts + [fmt.format(m[k]) for k, fmt in shown if k in m])


class MetricsWriter:
    """One row of metrics to stdout, and on process 0 to metrics.jsonl, TensorBoard event files (tensorboardX
    writes them without TensorFlow: tensorboard --logdir RUN_DIR) and Weights & Biases (wandb_project).
    Rows reach the run directory at flush(): after every row on a local disk, before each checkpoint on a bucket
    (each flush uploads only its new rows: metrics.jsonl grows by compose, TensorBoard gets one event file per
    flush, named by its steps). A resumed run first drops the rows past its checkpoint, so every step appears
    once; W&B's history cannot drop rows, so it gets a row once a checkpoint holds its step."""

    def __init__(self, cfg, run_dir, start_step, shown=()):
        self.main, self.run_dir, self.path = jax.process_index() == 0, run_dir, os.path.join(run_dir, 'metrics.jsonl')
        self.shown = shown
        self.wandb, self.unsent, self.rows = open_wandb(cfg, run_dir) if self.main and cfg.wandb_project else None, [], []
        self.tb = None
        if self.main:
            write(self.path, ''.join(kept_rows(self.path, start_step)) if start_step else '')
            self.tb_dir = tempfile.mkdtemp(prefix='tensorboard-') if remote(run_dir) else run_dir
            for f in stored(run_dir).glob('events.out.tfevents.steps-*') if remote(run_dir) else ():
                if int(f.name.split('-')[1]) > start_step:  # written past the checkpoint resumed from
                    f.unlink()
            self.tb = SummaryWriter(self.tb_dir)

    def write(self, m, steps):
        log(short_line(m, steps, self.shown))
        if self.main:
            for k, v in m.items():
                if k != 'step' and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, m['step'])
            self.rows.append(m)
            self.unsent.append(m)
            if not remote(self.run_dir):
                self.flush()

    def flush(self):
        """The rows since the last flush into the run directory."""
        rows, self.rows = self.rows, []  # taken first: rows a failed write could not land are not tried again
        if not (self.main and rows):
            return
        append(self.path, ''.join(json.dumps(m) + '\n' for m in rows))
        if remote(self.run_dir):  # a closed event file goes up once, whole; the next rows start a new one
            self.tb.close()
            name = f'events.out.tfevents.steps-{rows[0]["step"]:010d}-{rows[-1]["step"]:010d}'
            for f in glob.glob(os.path.join(self.tb_dir, 'events.out.tfevents.*')):
                with open(f, 'rb') as local:
                    write(os.path.join(self.run_dir, name), local.read())
                os.remove(f)
            self.tb = SummaryWriter(self.tb_dir)
        else:
            self.tb.flush()

    def checkpointed(self, step):
        """A checkpoint holds `step`: the rows up to it go to W&B (a resume starts after them)."""
        for m in self.unsent if self.wandb else ():
            self.wandb.log({k: v for k, v in m.items() if k != 'step'}, step=m['step'])
        self.unsent = []

    def close(self):
        if self.main:
            self.flush()
            self.tb.close()
            if self.tb_dir != self.run_dir:  # a bucket run's local staging for event files
                shutil.rmtree(self.tb_dir, ignore_errors=True)
            if self.wandb:
                self.wandb.finish()


def kept_rows(path, step):
    """The rows of a metrics.jsonl up to `step`; a last row written only in part (a kill mid-write) is dropped."""
    try:
        lines = stored(path).read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    if lines and not lines[-1].endswith('\n'):
        log(f'WARNING: {path}: dropped its last line, written only in part: {lines.pop()[:60]!r}')
    return [r for r in lines if json.loads(r)['step'] <= step]


def open_wandb(cfg, run_dir):
    """The run's W&B run, the same one across resumes (its id is kept in RUN_DIR/wandb_id), with the resolved
    config. WANDB_MODE=offline writes it under RUN_DIR/wandb for `wandb sync` later (a bucket's run: under the
    system's temporary directory, since wandb writes only to a local disk)."""
    import wandb
    path = os.path.join(run_dir, 'wandb_id')
    try:
        run_id = stored(path).read_text().strip() if stored(path).exists() else os.urandom(6).hex()
    except UnicodeDecodeError:
        run_id = ''
    if not re.fullmatch(r'[a-z0-9]{1,64}', run_id):
        raise ConfigError(f'{path}: not a W&B run id (a run writes 12 hex digits there); restore it to keep logging '
                          'to the same W&B run, or delete it to start a new one')
    write(path, run_id + '\n')
    local = os.path.join(tempfile.gettempdir(), 'wandb', cfg.run_name) if remote(run_dir) else run_dir
    os.makedirs(local, exist_ok=True)
    # wandb's core keeps its logs in its cache directory (~/.cache/wandb) and, where it cannot make that (a home
    # that is not writable), prints them on stderr instead, line after line: then the cache goes beside the run.
    cache = os.environ.get('WANDB_CACHE_DIR') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'wandb')
    with contextlib.suppress(OSError):
        os.makedirs(cache, exist_ok=True)
    if not os.access(cache, os.W_OK):
        os.environ['WANDB_CACHE_DIR'] = os.path.join(local, 'wandb-cache')
    try:
        return wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, id=run_id, resume='allow',
                          name=cfg.run_name, dir=local, config=cfg.model_dump(mode='json'),
                          settings=wandb.Settings(silent=True, console='off'))
    except Exception as e:  # not logged in, no network, a project the entity cannot write to
        raise ConfigError(f'wandb_project={cfg.wandb_project}: W&B refused the run ({first_line(e)}): log in with '
                          '`wandb login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline, or set '
                          'wandb_project=') from None


def step_flops(cfg, task, devices):
    """FLOPs per token and the peak they are measured against. On CPU the simulated devices share one
    processor, so the peak measured there is the whole machine's."""
    peak, source = device_peak_flops(cfg.dtype, devices[0])
    log(f'peak: {peak / 1e12:.3f} TFLOP/s per device ({source})')
    n = len(devices)
    return {'per_token': task.flops_per_token(cfg), 'devices': n, 'peak_per_device': peak, 'peak_source': source,
            'peak': peak if devices[0].platform == 'cpu' else peak * n}


# ==================================================================================================
# The loop: dispatch a step, read the one before it, log, evaluate, checkpoint, until cfg.steps.
# ==================================================================================================
def rates(flops, tps):
    """Throughput at `tps` tokens/s: per device, in TFLOP/s per device, and as MFU. A measured CPU peak that the
    step outruns was timed on a busy CPU: it is raised to the step's own rate, so MFU never passes 100%."""
    if tps * flops['per_token'] > flops['peak'] and 'spec sheet' not in flops['peak_source']:
        if not flops['peak_source'].startswith('this run'):
            log('peak: raised to this run\'s fastest step (the CPU was busy when its matmul was timed)')
        flops['peak'] = flops['peak_per_device'] = tps * flops['per_token']
        flops['peak_source'] = 'this run\'s fastest step'
    n = flops['devices']
    return {'tokens_per_sec': tps, 'tokens_per_sec_per_device': tps / n,
            'tflops_per_device': tps * flops['per_token'] / n / 1e12, 'mfu': tps * flops['per_token'] / flops['peak']}


class Window:
    """The steps since the last metrics row: their losses, the task's metrics, tokens and time, and how long
    the data kept the loop waiting (`waited`: the iterator's running total)."""

    def __init__(self, waited):
        self.waited, self.losses, self.extras, self.tokens, self.timed = waited, [], [], 0.0, 0
        self.restart_clock()

    def restart_clock(self):
        self.t0, self.wait0 = time.perf_counter(), self.waited()

    def add(self, out, timed):
        self.losses.append(float(out['loss']))
        self.extras.append({k: float(v) for k, v in out.items()  # the task's metrics; NaN = not measured
                            if k not in ('loss', 'grad_norm', 'tokens') and np.isfinite(v)})
        self.tokens += float(out['tokens']) if timed else 0.0
        self.timed += timed

    def row(self, step, out, learning_rate, flops):
        """The window's metrics row; `out`: the newest step's outputs."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        m = {'step': step, 'loss': float(np.mean(self.losses)) if self.losses else float('nan'),
             'learning_rate': learning_rate, 'grad_norm': float(out['grad_norm'])}
        if self.tokens:  # a window holding only the compiling first step has no rate to report
            m.update(rates(flops, self.tokens / dt), step_seconds=dt / max(self.timed, 1))
        m.update(tokens_per_step=float(out['tokens']), data_wait_fraction=(self.waited() - self.wait0) / dt,
                 host_rss_gb=host_rss_gb())
        m.update({k: float(np.mean([e[k] for e in self.extras if k in e]))
                  for k in dict.fromkeys(k for e in self.extras for k in e)})
        if (mem := device_peak_memory_gb(jax.local_devices()[0])) is not None:
            m['device_peak_memory_gb'] = mem
        return m


class InFlight:
    """Dispatched steps' outputs, read back oldest first: one step in flight lets the host dispatch step n+1
    while step n runs, and every log line, eval and checkpoint reads them all first (drain), so none of them
    sees a step whose loss was not checked. Keeps each timed step's seconds for the benchmark."""

    def __init__(self, skip_nonfinite):
        self.skip_nonfinite, self.skipped, self.pending, self.step_times = skip_nonfinite, 0, [], []
        self.t_done = self.first_step_seconds = self.last = None

    def drain(self, window, saved, keep=0):
        """Read finished steps into `window` until `keep` remain in flight; returns the newest outputs read.
        `saved`: the last checkpointed step, named if a non-finite loss stops the run."""
        while len(self.pending) > keep:
            step, t0, out = self.pending.pop(0)
            out = self.last = jax.device_get(out)
            now, timed = time.perf_counter(), self.first_step_seconds is not None
            if timed:
                self.step_times.append(now - max(self.t_done, t0))  # from the last step's end or this dispatch
            else:  # the first step warms up (the program was compiled before): not timed
                self.first_step_seconds = now - t0
                log(f'first step: {now - t0:.1f}s')
                window.restart_clock()
            self.t_done = now
            if np.isfinite(out['loss']) and np.isfinite(out['grad_norm']):
                window.add(out, timed)
            else:
                self.skip(step, out, saved)
        return self.last

    def skip(self, step, out, saved):
        self.skipped += 1
        if self.skipped > self.skip_nonfinite:
            raise FloatingPointError(
                f'loss is {out["loss"]} at step {step}; stopping (checkpoints up to step {saved} are intact; '
                'lower learning_rate, raise warmup_steps, or set skip_nonfinite_steps)')
        log(f'WARNING: non-finite loss at step {step}: update skipped ({self.skipped} of '
            f'skip_nonfinite_steps={self.skip_nonfinite})')


def benchmark(flight, flops, tokens_per_step, note):
    """Medians over every timed step (the first, compiling, excluded), for the summary and one line."""
    if not flight.step_times:
        return {}
    med = float(np.median(flight.step_times))
    r = rates(flops, tokens_per_step / med)
    log(f'benchmark: {len(flight.step_times)} timed steps, median {med:.3f} s/step = {r["tokens_per_sec"]:,.0f} '
        f'tokens/s, {r["tflops_per_device"]:.3f} TFLOP/s per device, MFU {r["mfu"]:.1%} of '
        f'{flops["peak_per_device"] / 1e12:.3f} TFLOP/s ({flops["peak_source"]}); {note}')
    return {'median_step_seconds': med, 'median_tokens_per_sec': r['tokens_per_sec'], 'median_mfu': r['mfu']}


class Signals(list):
    """The SIGTERM / SIGINT names a run has noted. Until `saving` is set (the loop is about to take its first
    step) there is nothing new to save, and a signal stops the run at once, where it is."""
    saving = False


@contextlib.contextmanager
def preemption_signals():
    """SIGTERM (preemption, schedulers) and SIGINT, from the start of the run to its last committed save. Before
    the loop a signal raises Preempted at once (nothing new to save); in the loop it is noted, not obeyed: the
    loop finishes the step, checkpoints and exits, and a repeated signal during that save is noted too. With
    several processes a signal reaching one host must stop them all at the same step: JAX's preemption sync
    point listens for SIGTERM, so SIGINT is passed on to it as one. Yields the Signals the loop acts on."""
    caught, several = Signals(), jax.process_count() > 1

    def note(signum, _):
        name = signal.Signals(signum).name
        if not caught.saving:
            raise Preempted(f'{name} before the first step: nothing new to save; rerun the same command to go on')
        caught.append(name)
    to_sync_point = lambda signum, _: os.kill(os.getpid(), signal.SIGTERM)
    wanted = {signal.SIGINT: to_sync_point} if several else {signal.SIGTERM: note, signal.SIGINT: note}
    handlers = ({sig: signal.signal(sig, handler) for sig, handler in wanted.items()}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        yield caught
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class Steps(NamedTuple):
    """The run's compiled functions and what goes with them."""
    train: Callable      # (state, batch [A, B, L]) -> (new state, metrics)
    evaluate: Callable   # (state, n batches or None = all, save_to=None) -> eval metrics
    feed: Feed           # how batches reach the devices
    schedule: Callable   # step -> learning rate (for the metrics row)
    flops: dict = None   # step_flops: FLOPs per token and the peak (mode=train)


class Place(NamedTuple):
    """Where a run lives, as run() opened it: its directory, its checkpoints, and the signals it answers."""
    run_dir: str
    mngr: ocp.CheckpointManager
    caught: Signals


def next_batch(cfg, feed, it, step):
    """The grad_accum microbatches of update `step` (0-based) as one global [A, B, L] batch."""
    mbs = [next(it) for _ in range(feed.accum)]
    return global_batch({k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]}, feed.step_sharding, feed.rows)


def train_loop(cfg, state, it, steps, place, writer):
    """Dispatch a step, read the one before it, log, evaluate, checkpoint, until cfg.steps. Returns the last
    metrics row and the steps' timings; a signal (noted in place.caught) ends it with a checkpoint and Preempted."""
    step = saved = int(state['step'])
    flight, window, last = InFlight(cfg.skip_nonfinite_steps), Window(lambda: it.wait_seconds), {}
    while step < cfg.steps:
        profile(cfg, step, place.run_dir, lambda: flight.drain(window, saved))
        t0 = time.perf_counter()
        state, out = steps.train(state, next_batch(cfg, steps.feed, it, step))
        step += 1
        flight.pending.append((step, t0, out))
        flight.drain(window, saved, keep=1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            last = window.row(step, flight.drain(window, saved), float(steps.schedule(step - 1)), steps.flops)
            if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                last.update({f'eval_{k}': v for k, v in steps.evaluate(state, cfg.eval_batches).items()})
            writer.write(last, cfg.steps)
            window = Window(window.waited)  # after the eval: its time counts in no window
        preempted = place.caught or (jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(step))
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or preempted:
            flight.drain(window, saved)  # a checkpoint holds only checked steps
            writer.flush()  # before the save: a resume drops rows past the checkpoint, never misses one
            save_checkpoint(place.mngr, step, state, it)  # async: training goes on while it writes
            saved = step
            writer.checkpointed(step)
        if preempted:
            raise Preempted(f'{place.caught[0] if place.caught else "preemption notice"}: saved checkpoint at step '
                            f'{step} in {place.mngr.directory}; rerun the same command to resume')
    profile(cfg, step, place.run_dir, lambda: flight.drain(window, saved))
    return last, flight


def profile(cfg, step, run_dir, drain):
    """profile_steps=a,b: a jax.profiler trace of steps a..b (1-based) into RUN_DIR/profile; called with the
    steps done so far, before each dispatch and after the last. `drain` reads back the steps in flight."""
    local = os.path.join(tempfile.gettempdir(), 'profile', cfg.run_name) if remote(run_dir) else run_dir
    if step + 1 == cfg.profile_steps[0]:
        drain()
        jax.profiler.start_trace(os.path.join(local, 'profile'))
    if step == cfg.profile_steps[1] and step:
        drain()
        jax.profiler.stop_trace()
        for f in glob.glob(os.path.join(local, 'profile', '**', '*'), recursive=True) if local != run_dir else ():
            if os.path.isfile(f):  # the profiler writes local files only: copied up to the bucket's run directory
                with open(f, 'rb') as trace:
                    write(os.path.join(run_dir, os.path.relpath(f, local)), trace.read())
        log(f'profile of steps {cfg.profile_steps[0]}-{step}: {run_dir}/profile')


def train(cfg, task, state, it, steps, place):
    """mode=train: from state['step'] to cfg.steps; returns the last metrics row with the benchmark's medians."""
    start, run_dir = int(state['step']), place.run_dir
    if start >= cfg.steps:
        log(f'{run_dir} is already at step {start} of steps={cfg.steps}: nothing to train (raise steps= to go on)')
        return {'step': start, 'run_dir': run_dir}
    writer = MetricsWriter(cfg, run_dir, start, task.shown)  # before the compile: a W&B login problem shows at once
    try:
        t_xla, m = compile_step(steps.train, state, steps.feed)
        line, compiled_gb = compiled_line(m) if m else ('', None)
        log(f'step compiled in {t_xla:.1f}s; {line}')
        place.caught.saving = True  # from here a signal is noted and answered with a checkpoint
        summary, flight = train_loop(cfg, state, it, steps, place, writer)
    finally:
        it.close()
        writer.close()
        wait_for_saves(place.mngr)  # still under the handlers: a repeated SIGTERM cannot cut the last save short
    summary.update(run_dir=run_dir, compile_seconds=t_xla + (flight.first_step_seconds or 0))
    mem = device_peak_memory_gb(jax.local_devices()[0])
    summary.update(benchmark(flight, steps.flops, summary.get('tokens_per_step', 0.0), (
        f'compile + first step {summary["compile_seconds"]:.1f}s; host RSS {host_rss_gb():.2f} GiB'
        + (f', device peak {mem:.2f} GiB' if mem is not None else '')
        + (f', compiled step {gb(compiled_gb)}' if compiled_gb else ''))))
    log('done: ' + json.dumps({k: summary.get(k) for k in ('step', 'loss', 'eval_loss', 'tokens_per_sec', 'mfu',
                                                           'compile_seconds', 'run_dir')}))
    log(f'checkpoints: {place.mngr.directory}; metrics: {run_dir}/metrics.jsonl (TensorBoard: tensorboard --logdir '
        f'{run_dir})')
    return summary


def compile_step(train_step, state, feed):
    """Compile the step for this state and an [A, B, L] batch ahead of its first call (which then reuses the
    program). Returns (seconds, the compiler's memory analysis: its per-device figures are the truth for every
    task, where a hand estimate would know only a language model's arithmetic)."""
    t0 = time.perf_counter()
    m = train_step.lower(state, abstract_batch(feed)).compile()
    return time.perf_counter() - t0, m.memory_analysis()


# ==================================================================================================
# Other modes: eval, generation, Hugging Face export / import (safetensors).
# ==================================================================================================
def eval_mode(cfg, task, steps, state, run_dir):
    """mode=eval: the loaded parameters on the eval set (eval_batches, or all of it where the task says so),
    printed as one JSON line and written to eval.json (and any answers the task writes beside it)."""
    n_batches = None if task.eval_all else cfg.eval_batches
    result = {'step': int(state['step']), **steps.evaluate(state, n_batches, save_to=run_dir)}
    write(os.path.join(run_dir, 'eval.json'), json.dumps(result))
    log(json.dumps(result))
    return result


def generate_mode(cfg, task, built, params, ds, run_dir):
    """mode=generate: the task's generation from prompt=, printed and written to RUN_DIR/generation.txt."""
    summary, shown, text = task.generate(cfg, built.graph, params, ds, built.mesh.size)
    log(shown)
    write(os.path.join(run_dir, 'generation.txt'), text)
    return {**summary, 'run_dir': run_dir}


def export_hf(cfg, params, ds, out_dir):
    """mode=export: config.json, model.safetensors (weight dtype), tokenizer.model (+ tokenizer_config.json)."""
    tensors, conf = model_lib.to_hf(cfg, multihost_utils.process_allgather(params, tiled=True))  # whole arrays
    bos, eos = (ds.bos_id, ds.eos_id) if ds.tokenizer else (None, None)
    try:
        if jax.process_index() == 0:
            stored(out_dir).mkdir(parents=True, exist_ok=True)
        # transformers wants the metadata format=pt.
        write(os.path.join(out_dir, 'model.safetensors'), safetensors.numpy.save(tensors, metadata={'format': 'pt'}))
        write(os.path.join(out_dir, 'config.json'), json.dumps({**conf, 'bos_token_id': bos, 'eos_token_id': eos},
                                                               indent=2))
        for name, content in (ds.tokenizer_files() if ds.tokenizer else {}).items():
            write(os.path.join(out_dir, name), content)
    except (WriteError, *STORAGE_ERRORS) as e:
        raise ConfigError(f'export_dir={out_dir}: cannot write there ({e if isinstance(e, WriteError) else storage_reason(e)});'
                          ' choose a writable directory') from None
    log(f'exported {len(tensors)} tensors ({cfg.weight_dtype}) as a Hugging Face Llama checkpoint to {out_dir}'
        + ('' if ds.tokenizer else ' (no tokenizer: dataset=synthetic has none)'))
    return tensors


def load_hf(path, abstract_params, cfg):
    """load_hf=DIR: a Hugging Face Llama checkpoint -> our params in the run's shardings (fine-tuning)."""
    try:
        conf = json.loads(stored(os.path.join(path, 'config.json')).read_text())
        tensors = safetensors.numpy.load(stored(os.path.join(path, 'model.safetensors')).read_bytes())
        params = model_lib.from_hf(cfg, tensors, conf)
    except STORAGE_ERRORS as e:
        raise ConfigError(f'load_hf={path}: cannot read {getattr(e, "filename", None) or path} ({storage_reason(e)}); '
                          'give a directory with config.json and one model.safetensors') from None
    except (safetensors.SafetensorError, json.JSONDecodeError, TypeError, ZeroDivisionError) as e:
        raise ConfigError(f'load_hf={path}: config.json or model.safetensors is damaged ({str(e)[:200]})') from None
    except ValueError as e:  # the checkpoint and the config disagree
        raise ConfigError(f'load_hf={path}: {e}') from None

    def place(keypath, a):
        w = params[tuple(k.key for k in keypath)]
        if w.size != a.size:
            raise ConfigError(f'load_hf={path}: model.safetensors disagrees with its config.json: '
                              f'{"/".join(k.key for k in keypath)} holds {w.shape} values where the config makes {a.shape}')
        return jax.device_put(w.reshape(a.shape).astype(a.dtype), a.sharding)
    params = jax.tree_util.tree_map_with_path(place, abstract_params)
    log(f'loaded Hugging Face checkpoint {path}')
    return params


# ==================================================================================================
# The TPU fit check: compile the real step for a TPU slice on this machine (libtpu), compare with HBM.
# ==================================================================================================
TPU_SLICES = {  # slice name: (libtpu topology, chip config, HBM per JAX device; a v2/v3 device is one core,
    # a TPU7x (Ironwood) device one of a chip's two dies: libtpu 0.0.51 makes a 2x2x1 slice 8 devices of 94.7 GiB
    # available, of the chip's 192 GB)
    'v2-8': ('v2:2x2', 'default', 8 * GiB), 'v3-8': ('v3:2x2', 'default', 16 * GiB),
    'v4-8': ('v4:2x2x1', 'megacore', 32 * GiB), 'v4-32': ('v4:2x2x4', 'megacore', 32 * GiB),
    'v4-64': ('v4:2x4x4', 'megacore', 32 * GiB), 'v5e-8': ('v5e:2x4', 'default', 16 * GiB),
    'v5p-8': ('v5p:2x2x1', 'megacore', 95 * GiB), 'v6e-8': ('v6e:2x4', 'default', 32 * GiB),
    'tpu7x-8': ('tpu7x:2x2x1', 'default', 96 * GiB),
}
DOES_NOT_FIT = 4  # exit code of compile_topology when the step needs more HBM than the slice has


def abstract_batch(feed):
    """The step's [A, B, L] batch as shapes only: to compile ahead of time, nothing read."""
    shape = (feed.accum, feed.rows, feed.length)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == 'loss_mask' else jnp.int32, sharding=feed.step_sharding)
            for k in ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')}


def compiled_line(m):
    """(the compiler's memory_analysis() per device as a log line, total bytes). Donated state buffers are
    reused for the new state (alias), so they count once."""
    need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return (f'compiled per device: arguments (params + optimizer state + batch) {gb(m.argument_size_in_bytes)}, '
            f'temporaries {gb(m.temp_size_in_bytes)}, outputs {gb(m.output_size_in_bytes)} '
            f'({gb(m.alias_size_in_bytes)} reusing donated arguments) = {gb(need)}', need)


def tpu_slice(cfg):
    """compile_topology=v4-64: that slice's devices as libtpu describes them, on any machine (no TPU needed)."""
    topology, chips, hbm = TPU_SLICES[cfg.compile_topology]
    if topology.startswith('tpu7x') and tuple(map(int, jax.__version__.split('.')[:2])) < (0, 12):
        raise ConfigError(f'compile_topology={cfg.compile_topology}: TPU7x needs the current JAX and libtpu 0.0.51 '
                          f'(Python 3.12: pip install -r requirements.txt -r tests/requirements.txt there); the '
                          f'libtpu of jax {jax.__version__} aborts compiling its programs')
    try:
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(topology_name=topology, platform='tpu',
                                               chip_config_name=chips).devices
    except Exception as e:  # no libtpu, an older one, or another process holding it
        raise ConfigError(f'compile_topology={cfg.compile_topology}: libtpu cannot describe the slice: '
                          f'{first_line(e, typed=False, limit=200)} (pip install -r tests/requirements.txt brings libtpu)'
                          ) from None
    log(f'AOT compile for {cfg.compile_topology}: {len(devices)} x {devices[0].device_kind}, {gb(hbm)} HBM each')
    return devices


def fit_memory(cfg, task, devices):
    """Compile the real train step of cfg for the slice's devices: (bytes per device or None where the
    compiler refuses it as too large, the compiler's figures, the log line). Nothing runs, no data is read."""
    built = build(cfg, task, devices)
    step = compile_steps(cfg, task, built, None).train
    try:
        with jax.set_mesh(built.mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
            seconds, m = compile_step(step, built.layout.abstract, built.feed)
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler itself refuses a program over its HBM
        if 'RESOURCE_EXHAUSTED' not in str(e):
            raise
        return None, None, f'compiler: {first_line(e, typed=False, limit=300)}'
    line, need = compiled_line(m)
    return need, {k: getattr(m, f'{k}_size_in_bytes') for k in ('argument', 'temp', 'output', 'alias')}, \
        f'compiled in {seconds:.1f}s; {line}'


def fit_check(cfg, task, devices):
    """compile_topology=SLICE: does the step fit the slice's HBM? With what to change when it does not."""
    hbm = TPU_SLICES[cfg.compile_topology][2]
    need, memory, line = fit_memory(cfg, task, devices)
    fits = need is not None and need <= hbm
    log(f'{line} of {gb(hbm)} HBM: {"fits" if fits else "does not fit"}')
    if not fits:
        log('to fit: per_device_batch=auto finds the largest batch that does; or remat=full, more fsdp (mesh=1,-1,1), '
            'a smaller model or a larger slice')
    return {'fits': fits, 'bytes_per_device': need, 'hbm_bytes': hbm, 'memory': memory}


def fit_search(cfg, task, devices):
    """compile_topology=SLICE per_device_batch=auto: the largest per-device microbatch that fits in 90% of the
    HBM, grad_accum being the examples per device per update (split into grad_accum / b microbatches of b),
    then the least recompute that still fits at that size. Bisection over the divisors, one compile each, every
    result printed; ends with the command line to run."""
    total, hbm = cfg.grad_accum, TPU_SLICES[cfg.compile_topology][2]

    def fits(b, remat):
        need = fit_memory(cfg.model_copy(update={'per_device_batch': b, 'grad_accum': total // b, 'remat': remat}),
                          task, devices)[0]
        ok = need is not None and need <= 0.9 * hbm
        log(f'  per_device_batch={b} grad_accum={total // b} remat={remat}: '
            f'{"over the HBM" if need is None else gb(need)} -> {"fits" if ok else "no"}')
        return ok
    sizes = [b for b in range(1, total + 1) if total % b == 0]
    lo, hi = 0, len(sizes) - 1  # sizes[:lo] fit with remat=full (the least memory); find the last that does
    while lo <= hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if fits(sizes[mid], 'full') else (lo, mid - 1)
    if not lo:
        log('nothing fits, even one example per device with remat=full: more fsdp, a smaller model or a larger slice')
        return {'fits': False}
    b = sizes[lo - 1]
    remat = next(r for r in ('none', 'save_dots', 'full') if r == 'full' or fits(b, r))
    found = [f'per_device_batch={b}', f'grad_accum={total // b}', f'remat={remat}']
    kept = [a for a in sys.argv[1:] if a.partition('=')[0] not in ('per_device_batch', 'grad_accum', 'remat',
                                                                     'compile_topology')]
    log(f'largest that fits: {" ".join(found)}\nrun on the slice: python train.py {" ".join(kept + found)}')
    return {'fits': True, 'per_device_batch': b, 'grad_accum': total // b, 'remat': remat}


# ==================================================================================================
# run: everything above, in the order the data flows.
# ==================================================================================================
@contextlib.contextmanager
def run_directory(cfg):
    """output_dir/run_name (a local path or gs://) for the block: made, checked writable, and in mode=train owned
    by this run (one run trains in a run directory at a time). resume=false moves an earlier run's checkpoints
    and metrics aside (renamed, never deleted) so the new run starts clean."""
    run_dir = os.path.join(cfg.output_dir, cfg.run_name)
    checkpoints_dir, bucket = os.path.join(run_dir, 'checkpoints'), '/'.join(run_dir.split('/')[:3])  # gs://NAME
    try:
        if remote(run_dir) and not stored(bucket).exists():  # gcsfs would create the bucket a typo names
            raise WriteError(f'output_dir={cfg.output_dir}: bucket {bucket} does not exist or these credentials '
                             f'cannot see it; create it (gcloud storage buckets create {bucket}) or fix output_dir')
        stored(run_dir).mkdir(parents=True, exist_ok=True)
        lock = own(run_dir) if cfg.mode == 'train' else None
        if cfg.mode == 'train':
            if not cfg.resume and jax.process_index() == 0:
                for name in ('checkpoints', 'metrics.jsonl'):
                    if stored(os.path.join(run_dir, name)).exists():
                        moved = set_aside(os.path.join(run_dir, name), 'replaced')
                        log(f'resume=false: moved the earlier {name} aside to {os.path.basename(moved)}')
            if stored(checkpoints_dir).is_file():
                raise ConfigError(f'{checkpoints_dir} is a file, where the run keeps its checkpoints: move it away')
            stored(checkpoints_dir).mkdir(parents=True, exist_ok=True)
            probe = stored(checkpoints_dir) / f'.writable-{os.getpid()}'  # now rather than at the first save
            probe.write_text('')
            probe.unlink()
    except STORAGE_ERRORS as e:  # a local directory refusing is the user's to fix; a bucket refusing, a fault
        raise (WriteError if remote(run_dir) else ConfigError)(
            f'output_dir={cfg.output_dir}: cannot write in {run_dir} ({storage_reason(e)}); choose a writable '
            'output_dir') from None
    key = run_dir if remote(run_dir) else os.path.abspath(run_dir)
    HELD[key] = held(run_dir, lock)
    try:
        yield run_dir
    finally:
        HELD.pop(key, None)
        if lock:
            lock.close()


def held(run_dir, lock):
    """How check_held tells the run directory is still this run's: its lease (a bucket), or its inode (a disk)."""
    if remote(run_dir):
        return lambda: not (lock and lock.lost)
    def inode():
        with contextlib.suppress(OSError):
            return os.stat(run_dir).st_dev, os.stat(run_dir).st_ino
    first = inode()
    return lambda: inode() == first


def own(run_dir):
    """Process 0 takes the run directory's lock for the whole run: on a disk RUN_DIR/.lock, locked with flock
    (the kernel drops it when the process ends, however it ends), with its holder written inside; in a bucket a
    BucketLease. A second run on the directory finds it held and stops, every process of it."""
    lock, holder = None, ''
    if jax.process_index() == 0 and remote(run_dir):
        lock = BucketLease(os.path.join(run_dir, '.lock'))
        holder = lock.acquire()
    elif jax.process_index() == 0:
        lock = open(os.path.join(run_dir, '.lock'), 'a+')
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.truncate(0)
            lock.write(f'process {os.getpid()} on {socket.gethostname()} since {time.strftime("%Y-%m-%d %H:%M:%S")}\n')
            lock.flush()
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or 'another process'
    if not multihost_utils.broadcast_one_to_all(np.int32(not holder)):
        if lock and not remote(run_dir):
            lock.close()
        raise ConfigError(f'{run_dir} is in use by {holder or "another run (see process 0)"}: wait for that run to '
                          'end, or choose another run_name')
    return lock


TOKENIZER_KEYS = ('tokenizer_path', 'vocab_size', 'dataset', 'dataset_path', 'tfds_name', 'train_split', 'hf_path',
                  'hf_name', 'hf_data_files', 'hf_split', 'text_key')


def keep_tokenizer(cfg, ds, run_dir, resumed):
    """What a checkpoint's token ids mean is part of it: a run keeps its tokenizer as RUN_DIR/tokenizer.model, and
    a resume whose tokenizer differs (other files, vocab_size, tokenizer_path) stops, naming what changed."""
    path, model = os.path.join(run_dir, 'tokenizer.model'), ds.tokenizer.serialized_model_proto()
    if not (resumed and stored(path).exists()):
        return write(path, model)
    if stored(path).read_bytes() != model:
        changed = [c for c in config_changes(run_dir, cfg) if c.split()[0] in TOKENIZER_KEYS] or [
            'the training text (its files changed, so the tokenizer trained on them did)']
        raise ConfigError(f'{path}: this run\'s tokenizer would change with {", ".join(changed)}: the checkpoint\'s '
                          'token ids would mean other text; undo the change, set tokenizer_path=' + path + ' to keep '
                          'its tokenizer, or start a new run_name (load_params= takes the weights)')


def write_config(cfg, run_dir, derived):
    """The resolved config, the derived figures as a comment on top (config.MODE.yml for the other modes,
    so the training record stays)."""
    name = 'config.yml' if cfg.mode == 'train' else f'config.{cfg.mode}.yml'
    write(os.path.join(run_dir, name), f'# {derived}\n' + yaml.safe_dump(cfg.model_dump(mode='json'), sort_keys=False))


def describe(cfg, devices, mesh, rows):
    """The batch arithmetic, printed at start and kept in config.yml."""
    log(f'devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}), {jax.process_count()} '
        f'process(es); mesh {dict(mesh.shape)}')
    batch = (f'batch: {cfg.per_device_batch}/device x {len(devices)} devices x {cfg.grad_accum} accum = '
             f'{rows * cfg.grad_accum} examples = {rows * cfg.grad_accum * cfg.max_target_length} tokens per step')
    log(batch)
    return batch


def run(cfg, devices=None, caught=None):
    """Train, evaluate, export or generate per cfg; returns a summary dict. `devices` lets tests pick a subset;
    `caught`: the signals main() listens for."""
    task = model_lib.TASKS[cfg.task]  # what is trained: the one place train.py asks
    check(cfg, task)
    if cfg.compile_cache_dir:  # before the first compile; every program is cached, however quick to compile
        jax.config.update('jax_compilation_cache_dir', str(stored(cfg.compile_cache_dir)))
        jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    devices = tpu_slice(cfg) if cfg.compile_topology else devices or jax.devices()
    cfg = resolve(cfg, task, devices[0].platform, devices[0].device_kind)
    if cfg.compile_topology:
        return (fit_search if cfg.per_device_batch == 'auto' else fit_check)(cfg, task, devices)
    built = build(cfg, task, devices)
    batch = describe(cfg, devices, built.mesh, built.feed.rows)
    ds = data.make_dataset(cfg, jax.process_index(), jax.process_count(), log, task.dataset)
    if ds.vocab_size != cfg.vocab_size:
        raise ConfigError(f'vocab_size={cfg.vocab_size} but the data has {ds.vocab_size} tokens; '
                          f'set vocab_size={ds.vocab_size}')
    flops = step_flops(cfg, task, devices) if cfg.mode == 'train' else None  # its probe runs outside the mesh
    with run_directory(cfg) as run_dir, jax.set_mesh(built.mesh), nnx.logical_axis_rules(cfg.logical_axis_rules), \
            checkpoints(os.path.join(run_dir, 'checkpoints'), cfg) as mngr:
        state, data_state, trained = restore_or_init(cfg, task, mngr, built.layout)
        if cfg.mode == 'train' and ds.tokenizer:
            keep_tokenizer(cfg, ds, run_dir, resumed=int(state['step']) > 0)
        write_config(cfg, run_dir, batch)
        log(f'model: {sum(x.size for x in jax.tree.leaves(state["params"])) / 1e6:.2f}M parameters, '
            f'{task.flops_per_token(cfg) / 1e6:.1f} MFLOPs per token (train)')
        if cfg.print_sharding:
            log(sharding_table(state['params'], built.layout.shardings['params']))
        if cfg.mode != 'train' and not trained:
            raise ConfigError(f'mode={cfg.mode} needs trained parameters: set load_params=RUN_DIR, load_hf=DIR, or '
                              f'run_name= a run with checkpoints (none in {run_dir}/checkpoints)')
        if cfg.mode == 'export':
            out_dir = cfg.export_dir or os.path.join(run_dir, 'hf')
            export_hf(cfg, state['params'], ds, out_dir)
            return {'export_dir': out_dir}
        if cfg.mode == 'generate':
            return generate_mode(cfg, task, built, state[task.eval_weights], ds, run_dir)
        steps = compile_steps(cfg, task, built, ds, flops)
        if cfg.mode == 'eval':
            return eval_mode(cfg, task, steps, state, run_dir)
        it = ds.train_iter(built.feed.rows // jax.process_count(), state=data_state)
        return train(cfg, task, state, it, steps, Place(run_dir, mngr, Signals() if caught is None else caught))


class Built(NamedTuple):
    """What build() makes of a config for a set of devices; nothing here holds an array yet."""
    mesh: jax.sharding.Mesh
    feed: Feed           # the batch's shardings and rows
    graph: Any           # the model's static graph (nnx.split)
    tx: Any              # the optimizer (optax)
    schedule: Callable   # its learning rate per step
    layout: Layout       # the train state's shapes and shardings


def build(cfg, task, devices):
    """The mesh, the batch feed, the model's graph, the optimizer and its schedule, and the state's layout."""
    mesh = make_mesh(cfg, devices)
    feed = make_feed(cfg, mesh, cfg.per_device_batch * len(devices))
    tx, schedule = make_optimizer(cfg)
    return Built(mesh, feed, model_lib.abstract(cfg)[0], tx, schedule, state_layout(cfg, task, mesh, tx, feed.rows))


def compile_steps(cfg, task, built, ds, flops=None):
    """The jitted train step (the state donated: updated in place) and eval of a state's eval weights."""
    layout, feed = built.layout, built.feed
    train_step = jax.jit(make_train_step(cfg, task, built.graph, built.tx), out_shardings=(layout.shardings, None),
                         in_shardings=(layout.shardings, feed.step_sharding), donate_argnums=0)
    eval_step = jax.jit(functools.partial(task.eval_step, cfg, built.graph),
                        in_shardings=(layout.shardings['params'], feed.eval_sharding))
    return Steps(train_step, evaluator(cfg, task, eval_step, ds, feed), feed, built.schedule, flops)


# ==================================================================================================
# The command line, and the process plumbing it needs: which platforms to start, joining a multi-process
# system, and keeping library noise off stderr. Kept here so the trainer above reads without it.
# ==================================================================================================
def main(argv):
    if len(argv) < 2 or argv[1] in ('-h', '--help'):
        print(__doc__.strip().splitlines()[0])
        return 0 if len(argv) >= 2 else 2
    try:
        files = 1 + sum(1 for _ in itertools.takewhile(lambda a: a.endswith(('.yml', '.yaml')) and '=' not in a, argv[2:]))
        cfg = load_config(argv[1:1 + files], argv[1 + files:])  # config files first (base.yml, then yours), then keys
        quiet_libraries()
        start_platforms()
        init_distributed()
        check_backends()
        with preemption_signals() as caught:  # from here to the last save a signal ends the run in one line
            return DOES_NOT_FIT if run(cfg, caught=caught).get('fits') is False else 0
    except STORAGE_ERRORS as e:  # a disk or bucket failing where no message above names the key: still one line
        where = f' at {e.filename}' if getattr(e, 'filename', None) else ''
        print(f'error: storage failed{where}: {storage_reason(e)}; checkpoints already committed are intact',
              file=sys.stderr)
        return 74
    except (ConfigError, data.DataError, FloatingPointError, WriteError, Preempted) as e:  # one line, no traceback
        print(f'{"stopped" if isinstance(e, Preempted) else "error"}: {e}', file=sys.stderr)
        # 3: the loss went non-finite; 74 (EX_IOERR): the run directory refused a write; 75 (EX_TEMPFAIL):
        # preempted with a checkpoint, schedulers requeue on it
        return {FloatingPointError: 3, WriteError: 74, Preempted: 75}.get(type(e), 2)


def quiet_libraries():
    """Library noise off stderr, for what the trainer reports in one line: orbax and tfds narrate through
    absl warnings (a local build as a download, our per-glob builder config); reading a damaged checkpoint,
    the tensorstore reads orbax left in flight fail later, each logged by asyncio and raised once more from
    its abandoned coroutine or into a closed event loop; a refused write leaves orbax's write coroutines
    unawaited, which Python reports at exit."""
    logging.getLogger('absl').setLevel(logging.CRITICAL)  # orbax logs a failed save it raises to us as well
    for name in ('gcsfs', 'fsspec', 'google.auth', 'wandb'):  # retries and fallbacks: what matters, we say once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings('ignore', r"coroutine '.*' was never awaited", RuntimeWarning)
    logging.getLogger('asyncio').setLevel(logging.CRITICAL)
    hook = sys.unraisablehook
    orbax_read = lambda u: 'orbax' in getattr(getattr(u.object, 'cr_code', None), 'co_filename', '')
    sys.unraisablehook = lambda u: None if str(u.exc_value) == 'Event loop is closed' or orbax_read(u) else hook(u)


def pci_vendors():
    """The PCI vendor ids of this host's devices (Linux sysfs): what accelerators it has, without starting
    any of them. Google 0x1ae0 = TPU chips, NVIDIA 0x10de, AMD 0x1002."""
    vendors = set()
    for path in glob.glob('/sys/bus/pci/devices/*/vendor'):
        with open(path) as f:
            vendors.add(f.read().strip())
    return vendors


def start_platforms():
    """An installed libtpu (tests/requirements.txt brings it, for the TPU fit check) loads itself into every
    JAX process and prints five lines of errors on a host without TPU chips. There, unless the user chose
    platforms (JAX_PLATFORMS), JAX starts only what the host has: a GPU whose JAX plugin is installed, and
    the CPU. The fit check loads libtpu itself."""
    vendors = pci_vendors()
    if jax.config.jax_platforms or '0x1ae0' in vendors:
        return
    plugins = [m.name for m in pkgutil.iter_modules()]
    gpus = [name for name, vendor in (('cuda', '0x10de'), ('rocm', '0x1002'))
            if vendor in vendors and any(p.startswith(f'jax_{name}') for p in plugins)]
    jax.config.update('jax_platforms', ','.join(gpus + ['cpu']))


def check_backends():
    """JAX starts the platforms JAX_PLATFORMS names, or fails deep inside (RuntimeError, or a bare AssertionError
    for a GPU whose plugin is missing): one line instead."""
    try:
        jax.devices()
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ConfigError(f'JAX_PLATFORMS={jax.config.jax_platforms}: JAX cannot start it on this host'
                          + (f' ({first_line(e)})' if str(e) else '') + '; name platforms this host has (cpu, gpu '
                          'with jax[cuda], tpu on a TPU VM), or unset JAX_PLATFORMS') from None


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
        address = os.environ['JAX_COORDINATOR_ADDRESS']
        if not 0 <= index < count:
            raise ConfigError(f'JAX_PROCESS_INDEX={index}: must be 0..{count - 1} (JAX_PROCESS_COUNT={count})')
        if not address.rpartition(':')[2].isdigit():
            raise ConfigError(f'JAX_COORDINATOR_ADDRESS={address}: give host:port of process 0 (e.g. 10.0.0.1:8476)')
        jax.distributed.initialize(address, count, index)
        return
    slurm = 'SLURM_JOB_ID' in os.environ and int(os.environ.get('SLURM_NTASKS', '1')) > 1
    if slurm or '0x1ae0' in pci_vendors():  # a Cloud TPU VM: JAX reads the slice's hosts from its metadata
        jax.distributed.initialize()


if __name__ == '__main__':
    sys.exit(main(sys.argv))
