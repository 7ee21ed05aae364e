"""A Llama-style GQA transformer in Flax NNX, two puzzle heads on it, and the tasks train.py trains.

Its sections, in reading order (an LM reader can stop after the Task interface):
  Transformer    token ids -> logits; exactly Llama's math (rotate-half RoPE, RMSNorm with eps
                 inside the rsqrt, SwiGLU, no biases), so the weights export to Hugging Face's
                 LlamaForCausalLM. Its layers in order: RMSNorm, RoPE, Attention, SwiGLU (the MLP),
                 Block, Trunk, Transformer; then the loss (cross_entropy) and FLOPs.
  LM task        the language model's loss, eval and generation with a KV cache (lm_loss, generate).
  bf16 matmuls   dot, product, contract: the model's matmuls, each a plain jnp.einsum in float32,
                 written so that a bf16 step runs at bf16 speed on XLA:CPU.
  HF checkpoints Llama, Qwen2 and Qwen3 weights and config.json in and out (load_hf, save_hf).
  Task           the one interface train.py reads: a task's module, loss, extra train state, what
                 follows an update, evaluation and generation; LM is the language model's.
  TRM            Tiny Recursive Model: the trunk recursed over an answer state and a latent, with
                 deep supervision and a halting head (trm_loss is its training step's loss).
  ToT            a value head on the TRM's answer state, a step-level beam search over thoughts
                 (tree_search) and a complete depth-first one over legal moves (depth_first_search),
                 plus greedy decoding and the Sudoku scoring they are measured with.
  Sudoku task    the TRM's Task (SUDOKU). TASKS holds the language model ('lm') and the Sudoku
                 solver ('sudoku'); the puzzle sections can be skipped by an LM reader.

Modules are NNX; the trainer keeps no module objects. `init` splits a model into its graph
(structure and settings, static) and its parameters (a plain nested dict of arrays: what optax,
orbax and the HF export see); a loss merges them back, `nnx.merge(graph, params)(...)`, inside the
jitted step, so the step is a pure function of arrays. Parameters carry *logical* axis names only
('embed', 'heads', 'mlp', ...); train.py maps them to mesh axes with the one table
`logical_axis_rules` in base.yml, and nothing here knows the mesh. The puzzle heads read the Sudoku
rules and token layout from data.py.

Shape letters, for the whole repository (x_BLD is a [batch, length, d_model] array). They name array
axes only; the config keys trm.T and trm.n keep the TRM paper's names.
  B batch rows      L length           D d_model            H query heads        G kv heads
  K head dim        k K / 2 (rotary)   R H / G              Q stacked queries (R x L)
  T key length (the KV cache's, or the positions a RoPE table covers)           F mlp hidden
  V vocab           A microbatches     S supervision steps  P prompt length      O tokens generated
  N rows of a flat batch (grids; the LM loss's tokens)     C digit choices (9)  U Sudoku units (27)
  W beam width      E thoughts per state                    M states held between search steps
  J trajectories per puzzle (decoder=trm_parallel)          I vocabulary tiles, t entries each
"""

import collections
import functools
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import flax.core.spmd
import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors.numpy
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

import data
from data import MEMBERS, SUDOKU_LEN, dead_end, digits_seen, legal_digits, solved

first_line = data.first_line

# remat=full recomputes everything in the backward pass: least memory. save_dots keeps the
# projections' outputs (dot's results named 'dot'), in the compute dtype: a policy on the dot
# primitives themselves would keep their float32 sums, twice the bytes in a bf16 step.
REMAT_POLICIES = {"full": None, "save_dots": jax.checkpoint_policies.save_only_these_names("dot")}


# ==================================================================================================
# The transformer: layers, the LM, its loss and FLOPs. Its matmuls (dot, product) are the bf16
# matmul layer's, the section after the language-model task.
# ==================================================================================================
def dims(cfg):
    """Head width, derived once: explicit head_dim or d_model / num_heads."""
    return cfg.head_dim or cfg.d_model // cfg.num_heads


def param(rngs, shape, axes, std, dtype, fill=None):
    """A parameter drawn N(0, std) in `dtype` (or filled with `fill`), annotated with its
    logical axes. train.py places the whole state in one jit, so variables are not sharded one
    by one as they are made."""
    value = (
        jnp.full(shape, fill, dtype)
        if fill is not None
        else std * jax.random.normal(rngs.params(), shape, dtype)
    )
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def constrain(x, axes):
    """with_sharding_constraint by logical axis names, through the rules train.py installs with
    nnx.logical_axis_rules; a no-op where none are installed (tests calling the model bare)."""
    rules = dict(flax.core.spmd.get_logical_axis_rules())
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*map(rules.get, axes))) if rules else x


def dividing_spec(logical, shape, rules, mesh_shape):
    """A PartitionSpec for an array of `shape` with these logical axis names: each dimension takes
    the longest prefix of its rule's mesh axes (size-1 axes and axes used by an earlier dimension
    left out) that divides it, so odd sizes stay whole instead of failing. train.py places every
    array by it; the kernels here split their inputs by it."""
    used, out = set(), []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        axes = rules.get(name) or ()
        axes = [
            a
            for a in ((axes,) if isinstance(axes, str) else axes)
            if a not in used and mesh_shape[a] > 1
        ]
        while axes and size % math.prod(mesh_shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*out)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: d_model wide, or
    `size` (qk_norm: each head's K channels, Qwen3)."""

    def __init__(self, cfg, size=None, axis="embed"):
        wdt = jnp.dtype(cfg.weight_dtype)
        self.scale = param(None, (size or cfg.d_model,), (axis,), None, wdt, fill=1.0)
        self.eps, self.dtype = cfg.norm_eps, jnp.dtype(cfg.dtype)

    def __call__(self, x_BLD):
        x = x_BLD.astype(jnp.float32)  # statistics in float32 whatever the compute dtype
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x.astype(self.dtype) * self.scale[...].astype(self.dtype)


def rope_frequencies(cfg):
    """RoPE's K/2 inverse frequencies, theta^(-2i/K). rope_scaling.type=llama3 (Llama 3.1 to 3.3)
    stretches the long wavelengths for a longer context: a wavelength longer than original /
    low_freq_factor is divided by factor, one shorter than original / high_freq_factor kept, and
    those between interpolated (transformers' llama3 rule, so imported weights see the angles
    they were trained with)."""
    K, s = dims(cfg), cfg.rope_scaling
    inv_freq_k = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2, dtype=np.float32) / K)
    if s.type == "none":
        return inv_freq_k
    original = s.original_max_position_embeddings
    wavelength_k = 2 * np.pi / inv_freq_k
    stretched_k = np.where(
        wavelength_k > original / s.low_freq_factor, inv_freq_k / s.factor, inv_freq_k
    )
    smooth_k = (original / wavelength_k - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    between_k = (wavelength_k >= original / s.high_freq_factor) & (
        wavelength_k <= original / s.low_freq_factor
    )
    blended_k = (1 - smooth_k) * stretched_k / s.factor + smooth_k * stretched_k
    return np.where(between_k, blended_k, stretched_k).astype(np.float32)


def rope_table(positions_BL, cfg, num_positions):
    """(cos, sin) [B, L, 1, K/2] of the rotary angles (rotate-half convention, Hugging Face Llama),
    float32. Gathered from a table for positions 0..num_positions-1 made with numpy at trace time,
    once per forward for all layers: computed in the graph, XLA:CPU recomputes cos/sin inside every
    fusion that uses them (per head, layer and pass). A position past the table reads NaN
    (jnp.take's fill), never a wrong angle."""
    inv_freq_k = rope_frequencies(cfg)
    angles_Tk = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq_k
    return tuple(jnp.take(f(angles_Tk), positions_BL, axis=0)[:, :, None] for f in (np.cos, np.sin))


def rope(x_BLHK, rope_BL1k):
    """Rotary embedding of q or k with rope_table's (cos, sin), in float32: the halves x1, x2
    of the head dimension become x1 cos - x2 sin, x2 cos + x1 sin (HF's x cos + rotate_half(x)
    sin, the same products)."""
    (cos_BL1k, sin_BL1k), K = rope_BL1k, x_BLHK.shape[-1]
    x1, x2 = x_BLHK[..., : K // 2].astype(jnp.float32), x_BLHK[..., K // 2 :].astype(jnp.float32)
    return jnp.concatenate(
        [x1 * cos_BL1k - x2 * sin_BL1k, x2 * cos_BL1k + x1 * sin_BL1k], axis=-1
    ).astype(x_BLHK.dtype)


def kv_cache(cache, k_BLGK, v_BLGK, positions_BL, segment_ids_BL):
    """Generation: write this call's keys/values into the layer's [B, T, G, K] cache at their
    positions (all rows share positions) and let each query see every cached slot at or before its
    own position that holds its segment: prompts of several lengths are padded on the left with
    segment 0, which the real tokens (segment 1) never see. RoPE depends only on the distance
    between positions, so a padded prompt gives the logits it gives alone. A prompt fills many slots
    at once (prefill); a decode step fills one, so a new token costs one position. Returns the whole
    cache's keys, values, the mask, and the updated cache."""
    start = positions_BL[0, 0]
    k_BTGK = jax.lax.dynamic_update_slice(
        cache["k"], k_BLGK.astype(cache["k"].dtype), (0, start, 0, 0)
    )
    v_BTGK = jax.lax.dynamic_update_slice(
        cache["v"], v_BLGK.astype(cache["v"].dtype), (0, start, 0, 0)
    )
    seg_BT = jax.lax.dynamic_update_slice(cache["seg"], segment_ids_BL, (0, start))
    seen_BLT = jnp.arange(k_BTGK.shape[1])[None, None, :] <= positions_BL[:, :, None]
    mask_B1LT = (seen_BLT & (seg_BT[:, None, :] == segment_ids_BL[:, :, None]))[:, None]
    return k_BTGK, v_BTGK, mask_B1LT, {"k": k_BTGK, "v": v_BTGK, "seg": seg_BT}


def gqa_attention(q_BLHK, k_BTGK, v_BTGK, mask_B1LT, causal, dtype):
    """attention=einsum: jax.nn.dot_product_attention's math (float32 scores and softmax) in a
    layout XLA:CPU runs well. The R = H/G query heads sharing a kv head are stacked along the
    length, so each kv head is one [R*L, K] x [K, T] matmul; the dot_product_attention layout costs
    more fwd+bwd on CPU (transposed copies of the [B, H, L, T] scores)."""
    (B, L, H, K), (_, T, G, _) = q_BLHK.shape, k_BTGK.shape
    R = H // G
    q_BGQK = q_BLHK.reshape(B, L, G, R, K).transpose(0, 2, 3, 1, 4).reshape(B, G, R * L, K)
    # bf16 dots need a real copy
    move = jnp.transpose if jnp.dtype(dtype) == jnp.float32 else transposed
    k_BGTK, v_BGTK = move(k_BTGK, (0, 2, 1, 3)), move(v_BTGK, (0, 2, 1, 3))
    s_BGRLT = (
        product("bgqk,bgtk->bgqt", q_BGQK, k_BGTK, dtype, jnp.float32).reshape(B, G, R, L, T)
        * K**-0.5
    )
    if causal:
        mask_B1LT = mask_B1LT & (jnp.arange(L)[:, None] >= jnp.arange(T)[None, :])
    s_BGRLT = jnp.where(mask_B1LT[:, :, None], s_BGRLT, -0.7 * jnp.finfo(jnp.float32).max)
    p_BGQT = jax.nn.softmax(s_BGRLT, axis=-1).astype(dtype).reshape(B, G, R * L, T)
    o_BGQK = product("bgqt,bgtk->bgqk", p_BGQT, v_BGTK, dtype, dtype)
    return o_BGQK.reshape(B, G, R, L, K).transpose(0, 3, 1, 2, 4).reshape(B, L, H, K)


def splash_block(L):
    """The splash kernel's tile over a sequence of L tokens: the largest of 512, 256, 128
    that divides L, the whole length at toy sizes (up to 512); 0 where none fits
    (train.py refuses the config)."""
    return L if L <= 512 else next((b for b in (512, 256, 128) if L % b == 0), 0)


def splash_attention(q_BLHK, k_BTGK, v_BTGK, segment_ids_BL, causal, interpret=False):
    """attention=splash: the Pallas TPU flash-attention kernel that ships with JAX (splash
    attention). Scores are made block by block in on-chip memory, never the [B, H, L, T] array the
    einsum keeps for the backward pass. Each kv head serves its R query heads through the kernel's
    MQA form (vmapped over kv heads and batch, so k and v are never copied R times); packing's
    segment ids mask across documents. Under a mesh it runs per device (shard_map): batch split as
    the 'batch' rule says, heads as 'heads' and 'kv_heads'. interpret=True runs the kernel's
    reference interpreter on any backend (the numerics tests, on CPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    def local(q_BLHK, k_BTGK, v_BTGK, seg_BL):
        (B, L, H, K), G = q_BLHK.shape, k_BTGK.shape[2]
        # one tile for every block size the kernel takes
        sizes = splash.BlockSizes(*[splash_block(L)] * 8)
        head = masks.CausalMask((L, L)) if causal else masks.FullMask((L, L))
        kernel = splash.make_splash_mqa_single_device(
            masks.MultiHeadMask([head] * (H // G)), block_sizes=sizes, interpret=interpret
        )
        q_BGRLK = (q_BLHK * K**-0.5).reshape(B, L, G, H // G, K).transpose(0, 2, 3, 1, 4)
        # kernel(q_RLK, k_TK, v_TK, segment ids)
        o_BGRLK = jax.vmap(jax.vmap(kernel, in_axes=(0, 0, 0, None)))(
            q_BGRLK,
            k_BTGK.transpose(0, 2, 1, 3),
            v_BTGK.transpose(0, 2, 1, 3),
            splash.SegmentIds(seg_BL, seg_BL),
        )
        return o_BGRLK.transpose(0, 3, 1, 2, 4).reshape(B, L, H, K)

    rules, mesh = dict(flax.core.spmd.get_logical_axis_rules()), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(q_BLHK, k_BTGK, v_BTGK, segment_ids_BL)
    spec = lambda logical, x: dividing_spec(logical, x.shape, rules, dict(mesh.shape))
    q_spec, kv_spec = (
        spec(("batch", None, "heads"), q_BLHK),
        spec(("batch", None, "kv_heads"), k_BTGK),
    )
    # heads and kv heads must split alike, or the groups break apart: keep both whole
    if q_spec[2] != kv_spec[2]:
        q_spec, kv_spec = (PartitionSpec(s[0], None, None, None) for s in (q_spec, kv_spec))
    return jax.shard_map(
        local,
        in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[0], None)),
        out_specs=q_spec,
        check_vma=False,
    )(q_BLHK, k_BTGK, v_BTGK, segment_ids_BL)


class Attention(nnx.Module):
    """GQA attention. Two options cover the families load_hf reads: qkv_bias (Qwen2: biases on the
    q, k and v projections) and qk_norm (Qwen3: an RMSNorm over each head's q and k before RoPE)."""

    def __init__(self, cfg, rngs):
        D = cfg.d_model
        H = cfg.num_heads
        G = cfg.num_kv_heads
        K = dims(cfg)
        wdt = jnp.dtype(cfg.weight_dtype)
        self.cfg = cfg
        self.wq = param(rngs, (D, H, K), ("embed", "heads", "head_dim"), D**-0.5, wdt)
        self.wk = param(rngs, (D, G, K), ("embed", "kv_heads", "head_dim"), D**-0.5, wdt)
        self.wv = param(rngs, (D, G, K), ("embed", "kv_heads", "head_dim"), D**-0.5, wdt)
        self.wo = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), (H * K) ** -0.5, wdt)
        if cfg.qkv_bias:
            self.bq = param(None, (H, K), ("heads", "head_dim"), None, wdt, fill=0.0)
            self.bk = param(None, (G, K), ("kv_heads", "head_dim"), None, wdt, fill=0.0)
            self.bv = param(None, (G, K), ("kv_heads", "head_dim"), None, wdt, fill=0.0)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, K, "head_dim")
            self.k_norm = RMSNorm(cfg, K, "head_dim")
        add_adapters(self, cfg, rngs)  # LoRA, where lora.rank > 0

    def project(self, x_BLD, rope_BL1k, key=None):
        """q, k (normed where qk_norm, then rotated) and v, in the compute dtype."""
        dt = jnp.dtype(self.cfg.dtype)
        q_BLHK = projected(self, "wq", "bld,dhk->blhk", x_BLD, dt, key)
        k_BLGK = projected(self, "wk", "bld,dgk->blgk", x_BLD, dt, key)
        v_BLGK = projected(self, "wv", "bld,dgk->blgk", x_BLD, dt, key)
        if self.cfg.qkv_bias:
            q_BLHK = q_BLHK + self.bq[...].astype(dt)
            k_BLGK = k_BLGK + self.bk[...].astype(dt)
            v_BLGK = v_BLGK + self.bv[...].astype(dt)
        if self.cfg.qk_norm:
            q_BLHK, k_BLGK = self.q_norm(q_BLHK), self.k_norm(k_BLGK)
        return rope(q_BLHK, rope_BL1k), rope(k_BLGK, rope_BL1k), v_BLGK

    def __call__(
        self, x_BLD, positions_BL, rope_BL1k, segment_ids_BL, causal, cache=None, key=None
    ):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD, rope_BL1k, key)
        # Tokens attend only within their own packed document (segment); padding is segment 0.
        mask_B1LL = (segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :])[:, None]
        if cache is not None:  # generation (train.generate): the cache mask holds causality
            (k_BLGK, v_BLGK, mask_B1LL, cache), causal = (
                kv_cache(cache, k_BLGK, v_BLGK, positions_BL, segment_ids_BL),
                False,
            )
        # a decode step has one query: no kernel needed
        if cfg.attention == "einsum" or cache is not None:
            out_BLHK = gqa_attention(q_BLHK, k_BLGK, v_BLGK, mask_B1LL, causal, dt)
        elif cfg.attention == "splash":
            out_BLHK = splash_attention(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, causal)
        else:  # GQA: dot_product_attention shares each kv head across H/G query heads itself.
            out_BLHK = jax.nn.dot_product_attention(
                q_BLHK,
                k_BLGK,
                v_BLGK,
                mask=mask_B1LL,
                is_causal=causal,
                implementation=cfg.attention,
            )
        return projected(self, "wo", "blhk,hkd->bld", out_BLHK, dt, key), cache


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down over the last axis of x (width D, hidden F). The blocks' MLP
    runs it over d_model; TRM's token mixer (trm.mixer=mlp) over the L positions instead of
    attention. Under remat=full it runs on gcd(mlp_chunks, L) slices of axis 1 in turn, each
    recomputed alone in the backward pass: the [rows, F] buffers there (gate, up, their gradients)
    that many times smaller, the FLOPs unchanged (the layer's own recompute of the forward pass
    drops the MLP, whose output it does not need)."""

    def __init__(self, cfg, D, F, axis, rngs):
        wdt, self.dtype = jnp.dtype(cfg.weight_dtype), jnp.dtype(cfg.dtype)
        self.chunks = cfg.mlp_chunks if cfg.remat == "full" else 1
        self.w_gate, self.w_up = (
            param(rngs, (D, F), (axis, "mlp"), D**-0.5, wdt) for _ in range(2)
        )
        self.w_down = param(rngs, (F, D), ("mlp", axis), F**-0.5, wdt)
        add_adapters(self, cfg, rngs)  # LoRA, where lora.rank > 0

    def __call__(self, x_BLD, key=None):
        (B, L, D), n = x_BLD.shape, math.gcd(self.chunks, x_BLD.shape[1])
        if n == 1:
            return self.mlp(x_BLD, key)
        keys = None if key is None else jax.random.split(key, n)  # LoRA's dropout, per slice
        x_nBlD = x_BLD.reshape(B, n, L // n, D).swapaxes(0, 1)
        y_nBlD = jax.lax.map(lambda xs: jax.checkpoint(self.mlp)(*xs), (x_nBlD, keys))
        return y_nBlD.swapaxes(0, 1).reshape(B, L, -1)

    def mlp(self, x_BLD, key=None):
        gate_BLF = projected(self, "w_gate", "bld,df->blf", x_BLD, self.dtype, key)
        up_BLF = projected(self, "w_up", "bld,df->blf", x_BLD, self.dtype, key)
        h_BLF = jax.nn.silu(gate_BLF) * up_BLF
        return projected(self, "w_down", "blf,fd->bld", h_BLF, self.dtype, key)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). mixer='mlp' (fixed-length
    puzzles only: `length` positions) swaps attention for a SwiGLU across the positions
    (TRM-MLP): for a fixed-size grid the mixing pattern can be learned outright, which the TRM
    paper found best on Sudoku."""

    def __init__(self, cfg, rngs, causal=True, mixer="attention", length=None):
        self.causal = causal
        self.attn_norm = RMSNorm(cfg)
        self.mlp_norm = RMSNorm(cfg)
        if mixer == "mlp":  # hidden width L x mlp_dim / d_model: the channel MLP's expansion
            self.token_mlp = SwiGLU(
                cfg, length, length * cfg.mlp_dim // cfg.d_model, "length", rngs
            )
        else:
            self.attn = Attention(cfg, rngs)
        self.mlp = SwiGLU(cfg, cfg.d_model, cfg.mlp_dim, "embed", rngs)

    def __call__(self, x_BLD, positions_BL, rope_BL1k, segment_ids_BL, cache=None, key=None):
        x_BLD = constrain(x_BLD, ("batch", "length", None))
        # mixing over L, as the last axis: XLA:CPU's dot has no bf16 x bf16
        if hasattr(self, "token_mlp"):
            # -> f32 kernel for contracting the middle axis
            h_BLD = jnp.swapaxes(self.token_mlp(jnp.swapaxes(self.attn_norm(x_BLD), 1, 2)), 1, 2)
        else:
            h_BLD, cache = self.attn(
                self.attn_norm(x_BLD),
                positions_BL,
                rope_BL1k,
                segment_ids_BL,
                self.causal,
                cache,
                None if key is None else jax.random.fold_in(key, 0),
            )
        x_BLD = x_BLD + h_BLD
        x_BLD = x_BLD + self.mlp(
            self.mlp_norm(x_BLD), None if key is None else jax.random.fold_in(key, 1)
        )
        return constrain(x_BLD, ("batch", "length", None)), cache


class Trunk(nnx.Module):
    """The stack of blocks. scan_layers: one Block whose parameters are stacked on a leading
    'layers' axis (made by nnx.vmap), run by jax.lax.scan: one compiled layer, whatever the
    depth. Otherwise a list of blocks, unrolled. remat wraps each layer in jax.checkpoint
    with the chosen policy."""

    def __init__(self, cfg, rngs, causal=True, mixer="attention", length=None):
        self.cfg = cfg
        make = lambda rngs: Block(cfg, rngs, causal, mixer, length)
        if cfg.scan_layers:
            stacked = nnx.vmap(
                make, in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"}
            )
            self.layers = nnx.split_rngs(splits=cfg.num_layers)(stacked)(rngs)
        else:
            self.layers = nnx.List([make(rngs) for _ in range(cfg.num_layers)])

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, cache=None, key=None):
        # positions are below the length / cache
        P = x_BLD.shape[1] if cache is None else cache["k"].shape[2]
        rope_BL1k = rope_table(positions_BL, self.cfg, P)
        keys = None if key is None else jax.random.split(key, self.cfg.num_layers)  # LoRA dropout

        # blocks are pytrees: jax transforms take them as arguments
        layer = lambda x_BLD, block, cache, key: block(
            x_BLD, positions_BL, rope_BL1k, segment_ids_BL, cache, key
        )
        if self.cfg.remat != "none":
            layer = jax.checkpoint(
                layer, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=not self.cfg.scan_layers
            )
        # the cache (if any) is stacked like the parameters: scanned along with them
        if self.cfg.scan_layers:
            xs = (self.layers, cache, keys)
            return jax.lax.scan(lambda x_BLD, xs: layer(x_BLD, *xs), x_BLD, xs)
        caches = []
        for i, block in enumerate(self.layers):
            at = lambda tree, i=i: jax.tree.map(lambda a: a[i], tree)
            x_BLD, c = layer(x_BLD, block, at(cache), at(keys))
            caches.append(c)
        return x_BLD, (None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *caches))


class Transformer(nnx.Module):
    """Token ids -> logits over the vocabulary (compute dtype); with a KV cache (generation),
    (logits, cache); logits=False: the final hidden states, for a loss that applies the head itself
    (tiled_cross_entropy)."""

    def __init__(self, cfg, rngs):
        D = cfg.d_model
        V = cfg.vocab_size
        wdt = jnp.dtype(cfg.weight_dtype)
        self.cfg = cfg
        self.embed = param(rngs, (V, D), ("vocab", "embed"), 1.0, wdt)
        self.trunk, self.final_norm = Trunk(cfg, rngs), RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (D, V), ("embed", "vocab"), D**-0.5, wdt)

    def __call__(self, tokens_BL, positions_BL, segment_ids_BL, cache=None, logits=True, key=None):
        dt = jnp.dtype(self.cfg.dtype)
        # Gather from a whole (all-gathered) table: a gather whose table is sharded over
        # vocab and embed while its indices are sharded over batch makes XLA replicate
        # everything anyway, less cleanly.
        x_BLD = jnp.take(constrain(self.embed[...], (None, None)), tokens_BL, axis=0).astype(dt)
        x_BLD = constrain(x_BLD, ("batch", "length", None))
        x_BLD, new_cache = self.trunk(x_BLD, positions_BL, segment_ids_BL, cache, key)
        x_BLD = self.final_norm(x_BLD)
        if not logits:
            return x_BLD
        # Logits in the compute dtype, summed in float32;
        # cross_entropy takes their softmax in float32.
        head, spec = self.head()
        logits_BLV = product(f"bld,{spec}->blv", x_BLD, head, dt, dt)
        return logits_BLV if cache is None else (logits_BLV, new_cache)

    def head(self):
        """(the LM head, its axes): lm_head [D, V] ('dv'), or, tied, the embedding [V, D] itself
        ('vd'), contracted over its last axis. Not its transpose: XLA:CPU's bf16 backward dot cannot
        read a transposed layout (UNIMPLEMENTED: DotThunk BF16 x BF16 = F32)."""
        if self.cfg.tie_embeddings:
            return self.embed[...], "vd"
        return self.lm_head[...], "dv"


def cross_entropy(logits_NV, targets_N):
    """Per-row cross-entropy of logits in the compute dtype (batch axes allowed) against integer
    targets, summed in float32. The max and the target's logit are read from the logits as they are
    (exact in any dtype), so each float32 use is fused into its own pass: no float32 copy of the
    [rows, V] logits is ever stored, forward or backward (optax's loss on float32 logits kept two
    such buffers: 3.3 GiB a device at the 0.9B preset on v4-8)."""
    top_N = jax.lax.stop_gradient(jnp.max(logits_NV, axis=-1).astype(jnp.float32))
    lse_N = top_N + jnp.log(
        jnp.sum(jnp.exp(logits_NV.astype(jnp.float32) - top_N[..., None]), axis=-1)
    )
    return lse_N - jnp.take_along_axis(logits_NV, targets_N[..., None], axis=-1)[..., 0].astype(
        jnp.float32
    )


def tiled_cross_entropy(x_ND, head, targets_N, tile, dtype):
    """Per-row cross-entropy of the logits of x and the LM head (Transformer.head: its weights and
    axes, 'dv' or 'vd') against targets, `tile` vocabulary entries at a time: a running log-sum-exp
    over the tiles, and the target's logit taken from the tile that holds it. The [N, V] float32
    logits never exist whole; the backward pass recomputes each tile's (jax.checkpoint) instead of
    keeping them. Equal to the untiled loss up to float32 rounding."""
    (w, spec), (N, D) = head, x_ND.shape
    V = w.shape[spec.index("v")]
    # I tiles of t vocabulary entries: [I, D, t] or, tied, [I, t, D]
    if spec == "dv":
        w_I = w.reshape(D, V // tile, tile).transpose(1, 0, 2)
    else:
        w_I = w.reshape(V // tile, tile, D)
    tile_eq = f"nd,{spec.replace('v', 't')}->nt"

    @jax.checkpoint
    def one(carry, xs):
        (top_N, total_N, target_N), (w_tile, i) = carry, xs
        logits_Nt = product(tile_eq, x_ND, w_tile, dtype, jnp.float32)
        new_top_N = jnp.maximum(top_N, jnp.max(logits_Nt, axis=1))
        total_N = total_N * jnp.exp(top_N - new_top_N) + jnp.sum(
            jnp.exp(logits_Nt - new_top_N[:, None]), axis=1
        )
        # the target's logit, from the tile that holds it
        picked_N = jnp.take_along_axis(logits_Nt, (targets_N % tile)[:, None], axis=1)[:, 0]
        return (
            new_top_N,
            total_N,
            target_N + jnp.where(targets_N // tile == i, picked_N, 0.0),
        ), None

    start = (jnp.full(N, -jnp.inf), jnp.zeros(N), jnp.zeros(N))
    (top_N, total_N, target_N), _ = jax.lax.scan(one, start, (w_I, jnp.arange(V // tile)))
    return top_N + jnp.log(total_N) - target_N


def init(cfg, key):
    """(graph, params): a new model of the task's module split into its static graph and
    its parameters as a plain nested dict of arrays. train.py calls it under jit with
    the state's shardings."""
    graph, params = nnx.split(TASKS[cfg.task].module(cfg, nnx.Rngs(params=key)))
    return graph, nnx.to_pure_dict(params)


# What AdamW's weight decay never reaches, by name: norm scales and biases (as transformers'
# Trainer, so trl, decays neither), and the TRM's learned start states, its heads' vectors, biases.
NOT_DECAYED = frozenset(
    ("scale", "bq", "bk", "bv", "y_init", "z_init", "halt", "halt_bias", "value", "value_bias")
)


def decayed(params):
    """Whether weight decay reaches each parameter (a tree of bools like params): by what it is, its
    name, never its shape (scan_layers stacks every norm scale into a [layers, D] matrix)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in NOT_DECAYED, params)


def abstract(cfg):
    """(graph, logical axes): the model's graph and a PartitionSpec of logical names for every
    parameter (the same nested dict as the params), with nothing allocated. Call it outside a mesh
    context: inside one, eval_shape would try to place the logical names on the mesh."""
    graph, state = nnx.split(nnx.eval_shape(lambda: TASKS[cfg.task].module(cfg, nnx.Rngs(0))))
    return graph, nnx.to_pure_dict(nnx.get_partition_spec(state))


def layer_flops(cfg, L, causal):
    """Forward FLOPs per token of one block: the projections, the MLP, and the attention scores and
    values over L keys (halved when causal: the mask keeps half the square)."""
    D = cfg.d_model
    F = cfg.mlp_dim
    H = cfg.num_heads
    G = cfg.num_kv_heads
    K = dims(cfg)
    return (
        2 * D * (H + 2 * G) * K
        + 2 * H * K * D
        + 2 * 3 * D * F
        + 2 * 2 * L * H * K / (2 if causal else 1)
    )


# ==================================================================================================
# The language-model task: loss, eval, generation.
# ==================================================================================================
def lm_loss(cfg, graph, params, mb):
    """The LM's loss in the train step's shape: (summed cross-entropy over real target tokens,
    sums). The step divides by sums['weight'] (the token count of the whole step), so
    accumulation is exact."""
    ce_BL = token_losses(cfg, graph, params, mb, mb.get("key"))
    # weight: the targets that count (an SFT row's answers);
    # tokens: every real one the step ran (for tokens/s, MFU)
    weight, tokens = jnp.sum(mb["loss_mask"]), jnp.sum(mb["segment_ids"] > 0).astype(jnp.float32)
    return jnp.sum(ce_BL * mb["loss_mask"]), {"weight": weight, "tokens": tokens}


def token_losses(cfg, graph, params, mb, key=None):
    """Each target's cross-entropy [B, L] (float32): -log p(target | the tokens before it)."""
    model = nnx.merge(graph, params)
    key = key if cfg.lora.rank and cfg.lora.dropout else None  # LoRA's dropout draws, training only
    if not cfg.vocab_tile:
        logits_BLV = model(mb["inputs"], mb["positions"], mb["segment_ids"], key=key)
        return cross_entropy(logits_BLV, mb["targets"])
    # the head and its loss in vocabulary tiles: no [rows, V] logits in memory
    x_BLD = model(mb["inputs"], mb["positions"], mb["segment_ids"], logits=False, key=key)
    return tiled_cross_entropy(
        x_BLD.reshape(-1, x_BLD.shape[-1]),
        model.head(),
        mb["targets"].reshape(-1),
        cfg.vocab_tile,
        jnp.dtype(cfg.dtype),
    ).reshape(mb["targets"].shape)


def lm_flops_per_token(cfg):
    """Training FLOPs per token (forward + backward = 3x forward), counted as MaxText does: every
    matmul including the LM head, plus causal attention."""
    return 3 * (
        cfg.num_layers * layer_flops(cfg, cfg.max_target_length, True)
        + 2 * cfg.d_model * cfg.vocab_size
    )


def lm_eval_step(cfg, graph, params, batch):
    loss, sums = lm_loss(cfg, graph, params, batch)
    return {"loss": loss, "tokens": sums["weight"]}  # eval loss per target that counts


def lm_eval_result(cfg, outs, batches, ds, save_to=None):
    """Eval loss per real target token over every batch, and its perplexity (NaN: no tokens to
    score); the tokens scored and, for SFT rows, the held-out rows (examples) scored, each of how
    many the eval set holds (ds.eval_size)."""
    tokens = float(sum(o["tokens"] for o in outs))
    loss = float(sum(o["loss"] for o in outs)) / tokens if tokens else float("nan")
    result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
    if size := getattr(ds, "eval_size", None):  # each example is one segment of a row
        scored = lambda b: sum(
            len(np.unique(seg[w > 0])) for seg, w in zip(b["segment_ids"], b["loss_mask"])
        )
        rows = sum(scored(b) for b in batches)
        result.update(rows=rows, rows_of=size["rows"], tokens_of=size["tokens"])
    return result


def generate(cfg, graph, params, prompt_BP, key, real_BP=None):
    """prompt [B, P] -> [B, max_new_tokens] sampled tokens (generator's program, compiled for this
    call). Prompts of several lengths come padded on the left, real_BP (1 = a prompt token, 0 =
    padding) saying which."""
    real_BP = np.ones(prompt_BP.shape, np.int32) if real_BP is None else real_BP
    return generator(cfg, graph)(
        params, jnp.asarray(prompt_BP, jnp.int32), jnp.asarray(real_BP, jnp.int32), key
    )


def generator(cfg, graph):
    """The jitted generation (params, prompt [B, P], real [B, P], key) -> [B, max_new_tokens]: the
    prompt fills the KV cache in one pass (prefill), then a scan of single-token steps, each new
    token costing one position, not the whole prefix. Shapes are static (cache length P +
    max_new_tokens): it compiles once per prompt shape, so a caller answering many batches of one
    shape keeps it."""
    O = cfg.max_new_tokens

    def sample(logits_BV, key):
        logits_BV = logits_BV.astype(jnp.float32)
        if cfg.temperature == 0:
            return jnp.argmax(logits_BV, -1).astype(jnp.int32)
        if 0 < cfg.top_k < cfg.vocab_size:  # below the top_k-th largest logit: never sampled
            logits_BV = jnp.where(
                logits_BV < jax.lax.top_k(logits_BV, cfg.top_k)[0][:, -1:], -jnp.inf, logits_BV
            )
        return jax.random.categorical(key, logits_BV / cfg.temperature).astype(jnp.int32)

    def run_all(params, prompt_BP, real_BP, key):
        B, P = prompt_BP.shape
        model, ones = nnx.merge(graph, params), lambda L: jnp.ones((B, L), jnp.int32)
        shape = (cfg.num_layers, B, P + O)
        cache = {
            "k": jnp.zeros((*shape, cfg.num_kv_heads, dims(cfg)), jnp.dtype(cfg.dtype)),  # empty
            "v": jnp.zeros((*shape, cfg.num_kv_heads, dims(cfg)), jnp.dtype(cfg.dtype)),
            "seg": jnp.zeros(shape, jnp.int32),
        }
        logits_BPV, cache = model(prompt_BP, jnp.arange(P) * ones(P), real_BP, cache)
        keys = jax.random.split(key, O)

        def step(carry, key):  # feed the last sampled token, sample the next
            cache, tok_B, pos = carry
            logits_B1V, cache = model(tok_B[:, None], pos * ones(1), ones(1), cache)
            return (cache, sample(logits_B1V[:, -1], key), pos + 1), tok_B

        (_, last_B, _), toks_OB = jax.lax.scan(
            step, (cache, sample(logits_BPV[:, -1], keys[0]), P), keys[1:]
        )
        return jnp.concatenate([toks_OB.T, last_B[:, None]], axis=1)

    return jax.jit(run_all)


def lm_generate(cfg, graph, params, ds, rows):
    """mode=generate: the prompt continued by max_new_tokens sampled tokens, cut where a stop token
    (eos, a chat model's end of turn) comes. With a chat template (and chat_template=true) the
    prompt is what the model was fine-tuned on: `messages` (a conversation, from a YAML file) or
    prompt= as one user turn, rendered with the generation prompt; else bos (where the tokenizer
    has one) and the text. Returns (summary, what to print, what RUN_DIR/generation.txt holds)."""
    tok = ds.tokenizer
    if cfg.messages and not (cfg.chat_template and tok.render):
        raise data.DataError(
            "messages: a conversation is rendered by the tokenizer's chat template, and "
            + ("chat_template=false is set" if tok.render else "this tokenizer has none")
            + "; give prompt= text instead"
        )
    if cfg.chat_template and tok.render:
        turns = [dict(m) for m in cfg.messages] or [{"role": "user", "content": cfg.prompt}]
        text = tok.render(turns, True)
        ids = tok.encode(text)  # the template writes bos itself
    else:
        text, ids = cfg.prompt, [tok.bos_id] * (tok.bos_id is not None) + tok.encode(cfg.prompt)
    prompt_1P = np.asarray([ids], np.int32)
    tokens = np.asarray(generate(cfg, graph, params, prompt_1P, jax.random.key(cfg.seed)))[
        0
    ].tolist()
    tokens = data.until_stop(tokens, tok.stop_ids)
    out = tok.decode(tokens)
    shown = f"prompt: {text}\ncontinuation: {out}"
    if prompt_1P.shape[1] + cfg.max_new_tokens > cfg.max_target_length:
        shown = (
            "WARNING: prompt + max_new_tokens = "
            f"{prompt_1P.shape[1] + cfg.max_new_tokens} tokens, more than the "
            f"max_target_length={cfg.max_target_length} the model was trained on\n{shown}"
        )
    return {"prompt": text, "tokens": tokens, "generation": out}, shown, out


def lm_answers(cfg, graph, params, ds, save_to):
    """mode=eval on SFT data, eval_answers=N: the first N held-out examples' prompts answered
    greedily (up to max_new_tokens, cut at a stop token), 16 at a time with their prompts padded on
    the left to one length (one compile for them all); exact match is the answer's text equal to
    the reference's, spaces at either end aside. The answers go to save_to/answers.jsonl."""
    if not hasattr(ds, "eval_examples"):
        raise data.DataError(
            f"eval_answers={cfg.eval_answers} scores the answers of SFT rows (messages, or prompt "
            "and completion); this data has none: set eval_answers=0"
        )
    examples = ds.eval_examples[: cfg.eval_answers]
    greedy, P = cfg.model_copy(update={"temperature": 0.0}), max(len(p) for p, _ in examples)
    B = min(len(examples), 16)  # prompts a call: the prefill keeps [B, heads, P, P] float32 scores
    answer = generator(greedy, graph)
    rows, exact = [], 0
    for start in range(0, len(examples), B):
        chunk = examples[start : start + B]
        prompt_BP, real_BP = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
        for b, (prompt, _) in enumerate(chunk):
            prompt_BP[b, P - len(prompt) :], real_BP[b, P - len(prompt) :] = prompt, 1
        real_BP[len(chunk) :, -1] = 1  # the rows past the last example: one token each, never read
        out_BO = np.asarray(answer(params, prompt_BP, real_BP, jax.random.key(0)))
        for (prompt, want), tokens in zip(chunk, out_BO.tolist()):
            got = ds.tokenizer.decode(data.until_stop(tokens, ds.tokenizer.stop_ids))
            exact += got.strip() == want.strip()
            rows.append(
                {"prompt": ds.tokenizer.decode(prompt.tolist()), "answer": got, "reference": want}
            )
    data.write(os.path.join(save_to, "answers.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    return {"exact_match": exact / len(rows), "answered": len(rows)}


def lm_check(cfg):
    """The LM's own config rules: a message naming the key, or ''."""
    return (
        "mode=generate needs a tokenizer: use a text dataset, or tokenizer_path= "
        "(dataset=synthetic has none)"
        if cfg.mode == "generate" and cfg.dataset == "synthetic" and not data.tokenizer_source(cfg)
        else ""
    )


# ==================================================================================================
# The bf16 matmul layer: how the model's matmuls run (dot, product, contract). In float32 every one
# is a plain jnp.einsum. This layer exists for the bf16 step on CPU: XLA:CPU runs a dot at bf16
# speed (AVX-512 BF16) only as bf16 x bf16 accumulating in float32, with the left operand stored
# with its summed axes last; any other dot runs as float32 x float32. jnp.einsum and its autodiff
# miss that form in three places, each fixed by one piece here:
#   dot       a projection as one 2-D matmul [rows, in] x [in, out] (XLA:CPU differentiates that
#             into plain matmuls; the 3-D einsum made it copy a transposed activation for each
#             weight gradient)
#   product   einsum in the compute dtype, float32 sums; in bf16 its own gradient (narrow_product)
#             casts the float32 cotangent back to bf16, so the backward dots are bf16 x bf16 as well
#   contract  each backward dot in the kernel's form, transposing (transposed) whichever operand is
#             cheaper
# saved_bits keeps what remat=save_dots saves in bf16 too.
# ==================================================================================================
def dot(eq, x, w, dtype, out_dtype=None):
    """A projection: einsum `eq` where x's trailing axes contract with w's leading ones
    ('bld,dhk->blhk'), as one [rows, in] x [in, out] product (compute dtype, float32 sums), the
    result in the compute dtype or out_dtype. A result in the compute dtype is what
    remat=save_dots keeps: named 'dot' here, after the cast, not the float32 sums before it (twice
    the bytes in a bf16 step)."""
    lhs, rhs = eq.split("->")[0].split(",")
    n = len(set(lhs) & set(rhs))  # the contracted axes
    assert n and lhs[-n:] == rhs[:n] and eq.endswith("->" + lhs[:-n] + rhs[n:]), (
        f"not a projection: {eq}"
    )
    I = math.prod(w.shape[:n])
    y = product("ni,io->no", x.reshape(-1, I), w.reshape(I, -1), dtype, out_dtype or dtype)
    if y.dtype == jnp.dtype(dtype):
        y = saved_bits(y) if y.dtype.itemsize == 2 else checkpoint_name(y, "dot")
    return y.reshape(x.shape[:-n] + w.shape[n:])


@jax.custom_vjp
def saved_bits(y):
    """y itself, named 'dot' for remat=save_dots as its uint16 bits: the layer scan stacks
    what is kept, and XLA:CPU has no bf16 dynamic-slice, so a bf16 y named as it is would be
    kept as a float32 copy for the backward pass. The bits are named only when
    differentiated (saved_bits_fwd); the cotangent passes straight through (a bit cast has
    no gradient of its own)."""
    return y


def saved_bits_fwd(y):
    bits = checkpoint_name(jax.lax.bitcast_convert_type(y, jnp.uint16), "dot")
    return jax.lax.bitcast_convert_type(bits, y.dtype), None


saved_bits.defvjp(saved_bits_fwd, lambda _, g: (g,))


def product(eq, x, w, dtype, out_dtype):
    """einsum(eq, x, w) of x and w cast to the compute
    dtype, accumulated in float32, result in out_dtype.

    In float32 that is all. In a narrower dtype (bf16) jnp.einsum's own gradient would not stay in
    it: the cotangent of the float32 sum is float32, so both backward products would be float32 x
    bf16, which XLA:CPU runs as float32 x float32. Here (narrow_product) the cotangent is cast to
    the compute dtype and both backward products are bf16 x bf16 accumulating in float32, as the
    forward one; the gradients come back in x's and w's own dtypes (a float32 master weight gets
    its gradient unrounded)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(
            eq, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32
        ).astype(out_dtype)
    return narrow_product(eq, (x.dtype, w.dtype, jnp.dtype(dtype), jnp.dtype(out_dtype)), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def narrow_product(eq, dtypes, x, w):
    """product in a narrow compute dtype; dtypes = (x's, w's, compute, result)."""
    return narrow_product_fwd(eq, dtypes, x, w)[0]


def narrow_product_fwd(eq, dtypes, x, w):
    x, w = x.astype(dtypes[2]), w.astype(dtypes[2])  # the residuals too: half float32's bytes
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(dtypes[3]), (x, w)


def narrow_product_bwd(eq, dtypes, xw, g):
    """x's and w's gradients as einsums of the same form:
    g with w gives x's axes, x with g gives w's."""
    (lhs, rhs), out = eq.split("->")[0].split(","), eq.split("->")[1]
    (x, w), g = xw, g.astype(dtypes[2])
    return contract(out, rhs, lhs, g, w).astype(dtypes[0]), contract(lhs, out, rhs, x, g).astype(
        dtypes[1]
    )


narrow_product.defvjp(narrow_product_fwd, narrow_product_bwd)


def contract(a_spec, b_spec, out_spec, a, b):
    """einsum a_spec,b_spec->out_spec accumulating in float32, in the one form XLA:CPU's bf16
    matmuls (YNNPACK) take: the left operand stored with its summed axes last, the result in the
    dot's own order (shared axes, the left's, the right's). A weight gradient sums over the rows,
    which lead both operands, so one of them is copied transposed: of the two ways (either
    operand on the left, the result transposed after if its order differs) the one that moves
    fewer bytes. For the MLP's down projection that copies the [rows, d_model] gradient, not the
    [rows, mlp_dim] activation."""
    # float32
    out_bytes = 4 * math.prod(dict(zip(a_spec + b_spec, a.shape + b.shape))[c] for c in out_spec)

    # l on the left: the bytes copied, the operands, l's layout, the result's
    def plan(l_spec, l, r_spec, r):
        summed = [c for c in l_spec if c in r_spec and c not in out_spec]
        order = "".join([c for c in l_spec if c not in summed] + summed)
        natural = "".join(
            [c for c in order if c in r_spec and c in out_spec]
            + [c for c in order if c not in r_spec]
            + [c for c in r_spec if c not in l_spec]
        )
        cost = (order != l_spec) * l.size * l.dtype.itemsize + (natural != out_spec) * out_bytes
        return cost, l_spec, l, r_spec, r, order, natural

    # a tie: a on the left
    _, l_spec, l, r_spec, r, order, natural = min(
        plan(a_spec, a, b_spec, b), plan(b_spec, b, a_spec, a), key=lambda p: p[0]
    )
    if order != l_spec:
        l = transposed(l, [l_spec.index(c) for c in order])
    y = jnp.einsum(f"{order},{r_spec}->{natural}", l, r, preferred_element_type=jnp.float32)
    return y if natural == out_spec else transposed(y, [natural.index(c) for c in out_spec])


def transposed(x, perm):
    """x.transpose(perm), on CPU stored in its new order: XLA:CPU may keep a plain transpose as a
    relabelled layout of x's buffer, which its bf16 dot cannot read (contract); through a unit axis
    it is a real copy. Other backends pick their own layouts, and a copy there only costs memory
    (v3-8 by AOT: +1.4 GiB)."""
    copy = lambda x: x[..., None].transpose(*perm, x.ndim)[..., 0]
    return jax.lax.platform_dependent(x, cpu=copy, default=lambda x: x.transpose(perm))


# ==================================================================================================
# LoRA: low-rank adapters on the projections (lora.rank > 0). Each targeted projection W computes
# x W + (alpha / rank) (dropout(x) A) B. The base's weights are frozen: the train state keeps
# them apart ('base') from what learns ('params': the adapters), so the step differentiates and
# AdamW keeps moments for the adapters alone, and a checkpoint holds only those. Adapters go out
# and come in in peft's format (adapter_config.json, adapter_model.safetensors).
# ==================================================================================================
# our projection weight -> (its lora.targets name, how many leading axes are its inputs, peft's
# name)
LORA_WEIGHTS = {
    "wq": ("q", 1, "self_attn.q_proj"),
    "wk": ("k", 1, "self_attn.k_proj"),
    "wv": ("v", 1, "self_attn.v_proj"),
    "wo": ("o", 2, "self_attn.o_proj"),
    "w_gate": ("gate", 1, "mlp.gate_proj"),
    "w_up": ("up", 1, "mlp.up_proj"),
    "w_down": ("down", 1, "mlp.down_proj"),
}
LORA_TARGETS = tuple(target for target, _, _ in LORA_WEIGHTS.values())
ADAPTER = ("_lora_a", "_lora_b")  # an adapter's parameters: weight name + these


def add_adapters(module, cfg, rngs):
    """lora.rank > 0: beside each of module's projection weights that lora.targets names, its
    adapter: A [inputs..., r] drawn as peft draws it (Kaiming-uniform: U(+-1/sqrt(inputs))) and B
    [r, outputs...] zero, so step 0 computes the base model exactly; float32, whatever weight_dtype
    (the base may stay bfloat16). Their logical axes are the weight's, the rank's 'lora_rank'."""
    r = cfg.lora.rank
    module.lora = (cfg.lora.alpha / r, cfg.lora.dropout) if r else None  # (scale, dropout rate)
    for name, (target, ins, _) in LORA_WEIGHTS.items():
        if not r or target not in cfg.lora.targets or not hasattr(module, name):
            continue
        w = getattr(module, name)
        shape, axes = w.shape, w.out_sharding
        bound = math.prod(shape[:ins]) ** -0.5
        a = jax.random.uniform(rngs.params(), (*shape[:ins], r), jnp.float32, -bound, bound)
        b = jnp.zeros((r, *shape[ins:]), jnp.float32)
        a_axes, b_axes = (*axes[:ins], "lora_rank"), ("lora_rank", *axes[ins:])
        setattr(module, name + ADAPTER[0], nnx.Param(a, out_sharding=a_axes, eager_sharding=False))
        setattr(module, name + ADAPTER[1], nnx.Param(b, out_sharding=b_axes, eager_sharding=False))


def projected(module, name, eq, x, dtype, key=None):
    """The projection module.<name> of x (dot's einsum `eq`) and, where LoRA adapts it, its adapter:
    x W + scale (dropout(x) A) B, in the compute dtype. `key`: the dropout's draws (training)."""
    y = dot(eq, x, getattr(module, name)[...], dtype)
    if not hasattr(module, name + ADAPTER[0]):
        return y
    a = getattr(module, name + ADAPTER[0])[...]
    b = getattr(module, name + ADAPTER[1])[...]
    scale, rate = module.lora
    lhs, rhs = eq.split("->")[0].split(",")
    ins = rhs[: a.ndim - 1]  # the weight's input axes, then its output axes
    outs = rhs[a.ndim - 1 :]
    rows = lhs[: lhs.index(rhs[0])]  # x's axes before the contracted ones
    if key is not None and rate:
        # each projection its own draws, the same on every host and every run (hash() of a str
        # is not: Python salts it per process)
        own = jax.random.fold_in(key, list(LORA_WEIGHTS).index(name))
        keep = jax.random.bernoulli(own, 1 - rate, x.shape)
        x = jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)
    xa = dot(f"{lhs},{ins}r->{rows}r", x, a, dtype)
    return y + scale * dot(f"{rows}r,r{outs}->{rows}{outs}", xa, b, dtype)


def leaf(tree, path):
    """tree[path[0]][path[1]]...: one entry of a nested dict."""
    return functools.reduce(lambda t, k: t[k], path, tree)


def parted(tree, keep):
    """The nested dict of tree's leaves whose names `keep` takes, empty branches dropped."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            if part := parted(v, keep):
                out[k] = part
        elif keep(k):
            out[k] = v
    return out


def joined(base, part):
    """base with part's leaves put in (a nested dict merge); `part` itself where base is empty."""
    if not base:
        return part
    out = dict(base)
    for k, v in part.items():
        out[k] = joined(base.get(k), v) if isinstance(v, dict) else v
    return out


def learned(cfg, tree):
    """The parameters that train, of a tree shaped as the model's: all of them, or with LoRA the
    adapters alone."""
    return parted(tree, lambda k: str(k).endswith(ADAPTER)) if cfg.lora.rank else tree


def frozen(cfg, tree):
    """The rest: with LoRA the base's weights ({} without)."""
    return parted(tree, lambda k: not str(k).endswith(ADAPTER)) if cfg.lora.rank else {}


# QLoRA's 4-bit levels (NormalFloat4: quantiles of a unit normal, as bitsandbytes' nf4) and the
# midpoints between them, where a value rounds to its neighbour.
NF4 = np.array(
    [
        -1.0,
        -0.6961928,
        -0.52507305,
        -0.3949175,
        -0.28444138,
        -0.18477343,
        -0.09105004,
        0.0,
        0.0795803,
        0.1609302,
        0.2461123,
        0.33791524,
        0.44070983,
        0.562617,
        0.72295684,
        1.0,
    ],
    np.float32,
)
NF4_EDGES = (NF4[1:] + NF4[:-1]) / 2


@jax.tree_util.register_pytree_node_class
class Quantized:
    """A frozen base weight stored blockwise-quantized (QLoRA, lora.base_quant): codes (int8, or two
    nf4 codes a byte) and one absmax scale per block of values along the last axis. w[...]
    dequantizes it, inside the layer that reads it: under the layer scan one layer's weights exist
    at full precision at a time."""

    def __init__(self, codes, scales, kind, dtype):
        self.codes, self.scales, self.kind, self.dtype = codes, scales, kind, dtype

    def tree_flatten(self):
        return (self.codes, self.scales), (self.kind, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __getitem__(self, index):
        return dequantize(self)[index]

    @property
    def size(self):
        return self.codes.size * (2 if self.kind == "nf4" else 1)


def quantize(w, kind, block):
    """w [..., n] -> Quantized: blocks of `block` values along the last axis scaled by their absmax
    to [-1, 1], then int8 (x 127, rounded) or the nearest of the 16 NF4 levels."""
    *lead, n = w.shape
    x = w.astype(jnp.float32).reshape(*lead, n // block, block)
    scales = jnp.max(jnp.abs(x), axis=-1)
    unit = x / jnp.where(scales > 0, scales, 1.0)[..., None]
    dtype = jnp.dtype(w.dtype)
    if kind == "int8":
        return Quantized(
            jnp.round(unit * 127).astype(jnp.int8).reshape(*lead, n), scales, kind, dtype
        )
    idx = jnp.searchsorted(jnp.asarray(NF4_EDGES), unit).astype(jnp.uint8).reshape(*lead, n)
    return Quantized(idx[..., 0::2] | (idx[..., 1::2] << 4), scales, kind, dtype)


def dequantize(q):
    """Quantized -> the weight it approximates, in its dtype."""
    if q.kind == "int8":
        unit = q.codes.astype(jnp.float32) / 127
    else:
        pairs = jnp.stack([q.codes & 15, q.codes >> 4], axis=-1).reshape(*q.codes.shape[:-1], -1)
        unit = jnp.take(jnp.asarray(NF4), pairs.astype(jnp.int32))
    *lead, n = unit.shape
    blocks = unit.reshape(*lead, q.scales.shape[-1], -1) * q.scales[..., None]
    return blocks.reshape(*lead, n).astype(q.dtype)


def quantized(cfg, base):
    """QLoRA: the base's projection weights as Quantized (their logical axes as Quantized of axes,
    the codes' and the scales' alike); the rest (embeddings, norms, biases) as they are."""
    if cfg.lora.base_quant == "none":
        return base

    def one(path, x):
        if path[-1].key not in LORA_WEIGHTS or isinstance(x, Quantized):
            return x
        if isinstance(x, PartitionSpec):
            return Quantized(x, x, cfg.lora.base_quant, jnp.dtype(cfg.weight_dtype))
        return quantize(x, cfg.lora.base_quant, cfg.lora.block)

    return jax.tree_util.tree_map_with_path(
        one, base, is_leaf=lambda x: isinstance(x, (PartitionSpec, Quantized))
    )


def parts(cfg, tree):
    """The train state's parameter entries from a tree shaped as the model's parameters (arrays, or
    their logical axes): {'params': what trains}; with LoRA the adapters there, and 'base' the
    frozen rest, 'base_id' the base's fingerprint (base_id: in the checkpoint, which the base is
    not, so that a resume on another base is caught)."""
    if not cfg.lora.rank:
        return {"params": tree}
    axes = isinstance(
        jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))[0], PartitionSpec
    )
    seal = base_fingerprint(cfg.load_hf, cfg.seed, cfg.task)
    base_id = PartitionSpec() if axes else jnp.asarray(np.frombuffer(seal, np.uint8))
    base = quantized(cfg, frozen(cfg, tree))
    return {"params": learned(cfg, tree), "base": base, "base_id": base_id}


def parameter_count(state):
    """The log's 'model:' figure: '3.54M parameters', with LoRA '3.54M parameters (0.30M of them
    trained: the adapters)'. A quantized base weight counts the values it stands for."""
    count = sum(
        x.size for x in jax.tree.leaves(state.get("base", {}), is_leaf=Quantized.__instancecheck__)
    )
    trained = sum(x.size for x in jax.tree.leaves(state["params"]))
    if not count:
        return f"{trained / 1e6:.2f}M parameters"
    total = f"{(count + trained) / 1e6:.2f}M parameters"
    return f"{total} ({trained / 1e6:.2f}M of them trained: the adapters)"


@functools.cache
def base_fingerprint(load_hf, seed, task):
    """20 bytes naming LoRA's base: load_hf's checkpoint by every tensor's name, dtype, shape and
    first bytes (cheap to read, other for other weights of the same shape), or a fresh init's
    seed."""
    digest = hashlib.sha1()
    if not load_hf:
        digest.update(f"init seed {seed} {task}".encode())
        return digest.digest()
    folder = data.hf_dir(load_hf)
    try:
        tensors = hf_tensors(folder)
    except (
        ValueError,
        *data.STORAGE_ERRORS,
    ):  # no weights (the fit check compiles from config.json)
        return hashlib.sha1(data.stored(os.path.join(folder, "config.json")).read_bytes()).digest()
    for name, (path, dtype, shape, first) in sorted(tensors.items()):
        with data.stored(path).open("rb") as f:
            f.seek(first)
            head = f.read(64)
        digest.update(f"{name} {dtype} {shape}".encode() + head)
    return digest.digest()


def on_base(cfg, start, restored):
    """A LoRA run's resumed state: the checkpoint's (adapters, their optimizer state, ...) on the
    frozen base of `start`, a fresh state from load_hf, which must be the base the checkpoint
    names."""
    if not np.array_equal(np.asarray(start["base_id"]), np.asarray(restored["base_id"])):
        raise data.DataError(
            f"load_hf={cfg.load_hf or '(none: a fresh init)'}: this run's adapters were trained on "
            "another base (its weights' fingerprint, kept in the checkpoint, differs); give the "
            "load_hf the run started from (RUN_DIR/config.yml), or start a new run_name"
        )
    return {**start, **restored}


def fold_adapters(cfg, params):
    """params with each adapter folded into its weight, W + scale A B (in the weight's dtype, the
    sum in float32), and dropped: the dense model the adapted one computes. jnp: differentiable."""
    scale = cfg.lora.alpha / cfg.lora.rank

    def fold(tree):
        out = {k: fold(v) if isinstance(v, dict) else v for k, v in tree.items()}
        for name, (_, ins, _) in LORA_WEIGHTS.items():
            if name + ADAPTER[0] in out:
                a = out.pop(name + ADAPTER[0])
                b = out.pop(name + ADAPTER[1])
                w = out[name][...]
                lead = a.ndim - 1 - ins  # the stacked layers' axis, if any
                a_IR = a.reshape(*a.shape[:lead], -1, a.shape[-1]).astype(jnp.float32)
                b_RO = b.reshape(*b.shape[: lead + 1], -1).astype(jnp.float32)
                delta = jnp.matmul(a_IR, b_RO).reshape(w.shape)
                out[name] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
        return out

    return fold(params)


def merged(cfg, params):
    """Host params with the adapters folded in (fold_adapters): the full model, written in the
    family's own format by lora.merge=true."""
    return jax.tree.map(np.asarray, fold_adapters(cfg, params))


# ==================================================================================================
# Hugging Face files, every one a run reads or writes: Llama, Qwen2 and Qwen3 tensors <-> our
# parameters, config.json <-> keys, peft's adapter format both ways; load_pretrained, export_hf.
# ==================================================================================================
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Our layer parameter <- the HF tensor under model.layers.{i}, and the option it comes with (None:
# always). HF Linear weights are [out, in]; ours keep the input axis first ('in': wq [D,H,K]) or the
# output axis last ('out': wo [H,K,D]); the rest only reshape (a bias [H*K] is our [H,K]). Both use
# rotate-half RoPE, so q and k need no permutation.
HF_LAYER = (
    ("self_attn.q_proj.weight", ("attn", "wq"), "in", None),
    ("self_attn.k_proj.weight", ("attn", "wk"), "in", None),
    ("self_attn.v_proj.weight", ("attn", "wv"), "in", None),
    ("self_attn.o_proj.weight", ("attn", "wo"), "out", None),
    ("self_attn.q_proj.bias", ("attn", "bq"), None, "qkv_bias"),
    ("self_attn.k_proj.bias", ("attn", "bk"), None, "qkv_bias"),
    ("self_attn.v_proj.bias", ("attn", "bv"), None, "qkv_bias"),
    ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), None, "qk_norm"),
    ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), None, "qk_norm"),
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), "in", None),
    ("mlp.up_proj.weight", ("mlp", "w_up"), "in", None),
    ("mlp.down_proj.weight", ("mlp", "w_down"), "out", None),
    ("input_layernorm.weight", ("attn_norm", "scale"), None, None),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), None, None),
)
# Our model key <- its config.json key, in every family.
HF_KEYS = {
    "d_model": "hidden_size",
    "mlp_dim": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "num_layers": "num_hidden_layers",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
# llama3's
HF_ROPE = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F16": np.float16, "F32": np.float32}
# export: one safetensors file up to this size, then shards with an index (as HF does)
SHARD_BYTES = 5 * 2**30


def hf_names(cfg):
    """[(HF tensor name, our params path, index in the scanned layer stack or None, layout)]."""
    out = [
        ("model.embed_tokens.weight", ("embed",), None, None),
        ("model.norm.weight", ("final_norm", "scale"), None, None),
    ]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ("lm_head",), None, "in"))
    for i in range(cfg.num_layers):
        layer, idx = (("layers",), i) if cfg.scan_layers else (("layers", i), None)
        out += [
            (f"model.layers.{i}.{hf}", ("trunk", *layer, *ours), idx, how)
            for hf, ours, how, option in HF_LAYER
            if option is None or getattr(cfg, option)
        ]
    return out


def hf_rope(conf):
    """(the RoPE scaling type, its parameters) of a config.json:
    rope_scaling, or transformers 5's rope_parameters."""
    rope = conf.get("rope_scaling") or conf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        # A ValueError, not a TypeError: read as a bad value, as every other config.json check.
        raise ValueError(f"rope_scaling={rope!r} is not an object")  # noqa: TRY004
    return rope.get("rope_type", rope.get("type", "default")), rope


def hf_keys(conf):
    """A checkpoint's config.json -> {our model key: value} (rope_scaling's dotted); a ValueError
    naming what this Transformer cannot run: another architecture, activation or RoPE scaling, a
    sliding window, or biases beyond Qwen2's q/k/v ones."""
    by_type = {family: arch for arch, family in HF_ARCHITECTURES.items()}
    arch = (conf.get("architectures") or [None])[0] or by_type.get(conf.get("model_type"))
    if arch not in HF_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch or conf.get('model_type')} is not one this trainer runs "
            f"({', '.join(HF_ARCHITECTURES)})"
        )
    family, (kind, rope) = HF_ARCHITECTURES[arch], hf_rope(conf)
    sliding = conf.get("use_sliding_window") or any(
        t != "full_attention" for t in conf.get("layer_types") or ()
    )
    refused = [
        (
            conf.get("hidden_act", "silu") != "silu",
            f"hidden_act={conf.get('hidden_act')!r} (the MLP here is SwiGLU)",
        ),
        (
            sliding,
            (
                "sliding-window attention (use_sliding_window or "
                "layer_types): every layer here sees the whole sequence"
            ),
        ),
        (
            kind not in ("default", "llama3"),
            f"rope_scaling of type {kind!r} (RoPE here is plain or llama3-scaled)",
        ),
        (
            family != "qwen2" and conf.get("attention_bias"),
            "attention_bias=true (its o_proj bias is not supported)",
        ),
        (conf.get("mlp_bias"), "mlp_bias=true (the MLP here has no biases)"),
    ]
    if message := next((says for bad, says in refused if bad), None):
        raise ValueError(f"{arch} with {message}")
    missing = [
        hf
        for hf in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
        )
        if conf.get(hf) is None
    ]
    if missing or kind == "llama3" and any(rope.get(k) is None for k in HF_ROPE):
        raise ValueError(
            f"config.json has no {(missing or ['rope_scaling.' + k for k in HF_ROPE])[0]}"
        )
    keys = {ours: conf.get(hf) for ours, hf in HF_KEYS.items()}
    keys["num_kv_heads"] = keys["num_kv_heads"] or keys["num_heads"]
    keys["head_dim"] = keys["head_dim"] or keys["d_model"] // keys["num_heads"]
    keys["rope_theta"] = keys["rope_theta"] or rope.get("rope_theta") or 10000.0
    keys["norm_eps"] = keys["norm_eps"] or 1e-6
    keys["tie_embeddings"] = bool(keys["tie_embeddings"])
    keys.update({"qkv_bias": family == "qwen2", "qk_norm": family == "qwen3"})
    keys["rope_scaling.type"] = "llama3" if kind == "llama3" else "none"
    keys.update({f"rope_scaling.{k}": rope[k] for k in HF_ROPE if kind == "llama3"})
    return keys


def hf_config(cfg, source=None):
    """config.json for our model in the family its options make: qk_norm Qwen3, qkv_bias Qwen2, else
    Llama (with its rope_scaling). Written over the config.json of the checkpoint the run started
    from (`source`), if any, so its other entries (token ids, context length) carry over."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("qkv_bias and qk_norm together make no Hugging Face architecture")
    family = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    arch = next(a for a, f in HF_ARCHITECTURES.items() if f == family)
    conf = {
        k: v
        for k, v in (source or {}).items()
        if k not in ("rope_parameters", "dtype", "layer_types")
    }
    conf.update(
        {
            "architectures": [arch],
            "model_type": family,
            "hidden_act": "silu",
            "mlp_bias": False,
            "torch_dtype": cfg.weight_dtype,
            "max_position_embeddings": max(
                cfg.max_target_length, conf.get("max_position_embeddings") or 0
            ),
            **{
                hf: dims(cfg) if ours == "head_dim" else getattr(cfg, ours)
                for ours, hf in HF_KEYS.items()
            },
        }
    )
    scaling = cfg.rope_scaling
    conf["rope_scaling"] = (
        None
        if scaling.type == "none"
        else {"rope_type": "llama3", **{k: getattr(scaling, k) for k in HF_ROPE}}
    )
    conf.update({"use_sliding_window": False} if family == "qwen2" else {"attention_bias": False})
    return conf


def safetensors_header(path):
    """{tensor name: (file, dtype, shape, first byte)} from one safetensors file's header, read
    alone (8 bytes of size, then JSON): every size is checked against the file's before anything
    is read or allocated, so a damaged or hostile header is a ValueError naming the file."""
    with data.stored(path).open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(size - 8, 2**27):
            raise ValueError(
                f"{path}: not a safetensors file (its header claims {n:,} bytes of {size:,})"
            )
        try:
            header = json.loads(f.read(n))
        except RecursionError:  # json's parser recurses per level of nesting
            raise ValueError(
                f"{path}: not a safetensors file (its header nests too deep)"
            ) from None
    if not isinstance(header, dict):
        # A ValueError, as every other damage of the file: load_hf names them all one way.
        why = f"{path}: not a safetensors file (its header is a JSON {type(header).__name__})"
        raise ValueError(why)  # noqa: TRY004
    return {
        name: tensor_entry(path, name, t, 8 + n, size)
        for name, t in header.items()
        if name != "__metadata__"
    }


def tensor_entry(path, name, t, start, size):
    """One tensor of a safetensors header (its bytes from `start` on) -> (file, dtype, shape, first
    byte): a dtype load_hf reads, a shape of whole dims, and bytes that lie inside the file."""
    if not isinstance(t, dict):
        why = f"{path}: tensor {name} is described by no JSON object (damaged)"
        raise ValueError(why)  # noqa: TRY004
    if t.get("dtype") not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{path}: tensor {name} is {t.get('dtype')}; load_hf reads BF16, F16 and F32"
        )
    shape = t.get("shape")
    span = t.get("data_offsets")
    whole = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
    if not whole(shape) or not whole(span) or len(span) != 2:
        raise ValueError(f"{path}: tensor {name} has no valid shape and data_offsets (damaged)")
    dtype = np.dtype(SAFETENSORS_DTYPES[t["dtype"]])
    first = span[0]
    last = span[1]
    if last - first != math.prod(shape) * dtype.itemsize or start + last > size:
        raise ValueError(f"{path}: tensor {name} runs past the file (damaged or cut short)")
    return (path, dtype, tuple(shape), start + first)


def hf_tensors(folder):
    """Every tensor of a checkpoint directory: model.safetensors, or the shards
    model.safetensors.index.json names (every checkpoint above ~5 GB). Only the headers are read."""
    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if data.stored(index).is_file():
        weight_map = data.read_json(index, "of a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
    return {
        k: v for name in files for k, v in safetensors_header(os.path.join(folder, name)).items()
    }


@functools.lru_cache(maxsize=2)
def hf_array(entry):
    """One tensor as a lazy array: a memory map of a local file (only the parts indexed are
    ever read), or the tensor's bytes of a gs:// one (cached while the shards of its
    parameter are cut from it)."""
    path, dtype, shape, first = entry
    if not data.remote(path):
        return np.memmap(path, dtype, "r", offset=first, shape=shape)
    with data.stored(path).open("rb") as f:
        f.seek(first)
        return np.frombuffer(f.read(math.prod(shape) * dtype.itemsize), dtype).reshape(shape)


def our_layout(w, how, shape):
    """An HF tensor in our axis order `shape`, still a view: HF [out..., in] -> ours [in, out...]
    ('in'), HF [out, in...] -> ours [in..., out] ('out'), or a reshape."""
    if how == "in":
        return np.moveaxis(w.reshape(*shape[1:], shape[0]), -1, 0)
    if how == "out":
        return np.moveaxis(w.reshape(shape[-1], *shape[:-1]), 0, -1)
    return w.reshape(shape)


def load_hf(cfg, path, abstract_params):
    """load_hf=DIR (local, gs:// or a hub id): a Hugging Face checkpoint -> our params, as global
    arrays placed as abstract_params says. Each process reads only the parts of each tensor its own
    devices hold (of a local file, through a memory map), so no host ever holds the whole
    checkpoint. A DataError names what is wrong."""
    folder = data.hf_dir(path)
    try:
        tensors = hf_tensors(folder)
    except data.STORAGE_ERRORS as e:
        raise data.DataError(
            f"load_hf={path}: cannot read {getattr(e, 'filename', None) or folder} "
            f"({data.storage_reason(e)}); give a directory with config.json and model.safetensors "
            "(or its shards and model.safetensors.index.json)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:  # a damaged header or index
        raise data.DataError(
            f"load_hf={path}: the checkpoint is damaged ({str(e)[:200]}); copy or download it "
            "again, or give load_hf= another checkpoint"
        ) from None
    # our params path -> its tensor, or one per layer of a scanned stack
    sources = collections.defaultdict(list)
    for name, p, i, how in hf_names(cfg):
        if name not in tensors:
            raise data.DataError(
                f"load_hf={path}: the checkpoint has no "
                f"tensor {name}, which its config.json implies"
            )
        sources[p].append((tensors[name], how, name))

    def placed(keypath, a):
        entries = sources[tuple(k.key for k in keypath)]
        stacked = cfg.scan_layers and keypath[0].key == "trunk"
        if isinstance(a, Quantized):  # QLoRA: each layer read, then quantized on its devices
            return quantized_layers(a, entries, stacked)
        shape = a.shape[1:] if stacked else a.shape
        checked(entries, shape)

        def shard(index):  # this device's part of our array
            if not stacked:
                return part(*entries[0][:2], index, shape, a.dtype)
            layers = range(a.shape[0])[index[0]]
            return np.stack([part(*entries[i][:2], index[1:], shape, a.dtype) for i in layers])

        return jax.make_array_from_callback(a.shape, a.sharding, shard)

    def checked(entries, shape):
        for entry, _, name in entries:
            if math.prod(entry[2]) != math.prod(shape):
                raise data.DataError(
                    f"load_hf={path}: the checkpoint disagrees with its config.json: {name} is "
                    f"{list(entry[2])} where the config makes {list(shape)}"
                )

    def part(entry, how, index, shape, dtype):  # what `index` of our array holds, from one tensor
        return np.asarray(our_layout(hf_array(entry), how, shape)[index], dtype)

    def quantized_layers(q, entries, stacked):
        """A Quantized weight: one layer's full-precision tensor at a time on the devices."""
        sharding = q.codes.sharding
        full = (*q.codes.shape[:-1], q.codes.shape[-1] * (2 if q.kind == "nf4" else 1))
        shape = full[1:] if stacked else full
        checked(entries, shape)
        spec = PartitionSpec(*sharding.spec[1:]) if stacked else sharding.spec
        layer = NamedSharding(sharding.mesh, spec)
        one = jax.jit(lambda w: quantize(w, q.kind, cfg.lora.block))
        layers = [
            one(
                jax.make_array_from_callback(
                    shape, layer, functools.partial(part, e, how, shape=shape, dtype=q.dtype)
                )
            )
            for e, how, _ in entries
        ]
        stack = lambda *ls: jax.tree.map(lambda *xs: jnp.stack(xs), *ls) if stacked else ls[0]
        return jax.jit(
            stack, out_shardings=Quantized(sharding, q.scales.sharding, q.kind, q.dtype)
        )(*layers)

    is_leaf = lambda x: isinstance(x, Quantized)
    return jax.tree_util.tree_map_with_path(placed, abstract_params, is_leaf=is_leaf)


# In an export directory: the files the export wrote, so the next export there removes them all
# (an old export's extra shards and index would otherwise be read in place of the new weights).
EXPORTED = ".exported.json"


def clear_export(out_dir, new):
    """Makes out_dir ready for an export of the files `new`: the files an earlier export of this
    trainer wrote there (EXPORTED lists them) removed, then the new list written first, so an export
    cut short is cleared all the same. A checkpoint file no export of ours wrote is never removed:
    a ValueError names it."""
    folder = data.stored(out_dir)
    listed = json.loads((folder / EXPORTED).read_text()) if (folder / EXPORTED).is_file() else []
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    theirs = [n for n in sorted(present - set(listed)) if data.checkpoint_file(n)]
    if theirs:
        raise ValueError(
            f"{out_dir} holds {theirs[0]}, which no export of this trainer wrote; export into an "
            "empty or new directory, or move it away"
        )
    if data.MAIN:
        folder.mkdir(parents=True, exist_ok=True)
        for name in set(listed) & present:
            (folder / name).unlink()
    data.write(os.path.join(out_dir, EXPORTED), json.dumps(sorted(set(new))))


def save_hf(cfg, params, out_dir, tokenizer=None, source=None):
    """mode=export: a Hugging Face checkpoint in out_dir (local or gs://, written by the data.MAIN
    process) that transformers loads: config.json (hf_config over `source`, the config.json the run
    started from), the tensors in the weight dtype (one model.safetensors, or shards with an index
    past SHARD_BYTES; the metadata transformers wants, format=pt), generation_config.json and the
    tokenizer's files. `params`: host arrays. With LoRA a peft adapter directory (save_peft), or
    with lora.merge the model with its adapters merged in. Returns the tensors."""
    if cfg.lora.rank and not cfg.lora.merge:
        return save_peft(cfg, params, out_dir, tokenizer)
    params = merged(cfg, params) if cfg.lora.rank else params
    conf, tensors = hf_config(cfg, source), {}
    for name, path, i, how in hf_names(cfg):
        w = functools.reduce(lambda tree, k: tree[k], path, params)
        w = w if i is None else w[i]
        # to HF's [out, in]: flatten the head axes on the non-embedding side, then transpose
        if how:
            w = (w.reshape(w.shape[0], -1) if how == "in" else w.reshape(-1, w.shape[-1])).T
        # written as laid out
        tensors[name] = np.ascontiguousarray(w.reshape(-1) if name.endswith("bias") else w)
    files, size = [[]], 0
    # in order, a new shard when the next tensor would pass SHARD_BYTES
    for name, w in tensors.items():
        if files[-1] and size + w.nbytes > SHARD_BYTES:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += w.nbytes
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    written = [*names, "model.safetensors.index.json"] if len(files) > 1 else names
    written += ["config.json", "generation_config.json", *(tokenizer.files if tokenizer else ())]
    clear_export(out_dir, written)
    for name, members in zip(names, files):
        blob = safetensors.numpy.save({k: tensors[k] for k in members}, metadata={"format": "pt"})
        data.write(os.path.join(out_dir, name), blob)
    if len(files) > 1:
        weight_map = {k: name for name, members in zip(names, files) for k in members}
        index = {
            "metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
            "weight_map": weight_map,
        }
        data.write(
            os.path.join(out_dir, "model.safetensors.index.json"), json.dumps(index, indent=2)
        )
    ids = {"bos_token_id": None, "eos_token_id": None}
    if tokenizer:
        stops = list(tokenizer.stop_ids)
        ids = {
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": stops[0] if len(stops) == 1 else stops,
        }
        for name, content in tokenizer.files.items():
            data.write(os.path.join(out_dir, name), content)
    data.write(os.path.join(out_dir, "config.json"), json.dumps({**conf, **ids}, indent=2))
    data.write(os.path.join(out_dir, "generation_config.json"), json.dumps(ids, indent=2))
    return tensors


# ---- peft's adapter format: adapter_config.json, adapter_model.safetensors ----------------------
def peft_names(cfg):
    """[(peft's module name, our path to the adapted weight, its layer's index in a scanned stack or
    None, its input axes)] of every adapter: peft's lora_A.weight is our A^T [r, inputs], its
    lora_B.weight our B^T [outputs, r]."""
    out = []
    for i in range(cfg.num_layers):
        layer, idx = (("layers",), i) if cfg.scan_layers else (("layers", i), None)
        for name, (target, ins, peft) in LORA_WEIGHTS.items():
            if target in cfg.lora.targets:
                part = "attn" if peft.startswith("self_attn") else "mlp"
                out.append(
                    (
                        f"base_model.model.model.layers.{i}.{peft}",
                        ("trunk", *layer, part, name),
                        idx,
                        ins,
                    )
                )
    return out


def peft_config(cfg):
    """adapter_config.json of our adapters, as peft writes it for a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.load_hf or None,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(
            p.rsplit(".", 1)[1] for t, _, p in LORA_WEIGHTS.values() if t in cfg.lora.targets
        ),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def save_peft(cfg, params, out_dir, tokenizer=None):
    """mode=export of a LoRA run (lora.merge=false): a peft adapter directory, adapter_config.json
    and adapter_model.safetensors in peft's names, and the tokenizer's files. `params`: host arrays
    of the whole model (the base's are not written). Returns the tensors."""
    tensors = {}
    for module, path, i, _ in peft_names(cfg):
        a, b = (leaf(params, (*path[:-1], path[-1] + suffix)) for suffix in ADAPTER)
        a, b = (np.asarray(x if i is None else x[i]) for x in (a, b))
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(b.shape[0], -1).T)
    files = [
        "adapter_model.safetensors",
        "adapter_config.json",
        *(tokenizer.files if tokenizer else ()),
    ]
    clear_export(out_dir, files)
    blob = safetensors.numpy.save(tensors, metadata={"format": "pt"})
    data.write(os.path.join(out_dir, "adapter_model.safetensors"), blob)
    data.write(os.path.join(out_dir, "adapter_config.json"), json.dumps(peft_config(cfg), indent=2))
    for name, content in (tokenizer.files if tokenizer else {}).items():
        data.write(os.path.join(out_dir, name), content)
    return tensors


# peft options this trainer's adapters cannot express: (option, the value they take here)
PEFT_REFUSED = (
    ("use_dora", False),
    ("use_rslora", False),
    ("fan_in_fan_out", False),
    ("bias", "none"),
    ("modules_to_save", None),
    ("layers_to_transform", None),
    ("rank_pattern", {}),
    ("alpha_pattern", {}),
)


def peft_keys(conf, where):
    """An adapter_config.json -> {our lora key: value}; a ValueError naming the option this trainer
    does not run (DoRA, rsLoRA, biases, saved modules, per-layer ranks, modules it has not)."""
    if conf.get("peft_type") != "LORA":
        raise ValueError(
            f"{where}: peft_type={conf.get('peft_type')!r}; load_adapter reads LoRA adapters"
        )
    for option, plain in PEFT_REFUSED:
        if conf.get(option) not in (plain, None) and conf.get(option) != type(plain)():
            raise ValueError(
                f"{where}: {option}={conf[option]!r} is not supported here (this trainer's LoRA "
                f"is plain: {option}={plain!r})"
            )
    ours = {peft.rsplit(".", 1)[1]: target for target, _, peft in LORA_WEIGHTS.values()}
    wanted = conf.get("target_modules") or []
    if isinstance(wanted, str) or not all(m in ours for m in wanted):
        bad = wanted if isinstance(wanted, str) else next(m for m in wanted if m not in ours)
        raise ValueError(
            f"{where}: target_modules has {bad!r}; the projections here are {', '.join(ours)}"
        )
    return {
        "lora.rank": conf.get("r"),
        "lora.alpha": conf.get("lora_alpha", conf.get("r")),
        "lora.dropout": conf.get("lora_dropout", 0.0),
        "lora.targets": [ours[m] for m in ours if m in wanted],
    }


def load_pretrained(cfg, abstract):
    """load_hf's weights placed as the train state's `abstract` says (with LoRA its 'base'), and
    with load_adapter that peft adapter's as the adapters ('params')."""
    params = load_hf(cfg, cfg.load_hf, abstract.get("base", abstract["params"]))
    if not cfg.load_adapter:
        return params
    return joined(params, load_peft(cfg, data.hf_dir(cfg.load_adapter), abstract["params"]))


def exported(cfg):
    """What mode=export writes, in words."""
    if cfg.lora.rank and not cfg.lora.merge:
        return f"a peft LoRA adapter (r={cfg.lora.rank}, {', '.join(cfg.lora.targets)})"
    arch = hf_config(cfg)["architectures"][0]
    return f"a Hugging Face {arch} checkpoint ({cfg.weight_dtype}" + (
        ", LoRA merged)" if cfg.lora.rank else ")"
    )


def load_peft(cfg, folder, abstract_params):
    """load_adapter=DIR: its adapter_model.safetensors as our adapters, placed as abstract_params
    (the adapters' part of the train state) says; a DataError names what is missing or misshapen."""
    path = os.path.join(folder, "adapter_model.safetensors")
    try:
        tensors = safetensors_header(path)
    except (ValueError, *data.STORAGE_ERRORS) as e:
        raise data.DataError(f"load_adapter={folder}: {first_line(e)}") from None
    loaded = {}
    for module, where, i, ins in peft_names(cfg):
        for suffix, kind in zip(ADAPTER, ("lora_A", "lora_B")):
            name = f"{module}.{kind}.weight"
            if name not in tensors:
                raise data.DataError(f"load_adapter={folder}: {path} has no tensor {name}")
            entry = tensors[name]
            loaded.setdefault((*where[:-1], where[-1] + suffix), []).append((entry, suffix, i))

    def placed(keypath, a):
        entries = loaded[tuple(k.key for k in keypath)]
        stacked = cfg.scan_layers
        shape = a.shape[1:] if stacked else a.shape

        def part(
            entry, suffix
        ):  # peft [r, inputs] / [outputs, r] -> ours [inputs..., r] / [r, outputs...]
            w = hf_array(entry)
            if math.prod(w.shape) != math.prod(shape):
                raise data.DataError(
                    f"load_adapter={folder}: {entry} is {list(w.shape)} where this model takes "
                    f"{list(shape)}"
                )
            w = w.T
            return np.asarray(w.reshape(shape), a.dtype)

        def shard(index):
            if not stacked:
                return part(*entries[0][:2])[index]
            return np.stack([part(*entries[k][:2])[index[1:]] for k in range(a.shape[0])[index[0]]])

        return jax.make_array_from_callback(a.shape, a.sharding, shard)

    return jax.tree_util.tree_map_with_path(placed, abstract_params)


# ---- what train.py reads: the keys a run takes from the files it loads, the export --------------
# A value config.json gives out of a key's bounds (train.with_values formats it)
UNHOLDABLE = (
    "load_hf={cfg.load_hf}: config.json gives {error}: a model this trainer cannot hold, or a "
    "damaged file; give load_hf= another checkpoint"
)


def checkpoint_keys(cfg):
    """load_hf: the model's keys come from the checkpoint's config.json, so the user types none; a
    key they set that disagrees is one line naming both values, and a model this Transformer cannot
    run one line naming why. -> {key: value}"""
    keys = source_keys(
        cfg,
        "load_hf",
        ("config.json", "of a model config"),
        lambda conf, path: hf_keys(conf),
        "a Hugging Face checkpoint directory (config.json, model.safetensors) or a hub id",
    )
    values = data.flat(cfg.model_dump(mode="json"))
    for key, value in keys.items():
        mine = values[key] if key != "head_dim" else dims(cfg)  # head_dim=0: derived
        same = math.isclose(mine, value) if isinstance(value, float) else mine == value
        if key in cfg._given and not same:
            raise data.ConfigError(
                f"load_hf={cfg.load_hf}: its config.json has "
                f"{HF_KEYS.get(key, key)}={value} but {key}={mine} is set; drop {key}= "
                "(the checkpoint decides it)"
            )
    return keys


def source_keys(cfg, key, file, parse, give):
    """The keys a JSON file sets: `file` (its name, what it is) in the directory cfg.<key> names
    (load_hf, load_adapter), read and parse(json, path)'d; unreadable or malformed is one line
    naming the key and what to `give` instead."""
    name, what = file
    path = os.path.join(data.hf_dir(getattr(cfg, key)), name)
    try:
        return parse(data.read_json(path, what), path)
    except data.STORAGE_ERRORS as e:
        raise data.ConfigError(
            f"{key}={getattr(cfg, key)}: cannot read {path} ({data.storage_reason(e)}); give {give}"
        ) from None
    except ValueError as e:
        raise data.ConfigError(f"{key}={getattr(cfg, key)}: {e}") from None


def adapter_keys(cfg):
    """load_adapter: the lora keys come from its adapter_config.json (peft's); one the user set that
    disagrees, or a peft option this trainer's LoRA does not have, is one line. -> {key: value}"""
    keys = source_keys(
        cfg,
        "load_adapter",
        ("adapter_config.json", "of a peft adapter"),
        peft_keys,
        "a peft LoRA adapter directory (adapter_config.json, adapter_model.safetensors)",
    )
    values = data.flat(cfg.model_dump(mode="json"))
    for key, value in keys.items():
        mine = list(values[key]) if key == "lora.targets" else values[key]
        if key in cfg._given and mine != value:
            raise data.ConfigError(
                f"load_adapter={cfg.load_adapter}: its adapter_config.json makes {key}={value} but "
                f"{key}={mine} is set; drop {key}= (the adapter decides it)"
            )
    return keys


def export_hf(cfg, params, tokenizer, out_dir):
    """A Hugging Face checkpoint of params in out_dir (save_hf, or save_peft for LoRA's adapters):
    the family the model's options make, over the config.json of the load_hf checkpoint the run
    started from, with the run's tokenizer. -> the tensors written"""
    host = multihost_utils.process_allgather(params, tiled=True)  # whole arrays on every process
    config = os.path.join(data.hf_dir(cfg.load_hf), "config.json") if cfg.load_hf else None
    source = data.read_json(config) if config else None
    try:
        return save_hf(cfg, host, out_dir, tokenizer, source)
    except (data.WriteError, *data.STORAGE_ERRORS) as e:
        reason = e if isinstance(e, data.WriteError) else data.storage_reason(e)
        raise data.ConfigError(
            f"export_dir={out_dir}: cannot write there ({reason}); choose a writable directory"
        ) from None
    except ValueError as e:
        raise data.ConfigError(f"mode=export: {e}") from None


# ==================================================================================================
# The task interface: all train.py knows about what it trains.
# ==================================================================================================
class Own(NamedTuple):
    """What a task keeps beside the weights it trains, each part optional: the TRM's EMA and carry
    (train state, checkpointed), DPO's reference log-probabilities (computed once, in RUN_DIR)."""

    # (cfg, params, rows) -> train state entries beyond step/params/opt_state
    init: Callable = lambda cfg, params, rows: {}
    # their logical axes (PartitionSpecs), from the parameters'
    axes: Callable = lambda param_axes: {}
    # (cfg, state, A) -> [A, ...] arrays the step scans beside the microbatches (the TRM's carry)
    inputs: Callable = lambda cfg, state, A: {}
    # (cfg, state, new params, the loss's sums per microbatch [A, ...]) -> those entries updated
    update: Callable = lambda cfg, state, params, sums_A: {}
    # the state entry eval, generation and export read
    eval_weights: str = "params"
    # (cfg, graph, params, ds, start step, run_dir, over) -> a line to log, or None: what the task
    # computes once before it runs; over(step, params, batches_of, what=) runs a jitted step on
    # every host's batches (batches_of(rows per process)) -> (outputs, this host's batches)
    prepare: Callable = lambda *_: None


class Task(NamedTuple):
    """What differs between the language model and the puzzle heads. train.py picks one from TASKS
    by cfg.task and reads nothing else task-specific. Functions take the config first, then (graph,
    params) where they run the model; the defaults are what a task without more does. What a task
    keeps beyond its weights is its `own` (Own)."""

    # the nnx.Module, built as module(cfg, rngs)
    module: type
    # (cfg, graph, params, microbatch) -> (summed loss, sums): sums['weight'] is what the loss
    # stands for (the step divides by its total). A training microbatch also holds 'key' (its
    # random draws) and what own.inputs adds.
    loss: Callable
    # (cfg) -> training FLOPs per token
    flops_per_token: Callable
    # (cfg, graph, params, batch) -> {name: device array}; train.py jits it
    eval_step: Callable
    # (cfg, outs, batches, ds, save_to) -> eval metrics; host numpy in, every process
    eval_result: Callable
    # (cfg, graph, params, ds, rows) -> (summary, printed text, generation.txt text)
    generate: Callable
    # (cfg) -> '' or a one-line config error: the task's own rules
    check: Callable
    # (metric, format) pairs the progress line adds after the loss
    shown: tuple = ()
    # (cfg, process_index, process_count, log) -> its data; None: the text pipelines. The class
    # says what the data fixes in the config (data.fixed_by) and whether mode=eval reads it all.
    dataset: Callable = None
    # extra training metrics from the step's sums
    step_metrics: Callable = lambda sums, weight: {}
    # (cfg, graph, params, ds, save_to) -> metrics of mode=eval's answers, or {}
    answers: Callable = None
    # what it keeps beside the weights
    own: Own = Own()


LM = Task(
    module=Transformer,
    loss=lm_loss,
    flops_per_token=lm_flops_per_token,
    eval_step=lm_eval_step,
    eval_result=lm_eval_result,
    generate=lm_generate,
    check=lm_check,
    answers=lm_answers,
    shown=(
        ("eval_loss", "eval loss {:.4f}"),
        (
            "eval_rows_of",
            "on {m[eval_rows]}/{} rows ({m[eval_tokens]:.0f}/{m[eval_tokens_of]:.0f} tokens)",
        ),
    ),
)


# ==================================================================================================
# DPO (task=dpo): preference tuning on (chosen, rejected) pairs, as trl's DPOTrainer computes it.
# A row holds one pair (data.DPOData): chosen as segment 1, rejected as segment 2. Each side's
# log-probability is summed over its answer's tokens, for the policy and the reference (with LoRA:
# the base, its adapters off); the loss is -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))),
# its mean over the step's pairs.
# ==================================================================================================
def sides(values_BL, segments_BL):
    """(chosen [B], rejected [B]): a per-position value summed over each row's two sequences."""
    return tuple(jnp.sum(values_BL * (segments_BL == s), axis=-1) for s in (1, 2))


def dpo_logps(cfg, graph, params, mb, key=None):
    """(chosen [B], rejected [B]): each row's two answers' log-probabilities, summed over tokens."""
    logp_BL = -token_losses(cfg, graph, params, mb, key) * mb["loss_mask"]
    return sides(logp_BL, mb["segment_ids"])


def adapters_off(params):
    """The reference LoRA trains against: the same parameters with every adapter zero, which
    computes the base exactly (x W + scale (x A) 0)."""
    off = lambda path, x: jnp.zeros_like(x) if str(path[-1].key).endswith(ADAPTER) else x
    return jax.tree_util.tree_map_with_path(off, params)


def dpo_loss(cfg, graph, params, mb):
    """The step's sums over its pairs (padding rows hold none): the loss, and trl's rewards
    beta (pi - ref) for chosen and rejected, and how often chosen's is the higher. The reference:
    with LoRA the base, else the starting weights' log-probabilities in the rows (dpo_prepare)."""
    policy = dpo_logps(cfg, graph, params, mb, mb.get("key"))
    if cfg.lora.rank:
        reference = jax.lax.stop_gradient(dpo_logps(cfg, graph, adapters_off(params), mb))
    else:
        reference = sides(mb["reference"], mb["segment_ids"])
    chosen, rejected = (cfg.dpo.beta * (p - r) for p, r in zip(policy, reference))
    segments = mb["segment_ids"]
    answered = sides(mb["loss_mask"], segments)  # padding (an eval's too) answers nothing
    pair_B = ((answered[0] > 0) & (answered[1] > 0)).astype(jnp.float32)
    loss_B = -jax.nn.log_sigmoid(chosen - rejected)
    return jnp.sum(loss_B * pair_B), {
        "weight": jnp.sum(pair_B),
        "tokens": jnp.sum(segments > 0).astype(jnp.float32),
        "chosen": jnp.sum(chosen * pair_B),
        "rejected": jnp.sum(rejected * pair_B),
        "accurate": jnp.sum((chosen > rejected) * pair_B),
        "logps_chosen": jnp.sum(policy[0] * pair_B),
        "logps_rejected": jnp.sum(policy[1] * pair_B),
    }


def dpo_rewards(sums, pairs):
    """trl's reward metrics, means over the pairs, and its logps/*: the policy's summed answer
    log-probabilities (the chosen's falling while its reward rises is DPO's known displacement)."""
    chosen = sums["chosen"] / pairs
    rejected = sums["rejected"] / pairs
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": sums["accurate"] / pairs,
        "logps/chosen": sums["logps_chosen"] / pairs,
        "logps/rejected": sums["logps_rejected"] / pairs,
    }


def dpo_eval_step(cfg, graph, params, batch):
    loss, sums = dpo_loss(cfg, graph, params, batch)
    return {"loss": loss, **sums}


def dpo_eval_result(cfg, outs, batches, ds, save_to=None):
    """The held-out pairs' mean loss and rewards, and how many pairs of how many."""
    total = {k: float(sum(o[k] for o in outs)) for k in outs[0]}
    pairs = max(total["weight"], 1.0)
    rewards = {k: float(v) for k, v in dpo_rewards(total, pairs).items()}
    size = getattr(ds, "eval_size", {})
    return {"loss": total["loss"] / pairs, **rewards, "pairs": total["weight"], **size}


def dpo_check(cfg):
    """DPO's own rules: a message naming the key, or ''."""
    if cfg.dataset != "hf":
        return f"task=dpo reads preference pairs: set dataset=hf (dataset={cfg.dataset})"
    return ""


# ---- a full fine-tune's reference: computed once, kept in RUN_DIR --------------------------------
REFERENCE = "dpo_reference.npz"


def dpo_prepare(cfg, graph, params, ds, start, run_dir, over):
    """Without LoRA the reference is the starting weights: their log-probabilities of every pair,
    computed in one pass before step 1 (trl's precompute_ref_log_probs) and written to
    RUN_DIR/dpo_reference.npz, so no frozen copy sits beside the policy and a resume reads the same
    numbers. mode=eval reads the run's (or load_params' run's); where there is none, the reference
    is the weights evaluated (rewards 0: a starting point). With LoRA, the base: nothing to do."""
    if cfg.lora.rank or cfg.mode not in ("train", "eval"):
        return None
    held_only = cfg.mode == "eval"
    found, path = stored_reference(cfg, run_dir, start, ds, held_only)
    line = f"dpo: the reference log-probabilities read from {path}"
    if found is None:
        t0 = time.perf_counter()
        found = dpo_reference(cfg, graph, params, ds, over, held_only)
        pairs = f"{len(ds.eval_ids):,} held-out pairs"
        pairs = pairs if held_only else f"{len(ds.train_ids):,} training and {pairs}"
        line = f"dpo: the reference log-probabilities of {pairs}, from the starting weights"
        line += f" in one pass ({time.perf_counter() - t0:.1f}s)"
        if cfg.mode == "train":
            buffer = io.BytesIO()
            digests = {f"{k}_pairs": ds.pairs_digest(k == "held") for k in ("train", "held")}
            np.savez(buffer, train=found[0], held=found[1], **digests)
            data.write(os.path.join(run_dir, REFERENCE), buffer.getvalue())
            line += f", kept in {os.path.join(run_dir, REFERENCE)}"
        else:  # nothing stored: the weights evaluated are their own reference
            line += " (none stored: the weights evaluated are their own reference, rewards 0)"
    ds.with_reference(*found)
    return line


def dpo_reference(cfg, graph, params, ds, over, held_only):
    """The pass: ([train pairs, 2], [held-out pairs, 2]) summed log-probabilities (0 where none)."""
    numbered = lambda b: jnp.where(jnp.sum(b["loss_mask"], -1) > 0, b["example"][:, 0], -1)
    step = jax.jit(
        lambda p, b: {"logps": jnp.stack(dpo_logps(cfg, graph, p, b), -1), "n": numbered(b)}
    )
    outs, _ = over(step, params, lambda rows: ds.reference_rows(rows, held_only), what="reference")
    table = np.zeros((len(ds.train_tokens) + len(ds.eval_tokens), 2), np.float32)
    for out in outs:  # padding rows (numbered -1) left out
        table[out["n"][out["n"] >= 0]] = out["logps"][out["n"] >= 0]
    return table[: len(ds.train_tokens)], table[len(ds.train_tokens) :]


def stored_reference(cfg, run_dir, start, ds, held_only):
    """(a resume's reference (train: this run's; eval: its run's or load_params'), checked against
    the pairs it was computed on, its file); (None, None) for a fresh run, or an eval with none."""
    if cfg.mode == "train" and not start:
        return None, None
    places = [run_dir]
    if cfg.load_params:
        places.append(os.path.dirname(data.checkpoint_steps(cfg.load_params)[0]))
    files = [os.path.join(d, REFERENCE) for d in places]
    path = next((f for f in files if data.stored(f).exists()), None)
    if path is None and cfg.mode == "train":
        raise data.DataError(
            f"{files[0]} is missing: the reference log-probabilities this run computed at its "
            "start; start a new run_name with load_params=RUN_DIR (its reference: the weights it "
            "has now)"
        )
    if path is None:
        return None, None
    table = np.load(io.BytesIO(data.stored(path).read_bytes()))
    part = "held" if held_only else "train"
    if str(table[f"{part}_pairs"]) != ds.pairs_digest(held_only):
        raise data.DataError(
            f"{path}: its reference log-probabilities are of other pairs (the data, tokenizer or "
            f"max_target_length changed): {'evaluate' if held_only else 'resume'} with the data it "
            "was computed on, or start a new run_name with load_params=RUN_DIR"
        )
    return (table["train"], table["held"]), path


DPO = Task(
    module=Transformer,
    loss=dpo_loss,
    # the policy's forward and backward, and with LoRA the reference's forward
    flops_per_token=lambda cfg: lm_flops_per_token(cfg) * (4 / 3 if cfg.lora.rank else 1),
    eval_step=dpo_eval_step,
    eval_result=dpo_eval_result,
    generate=lm_generate,
    check=dpo_check,
    step_metrics=dpo_rewards,
    dataset=data.DPOData,
    own=Own(prepare=dpo_prepare),  # a full fine-tune's reference
    shown=(
        ("rewards/accuracies", "reward accuracy {:.1%}"),
        ("eval_loss", "eval loss {:.4f}"),
        ("eval_rewards/accuracies", "eval reward accuracy {:.1%}"),
        ("eval_rewards/margins", "margin {:.3f}"),
    ),
)


# ==================================================================================================
# TRM: the recursive head, its deep-supervision loss, and decoding by recursion.
# ==================================================================================================
class TRM(nnx.Module):
    """Tiny Recursive Model (Jolicoeur-Martineau 2025): one small bidirectional trunk
    `net` refines an answer state y and a latent z, given the puzzle embedding x. One
    call is one supervision step:

        T times:  n times z <- net(x + y + z);  then y <- net(y + z)

    The first T-1 cycles run under stop_gradient (cheap deep recursion, no backprop memory); only
    the last one learns. Returns the new (y, z) for the caller to carry (detached) into the next
    supervision step, the logits read from y, the halting logit q (q > 0: "this answer is right,
    stop") and the ToT value head's log value. noise=(keys [B], scale) adds scale x N(0, 1) to z
    after every update, drawn from each row's key (decoder=trm_parallel's perturbed trajectories;
    trm.train_noise in training)."""

    def __init__(self, cfg, rngs):
        D = cfg.d_model
        V = cfg.vocab_size
        wdt = jnp.dtype(cfg.weight_dtype)
        vector = lambda std: param(rngs, (D,), ("embed",), std, wdt)  # a [D] parameter
        self.cfg = cfg
        self.embed = param(rngs, (V, D), ("vocab", "embed"), 1.0, wdt)
        # Fresh slots (new puzzles) start from learned initial states; others continue their carry.
        self.y_init, self.z_init = vector(1.0), vector(1.0)
        # The trunk is pre-norm, so its residual stream would grow with every recursion;
        # normalising the output keeps y and z at unit scale however deep the recursion goes (TRM
        # uses post-norm for this).
        self.net, self.net_norm = (
            Trunk(cfg, rngs, causal=False, mixer=cfg.trm.mixer, length=SUDOKU_LEN),
            RMSNorm(cfg),
        )
        self.head = param(rngs, (D, V), ("embed", "vocab"), D**-0.5, wdt)
        # Halting head on the mean of y (no prefix token here to read position 0 from); bias -5
        # makes the untrained model keep going (sigmoid(-5) ~ 0.007) instead of halting at random.
        self.halt, self.halt_bias = vector(D**-0.5), param(rngs, (), (), None, wdt, fill=-5.0)
        # ToT value head: log P(every digit on the grid is right) = sum over cells of log
        # sigmoid(a per-cell logit). One wrong cell is local evidence; a product over cells lets
        # it veto the whole state, where a mean over cells would dilute it 81 times. Bias 5: an
        # untrained head says "~0.6 likely fine".
        self.value, self.value_bias = vector(D**-0.5), param(rngs, (), (), None, wdt, fill=5.0)

    def __call__(self, inputs_BL, positions_BL, segment_ids_BL, y_BLD, z_BLD, fresh_B, noise=None):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x_BLD = jnp.take(constrain(self.embed[...], (None, None)), inputs_BL, axis=0).astype(dt)
        y_BLD, z_BLD = (
            jnp.where(fresh_B[:, None, None], init[...].astype(dt), h.astype(dt))
            for init, h in ((self.y_init, y_BLD), (self.z_init, z_BLD))
        )
        net = lambda h_BLD: self.net_norm(self.net(h_BLD, positions_BL, segment_ids_BL)[0])

        # Gaussian noise on the latent, update i's own draw per row; noise = (keys [B], scale)
        def kick(z_BLD, i):
            draw = lambda k: jax.random.normal(
                jax.random.fold_in(k, i), z_BLD.shape[1:], z_BLD.dtype
            )
            return z_BLD + noise[1] * jax.vmap(draw)(noise[0])

        def cycle(y_BLD, z_BLD, t):
            for i in range(cfg.trm.n):
                z_BLD = net(x_BLD + y_BLD + z_BLD)
                z_BLD = z_BLD if noise is None else kick(z_BLD, t * cfg.trm.n + i)
            return net(y_BLD + z_BLD), z_BLD

        for t in range(cfg.trm.T - 1):
            y_BLD, z_BLD = cycle(y_BLD, z_BLD, t)
        # gradient through this one only
        y_BLD, z_BLD = cycle(*jax.lax.stop_gradient((y_BLD, z_BLD)), cfg.trm.T - 1)
        logits_BLV, y32_BLD = (
            product("bld,dv->blv", y_BLD, self.head[...], dt, jnp.float32),
            y_BLD.astype(jnp.float32),
        )
        q_B = jnp.mean(y32_BLD, axis=1) @ self.halt[...].astype(jnp.float32) + self.halt_bias[...]
        cell_BL = y32_BLD @ self.value[...].astype(jnp.float32) + self.value_bias[...]
        # log value: sum over cells
        return (
            y_BLD,
            z_BLD,
            logits_BLV,
            q_B,
            jnp.sum(jax.nn.log_sigmoid(cell_BL), axis=1),
        )


# The deep-supervision carry's logical axes ([A, B, ...]): it shards over the batch like data.
CARRY_AXES = {
    "y": PartitionSpec(None, "batch", "length", "embed"),
    "inputs": PartitionSpec(None, "batch", "length"),
    "z": PartitionSpec(None, "batch", "length", "embed"),
    "targets": PartitionSpec(None, "batch", "length"),
    "steps": PartitionSpec(None, "batch"),
    "halted": PartitionSpec(None, "batch"),
}


def trm_carry(cfg, A, B):
    """The deep-supervision carry, one slot per example row of a train step ([A, B, ...]): its
    puzzle, answer state y, latent z, supervision steps taken, and whether it halted (all start
    halted, so the first step fills every slot). Its axes are CARRY_AXES."""
    yz, grid = (
        jnp.zeros((A, B, SUDOKU_LEN, cfg.d_model), jnp.float32),
        jnp.zeros((A, B, SUDOKU_LEN), jnp.int32),
    )
    return {
        "y": yz,
        "z": yz,
        "inputs": grid,
        "targets": grid,
        "steps": jnp.zeros((A, B), jnp.int32),
        "halted": jnp.ones((A, B), bool),
    }


def trm_loss(cfg, graph, params, mb):
    """One supervision step for every slot of the carry (deep supervision with a fixed-shape batch):
    mb holds this microbatch's fresh puzzles, its slice of the carry, the step and a key (own.inputs
    puts them there); the sums hold the updated carry.

    Slots that halted last step take this step's fresh example from `mb` and restart from
    y_init/z_init; the others keep their puzzle and carry, so shapes never change and nothing
    recompiles. Loss per slot: mean cell cross-entropy + halt_loss_weight x BCE(q, whole grid
    right), plus the ToT value head's BCE on partial grids from tot.start_step on.
    trm.train_noise > 0 perturbs the latent z as decoder=trm_parallel does (each row and update
    its own draw, from `key`)."""
    t = cfg.trm
    carry, key, step = mb["carry"], mb["key"], mb["step"]
    fresh_B = carry["halted"]
    B = carry["halted"].shape[0]
    # A halted slot takes this step's fresh puzzle; the others keep theirs.
    inputs_BL, targets_BL = (
        jnp.where(fresh_B[:, None], mb[k], carry[k]) for k in ("inputs", "targets")
    )
    steps_B = jnp.where(fresh_B, 0, carry["steps"]) + 1
    noise = (
        (jax.random.split(jax.random.fold_in(key, 2), B), t.train_noise) if t.train_noise else None
    )
    y_BLD, z_BLD, logits_BLV, q_B, _ = nnx.merge(graph, params)(
        inputs_BL, mb["positions"], mb["segment_ids"], carry["y"], carry["z"], fresh_B, noise
    )
    ce_B = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean(axis=1)
    correct_B = jnp.all(jnp.argmax(logits_BLV, axis=-1) == targets_BL, axis=1)
    halt_bce_B = optax.sigmoid_binary_cross_entropy(q_B, correct_B.astype(jnp.float32))
    # Halt when the head says "right" (q > 0) or at N_sup. With halt_explore_prob a slot must
    # first reach a random 2..N_sup steps, so the later supervision steps (and the halting
    # head on them) get trained.
    k_explore, k_steps = jax.random.split(key)
    explore_B = jax.random.uniform(k_explore, (B,)) < t.halt_explore_prob
    min_steps_B = jnp.where(explore_B, jax.random.randint(k_steps, (B,), 2, t.N_sup + 1), 1)
    halted_B = (steps_B >= t.N_sup) | ((q_B > 0) & (steps_B >= min_steps_B))
    new_carry = {
        "y": y_BLD.astype(jnp.float32),
        "z": z_BLD.astype(jnp.float32),
        "inputs": inputs_BL,
        "targets": targets_BL,
        "steps": steps_B,
        "halted": halted_B,
    }
    sums = {
        "weight": jnp.float32(B),
        "tokens": jnp.float32(B * SUDOKU_LEN),
        "halted": jnp.sum(halted_B),
        "halt_steps": jnp.sum(jnp.where(halted_B, steps_B, 0)),
        "exact": jnp.sum(correct_B),
        "carry": jax.lax.stop_gradient(new_carry),  # no gradient from one step into the next
    }
    loss = jnp.sum(ce_B) + t.halt_loss_weight * jnp.sum(halt_bce_B)
    # ToT value head, on partial grids made from this microbatch's fresh puzzles
    if cfg.tot.loss_weight:
        # half the rows: 2/3 of the extra step time is enough examples for one bit
        half = max(B // 2, 1)

        def value_loss(_):
            grids_BL, label_B = partial_states(
                jax.random.fold_in(key, 1), mb["inputs"][:half] - 1, mb["targets"][:half] - 1
            )
            log_v_B = trm_steps(cfg, graph, params, grids_BL, cfg.tot.value_step).log_value_N
            return jnp.sum(value_bce(log_v_B, label_B)), jnp.sum(
                (log_v_B > jnp.log(0.5)) == label_B
            )

        def no_value_loss(_):  # before tot.start_step: no value pass
            return 0.0, 0

        # From tot.start_step on only: a real branch, so
        # earlier steps do not pay for the value pass.
        on = step >= cfg.tot.start_step
        v_loss, v_acc = jax.lax.cond(on, value_loss, no_value_loss, None)
        sums.update(value_acc=v_acc, value_rows=jnp.where(on, half, 0.0))
        loss += cfg.tot.loss_weight * v_loss
    return loss, sums


def ema_update(decay, step, ema, params):
    """ema <- d ema + (1 - d) params, with d = min(decay, (1 + step) / (10 + step)):
    early on the average forgets the random init quickly instead of dragging it along
    for ~1/(1 - decay) steps."""
    d = jnp.minimum(decay, (1.0 + step) / (10.0 + step))
    return jax.tree.map(lambda e, p: (d * e + (1 - d) * p).astype(e.dtype), ema, params)


# What trm_steps returns: predicted tokens after each supervision step, the digit
# log-probs after the last, the value head's log value after step min(tot.value_step,
# steps), halting logits after each.
TRMSteps = collections.namedtuple("TRMSteps", "preds_SNL logp_NLC log_value_N halt_SN")


def trm_steps(cfg, graph, params, grids_NL, steps, noise=None):
    """`steps` supervision steps from a fresh carry on digit grids (0 = blank), as TRMSteps.
    Only the log value of step v = min(tot.value_step, steps) is differentiable: the value loss
    trains through it. noise=(keys [N], scale): perturbed recursion (see TRM), each supervision
    step with its own draws."""
    N, L = grids_NL.shape
    rows = lambda x: jnp.broadcast_to(x, (N, L)).astype(jnp.int32)
    # padding rows: -1
    tokens = rows(grids_NL + 1)
    pos = rows(jnp.arange(L))
    seg = rows(grids_NL >= 0)
    v = min(cfg.tot.value_step, steps)

    # supervision step i, the model's parameters p; carry: y, z and the step's logits
    def step(p, carry, i):
        kick = (
            None
            if noise is None
            else (jax.vmap(lambda k: jax.random.fold_in(k, i))(noise[0]), noise[1])
        )
        # step 0 starts fresh, from y_init and z_init
        y, z, logits_NLV, q_N, log_v_N = nnx.merge(graph, p)(
            tokens, pos, seg, *carry[:2], jnp.full(N, i == 0), kick
        )
        carry = jax.lax.stop_gradient((y.astype(jnp.float32), z.astype(jnp.float32), logits_NLV))
        return carry, (jnp.argmax(logits_NLV, -1), log_v_N, q_N)

    # a scan body no gradient flows through
    fixed = functools.partial(step, jax.lax.stop_gradient(params))
    yz, i = jnp.zeros((N, L, cfg.d_model), jnp.float32), jnp.arange(steps)
    carry, before = jax.lax.scan(fixed, (yz, yz, jnp.zeros((N, L, cfg.vocab_size))), i[: v - 1])
    carry, at_v = step(params, carry, i[v - 1])
    carry, after = jax.lax.scan(fixed, carry, i[v:])
    preds_SNL, log_v_SN, q_SN = (
        jnp.concatenate([b, a[None], c]) for b, a, c in zip(before, at_v, after)
    )
    # Digit d is token d + 1: the nine digit logits
    # (the last step's, in the carry) are tokens 2..10.
    return TRMSteps(
        preds_SNL, jax.nn.log_softmax(carry[2][..., 2:11], axis=-1), log_v_SN[v - 1], q_SN
    )


def take_along(x, i, axis):
    """x's entries at indices i along `axis` (jnp.take_along_axis),
    i spread over x's further trailing axes."""
    return jnp.take_along_axis(x, i.reshape(*i.shape, *[1] * (x.ndim - i.ndim)), axis=axis)


def pick_answers(preds_SBJL, q_SBJ, rule):
    """trm.eval_halt's pick from J trajectories' answers [S, B, J, L] and halting logits q [S, B,
    J] (J = 1: decoder=trm) -> (each puzzle's answer as it stands after each step [S, B, L],
    forward passes per puzzle [B]). The (step, trajectory) pairs standing after step s: first:
    each trajectory's first step with q > 0 (it stops there), else step s | best, vote: every step
    up to s | last: step s. Of those the highest q wins; vote: of the answers that the most
    standing pairs with q > 0 give (ties, or no such pair: the highest q). Answers are compared
    whole; no Sudoku rule is used."""
    S, B, J, _L = preds_SBJL.shape
    preds_BML, q_BM = (
        jnp.swapaxes(x, 0, 1).reshape(B, S * J, *x.shape[3:]) for x in (preds_SBJL, q_SBJ)
    )
    halt_BJ = (
        jnp.argmax((q_SBJ > 0).at[-1].set(True), axis=0)
        if rule == "first"
        else jnp.full((B, J), S - 1)
    )
    # pair m = (step m // J, m % J)
    cap_BMS = jnp.tile(jnp.minimum(jnp.arange(S), halt_BJ[..., None]), (1, S, 1))
    step_M1 = (jnp.arange(S * J) // J)[:, None]
    stands_BMS = step_M1 <= cap_BMS if rule in ("best", "vote") else step_M1 == cap_BMS

    def votes(puzzle):
        # One puzzle: how many standing pairs with q > 0 give each pair's answer (compared whole).
        p_ML, right_M, stands_MS = puzzle
        same_MM = jnp.all(p_ML[:, None] == p_ML[None], -1) & right_M
        return same_MM.astype(jnp.float32) @ stands_MS.astype(jnp.float32)

    votes_BMS = jax.lax.map(votes, (preds_BML, q_BM > 0, stands_BMS)) if rule == "vote" else 0
    votes_BMS = jnp.where(stands_BMS, votes_BMS, -1)  # a pair not standing never wins
    pick_BS = jnp.argmax(
        jnp.where(votes_BMS == votes_BMS.max(1, keepdims=True), q_BM[..., None], -jnp.inf), axis=1
    )
    return take_along(preds_BML, pick_BS, 1).swapaxes(0, 1), jnp.sum(halt_BJ + 1, axis=1)


def parallel_decode(cfg, graph, params, q_BL, steps, plain=False, real_B=None):
    """decoder=trm_parallel: J = parallel.trajectories runs of the TRM per puzzle (plain: one,
    decoder=trm), the first without noise and the others with parallel.noise on the latent;
    trm.eval_halt picks the answer (pick_answers). With parallel.extra_trajectories E, a puzzle
    whose answer fewer than parallel.sure_votes (step, trajectory) pairs with q > 0 give runs E
    noisy trajectories more and is picked again from all J + E (adaptive width: only those puzzles
    pay for them); with parallel.budget, only the least sure of them that the batch's mean passes
    per puzzle (rows real_B) can pay for. No Sudoku rule is used. The draws depend on the puzzle and
    the trajectory, not on the batch. Returns (answers after each step [S, B, L], forward passes per
    puzzle [B]: every trajectory's)."""
    (_B, L), (J, E) = (
        q_BL.shape,
        (1, 0) if plain else (cfg.parallel.trajectories, cfg.parallel.extra_trajectories),
    )
    keys_BK = jax.vmap(
        lambda h: jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), h), J + E)
    )(puzzle_hash(q_BL))

    # answers [S, N, K, L], halting logits [S, N, K]; the first `clean` without noise
    def run(q_NL, keys_NK, clean):
        (N, K), noise = keys_NK.shape, jnp.arange(keys_NK.size) % keys_NK.shape[1] >= clean
        r = trm_steps(
            cfg,
            graph,
            params,
            jnp.repeat(q_NL, K, axis=0),
            steps,
            (keys_NK.reshape(N * K), noise[:, None, None] * cfg.parallel.noise)
            if J + E > 1
            else None,
        )
        return r.preds_SNL.reshape(steps, N, K, L), r.halt_SN.reshape(steps, N, K)

    preds_SBJL, q_SBJ = run(q_BL, keys_BK[:, :J], 1)
    answers_SBL, passes_B = pick_answers(preds_SBJL, q_SBJ, cfg.trm.eval_halt)
    votes_B = jnp.sum(jnp.all(preds_SBJL == answers_SBL[-1][:, None], -1) & (q_SBJ > 0), (0, 2))
    unsure_B = votes_B < cfg.parallel.sure_votes
    if cfg.parallel.budget and E:
        unsure_B = within_budget(
            cfg.parallel.budget, votes_B, unsure_B, passes_B, real_B, E * steps
        )

    def widen(puzzle):
        # One puzzle: only if unsure, E more trajectories, and its answer picked again from all.
        unsure, q_L, keys_E, p_SJL, q_SJ, a_SL = puzzle

        def repick():  # E more trajectories beside the J: the answer picked from all J + E
            more_S1EL, more_S1E = run(q_L[None], keys_E[None], 0)
            pool_S1JL = jnp.concatenate([p_SJL[:, None], more_S1EL], 2)
            pool_S1J = jnp.concatenate([q_SJ[:, None], more_S1E], 2)
            return pick_answers(pool_S1JL, pool_S1J, cfg.trm.eval_halt)[0][:, 0]

        def keep():  # sure already: the answer stands
            return a_SL

        return jax.lax.cond(unsure, repick, keep)

    xs = (
        unsure_B,
        q_BL,
        keys_BK[:, J:],
        preds_SBJL.swapaxes(0, 1),
        q_SBJ.swapaxes(0, 1),
        answers_SBL.swapaxes(0, 1),
    )
    return (
        jax.lax.map(widen, xs).swapaxes(0, 1) if E else answers_SBL
    ), passes_B + unsure_B * E * steps


def within_budget(budget, votes_B, unsure_B, passes_B, real_B, cost):
    """The unsure puzzles [B] that widen under a mean of `budget` forward passes per real puzzle:
    the fewest votes first, each widening costing `cost` passes, while the batch's total stays
    within budget x its real puzzles. Padding rows never widen."""
    real_B = jnp.ones_like(unsure_B) if real_B is None else real_B
    spare = budget * jnp.sum(real_B) - jnp.sum(jnp.where(real_B, passes_B, 0))
    wants_B = unsure_B & real_B
    rank_B = jnp.argsort(jnp.argsort(jnp.where(wants_B, votes_B, jnp.iinfo(jnp.int32).max)))
    return wants_B & (rank_B < spare // cost)


# ==================================================================================================
# ToT, part 1: the value head's training states. Grids are digits (0 = blank), as in data.py.
# ==================================================================================================
def partial_states(key, q_BL, a_BL, sparse_B=None):
    """ToT value-head examples from puzzles and solutions (digit grids): in half of the rows (odd
    rows, or `sparse_B`) up to a third of the givens blanked (states as sparse as the hardest
    puzzles'), then a random share of the blanks filled from the solution, and in half of the rows
    one blank set to a wrong digit, one that breaks no rule where the grid allows it (the mistakes a
    solver makes). Label: True = every digit agrees with the solution (for a unique-solution puzzle:
    the grid can still be completed)."""
    (B, L), (k_frac, k_fill, k_bad, k_cell, k_digit, k_drop) = q_BL.shape, jax.random.split(key, 6)
    sparse_B = jnp.arange(B) % 2 == 1 if sparse_B is None else sparse_B
    drop_BL = jax.random.uniform(k_drop, (B, L)) < jnp.where(sparse_B, 1 / 3, 0.0)[:, None]
    q_BL = jnp.where(drop_BL, 0, q_BL)
    blank_BL, rows = q_BL == 0, jnp.arange(B)
    fill_BL = blank_BL & (jax.random.uniform(k_fill, (B, L)) < jax.random.uniform(k_frac, (B, 1)))
    g_BL = jnp.where(fill_BL, a_BL, q_BL)
    bad_B = jax.random.bernoulli(k_bad, 0.5, (B,))
    # The wrong cell: a random blank, preferring filled ones (so right and wrong grids have as
    # many digits: the count must not give the label away) where some wrong digit clashes with
    # no peer (a quiet mistake).
    wrong_BLC = jnp.arange(1, 10) != a_BL[..., None]
    quiet_BLC = wrong_BLC & ~digits_seen(g_BL)
    pref_BL = blank_BL * (1.0 + 2.0 * fill_BL + jnp.any(quiet_BLC, axis=-1))
    cell_B = jnp.argmax(pref_BL + jax.random.uniform(k_cell, (B, L)), axis=1)
    # quiet ones where any
    pool_BLC = jnp.where(jnp.any(quiet_BLC, axis=-1, keepdims=True), quiet_BLC, wrong_BLC)
    digit_B = (
        jnp.argmax(
            jnp.where(pool_BLC[rows, cell_B], jax.random.uniform(k_digit, (B, 9)), -1.0), axis=1
        )
        + 1
    )
    g_BL = jnp.where(bad_B[:, None] & (jnp.arange(L) == cell_B[:, None]), digit_B[:, None], g_BL)
    return g_BL, ~bad_B


def puzzle_partial_states(key, q_BL, a_BL):
    """partial_states drawn per puzzle (its key folded with a hash of its givens, a coin
    for sparse or not), so eval's value_auroc does not depend on the batch size or on
    which rows a puzzle shares."""

    def one(q_L, a_L):
        k = jax.random.fold_in(key, puzzle_hash(q_L))
        # half the states sparse, as in training
        sparse = jax.random.bernoulli(jax.random.fold_in(k, 1))
        g, label = partial_states(k, q_L[None], a_L[None], sparse[None])
        return g[0], label[0]

    return jax.vmap(one)(q_BL, a_BL)


def value_bce(log_v_B, label_B):
    """Binary cross-entropy from log P(right): -log p
    for right grids, -log(1 - p) for wrong ones."""
    return -jnp.where(label_B, log_v_B, jnp.log(-jnp.expm1(jnp.minimum(log_v_B, -1e-6))))


def puzzle_hash(q_BL):
    """uint32[B]: a hash of each puzzle's givens. It seeds per-puzzle random draws (trm_parallel's
    noise, eval's value states), so a puzzle's result does not depend on the batch around it."""
    mix_L = jnp.arange(q_BL.shape[-1], dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
    return jnp.sum(q_BL.astype(jnp.uint32) * mix_L, axis=-1)


# ==================================================================================================
# ToT, part 2: decoding by search. The rule checks (data.digits_seen, dead_end, solved) are
# Long's Sudoku ToT checker, as masks; rules=False (tot.rule_checks=false) leaves the
# learned heads alone to decide.
# ==================================================================================================
def fill_forced(grids_NL):
    """Fills what the rules force, until nothing more is: a blank with one legal digit left (a
    naked single), and a digit with one legal cell left in a row, column or box (a hidden single).
    Costs no forward pass (tot.propagate). Contradictions it meets (two cells forced to one digit)
    are left for dead_end."""

    def fill(c):
        g_NL, ok_NLC = c[0], legal_digits(c[0])
        single_NUC = MEMBERS @ ok_NLC.astype(jnp.float32) == 1
        hidden_NLC = MEMBERS.T @ single_NUC.astype(jnp.float32) > 0
        forced_NLC = ok_NLC & ((jnp.sum(ok_NLC, axis=-1, keepdims=True) == 1) | hidden_NLC)
        new_NL = jnp.where(
            jnp.any(forced_NLC, axis=-1), jnp.argmax(forced_NLC, axis=-1) + 1, g_NL
        ).astype(g_NL.dtype)
        return new_NL, jnp.any(new_NL != g_NL)

    return jax.lax.while_loop(lambda c: c[1], fill, (grids_NL, jnp.bool_(True)))[0]


def finished(answer_NL, q_N, rules):
    """Whether a state's policy answer ends the search: it obeys the rules, or without rules, the
    halting head (a learned "this answer is right") says so, q > 0."""
    return solved(answer_NL) if rules else q_N > 0


def fill_argmax(grids_NL, logp_NLC):
    """Blanks left -> the policy's likeliest digit (how
    a search hands back a grid it did not finish)."""
    return jnp.where(grids_NL == 0, jnp.argmax(logp_NLC, axis=-1) + 1, grids_NL)


def shrinking_loop(body, c):
    """lax.while_loop(body) until every row's c['stop'], in which finished rows leave the batch:
    once at most a quarter of the rows still run, those rows are gathered into a batch a quarter the
    size (static shapes: 100 -> 25 -> 6 rows, each its own loop in the same compiled function) and
    scattered back at the end, so a few hard puzzles no longer drag a full batch through every step.
    Every entry of c has the batch as its first axis; body reads the batch size from its carry."""
    quarter = c["stop"].shape[0] // 4
    if quarter < 4:  # small enough: run to the end
        return jax.lax.while_loop(lambda c: ~jnp.all(c["stop"]), body, c)
    c = jax.lax.while_loop(lambda c: jnp.sum(~c["stop"]) > quarter, body, c)
    idx = jax.lax.top_k((~c["stop"]).astype(jnp.int32), quarter)[1]  # every row still running
    rest = shrinking_loop(body, jax.tree.map(lambda x: x[idx], c))
    return jax.tree.map(lambda x, r: x.at[idx].set(r), c, rest)


def propose_thoughts(g_L, logp_LC, E, cells, rules=True):
    """One state -> its E candidate grids (the surest blank cell at each of its E likeliest
    legal digits, plus the cells-1 next surest blanks at their argmax), their log-prob gain,
    and whether they exist."""
    # The moves that break no rule: a blank cell, a digit
    # no peer holds (without rules: any digit in a blank).
    legal_LC = legal_digits(g_L) if rules else (g_L == 0)[:, None]
    lp_LC = jnp.where(legal_LC, logp_LC, -jnp.inf)
    conf_L, best_L = jnp.max(lp_LC, axis=-1), jnp.argmax(lp_LC, axis=-1) + 1
    cell = jnp.argmax(conf_L)
    top_E, digit_E = jax.lax.top_k(lp_LC[cell], E)
    g_EL, gain_E = jnp.broadcast_to(g_L, (E, g_L.shape[0])).at[:, cell].set(digit_E + 1), top_E
    # The rest of the thought, the same for every digit: the most confident other blanks, at their
    # argmax.
    if cells > 1:
        more_v, more_i = jax.lax.top_k(conf_L.at[cell].set(-jnp.inf), cells - 1)
        g_EL = g_EL.at[:, more_i].set(jnp.where(more_v > -jnp.inf, best_L[more_i], g_EL[:, more_i]))
        gain_E = gain_E + jnp.sum(jnp.where(more_v > -jnp.inf, more_v, 0.0))
    return g_EL, gain_E, top_E > -jnp.inf


class Search(NamedTuple):
    """How tree_search expands and ranks states. The defaults are greedy decoding: one
    state, one one-cell thought a step, ranked by log-prob, until the grid is full (the
    puzzle's own pass + one per move)."""

    width: int = 1  # states expanded per step (beam_width)
    thoughts: int = 1  # candidates proposed per expanded state (thoughts_per_step)
    cells: int = 1  # cells one thought fills (thought_cells)
    max_depth: int = SUDOKU_LEN  # steps per puzzle at most
    max_thoughts: int = SUDOKU_LEN + 1  # states evaluated per puzzle at most
    score: str = "logp"  # 'value' | 'logp': see tree_search
    logp_weight: float = 0.0  # ranking: log value + this x the path's summed log-prob
    frontier: int = 0  # states held between steps (0 = width: a plain beam)
    rules: bool = True  # the Sudoku rules: legal moves, dead ends, a valid grid ends the search
    propagate: bool = False  # with rules: every state gets the moves the rules force


def tree_search(evaluate, q_BL, search):
    """Step-level beam search (Tree of Thoughts, BFS form) for a batch of puzzles, in one
    compiled function. evaluate(grids [N, L]) -> (log-probs [N, L, 9] of digits 1..9, log
    value [N], halting logit [N]).

    A thought fills `search.cells` blank cells: the state's most confident blank cell (highest top
    probability) with one of its `thoughts` most likely digits, plus the cells-1 next most confident
    blanks at their argmax. So the search branches where greedy decoding would commit, and keeps the
    alternatives while they are plausible. Every candidate of every state in the beam is evaluated
    (one forward pass each: the policy for its next thoughts and its value), duplicates are dropped,
    and the best `width` continue, ranked by `score` (cum = the path's summed log-prob):
      'value'    log value + logp_weight x cum: ToT
      'logp'     cum only (plain beam search, no value head)
    A `finished` grid ends a puzzle's search: a complete candidate, or any state's blanks filled by
    the policy's argmax (checked at every state, no extra pass); a complete one that is not is
    dropped. rules=False: no rule checks anywhere, the halting head decides what is finished.
    propagate: the root and every candidate get their forced moves before they are evaluated
    (fill_forced). A puzzle also stops after max_depth steps, once `max_thoughts` states were
    evaluated, or when its beam is empty. Shapes depend only on (batch, width, thoughts): one
    compile per batch size; finished puzzles are dropped from the batch in quarter steps inside it.

    frontier M > width keeps M states between steps instead of width (best-first search with
    backtracking, ToT's DFS/BFS in one): each step expands the best `width` states held, from any
    depth, and the M best of the rest and the new candidates are held. When every child of a path
    scores low, the search goes back to an earlier state. M = width (or 0) is the plain per-depth
    beam above. Returns (grids [B, L], states evaluated per puzzle [B]). Unsolved puzzles return the
    best candidate of the last step with its blanks filled by argmax."""
    B, M = q_BL.shape[0], max(search.frontier, search.width)  # M states held between steps
    q_BL = fill_forced(q_BL) if search.propagate else q_BL
    logp0_BLC, _, q0_B = evaluate(q_BL)
    held = {
        "grid": jnp.repeat(q_BL[:, None], M, axis=1),
        "logp": jnp.repeat(logp0_BLC[:, None], M, axis=1),
        "cum": jnp.zeros((B, M)),
        "score": jnp.full((B, M), -jnp.inf).at[:, 0].set(0.0),
    }
    fill0 = fill_argmax(q_BL, logp0_BLC)
    carry = {
        "held": held,
        "stop": finished(fill0, q0_B, search.rules),
        "answer": fill0,
        "evals": jnp.ones(B, jnp.int32),
        "depth": jnp.zeros(B, jnp.int32),
    }
    c = shrinking_loop(lambda c: search_step(evaluate, search, c), carry)
    return c["answer"], c["evals"]


def search_step(evaluate, search, c):
    """One step of tree_search for every puzzle of the carry c: expand the best held
    states, evaluate and rank their candidates, note a finished answer, hold the M best
    states for the next step."""
    g_BNL, cum_BN, alive_BN, rest = expand(c["held"], search)
    # B shrinks as finished puzzles leave (shrinking_loop)
    (B, N, L), live_B = (
        g_BNL.shape,
        ~c["stop"],
    )
    # One forward pass per candidate: log-probs [B, N, L, 9], log values and halting logits [B, N].
    logp_BNLC, logv_BN, q_BN = (
        x.reshape(B, N, *x.shape[1:]) for x in evaluate(g_BNL.reshape(B * N, L))
    )
    rank_BN = cum_BN if search.score == "logp" else logv_BN + search.logp_weight * cum_BN
    s_BN = jnp.where(alive_BN, rank_BN, -jnp.inf)
    # each state's policy answer: a valid one is the solution
    fill_BNL = fill_argmax(g_BNL, logp_BNLC)
    ok_BN = alive_BN & finished(fill_BNL, q_BN, search.rules)
    pick = lambda x, i_B: take_along(x, i_B[:, None], 1)[:, 0]
    # The answer so far: a finished one (the puzzle then
    # stops and keeps it), else the best candidate.
    # the best, before full-but-wrong grids are dropped
    best = pick(fill_BNL, jnp.argmax(s_BN, axis=1))
    best = jnp.where((live_B & jnp.any(alive_BN, axis=1))[:, None], best, c["answer"])
    found_B = live_B & jnp.any(ok_BN, axis=1)
    answer = jnp.where(found_B[:, None], pick(fill_BNL, jnp.argmax(ok_BN, axis=1)), best)
    # a full grid ended the search or broke a rule
    s_BN = jnp.where(jnp.all(g_BNL > 0, axis=-1), -jnp.inf, s_BN)
    # The M best of the new candidates (first: they win ties) and the states held but not expanded.
    pool = jax.tree.map(
        lambda n, o: jnp.concatenate([n, o], axis=1),
        {"grid": g_BNL, "logp": logp_BNLC, "cum": cum_BN, "score": s_BN},
        rest,
    )
    # A finished puzzle's held states change on like the
    # others': harmless, its answer and evals no longer do.
    top_BM, idx_BM = jax.lax.top_k(pool["score"], c["held"]["score"].shape[1])
    held = jax.tree.map(lambda x: take_along(x, idx_BM, 1), pool)
    evals, depth = c["evals"] + jnp.where(live_B, jnp.sum(alive_BN, axis=1), 0), c["depth"] + 1
    stop = (
        c["stop"]
        | found_B
        | (evals >= search.max_thoughts)
        | ~jnp.any(top_BM > -jnp.inf, axis=1)
        | (depth >= search.max_depth)
    )
    return {"held": held, "stop": stop, "answer": answer, "evals": evals, "depth": depth}


def expand(held, search):
    """The best `width` held states -> their candidates' grids [B, N, L], path log-probs [B, N] and
    whether they are alive [B, N] (N = width x thoughts; dead ends and repeated grids are not), and
    the held states left over."""
    B, L = held["grid"].shape[0], held["grid"].shape[-1]
    _, pop_BW = jax.lax.top_k(held["score"], search.width)
    bm = jax.tree.map(lambda x: take_along(x, pop_BW, 1), held)
    rest = dict(held, score=held["score"].at[jnp.arange(B)[:, None], pop_BW].set(-jnp.inf))
    propose = lambda g, lp: propose_thoughts(g, lp, search.thoughts, search.cells, search.rules)
    g, gain, ok = jax.vmap(jax.vmap(propose))(bm["grid"], bm["logp"])  # [B, W, E, ...]
    g_BNL = g.reshape(B, -1, L)  # N = width x thoughts
    g_BNL = fill_forced(g_BNL) if search.propagate else g_BNL
    alive_BN = (ok & (bm["score"][..., None] > -jnp.inf)).reshape(B, -1)
    if search.rules:  # drop a state no completion of which obeys the rules
        alive_BN &= ~dead_end(g_BNL)
    same_BNN = jnp.all(g_BNL[:, :, None] == g_BNL[:, None], axis=-1) & jnp.tri(
        g_BNL.shape[1], k=-1, dtype=bool
    )
    alive_BN &= ~jnp.any(same_BNN & alive_BN[:, None], axis=-1)  # keep the first copy of a grid
    return g_BNL, (bm["cum"][..., None] + gain).reshape(B, -1), alive_BN, rest


def depth_first_search(evaluate, q_BL, budget):
    """tot.search=dfs: a complete backtracking search over legal moves, the policy choosing where it
    branches and in which order (Tree of Thoughts' DFS form, every branch kept). evaluate as for
    tree_search; budget: states evaluated per puzzle at most.

    Every state is filled with what the rules force (fill_forced), then evaluated once. Its branch
    cell is its surest blank (the highest legal log-prob); its children are that cell at each legal
    digit, forced moves filled, dead ends dropped, in the policy's order. The search goes down the
    first child, and back up to the next one when a state's children are all tried. Every legal
    digit of the branch cell is tried, and fill_forced and dead_end only remove grids no solution
    passes through, so every puzzle that has a solution is solved unless the budget runs out first.
    The search stops at a state whose policy answer obeys the rules, or with every branch tried (no
    solution). The stack holds one state per level, at most 82. Returns (grids [B, L]: the solution,
    else the policy's answer at the last state evaluated; states evaluated per puzzle [B])."""
    B, L = q_BL.shape
    root_BL = fill_forced(q_BL)
    logp_BLC = evaluate(root_BL)[0]
    cell_B, order_B9, count_B = branch(root_BL, logp_BLC)
    answer_BL = fill_argmax(root_BL, logp_BLC)
    level = lambda x: jnp.zeros((B, L + 1, *x.shape[1:]), x.dtype).at[:, 0].set(x)
    c = {
        "grid": level(root_BL),
        "cell": level(cell_B),
        "order": level(order_B9),
        "count": level(count_B),
        "tried": jnp.zeros((B, L + 1), jnp.int32),
        "top": jnp.zeros(B, jnp.int32),
        "stop": solved(answer_BL) | dead_end(root_BL) | (budget <= 1),
        "answer": answer_BL,
        "evals": jnp.ones(B, jnp.int32),
    }
    c = shrinking_loop(lambda c: depth_first_step(evaluate, budget, c), c)
    return c["answer"], c["evals"]


def branch(g_BL, logp_BLC):
    """Where states [B, L] branch: the surest blank cell [B], its digits 0..8 in the policy's order,
    live children first [B, 9], and the number of live children [B] (a legal digit whose grid,
    forced moves filled, is no dead end)."""
    lp_BLC = jnp.where(legal_digits(g_BL), logp_BLC, -jnp.inf)
    cell_B = jnp.argmax(jnp.max(lp_BLC, axis=-1), axis=-1)
    lp_B9 = take_along(lp_BLC, cell_B[:, None], 1)[:, 0]
    kids_B9L = jnp.where(
        jnp.arange(g_BL.shape[1]) == cell_B[:, None, None],
        jnp.arange(1, 10)[:, None],
        g_BL[:, None],
    )
    live_B9 = (lp_B9 > -jnp.inf) & ~dead_end(
        fill_forced(kids_B9L.reshape(-1, g_BL.shape[1]))
    ).reshape(-1, 9)
    order_B9 = jnp.argsort(-jnp.where(live_B9, lp_B9, -jnp.inf), axis=-1, stable=True)
    return cell_B, order_B9.astype(jnp.int32), jnp.sum(live_B9, axis=-1, dtype=jnp.int32)


def depth_first_step(evaluate, budget, c):
    """One step of depth_first_search for every puzzle of the carry c: the top state's next child
    is evaluated and pushed (or, being a solution, ends the search); a state whose children are all
    tried is popped."""
    rows = jnp.arange(c["top"].shape[0])  # B shrinks as finished puzzles leave (shrinking_loop)
    at_top = lambda x: x[rows, c["top"]]
    live_B, go_B = ~c["stop"], at_top(c["tried"]) < at_top(c["count"])
    digit_B = at_top(c["order"])[rows, jnp.minimum(at_top(c["tried"]), 8)] + 1
    move_BL = jnp.arange(c["grid"].shape[-1]) == at_top(c["cell"])[:, None]
    child_BL = fill_forced(jnp.where(move_BL, digit_B[:, None], at_top(c["grid"])))
    logp_BLC = evaluate(child_BL)[0]
    answer_BL = fill_argmax(child_BL, logp_BLC)
    tries_B = live_B & go_B
    found_B = tries_B & solved(answer_BL)
    push_B = tries_B & ~found_B
    cell_B, order_B9, count_B = branch(child_BL, logp_BLC)
    up = jnp.minimum(c["top"] + 1, c["grid"].shape[1] - 1)
    put = lambda x, new: x.at[rows, up].set(
        jnp.where(push_B.reshape(-1, *[1] * (x.ndim - 2)), new, x[rows, up])
    )
    evals_B = c["evals"] + tries_B
    top_B = c["top"] + push_B - (live_B & ~go_B)
    return {
        "grid": put(c["grid"], child_BL),
        "cell": put(c["cell"], cell_B),
        "order": put(c["order"], order_B9),
        "count": put(c["count"], count_B),
        "tried": c["tried"]
        .at[rows, c["top"]]
        .add(tries_B)
        .at[rows, up]
        .set(jnp.where(push_B, 0, c["tried"][rows, up])),
        "top": top_B,
        "stop": c["stop"] | found_B | (top_B < 0) | (evals_B >= budget),
        "answer": jnp.where(tries_B[:, None], answer_BL, c["answer"]),
        "evals": evals_B,
    }


# ==================================================================================================
# The Sudoku task: the TRM's train state and metrics, decoding with cfg.decoder, host-side scoring.
# ==================================================================================================
def sudoku_search(cfg, decoder):
    """The Search a decoder runs, from base.yml's keys (greedy: the defaults, width one)."""
    rules = cfg.tot.rule_checks
    if decoder == "greedy":
        return Search(rules=rules, propagate=rules and cfg.tot.propagate)
    return Search(
        cfg.beam_width,
        cfg.thoughts_per_step,
        cfg.thought_cells,
        cfg.max_depth,
        cfg.max_thoughts,
        {"beam_logp": "logp", "tot": "value"}[decoder],
        cfg.tot.logp_weight,
        cfg.tot.frontier,
        rules,
        rules and cfg.tot.propagate,
    )


def sudoku_decode(cfg, graph, params, batch):
    """Decodes a token batch with cfg.decoder: {predicted tokens [S, B, L] (S = supervision steps
    for trm, 1 for the others), forward passes per puzzle [B], and the value head's log values and
    labels on partial grids made from the batch (for its AUROC)}."""
    q_BL = batch["inputs"] - 1
    if cfg.decoder.startswith("trm"):  # trm: the plain TRM, one trajectory without noise
        preds_SBL, passes_B = parallel_decode(
            cfg,
            graph,
            params,
            q_BL,
            cfg.trm.eval_steps or cfg.trm.N_sup,
            cfg.decoder == "trm",
            batch["segment_ids"][:, 0] > 0 if "segment_ids" in batch else None,
        )
    else:  # a search: each state it evaluates runs this many supervision steps (dfs: the policy's)
        dfs = cfg.decoder == "tot" and cfg.tot.search == "dfs" and cfg.tot.rule_checks
        steps = cfg.tot.policy_steps if dfs else max(cfg.tot.policy_steps, cfg.tot.value_step)

        def evaluate(g_NL):  # -> digit log-probs, log value, halting logit after the last step
            run = trm_steps(cfg, graph, params, g_NL, steps)
            return run.logp_NLC, run.log_value_N, run.halt_SN[-1]

        grids_BL, evals_B = (
            depth_first_search(evaluate, q_BL, cfg.max_thoughts)
            if dfs
            else tree_search(evaluate, q_BL, sudoku_search(cfg, cfg.decoder))
        )
        preds_SBL, passes_B = grids_BL[None] + 1, evals_B * steps
    partial_BL, label_B = puzzle_partial_states(
        jax.random.key(cfg.seed), q_BL, batch["targets"] - 1
    )
    log_value_B = trm_steps(cfg, graph, params, partial_BL, cfg.tot.value_step).log_value_N
    return {
        "preds_SBL": preds_SBL,
        "passes_B": passes_B,
        "log_value_B": log_value_B,
        "label_B": label_B,
    }


def sudoku_scores(preds_SBL, batch):
    """Host-side scoring of one eval batch: {exact solves per step [S], right blank cells per step
    [S], blank cells, puzzles, final digit grids [B, L]}. Padding rows are skipped; givens are
    copied from the puzzle whatever the model said; a grid counts as solved only if it obeys the
    Sudoku rules and equals the label."""
    real = batch["segment_ids"][:, 0] > 0
    # tokens -> digits, 0 = blank
    q_BL, a_BL = (
        batch["inputs"][real] - 1,
        batch["targets"][real] - 1,
    )
    blank_BL = q_BL == 0
    grids_SBL = np.where(blank_BL, np.asarray(preds_SBL)[:, real] - 1, q_BL)
    valid_SB = solved(grids_SBL.reshape(-1, SUDOKU_LEN)).reshape(grids_SBL.shape[:2])
    return {
        "exact_S": ((grids_SBL == a_BL).all(-1) & valid_SB).sum(1),
        "cells_S": ((grids_SBL == a_BL) & blank_BL).sum((1, 2)),
        "blanks": blank_BL.sum(),
        "puzzles": len(q_BL),
        "grids_BL": np.clip(grids_SBL[-1], 0, 9),
    }


def auroc(scores, labels):
    """Area under the ROC curve: the chance a random positive scores above a random negative."""
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(np.mean((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])))


def sudoku_eval_result(cfg, outs, batches, ds, save_to=None):
    """Exact (whole grid) and cell accuracy, forward passes and the value head's AUROC over
    every batch, with per-step accuracies for decoder=trm; save_to: also the answers, in
    eval-file order, as a CSV."""
    scores = [sudoku_scores(o["preds_SBL"], b) for o, b in zip(outs, batches)]
    total = {k: sum(sc[k] for sc in scores) for k in ("exact_S", "cells_S", "blanks", "puzzles")}
    if save_to:  # the answers themselves, givens as in the puzzle
        grids = np.concatenate([sc["grids_BL"] for sc in scores])[: len(ds.eval_q)]
        data.write_sudoku_csv(os.path.join(save_to, "predictions.csv"), ds.eval_q, grids)
    exact_S, cells_S = (
        total["exact_S"] / max(total["puzzles"], 1),
        total["cells_S"] / max(total["blanks"], 1),
    )
    # real rows
    cat = lambda k: np.concatenate(
        [o[k][b["segment_ids"][:, 0] > 0] for o, b in zip(outs, batches)]
    )
    result = {
        "exact_accuracy": float(exact_S[-1]),
        "cell_accuracy": float(cells_S[-1]),
        "num_puzzles": int(total["puzzles"]),
        "decoder": cfg.decoder,
        "forward_passes": float(np.mean(cat("passes_B"))),
        "forward_passes_max": int(np.max(cat("passes_B"), initial=0)),
        "value_auroc": auroc(cat("log_value_B"), cat("label_B").astype(bool)),
    }
    if len(exact_S) > 1:  # does recursion help? accuracy after each supervision step
        result.update(
            exact_accuracy_per_step=[round(float(e), 4) for e in exact_S],
            cell_accuracy_per_step=[round(float(c), 4) for c in cells_S],
        )
    return result


def sudoku_generate(cfg, graph, params, ds, rows):
    """mode=generate: the grid for the puzzle given as prompt=, givens kept, checked against the
    rules. The puzzle fills all `rows` rows, so the batch divides the mesh."""
    q_L = data.parse_grid(cfg.prompt)
    tokens = np.tile(q_L + 1, (rows, 1)).astype(np.int32)
    batch = {
        "inputs": tokens,
        "targets": tokens,
    }  # targets unknown: only the value AUROC reads them
    preds_L = (
        np.asarray(
            jax.jit(lambda p, b: sudoku_decode(cfg, graph, p, b))(params, batch)["preds_SBL"]
        )[-1, 0]
        - 1
    )
    grid_L = np.where(q_L == 0, np.clip(preds_L, 0, 9), q_L)
    valid = bool(solved(grid_L[None])[0])
    shown = "\n".join(" ".join(map(str, grid_L[r * 9 : (r + 1) * 9])) for r in range(9))
    shown += f"\n{'a valid solution' if valid else 'NOT a valid solution'} (decoder={cfg.decoder})"
    return (
        {"solution": "".join(map(str, grid_L)), "valid": valid},
        shown,
        "".join(map(str, grid_L)) + "\n",
    )


def sudoku_check(cfg):
    """The puzzle task's own config rules: a message naming the key, or ''."""
    if cfg.mode == "export" or cfg.load_hf:
        return (
            f"{'mode=export' if cfg.mode == 'export' else 'load_hf'} is for task=lm "
            "(a TRM solver has no HF form)"
        )
    width = cfg.parallel.trajectories * (cfg.trm.eval_steps or cfg.trm.N_sup)
    if cfg.decoder == "trm_parallel" and 0 < cfg.parallel.budget < width:
        return (
            f"parallel.budget={cfg.parallel.budget}: below the {width} forward passes every "
            "puzzle runs (parallel.trajectories x trm.eval_steps or trm.N_sup); raise it or "
            "run fewer trajectories"
        )
    if cfg.mode == "generate" and data.parse_grid(cfg.prompt) is None:
        return (
            f"prompt={cfg.prompt!r}: give the puzzle as 81 characters, "
            "digits 1-9 and . or 0 for blanks, row by row"
        )
    return ""


def trm_flops_per_token(cfg):
    """Training FLOPs per cell per supervision step: T(n+1) forward net calls, of which the
    last n+1 also run backward (2x), attention bidirectional over the 81 cells (the MLP mixer
    counted as attention)."""
    # (T + 2)(n + 1) = T(n + 1) forward calls + 2(n + 1) backward; the head 3 x 2 dV
    T, n = (
        cfg.trm.T,
        cfg.trm.n,
    )
    return (T + 2) * (n + 1) * cfg.num_layers * layer_flops(
        cfg, SUDOKU_LEN, False
    ) + 6 * cfg.d_model * cfg.vocab_size


def trm_step_metrics(sums, weight):
    """Halting and solving rates of the step's slots, and
    the value head's accuracy (NaN before it trains)."""
    out = {
        "halt_rate": sums["halted"] / weight,
        "train_exact": sums["exact"] / weight,
        "sup_steps": sums["halt_steps"] / jnp.maximum(sums["halted"], 1),
    }
    if "value_acc" in sums:  # share of partial grids the value head calls right (p > 0.5 iff right)
        out["value_acc"] = jnp.where(
            sums["value_rows"] > 0, sums["value_acc"] / jnp.maximum(sums["value_rows"], 1), jnp.nan
        )
    return out


SUDOKU = Task(
    module=TRM,
    loss=trm_loss,
    flops_per_token=trm_flops_per_token,
    step_metrics=trm_step_metrics,
    eval_step=sudoku_decode,
    eval_result=sudoku_eval_result,
    generate=sudoku_generate,
    check=sudoku_check,
    dataset=data.SudokuData,
    shown=(
        ("train_exact", "solved {:.1%}"),
        ("eval_exact_accuracy", "eval solved {:.1%}"),
        ("eval_cell_accuracy", "cells {:.1%}"),
    ),
    own=Own(  # the EMA and the carry are train state: checkpointed, so a resume is exact
        init=lambda cfg, params, rows: {
            "ema": params,
            "carry": trm_carry(cfg, cfg.grad_accum, rows),
        },
        axes=lambda param_axes: {"ema": param_axes, "carry": CARRY_AXES},
        inputs=lambda cfg, state, A: {
            "carry": state["carry"],
            "step": jnp.broadcast_to(state["step"], (A,)),
        },
        update=lambda cfg, state, params, sums_A: {
            "carry": sums_A["carry"],
            "ema": ema_update(cfg.trm.ema_decay, state["step"], state["ema"], params),
        },
        eval_weights="ema",
    ),
)

TASKS = {"lm": LM, "sudoku": SUDOKU, "dpo": DPO}
