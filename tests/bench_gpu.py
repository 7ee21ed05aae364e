"""One-GPU benchmark: the README's "1x H100 / H200 GPU" row, this trainer vs transformers + torch.

Run by hand on the GPU machine, from the repository root, with the machine's python (jax with CUDA,
torch and transformers installed; no network needed), in at most ~8 minutes:

    python tests/bench_gpu.py                # --steps 12 for a shorter run

and on CPU, a tiny model through the same code (the test suite runs this; torch optional):

    JAX_PLATFORMS=cpu python tests/bench_gpu.py --tiny

What it does, in order:
1. our trainer (`train.py base.yml dataset=synthetic`, the README row, steps/log/eval/checkpoint
   keys, a temp dir) in a subprocess; its `model:`, `step compiled in`, `benchmark:` lines parsed;
2. transformers' LlamaForCausalLM with the same dims (GQA, SwiGLU, untied embeddings, RoPE base and
   norm eps from base.yml), sdpa attention, bf16 autocast, torch.compile, AdamW with base.yml's
   hyperparameters, schedule and clipping, on the trainer's own synthetic tokens, the same batch
   (per_device_batch x grad_accum microbatches); alternating with ours (ours, torch, ours, torch).
   Its tokens/s and MFU use our trainer's FLOPs per token and our trainer's peak (the GPU's bf16
   spec-sheet figure; a measured matmul where the GPU is not in its table);
3. a check: attention=cudnn (--tiny: einsum) against attention=xla, the first step's loss and
   gradient norm from metrics.jsonl, equal within bf16 rounding (rtol 2e-2).

It prints a progress line per run, `check: ...`, then one table: date, host, GPU and driver
(nvidia-smi), versions (jax, jaxlib, CUDA plugin, cuDNN, torch, transformers, CUDA), the model,
median step time, tokens/s, TFLOP/s, MFU, compile + first step, memory, final loss of each side,
and the ratios ours / torch. Exit 0; 1 if the check fails or a run fails (its output's tail
printed; a failed torch or check run still leaves the rest of the table). Without torch or
transformers the torch side is skipped with a line saying so. The helpers shared with the CPU
benchmark come from bench_torch.py (`machine`, `median_of`).
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch

ROOT = bench_torch.ROOT
# The README's "1x H100 / H200 GPU" row, verbatim.
GPU_ROW = {
    "mesh": "1,1,1",
    "per_device_batch": 8,
    "grad_accum": 4,
    "dtype": "bfloat16",
    "remat": "save_dots",
    "attention": "cudnn",
    "d_model": 2048,
    "num_layers": 16,
    "num_heads": 16,
    "num_kv_heads": 8,
    "mlp_dim": 5632,
    "vocab_size": 32768,
    "max_target_length": 2048,
}
# The same recipe at a size a 2-core CPU trains in seconds; einsum is the CPU's attention.
TINY_ROW = {
    **GPU_ROW,
    "per_device_batch": 2,
    "grad_accum": 2,
    "dtype": "float32",
    "attention": "einsum",
    "d_model": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "mlp_dim": 128,
    "vocab_size": 256,
    "max_target_length": 64,
}
# torch steps left out of its median: the first compiles, the second allocates the optimizer state.
TORCH_WARMUP = 2
START = time.perf_counter()
RTOL = 2e-2  # bf16 keeps 8 bits of mantissa: two attention kernels' sums differ by ~1e-2 relative


class Failed(Exception):
    """A run that exited non-zero (its output's tail already printed)."""


def say(line):
    """A progress line, with the minutes since start (the budget on one GPU is 8)."""
    print(f"{line}  [{(time.perf_counter() - START) / 60:.1f} min]", flush=True)


def keys(row, **more):
    return [f"{k}={v}" for k, v in {**row, **more}.items()]


def run_trainer(row, out, name, steps, log_every):
    """Our trainer in a subprocess: (stdout, run directory). bench_torch.run_ours drops stdout, and
    this benchmark needs more of it (the compile and memory lines), so it is not reused here."""
    args = keys(
        row,
        dataset="synthetic",
        steps=steps,
        log_every=log_every,
        eval_batches=0,
        checkpoint_every=0,
        resume="false",
        output_dir=out,
        run_name=name,
        cache_dir=os.path.join(out, "cache"),
        # a rerun of the same program loads it: only the first run of each pays the compile
        compile_cache_dir=os.path.join(out, "jax-cache"),
    )
    p = subprocess.run(
        [sys.executable, "train.py", "base.yml", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        raise Failed(f"trainer failed (exit {p.returncode}): train.py base.yml {' '.join(args)}")
    return p.stdout, os.path.join(out, name)


def find(pattern, text, default=None):
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1) if m else default


def parse_ours(out):
    """The figures of our trainer's log: `model:`, `step compiled in` and `benchmark:` lines."""
    bench = next(x for x in out.splitlines() if x.startswith("benchmark:"))
    num = lambda pat, text=bench: float(find(pat, text).replace(",", ""))
    mem = find(r"device peak ([\d.]+) GiB", bench)
    done = json.loads(find(r"^done: (\{.*\})$", out, "{}"))
    return {
        "params_m": num(r"model: ([\d.]+)M parameters", out),
        "flops_per_token": num(r"([\d.]+) MFLOPs per token", out) * 1e6,
        "xla_compile_s": num(r"step compiled.*? in ([\d.]+)s;", out),
        "compiled_gb": num(r"compiled per device: .* = ([\d.]+) GiB", out),
        "step_s": num(r"median ([\d.]+) s/step"),
        "tokens_s": num(r"= ([\d,]+) tokens/s"),
        "tflops": num(r"([\d.]+) TFLOP/s per device"),
        "mfu": num(r"MFU ([\d.]+)%") / 100,
        "peak": num(r" of ([\d.]+) TFLOP/s"),
        "peak_source": find(r"TFLOP/s \((.*?)\); compile", bench),
        "compile_s": num(r"compile \+ first step ([\d.]+)s"),
        "mem_gb": float(mem) if mem else None,
        "loss": done.get("loss"),
    }


def write_tokens(row, steps, path, out):
    """The trainer's own synthetic microbatches for `steps` updates, [steps x grad_accum, B, L], for
    the torch side; also returns the trainer's config (its optimizer keys are torch's too)."""
    import jax
    import numpy as np

    # this process only reads the data pipeline: the GPU stays whole for the runs
    jax.config.update("jax_platforms", "cpu")
    sys.path.insert(0, ROOT)
    import data
    import train

    more = keys(row, dataset="synthetic", cache_dir=os.path.join(out, "cache"))
    cfg = train.load_config(os.path.join(ROOT, "base.yml"), more)
    it = data.make_dataset(cfg).train_iter(cfg.per_device_batch)
    mbs = [next(it) for _ in range(steps * cfg.grad_accum)]
    it.close()
    np.savez(path, **{k: np.stack([b[k] for b in mbs]) for k in ("inputs", "targets")})
    return cfg


def torch_spec(cfg, steps, flops, peak, gpu):
    """What the torch worker needs, from the trainer's config: dims, optimizer, schedule."""
    names = (
        *("vocab_size", "d_model", "mlp_dim", "num_layers", "num_heads", "num_kv_heads"),
        *("max_target_length", "rope_theta", "norm_eps", "grad_accum", "dtype"),
        *("learning_rate", "adam_b1", "adam_b2", "adam_eps", "weight_decay", "grad_clip"),
        *("warmup_steps", "min_lr_ratio", "tie_embeddings"),
    )
    return {
        **{k: getattr(cfg, k) for k in names},
        "steps": steps,
        "flops": flops,
        "peak": peak,
        "gpu": gpu,
    }


# ---- the torch side (this file with --worker, in its own process) -----------------------------
def llama(torch, transformers, s, dev):
    """LlamaForCausalLM with our dims, built on the device (no host copy of 0.9B weights)."""
    conf = transformers.LlamaConfig(
        vocab_size=s["vocab_size"],
        hidden_size=s["d_model"],
        intermediate_size=s["mlp_dim"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        max_position_embeddings=s["max_target_length"],
        rope_theta=s["rope_theta"],
        rms_norm_eps=s["norm_eps"],
        tie_word_embeddings=s["tie_embeddings"],  # base.yml: untied
        use_cache=False,  # training: no KV cache built each forward
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(dev):
        return transformers.LlamaForCausalLM(conf).train()


def adamw(torch, model, s, dev):
    """base.yml's AdamW: decay on matrices only (ours masks norm scales), warmup + cosine as optax's
    warmup_cosine_decay_schedule with the trainer's decay_steps."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": s["weight_decay"]},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=s["learning_rate"],
        betas=(s["adam_b1"], s["adam_b2"]),
        eps=s["adam_eps"],
        fused=True if dev == "cuda" else None,  # the fastest AdamW torch has on a GPU
    )
    w, end = s["warmup_steps"], s["min_lr_ratio"]
    decay = max(s["steps"] - 1, w + 1) - w

    def factor(n):
        if n < w:
            return n / w
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * min(n - w, decay) / decay))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def torch_steps(torch, model, s, dev, tokens):
    """Every update: grad_accum microbatches (mean loss), clip, AdamW. Returns the seconds of each
    update, the last loss and the tokens per update."""
    import numpy as np

    opt, sched = adamw(torch, model, s, dev)
    bf16 = s["dtype"] == "bfloat16"

    def loss_fn(inputs, targets):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1)
        )

    fwd = torch.compile(loss_fn)
    toks = np.load(tokens)
    # on the device before the clock starts, as ours prefetches its batches
    inputs, targets = (torch.from_numpy(toks[k]).long().to(dev) for k in ("inputs", "targets"))
    accum, times = s["grad_accum"], []
    for step in range(len(inputs) // accum):
        t0 = time.perf_counter()
        loss = 0.0
        for k in range(step * accum, (step + 1) * accum):
            part = fwd(inputs[k], targets[k]) / accum
            part.backward()
            loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = float(loss)
        if dev == "cuda":  # the update's kernels done, not just queued
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, loss, accum * inputs.shape[1] * inputs.shape[2]


def worker(spec, tokens):
    """Prints one JSON line: the torch side's figures, or why it was skipped."""
    try:
        import torch
        import transformers
    except ImportError as e:
        why = f"import torch, transformers failed ({type(e).__name__}: {e})"
        return print(json.dumps({"skipped": why}))
    s = json.loads(spec)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if s["gpu"] and dev == "cpu":  # the 0.9B model on a CPU would take hours, not minutes
        return print(json.dumps({"skipped": f"torch {torch.__version__} sees no CUDA device"}))
    times, loss, n = torch_steps(torch, llama(torch, transformers, s, dev), s, dev, tokens)
    timed = sorted(times[TORCH_WARMUP:])
    step = timed[len(timed) // 2]
    cuda = dev == "cuda"
    versions = (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}), transformers {transformers.__version__}"
    )
    r = {
        "step_s": step,
        "tokens_s": n / step,
        "tflops": n / step * s["flops"] / 1e12,
        "mfu": n / step * s["flops"] / s["peak"],
        "peak": s["peak"] / 1e12,
        "compile_s": times[0],
        "timed": len(timed),
        "loss": loss,
        "mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": versions,
    }
    print(json.dumps(r))


# ---- the parent: runs, check, table -------------------------------------------------------------
def run_torch(spec, tokens):
    """The torch side in a process of its own (its compile and CUDA memory apart from ours)."""
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), tokens],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:  # ours' figures and the check still come: the GPU is lent rarely
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"skipped": f"torch worker failed (exit {p.returncode}): {last}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def first_step(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    return row["loss"], row["grad_norm"]


def check(row, out):
    """The row's attention against attention=xla: one step each on the same first batch."""
    got = {}
    for attention in (row["attention"], "xla"):
        try:
            run = run_trainer({**row, "attention": attention}, out, f"check-{attention}", 1, 1)
        except Failed as e:
            say(f"check: {e}")
            return False, f"attention={attention} failed: see its output above"
        got[attention] = first_step(run[1])
    (la, ga), (lb, gb) = got.values()
    ok = math.isclose(la, lb, rel_tol=RTOL) and math.isclose(ga, gb, rel_tol=RTOL)
    line = (
        f"attention={row['attention']} vs xla, first step: loss {la:.5f} vs {lb:.5f}, "
        f"grad norm {ga:.5f} vs {gb:.5f}: {'equal' if ok else 'NOT equal'} (rtol {RTOL:g})"
    )
    say(f"check: {line}")
    return ok, line


def nvidia_smi():
    """The GPU's name, memory, driver and CUDA version from nvidia-smi, or why there is none."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "none (nvidia-smi absent)"
    q = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    p = subprocess.run([smi, *q], capture_output=True, text=True, check=False)
    if p.returncode or not p.stdout.strip():
        return f"nvidia-smi failed: {(p.stdout + p.stderr).strip()[:200]}"
    head = subprocess.run([smi], capture_output=True, text=True, check=False).stdout
    cuda = find(r"CUDA Version: ([\d.]+)", head, "?")
    name, mem, driver = (x.strip() for x in p.stdout.splitlines()[0].split(","))
    return f"{name}, {mem}, driver {driver}, CUDA {cuda}"


def jax_versions():
    """jax, jaxlib and whichever CUDA plugin and cuDNN wheels are installed, from their metadata:
    importing jax here would not name the plugin."""
    found = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    plugins = sorted(n for n in found if re.match(r"jax[-_]cuda|nvidia-cudnn", n))
    return ", ".join(f"{n} {found[n]}" for n in ["jax", "jaxlib", *plugins] if n in found)


def median_row(runs):
    """bench_torch.median_of over the runs; the compile of the first run (later ones hit caches),
    the largest memory, the last run's loss."""
    row = bench_torch.median_of(runs)
    mems = [r["mem_gb"] for r in runs if r.get("mem_gb") is not None]
    row.update(compile_s=runs[0]["compile_s"], mem_gb=max(mems, default=None))
    return {**row, "loss": runs[-1]["loss"]}


def fmt(v, spec, unit=""):
    return "n/a" if v is None else format(v, spec) + unit


def ours_line(r):
    """One ours run's figures: the benchmark line's, the compile line's and the memory."""
    return (
        f"{r['step_s']:.3f} s/step, {r['tokens_s']:,.0f} tokens/s, {r['tflops']:.3f} TFLOP/s, "
        f"MFU {r['mfu']:.1%} of {r['peak']:.3f} TFLOP/s ({r['peak_source']}); step compiled in "
        f"{r['xla_compile_s']:.1f}s, {r['compiled_gb']:.2f} GiB per device; compile + first step "
        f"{r['compile_s']:.1f}s; device peak {fmt(r['mem_gb'], '.2f', ' GiB')}"
    )


def torch_line(r):
    return (
        f"{r['step_s']:.3f} s/step, {r['tokens_s']:,.0f} tokens/s, {r['tflops']:.3f} TFLOP/s, "
        f"MFU {r['mfu']:.1%}; compile + first step {r['compile_s']:.1f}s; max allocated "
        f"{fmt(r['mem_gb'], '.2f', ' GiB')}; loss {r['loss']:.4f}"
    )


def alternate(row, cfg, steps, repeats, out, tokens):
    """ours, torch, ours, torch, ...: (ours runs, torch runs, why torch was skipped or None)."""
    ours, theirs, skipped = [], [], None
    for rep in range(1, repeats + 1):
        r = parse_ours(run_trainer(row, out, f"ours-{rep}", steps, steps)[0])
        ours.append(r)
        say(f"ours run {rep}/{repeats}: {ours_line(r)}")
        if skipped:
            continue
        # the same FLOPs per token and the same peak as the ours run just before
        spec = torch_spec(cfg, steps, r["flops_per_token"], r["peak"] * 1e12, row is GPU_ROW)
        t = run_torch(spec, tokens)
        if "skipped" in t:
            skipped = t["skipped"]
            say(f"torch side skipped: {skipped}")
        else:
            theirs.append(t)
            say(f"torch run {rep}/{repeats}: {torch_line(t)}")
    return ours, theirs, skipped


def context(row, ours, theirs, skipped, steps):
    """The table's descriptive cells."""
    b, a, n = row["per_device_batch"], row["grad_accum"], row["max_target_length"]
    first = ours[0]
    return {
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "host": bench_torch.machine("at the end").split(" UTC, ", 1)[
            -1
        ],  # its date is the row above
        "gpu": nvidia_smi(),
        "torch_device": theirs[0]["device"] if theirs else "",
        "torch_versions": theirs[0]["versions"] if theirs else f"skipped: {skipped}",
        "model": f"{first['params_m']:.2f}M parameters, {first['flops_per_token'] / 1e6:,.1f} "
        f"MFLOPs/token; {b} x {a} x {n} = {b * a * n:,} tokens per update; attention="
        f"{row['attention']}, dtype {row['dtype']}, remat {row['remat']}",
        "torch_model": "LlamaForCausalLM, same dims; sdpa, "
        + ("bf16 autocast" if row["dtype"] == "bfloat16" else "float32")
        + ", torch.compile, AdamW",
        "runs_ours": f"{len(ours)} x {steps} (first untimed)",
        "runs_torch": f"{len(theirs)} x {steps} (first {TORCH_WARMUP} untimed)"
        if theirs
        else "skipped",
        "peak": f"{first['peak']:.3f} TFLOP/s ({first['peak_source']})",
        "ours_mem": f"compiled step {first['compiled_gb']:.2f} GiB, device peak "
        f"{fmt(max((r['mem_gb'] for r in ours if r['mem_gb']), default=None), '.2f', ' GiB')}",
    }


def table(ctx, ours, torch, check_line, pairs):
    """The one table: where and with what it ran, each side's figures, the ratios."""
    t = torch or dict.fromkeys(ours)
    ratio = lambda k: f"{ours[k] / t[k]:.2f}x" if torch else "n/a"
    rows = [
        ("date", ctx["date"], "", ""),
        ("host", ctx["host"], "", ""),
        ("GPU (nvidia-smi; torch's device)", ctx["gpu"], ctx["torch_device"], ""),
        ("versions", jax_versions(), ctx["torch_versions"], ""),
        ("model", ctx["model"], ctx["torch_model"], ""),
        ("runs x steps", ctx["runs_ours"], ctx["runs_torch"], ""),
        ("median step (s)", fmt(ours["step_s"], ".3f"), fmt(t["step_s"], ".3f"), ""),
        ("tokens/s", fmt(ours["tokens_s"], ",.0f"), fmt(t["tokens_s"], ",.0f"), ratio("tokens_s")),
        (
            "TFLOP/s per device",
            fmt(ours["tflops"], ".3f"),
            fmt(t["tflops"], ".3f"),
            ratio("tflops"),
        ),
        (f"MFU of {ctx['peak']}", fmt(ours["mfu"], ".1%"), fmt(t["mfu"], ".1%"), ratio("mfu")),
        (
            "compile + first step, run 1 (s)",
            fmt(ours["compile_s"], ".1f"),
            fmt(t["compile_s"], ".1f"),
            "",
        ),
        ("memory", ctx["ours_mem"], fmt(t["mem_gb"], ".2f", " GiB max allocated"), ""),
        ("final loss", fmt(ours["loss"], ".4f"), fmt(t["loss"], ".4f"), ""),
        ("ours / torch tokens/s, run by run", "", "", ", ".join(pairs) or "n/a"),
        ("check (cudnn or einsum vs xla)", check_line, "", ""),
    ]
    print("\n| | ours: train.py (jax) | torch: LlamaForCausalLM + AdamW | ours / torch |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


def bench(row, steps, repeats):
    """Steps 1 to 4 of the docstring; the exit code."""
    out = tempfile.mkdtemp(prefix="bench-gpu-")
    print(f"machine: {bench_torch.machine()}; GPU: {nvidia_smi()}", flush=True)
    tokens = os.path.join(out, "tokens.npz")
    cfg = write_tokens(row, steps, tokens, out)
    ours, theirs, skipped = alternate(row, cfg, steps, repeats, out, tokens)
    ok, check_line = check(row, out)
    ctx = context(row, ours, theirs, skipped, steps)
    pairs = [f"{o['tokens_s'] / t['tokens_s']:.2f}x" for o, t in zip(ours, theirs, strict=False)]
    table(ctx, median_row(ours), median_row(theirs) if theirs else None, check_line, pairs)
    print(f"\ntotal: {(time.perf_counter() - START) / 60:.1f} min", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return 0 if ok and not (skipped or "").startswith("torch worker failed") else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model, for CPU (the test suite)")
    p.add_argument("--steps", type=int, help="updates per run (default 24; --tiny 4)")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    try:
        return bench(
            TINY_ROW if args.tiny else GPU_ROW, args.steps or (4 if args.tiny else 24), args.repeats
        )
    except Failed as e:
        sys.exit(str(e))


if __name__ == "__main__":
    sys.exit(main())
