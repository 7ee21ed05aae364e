"""Side-by-side CPU benchmark: this trainer vs Hugging Face transformers' LlamaForCausalLM + torch AdamW.

Run by hand (not collected by pytest: the file name does not start with test_). torch and transformers
live in their own virtual environment, never in requirements.txt:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 transformers
    python tests/bench_torch.py --torch-python /tmp/tv/bin/python            # the side-by-side table
    python tests/bench_torch.py --torch-python /tmp/tv/bin/python --variants "jax f32,torch fp32" --repeats 5
    python tests/bench_torch.py --scaling                                     # our scaling table only
    python tests/bench_torch.py --torch-python /tmp/tv/bin/python --kernels  # the matmuls alone, 1 core and all

(On a machine with CUDA wheels on its index, a plain `pip install torch` pulls GBs of CUDA libraries; the
pinned version picks a CPU wheel here.) The main python (the one with jax) runs our trainer as
`train.py base.yml dataset=synthetic ...` in a subprocess and reads its `benchmark:` line; the venv's
python runs the torch side (this same file with --worker). Both train on the same token batches (the
trainer's synthetic stream, written to a .npz), the same number of steps, alternating runs; every figure
is a median (of timed steps within a run, then of the runs). MFU is against a matmul peak measured by each
side in its own process, in its compute dtype. The first and last lines name the CPU and whether it has bf16
instructions (avx512_bf16, amx_bf16); the last lines give the default's and our best row's ratio to the best
torch variant and to the best fp32 one.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The benchmark model: Llama-style GQA, d=384, 4 layers, 6 heads / 2 kv heads, SwiGLU 1024, vocab 4096.
DIMS = {
    "d_model": 384,
    "num_layers": 4,
    "num_heads": 6,
    "num_kv_heads": 2,
    "mlp_dim": 1024,
    "vocab_size": 4096,
    "max_target_length": 256,
    "per_device_batch": 8,
}
# Ours: the default command's settings (base.yml: dtype=auto, layers scanned), bf16 scanned (the default before
# dtype=auto), and each dtype unscanned; each also with one of FLAGS added to XLA_FLAGS ('jax default onednn'):
# noynn = Eigen's dot kernels instead of YNNPACK's (XLA:CPU's default since jax 0.10), onednn = oneDNN's matmuls,
# ynn-eltwise = YNNPACK fusing elementwise work into its dots too.
FLAGS = {
    "noynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "ynn-eltwise": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise",
}
OURS = {
    "jax default": [],
    "jax bf16 scanned": ["dtype=bfloat16"],
    "jax f32": ["dtype=float32", "scan_layers=false"],
    "jax bf16": ["dtype=bfloat16", "scan_layers=false"],
}
OURS.update({f"{k} {flag}": v for k, v in list(OURS.items()) for flag in FLAGS})
TORCH = ("torch fp32", "torch bf16 autocast", "torch.compile fp32", "torch.compile bf16 autocast")
# The benchmark step's matmul shapes ([rows, in] x [in, out]: projections, the MLP's down and its weight gradient, the
# LM head) and the 2048^3 peak probe, for --kernels.
KERNELS = [
    (2048, 384, 1024),
    (2048, 1024, 384),
    (384, 2048, 1024),
    (2048, 384, 4096),
    (2048, 2048, 2048),
]
SCALING = [
    {"d_model": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 768},
    {"d_model": 384, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2, "mlp_dim": 1024},
    {"d_model": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 2, "mlp_dim": 1408},
]


def machine(when="at start"):
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = pathlib.Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    isa += f", bf16 instructions: {' '.join(bf16)}" if bf16 else ", no bf16 instructions"
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu} ({isa}), {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} {when}"
    )


def run_ours(extra, steps, out_dir, dims=DIMS, xla_flags=""):
    """Our trainer on synthetic tokens (with xla_flags added to XLA_FLAGS); the dict parsed from its final
    `benchmark:` line."""
    args = [f"{k}={v}" for k, v in dims.items()] + [
        "dataset=synthetic",
        f"steps={steps}",
        f"log_every={steps}",
        "eval_batches=0",
        "checkpoint_every=0",
        "resume=false",
        f"output_dir={out_dir}",
        "run_name=bench",
        *extra,
    ]
    # XLA reads a blank XLA_FLAGS as a file name and aborts: join only what is set.
    env = dict(
        os.environ, XLA_FLAGS=" ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags) if f)
    )
    p = subprocess.run(
        [sys.executable, "train.py", "base.yml", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("benchmark:")), None)
    if p.returncode or not line:
        sys.exit(f"trainer failed ({' '.join(args)}):\n{p.stderr[-3000:]}")
    num = lambda pat: float(re.search(pat, line).group(1).replace(",", ""))
    params = re.search(r"model: ([\d.]+)M parameters", p.stdout).group(1)
    return {
        "params": params,
        "step_s": num(r"median ([\d.]+) s/step"),
        "tokens_s": num(r"= ([\d,]+) tokens/s"),
        "tflops": num(r"([\d.]+) TFLOP/s per device"),
        "mfu": num(r"MFU ([\d.]+)%") / 100,
        "peak": num(r"of ([\d.]+) TFLOP/s"),
        "compile_s": num(r"compile \+ first step ([\d.]+)s"),
    }


def write_tokens(path, steps):
    """The trainer's own synthetic batches (same seed, same shapes), for the torch side to train on."""
    import numpy as np

    sys.path.insert(0, ROOT)
    import data
    import train

    cfg = train.load_config(
        os.path.join(ROOT, "base.yml"),
        [f"{k}={v}" for k, v in DIMS.items()] + ["dataset=synthetic"],
    )
    it = data.make_dataset(cfg).train_iter(cfg.per_device_batch)
    batches = [next(it) for _ in range(steps)]
    it.close()
    np.savez(
        path,
        inputs=np.stack([b["inputs"] for b in batches]),
        targets=np.stack([b["targets"] for b in batches]),
    )


def worker(variant, tokens_path, flops_per_token):
    """The torch side (runs in the torch venv): what a user would write with transformers + AdamW."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=DIMS["vocab_size"],
        hidden_size=DIMS["d_model"],
        intermediate_size=DIMS["mlp_dim"],
        num_hidden_layers=DIMS["num_layers"],
        num_attention_heads=DIMS["num_heads"],
        num_key_value_heads=DIMS["num_kv_heads"],
        max_position_embeddings=DIMS["max_target_length"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # RoPE base: the default 10000
    model = transformers.LlamaForCausalLM(conf).train()
    # The trainer's recipe: AdamW (b2 0.95, decay 0.1) after global-norm clipping at 1.0.
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    bf16 = "bf16" in variant

    def loss_fn(inputs, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1)
        )

    fwd_bwd = torch.compile(loss_fn) if variant.startswith("torch.compile") else loss_fn
    toks = np.load(tokens_path)
    times, t_first = [], None
    for inputs, targets in zip(
        torch.from_numpy(toks["inputs"]).long(), torch.from_numpy(toks["targets"]).long()
    ):
        t0 = time.perf_counter()
        loss = fwd_bwd(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()
        if t_first is None:
            t_first = time.perf_counter() - t0
        else:
            times.append(time.perf_counter() - t0)
    n, dt = 2048, torch.bfloat16 if bf16 else torch.float32
    a = torch.ones(n, n, dtype=dt)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(5))
    step = float(np.median(times))
    tokens = toks["inputs"].shape[1] * toks["inputs"].shape[2]
    peak = 2 * n**3 / best
    print(
        json.dumps(
            {
                "step_s": step,
                "tokens_s": tokens / step,
                "tflops": tokens / step * flops_per_token / 1e12,
                "mfu": tokens / step * flops_per_token / peak,
                "peak": peak / 1e12,
                "compile_s": t_first,
                "loss": loss,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def kernel_rates(framework, dtype, cores):
    """GFLOP/s of each KERNELS matmul in this process (jax, or torch in its venv), best of 5 calls after a warm-up,
    on `cores` cores ('1': pinned to core 0, one torch thread; 'all': every core)."""
    if cores == "1":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if framework == "torch":
        import torch

        torch.set_num_threads(1 if cores == "1" else os.cpu_count())
        ones = lambda shape: torch.full(shape, 0.01, dtype=getattr(torch, dtype))
        mm, sync = lambda a, b: a @ b, lambda x: x
    else:
        import jax
        import jax.numpy as jnp

        ones = lambda shape: jnp.full(shape, 0.01, jnp.dtype(dtype))
        mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        sync = jax.block_until_ready
    rates = []
    for m, k, n in KERNELS:
        a, b = ones((m, k)), ones((k, n))
        sync(mm(a, b))
        rates.append(
            2 * m * k * n / min(_timed(lambda a=a, b=b: sync(mm(a, b))) for _ in range(5)) / 1e9
        )
    print(json.dumps(rates))


def kernels(torch_python, repeats):
    """--kernels: each framework's matmuls at the step's shapes, on one core and on all, in alternating fresh
    processes; medians. Says whether a gap in the step is the kernels' (one core) or their threading (all)."""
    import numpy as np

    dtype = "bfloat16" if "bf16 instructions:" in machine() else "float32"
    sides = [("jax", sys.executable)] + ([("torch", torch_python)] if torch_python else [])
    runs = {}
    for rep in range(repeats):
        for cores in ("1", "all"):
            for name, python in sides:
                p = subprocess.run(
                    [python, os.path.abspath(__file__), "--kernel-worker", name, dtype, cores],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    env=dict(os.environ, JAX_PLATFORMS="cpu"),
                    check=False,
                )
                if p.returncode:
                    sys.exit(f"{name} kernels failed:\n{p.stderr[-3000:]}")
                runs.setdefault((name, cores), []).append(
                    json.loads(p.stdout.strip().splitlines()[-1])
                )
    print(
        f"\n{machine('at the end')}\n\n{dtype} matmul GFLOP/s, median of {repeats} alternating runs (best of 5 calls "
        "each)\n\n| framework, cores | " + " | ".join("x".join(map(str, s)) for s in KERNELS) + " |"
    )
    print("|---" * (len(KERNELS) + 1) + "|")
    for (name, cores), rs in runs.items():
        print(
            f"| {name}, {cores} | " + " | ".join(f"{r:.0f}" for r in np.median(rs, axis=0)) + " |"
        )


def table(rows, title):
    print(f"\n{title}\n")
    print(
        "| run | tokens/s | step (s) | TFLOP/s | matmul peak (TFLOP/s, same process) | MFU | compile + first step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['tokens_s']:,.0f} | {r['step_s']:.3f} | {r['tflops']:.3f} | {r['peak']:.3f} | "
            f"{r['mfu']:.0%} | {r['compile_s']:.1f} |"
        )


def median_of(runs):
    import numpy as np

    return {
        k: float(np.median([r[k] for r in runs]))
        for k in ("step_s", "tokens_s", "tflops", "peak", "mfu", "compile_s")
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch-python", help="the torch venv's python (e.g. /tmp/tv/bin/python)")
    p.add_argument(
        "--steps", type=int, default=12, help="steps per run; the first (compile) is not timed"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="alternating runs of every variant; medians reported"
    )
    p.add_argument(
        "--variants",
        default=",".join(list(OURS)[:4] + list(TORCH)),
        help="comma-separated subset of: " + ", ".join(list(OURS) + list(TORCH)),
    )
    p.add_argument(
        "--scaling", action="store_true", help="our scaling table: 3 sizes x 2 sequence lengths"
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="the step's matmuls alone, jax vs torch, 1 core and all",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kernel-worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    p.add_argument("--flops", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.tokens, args.flops)
    if args.kernel_worker:
        return kernel_rates(*args.kernel_worker)
    print(f"machine: {machine()}")
    if args.kernels:
        return kernels(args.torch_python, args.repeats)
    out = tempfile.mkdtemp(prefix="bench-")
    if args.scaling:
        rows = {}
        for dims in SCALING:
            for L, B in ((256, 8), (1024, 2)):  # the same 2,048 tokens per step
                r = run_ours(
                    ["dtype=float32", "scan_layers=false"],
                    args.steps,
                    out,
                    {**DIMS, **dims, "max_target_length": L, "per_device_batch": B},
                )
                rows[
                    f"{r['params']}M: d={dims['d_model']}, {dims['num_layers']} layers, mlp {dims['mlp_dim']}; "
                    f"seq {L} x batch {B}"
                ] = r
                print(list(rows)[-1], r, flush=True)
        return table(
            rows,
            f"scaling: this trainer, float32, {args.steps} steps of 2,048 tokens, one run each",
        )
    sys.path.insert(0, ROOT)
    import model as model_lib
    import train

    flops = model_lib.lm_flops_per_token(
        train.load_config(os.path.join(ROOT, "base.yml"), [f"{k}={v}" for k, v in DIMS.items()])
    )
    tokens = os.path.join(out, "tokens.npz")
    write_tokens(tokens, args.steps)
    variants = [v for v in args.variants.split(",") if v in OURS or args.torch_python]
    runs = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants:
            if v in OURS:
                r = run_ours(
                    OURS[v], args.steps, out, xla_flags=FLAGS.get(v.rsplit(" ", 1)[-1], "")
                )
            else:
                proc = subprocess.run(
                    [
                        args.torch_python,
                        os.path.abspath(__file__),
                        "--worker",
                        v,
                        "--tokens",
                        tokens,
                        "--flops",
                        str(flops),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode:
                    sys.exit(f"{v} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                versions = (
                    f"torch {r['torch']}, transformers {r['transformers']}, {r['threads']} threads"
                )
            runs[v].append(r)
            print(
                f"run {rep + 1}/{args.repeats} {v}: {r['tokens_s']:,.0f} tokens/s, MFU {r['mfu']:.0%}",
                flush=True,
            )
    rows = {v: median_of(rs) for v, rs in runs.items()}
    import jax

    print(
        f"\n{machine('at the end')}; jax {jax.__version__}"
        + (f"; {versions}" if args.torch_python else "")
    )
    table(
        rows,
        f"side by side: {args.repeats} alternating run(s) x {args.steps} steps of 8 x 256 tokens, medians",
    )
    fastest = lambda names: max(names, key=lambda v: rows[v]["tokens_s"])
    torch_rows = [v for v in rows if v.startswith("torch")]
    for ours in dict.fromkeys(
        [v for v in ("jax default",) if v in rows] + [fastest([v for v in rows if v in OURS])]
    ):
        for pool, what in (
            (torch_rows, "the best torch"),
            ([v for v in torch_rows if "fp32" in v], "the best fp32 torch"),
        ):
            if pool:
                best = fastest(pool)
                print(
                    f"{ours} {rows[ours]['tokens_s']:,.0f} tokens/s vs {what}, {best} {rows[best]['tokens_s']:,.0f}: "
                    f"{rows[ours]['tokens_s'] / rows[best]['tokens_s']:.2f}x"
                )


if __name__ == "__main__":
    main()
