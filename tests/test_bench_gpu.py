"""tests/bench_gpu.py --tiny on CPU: the one-GPU benchmark's code runs end to end between GPU
lendings (our trainer twice, the torch side or its skip line, the attention check, the table)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import ENV, ROOT


@pytest.mark.slow
def test_bench_gpu_tiny_prints_the_figures_the_check_and_the_table():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "bench_gpu.py"), "--tiny"],
        cwd=ROOT,
        env=ENV,  # os.environ with JAX_PLATFORMS=cpu and the session's compile cache
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    # each ours run: the benchmark line's figures, its peak's source, the compile line's memory
    runs = re.findall(
        r"ours run \d/2: [\d.]+ s/step, [\d,]+ tokens/s, [\d.]+ TFLOP/s, MFU [\d.]+% of [\d.]+ "
        r"TFLOP/s \(.+\); step compiled in [\d.]+s, [\d.]+ GiB per device; compile \+ first step",
        out,
    )
    assert len(runs) == 2, out
    assert re.search(
        r"check: attention=einsum vs xla, first step: loss ([\d.]+) vs \1, grad norm [\d.]+ vs "
        r"[\d.]+: equal",
        out,
    ), out
    assert "| | ours: train.py (jax) | torch: LlamaForCausalLM + AdamW | ours / torch |" in out
    for row in ("date", "versions", "tokens/s", "MFU of", "compile + first step", "check"):
        assert re.search(rf"^\| {re.escape(row)}.* \|$", out, re.MULTILINE), (row, out)
    assert re.search(r"^\| tokens/s \| [\d,]+ \|", out, re.MULTILINE), out
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        assert re.search(r"^\| tokens/s \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$", out, re.MULTILINE)
    else:
        assert "torch side skipped: import torch, transformers failed" in out, out
        assert "| skipped: import torch, transformers failed" in out, out
