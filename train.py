"""Train a GQA transformer with JAX: python train.py base.yml [your.yml ...] [key=value ...]

Part 1 is the trainer, read top to bottom: the mesh -> sharding -> state -> the step -> eval ->
checkpoints -> metrics -> the loop -> the other modes -> run() -> main(). A run goes
  main -> load_config -> run: as_run (the config checked and made concrete) -> build (the mesh, the
  batch feed, the state's layout, the jitted steps) -> data.make_dataset -> run_directory ->
  restore_or_init -> train: train_loop (next_batch, the step, Meter -> MetricsWriter,
  save_checkpoint), inside guard (the watchdog, a lost host, a non-finite loss).
Part 2, after its banner, is what a pod needs beyond the trainer, in sections a first reading skips:
the config schema and its rules, the platforms and the hosts that must agree, the run directory,
damaged checkpoints, stalls, signals and lost hosts, the memory checks. Part 1 reaches it through 12
entry points, each marked `Part 2` where it is called.
What is trained, the language model or the puzzle heads, is a model.Task picked once in run(); the
data pipelines and the storage layer (local or gs:// paths, the run directory's lock, W&B) are in
data.py. Shape letters: model.py.
"""

import contextlib
import ctypes
import dataclasses
import difflib
import faulthandler
import functools
import glob
import itertools
import json
import math
import os
import pathlib
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pydantic
import yaml
from absl import flags as absl_flags
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import AfterValidator, BeforeValidator, Field

import data

# flax imports IPython where it is installed, only to ask whether it runs inside one (it cannot
# when IPython is not yet imported): 0.15 s to 0.28 s of every start (2026-12-07).
with data.kept_out("IPython"):
    from flax import nnx
import model as model_lib

GiB = 2**30
DOES_NOT_FIT = 4  # exit code of compile_topology when the step needs more HBM than the slice has
gb = lambda n_bytes: f"{n_bytes / GiB:.2f} GiB"
first_line = data.first_line


ConfigError = data.ConfigError  # a user mistake in the config: one line, no traceback


def log(msg):
    """Process 0 prints. Output that went away (`| head` ended, a full device, a closed terminal)
    costs no step: stdout goes to /dev/null from then on, and the rows stay in metrics.jsonl. None
    says nothing."""
    if msg is not None and jax.process_index() == 0:
        try:
            print(msg, flush=True)
        except OSError:  # BrokenPipeError, ENOSPC, EIO
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# ==================================================================================================
# The mesh: every device in one named grid; only this file builds it.
# ==================================================================================================


def make_mesh(cfg, devices):
    """The mesh over `devices`: jax.make_mesh on one slice; over several, the axes dcn_mesh names
    split across the slices (the data-center network between them) and the rest within each
    (create_hybrid_device_mesh). as_run (Part 2) has checked the slices against the devices."""
    n, known = len(devices), math.prod(cfg.mesh)  # known < 0: one -1 to fill in
    shape = [n // -known if s == -1 and n % known == 0 else s for s in cfg.mesh]
    if math.prod(shape) != n or -1 in shape:
        raise ConfigError(
            f"mesh={','.join(map(str, cfg.mesh))} ({','.join(cfg.mesh_axes)}) needs "
            f"{abs(math.prod(shape))} devices but JAX sees {n} {devices[0].platform} device(s); "
            f"use e.g. mesh=1,{n},1 or mesh=1,-1,1"
        )
    # Auto: the compiler propagates our annotations (not Explicit sharding in types)
    kinds = (jax.sharding.AxisType.Auto,) * len(shape)
    if cfg.num_slices == 1:
        return jax.make_mesh(shape, cfg.mesh_axes, devices=devices, axis_types=kinds)
    dcn = slices_per_axis(cfg, len(shape))
    ici = [s // d for s, d in zip(shape, dcn)]
    # a TPU device knows its slice; elsewhere a process is one
    granule = devices[0].platform != "tpu"
    mesh = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=granule)
    return Mesh(mesh, cfg.mesh_axes, kinds)


def slices_per_axis(cfg, ndim):
    """dcn_mesh: how many slices each mesh axis spans (auto: all of them along the first)."""
    return (cfg.num_slices,) + (1,) * (ndim - 1) if cfg.dcn_mesh == "auto" else cfg.dcn_mesh


# ==================================================================================================
# Sharding: logical axis names -> mesh axes, through the one table in base.yml.
# ==================================================================================================


def mesh_spec(logical, shape, cfg, mesh):
    """One array's PartitionSpec from its logical axis names (model.dividing_spec: a dimension keeps
    the longest prefix of its mesh axes that divides it, so odd sizes stay replicated instead of
    failing)."""
    rules = dict(cfg.logical_axis_rules)
    if missing := [name for name in logical if name is not None and name not in rules]:
        raise ConfigError(
            f"logical axis {missing[0]!r} has no entry in logical_axis_rules; add [{missing[0]}, "
            "null]"
        )
    return model_lib.dividing_spec(logical, shape, rules, dict(mesh.shape))


def shardings_for(logical, abstract, cfg, mesh):
    """NamedShardings for a tree of arrays from the same-shaped tree of logical PartitionSpecs."""
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, mesh_spec(spec, x.shape, cfg, mesh)),
        logical,
        abstract,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def sharding_table(layout, cfg, mesh, whole_only=False):
    """A row per parameter: its shape and sharding, and the dimensions kept whole because their size
    does not divide by the mesh axes their rule names (such a dimension costs memory on every
    device). whole_only: the rows with such a dimension, as printed at start."""
    rows = []
    for (path, spec), x in zip(
        jax.tree_util.tree_leaves_with_path(
            layout.logical["params"], is_leaf=lambda v: isinstance(v, PartitionSpec)
        ),
        jax.tree.leaves(layout.abstract["params"]),
    ):
        got = mesh_spec(spec, x.shape, cfg, mesh)
        want = mesh_spec(spec, (0,) * x.ndim, cfg, mesh)  # 0 divides by every axis
        whole = [f"dim {i} not over {w}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if whole or not whole_only:
            rows.append(
                f"{jax.tree_util.keystr(path):52s} {x.shape!s:>20s}  {got}  {', '.join(whole)}"
            )
    return rows


@dataclasses.dataclass(frozen=True)
class Feed:
    """How host batches become global arrays: the microbatches per step (A: grad_accum; a
    batch_ramp changes it per step), the rows of one microbatch across every process (B), and the
    shardings of train batches [A, B, L] (the microbatch axis whole) and of eval batches [B, L];
    the batch's fields and their dtypes (the task's data may add some)."""

    accum: int
    rows: int
    length: int
    step_sharding: NamedSharding
    eval_sharding: NamedSharding
    fields: dict


def make_feed(cfg, mesh, rows, fields):
    spec = mesh_spec(("batch", "length"), (rows, cfg.max_target_length), cfg, mesh)
    return Feed(
        cfg.grad_accum,
        rows,
        cfg.max_target_length,
        NamedSharding(mesh, PartitionSpec(None, *spec)),
        NamedSharding(mesh, spec),
        fields,
    )


def global_batch(local, sharding, rows):
    """Host-local numpy [..., rows_here, L] -> global jax arrays [..., rows, L]: each process passes
    only its own share, so this is correct on multi-host pods."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, v.shape[:-2] + (rows, v.shape[-1]))
        for k, v in local.items()
    }


def to_host(tree):
    """Every process gets the whole of each array (gathered across processes), as numpy."""
    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
    )


# ==================================================================================================
# State: the optimizer, and the train state created directly in its sharding.
# ==================================================================================================


def make_optimizer(cfg):
    """AdamW on a warmup + cosine schedule. Gradient clipping is not chained in here: the step does
    it, where a reader can see it."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        # the last update (count steps - 1) at the end value
        decay_steps=max(cfg.steps - 1, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    # decoupled decay of the matrices only: no norm scale, no bias (model.decayed)
    return optax.adamw(
        schedule,
        cfg.adam_b1,
        cfg.adam_b2,
        cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=model_lib.decayed,
    ), schedule


class Layout(NamedTuple):
    init: Callable  # (rng, params or None) -> the train state
    shardings: dict  # the state's NamedShardings
    abstract: dict  # its shapes, dtypes and shardings, nothing allocated
    logical: dict  # its logical axes (PartitionSpecs of names)


def state_layout(cfg, task, mesh, tx, rows):
    """The train state's shapes and placement: step, params, the optimizer state and the task's own
    (the TRM's EMA and carry). Parameters take the model's logical axes, the optimizer's moments
    their parameter's, the task's state the axes it declares; the rest replicates."""

    def init(rng, params=None):  # params: start from these (loaded) instead of a fresh init
        if params is None or cfg.lora.rank:  # LoRA: the adapters fresh beside a loaded base
            params = model_lib.joined(model_lib.init(cfg, rng)[1], params or {})
        parts = model_lib.parts(cfg, params)  # what trains ('params'); with LoRA the 'base' apart
        return {
            "step": jnp.zeros((), jnp.int32),
            **parts,
            "opt_state": tx.init(parts["params"]),
            **task.own.init(cfg, parts["params"], rows),
        }

    shapes = jax.eval_shape(init, jax.random.key(cfg.seed))
    parts = model_lib.parts(cfg, model_lib.abstract(cfg)[1])  # the parameters' logical axes
    logical = {
        "step": PartitionSpec(),
        **parts,
        **task.own.axes(parts["params"]),
        "opt_state": optax.tree_map_params(
            tx,
            lambda _, spec: spec,
            shapes["opt_state"],
            parts["params"],
            transform_non_params=lambda _: PartitionSpec(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        ),
    }
    shardings = shardings_for(logical, shapes, cfg, mesh)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )
    return Layout(init, shardings, abstract, logical)


def init_state(cfg, layout, params=None):
    """Build the train state directly in its sharding (no full copy ever sits on one device), from a
    fresh init or from given parameters. Called inside the run's mesh and axis rules."""
    return jax.jit(layout.init, out_shardings=layout.shardings)(jax.random.key(cfg.seed), params)


# ==================================================================================================
# The step: scan over the microbatches summing token-weighted gradients, divide once, clip, AdamW.
# ==================================================================================================


def make_train_step(cfg, task, graph, tx):
    """The step: (state, batch [A, B, L]) -> (new state, metrics). The task's loss returns a loss
    summed over the microbatch and the weight it stands for, so summing then dividing once makes
    grad_accum=4 x batch 2 equal grad_accum=1 x batch 8."""

    def train_step(state, batch_ABL):
        params = state["params"]  # what trains: with LoRA the adapters, the frozen base beside them
        whole = lambda p: model_lib.joined(state.get("base"), p)
        loss_fn = lambda p, mb: task.loss(cfg, graph, whole(p), mb)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def micro(acc, mb):  # one microbatch: its gradient (float32) and loss added to the sums
            grads, loss = acc
            (l, sums), g = grad_fn(params, mb)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (grads, loss + l), sums

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        # Random draws (LoRA's dropout, TRM's halting exploration) are a function of (seed, step):
        # resume stays exact.
        step_key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        A = len(batch_ABL["inputs"])
        xs = {**batch_ABL, "key": jax.random.split(step_key, A), **task.own.inputs(cfg, state, A)}
        (grads, loss), sums_A = jax.lax.scan(micro, (zeros, 0.0), xs)
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), sums_A)
        denom = jnp.maximum(sums["weight"], 1.0)  # the step's real tokens (LM) or examples (TRM)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        # Clip by the global norm: scale every gradient by grad_clip / norm when the norm is above
        # it.
        grad_norm = optax.tree.norm(grads)
        if cfg.grad_clip > 0:
            over = grad_norm >= cfg.grad_clip
            clip = lambda g: jnp.where(over, g / grad_norm.astype(g.dtype) * cfg.grad_clip, g)
            grads = jax.tree.map(clip, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {
            **state,
            "step": state["step"] + 1,
            "params": new_params,
            "opt_state": opt_state,
            **task.own.update(cfg, state, new_params, sums_A),
        }
        metrics = {"loss": loss / denom, "grad_norm": grad_norm, "tokens": sums["tokens"]}
        return new_state, {**metrics, **task.step_metrics(sums, denom)}

    return train_step


class Built(NamedTuple):
    """What build() makes of a config for a set of devices; nothing here holds an array yet."""

    mesh: jax.sharding.Mesh
    feed: Feed  # the batch's shardings and rows
    graph: Any  # the model's static graph (nnx.split)
    schedule: Callable  # the learning rate per step
    layout: Layout  # the train state's shapes and shardings
    train_step: Callable  # jitted: (state, batch [A, B, L]) -> (new state, metrics)
    eval_step: Callable  # jitted: (eval weights, batch [B, L]) -> the task's outputs


def build(cfg, task, devices):
    """The mesh, the batch feed, the model's graph, the optimizer and its schedule, the state's
    layout, and the jitted steps (compiled at their first call, or ahead by compile_step)."""
    mesh = make_mesh(cfg, devices)
    feed = make_feed(cfg, mesh, cfg.per_device_batch * len(devices), data.fields_of(task.dataset))
    tx, schedule = make_optimizer(cfg)
    graph, _ = model_lib.abstract(cfg)
    layout = state_layout(cfg, task, mesh, tx, feed.rows)
    # The sharding is all stated here, at the jit: the state enters and leaves in its layout
    # (parameters and their optimizer moments split by their logical axes), the batch split over its
    # 'batch' rule; XLA inserts the collectives (the gradient's reduction across data, the gathers
    # of fsdp). The old state's buffers are donated to the new one, so a step holds one copy of the
    # state.
    train_step = jax.jit(
        make_train_step(cfg, task, graph, tx),
        in_shardings=(layout.shardings, feed.step_sharding),
        out_shardings=(layout.shardings, None),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        functools.partial(task.eval_step, cfg, graph),
        in_shardings=(weights(layout.shardings, task), feed.eval_sharding),
    )
    return Built(mesh, feed, graph, schedule, layout, train_step, eval_step)


# ==================================================================================================
# Eval: the task's eval step on fixed batches, its metrics computed on the host.
# ==================================================================================================


def evaluator(cfg, task, eval_step, feed):
    """evaluate(state, ds, save_to=None, beat=None): the task's eval metrics of the state's eval
    weights on eval_batches fixed batches of ds (the same every call, so curves compare), or on the
    whole eval set: SFT rows' unless eval_batches is set, mode=eval's where the task says so (the
    puzzles); and the seconds they took. save_to: a directory for the task's answers (process 0
    only); beat: called after every batch."""
    whole = lambda ds: ds.whole_eval and "eval_batches" not in cfg._given

    def evaluate(state, ds, save_to=None, beat=lambda *_: None):
        n_batches = None if whole(ds) or ds.eval_all and cfg.mode == "eval" else cfg.eval_batches
        if n_batches == 0:
            return {}
        t0 = time.perf_counter()
        rows_of = lambda rows: ds.eval_batches(rows, n_batches)  # one pass at most
        outs, batches = gathered(cfg, feed, eval_step, weights(state, task), rows_of, beat)
        batches += [data.padding(batches[0])] * (len(outs) - len(batches))
        if n_batches and len(outs) < n_batches:
            log(f"eval_batches={n_batches}: the eval set fills {len(outs)}; evaluating those")
        main = save_to if jax.process_index() == 0 else None  # answers written once
        result = task.eval_result(cfg, outs, [to_host(b) for b in batches], ds, main)
        return {**result, "seconds": time.perf_counter() - t0}

    return evaluate


def gathered(cfg, feed, step, w, batches_of, beat=lambda *_: None, what="eval"):
    """step(w, batch) on this host's [B, L] batches (batches_of(its rows), a sequence): (every
    output whole on every host, those batches). Every host runs as many as the one holding most,
    the rest padding that weighs nothing."""
    outs = []
    said = time.perf_counter()  # a long pass says where it is every 10 s
    batches = batches_of(feed.rows // jax.process_count())
    n = max(agree(len(batches), cfg.host_timeout))
    for i in range(n):
        b = batches[i] if i < len(batches) else data.padding(batches[0])
        x = global_batch(b, feed.eval_sharding, feed.rows)
        # Compiled ahead, then every host goes on at once: a collective's first run (Gloo, on CPU)
        # waits 30 s for the others.
        if i == 0:
            step.lower(w, x).compile()
            agree("", cfg.host_timeout)
        outs.append(to_host(step(w, x)))
        beat()
        if time.perf_counter() - said > 10:  # a search can take minutes
            said = time.perf_counter()
            log(f"{what}: {i + 1}/{n} batches")
    return outs, batches


# ==================================================================================================
# Checkpoints (orbax): async, sharded, atomic. A step directory appears only once complete, so a
# crash or kill -9 mid-write leaves nothing that resume would pick up.
# ==================================================================================================


class Preempted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""


KEPT = "the ones written before stay as they are"


# Room for one row's data-iterator state as JSON (a lane's, or a piece of a stream host's).
DATA_STATE_BYTES = 1024


def wait_for_saves(mngr):
    """Until the save in flight has committed; one that failed in the background (the disk filled
    up, the mount or bucket went away) is a WriteError."""
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - whatever failed in the background, one line
        raise data.WriteError(
            f"{mngr.directory}: the last checkpoint failed ({first_line(e)}); {KEPT}"
        ) from None


@contextlib.contextmanager
def checkpoints(directory, cfg, read_only=False):
    """The orbax CheckpointManager of a checkpoints/ directory, open for the block. Leaving the
    block, by any path, lets a save still in flight land first, then closes the manager."""
    # Orbax's barriers go through the coordination service (with a timeout), not a collective: on
    # CPU (Gloo) a collective's first run waits only 30 s for the other hosts, and one host can be
    # that far behind at a barrier.
    absl_flags.FLAGS.mark_as_parsed()
    absl_flags.FLAGS.experimental_orbax_use_distributed_barrier = True
    # The step directory is made before save() returns, so a directory that refuses it fails there
    # and then, not in a background thread that the end of the run would wait on.
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints or None,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    mngr = ocp.CheckpointManager(
        data.stored(directory),
        options=opts,
        item_handlers={
            "train_state": ocp.PyTreeCheckpointHandler(),
            "data_state": ocp.StandardCheckpointHandler(),
        },
    )
    try:
        yield mngr
    finally:
        try:
            wait_for_saves(mngr)
        finally:
            # every save has committed or failed in wait_for_saves, loudly: a close that fails too
            # (orbax raising a failed save again) has nothing more to say, and loses nothing
            with contextlib.suppress(Exception):
                mngr.close()


def save_checkpoint(mngr, step, state, it):
    """Step `step`'s train state and data position, saved asynchronously: training goes on while it
    is written. The position is every lane's iterator state (one per row of the global batch) as a
    uint8 array with a JSON row each, gathered in process order (process p reads rows p * local_rows
    onward), so every process holds all of it, process 0's copy is written, and a run on any process
    count reads every lane back; with it, the identity of the data it counts in."""
    raw = [json.dumps(s).encode().ljust(DATA_STATE_BYTES) for s in it.state()]
    assert max(map(len, raw)) <= DATA_STATE_BYTES, "data iterator state too large to checkpoint"
    lanes = multihost_utils.process_allgather(
        np.stack([np.frombuffer(r, np.uint8) for r in raw]), tiled=True
    )
    data_state = {"lanes": np.asarray(lanes), "source": np.frombuffer(it.source.encode(), np.uint8)}
    state = {k: v for k, v in state.items() if k != "base"}  # LoRA: the base is its source's
    data.check_held(str(mngr.directory))
    try:
        mngr.check_for_errors()  # the save before this one, finished in the background
        mngr.save(
            step,
            args=ocp.args.Composite(
                train_state=ocp.args.PyTreeSave(state), data_state=ocp.args.StandardSave(data_state)
            ),
        )
    except Exception as e:  # noqa: BLE001 - whatever refused the write, one line
        raise data.WriteError(
            f"{mngr.directory}: a checkpoint failed ({first_line(e)}); {KEPT}"
        ) from None


def restore_or_init(cfg, task, mngr, layout):
    """The train state: the newest readable checkpoint of this run (resume; with LoRA on the frozen
    base it started from), else starting_state. Returns (state, every lane's data state or None,
    whether the state holds trained parameters). restore_checkpoint (Part 2) skips damaged steps and
    names a changed config."""
    if cfg.resume and mngr.all_steps():
        # a damaged step is moved aside by the run that trains, never by an eval beside it
        kept = {k: v for k, v in layout.abstract.items() if k != "base"}  # a checkpoint's part
        restored = restore_checkpoint(mngr, kept, cfg, move_aside=cfg.mode == "train")
        if not restored:
            raise ConfigError(
                f"no readable checkpoint in {mngr.directory} (steps "
                f"{', '.join(map(str, mngr.all_steps()))} are damaged, see the warnings): move "
                "them away to start over, or set resume=false"
            )
        log(f"resuming from checkpoint {mngr.directory}/{restored.step}")
        state = restored.state
        if "base" in layout.abstract:  # LoRA: the base the adapters were trained on, loaded again
            state = model_lib.on_base(cfg, starting_state(cfg, task, layout)[0], state)
        return state, restored.data_state, True
    return starting_state(cfg, task, layout)


def starting_state(cfg, task, layout):
    """A fresh state, from load_params (another run's newest readable checkpoint: its params for
    training, what the task evaluates for the other modes) or load_hf weights (with load_adapter a
    peft adapter over them) if given: (state, None, whether it holds trained parameters)."""
    if cfg.load_params:
        part = "params" if cfg.mode == "train" else task.own.eval_weights
        path, steps = data.checkpoint_steps(cfg.load_params)
        with checkpoints(path, cfg, read_only=True) as source:
            found = restore_checkpoint(source, layout.abstract, cfg, steps, part=part)
        if not found:
            raise ConfigError(
                f"load_params={path}: no readable checkpoint there (see the warnings)"
            )
        log(f"loaded {part} from {path}/{found.step}")
        state = init_state(cfg, layout, found.state)
        if cfg.mode != "train":  # eval: the step it was trained to
            state = {**state, "step": jnp.int32(found.step)}
        return state, None, True
    if cfg.load_hf:  # each host reads what its devices hold
        params = model_lib.load_pretrained(cfg, layout.abstract)
        adapter = f" and peft adapter {cfg.load_adapter}" if cfg.load_adapter else ""
        log(f"loaded Hugging Face checkpoint {cfg.load_hf}{adapter}")
        return init_state(cfg, layout, params), None, True
    return init_state(cfg, layout), None, False


def weights(state, task):
    """What eval, generation and export read: the task's eval weights (with LoRA, the base
    joined)."""
    return model_lib.joined(state.get("base"), state[task.own.eval_weights])


# ==================================================================================================
# Metrics: throughput and MFU, one row per log_every steps to stdout, JSONL and TensorBoard.
# ==================================================================================================


def rates(flops, tps):
    """Throughput at `tps` tokens/s: per device, in TFLOP/s per device, and as MFU. A measured CPU
    peak that the step outruns was timed on a busy CPU: it is raised to the step's own rate, so MFU
    never passes 100%."""
    if tps * flops["per_token"] > flops["peak"] and "spec sheet" not in flops["peak_source"]:
        if not flops["peak_source"].startswith("this run"):
            log(
                "peak: raised to this run's fastest step (the CPU was busy when its matmul was "
                "timed)"
            )
        flops["peak"] = flops["peak_per_device"] = tps * flops["per_token"]
        flops["peak_source"] = "this run's fastest step"
    n = flops["devices"]
    return {
        "tokens_per_sec": tps,
        "tokens_per_sec_per_device": tps / n,
        "tflops_per_device": tps * flops["per_token"] / n / 1e12,
        "mfu": tps * flops["per_token"] / flops["peak"],
    }


class NonFinite(Exception):
    """A step whose loss or gradient norm is NaN or inf: (step, what was non-finite)."""


class Meter:
    """Dispatched steps read back oldest first (one in flight lets the host dispatch step n + 1
    while n runs; a log line, eval or checkpoint reads them all first, so none sees an unchecked
    loss), and the window since the last row: losses, task metrics, tokens, time, data wait. Keeps
    step times for the benchmark; `beat`: the watchdog."""

    def __init__(self, waited, beat):
        self.waited = waited  # () -> the seconds spent waiting for data so far
        self.beat = beat
        self.pending = []  # (step, dispatch time, outputs) of the steps not read back yet
        self.step_times = []
        self.t_done = None  # when the last step read back was seen to finish
        self.first_step_seconds = None
        self.last = None  # the newest step's outputs
        self.new_window()

    def new_window(self):
        self.losses, self.extras = [], []
        self.tokens, self.timed = 0.0, 0
        self.t0, self.wait0 = time.perf_counter(), self.waited()

    def read(self, keep=0):
        """Reads back finished steps until `keep` remain in flight; returns the newest outputs."""
        while len(self.pending) > keep:
            step, t0, out = self.pending.pop(0)
            out, now = jax.device_get(out), time.perf_counter()
            timed = self.t_done is not None  # the first step warms up (compiled before): not timed
            if timed:  # from the last step's end or this dispatch, whichever came later
                self.step_times.append(now - max(self.t_done, t0))
            else:
                self.first_step_seconds = now - t0
                log(f"first step: {now - t0:.1f}s")
                self.t0, self.wait0 = now, self.waited()
            self.t_done, self.last = now, out
            self.beat(step, now - t0)
            for name, key in (("loss", "loss"), ("gradient norm", "grad_norm")):
                if not np.isfinite(out[key]):
                    loss = f" (loss {out['loss']:.4f})" if key != "loss" else ""
                    raise NonFinite(step, f"{name} is {out[key]}{loss}")
            self.losses.append(float(out["loss"]))
            # the task's metrics; NaN = not measured
            task = {k: v for k, v in out.items() if k not in ("loss", "grad_norm", "tokens")}
            self.extras.append({k: float(v) for k, v in task.items() if np.isfinite(v)})
            self.tokens += float(out["tokens"]) if timed else 0.0
            self.timed += timed
        return self.last

    def row(self, step, learning_rate, flops):
        """The window's metrics row, every step read first."""
        out, dt = self.read(), max(time.perf_counter() - self.t0, 1e-9)
        m = {
            "step": step,
            "loss": float(np.mean(self.losses)) if self.losses else float("nan"),
            "learning_rate": learning_rate,
            "grad_norm": float(out["grad_norm"]),
        }
        if self.tokens:  # a window holding only the compiling first step has no rate to report
            m.update(rates(flops, self.tokens / dt), step_seconds=dt / max(self.timed, 1))
        m["tokens_per_step"] = float(out["tokens"])
        m["data_wait_fraction"] = (self.waited() - self.wait0) / dt
        m["host_rss_gb"] = data.host_rss_gb()
        m["open_files"] = data.open_files()
        names = {k for e in self.extras for k in e}
        m.update({k: float(np.mean([e[k] for e in self.extras if k in e])) for k in names})
        if (mem := data.device_peak_memory_gb(jax.local_devices()[0])) is not None:
            m["device_peak_memory_gb"] = mem
        self.new_window()
        return m


def benchmark(meter, flops, tokens_per_step, note):
    """Medians over every timed step (the first, compiling, excluded): for the summary, one line."""
    if not meter.step_times:
        return {}
    med = float(np.median(meter.step_times))
    r = rates(flops, tokens_per_step / med)
    log(
        f"benchmark: {len(meter.step_times)} timed steps, median {med:.3f} s/step = "
        f"{r['tokens_per_sec']:,.0f} tokens/s, {r['tflops_per_device']:.3f} TFLOP/s per device, "
        f"MFU {r['mfu']:.1%} of {flops['peak_per_device'] / 1e12:.3f} TFLOP/s "
        f"({flops['peak_source']}); {note}"
    )
    return {
        "median_step_seconds": med,
        "median_tokens_per_sec": r["tokens_per_sec"],
        "median_mfu": r["mfu"],
    }


# ==================================================================================================
# The loop: dispatch a step, read the one before it, log, evaluate, checkpoint, until cfg.steps.
# ==================================================================================================


@dataclasses.dataclass
class Signals:
    """The SIGTERM / SIGINT names a run has noted (Part 2's preemption_signals); until `saving` is
    set (the loop is about to take its first step) there is nothing new to save, and a signal stops
    the run at once."""

    names: list = dataclasses.field(default_factory=list)
    saving: bool = False


@dataclasses.dataclass
class Job:
    """What the loop works with: the run directory and its checkpoints, the built step and the
    evaluator, the signals it answers, the clock of its goodput and the FLOPs its rates need; once
    training starts, the metrics writer and the watchdog's beat (called for every step read back,
    eval batch and checkpoint)."""

    dir: str
    mngr: Any
    built: Any
    evaluate: Callable
    caught: Signals
    clock: Any  # a Goodput (Part 2)
    flops: dict = None
    writer: Any = None
    beat: Callable = lambda *_: None


def accum_at(cfg, step):
    """The microbatches the update after `step` sums: grad_accum, or the count of the last
    batch_ramp pair [step, count] reached. Only their count grows: memory and the learning-rate
    schedule stay as they are."""
    return next((count for at, count in reversed(cfg.batch_ramp) if step >= at), cfg.grad_accum)


def next_batch(feed, it, accum, clock):
    """The next `accum` microbatches as one global [A, B, L] batch; the wait for them is data's."""
    with clock.timing("data"):
        mbs = [next(it) for _ in range(accum)]
    return global_batch(
        {k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]}, feed.step_sharding, feed.rows
    )


def profile(cfg, step, run_dir, drain):
    """profile_steps=a,b: a jax.profiler trace of steps a..b (1-based) into RUN_DIR/profile; called
    with the steps done so far, before each dispatch and after the last. `drain` reads back the
    steps in flight."""
    local = run_dir
    if data.remote(run_dir):  # the profiler writes local files only
        local = os.path.join(tempfile.gettempdir(), "profile", cfg.run_name)
    if step + 1 == cfg.profile_steps[0]:
        drain()
        jax.profiler.start_trace(os.path.join(local, "profile"))
    if step == cfg.profile_steps[1] and step:
        drain()
        jax.profiler.stop_trace()
        if local != run_dir:  # the profiler writes local files only
            data.move_up(local, "profile/**/*", run_dir)
        log(f"profile of steps {cfg.profile_steps[0]}-{step}: {run_dir}/profile")


def train_loop(cfg, task, state, it, ds, job):
    """Dispatch a step, read the one before it, log, evaluate, checkpoint, until cfg.steps. Returns
    the last metrics row and the Meter (its timings); a signal (noted in job.caught) ends it with a
    checkpoint and Preempted. Steps up to job.writer.redone_to were done once before a stop that
    lost them: their time is badput."""
    step = int(state["step"])
    last = {}
    meter = Meter(lambda: it.wait_seconds, job.beat)
    accum = cfg.grad_accum
    if job.writer.redone_to > step:
        log(f"steps {step + 1}-{job.writer.redone_to} ran before the stop and are run again")
    while step < cfg.steps:
        profile(cfg, step, job.dir, meter.read)
        if accum_at(cfg, step) != accum:
            accum = accum_at(cfg, step)
            log(f"batch ramp: from step {step + 1}, {accum} microbatches per update")
        job.clock.now("redone" if step < job.writer.redone_to else "step")
        t0 = time.perf_counter()
        state, out = job.built.train_step(state, next_batch(job.built.feed, it, accum, job.clock))
        step += 1
        meter.pending.append((step, t0, out))
        meter.read(keep=1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            last = meter.row(step, float(job.built.schedule(step - 1)), job.flops)
            if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                with job.clock.timing("eval"):
                    evaluated = job.evaluate(state, ds, beat=job.beat)
                last.update({f"eval_{k}": v for k, v in evaluated.items()})
            last.update(job.clock.shares())
            log(data.short_line(last, cfg.steps, task.shown))
            job.writer.write(last)
            meter.new_window()  # after the eval: its time counts in no window
        preempted = job.caught.names or (
            jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(step)
        )
        if (
            (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or step == cfg.steps
            or preempted
        ):
            meter.read()  # a checkpoint holds only checked steps
            with job.clock.timing("checkpoint"):
                # before the save: a resume drops rows past the checkpoint, never misses one
                job.writer.flush()
                save_checkpoint(job.mngr, step, state, it)  # async: training goes on as it writes
                job.writer.flush(saved=True)
            job.beat()
        if preempted:
            raise Preempted(
                f"{job.caught.names[0] if job.caught.names else 'preemption notice'}: saved "
                f"checkpoint at step {step} in {job.mngr.directory}; rerun the same command to "
                "resume"
            )
    profile(cfg, step, job.dir, meter.read)
    return last, meter


def train(cfg, task, state, it, ds, job):
    """mode=train: from state['step'] to cfg.steps; returns the last metrics row with the
    benchmark's medians."""
    if (start := int(state["step"])) >= cfg.steps:
        log(
            f"{job.dir} is already at step {start} of steps={cfg.steps}: nothing to train (raise "
            "steps= to go on)"
        )
        return {"step": start, "run_dir": job.dir}
    # before the compile: a W&B problem shows at once
    job.writer = data.MetricsWriter(cfg, job.dir, start, log)
    try:
        with job.clock.timing("compile"):
            t_xla, compiled = compile_ahead(cfg, job.built, state)
        with guard(cfg, job, t_xla):  # Part 2: the watchdog, a lost host, a non-finite loss
            summary, meter = train_loop(cfg, task, state, it, ds, job)
    finally:
        it.close()
        job.writer.close()
        job.clock.now("checkpoint")
        # still under the handlers: a repeated SIGTERM cannot cut the last save short
        wait_for_saves(job.mngr)
    mem = data.device_peak_memory_gb(jax.local_devices()[0])
    summary.update(run_dir=job.dir, compile_seconds=t_xla + (meter.first_step_seconds or 0))
    note = (
        f"compile + first step {summary['compile_seconds']:.1f}s; "
        f"host RSS {data.host_rss_gb():.2f} GiB"
        + (f", device peak {mem:.2f} GiB" if mem is not None else "")
        + f", compiled step {gb(compiled or 0)}"
    )
    summary.update(benchmark(meter, job.flops, summary.get("tokens_per_step", 0.0), note))
    summary.update(job.clock.shares())
    log(job.clock.line())
    done = ("step", "loss", "eval_loss", "tokens_per_sec", "mfu", "goodput", "compile_seconds")
    log("done: " + json.dumps({k: summary.get(k) for k in (*done, "run_dir")}))
    log(
        f"checkpoints: {job.mngr.directory}; metrics: {job.dir}/metrics.jsonl (tensorboard "
        f"--logdir {job.dir})"
    )
    return summary


# ==================================================================================================
# The other modes: eval, generation, Hugging Face export (import is in restore_or_init), each (cfg,
# task, state, ds, job) -> a summary.
# ==================================================================================================


def eval_mode(cfg, task, state, ds, job):
    """mode=eval: the loaded parameters on the eval set (eval_batches, or all of it where the task
    says so), printed as one JSON line and written to eval.json (and any answers the task writes
    beside it)."""
    result = {"step": int(state["step"]), **job.evaluate(state, ds, save_to=job.dir)}
    if task.answers and cfg.eval_answers:  # held-out prompts answered, scored by exact match
        result.update(task.answers(cfg, job.built.graph, weights(state, task), ds, job.dir))
    data.write(os.path.join(job.dir, "eval.json"), json.dumps(result))
    log(json.dumps(result))
    return result


def generate_mode(cfg, task, state, ds, job):
    """mode=generate: the task's generation from prompt=, printed and written to
    RUN_DIR/generation.txt."""
    summary, shown, text = task.generate(
        cfg, job.built.graph, weights(state, task), ds, job.built.mesh.size
    )
    log(shown)
    data.write(os.path.join(job.dir, "generation.txt"), text)
    return {**summary, "run_dir": job.dir}


def export_mode(cfg, task, state, ds, job):
    """mode=export: the parameters as a Hugging Face Llama checkpoint in export_dir (default
    RUN_DIR/hf)."""
    out_dir = cfg.export_dir or os.path.join(job.dir, "hf")
    tensors = model_lib.export_hf(cfg, weights(state, task), ds.tokenizer, out_dir)
    log(f"exported {len(tensors)} tensors as {model_lib.exported(cfg)} to {out_dir}")
    return {"export_dir": out_dir}


# ==================================================================================================
# run: everything above, in the order the data flows; main: the command line.
# ==================================================================================================


def describe(cfg, devices, built):
    """Logs the devices, the mesh, the batch and the parameters kept whole; returns the batch."""
    rows = cfg.per_device_batch * len(devices) * cfg.grad_accum
    batch = (
        f"batch: {cfg.per_device_batch}/device x {len(devices)} devices x {cfg.grad_accum} accum = "
        f"{rows} examples = {rows * cfg.max_target_length} tokens per step"
    )
    if cfg.batch_ramp:
        ramp = ", ".join(f"{count} after step {at}" for at, count in cfg.batch_ramp)
        batch += f"; batch_ramp: accum {ramp}"
    log(
        f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}), "
        f"{jax.process_count()} process(es), {cfg.num_slices} slice(s); mesh "
        f"{dict(built.mesh.shape)}\n{batch}"
    )
    if whole := sharding_table(built.layout, cfg, built.mesh, whole_only=True):
        log(
            "parameters kept whole where their size does not divide by their mesh axes:\n"
            + "\n".join(whole)
        )
    return batch


def run(cfg, devices=None, caught=None, t0=None):
    """Train, evaluate, export or generate per cfg; returns a summary dict. `devices` lets tests
    pick a subset; `caught`: the signals main() listens for; t0: when the run began (goodput's
    start-up counts from it; by default, now)."""
    clock = Goodput(t0 or time.perf_counter())  # Part 2: where the wall time goes
    task = model_lib.TASKS[cfg.task]  # what is trained: the one place train.py asks
    # Part 2: checked, load_hf's keys, auto values, alike on every host
    cfg, devices = as_run(cfg, task, devices)
    if cfg.compile_topology:
        return fit_tpu(cfg, task, devices)  # Part 2: compiled for a TPU slice, nothing run
    ds = data.make_dataset(cfg, jax.process_index(), jax.process_count(), log, task.dataset)
    if cfg.epochs:  # the steps that read every training example `epochs` times
        steps = ds.epoch_steps(cfg.per_device_batch * len(devices), cfg.grad_accum, cfg.epochs)
        cfg = cfg.model_copy(update={"steps": steps})
        log(f"epochs={cfg.epochs}: steps={steps}")
    built = build(cfg, task, devices)
    # Part 2: the same data on every host, its vocabulary the model's, the state within host memory;
    # to train, the FLOPs per token and the device's peak (on CPU, measured outside the mesh)
    flops = preflight(cfg, task, ds, built)
    batch = describe(cfg, devices, built)
    with (
        run_directory(cfg) as run_dir,  # Part 2: one run at a time in it, shared by every host
        jax.set_mesh(built.mesh),
        nnx.logical_axis_rules(cfg.logical_axis_rules),
        # read-only outside mode=train: an eval of a run while it trains leaves its saves alone
        checkpoints(os.path.join(run_dir, "checkpoints"), cfg, cfg.mode != "train") as mngr,
    ):
        state, data_state, trained = restore_or_init(cfg, task, mngr, built.layout)
        start = int(state["step"])
        if cfg.mode == "train" and ds.tokenizer:
            data.keep_tokenizer(ds, run_dir, start > 0, cfg)
        # train's record of its config stays; the other modes write theirs beside it
        name = "config.yml" if cfg.mode == "train" else f"config.{cfg.mode}.yml"
        config = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        data.write(os.path.join(run_dir, name), f"# {batch}\n{config}")
        log(
            f"model: {model_lib.parameter_count(state)}, "
            f"{task.flops_per_token(cfg) / 1e6:.1f} MFLOPs per token (train)"
        )
        if cfg.print_sharding:
            log("\n".join(sharding_table(built.layout, cfg, built.mesh)))
        if cfg.mode != "train" and not trained:
            raise ConfigError(
                f"mode={cfg.mode} needs trained parameters: set load_params=RUN_DIR, load_hf=DIR, "
                f"or run_name= a run with checkpoints (none in {run_dir}/checkpoints)"
            )
        evaluate = evaluator(cfg, task, built.eval_step, built.feed)
        job = Job(run_dir, mngr, built, evaluate, caught or Signals(), clock, flops)
        over = functools.partial(gathered, cfg, built.feed)  # a step on every host's batches
        # what the task computes once before it runs (DPO's reference without LoRA), said in a line
        log(task.own.prepare(cfg, built.graph, weights(state, task), ds, start, run_dir, over))
        if cfg.mode == "train":
            it = ds.train_iter(built.feed.rows // jax.process_count(), state=data_state)
            return train(cfg, task, state, it, ds, job)
        modes = {"export": export_mode, "generate": generate_mode, "eval": eval_mode}
        return modes[cfg.mode](cfg, task, state, ds, job)


def main(argv):
    """The command line: config files first (base.yml, then yours), then key=value pairs. Returns
    the exit code."""
    t0 = time.perf_counter()
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        return 0 if len(argv) >= 2 else 2
    is_file = lambda arg: arg.endswith((".yml", ".yaml")) and "=" not in arg
    files = [argv[1], *itertools.takewhile(is_file, argv[2:])]
    # Part 2: a mistake, a full disk, a lost host: one line and an exit code
    with OneLineErrors() as outcome:
        # Part 2: the files and keys, checked by the schema
        cfg = load_config(files, argv[1 + len(files) :])
        # Part 2: the platforms and hosts; from here a signal is answered
        with started(cfg) as caught:
            summary = run(cfg, caught=caught, t0=t0)
        outcome.code = DOES_NOT_FIT if summary.get("fits") is False else 0
    return outcome.code


# Part 2: what a pod needs beyond the trainer. A first reading of the trainer skips all of it;
# each section names the failure it answers and the test that shows it. Part 1 reaches it through
# 12 entry points, each with a one-line docstring: load_config, as_run, fit_tpu, preflight, agree,
# Goodput, run_directory, restore_checkpoint, compile_ahead, guard, OneLineErrors, started.


# ==================================================================================================
# The config (Part 2). Failure: a key mistyped, out of range or at odds with another, a file that is
# not a config, a checkpoint whose config.json this model cannot run: one line naming the key and
# the fix, exit 2. Shown by tests/test_errors.py::test_bad_input_is_one_line_and_exit_2, test_hf.py
# (load_hf's keys). Every key is declared once, in base.yml: its default, its kind (a type KINDS
# names, or the values allowed) and its doc, on one line; make_schema types them all.
# ==================================================================================================


def _number(value):
    """YAML reads yes/true as a boolean, which pydantic would take as 1 for a number key."""
    if isinstance(value, bool):
        raise ValueError("expected a number")  # noqa: TRY004 - pydantic reports only ValueError
    return value


def _items(value):
    """A list typed on the command line: 4,4,2 or YAML ([[batch, data]]); from a file, as it is."""
    if isinstance(value, str) and value.startswith("["):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(
                "expected a list: 4,4,2 or [4, 4, 2] with its brackets closed"
            ) from None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")]
    # one value (YAML's 45) is a list of one
    return value if isinstance(value, (list, tuple)) else [value]


def _ramp(value):
    """batch_ramp as 2000:2,4000:4 on the command line, or [[2000, 2], [4000, 4]]; '' = none."""
    pairs = [] if value in ("", None) else _items(value)
    return [p.split(":") if isinstance(p, str) else p for p in pairs]


def _rising(pairs):
    if any(b[0] <= a[0] for a, b in itertools.pairwise(pairs)):
        raise ValueError("give its steps in rising order, each once: 2000:2,4000:4")
    return pairs


def _day(text):
    if text and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        raise ValueError("give a date as YYYY-MM-DD, or '' for the run's first day")
    return text


def _conversation(value):
    """messages: a list of {role, content} turns of text (in a YAML file, or as YAML on the
    command line: messages='[{role: user, content: Hi}]')."""
    turns = _items(value) if isinstance(value, str) and value else value or []
    ok = lambda t: isinstance(t, dict) and set(t) == {"role", "content"}
    if not isinstance(turns, (list, tuple)) or not all(
        ok(t) and all(isinstance(v, str) for v in t.values()) for t in turns
    ):
        raise ValueError(
            "give a list of {role, content} turns of text, e.g. in a YAML file: messages: [{role: "
            "user, content: Hi}]"
        )
    return turns


def _mesh_sizes(sizes):
    if sizes.count(-1) > 1 or any(s < 1 and s != -1 for s in sizes):
        raise ValueError("use positive sizes and at most one -1")
    return sizes


Number = BeforeValidator(_number)


INT_MAX = 2**31 - 1  # steps, counts and sizes reach jitted code as int32


# rates and decays too, as float32: 1e39 would be inf there
FLOAT_MAX = float(np.finfo(np.float32).max)


Count = Annotated[int, Number, Field(ge=1, le=INT_MAX)]  # at least one


Off = Annotated[int, Number, Field(ge=0, le=INT_MAX)]  # a count where 0 means off, none or all


Positive = Annotated[float, Number, Field(gt=0, le=FLOAT_MAX)]


NonNeg = Annotated[float, Number, Field(ge=0, le=FLOAT_MAX)]


Share = Annotated[float, Number, Field(ge=0, le=1)]  # a probability or fraction


Decay = Annotated[float, Number, Field(ge=0, lt=1)]  # a moving-average decay: 1 would never move


Names = Annotated[tuple[str, ...], BeforeValidator(_items)]


def _no_nul(text):
    if "\0" in text:  # no path, tokenizer or prompt holds one; the OS refuses it with a traceback
        raise ValueError("holds a NUL character (\\0); remove it")
    return text


Text = Annotated[str, AfterValidator(_no_nul)]


AxisRule = tuple[str, str | tuple[str, ...] | None]


class Slice(NamedTuple):
    """A TPU slice the fit check compiles for, as libtpu names it."""

    topology: str
    chips: str  # libtpu's chip config
    hbm: int  # bytes per JAX device


# A v2/v3 device is one core (half a chip); a TPU7x (Ironwood) device one of a chip's two dies
# (libtpu 0.0.51: 8 x 94.7 GiB per 2x2x1).
TPU_SLICES = {
    "v2-8": Slice("v2:2x2", "default", 8 * GiB),
    "v3-8": Slice("v3:2x2", "default", 16 * GiB),
    "v4-8": Slice("v4:2x2x1", "megacore", 32 * GiB),
    "v4-32": Slice("v4:2x2x4", "megacore", 32 * GiB),
    "v4-64": Slice("v4:2x4x4", "megacore", 32 * GiB),
    "v5e-1": Slice("v5e:1x1", "default", 16 * GiB),
    "v5e-8": Slice("v5e:2x4", "default", 16 * GiB),
    "v5p-8": Slice("v5p:2x2x1", "megacore", 95 * GiB),
    "v6e-1": Slice("v6e:1x1", "default", 32 * GiB),
    "v6e-8": Slice("v6e:2x4", "default", 32 * GiB),
    "tpu7x-8": Slice("tpu7x:2x2x1", "default", 96 * GiB),
}


class Keys(pydantic.BaseModel):
    """Frozen (nothing changes a config once loaded; resolve() makes a new one), strict about names.
    `_given`: the keys the user set beyond base.yml (later files, the command line), which a
    checkpoint's own may not contradict."""

    model_config = pydantic.ConfigDict(
        frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
    )
    _given: frozenset = pydantic.PrivateAttr(default=frozenset())


KINDS = {  # the kinds base.yml's keys name, [kind] in each one's comment
    "count": Count,
    "off": Off,
    "positive": Positive,
    "nonneg": NonNeg,
    "share": Share,
    "decay": Decay,
    "bool": bool,
    "text": Text,
    "day": Annotated[str, AfterValidator(_day)],
    "span": Annotated[tuple[Off, Off], BeforeValidator(_items)],
    "names": Names,
    "mesh": Annotated[tuple[int, ...], BeforeValidator(_items), AfterValidator(_mesh_sizes)],
    "counts": Annotated[tuple[Count, ...], BeforeValidator(_items)],
    "ramp": Annotated[
        tuple[tuple[Off, Count], ...], BeforeValidator(_ramp), AfterValidator(_rising)
    ],
    "turns": Annotated[tuple[dict[str, str], ...], BeforeValidator(_conversation)],
    "axis_rules": Annotated[tuple[AxisRule, ...], BeforeValidator(_items)],
    "targets": Annotated[
        tuple[Literal[model_lib.LORA_TARGETS], ...], BeforeValidator(_items), Field(min_length=1)
    ],
    "topology": Literal[("", *TPU_SLICES)],
    "task": Literal[tuple(model_lib.TASKS)],
}


def kind_type(kind):
    """A key's [kind] as its type: alternatives split by |, each a name in KINDS or a value allowed
    (none|llama3, count|auto), or 'int lo..hi' ('ints lo..hi': a list of those)."""
    if match := re.fullmatch(r"(ints?) (\d+)\.\.(\d+)", kind):
        one = Annotated[int, Number, Field(ge=int(match[2]), le=int(match[3]))]
        many = Annotated[tuple[one, ...], BeforeValidator(_items), Field(min_length=1)]
        return one if match[1] == "int" else many
    alternatives = kind.split("|")
    values = tuple(a for a in alternatives if a not in KINDS)
    if len(alternatives) == 1 and values:  # one value allowed is a kind mistyped
        raise TypeError(kind)
    types = [KINDS[a] if a in KINDS else Literal[values] for a in alternatives]
    types = list(dict.fromkeys(types))  # the values allowed: one Literal, where the first stood
    return functools.reduce(lambda x, y: x | y, types)


class Declared(NamedTuple):
    """One key as base.yml declares it: `key: default  # [kind] doc`."""

    kind: str
    doc: str
    line: int


DECLARATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.yml")


def declared(path=DECLARATIONS):
    """{key: Declared} of every key the file declares, a section's as section.key (trm.T); a line
    that sets a value without a [kind] and a doc is a ConfigError naming it."""
    keys, sections, last = {}, [], None
    with open(path) as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if last and (more := re.fullmatch(r" +#\s*(.*)", line)):  # the doc goes on, indented
            keys[last] = keys[last]._replace(doc=f"{keys[last].doc} {more[1]}")
            continue
        last = None
        if not (m := re.match(r"( *)([A-Za-z_]\w*):([^#]*)(?:#\s*(.*))?$", line)):
            continue  # a comment, a list's entry, a blank line
        sections = sections[: len(m[1]) // 2]
        tag = re.match(r"\[([^]]+)\]\s*(.*)", m[4] or "")
        if not tag and not m[3].strip():  # `lora:`, its keys indented below
            sections.append(m[2])
            continue
        key = ".".join([*sections, m[2]])
        if key in keys:
            raise ConfigError(f"{path}:{n}: {key} is declared twice (line {keys[key].line})")
        if not tag or not tag[2]:
            raise ConfigError(
                f"{path}:{n}: {key} needs its kind and doc: `{m[2]}: value  # [kind] what it does`"
            )
        keys[key] = Declared(tag[1], tag[2], n)
        last = key
    return keys


def make_schema(keys):
    """The config's pydantic model from {key: Declared}: a field per key, a nested model per
    section. A kind train.py does not know is a ConfigError naming the key."""
    fields = {}
    for key, d in keys.items():
        try:
            typ = kind_type(d.kind)
        except TypeError:
            raise ConfigError(f"{key}: kind [{d.kind}] names no type in train.KINDS") from None
        section, _, name = key.rpartition(".")
        fields.setdefault(section, {})[name] = (typ, ...)
    sections = {
        name: (pydantic.create_model(name, __base__=Keys, **f), ...)
        for name, f in fields.items()
        if name
    }
    return pydantic.create_model("Config", __base__=Keys, **fields.pop(""), **sections)


DECLARED = declared()
KEYS = list(DECLARED)
Config = make_schema(DECLARED)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML silently keeps the last of two equal keys; a config that sets a key twice is a
    mistake."""

    def construct_mapping(self, node, deep=False):
        keys = [(self.construct_object(k, deep=deep), k.start_mark.line + 1) for k, _ in node.value]
        for i, (key, line) in enumerate(keys):
            if key in [k for k, _ in keys[:i]]:
                raise ConfigError(
                    f"{node.start_mark.name}: key {key!r} is set twice (line {line}); keep one"
                )
        return super().construct_mapping(node, deep)


def read_yaml(path):
    try:
        with open(path) as f:
            raw = yaml.load(f, _UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: bytes that are not text
        raise ConfigError(
            f"{path} is not valid YAML: {first_line(e, typed=False, limit=None)}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected key: value lines at the top level, as in base.yml")
    return raw


def unknown_key(key, path):
    close = difflib.get_close_matches(key, KEYS, n=1)
    return f"unknown key {key!r}" + (
        f"; did you mean {close[0]}?" if close else f"; the keys are listed in {path}"
    )


def merge(into, new, path, prefix):
    """The keys of `new` (read from `path`) over `into`, section by section, each checked to be a
    key."""
    for name, value in new.items():
        if isinstance(name, str) and "." in name:  # `trm.T: 3` in a file is `trm:` then `T: 3`
            name, _, rest = name.partition(".")
            value = {rest: value}
        key = f"{prefix}{name}"
        if not any(k == key or k.startswith(f"{key}.") for k in KEYS):
            raise ConfigError(f"{path}: {unknown_key(key, path)}")
        section = any(k.startswith(f"{key}.") for k in KEYS)
        if section != isinstance(value, dict):
            raise ConfigError(
                f"{path}: {key} is "
                f"{'a section of keys, not a value' if section else 'a value, not a section'}"
            )
        if section:
            merge(into.setdefault(name, {}), value, path, f"{key}.")
        else:
            into[name] = value


BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
EXPECTED = {  # pydantic's error types -> what the key takes, in words
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "text",
    "model": "a section of keys",
    "dict": "a section of keys",
    "tuple": "a list",
    "list": "a list",
    "finite": "a finite number",
}


def schema_error(err, path, raw):
    """pydantic's first complaint as our one line: the key, its value as typed, what it must be."""
    parts = {k for key in KEYS for k in key.split(".")}
    names = [p for p in err["loc"] if isinstance(p, str) and p in parts]
    key = ".".join(names)
    kind = err["type"]
    ctx = err.get("ctx", {})
    in_list = len(names) < len(err["loc"])  # err['input'] is only the bad item of a list
    value = raw
    for name in names:  # the whole value of the key
        value = value.get(name) if isinstance(value, dict) else None
    # as typed, or as YAML wrote it
    printable = isinstance(value, str) and value.isprintable()
    shown = value if printable else json.dumps(value, default=str)
    if kind == "extra_forbidden":
        return unknown_key(key, path)
    if key == "logical_axis_rules":
        return (
            f"logical_axis_rules={shown}: give a list of [logical axis, mesh axis or list of them "
            "or null] pairs, e.g. [[batch, [data, fsdp]], [embed, fsdp]]"
        )
    if kind == "missing" and not in_list:
        return (
            f"{path}: key {key} is missing; list base.yml first to take it from there: train.py "
            f"base.yml {path}"
        )
    if kind == "literal_error":
        return f"{key}={value!r}: choose one of {ctx['expected'].replace(' or ', ', ')}"
    if kind in BOUNDS:
        bound = next(iter(ctx.values()))
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        return f"{key}={shown}: must be {BOUNDS[kind]} {bound}"
    if kind in ("missing", "too_long"):  # a list of fixed length
        entries = len(Config.model_fields[key].annotation.__args__)
        return f"{key}={shown}: expected {entries} entries"
    if kind == "value_error":
        return f"{key}={shown}: {ctx['error']}"
    what = next((v for k, v in EXPECTED.items() if kind.startswith(k)), kind)
    return f"{key}={shown}: expected {what}" + (" in each entry" if in_list else "")


def load_config(paths, overrides=()):
    """YAML files (base.yml, then yours; later keys win) + key=value pairs -> a checked Config."""
    # Each file and pair is checked by the one schema; a mistake is a ConfigError naming the key.
    raw = {}
    paths = [paths] if isinstance(paths, str) else paths
    given = set()
    for i, path in enumerate(paths):
        values = read_yaml(path)
        merge(raw, values, path, "")
        given |= set(data.flat(values)) if i else set()
    given_keys = [item.partition("=")[0] for item in overrides]
    for item, key in zip(overrides, given_keys):
        text = item.partition("=")[2]
        if "=" not in item:
            raise ConfigError(f"argument {item!r} is not key=value")
        if given_keys.count(key) > 1:
            raise ConfigError(f"{key} is given twice on the command line; keep one")
        try:
            text.encode()
        # Python keeps bytes that are not UTF-8 as surrogates: the tokenizer cannot
        except UnicodeEncodeError:
            raise ConfigError(
                f"{key}=: the value is not UTF-8 text; retype it, or set the terminal to UTF-8"
            ) from None
        if key not in KEYS:
            raise ConfigError(unknown_key(key, paths[-1]))
        merge(
            raw,
            functools.reduce(lambda value, name: {name: value}, reversed(key.split(".")), text),
            paths[-1],
            "",
        )
    return validated(raw, paths[-1], given | set(given_keys))


def validated(raw, path, given):
    """The Config of nested values, checked by the schema (errors name the key as `path` set it)."""
    try:
        cfg = Config.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(schema_error(e.errors()[0], path, raw)) from None
    cfg._given = frozenset(given)
    return cfg


def check(cfg, task, shaped=True):
    """The rules that tie keys together, the task's own, the paths: each names the key and fix.
    shaped=False: the model's shape is not known yet (load_hf's config.json decides it)."""
    rules = (shape_rules(cfg) if shaped else []) + run_rules(cfg) + [(True, task.check(cfg))]
    if message := next((says for broken, says in rules if broken and says), None):
        raise ConfigError(message)
    data.check_paths(cfg)


def shape_rules(cfg):
    """(broken, message) for the model's shape and the mesh's."""
    mesh, axes = ",".join(map(str, cfg.mesh)), ",".join(cfg.mesh_axes)
    unmapped = [
        (name, a)
        for name, to in cfg.logical_axis_rules
        for a in (to if isinstance(to, tuple) else [to])
        if a and a not in cfg.mesh_axes
    ] or [("", "")]
    return [
        (
            cfg.num_heads % cfg.num_kv_heads,
            f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}",
        ),
        (
            not cfg.head_dim and cfg.d_model % cfg.num_heads,
            (
                f"d_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}; change one, "
                "or set head_dim explicitly"
            ),
        ),
        (
            model_lib.dims(cfg) % 2,
            f"head dim {model_lib.dims(cfg)} must be even for RoPE; set head_dim",
        ),
        (
            cfg.lora.base_quant != "none"
            and any(n % cfg.lora.block for n in (model_lib.dims(cfg), cfg.d_model, cfg.mlp_dim))
            or cfg.lora.base_quant == "nf4"
            and cfg.lora.block % 2,
            (
                f"lora.block={cfg.lora.block}: must divide the last axis of every quantized weight "
                f"(head dim {model_lib.dims(cfg)}, d_model {cfg.d_model}, mlp_dim {cfg.mlp_dim})"
                " and be even for nf4 (two codes a byte)"
            ),
        ),
        (
            len(cfg.mesh) != len(cfg.mesh_axes),
            (
                f"mesh={mesh} has {len(cfg.mesh)} entries but mesh_axes={axes} names "
                f"{len(cfg.mesh_axes)}"
            ),
        ),
        (
            unmapped[0][1],
            (
                f"logical_axis_rules maps {unmapped[0][0]!r} to mesh axis {unmapped[0][1]!r}, "
                f"which mesh_axes={axes} does not name"
            ),
        ),
    ]


def run_rules(cfg):
    """(broken, message) for the run's keys: what it profiles, its batch, its start, its name."""
    first, last = cfg.profile_steps
    run_dir = os.path.join(cfg.output_dir, cfg.run_name)
    return [
        (
            (first, last) != (0, 0) and not 1 <= first <= last <= cfg.steps,
            (
                f"profile_steps={first},{last}: give two steps a,b with 1 <= a <= b <= "
                f"steps={cfg.steps} (0,0 = off)"
            ),
        ),
        (
            cfg.vocab_tile not in (0, "auto") and cfg.vocab_size % cfg.vocab_tile,
            f"vocab_tile={cfg.vocab_tile}: must divide vocab_size={cfg.vocab_size} (0 = off)",
        ),
        (
            cfg.per_device_batch == "auto" and not cfg.compile_topology,
            (
                "per_device_batch=auto is the fit check's search: give compile_topology=SLICE, or "
                "a number to train"
            ),
        ),
        (cfg.load_params and cfg.load_hf, "load_params and load_hf are both set; keep one"),
        (
            cfg.lora.rank and cfg.load_params,
            (
                f"lora.rank={cfg.lora.rank} with load_params: LoRA's frozen base comes from "
                "load_hf (a Hugging Face checkpoint: mode=export of that run makes one)"
            ),
        ),
        (
            cfg.lora.base_quant != "none" and (not cfg.lora.rank or cfg.task != "lm"),
            (
                f"lora.base_quant={cfg.lora.base_quant} quantizes the frozen base of a language "
                "model's LoRA: set lora.rank (and task=lm), or lora.base_quant=none"
            ),
        ),
        (
            cfg.load_adapter and not cfg.load_hf,
            (
                f"load_adapter={cfg.load_adapter}: an adapter goes on the model it was trained on; "
                "set load_hf= to that model"
            ),
        ),
        (
            cfg.hf_eval_files and cfg.hf_eval_split,
            (
                f"hf_eval_files={cfg.hf_eval_files} and hf_eval_split={cfg.hf_eval_split} both "
                "name the held-out rows; keep one"
            ),
        ),
        (
            cfg.epochs and cfg.batch_ramp,
            (
                f"epochs={cfg.epochs} counts steps at grad_accum={cfg.grad_accum} but batch_ramp "
                "changes it: give steps= instead of epochs, or drop batch_ramp"
            ),
        ),
        (
            cfg.epochs and "steps" in cfg._given,
            (
                f"steps={cfg.steps} and epochs={cfg.epochs} are both set: epochs sets steps from "
                "the size of the data; keep one"
            ),
        ),
        (
            not cfg.run_name
            or os.sep in cfg.run_name
            or cfg.run_name in (".", "..")
            or not cfg.run_name.isprintable(),
            (
                f"run_name={cfg.run_name!r}: give a plain directory name, printable, no / (the run "
                "goes to output_dir/run_name)"
            ),
        ),
        (
            cfg.export_dir and inside(cfg.export_dir, run_dir),
            (
                f"export_dir={cfg.export_dir}: inside the run's checkpoints, where an export would "
                f"land in a saved step; give a directory outside {run_dir}/checkpoints"
            ),
        ),
    ]


def inside(path, run_dir):
    """Whether `path` is run_dir/checkpoints or under it (links and .. resolved; gs:// as text)."""
    resolve = lambda p: os.path.realpath(p) if not data.remote(p) else p.rstrip("/")
    return (resolve(path) + "/").startswith(resolve(f"{run_dir}/checkpoints") + "/")


def with_values(cfg, values, unfit="{error}"):
    """cfg with {key or section.key: value} set, checked by the schema again; a value out of its
    bounds is the line `unfit` makes of cfg and the schema's error."""
    raw = cfg.model_dump()
    for key, value in values.items():
        *sections, name = key.split(".")
        functools.reduce(lambda tree, s: tree[s], sections, raw)[name] = value
    try:
        return validated(raw, "", cfg._given)
    except ConfigError as e:
        raise ConfigError(unfit.format(cfg=cfg, error=e)) from None


def pretrained(cfg):
    """cfg with the keys of what it loads (model.py's Hugging Face section reads them): load_hf's
    config.json sets the model's shape, load_adapter's adapter_config.json the lora keys."""
    if cfg.load_hf:
        cfg = with_values(cfg, model_lib.checkpoint_keys(cfg), model_lib.UNHOLDABLE)
    if cfg.load_adapter:
        cfg = with_values(cfg, model_lib.adapter_keys(cfg))
    return cfg


def fine_tuning_advice(cfg):
    """A load_hf run training at base.yml's learning rate (a pretraining recipe): one warning."""
    if cfg.mode == "train" and "learning_rate" not in cfg._given:
        log(
            f"WARNING: load_hf={cfg.load_hf} trains at learning_rate={cfg.learning_rate:g}, "
            "base.yml's rate for pretraining from scratch, which wrecks a pretrained model within "
            "steps; fine-tuning runs at ~2e-5 (the README's fine-tuning command: "
            "learning_rate=2e-5)"
        )


def run_day(cfg):
    """The date chat templates render (chat_date): the one in RUN_DIR/config.yml, written by the run
    this one resumes or evaluates, else today."""
    run_dir = os.path.join(cfg.output_dir, cfg.run_name)
    try:
        kept = (
            data.run_config(run_dir).get("chat_date") if cfg.resume or cfg.mode != "train" else ""
        )
    except (data.DataError, *data.STORAGE_ERRORS):
        kept = ""  # a damaged config.yml is set aside later, and the run goes on
    return kept or time.strftime("%Y-%m-%d")


def cpu_has_bf16():
    """Whether this CPU has bf16 instructions: avx512_bf16 or amx_bf16 in /proc/cpuinfo's flags."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve(cfg, task, platform, device_kind=""):
    """The config as run: dtype=auto made concrete (bfloat16 on TPU, GPU and CPUs with bf16
    instructions, float32 on other CPUs, where XLA:CPU's bf16 step is slower), attention=auto
    (splash on TPU chips whose compiler takes the Pallas kernel, v4 on; XLA's on v2 and v3, whose
    Mosaic refuses its bf16 matmuls; cuDNN's on GPU; einsum on CPU), vocab_tile=auto (4096 on TPU,
    off elsewhere), and the values the task decides (the puzzle vocabulary and length). Computed
    once; config.yml records the result."""
    fixed = data.fixed_by(task.dataset)
    old_tpu = device_kind.startswith(("TPU v2", "TPU v3"))
    chip = device_kind or platform
    if cfg.dtype == "auto":
        bf16 = platform != "cpu" or cpu_has_bf16()
        fixed["dtype"] = "bfloat16" if bf16 else "float32"
        log(
            f"dtype=auto: {fixed['dtype']} on {platform}"
            + ("" if bf16 else " (a CPU without bf16 instructions)")
        )
    if cfg.attention == "auto":
        fixed["attention"] = {"tpu": "xla" if old_tpu else "splash", "gpu": "cudnn"}.get(
            platform, "einsum"
        )
        log(f"attention=auto: {fixed['attention']} on {chip}")
    # on TPU the memory it frees buys batch; XLA:CPU runs the recompute slower
    if cfg.vocab_tile == "auto":
        fixed["vocab_tile"] = 4096 if platform == "tpu" and cfg.vocab_size % 4096 == 0 else 0
    attention = fixed.get("attention", cfg.attention)
    if attention == "splash" and (platform != "tpu" or old_tpu):
        raise ConfigError(
            f"attention=splash: the Pallas kernel runs on TPU v4 and later, not on {chip}; use "
            "attention=auto"
        )
    if attention == "splash" and not model_lib.splash_block(cfg.max_target_length):
        raise ConfigError(
            f"attention=splash: max_target_length={cfg.max_target_length} is not a multiple of the "
            "kernel's 128-token blocks (nor 512 or less); use a multiple of 128, or attention=xla"
        )
    if attention == "cudnn" and platform != "gpu":
        raise ConfigError(
            f"attention=cudnn: cuDNN's kernel runs on NVIDIA GPUs, not on {chip}; use "
            "attention=auto"
        )
    return cfg.model_copy(update=fixed)


def as_run(cfg, task, devices=None):
    """(the config as this run uses it, its devices): checked, concrete, alike on every host."""
    # The rules checked; load_hf's model keys from its config.json, the rules again on them; the
    # compilation cache on; the devices (for compile_topology, the TPU slice's, described by
    # libtpu); the auto values made concrete for them; and every host started alike.
    check(cfg, task, shaped=not cfg.load_hf)
    if cfg.load_hf:  # the model's shape from its config.json (and a peft adapter's lora keys)
        check(cfg := pretrained(cfg), task)
        fine_tuning_advice(cfg)
    if not cfg.chat_date:  # process 0's day, or the day the run being resumed rendered its rows
        cfg = with_values(cfg, {"chat_date": agree(run_day(cfg), cfg.host_timeout)[0]})
    # before the first compile; every program is cached, however quick to compile
    if cfg.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(data.stored(cfg.compile_cache_dir)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    devices = tpu_slice(cfg) if cfg.compile_topology else devices or jax.devices()
    check_slices(cfg, devices)
    cfg = resolve(cfg, task, devices[0].platform, devices[0].device_kind)
    local = ("cache_dir", "data_dir", "compile_cache_dir")  # these may name each host's own disk
    shared = {k: v for k, v in data.flat(cfg.model_dump(mode="json")).items() if k not in local}
    same_everywhere(shared, "start every host with the same command", cfg.host_timeout)
    return cfg, devices


# ==================================================================================================
# Platforms and hosts (Part 2). Failures: a platform JAX cannot start, distributed variables that do
# not add up, hosts started with other keys or other data (a collective across them would hang, or
# train them apart): one line each. Shown by
# tests/test_errors.py::test_a_platform_jax_cannot_start_is_one_line,
# test_hardware.py::test_bad_distributed_env_is_one_line_error,
# test_hosts.py::test_hosts_started_differently_*. The hosts compare what must match through JAX's
# coordination service (its key-value store, no devices).
# ==================================================================================================


def pci_vendors():
    """The PCI vendor ids of this host's devices (Linux sysfs): what accelerators it has, without
    starting any of them. Google 0x1ae0 = TPU chips, NVIDIA 0x10de, AMD 0x1002."""
    return {open(path).read().strip() for path in glob.glob("/sys/bus/pci/devices/*/vendor")}


def start_platforms():
    """An installed libtpu (tests/requirements.txt brings it, for the TPU fit check) loads itself
    into every JAX process and prints five lines of errors on a host without TPU chips. There,
    unless the user chose platforms (JAX_PLATFORMS), JAX starts only what the host has: a GPU whose
    JAX plugin is installed, and the CPU. The fit check loads libtpu itself."""
    vendors = pci_vendors()
    if jax.config.jax_platforms or "0x1ae0" in vendors:
        return
    plugins = [m.name for m in pkgutil.iter_modules()]
    gpus = [
        name
        for name, vendor in (("cuda", "0x10de"), ("rocm", "0x1002"))
        if vendor in vendors and any(p.startswith(f"jax_{name}") for p in plugins)
    ]
    jax.config.update("jax_platforms", ",".join(gpus + ["cpu"]))


def check_backends():
    """JAX starts the platforms JAX_PLATFORMS names, or fails deep inside (RuntimeError, or a bare
    AssertionError for a GPU whose plugin is missing): one line instead."""
    try:
        jax.devices()
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ConfigError(
            f"JAX_PLATFORMS={jax.config.jax_platforms}: JAX cannot start it on this host "
            f"({first_line(e)}); name platforms this host has (cpu, gpu with jax[cuda], tpu on a "
            "TPU VM), or unset it"
        ) from None


DISTRIBUTED = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_INDEX")


def several_processes():
    """Whether this process is one of several: JAX_* variables, or a cluster JAX finds by itself
    (SLURM with several tasks, a Cloud TPU VM, which JAX asks for its slice's hosts)."""
    slurm = "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    return any(os.environ.get(n) for n in DISTRIBUTED) or slurm or "0x1ae0" in pci_vendors()


def init_distributed(cfg):
    """Join a multi-process JAX system before any device is touched, every host waiting host_timeout
    seconds for the others (to join, and later for a silent host's heartbeat). Explicit JAX_*
    variables win, checked first (JAX answers a bad one with a traceback, or waits for a coordinator
    that never comes)."""
    given = [n for n in DISTRIBUTED if os.environ.get(n)]
    if given and len(given) < len(DISTRIBUTED):
        missing = ", ".join(n for n in DISTRIBUTED if n not in given)
        raise ConfigError(
            f"{', '.join(given)} set but {missing} not: set all three for a multi-process run, or "
            "none"
        )
    address, count, index = (os.environ.get(n, "") for n in DISTRIBUTED)
    if given and not (count.isdigit() and index.isdigit() and int(index) < int(count)):
        raise ConfigError(
            f"JAX_PROCESS_INDEX={index}: must be 0..N-1 for JAX_PROCESS_COUNT={count}"
        )
    if given and not address.rpartition(":")[2].isdigit():
        raise ConfigError(
            f"JAX_COORDINATOR_ADDRESS={address}: give host:port of process 0 (e.g. 10.0.0.1:8476)"
        )
    if several_processes():
        jax.distributed.initialize(
            *(address, int(count), int(index)) if given else (),
            heartbeat_timeout_seconds=cfg.host_timeout,
            initialization_timeout=cfg.host_timeout,
        )
        data.MAIN = jax.process_index() == 0


@contextlib.contextmanager
def started(cfg):
    """This process ready to run; then a SIGTERM or SIGINT is answered by a checkpoint."""
    # Library noise off stderr, the platforms this host has, a multi-process system joined, JAX's
    # backends up; then, until the run's last save, a signal is noted and answered
    # (preemption_signals). Yields the Signals.
    data.quiet_libraries()
    start_platforms()
    init_distributed(cfg)
    check_backends()
    with preemption_signals() as caught:
        yield caught


def check_slices(cfg, devices):
    """num_slices and dcn_mesh against the devices: the slices they are in (processes off TPU), and
    slices that divide each mesh axis."""
    n, known = len(devices), math.prod(cfg.mesh)
    shape = [n // -known if s == -1 and n % known == 0 else s for s in cfg.mesh]
    if math.prod(shape) != n or -1 in shape:  # the mesh does not fit the devices: make_mesh says so
        return
    dcn, tpu = slices_per_axis(cfg, len(shape)), devices[0].platform == "tpu"
    found = len({getattr(d, "slice_index", 0) if tpu else d.process_index for d in devices})
    if found != cfg.num_slices and (tpu or cfg.num_slices > 1):
        raise ConfigError(
            f"num_slices={cfg.num_slices}: the devices are in {found} slice(s) (processes off "
            f"TPU); set it to {found}"
        )
    if (
        len(dcn) != len(shape)
        or math.prod(dcn) != cfg.num_slices
        or any(s % d for s, d in zip(shape, dcn))
    ):
        raise ConfigError(
            f"dcn_mesh={','.join(map(str, dcn))}: give the slices of each axis of "
            f"mesh={','.join(map(str, shape))} ({','.join(cfg.mesh_axes)}), {cfg.num_slices} in "
            f"all, each a divisor of its axis; e.g. mesh={cfg.num_slices},-1,1"
        )


def coordination():
    """The client of the coordination service that jax.distributed.initialize started. JAX has no
    public handle on its key-value store (multihost_utils exchanges arrays through a collective,
    which would hang on a lost host), so this is the one place a private module (jax._src) is used.
    """
    from jax._src.distributed import global_state

    return global_state.client


# every process agrees on the same topics in the same order, so their keys match
AGREED = itertools.count()


def agree(mine, timeout_s):
    """Every process's `mine` (JSON), in process order: also where the hosts wait for each other."""
    # Through the coordination service that jax.distributed.initialize started (no devices, no
    # collective).
    if jax.process_count() == 1:
        return [mine]
    topic, client = f"train/agree/{next(AGREED)}", coordination()
    client.key_value_set(f"{topic}/{jax.process_index()}", json.dumps(mine))
    return [
        json.loads(client.blocking_key_value_get(f"{topic}/{k}", timeout_s * 1000))
        for k in range(jax.process_count())
    ]


def same_everywhere(values, fix, timeout_s):
    """Stops every host, each with the same one line, when a process's values ({name: value}) differ
    from process 0's: the first such process and the names that differ, with both values."""
    every = agree(values, timeout_s)
    for k, theirs in enumerate(every):
        if differ := [
            name for name in {**every[0], **theirs} if theirs.get(name) != every[0].get(name)
        ]:
            shown = ", ".join(
                f"{n} ({every[0].get(n)} on process 0, {theirs.get(n)} on process {k})"
                for n in differ[:4]
            )
            raise ConfigError(
                f"process {k} of {len(every)} was started differently from process 0: {shown}; "
                f"{fix}"
            )


def preflight(cfg, task, ds, built):
    """Checks before the run (or one line); to train, the FLOPs its MFU needs (step_flops)."""
    # The data alike on every host and the model's, the state within host memory. Before anything
    # is allocated: a host reading other data would train apart; a vocabulary other than the
    # model's would index past it; the steps epochs= made stay within the schema's bounds; on CPU
    # the train state's shards on this host's devices must fit its free memory.
    same_everywhere({"data": ds.identity}, "give every host the same data", cfg.host_timeout)
    if ds.vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"vocab_size={cfg.vocab_size}: the data has {ds.vocab_size} tokens; set "
            f"vocab_size={ds.vocab_size}"
        )
    if cfg.epochs:
        with_values(cfg, {"steps": cfg.steps})
    arrays = jax.tree.leaves(built.layout.abstract)
    if next(iter(arrays[0].sharding.device_set)).platform == "cpu":
        shard = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        need = sum(shard(x) * len(x.sharding.addressable_devices) for x in arrays)
        fits_host(need, "the train state", "train a smaller model")
    if cfg.mode == "generate" or cfg.eval_answers:
        cache_fits(cfg, list(built.mesh.devices.flat))
    return step_flops(cfg, task, list(built.mesh.devices.flat)) if cfg.mode == "train" else None


PEAK_BF16_FLOPS = {  # per JAX device (a v2/v3 device is one core = half a chip)
    "TPU v2": 22.5e12,
    "TPU v3": 61.5e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 1153.5e12,  # a die
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
}


@functools.lru_cache  # once per process: the machine's peak does not change between runs in it
def device_peak_flops(dtype, device):
    """bf16 peak from the table; on CPU measured now, in the compute dtype on all cores: the best of
    two matmul shapes, each warmed and then timed eight times (0.1 s; larger squares ran no faster
    on 2 cores). A busy machine still reads low, which `rates` corrects when the step itself runs
    faster."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops, f"{device.device_kind} spec sheet"
    dt = jnp.dtype(dtype)
    f = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    best = 0.0
    for n in (512, 1024):
        a = jax.device_put(jnp.ones((n, n), dt), device)
        f(a).block_until_ready()
        for _ in range(8):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best, f"best {dt.name} matmul of 512^2 and 1024^2 on {device.device_kind}"


def step_flops(cfg, task, devices):
    """FLOPs per token, and the device peak that MFU is measured against."""
    # On CPU the simulated devices share one processor, so the peak measured there is the whole
    # machine's.
    peak, source = device_peak_flops(cfg.dtype, devices[0])
    log(f"peak: {peak / 1e12:.3f} TFLOP/s per device ({source})")
    return {
        "per_token": task.flops_per_token(cfg),
        "devices": len(devices),
        "peak_per_device": peak,
        "peak_source": source,
        "peak": peak if devices[0].platform == "cpu" else peak * len(devices),
    }


# ==================================================================================================
# The run directory (Part 2). Failures: two runs training in one directory, hosts that do not share
# it (each would hold part of the checkpoints): one line. Shown by tests/test_checkpoint.py::
# test_two_runs_on_one_run_directory, test_a_run_holds_its_directory_whatever_form_its_path_takes.
# ==================================================================================================


def hold(run_dir, cfg):
    """Process 0 takes the run directory's lock (data.own); every host then checks that it reads
    back what process 0 wrote there: a run directory on each host's own disk would split the run's
    checkpoints between them."""
    lock, holder = data.own(run_dir, log)
    if holder := agree(holder, cfg.host_timeout)[0]:
        raise ConfigError(
            f"{run_dir} is in use by {holder}: wait for that run to end, or choose another run_name"
        )
    if jax.process_count() > 1:  # what process 0 writes there, every host must read back
        data.write(marker := os.path.join(run_dir, ".hosts"), data.holder_line())
        agree("", cfg.host_timeout)  # written before anyone reads it
        same_everywhere(
            {
                marker: data.stored(marker).read_text()
                if data.stored(marker).exists()
                else "no such file"
            },
            "give every host one shared output_dir (a shared disk, or a gs:// bucket)",
            cfg.host_timeout,
        )
    return lock


@contextlib.contextmanager
def run_directory(cfg):
    """output_dir/run_name for the block: made, writable, shared by every host, held by one run."""
    # A local path or gs://. In mode=train this run owns it (one run trains in a run directory at a
    # time); data.prepare_training moves an earlier run's checkpoints and metrics aside under
    # resume=false.
    run_dir = os.path.join(cfg.output_dir, cfg.run_name)
    data.make_run_dir(cfg, run_dir, log)
    lock = hold(run_dir, cfg) if cfg.mode == "train" else None
    key = run_dir if data.remote(run_dir) else os.path.abspath(run_dir)
    try:
        if cfg.mode == "train":
            data.prepare_training(cfg, run_dir, log, lambda: agree("", cfg.host_timeout))
        data.HELD[key] = data.held(run_dir, lock)
        yield run_dir
    finally:
        data.HELD.pop(key, None)
        if lock:
            lock.close()


# ==================================================================================================
# Damaged checkpoints and changed configs (Part 2). Failures: a checkpoint truncated or garbled (on
# one host or all), one written by another config, a non-finite loss: the damaged step skipped and
# set aside, never deleted; the change named. Shown by
# tests/test_checkpoint.py::test_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes,
# test_a_changed_model_on_resume_is_named_not_damage, test_a_nonfinite_step_names_the_checkpoint_*,
# test_hosts.py::test_a_checkpoint_only_one_host_cannot_read_is_damaged_for_all.
# ==================================================================================================


class Damaged(Exception):
    """A checkpoint step that cannot be read back: truncated, garbled or missing files, bad
    metadata."""


def shape_mismatch(mngr, step, target, part):
    """'' or, for a checkpoint of another config, the first array of another shape; or Damaged."""
    # Read from the metadata before any array is (orbax would fail deep inside). optax's state comes
    # back as tuples, whose keys are indices.
    name = lambda k: str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    shapes = lambda tree: {
        tuple(map(name, p)): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    try:
        saved, want = shapes(mngr.item_metadata(step)["train_state"]), shapes(target)
    except Exception as e:  # noqa: BLE001 - orbax: ValueError, KeyError, tensorstore errors ...
        raise Damaged(f"its metadata is unreadable: {first_line(e)}") from None
    if not any(path[0] == "params" for path in saved):
        raise Damaged("its metadata lists no parameters")
    paths = set(want) | (set(saved) if not part else set())
    for path in sorted(paths, key=lambda p: (p[0] != "params", p)):
        if saved.get(path) != want.get(path):
            there, here = saved.get(path, "none"), want.get(path, "none")
            return f"{'/'.join(path)} is {there} there but {here} here"
    return ""


def read_step(mngr, step, abstract, part):
    """(state or its `part`, every lane's data state, '' or how its config differs), or Damaged."""
    target = {part: abstract[part]} if part else abstract
    if mismatch := shape_mismatch(mngr, step, target, part):
        return None, None, mismatch
    # With `part`, that subtree alone: another run's optimizer may differ.
    restore = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=bool(part),
    )
    reads = {"train_state": (ocp.PyTreeCheckpointHandler, restore)}
    if not part:
        reads["data_state"] = (ocp.StandardCheckpointHandler, ocp.args.StandardRestore())
    # Item by item, not mngr.restore: that ends waiting for every host, and a host that failed would
    # never come.
    try:
        got = {
            item: handler().restore(data.stored(mngr.directory) / str(step) / item, args=args)
            for item, (handler, args) in reads.items()
        }
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise bare Exception for bad data
        raise Damaged(first_line(e)) from None
    if part:
        return got["train_state"][part], None, ""
    lanes, source = got["data_state"].get("lanes"), got["data_state"].get("source")
    if lanes is None or source is None:  # not a position this trainer wrote
        data_state = {"lanes": [], "source": "a data state without per-row positions"}
    else:
        rows = [json.loads(row.tobytes().decode().strip()) for row in lanes]
        data_state = {"lanes": rows, "source": source.tobytes().decode()}
    return got["train_state"], data_state, ""


class Restored(NamedTuple):
    """A checkpoint step read back by restore_checkpoint."""

    step: int
    state: Any  # the train state, or its `part`
    data_state: Any  # every lane's data position ({'lanes', 'source'}); None with a `part`


def restore_checkpoint(mngr, abstract, cfg, steps=None, part=None, move_aside=False):
    """The newest checkpoint step every host can read, as Restored, or None."""
    # The hosts decide together, step by step: a step any of them cannot read is damaged for all,
    # reported in one line and skipped for the one before it (with move_aside, the run's own
    # checkpoints, renamed STEP.damaged-TIME once a readable one is found, never deleted, so the
    # next save of that step has room). `part` ('params', 'ema') reads that subtree alone. A
    # checkpoint of another config is not damage: it stops the run with what differs.
    damaged = []
    for step in sorted(steps or mngr.all_steps(), reverse=True):
        try:
            state, data_state, mismatch = read_step(mngr, step, abstract, part)
            why = ""
        except Damaged as e:
            mismatch, why = "", str(e)
        if mismatch:
            changed = data.config_changes(os.path.dirname(mngr.directory), cfg)
            raise ConfigError(
                f"checkpoint {mngr.directory}/{step} was written by another config: {mismatch}"
                + (f"; changed since: {', '.join(changed[:6])}" if changed else "")
                + "; use the keys of the run that wrote it, or a new run_name / resume=false"
            )
        if any(reasons := agree(why, cfg.host_timeout)):
            k, why = next((k, r) for k, r in enumerate(reasons) if r)
            where = f"on process {k}: " if k else ""
            log(
                f"WARNING: checkpoint {mngr.directory}/{step} is damaged ({where}{why}); trying "
                "the one before it"
            )
            damaged.append(step)
            continue
        if move_aside and damaged:
            moved = [
                data.set_aside(os.path.join(mngr.directory, str(bad)), "damaged")
                for bad in damaged
                if data.MAIN
            ]
            log(f"moved the damaged step(s) aside: {', '.join(moved)}")
            agree("", cfg.host_timeout)  # the others wait for the renames
            mngr.reload()
        return Restored(step, state, data_state)
    return None


def stop_nonfinite(e, mngr, cfg):
    """A non-finite step k: the parameters of step k - 1 produced it, so the checkpoint to go on
    from comes before k - 1, and one of k - 1 is set aside (renamed, never deleted) so that a rerun
    resumes from there."""
    step, what = e.args
    wait_for_saves(mngr)
    bad = [s for s in mngr.all_steps() if s >= step - 1]
    for s in bad if jax.process_index() == 0 else ():
        data.set_aside(os.path.join(mngr.directory, str(s)), "nonfinite")
    agree("", cfg.host_timeout)  # the others wait for the renames
    good = [s for s in mngr.all_steps() if s < step - 1]
    where = (
        f"the newest checkpoint before it is step {good[-1]}"
        + (f" (step {bad[0]} set aside)" if bad else "")
        if good
        else "no checkpoint comes before it"
    )
    return FloatingPointError(
        f"{what} at step {step}: stopped; {where}; lower learning_rate (or raise warmup_steps) and "
        f"rerun to {'resume from there' if good else 'start over'}"
    )


# ==================================================================================================
# Stalls, signals and lost hosts (Part 2). Failures: a preemption (SIGTERM) or Ctrl-C, a run that
# stopped moving, a host that died or never joined, any user mistake reaching main: a checkpoint
# where there is something to save, one line, an exit code. Shown by
# tests/test_checkpoint.py::test_interrupted_run_resumes_exactly, test_a_second_sigterm_*,
# test_hosts.py::test_a_host_killed_mid_run_*, test_a_stalled_host_is_named_with_its_stacks,
# test_hosts_that_never_all_join_end_in_one_line_within_host_timeout.
# ==================================================================================================


RERUN = "checkpoints already committed are intact; rerun the command on every host to resume"


def say(line):
    """One line on stderr; a terminal that went away (SIGHUP) must not turn it into a traceback."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def quit_now(line, code):
    """One line and exit now, not through JAX's shutdown (it would wait for a lost host)."""
    say(line)
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    os._exit(code)


def stop_lost_host(e, seconds=3):
    """A collective failed: a host is gone (its process ended, its network went). The survivors
    answer a roll call in the coordination service for a few seconds and whoever did not is named;
    no service at all means its host, process 0, is gone."""
    try:
        client = coordination()
        client.key_value_set(f"train/alive/{jax.process_index()}", "")
        time.sleep(seconds)
        alive = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get("train/alive/")}
        lost = [str(k) for k in range(jax.process_count()) if k not in alive] or ["unknown"]
    except Exception:  # noqa: BLE001 - the coordination service went with process 0
        lost = ["0"]
    quit_now(
        f"error: lost process {', '.join(lost)} of {jax.process_count()} ({first_line(e)}); "
        f"{RERUN}",
        74,
    )


@contextlib.contextmanager
def preemption_signals():
    """SIGTERM (preemption, schedulers), SIGINT and SIGHUP (the terminal closed), from the start of
    the run to its last committed save. Before the loop a signal ends the run at once; in the loop
    it is noted, not obeyed: the loop finishes the step, checkpoints and exits, and a repeated
    signal during that save is noted too. With several processes a signal reaching one host must
    stop them all at the same step: JAX's preemption sync point listens for SIGTERM, so SIGINT and
    SIGHUP are passed on to it as one (and SIGUSR1, the supervisor's word that a SIGTERM came,
    only wakes)."""
    caught = Signals()

    # before the loop nothing is new: it ends now, whatever it was in (no exception to unwind)
    def note(signum, _):
        if not caught.saving:
            quit_now(
                f"stopped: {signal.Signals(signum).name} before the first step: nothing new to "
                "save; rerun the same command to go on",
                75,
            )
        caught.names.append(signal.Signals(signum).name)

    to_sync_point = lambda signum, _: os.kill(os.getpid(), signal.SIGTERM)
    several = {signal.SIGINT: to_sync_point, signal.SIGHUP: to_sync_point}
    wanted = (
        {**several, signal.SIGUSR1: lambda *_: None}
        if jax.process_count() > 1
        else {signal.SIGTERM: note, signal.SIGINT: note, signal.SIGHUP: note}
    )
    old = {sig: signal.signal(sig, handler) for sig, handler in wanted.items()}
    try:
        yield caught
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class Watchdog(threading.Thread):
    """Ends a run that stopped moving. The loop beats for every step it reads back (and every eval
    batch and checkpoint); no beat for stall_seconds (auto: 10 minutes + 10 x (the compile + a
    typical step)), or none within a few steps of a signal (its handler cannot run while the main
    thread waits in a hung collective): every thread's stack goes into RUN_DIR/stacks-pK.txt, one
    line names the step and the file, exit 74."""

    def __init__(self, cfg, run_dir, compile_seconds):
        super().__init__(daemon=True)
        # the stacks go to a local file
        local = tempfile.gettempdir() if data.remote(run_dir) else run_dir
        self.path, self.done = (
            os.path.join(local, f"stacks-p{jax.process_index()}.txt"),
            threading.Event(),
        )
        # A pipe the signal machinery writes a byte to at once, even while the main thread waits
        # inside a step, where no Python handler runs (set from the main thread).
        self.wakeup, self.write_end = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self.write_end, False)
        self.old_wakeup = signal.set_wakeup_fd(self.write_end, warn_on_full_buffer=False)
        self.fixed, self.compile_seconds = cfg.stall_seconds, compile_seconds
        self.step = 0
        self.at = time.monotonic()
        self.typical = 0.0
        self.signalled = None

    def beat(self, step=None, seconds=None):
        self.at, self.step = time.monotonic(), self.step if step is None else step
        self.typical = self.typical if seconds is None else 0.9 * self.typical + 0.1 * seconds

    def run(self):
        while self.fixed != 0 and not self.done.wait(1):  # stall_seconds=0: off
            with contextlib.suppress(BlockingIOError):
                self.signalled = self.signalled or (os.read(self.wakeup, 64) and time.monotonic())
            bound = (
                600 + 10 * (self.compile_seconds + self.typical)
                if self.fixed == "auto"
                else self.fixed
            )
            # a signal waits for the step
            quiet, grace = (
                time.monotonic() - self.at,
                max(10.0, 3 * self.typical),
            )
            if quiet > bound:
                self.fire(f"no step finished in {quiet:.0f}s (stall_seconds={bound:.0f})")
            if self.signalled and time.monotonic() - max(self.signalled, self.at) > grace:
                self.fire(f"a signal went unanswered for {grace:.0f}s")

    def stop(self):
        self.done.set()
        self.join()
        signal.set_wakeup_fd(self.old_wakeup)
        os.close(self.wakeup)
        os.close(self.write_end)

    def fire(self, why):
        with open(self.path, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        quit_now(
            f"error: stalled after step {self.step}: {why}; every thread's stack is in "
            f"{self.path}; {RERUN}",
            74,
        )


@contextlib.contextmanager
def guard(cfg, job, compile_seconds):
    """Around the loop: the watchdog, a lost host, a non-finite loss; signals answered from here."""
    # The Watchdog ends a run that stopped moving (job.beat is its heartbeat); a failed collective
    # names the lost host (stop_lost_host); a non-finite loss names the checkpoint to go on from
    # (stop_nonfinite).
    job.caught.saving = True
    watchdog = Watchdog(cfg, job.dir, compile_seconds)
    watchdog.start()
    job.beat = watchdog.beat
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() > 1:  # now, before the cleanup after the loop waits for a lost host
            stop_lost_host(e)
        raise
    except NonFinite as e:
        raise stop_nonfinite(e, job.mngr, cfg) from None
    finally:
        watchdog.stop()


class OneLineErrors(contextlib.AbstractContextManager):
    """main's last word: what a user can fix ends as one line on stderr and an exit `code`."""

    # A mistake in the config, unreadable data, a refused write, a failing disk or bucket, a non-
    # finite loss or a preemption; a host lost outside the loop as stop_lost_host's line. Anything
    # else is a bug, and keeps its traceback.

    code = 0

    def __exit__(self, kind, e, traceback):
        if isinstance(e, data.STORAGE_ERRORS):  # where no message names the key: still one line
            where = f" at {e.filename}" if getattr(e, "filename", None) else ""
            say(f"error: storage failed{where}: {data.storage_reason(e)}; {KEPT}")
            self.code = 74
            return True
        if isinstance(
            e, (ConfigError, data.DataError, FloatingPointError, data.WriteError, Preempted)
        ):
            said = "stopped" if isinstance(e, Preempted) else "error"
            say(f"{said}: {e}")
            # 3: the loss went non-finite; 74 (EX_IOERR): the run directory refused a write; 75
            # (EX_TEMPFAIL): preempted with a checkpoint, schedulers requeue on it
            self.code = {FloatingPointError: 3, data.WriteError: 74, Preempted: 75}.get(type(e), 2)
            return True
        if isinstance(e, jax.errors.JaxRuntimeError) and jax.distributed.is_initialized():
            stop_lost_host(e)
        return False


# Set by the supervisor for its child: where C++ libraries' stderr goes.
NATIVE_LOG = "TRAIN_NATIVE_LOG"


def supervise(argv):
    """A process of a multi-host run trains in a child process. When a host is lost, or the hosts
    never all join, JAX's distributed runtime (C++) ends the others with an abort and a page of log;
    this parent turns such an end into one line naming the cause (exit 74), keeps C++ log lines off
    the terminal (in a file it names, removed when empty), and passes SIGTERM, SIGINT and SIGHUP on
    (SIGTERM with a SIGUSR1 beside it: the child's watchdog hears of it at once)."""
    path = os.path.join(tempfile.gettempdir(), f"train-{os.getpid()}.log")
    # A kill -9 of this process ends the child too (Linux's PR_SET_PDEATHSIG, set in the child
    # before it runs Python: no thread of ours exists there yet).
    die_with_parent = lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    child = subprocess.Popen(
        [sys.executable, *argv],
        env={**os.environ, NATIVE_LOG: path},
        preexec_fn=die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
    )

    def forward(signum, _):
        for sig in (signum, signal.SIGUSR1) if signum == signal.SIGTERM else (signum,):
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    if (code := child.wait()) >= 0:
        if os.path.exists(path) and os.path.getsize(path) == 0:
            os.remove(path)  # the C++ libraries wrote nothing: leave no empty file per run
        return code
    # passed on before the child listened for it
    if -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        say(f"stopped: {signal.Signals(-code).name} before the first step: nothing new to save")
        return 75
    with open(path, errors="replace") as f:
        native = f.read()
    lost = re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d, ]*\d)", native)
    address, count = (
        os.environ.get("JAX_COORDINATOR_ADDRESS", "the coordinator"),
        os.environ.get("JAX_PROCESS_COUNT", "?"),
    )
    causes = [
        (
            "RegisterTask" in native,
            (
                f"the {count} processes did not all join at {address} within host_timeout (a host "
                "missing or the coordinator unreachable, or two with one JAX_PROCESS_INDEX)"
            ),
        ),
        (
            lost,
            f"lost process {lost and lost.group(1)} of {count} (no heartbeat within host_timeout)",
        ),
        ("PollForError" in native, f"lost process 0 of {count}, the coordinator at {address}"),
    ]
    cause = next((says for seen, says in causes if seen), f"ended by {signal.Signals(-code).name}")
    say(f"error: {cause}; {RERUN} (JAX's log: {path})")
    return 74


def command_line(argv):
    """python train.py ...: a process of a multi-host run trains in a child that supervise()
    watches; that child sends C++ libraries' stderr to the supervisor's log file and keeps Python's
    on the terminal. A single process runs main() itself."""
    if several_processes() and not os.environ.get(NATIVE_LOG):
        return supervise(argv)
    if os.environ.get(NATIVE_LOG):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the loop listens for it
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
        os.dup2(os.open(os.environ[NATIVE_LOG], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    return main(argv)


# ==================================================================================================
# Goodput (Part 2). Failure: a long run that cannot say where its hours went, what its preemptions,
# restarts and checkpoints cost. Every second of a run belongs to one kind, measured by its own
# clock; every metrics row, TensorBoard, W&B and the last lines give the shares. Shown by
# tests/test_train.py::test_goodput_shares_are_measured_and_add_up and test_checkpoint.py's kill -9
# and resume (the steps redone).
# ==================================================================================================


class Goodput:
    """Where the run's wall time went: each second since t0 in one kind, the shares adding to 1."""

    # Every second since `t0` (main() began) belongs to the kind set last: startup (platforms, data,
    # restore), compile (the step, ahead of its first call), data (waiting for the next batch),
    # checkpoint (a save's blocking part), eval, redone (steps done before a stop that lost them) or
    # step (productive). A kind timed inside another pauses it.

    def __init__(self, t0):
        self.kind = "startup"
        self.since = t0
        self.spent = dict.fromkeys(("startup", "compile", "data", "checkpoint", "eval"), 0.0)
        self.spent.update(redone=0.0, step=0.0)

    def now(self, kind):
        """From now on the time is `kind`'s; returns the kind it was."""
        t = time.perf_counter()
        self.spent[self.kind] += t - self.since
        before = self.kind
        self.kind = kind
        self.since = t
        return before

    @contextlib.contextmanager
    def timing(self, kind):
        before = self.now(kind)
        try:
            yield
        finally:
            self.now(before)

    def shares(self):
        """goodput (the steps' share of the wall time), badput_KIND for the others, wall_seconds."""
        self.now(self.kind)
        wall = max(sum(self.spent.values()), 1e-9)
        bad = {f"badput_{k}": v / wall for k, v in self.spent.items() if k != "step"}
        return {"goodput": self.spent["step"] / wall, **bad, "wall_seconds": wall}

    def line(self):
        """The breakdown as the run's last lines print it."""
        s = self.shares()
        bad = ", ".join(f"{k[7:]} {v:.1%}" for k, v in s.items() if k.startswith("badput_"))
        return f"goodput: {s['goodput']:.1%} of {s['wall_seconds']:.1f}s in steps; badput: {bad}"


# ==================================================================================================
# Memory (Part 2). Failures: a run past the host's memory (XLA:CPU waits without a word or dies in a
# traceback), a preset that would not fit its TPU slice: stopped before anything is allocated, with
# what to lower. Shown by
# tests/test_errors.py::test_a_run_past_the_hosts_memory_stops_before_it_allocates,
# test_hardware.py::test_readme_preset_fits_its_tpu_slice, test_per_device_batch_auto_bisects_*.
# ==================================================================================================


def abstract_batch(feed):
    """The step's [A, B, L] batch as shapes only: to compile ahead of time, nothing read."""
    shape = (feed.accum, feed.rows, feed.length)
    return {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=feed.step_sharding)
        for k, dtype in feed.fields.items()
    }


def compile_step(train_step, state, feed):
    """Compile the step for this state and an [A, B, L] batch ahead of its first call (which then
    reuses the program). Returns (seconds, the compiler's memory analysis: its per-device figures
    are the truth for every task, where a hand estimate would know only a language model's
    arithmetic)."""
    t0 = time.perf_counter()
    m = train_step.lower(state, abstract_batch(feed)).compile()
    return time.perf_counter() - t0, m.memory_analysis()


def compiled_line(m):
    """(the compiler's memory_analysis() per device as a log line, total bytes). Donated state
    buffers are reused for the new state (alias), so they count once."""
    need = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return (
        (
            "compiled per device: arguments (params + optimizer state + batch) "
            f"{gb(m.argument_size_in_bytes)}, temporaries {gb(m.temp_size_in_bytes)}, outputs "
            f"{gb(m.output_size_in_bytes)} ({gb(m.alias_size_in_bytes)} reusing donated arguments) "
            f"= {gb(need)}"
        ),
        need,
    )


def compile_ahead(cfg, built, state):
    """The step compiled before its first call: (seconds, bytes per device or None)."""
    # Once for each microbatch count the run will still use (batch_ramp): none compiles mid-run.
    # Every host leaves the compile together (a collective's first run, Gloo on CPU, waits only 30 s
    # for the others); on CPU the compiled step must fit the host's free memory.
    start = int(state["step"])
    counts = {accum_at(cfg, s) for s in [start, *(s for s, _ in cfg.batch_ramp if s > start)]}
    seconds = 0.0
    for accum in sorted(counts):
        feed = dataclasses.replace(built.feed, accum=accum)
        took, m = compile_step(built.train_step, state, feed)
        seconds += took
    agree("", cfg.host_timeout)
    line, need = compiled_line(m) if m else ("", None)
    counted = f" for {len(counts)} microbatch counts" if len(counts) > 1 else ""
    log(f"step compiled{counted} in {seconds:.1f}s; {line}")
    if need and jax.local_devices()[0].platform == "cpu":
        fits_host(
            need * jax.local_device_count(), "the step", "lower per_device_batch, or remat=full"
        )
    return seconds, need


def fits_host(need, what, fix):
    """On CPU the devices' memory is the host's. Past what the host has, XLA:CPU either waits
    without a word or dies in an out-of-memory traceback: a run that cannot fit stops before it
    allocates, saying what to lower."""
    with (
        open("/proc/meminfo")
        if os.path.exists("/proc/meminfo")
        else contextlib.nullcontext([]) as f
    ):
        avail = next(
            (int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None
        )
    if avail is not None and need > avail:
        raise ConfigError(
            f"{what} needs {gb(need)} of host memory on CPU and {gb(avail)} is free: {fix}"
        )


def cache_fits(cfg, devices):
    """mode=generate, eval_answers: the KV cache of the prompts and max_new_tokens fits, or one
    line (a huge max_new_tokens allocated GiBs, then died)."""
    rows = 1 if cfg.mode == "generate" else min(cfg.eval_answers, 16)  # model.lm_answers' batch
    positions = cfg.max_target_length + cfg.max_new_tokens  # a longer prompt is skipped or warned
    per_row = 2 * cfg.num_layers * cfg.num_kv_heads * model_lib.dims(cfg) * positions
    # XLA's peak holds about 3 float32 caches (the scan's carry in and out, and the update), in
    # bfloat16 too: measured on CPU, 37.2 GB for max_new_tokens=10^8 (d_model=64, num_layers=1)
    need = 3 * rows * per_row * 4
    what = f"max_new_tokens={cfg.max_new_tokens}: the KV cache of {positions:,} positions"
    if devices[0].platform == "cpu":
        fits_host(need, what, "lower max_new_tokens")
    elif need > (limit := (devices[0].memory_stats() or {}).get("bytes_limit", math.inf)):
        raise ConfigError(
            f"{what} needs {gb(need)} and a {devices[0].device_kind} has {gb(limit)}: lower "
            "max_new_tokens"
        )


def tpu_slice(cfg):
    """compile_topology=v4-64: that slice's devices as libtpu describes them, on any machine (no TPU
    needed)."""
    topology, chips, hbm = TPU_SLICES[cfg.compile_topology]
    if topology.startswith("tpu7x") and tuple(map(int, jax.__version__.split(".")[:2])) < (0, 12):
        raise ConfigError(
            f"compile_topology={cfg.compile_topology}: TPU7x needs the current JAX and libtpu "
            "0.0.51 (Python 3.12: pip install -r requirements.txt -r tests/requirements.txt "
            f"there); the libtpu of jax {jax.__version__} aborts compiling its programs"
        )
    for name, value in (
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_ACCELERATOR_TYPE", cfg.compile_topology.replace("v5e", "v5litepod")),
    ):
        # no chip to find: two checks may run at once, and libtpu says nothing
        os.environ.setdefault(name, value)
    try:
        from jax.experimental import topologies

        one_chip = {"chips_per_host_bounds": (1, 1, 1)} if topology.endswith(":1x1") else {}
        devices = topologies.get_topology_desc(
            topology_name=topology,
            platform="tpu",
            chip_config_name=chips,
            num_slices=cfg.num_slices,
            **one_chip,  # one chip: its host holds only it (the default host bounds refuse 1x1)
        ).devices
    except Exception as e:  # noqa: BLE001 - no libtpu, an older one, or another process holding it
        raise ConfigError(
            f"compile_topology={cfg.compile_topology}: libtpu cannot describe the slice: "
            f"{first_line(e, typed=False, limit=200)} (pip install -r tests/requirements.txt "
            "brings libtpu)"
        ) from None
    log(
        f"AOT compile for {cfg.num_slices} x {cfg.compile_topology}: {len(devices)} x "
        f"{devices[0].device_kind}, {gb(hbm)} each"
    )
    return devices


def fit_memory(cfg, task, devices):
    """Compile the real train step of cfg for the slice's devices: (bytes per device or None where
    the compiler refuses it as too large, the compiler's figures, the log line). Nothing runs, no
    data is read."""
    built = build(cfg, task, devices)
    try:
        with jax.set_mesh(built.mesh), nnx.logical_axis_rules(cfg.logical_axis_rules):
            seconds, m = compile_step(built.train_step, built.layout.abstract, built.feed)
    # the TPU compiler itself refuses a program over its HBM
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None, None, f"compiler: {first_line(e, typed=False, limit=300)}"
    line, need = compiled_line(m)
    return (
        need,
        {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "temp", "output", "alias")},
        f"compiled in {seconds:.1f}s; {line}",
    )


def fit_check(cfg, task, devices):
    """compile_topology=SLICE: does the step fit the slice's HBM? With what to change when it does
    not."""
    hbm = TPU_SLICES[cfg.compile_topology].hbm
    need, memory, line = fit_memory(cfg, task, devices)
    fits = need is not None and need <= hbm
    log(f"{line} of {gb(hbm)} HBM: {'fits' if fits else 'does not fit'}")
    if not fits:
        log(
            "to fit: per_device_batch=auto finds the largest batch that does; or remat=full, more "
            "fsdp, a larger slice"
        )
    return {"fits": fits, "bytes_per_device": need, "hbm_bytes": hbm, "memory": memory}


def fit_search(cfg, task, devices):
    """compile_topology=SLICE per_device_batch=auto: the largest per-device microbatch that fits in
    90% of the HBM, grad_accum being the examples per device per update (split into grad_accum / b
    microbatches of b), then the least recompute that still fits at that size. Bisection over the
    divisors, one compile each, every result printed; ends with the command line to run."""
    total, hbm = cfg.grad_accum, TPU_SLICES[cfg.compile_topology].hbm

    def fits(b, remat):
        trial = {"per_device_batch": b, "grad_accum": total // b, "remat": remat}
        need, _, _ = fit_memory(cfg.model_copy(update=trial), task, devices)
        ok = need is not None and need <= 0.9 * hbm
        log(
            f"  per_device_batch={b} grad_accum={total // b} remat={remat}: "
            f"{gb(need) if need else 'over the HBM'} -> {'fits' if ok else 'no'}"
        )
        return ok

    sizes = [b for b in range(1, total + 1) if total % b == 0]
    # sizes[:lo] fit with remat=full (the least memory); find the last that does
    lo = 0
    hi = len(sizes) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid], "full"):
            lo = mid + 1
        else:
            hi = mid - 1
    if not lo:
        log(
            "nothing fits, even one example per device with remat=full: more fsdp, a smaller model "
            "or a larger slice"
        )
        return {"fits": False}
    b = sizes[lo - 1]
    remat = next(r for r in ("none", "save_dots", "full") if r == "full" or fits(b, r))
    found = [f"per_device_batch={b}", f"grad_accum={total // b}", f"remat={remat}"]
    kept = [
        a
        for a in sys.argv[1:]
        if a.partition("=")[0]
        not in ("per_device_batch", "grad_accum", "remat", "compile_topology")
    ]
    log(
        f"largest that fits: {' '.join(found)}\nrun on the slice: python train.py "
        f"{' '.join(kept + found)}"
    )
    return {"fits": True, "per_device_batch": b, "grad_accum": total // b, "remat": remat}


def fit_tpu(cfg, task, devices):
    """compile_topology=SLICE: fit_search for per_device_batch=auto, else fit_check."""
    # A program compiled for a topology (no TPU client) is one the persistent compilation cache
    # cannot load back (jax warns and compiles it again): none is written, which spares the write.
    cached = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
    try:
        return (fit_search if cfg.per_device_batch == "auto" else fit_check)(cfg, task, devices)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cached)


if __name__ == "__main__":
    sys.exit(command_line(sys.argv))
