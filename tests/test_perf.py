"""Performance tools: the profiler window, the persistent compilation cache, the memory report and the
benchmark summary. Behaviour only; speed itself is measured by the benchmark (README, Performance)."""

import os
import re
import subprocess
import sys

import pytest
from conftest import BASE, ENV, LM, ROOT, args

import train


@pytest.mark.slow
def test_profile_cache_memory_and_benchmark_line(tmp_path):
    """A fresh process (JAX sets up its persistent cache once, at its first compile) writes a trace of steps
    2-3, fills compile_cache_dir, and prints the compiler's per-device memory figures and the benchmark line. That a rerun then compiles nothing is measured in README (Performance)."""
    cache = tmp_path / "xla-cache"
    argv = args(
        tmp_path, "steps=3", f"compile_cache_dir={cache}", "run_name=a", "profile_steps=2,3"
    )
    run = subprocess.run(
        [sys.executable, "train.py", "base.yml", *argv],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
        env=ENV,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    traces = [
        f
        for _, _, fs in os.walk(tmp_path / "a" / "profile")
        for f in fs
        if f.endswith(".xplane.pb")
    ]
    assert traces, run.stdout
    for expect in ("compiled per device: arguments", "benchmark: 2 timed steps"):
        assert expect in run.stdout, run.stdout
    # The line a person reads each log_every steps: progress, loss, speed, MFU and the time left.
    assert re.search(
        r"^step 3/3  loss \d+\.\d{4}  [\d,]+ tokens/s  MFU [\d.]+%  ETA 0m00s$",
        run.stdout,
        re.MULTILINE,
    ), run.stdout
    assert os.listdir(cache)


@pytest.mark.parametrize("value", ["3,2", "0,9", "1"])
def test_bad_profile_steps_name_the_key(tmp_path, value):
    with pytest.raises(train.ConfigError, match="profile_steps="):
        train.run(
            train.load_config(
                BASE, LM + ["steps=4", f"profile_steps={value}", f"output_dir={tmp_path}"]
            )
        )
