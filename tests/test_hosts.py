"""Several hosts: two processes on loopback as two hosts of a pod, each `python train.py` as a user starts it (a
supervising parent and the trainer under it), started differently, never all joining, killed, seeing a damaged
checkpoint, stalled; every process under a timeout that fails the test on a hang. And two TPU fit checks at once."""

import concurrent.futures
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import BASE, ENV, ROOT, args, losses


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each host has 2 CPU devices.
HOSTS = ["mesh=2,-1,1", "per_device_batch=2", "prefetch=0", "host_timeout=20"]


def host(tmp_path, index, *keys, port, count=2, cwd=ROOT):
    env = {
        **ENV,
        "JAX_NUM_CPU_DEVICES": "2",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_PROCESS_COUNT": str(count),
        "JAX_PROCESS_INDEX": str(index),
    }
    return subprocess.Popen(
        [sys.executable, f"{ROOT}/train.py", BASE, *args(tmp_path, *HOSTS, *keys)],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def ended(procs, timeout=240):
    """[(exit code, stderr, stdout)] of each process, every one killed (and the test failed) past the timeout."""
    deadline, got = time.time() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"process {p.args} hung")
        got.append((p.returncode, err, out))
    return got


def at_step(metrics_file, step, procs):
    """Until the run's metrics.jsonl holds `step` rows; the test fails with their stderr if a process ends first."""
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= step):
        if any(p.poll() is not None for p in procs):
            pytest.fail(
                "a host ended early: " + " | ".join(p.communicate()[1][-1500:] for p in procs)
            )
        time.sleep(0.02)


def one_line(err):
    """stderr as the user sees it: exactly one line, no traceback (returned)."""
    assert err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    return err.strip()


@pytest.mark.slow
def test_hosts_started_differently_stop_every_host_in_one_line(tmp_path):
    """Process 1 with another learning_rate: both processes stop before building anything, each with the same line
    naming the key, both values and the host (before: both trained, each applying its own update, exit 0). Then
    output_dir=runs relative to each host's own working directory (a disk of its own): the run directory process 0
    made is not the one process 1 sees, named the same way (before: both hung at the first save)."""
    port = free_port()
    got = ended(
        [
            host(tmp_path, 0, "steps=2", port=port),
            host(tmp_path, 1, "steps=2", "learning_rate=0.002", port=port),
        ]
    )
    assert [code for code, _, _ in got] == [2, 2], got
    assert {one_line(err) for _, err, _ in got} == {
        (
            "error: process 1 of 2 was started differently from process 0: learning_rate (0.003 on process 0, 0.002 on "
            "process 1); start every host with the same command"
        )
    }
    disks = [tmp_path / f"disk{i}" for i in range(2)]
    for d in disks:
        d.mkdir()
    port = free_port()
    got = ended(
        [host(tmp_path, i, "steps=2", "output_dir=runs", port=port, cwd=disks[i]) for i in range(2)]
    )
    assert [code for code, _, _ in got] == [2, 2], got
    line = one_line(got[0][1])
    assert line == one_line(got[1][1]) and line.startswith(
        "error: process 1 of 2 was started differently from process 0: runs/default/.hosts (process "
    ), line
    assert line.endswith(
        ", no such file on process 1); give every host one shared output_dir (a shared disk, or a "
        "gs:// bucket)"
    ), line


@pytest.mark.slow
def test_hosts_that_never_all_join_end_in_one_line_within_host_timeout(tmp_path):
    """host_timeout=5: process 0 whose peer never starts, process 1 whose coordinator never answers, and two
    processes that both say JAX_PROCESS_INDEX=0 each end with one line naming the address and the count, exit 74,
    with JAX's C++ log kept off the terminal (before: SIGABRT after 300 s and a page of C++ logging)."""
    ports = [free_port() for _ in range(3)]
    t0 = time.time()
    procs = [
        host(tmp_path, 0, "host_timeout=5", port=ports[0]),
        host(tmp_path, 1, "host_timeout=5", port=ports[1]),
        host(tmp_path, 0, "host_timeout=5", port=ports[2]),
        host(tmp_path, 0, "host_timeout=5", port=ports[2]),
    ]
    got = ended(procs, timeout=120)
    took = time.time() - t0
    print(f"hosts that never all join: every process ended in {took:.0f}s with host_timeout=5")
    for (code, err, _), port in zip(got, ports + ports[2:]):
        said = re.fullmatch(
            rf"error: the 2 processes did not all join at 127\.0\.0\.1:{port} within host_timeout \(.*\); .* "
            r"\(JAX\'s log: (\S+)\)",
            one_line(err),
        )
        assert code == 74 and said, err
        # the file it names holds what JAX's runtime logged
        assert "RegisterTask" in pathlib.Path(said.group(1)).read_text()


def alone(tmp_path, *keys):
    """One process with 4 CPU devices: the pair's global mesh on one host, one slice."""
    return subprocess.Popen(
        [sys.executable, "train.py", "base.yml", *args(tmp_path, *HOSTS, *keys, "num_slices=1")],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "JAX_NUM_CPU_DEVICES": "4"},
    )


@pytest.mark.slow
def test_a_host_killed_mid_run_ends_the_others_in_one_line_and_the_rerun_is_exact(tmp_path):
    """Two processes as two slices (num_slices=2: off TPU each process is one; the hybrid mesh puts the slices on
    the data axis), their update batch doubling after step 5 (batch_ramp). kill -9 of process 1 at its step 6:
    process 0 names it and exits 74 within seconds; the rerun on both resumes from checkpoint 4. kill -9 of
    process 0, the coordinator, at step 9: process 1 names it, exit 74. The last rerun, on ONE process holding
    all 4 devices, resumes mid-ramp from checkpoint 8, and every step's loss equals an uninterrupted
    one-process run's on the same global mesh. (Before: the survivor aborted with a Gloo traceback and ~60
    lines.)"""
    keys = ["steps=10", "checkpoint_every=4", "log_every=1", "host_timeout=12", "batch_ramp=5:2"]
    one = alone(tmp_path, *keys, "run_name=one")
    metrics_file = tmp_path / "default" / "metrics.jsonl"
    for victim, at in ((1, 6), (0, 9)):
        port = free_port()
        pair = [host(tmp_path, i, *keys, "num_slices=2", port=port) for i in range(2)]
        at_step(metrics_file, at, pair)
        pair[victim].send_signal(signal.SIGKILL)
        t0 = time.time()
        survivor = ended([pair[1 - victim]])[0]
        print(
            f"kill -9 of process {victim}: the other ended {time.time() - t0:.1f}s later: {survivor[1].strip()}"
        )
        assert survivor[0] == 74 and one_line(survivor[1]).startswith(
            f"error: lost process {victim} of 2"
        ), survivor
        assert (
            "checkpoints already committed are intact; rerun the command on every host to resume"
            in survivor[1]
        )
        ended([pair[victim]])
    last = ended([alone(tmp_path, *keys), one])
    assert [code for code, _, _ in last] == [0, 0], [err[-2000:] for _, err, _ in last]
    out = last[0][2]
    assert "resuming from checkpoint" in out and "1 process(es), 1 slice(s)" in out, out
    assert "steps 9-9 ran before the stop" in out or "steps 9-10 ran before the stop" in out, out
    resumed, single = losses(tmp_path / "default"), losses(tmp_path / "one")
    print(
        "worst loss difference, killed twice and resumed on 1 of 2 hosts vs one process:",
        max(abs(a - b) for a, b in zip(resumed, single)),
    )
    assert len(single) == 10 and resumed == pytest.approx(single, rel=1e-5)


DAMAGED_ON_ONE_HOST = """
import os, sys
import train
read = train.read_step
def damaged_here(mngr, step, abstract, part):
    if train.jax.process_index() == 1 and step == int(os.environ['DAMAGED_STEP']):
        raise train.Damaged('a shard this host cannot read')
    return read(mngr, step, abstract, part)
train.read_step = damaged_here
sys.exit(train.main(['train.py', *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_a_checkpoint_only_one_host_cannot_read_is_damaged_for_all(tmp_path):
    """Step 4's shards unreadable on process 1 only: both hosts decide together that step 4 is damaged (the warning
    names process 1), set it aside once, resume from step 2, and the losses equal an uninterrupted run's (before:
    host 0 restored 4, host 1 restored 2, and they hung)."""
    keys = ["steps=4", "checkpoint_every=2", "log_every=1", "keep_checkpoints=0"]
    ref = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "base.yml",
            *args(tmp_path, *HOSTS, *keys, "steps=6", "run_name=ref"),
        ],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "JAX_NUM_CPU_DEVICES": "4"},
    )  # the same global mesh in one process
    pair_port, port = free_port(), free_port()
    first = ended([host(tmp_path, i, *keys, port=pair_port) for i in range(2)] + [ref])
    assert [code for code, _, _ in first] == [0] * 3, [err[-2000:] for _, err, _ in first]
    env = lambda i: {
        **ENV,
        "JAX_NUM_CPU_DEVICES": "2",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_PROCESS_COUNT": "2",
        "JAX_PROCESS_INDEX": str(i),
        "DAMAGED_STEP": "4",
    }
    got = ended(
        [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    DAMAGED_ON_ONE_HOST,
                    BASE,
                    *args(tmp_path, *HOSTS, *keys, "steps=6"),
                ],
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env(i),
            )
            for i in range(2)
        ]
    )
    assert [code for code, _, _ in got] == [0, 0], [err[-2000:] for _, err, _ in got]
    assert (
        "checkpoint" in got[0][2]
        and "is damaged (on process 1: a shard this host cannot read)" in got[0][2]
    )
    assert (
        "resuming from checkpoint" in got[0][2]
        and got[0][2].count("moved the damaged step(s) aside") == 1
    )
    names = os.listdir(tmp_path / "default" / "checkpoints")
    assert any(n.startswith("4.damaged-") for n in names) and {"2", "6"} <= set(names), names
    assert losses(tmp_path / "default") == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)


@pytest.mark.slow
def test_a_stalled_host_is_named_with_its_stacks(tmp_path):
    """The trainer of process 1 stopped (SIGSTOP: a hung host) at step 3: with stall_seconds=5, process 0 dumps every
    thread's stack into RUN_DIR/stacks-p0.txt and exits 74 naming the step and the file (before: both hung)."""
    metrics_file, port = tmp_path / "default" / "metrics.jsonl", free_port()
    pair = [host(tmp_path, i, "steps=100", "stall_seconds=5", port=port) for i in range(2)]
    at_step(metrics_file, 3, pair)
    child = int(
        subprocess.run(
            ["pgrep", "-P", str(pair[1].pid)], capture_output=True, text=True, check=False
        ).stdout.split()[0]
    )
    os.kill(child, signal.SIGSTOP)
    t0 = time.time()
    code, err, _ = ended([pair[0]], timeout=60)[0]
    print(f"stalled peer: process 0 ended {time.time() - t0:.1f}s later: {err.strip()}")
    os.kill(child, signal.SIGKILL)
    ended([pair[1]])
    assert code == 74 and re.fullmatch(
        r"error: stalled after step \d+: no step finished in \d+s \(stall_seconds=5\); every "
        rf"thread\'s stack is in {tmp_path}/default/stacks-p0.txt; .*",
        one_line(err),
    ), err
    assert "Thread 0x" in (tmp_path / "default" / "stacks-p0.txt").read_text()


LATE = """
import os, sys, time
import train
def late(f):  # on process 1, each call LATE_S seconds after process 0's
    def wrapped(*a, **k):
        time.sleep(float(os.environ['LATE_S']) if train.jax.process_index() == 1 else 0)
        return f(*a, **k)
    return wrapped
for name in os.environ['LATE_AT'].split(','):  # evaluator: the evaluate function it makes
    f = getattr(train, name)
    setattr(train, name, (lambda *a, f=f: late(f(*a))) if name == 'evaluator' else late(f))
sys.exit(train.main(['train.py', *sys.argv[1:]]))
"""


def late_runs(tmp_path):
    """[(mode, late_at, seconds, [(exit code, stderr, stdout)] of both processes)] of a train run whose process 1
    reaches the checkpoint manager and the step's compile 32 s after process 0, then an eval run of it whose
    process 1 is as late to the eval step's compile."""
    results = []
    for late_at, mode in (("checkpoints,compile_step", "train"), ("evaluator", "eval")):
        port, t0 = free_port(), time.time()
        env = lambda i, port=port, late_at=late_at: {
            **ENV,
            "JAX_NUM_CPU_DEVICES": "2",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_PROCESS_COUNT": "2",
            "JAX_PROCESS_INDEX": str(i),
            "LATE_S": "32",
            "LATE_AT": late_at,
        }
        keys = [*HOSTS, "steps=2", "eval_batches=1", "host_timeout=120", f"mode={mode}"]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", LATE, BASE, *args(tmp_path, *keys)],
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env(i),
            )
            for i in range(2)
        ]
        got = ended(procs, timeout=400)
        results.append((mode, late_at, time.time() - t0, got))
    return results


GLOO = "test_a_host_later_than_gloo_waits_still_trains_and_evaluates"


@pytest.fixture(scope="module", autouse=True)
def late_in_background(request, tmp_path_factory):
    """The late-host runs sleep ~100 s of their ~110: started with the module (when their test is to run) so
    that the file's other tests run meanwhile; their test, the file's last, waits for them."""
    if not any(item.name == GLOO for item in request.session.items):
        yield None
        return
    pool = concurrent.futures.ThreadPoolExecutor(1)
    yield pool.submit(late_runs, tmp_path_factory.mktemp("late"))
    pool.shutdown(wait=True)


HANGS_AT_STEP_4 = """
import sys, time
import train
next_batch, taken = train.next_batch, []
def hung(feed, it, *rest):
    taken.append(1)
    while len(taken) > 3:  # a step that never comes back (its handler runs, the loop never sees the signal)
        time.sleep(1)
    return next_batch(feed, it, *rest)
train.next_batch = hung
sys.exit(train.main(['train.py', *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_a_sigterm_to_a_stalled_run_ends_it_the_same_way(tmp_path):
    """A run hung in its fourth step, stall_seconds at its default (10 minutes here): a SIGTERM, which the loop
    cannot answer, ends it within seconds with the stacks and one line (before: it waited for the scheduler's
    SIGKILL). Multi-host runs get the same: the supervisor passes a SIGUSR1 beside the SIGTERM to JAX's sync point."""
    p = subprocess.Popen(
        [sys.executable, "-c", HANGS_AT_STEP_4, BASE, *args(tmp_path, "steps=100")],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "JAX_NUM_CPU_DEVICES": "1"},
    )
    at_step(tmp_path / "default" / "metrics.jsonl", 3, [p])
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    code, err, _ = ended([p], timeout=60)[0]
    print(f"SIGTERM to a stalled run: ended {time.time() - t0:.1f}s later: {err.strip()}")
    assert code == 74 and re.fullmatch(
        r"error: stalled after step 3: a signal went unanswered for 10s; every thread\'s "
        rf"stack is in {tmp_path}/default/stacks-p0.txt; .*",
        one_line(err),
    ), err


@pytest.mark.slow
def test_two_fit_checks_at_once_on_one_machine_both_run_and_print_no_libtpu_noise():
    """An AOT compile needs no TPU chip: two fit checks at once both compile (libtpu's lock on the chips of the host
    is not theirs to take: before, the second failed on it), and libtpu's warnings about a host without chips stay
    off stderr."""
    pytest.importorskip(
        "libtpu", reason="libtpu is not installed: pip install -r tests/requirements.txt"
    )
    cmd = [
        sys.executable,
        "train.py",
        "base.yml",
        "compile_topology=v5e-8",
        "mesh=1,8,1",
        "d_model=64",
        "num_layers=1",
        "num_heads=4",
        "num_kv_heads=2",
        "mlp_dim=128",
        "vocab_size=256",
        "max_target_length=128",
    ]
    got = ended(
        [
            subprocess.Popen(
                cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
            )
            for _ in range(2)
        ],
        timeout=300,
    )
    for code, err, out in got:
        assert code == 0 and err == "" and out.rstrip().endswith("HBM: fits"), (
            code,
            err[-2000:],
            out[-2000:],
        )


@pytest.mark.slow
def test_a_host_later_than_gloo_waits_still_trains_and_evaluates(late_in_background):
    """Process 1 reaches the checkpoint manager (orbax's barrier) and the step's compile 32 s after process 0 each
    time (a slow bucket read, a busy host): both train and exit 0; then mode=eval with process 1 as late to the eval
    step's compile: both evaluate. On CPU a collective's first run waits only 30 s for the other hosts (Gloo's own
    limit, not host_timeout): before, process 0 ended with 'lost process 1 ... Gloo context initialization failed:
    ... GetKeyValue() timed out'. (The runs started with the module: late_in_background.)"""
    for mode, late_at, took, got in late_in_background.result(timeout=600):
        print(f"mode={mode}, process 1 late by 32 s at {late_at}: both ended after {took:.0f}s")
        assert [code for code, _, _ in got] == [0, 0], [err[-2000:] for _, err, _ in got]
        assert ("eval loss" if mode == "train" else '"perplexity"') in got[0][2] and took > 32 * (
            1 + (mode == "train")
        )
