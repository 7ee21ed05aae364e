"""Data for the trainer: text (tfds + sentencepiece) and Sudoku puzzles, as grain pipelines that
resume exactly on any number of processes, and (last) the storage layer every file goes through.

    ds = make_dataset(cfg, process_index, process_count, log=print)  # log: the slow one-time steps
    it = ds.train_iter(local_rows, state=None)  # next(it) -> batch dict
    it.state()                                  # a small JSON dict per row: where to resume
    ds.eval_batches(local_rows, n)              # the same n batches on every call

Every batch is a dict of numpy arrays shaped [rows, L]:
    inputs, targets  int32    targets[r, t] is what the model should predict after inputs[r, :t+1]
    segment_ids      int32    0 = padding, 1, 2, ... = document number within the row
    positions        int32    position inside the document piece, restarting at 0 for every segment
    loss_mask        float32  1 where the target counts
Row r of the global batch (local_rows x process_count rows; process p reads rows p * local_rows
onward) is a lane: its own grain pipeline over the records at positions r, r + rows, r + 2 rows, ...
of one order, shuffled per epoch from the seed, packed on its own. A lane's state does not depend on
how many processes there are, so a checkpoint of every lane's state resumes on any process count
that divides the rows, reading exactly the batches an uninterrupted run reads. This module is
numpy-only on purpose: train.py owns devices and turns these into global jax arrays. TensorFlow is
optional: tfds builds and reads array_record files without it. The Sudoku rules are defined here
once (UNITS, PEERS, digits_seen, dead_end, solved) and take numpy or jax arrays: model.py's search
uses them too.

What is here, in order:
  Pipelines
    lanes          Batches, _Data: one grain pipeline (a lane) per row of the global batch, each
                   process reading its own rows (the per-host sharding); train_iter, eval_batches
    synthetic      SyntheticData: random tokens, no files
    text sources   files and globs, local or gs:// (expand), the standard library, tfds, and Hugging
                   Face datasets read by random access or streamed
    tokenizers     Tokenizer, one face for sentencepiece (trained here on the text, or a .model) and
                   Hugging Face's tokenizer.json (hf_tokenizer); tokenizer_source, load_tokenizer,
                   until_stop
    packing        TextData, StreamData (hf_streaming): documents tokenized on the fly and packed
                   into rows
    SFT            SFTData: rows of messages, or prompt and completion, the loss on the answers only
                   (sft_rows, chat_renderer, chat_spans, sft_example)
    Sudoku         the rules (UNITS, PEERS, MEMBERS, digits_seen, legal_digits, dead_end, solved,
                   by_singles), solver and generator (solve, search_guesses, generate_sudoku,
                   augment), CSV files (read_sudoku_csv, write_sudoku_csv, parse_grid), SudokuData
    entry points   make_dataset, which picks the pipeline; make_chat and main, the commands
                   `python data.py make-chat | make-pairs | make-sudoku`
  Storage          paths local or gs:// (stored, remote, STORAGE_ERRORS), Hugging Face checkpoint
                   files (hf_dir), files read and written (read_json, write, append, set_aside), the
                   run directory's lock (own, BucketLease, held, check_held), the paths a config
                   names (check_paths, checkpoint_steps), the run directory (make_run_dir,
                   prepare_training, resume_metrics, move_up), its tokenizer (keep_tokenizer,
                   config_changes, flat), metrics (MetricsWriter: metrics.jsonl, TensorBoard, and
                   W&B through open_wandb; quiet_libraries)
"""

import collections.abc
import contextlib
import csv
import fcntl
import fnmatch
import functools
import glob
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import pathlib
import random
import re
import resource
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import grain
import numpy as np
import yaml
from etils import epath
from grain.experimental import (
    ConcatThenSplitIterDataset,
    ThreadPrefetchIterDataset,
    ZipIterDataset,
)

# Special ids of the tokenizers trained here. A tokenizer given by tokenizer_path keeps its own ids
# (its eos is required; without a bos, eos also starts documents).
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

SUDOKU_LEN = 81
SUDOKU_VOCAB = 11  # TRM tokens: pad 0, blank 1, digits 1..9 -> 2..10 (token = digit + 1)
_TOKENIZER_SAMPLE_CHARS = (
    5_000_000  # BPE training on 5 MB takes ~1 s; more text barely changes merges
)
_EVAL_HEAD_DOCS = 10_000  # documents of a streamed eval split read for eval (its head)
_SENTENCE_CHARS = 4000  # sentencepiece caps sentence length, so long files are cut at line ends
_MAX_SENTENCE_CHARS = 4 * _SENTENCE_CHARS  # what it takes: a line longer than this is skipped
_SUDOKU_GEN_VERSION = 1  # bump when the generator changes, so cached puzzle sets are regenerated
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def first_line(e, typed=True, limit=160):
    """An exception as one line for an error message:
    its type (typed) and the first line of its text."""
    text = str(e).splitlines()[0][:limit] if str(e) else ""
    return f"{type(e).__name__}: {text}" if typed and text else text or type(e).__name__


class DataError(Exception):
    """A mistake in the data settings; the message names the key or file and the fix."""


class ConfigError(Exception):
    """A user mistake in the config or command line: printed as one line, no traceback."""


@contextlib.contextmanager
def kept_out(*names):
    """Inside, each named module not yet imported fails to import (sys.modules holds it as None),
    so a library's optional import of it goes without; afterwards it imports as usual. For optional
    imports a run never uses (flax's of IPython, tensorboardX's of two cloud clients)."""
    out = [name for name in names if name not in sys.modules]
    sys.modules.update(dict.fromkeys(out))
    try:
        yield
    finally:
        for name in out:
            if sys.modules.get(name, "") is None:
                del sys.modules[name]


# ==================================================================================================
# Pipelines: the lanes every dataset is read through (one per row of the global batch, so a
# checkpoint's position resumes on any process count), then synthetic tokens, text, SFT and Sudoku
# data, and make_dataset, which picks one.
# ==================================================================================================

# ---- shared plumbing: lanes, batches, the prefetching iterator -----------------------------------

# lanes read on the prefetch thread, not a pool each
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


# What a batch holds, each [rows, length]: a dataset may add its own (DPOData's reference).
FIELDS = {
    "inputs": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
}


def fields_of(source):
    """The batch fields of a task's dataset class (None: the text pipelines')."""
    return getattr(source, "fields", FIELDS)


def fixed_by(source):
    """The config values a task's dataset class decides (the puzzles' vocabulary and length)."""
    return dict(getattr(source, "fixed", {}))


def _stack(rows, n, length, fields=FIELDS):
    """A batch of n rows from row dicts; the rows past them are padding (segment 0, loss_mask 0)."""
    batch = {k: np.zeros((n, length), dtype) for k, dtype in fields.items()}
    for r, row in enumerate(rows):
        for k, v in batch.items():
            v[r] = row[k]
    return batch


def padding(batch):
    """A batch like `batch` that weighs nothing (every host runs as many batches as the others)."""
    return {**batch, "loss_mask": 0 * batch["loss_mask"]}


def _full_row(inputs, targets):
    """A row holding one example that fills it: one segment, every target counts."""
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": np.ones(len(inputs), np.int32),
        "positions": np.arange(len(inputs), dtype=np.int32),
        "loss_mask": np.ones(len(inputs), np.float32),
    }


def _tuples(state):
    """A lane state back from JSON: grain's packing state
    compares its slices as tuples, which JSON made lists."""
    if isinstance(state, dict):
        return {k: _tuples(v) for k, v in state.items()}
    return tuple(state) if isinstance(state, list) else state


class Batches(collections.abc.Iterator):
    """What train_iter returns: grain zips the lanes' rows into batches and reads `prefetch` batches
    ahead on a thread. state() is each lane's state after the last batch handed out (grain keeps it
    with every prefetched batch); wait_seconds is the time next() spent blocked on data."""

    def __init__(self, lanes, prefetch, state=None, source=""):
        # source: the identity of the data read, saved with the position
        self.source, self.wait_seconds = (
            source,
            0.0,
        )
        batches = ZipIterDataset(lanes).map(
            lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        )
        self._it = ThreadPrefetchIterDataset(batches, prefetch_buffer_size=prefetch).__iter__()
        if state:
            self._it.set_state({"parents": [_tuples(s) for s in state]})

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.wait_seconds += time.perf_counter() - start

    def state(self):
        return self._it.get_state()["parents"]

    def close(self):
        self._it.close()


class _StreamBatches(Batches):
    """Batches of one host's share of a stream (dataset=hf with hf_streaming): one pipeline
    per host, whose state (with the host it belongs to) is spread over the host's rows, so
    the checkpoint keeps it as it keeps lanes. `rows_state`: the host's rows of a
    checkpoint's data state."""

    def __init__(self, batches, prefetch, host, rows, rows_state, source):
        self.source = source
        self.host = list(host)
        self.rows = rows
        self.wait_seconds = 0.0
        self._it = ThreadPrefetchIterDataset(batches, prefetch_buffer_size=prefetch).__iter__()
        if rows_state:
            state = {
                "host": None
            }  # rows holding pieces of several processes' positions are no JSON: no host's
            with contextlib.suppress(json.JSONDecodeError):
                state = json.loads("".join(rows_state))
            if state["host"] != self.host:
                raise DataError(
                    f"a streaming run resumes on the process count that wrote it (this run has "
                    f"{host[1]} processes; the checkpoint's position is not theirs)"
                )
            self._it.set_state(_tuples(state["pipeline"]))

    def state(self):
        text = json.dumps({"host": self.host, "pipeline": self._it.get_state()})
        n = -(-len(text) // self.rows)
        return [text[i * n : (i + 1) * n] for i in range(self.rows)]


class _Data:
    """What make_dataset returns. Subclasses define _order (the examples in their seeded order: lane
    r of `rows` reads positions r, r + rows, ...) or their own _lane (one row's pipeline),
    eval_batches, and identity: a name of the records read, so a checkpoint's position is applied
    only to the data it counts; and tokenizer (None: the data is token ids already). vocab_size and
    length (of a row) are cfg's unless the data fixes them. `log` (a print function, or None for
    silence) hears about the slow one-time preparations."""

    tokenizer = None
    fields: ClassVar[dict] = FIELDS  # a batch's, each [rows, length]

    whole_eval = False  # an eval reads eval_batches batches (SFTData: all of them, unless set)
    eval_all = False  # mode=eval reads the whole eval set, eval_batches or not (the puzzles)
    fixed: ClassVar[dict] = {}  # config values the data decides (data.fixed_by)

    def __init__(self, cfg, process_index, process_count, log=None):
        self.cfg = cfg
        self.process_index = process_index
        self.process_count = process_count
        self.vocab_size = cfg.vocab_size
        self.length = cfg.max_target_length
        self.log = log or (lambda msg: None)

    def _lane(self, row, rows):
        return self._order[row::rows].to_iter_dataset(_READ)

    def train_iter(self, local_rows, state=None):
        """This process's rows of the global batch (local_rows x process_count rows, a lane
        each), from `state`: what a checkpoint saved, {'lanes': every lane's state, as
        saved by a run on any number of processes, 'source': the identity of the data they
        read} (None = the start)."""
        rows, first = local_rows * self.process_count, local_rows * self.process_index
        lanes_state = self._resumable(state, local_rows)
        lanes = [self._lane(r, rows) for r in range(first, first + local_rows)]
        try:
            return Batches(lanes, self.cfg.prefetch, lanes_state, self.identity)
        except (KeyError, ValueError, TypeError, IndexError):  # another pipeline's (older) states
            self.log(
                "WARNING: the checkpoint's data position does not fit this data: the data order "
                "starts again from its beginning"
            )
            return Batches(lanes, self.cfg.prefetch, source=self.identity)

    def _resumable(self, state, local_rows):
        """This process's lane states to resume from; None
        (with a warning) if they are another source's."""
        rows, first = local_rows * self.process_count, local_rows * self.process_index
        if state is None:
            return None
        if state.get("source") not in (None, self.identity):
            self.log(
                f"WARNING: the checkpoint's data position is in {state['source']}, not in this "
                f"run's data ({self.identity}): the data order starts again from its beginning"
            )
            return None
        if len(state["lanes"]) != rows:
            raise DataError(
                f"the checkpoint holds the data position of {len(state['lanes'])} rows per "
                f"microbatch but this run reads {rows} (per_device_batch x devices): keep "
                f"{len(state['lanes'])} to resume, or start a new run_name with load_params=RUN_DIR"
            )
        return state["lanes"][first : first + local_rows]


@contextlib.contextmanager
def _locked(cache_dir):
    """Serialises preparation between processes sharing cache_dir (e.g. two hosts on one machine);
    make_dataset made cache_dir."""
    with open(os.path.join(cache_dir, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # closing the file releases it, however the block ends
        yield


@contextlib.contextmanager
def _announced(log, what):
    """One line before and one after a slow preparation
    step (done once, then cached); log=None is silent."""
    log, start = log or (lambda msg: None), time.perf_counter()
    log(f"{what} (once; cached for later runs) ...")
    yield
    log(f"{what}: done in {time.perf_counter() - start:.1f}s")


# ---- synthetic tokens ----------------------------------------------------------------------------


# The eval set of dataset=synthetic: eval_batches past it evaluate these (each eval set is one pass)
SYNTHETIC_EVAL_BATCHES = 64


class SyntheticData(_Data):
    """Uniform random tokens, row r of step s a pure function of (seed, s, r): no files. Its
    tokenizer is the one tokenizer_path or load_hf's checkpoint names, if any (for generation
    and export), else none."""

    identity = "synthetic"

    def __init__(self, cfg, process_index, process_count, log=None):
        super().__init__(cfg, process_index, process_count, log)
        self.tokenizer = (
            load_tokenizer(tokenizer_source(cfg), cfg) if tokenizer_source(cfg) else None
        )

    def _row(self, stream, step, row):
        rng = np.random.default_rng([self.cfg.seed, stream, step, row])
        tokens = rng.integers(0, self.vocab_size, self.length + 1, dtype=np.int32)
        return _full_row(tokens[:-1], tokens[1:])

    def _lane(self, row, rows):
        return (
            grain.MapDataset.range(sys.maxsize)
            .map(lambda step: self._row(0, step, row))
            .to_iter_dataset(_READ)
        )

    def eval_batches(self, local_rows, n):
        """n fixed batches of random tokens, at most SYNTHETIC_EVAL_BATCHES (its eval set)."""
        rows = range(self.process_index * local_rows, (self.process_index + 1) * local_rows)
        return [
            _stack([self._row(1, i, r) for r in rows], local_rows, self.length)
            for i in range(min(n, SYNTHETIC_EVAL_BATCHES))
        ]


# ---- text: sources -------------------------------------------------------------------------------


def _texts(records, key):
    """Random access to the text of each record of a tfds
    data source, a Hugging Face dataset or a list."""
    return grain.MapDataset.source(records).map(lambda record: _text(record, key))


def _text(record, key):
    """The text of one record (a dict of features): the feature `key`, as str."""
    if key not in record:
        raise DataError(
            f"text_key={key!r} is not a feature of the records (they have {sorted(record)}): set "
            "text_key to the text feature"
        )
    text = record[key]
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)


def expand(pattern):
    """The files a glob matches, sorted: on a local disk, or in a bucket (gs://bucket/corpus/*.txt,
    through epath); a plain path is a glob that matches itself."""
    if "://" not in pattern:
        return sorted(
            f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f)
        )
    if not re.search(r"[*?[]", pattern):
        return [pattern] if epath.Path(pattern).is_file() else []
    head = re.split(r"[*?[]", pattern)[0].rsplit("/", 1)[
        0
    ]  # the directory above the first wildcard
    return sorted(str(p) for p in epath.Path(head).glob(pattern[len(head) + 1 :]) if p.is_file())


def _fingerprint(path):
    """What names a file's content, not where or when it was written (a copy to another host or
    bucket is the same data): its bytes' SHA-1 on a disk, its size and CRC32C in a bucket (GCS keeps
    both)."""
    if remote(path):
        info = gcs().info(path)
        return f"{info.get('size')}:{info.get('crc32c') or info.get('md5Hash')}"
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _relative(files):
    """Each file's path below the deepest directory holding them all (local or gs://): the same
    wherever the whole tree is copied."""
    parts = [f.split("/") for f in files]
    common = next((k for k in range(min(map(len, parts))) if len({p[k] for p in parts}) > 1), None)
    common = min(map(len, parts)) - 1 if common is None else common
    return ["/".join(p[common:]) for p in parts]


def _glob(pattern, key):
    if not (files := expand(pattern)):
        raise DataError(
            f"{key}={pattern!r} matches no files: set it to a glob of text files, "
            "e.g. 'corpus/**/*.txt' (quote it on the command line)"
        )
    return files


def _stdlib_files():
    """Python's own library source: ships with every Python, so the default run needs no network."""
    root, files = sysconfig.get_paths()["stdlib"], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise DataError(
            f"dataset=stdlib found no .py files under {root}: use dataset=files or synthetic"
        )
    return files


def _corpus_key(cfg):
    """The key=value that names the text a run reads, for messages about the text itself."""
    if cfg.dataset in ("files", "stdlib"):
        return "dataset=stdlib" if cfg.dataset == "stdlib" else f"dataset_path={cfg.dataset_path!r}"
    key = (
        "tfds_name"
        if cfg.dataset == "tfds"
        else "hf_data_files"
        if cfg.hf_data_files
        else "hf_path"
    )
    return f"{key}={getattr(cfg, key)!r}"


def _split_files(cfg):
    """(train_files, eval_files): eval_path if set, else
    ~3% of files picked by a hash of their path."""
    key = _corpus_key(cfg)
    files = _stdlib_files() if cfg.dataset == "stdlib" else _glob(cfg.dataset_path, "dataset_path")
    if cfg.eval_path:
        eval_files = _glob(cfg.eval_path, "eval_path")
    elif len(files) < 2:
        raise DataError(
            f"{key} matches one file; need two or more "
            "(some are held out for eval) or set eval_path"
        )
    else:
        # Paths hashed relative to the files' common root: the split is the same on every machine.
        root = os.path.commonpath(files)
        digest = {f: hashlib.sha1(os.path.relpath(f, root).encode()).digest() for f in files}
        eval_files = [f for f in files if digest[f][0] < 8] or [
            min(files, key=digest.get)
        ]  # 8/256 ~ 3%
    held_out = set(eval_files)
    train_files = [f for f in files if f not in held_out]
    if cfg.eval_path and not train_files:
        raise DataError(
            f"{key}: every file is also in eval_path={cfg.eval_path!r}; nothing left to train on"
        )
    return train_files, eval_files


def _file_sources(cfg, log=None):
    """(train texts, eval texts, identity) for dataset=files|stdlib, prepared once into cache_dir by
    a tfds builder over the files, one record (document) per file."""
    import tensorflow_datasets as tfds

    train_files, eval_files = _split_files(cfg)
    # The prepared dataset is named by its files' contents and their paths below their common
    # directory (its records' keys, which order them): the same files copied elsewhere are the same
    # dataset, a resume on them exact; other files, another dataset.
    key = dict(zip(train_files + eval_files, _relative(train_files + eval_files)))
    listing = "".join(
        f"{split}\t{key[f]}\t{_fingerprint(f)}\n"
        for split, files in (("train", train_files), ("eval", eval_files))
        for f in files
    )
    name = "files_" + hashlib.sha1(listing.encode()).hexdigest()[:16]

    # skip_registration: the class is made per call and must not clash in tfds' global registry.
    class TextFiles(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
            )

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples(train_files),
                "eval": self._generate_examples(eval_files),
            }

        def _generate_examples(self, files):
            return (
                (key[path], {"text": epath.Path(path).read_bytes().decode("utf-8", "replace")})
                for path in files
            )

    # the builder reads what is prepared when made: after another process built it
    with _locked(cfg.cache_dir), _scratch_tempdir():
        builder = TextFiles(
            config=tfds.core.BuilderConfig(name=name),
            data_dir=cfg.cache_dir,
            file_format="array_record",
        )
        if not builder.is_prepared():
            tfds.disable_progress_bar()
            with (
                _announced(
                    log,
                    f"building the text dataset from {len(train_files)} + {len(eval_files)} "
                    f"files into {cfg.cache_dir}",
                ),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                builder.download_and_prepare(
                    file_format="array_record",
                    download_config=tfds.download.DownloadConfig(
                        compute_stats=tfds.download.ComputeStatsMode.SKIP
                    ),
                )
    source = builder.as_data_source()
    return _texts(source["train"], "text"), _texts(source["eval"], "text"), name


@contextlib.contextmanager
def _scratch_tempdir():
    """tempfile's directory for the block: a new one, removed after it. A tfds builder of a dataset
    not yet prepared makes an empty tmp*tfds directory there each time it is made (looking for its
    metadata in Google's bucket), and leaves it."""
    old = tempfile.tempdir
    with tempfile.TemporaryDirectory() as scratch:
        tempfile.tempdir = scratch
        try:
            yield
        finally:
            tempfile.tempdir = old


def _tfds_sources(cfg):
    """(train texts, eval texts, identity) for a prepared tfds dataset, read by random access."""
    import tensorflow_datasets as tfds

    if not cfg.tfds_name:
        raise DataError(
            "dataset=tfds needs tfds_name=NAME (a dataset prepared with file_format='array_record')"
        )
    splits = [cfg.train_split, cfg.eval_split]
    try:
        builder = tfds.builder(cfg.tfds_name, data_dir=cfg.data_dir or None)
        sources = [builder.as_data_source(split=s) for s in splits]
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(
            f"tfds_name={cfg.tfds_name!r}: no such tfds dataset (see `tfds.list_builders()`)"
        ) from None
    except NotImplementedError:  # stored as tfrecord only, or not prepared at all
        if not builder.is_prepared():
            raise DataError(
                f"tfds_name={cfg.tfds_name!r} is not prepared in {builder.data_dir} (there is no "
                f"network here): prepare it with `tfds build {cfg.tfds_name} "
                "--file_format=array_record --data_dir=DIR` and set data_dir=DIR"
            ) from None
        try:
            import tensorflow  # noqa: F401  (tfrecord files can only be read through tf.data)
        except ImportError:
            raise DataError(
                f"tfds_name={cfg.tfds_name!r} is stored as tfrecord, which needs TensorFlow: "
                "rebuild it with file_format='array_record' (`tfds build "
                "--file_format=array_record`) or pip install tensorflow"
            ) from None
        # tf.data has no random access, so the splits are read once into memory.
        sources = [list(tfds.as_numpy(builder.as_dataset(split=s))) for s in splits]
    except (KeyError, ValueError) as e:
        raise DataError(
            f"train_split={cfg.train_split!r} / eval_split={cfg.eval_split!r}: {e}"
        ) from None
    if not len(sources[0]):
        raise DataError(
            f"train_split={cfg.train_split!r} of {cfg.tfds_name} "
            "has no records: choose a split with data"
        )
    identity = "tfds_" + builder.info.full_name.replace("/", "_") + f"_{cfg.train_split}"
    return _texts(sources[0], cfg.text_key), _texts(sources[1], cfg.text_key), identity


# ---- text: Hugging Face datasets -----------------------------------------------------------------


def _files_key(cfg, key):
    """The key naming the files of split cfg.<key>: hf_eval_files for the held-out split when set
    (its own files), else hf_data_files."""
    return "hf_eval_files" if key == "hf_eval_split" and cfg.hf_eval_files else "hf_data_files"


def split_name(cfg, key):
    """How messages name split cfg.<key>: hf_split=train, hf_eval_files=held.jsonl, ..."""
    files_key = _files_key(cfg, key)
    return (
        f"{files_key}={cfg.hf_eval_files}"
        if files_key == "hf_eval_files"
        else f"{key}={getattr(cfg, key)}"
    )


def held_out(cfg):
    """Whether dataset=hf's eval rows come from a split or files of their own."""
    return bool(cfg.hf_eval_split or cfg.hf_eval_files)


def _hf_split(cfg, key):
    """The split cfg.<key> of dataset=hf (datasets.load_dataset: a hub name, or a builder such
    as json / parquet / text with hf_data_files; the held-out one from hf_eval_files where set),
    prepared into cache_dir/hf. What the hub or the files refuse is one DataError naming the key
    (the file and line where it can); without network or with HF_HUB_OFFLINE=1 only what is
    cached loads."""
    if not cfg.hf_path:
        raise DataError(
            "dataset=hf needs hf_path: a hub dataset (roneneldan/TinyStories), or a builder (json, "
            "parquet, text, csv) with hf_data_files"
        )
    try:
        import datasets
    except ImportError:
        raise DataError(
            "dataset=hf needs the Hugging Face datasets library: pip install datasets==5.2.0"
        ) from None
    datasets.disable_progress_bars()
    # their retries and fallbacks: the error below says it once
    for name in (
        "datasets",
        "huggingface_hub",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    files_key = _files_key(cfg, key)
    files = _listed(getattr(cfg, files_key)) or None
    try:
        with _locked(cfg.cache_dir):
            return datasets.load_dataset(
                cfg.hf_path,
                cfg.hf_name or None,
                data_files=files,
                split="train" if files_key == "hf_eval_files" else getattr(cfg, key),
                streaming=cfg.hf_streaming,
                cache_dir=os.path.join(cfg.cache_dir, "hf"),
            )
    except Exception as e:  # noqa: BLE001 - datasets' many errors, each one line
        raise _hf_error(cfg, e, key) from None


def _listed(files):
    """A comma-separated list of files or globs as a list."""
    return [f.strip() for f in files.split(",") if f.strip()]


def _hf_error(cfg, e, key):
    """What the hub or the files refuse, loading or streaming: a DataError naming the key, and
    for JSON files the file, line and what is wrong (datasets says only "An error occurred")."""
    text = first_line(e, typed=False, limit=200) if str(e) else ""
    if isinstance(e, ConnectionError):
        return DataError(
            f"hf_path={cfg.hf_path}: {text} (offline, only datasets "
            "in cache_dir load; a private one needs HF_TOKEN)"
        )
    if isinstance(e, ValueError) and "split" in text.lower():  # a split it lacks
        return DataError(f"{key}={getattr(cfg, key)}: {text}")
    files_key = _files_key(cfg, key)
    files = [f for pattern in _listed(getattr(cfg, files_key)) for f in expand(pattern)]
    if why := (_json_trouble(files) if cfg.hf_path == "json" else ""):
        return DataError(f"{files_key}: {why}")
    # files the builder cannot read, a refused dataset: the innermost cause says why
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    where = files_key if getattr(cfg, files_key) else "hf_path"
    return DataError(f"{where}={getattr(cfg, where)}: {first_line(e, limit=200)}")


class _Twice(ValueError):
    """A key set twice in one JSON object."""


def _once(pairs):
    """json's object_pairs_hook: an object, each key once."""
    keys = [k for k, _ in pairs]
    if twice := next((k for k in keys if keys.count(k) > 1), None):
        raise _Twice(twice)
    return dict(pairs)


def _json_trouble(files):
    """The first thing in these JSON or JSON-lines files that the json builder cannot read, as
    'FILE:LINE: what is wrong'; '' where every file reads (one JSON document, or a row a line)."""
    hints = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".txt": "text"}
    for path in files:
        hint = hints.get(os.path.splitext(path)[1].lower())
        hint = f"; for this kind of file give hf_path={hint}" if hint else ""
        try:
            text = stored(path).read_bytes().decode()
        except UnicodeDecodeError as e:
            return f"{path}: not UTF-8 text (byte {e.start}){hint}"
        if not text.strip():
            return f"{path}: empty, no rows; remove it from the list, or give it rows"
        try:
            json.loads(text, object_pairs_hook=_once)  # one JSON document (a list of rows)
            continue
        except (json.JSONDecodeError, _Twice):
            pass
        for n, line in enumerate(text.splitlines(), 1):
            try:
                row = json.loads(line, object_pairs_hook=_once) if line.strip() else {}
            except _Twice as e:
                return f"{path}:{n}: key {e.args[0]!r} is set twice in one row; keep one"
            except json.JSONDecodeError as e:
                return f"{path}:{n}: not JSON ({e.msg} at column {e.colno}){hint}"
            if not isinstance(row, dict):
                return f"{path}:{n}: {_kind(row)} where a row is an object of columns"
    return ""


def _records(cfg, key, stream=None):
    """The records of the streamed split cfg.<key> (or of `stream`, a share of it) with
    the same one-line errors as loading it: a stream only reads (and fails on) its
    files as it is iterated."""
    stream = _hf_split(cfg, key) if stream is None else stream
    try:
        yield from stream
    except Exception as e:  # noqa: BLE001 - datasets' many errors, each one line
        raise _hf_error(cfg, e, key) from None


def _hf_identity(cfg, *parts):
    """Names what dataset=hf reads (for the tokenizer cache and the checkpoint's data position): its
    files by their contents (where they lie does not matter), or a hub dataset by its name."""
    contents = [_fingerprint(f) for p in _listed(cfg.hf_data_files) for f in expand(p)]
    key = json.dumps([cfg.hf_path, cfg.hf_name, cfg.hf_split, cfg.text_key, contents, *parts])
    return "hf_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _hf_sources(cfg):
    """(train texts, eval texts, identity) of a random-access dataset=hf: the split's
    records, and eval from hf_eval_split or hf_eval_files, else every 32nd record (~3%, the
    same every time) held out of training."""
    train = _hf_split(cfg, "hf_split")
    if held_out(cfg):
        eval_ = _hf_split(cfg, "hf_eval_split")
    else:  # spread over the whole split, so it samples the same mix of records as training
        ids = np.arange(len(train))
        train, eval_ = train.select(ids[ids % 32 > 0]), train.select(ids[::32])
    if not len(train):
        raise DataError(f"hf_split={cfg.hf_split}: no records")
    return _texts(train, cfg.text_key), _texts(eval_, cfg.text_key), _hf_identity(cfg, len(train))


class _Stream(grain.IterDataset):
    """One host's share of a streaming dataset=hf split (its records' texts; host = (process index,
    count), as datasets.distributed.split_dataset_by_node takes it), in the stream's order, epoch
    after epoch. Its state is the stream's own (datasets' state_dict): a resume goes on with the
    next record, none read twice and none skipped."""

    def __init__(self, cfg, host):
        from datasets.distributed import split_dataset_by_node

        super().__init__()
        self.cfg, self.stream = cfg, split_dataset_by_node(_hf_split(cfg, "hf_split"), *host)

    def __iter__(self):
        return _StreamIterator(self)


class _StreamIterator(grain.DatasetIterator):
    def __init__(self, ds):
        super().__init__()
        self.ds = ds
        self.epoch = 0
        self.it = _records(ds.cfg, "hf_split", ds.stream)

    def __next__(self):
        for _ in range(2):  # the end of an epoch: the next one
            try:
                return _text(next(self.it), self.ds.cfg.text_key)
            except StopIteration:
                self.epoch += 1
                self.ds.stream.set_epoch(self.epoch)
                self.it = _records(self.ds.cfg, "hf_split", self.ds.stream)
        raise DataError(
            "hf_split: this process's share of the stream is empty: fewer files than processes?"
        )

    def get_state(self):
        return {"epoch": self.epoch, "stream": self.ds.stream.state_dict()}

    def set_state(self, state):
        self.epoch = state["epoch"]
        self.ds.stream.set_epoch(self.epoch)
        self.ds.stream.load_state_dict(state["stream"])
        self.it = _records(self.ds.cfg, "hf_split", self.ds.stream)


# ---- tokenizers: trained here or read (sentencepiece, tokenizer.json) ----------------------------


def _sentences(texts, cfg):
    """What the tokenizer trains on: up to ~5 MB of the training split in record order, cut at
    line ends into sentences of about _SENTENCE_CHARS (a longer line stays whole, and
    sentencepiece skips it). Text with no such sentence stops here, naming why: sentencepiece
    would fail on it blaming vocab_size."""
    sentences, read = [], 0
    for i in range(len(texts)):
        text, chunk = texts[i], ""
        for line in text.splitlines(keepends=True):
            if chunk and len(chunk) + len(line) > _SENTENCE_CHARS:
                sentences.append(chunk)
                chunk = ""
            chunk += line
        sentences += [chunk] if chunk else []
        read += len(text)
        if read >= _TOKENIZER_SAMPLE_CHARS:
            break
    text = [s for s in sentences if not s.isspace()]
    if any(len(s) <= _MAX_SENTENCE_CHARS for s in text):
        return sentences
    if not read:
        why = (
            "every file is empty"
            if cfg.dataset in ("files", "stdlib")
            else f"every record's text (text_key={cfg.text_key!r}) is empty"
        )
    elif not text:
        why = "the text is only whitespace"
    else:
        nul = "NUL-separated text with " if any("\0" in s for s in text) else ""
        why = (
            f"{nul}no line breaks in {max(map(len, text)):,} characters (sentencepiece takes lines "
            f"of up to {_MAX_SENTENCE_CHARS:,}): break the text into lines"
        )
    raise DataError(f"{_corpus_key(cfg)}: no text to train the tokenizer on: {why}")


def _train_tokenizer(sentences, vocab_size, path):
    """Byte-fallback BPE that keeps code layout: no
    whitespace normalisation, newlines inside pieces."""
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.9995,  # rare characters go to byte pieces
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=False,
            max_sentence_length=_MAX_SENTENCE_CHARS,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    # e.g. too little text for this many pieces; spm says which size would fit
    except RuntimeError as e:
        raise DataError(
            f"vocab_size={vocab_size}: cannot train a tokenizer of that size on this text "
            f"({str(e).split('] ')[-1]})"
        ) from None
    _save(path, lambda f: f.write(model.getvalue()))


def _save(path, write):
    """write(file) into a new file that then replaces `path` atomically: a reader (another run on
    the same cache_dir) or a crash never sees half a cache file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            # on disk before the rename: a power loss must not leave `path` named but empty
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # a write that failed (a full disk) leaves no temporary file in the cache
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


class Tokenizer(NamedTuple):
    """The two kinds of tokenizer behind one face: sentencepiece (trained here, or a .model) and a
    Hugging Face tokenizer.json (the byte-level BPE of Llama 3 and Qwen, through the `tokenizers`
    library) with the special tokens and chat template its checkpoint names. Every pipeline,
    generation and export read only this."""

    encode: Callable  # text -> ids, no special tokens added
    decode: Callable  # ids -> text (special tokens dropped)
    size: int  # ids it can produce
    # starts every plain document and prompt; None: they start without one (Qwen)
    bos_id: int | None
    eos_id: int  # ends every document (and a completion)
    stop_ids: tuple  # ids that end a generation: eos, and generation_config.json's eos_token_id
    # jinja text rendering a list of messages (tokenizer_config.json), or None
    chat_template: str | None
    special: dict  # what a template may name: bos_token, eos_token, pad_token
    files: dict  # {file name: bytes}: what export writes; files[primary] is what a run keeps
    primary: str  # 'tokenizer.model' or 'tokenizer.json'
    max_token_bytes: int  # the longest token's text, in UTF-8 bytes: how long a text can be in ids
    # (messages, add_generation_prompt, marked=False) -> chat_template's text (chat_renderer)
    render: Callable | None = None


def until_stop(tokens, stop_ids):
    """The tokens before the first one that ends a generation (eos, a chat model's end of turn)."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stop_ids), tokens)


def sentencepiece_tokenizer(sp, max_length):
    """Ours: bos, eos, pad and unk pieces set when trained (a
    given .model without a bos starts documents with eos)."""
    piece = sp.id_to_piece
    bos = sp.bos_id() if sp.bos_id() >= 0 else sp.eos_id()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(bos),
        "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()),
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,  # ours is trained without sentencepiece's dummy prefix
        "model_max_length": max_length,
    }
    files = {
        "tokenizer.model": sp.serialized_model_proto(),
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
    }
    return Tokenizer(
        sp.encode,
        sp.decode,
        sp.get_piece_size(),
        bos,
        sp.eos_id(),
        (sp.eos_id(),),
        None,
        {"bos_token": piece(bos), "eos_token": piece(sp.eos_id())},
        files,
        "tokenizer.model",
        max(len(piece(i).encode()) for i in range(sp.get_piece_size())),
    )


def _token_text(value):
    """A special token as tokenizer_config.json writes
    it: its text, or {content: text, ...}, or null."""
    return value.get("content") if isinstance(value, dict) else value


def hf_tokenizer(path, date=""):
    """A Hugging Face tokenizer from its directory (or its tokenizer.json): the special tokens from
    tokenizer_config.json, the stop ids from generation_config.json too, the chat template
    from either file transformers keeps it in (rendered as of `date`, chat_date). bos is
    prepended where the checkpoint's own tokenizer prepends it."""
    import tokenizers

    folder = (os.path.dirname(path) or ".") if path.endswith(".json") else path
    file = os.path.join(folder, "tokenizer.json")
    try:
        files = {
            name: stored(os.path.join(folder, name)).read_bytes()
            for name in TOKENIZER_FILES
            if stored(os.path.join(folder, name)).is_file()
        }
        tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
    except Exception as e:  # noqa: BLE001 - a damaged file: tokenizers' own reason, one line
        raise DataError(
            f"{file}: not a Hugging Face tokenizer ({first_line(e, limit=120)})"
        ) from None
    config = (
        read_json(os.path.join(folder, "tokenizer_config.json"))
        if "tokenizer_config.json" in files
        else {}
    )
    generation = os.path.join(folder, "generation_config.json")
    generation = read_json(generation) if stored(generation).is_file() else {}
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
    ids = {k: tok.token_to_id(v) if isinstance(v, str) else None for k, v in special.items()}
    for key, value in special.items():
        if isinstance(value, str) and ids[key] is None:
            raise DataError(
                f"{folder}/tokenizer_config.json: {key} {value!r} is not a token of tokenizer.json"
            )
    stops = generation.get("eos_token_id")
    stops = [stops] if isinstance(stops, int) else [s for s in stops or () if isinstance(s, int)]
    eos = ids["eos_token"] if ids["eos_token"] is not None else (stops[0] if stops else None)
    if eos is None:
        raise DataError(
            f"{folder}: no eos token (tokenizer_config.json eos_token, generation_config.json "
            "eos_token_id), which ends every document: add one"
        )
    plain, marked = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    adds_bos = config.get(
        "add_bos_token", len(marked) > len(plain) and marked[0] == ids["bos_token"]
    )
    template, where = config.get("chat_template"), f"{folder}/tokenizer_config.json"
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if "chat_template.jinja" in files:
        template, where = files["chat_template.jinja"].decode(), f"{folder}/chat_template.jinja"
    special = {k: v or "" for k, v in special.items()}
    return Tokenizer(
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        tok.get_vocab_size(with_added_tokens=True),
        ids["bos_token"] if adds_bos else None,
        eos,
        tuple(dict.fromkeys([eos, *stops])),
        template,
        special,
        files,
        "tokenizer.json",
        max(len(t.encode()) for t in tok.get_vocab(with_added_tokens=True)),
        chat_renderer(template, special, date, where) if template else None,
    )


def tokenizer_source(cfg):
    """Where the tokenizer comes from: tokenizer_path, else load_hf's checkpoint if it holds one,
    else '' (train one here, for text)."""
    if cfg.tokenizer_path or not cfg.load_hf:
        return cfg.tokenizer_path
    folder = hf_dir(cfg.load_hf)
    has = any(
        stored(os.path.join(folder, name)).is_file()
        for name in ("tokenizer.json", "tokenizer.model")
    )
    return folder if has else ""


def load_tokenizer(path, cfg):
    """tokenizer_path (or load_hf's directory): a sentencepiece .model, a tokenizer.json, or a
    directory holding either; checked against vocab_size (the model's embedding rows: a Hugging
    Face model's may be more)."""
    import sentencepiece as spm

    folder = stored(path).is_dir()
    if folder or path.endswith(".json"):
        kind = (
            "tokenizer.json"
            if stored(os.path.join(path, "tokenizer.json")).is_file() or not folder
            else None
        )
        if folder and not kind and stored(os.path.join(path, "tokenizer.model")).is_file():
            return load_tokenizer(os.path.join(path, "tokenizer.model"), cfg)
        if not kind:
            key = "tokenizer_path" if cfg.tokenizer_path else "load_hf"
            raise DataError(
                f"{key}={getattr(cfg, key)}: no tokenizer.json or tokenizer.model in {path}; set "
                "tokenizer_path= to the model's tokenizer"
            )
        tok = hf_tokenizer(path, cfg.chat_date)
        if tok.size > cfg.vocab_size:
            raise DataError(_vocab_mismatch(cfg, path, f"{tok.size} tokens", f"{tok.size} or more"))
        return tok
    try:
        sp = (
            spm.SentencePieceProcessor(model_proto=stored(path).read_bytes())
            if remote(path)
            else spm.SentencePieceProcessor(model_file=path)
        )
    except (OSError, RuntimeError) as e:
        raise DataError(
            f"tokenizer_path={path}: not a sentencepiece model "
            f"({first_line(e, typed=False, limit=120)}); give a .model file or a "
            "tokenizer.json, or '' to train one"
        ) from None
    if (size := sp.get_piece_size()) != cfg.vocab_size:
        raise DataError(_vocab_mismatch(cfg, path, f"{size} pieces", size))
    if sp.eos_id() < 0:
        raise DataError(
            f"tokenizer {path} has no eos piece, which ends "
            "every document: retrain it with eos_id set"
        )
    return sentencepiece_tokenizer(sp, cfg.max_target_length)


def _vocab_mismatch(cfg, path, has, fix):
    """A tokenizer too large for the model: set vocab_size, unless a load_hf checkpoint decides it
    (its config.json), where only another tokenizer can fix it."""
    if cfg.load_hf:
        return (
            f"tokenizer {path} has {has} but load_hf={cfg.load_hf} has {cfg.vocab_size} embedding "
            "rows (its config.json vocab_size): give the tokenizer that checkpoint was trained "
            "with (tokenizer_path=, or leave it empty for the checkpoint's own)"
        )
    return f"vocab_size={cfg.vocab_size} but tokenizer {path} has {has}: set vocab_size={fix}"


def _tokenizer(cfg, train_texts, identity, log=None):
    """The run's tokenizer: tokenizer_source(cfg), or a
    sentencepiece BPE trained once on the text into cache_dir."""
    path = tokenizer_source(cfg)
    if not path:  # trained once into cache_dir
        path = os.path.join(cfg.cache_dir, f"tokenizer_{identity}_bpe{cfg.vocab_size}.model")
        with _locked(cfg.cache_dir):
            _set_aside_damaged(path, log)
            if not os.path.exists(path):
                with _announced(
                    log, f"training a {cfg.vocab_size}-piece BPE tokenizer on the training text"
                ):
                    _train_tokenizer(_sentences(train_texts, cfg), cfg.vocab_size, path)
    elif not stored(path).exists():
        raise DataError(
            f"tokenizer_path={path!r}: file not found (set it to a sentencepiece .model or a "
            "tokenizer.json, or '' to train one)"
        )
    return load_tokenizer(path, cfg)


def _set_aside_damaged(path, log=None):
    """A cached tokenizer that is no tokenizer (a disk that failed, a copy cut short) is renamed
    aside, never deleted, and trained again: the cache holds what the run can remake, and the
    error load_tokenizer would give names tokenizer_path, which the user did not set."""
    file = pathlib.Path(path)
    if file.exists() and (why := tokenizer_damage("tokenizer.model", file.read_bytes())):
        moved = set_aside(path, "damaged")
        (log or print)(f"WARNING: {path}: damaged ({why}); kept aside as {moved}, trained again")


# ---- tokenizers: a Hugging Face checkpoint's files (load_hf), the hub ----------------------------

# A Hugging Face checkpoint's files, all load_hf reads or export writes: the weights (one file, or
# shards and their index), the model's config, its tokenizer (tokenizer.json, or sentencepiece's
# tokenizer.model), its special tokens and chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
HF_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.model",
    "adapter_config.json",
    *TOKENIZER_FILES,
)
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def checkpoint_file(name):
    """Whether a file name is one of a Hugging Face checkpoint's (HF_FILES)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in HF_FILES)


def hub_id(name):
    """Whether load_hf=NAME names a hub model
    (Qwen/Qwen2.5-0.5B-Instruct), not a directory: org/name, not here."""
    return bool(name) and not remote(name) and HUB_ID.fullmatch(name) and not os.path.exists(name)


@functools.lru_cache
def hf_dir(name):
    """load_hf's checkpoint as a directory: a local or gs:// path as it is; a hub id fetched (the
    files above only) into huggingface_hub's cache, once per process (HF_TOKEN for a gated model;
    HF_HUB_OFFLINE=1: the cache only)."""
    if not hub_id(name):
        return name
    from huggingface_hub import snapshot_download

    for logger in ("huggingface_hub", "filelock"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    try:
        return snapshot_download(name, allow_patterns=list(HF_FILES))
    except Exception as e:  # noqa: BLE001 - no network, no such repo, gated, offline, not cached
        raise DataError(
            f"load_hf={name}: no such directory, and the Hugging Face hub did not give that model "
            f"({first_line(e, limit=120)}); a gated model needs HF_TOKEN, and offline "
            "(HF_HUB_OFFLINE=1) only models already in the hub cache load"
        ) from None


# ---- the run's tokenizer, kept beside its checkpoints --------------------------------------------

TOKENIZER_KEYS = (
    "tokenizer_path",
    "load_hf",
    "vocab_size",
    "dataset",
    "dataset_path",
    "tfds_name",
    "train_split",
    "hf_path",
    "hf_name",
    "hf_data_files",
    "hf_split",
    "text_key",
)


def flat(values, prefix=""):
    """A nested dict as {'section.key': value}: how configs are compared and shown."""
    pairs = {}
    for k, v in values.items():
        pairs.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return pairs


def run_config(run_dir):
    """run_dir's config.yml as {'section.key': value}: {} where there is none, a DataError naming it
    where it is damaged (cut short, not text, nested past the parser, not the mapping a run
    writes)."""
    path = os.path.join(run_dir, "config.yml")
    try:
        values = yaml.safe_load(stored(path).read_text())
    except FileNotFoundError:
        return {}
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(f"{path}: damaged ({first_line(e, typed=False, limit=80)})") from None
    if not isinstance(values, dict):
        raise DataError(
            f"{path}: damaged (it holds a YAML {type(values).__name__}, not the mapping a run "
            "writes)"
        )
    return flat(values)


def config_changes(run_dir, cfg):
    """'key (old -> new)' for each key whose value differs from run_dir's config.yml (none where
    it is missing, unreadable or damaged: nothing to compare with)."""
    try:
        old = run_config(run_dir)
    except (*STORAGE_ERRORS, DataError):
        return []
    new = flat(cfg.model_dump(mode="json"))
    return [f"{k} ({old[k]} -> {new[k]})" for k in new if k in old and old[k] != new[k]]


def keep_damaged_config(run_dir, log):
    """A damaged config.yml (run_config) is renamed aside, never deleted, before the run writes its
    own. It is the run's record of its config, not an input (the command line is), so the run goes
    on: stopping would only make the user move by hand a file the run rewrites anyway."""
    try:
        run_config(run_dir)
    except DataError as e:
        moved = set_aside(os.path.join(run_dir, "config.yml"), "damaged")
        log(
            f"WARNING: {e}; kept it aside as {os.path.basename(moved)}, and this run writes its "
            "config anew"
        )


def keep_tokenizer(ds, run_dir, resumed, cfg):
    """What a checkpoint's token ids mean is part of it: a run keeps its tokenizer as
    RUN_DIR/tokenizer.model, and a resume whose tokenizer differs (other files, vocab_size,
    tokenizer_path) stops, naming what changed since the run's config.yml; a kept file that is no
    tokenizer at all stops as damaged, not as a change. A Hugging Face tokenizer is kept as
    RUN_DIR/tokenizer.json with its special tokens and template beside it."""
    tok = ds.tokenizer
    path = os.path.join(run_dir, tok.primary)
    model = tok.files[tok.primary]
    if not (resumed and stored(path).exists()):
        # A Hugging Face tokenizer keeps its special tokens and template beside it.
        kept = tok.files if tok.primary == "tokenizer.json" else {tok.primary: model}
        for name, content in kept.items():
            write(os.path.join(run_dir, name), content)
        return
    kept = stored(path).read_bytes()
    if kept == model:
        return
    if why := tokenizer_damage(tok.primary, kept):
        raise DataError(
            f"{path}: damaged ({why}); the checkpoint's token ids are this file's tokenizer: "
            "restore it from a copy, or move it away to go on with the tokenizer this run has now "
            "(the same one unless the training text, tokenizer_path, vocab_size or load_hf changed)"
        )
    raise DataError(
        f"{path}: this run's tokenizer would change with {tokenizer_change(run_dir, cfg)}: the "
        f"checkpoint's token ids would mean other text; undo the change, set tokenizer_path={path} "
        "to keep its tokenizer, or start a new run_name (load_params= takes the weights)"
    )


def tokenizer_damage(name, content):
    """Why `content` is not a tokenizer file `name` (tokenizer.model or tokenizer.json), or ''."""
    kind = "Hugging Face" if name == "tokenizer.json" else "sentencepiece"
    try:
        if name == "tokenizer.json":
            import tokenizers

            ok = bool(tokenizers.Tokenizer.from_str(content.decode()))
        else:
            import sentencepiece as spm

            # an empty proto loads as a model of no pieces (that logs on stderr when asked its size)
            ok = bool(content) and spm.SentencePieceProcessor(model_proto=content).get_piece_size()
    except Exception:  # noqa: BLE001 - each library's own parse error; its text says no more
        ok = False
    return "" if ok else f"not a {kind} tokenizer"


def tokenizer_change(run_dir, cfg):
    """What changed the run's tokenizer, as the keys config_changes names; without a config.yml to
    compare with (missing, or damaged and kept aside), that is said, not guessed."""
    changed = [c for c in config_changes(run_dir, cfg) if c.split()[0] in TOKENIZER_KEYS]
    try:
        known = bool(changed or run_config(run_dir))
    except DataError:
        known = False
    if not known:
        return (
            f"a change not named ({run_dir}/config.yml, the config to compare with, is missing "
            "or was damaged)"
        )
    if changed:
        return ", ".join(changed)
    return "the training text (its files changed, so the tokenizer trained on them did)"


# ---- text: packing -------------------------------------------------------------------------------


def _pack(docs, length):
    """Rows of `length` (input, target) pairs from an IterDataset
    of token documents: grain's concatenate-then-split.

    A document of m tokens holds m-1 pairs (tok[t], tok[t+1]); packing pairs rather than tokens
    means no target ever crosses a document boundary and no slot is spent on one. A document that
    does not fit continues in the next row as a new segment, so rows are full until `docs` runs out
    (eval): then the last row is padded and iteration stops. The state is where the row's first
    document starts (grain replays at most a row to resume).
    """
    pairs = docs.map(lambda doc: {"inputs": doc[:-1], "targets": doc[1:]})
    packed = ConcatThenSplitIterDataset(pairs, length_struct={"inputs": length, "targets": length})
    return packed.map(
        lambda p: {
            "inputs": p["inputs"],
            "targets": p["targets"],
            "segment_ids": p["inputs_segment_ids"],
            "positions": p["inputs_positions"],
            "loss_mask": (p["inputs_segment_ids"] > 0).astype(np.float32),
        }
    )


class TextData(_Data):
    """Documents from a random-access text source, tokenized on the fly and packed into rows."""

    def __init__(self, cfg, process_index, process_count, log=None):
        super().__init__(cfg, process_index, process_count, log)
        self.train_texts, self.eval_texts, self.identity = self._sources()
        # The eval records this process reads: disjoint between processes, all of them
        # together. A process left without any (fewer records than processes) reads
        # padding, which weighs nothing.
        self.eval_records = np.arange(process_index, len(self.eval_texts), process_count)
        self.tokenizer = _tokenizer(cfg, self.train_texts, self.identity, self.log)
        self._order = self.train_texts.shuffle(seed=cfg.seed).repeat().map(self.encode)

    def _sources(self):
        """(train texts, eval texts, identity) of
        cfg.dataset, as the *_sources functions make them."""
        sources = {"tfds": _tfds_sources, "hf": _hf_sources}.get(self.cfg.dataset)
        return sources(self.cfg) if sources else _file_sources(self.cfg, self.log)

    def encode(self, text):
        """A document's tokens: bos (where the tokenizer has
        one), text, eos (so every token is a target)."""
        tok = self.tokenizer
        return np.asarray(
            [tok.bos_id] * (tok.bos_id is not None) + tok.encode(text) + [tok.eos_id], np.int32
        )

    def _lane(self, row, rows):
        return _pack(super()._lane(row, rows), self.length)

    def eval_batches(self, local_rows, n):
        # Fixed order and a single pass: batches past the
        # end of the split are padding (loss_mask 0).
        docs = grain.MapDataset.source(self.eval_records).map(
            lambda i: self.encode(self.eval_texts[i])
        )
        rows = iter(_pack(docs.to_iter_dataset(_READ), self.length))
        batches = []
        # one pass at most: a batch after the last row is made only as the first (padding)
        while len(batches) < n and (
            chunk := list(itertools.islice(rows, local_rows)) or not batches
        ):
            batches.append(_stack(chunk, local_rows, self.length))
        return batches


class StreamData(TextData):
    """dataset=hf with hf_streaming: a split too large to download, read as a stream. Each process
    reads its share (datasets.distributed.split_dataset_by_node) in the stream's order, packed into
    its rows by one pipeline; the checkpoint keeps that pipeline's position, so a resume on the same
    process count reads every document once. The tokenizer trains on the stream's first ~5 MB; eval
    reads the head of hf_eval_split (or hf_eval_files)."""

    def _sources(self):
        """The stream's head (~5 MB, what the tokenizer trains
        on), the head of the held-out split, and the identity."""
        cfg = self.cfg
        if not held_out(cfg) and cfg.eval_batches:
            raise DataError(
                "hf_streaming=true holds no share out for eval: set hf_eval_files, hf_eval_split "
                "(e.g. validation), or eval_batches=0"
            )
        head, chars = [], 0
        for record in _records(cfg, "hf_split"):
            head.append(record)
            chars += len(_text(record, cfg.text_key))
            if chars >= _TOKENIZER_SAMPLE_CHARS:
                break
        evals = (
            list(itertools.islice(_records(cfg, "hf_eval_split"), _EVAL_HEAD_DOCS))
            if held_out(cfg)
            else []
        )
        return _texts(head, cfg.text_key), _texts(evals, cfg.text_key), _hf_identity(cfg, "stream")

    def train_iter(self, local_rows, state=None):
        host = (self.process_index, self.process_count)
        batches = _pack(_Stream(self.cfg, host).map(self.encode), self.length).batch(
            local_rows, drop_remainder=True
        )
        return _StreamBatches(
            batches,
            self.cfg.prefetch,
            host,
            local_rows,
            self._resumable(state, local_rows),
            self.identity,
        )


# ---- text: supervised fine-tuning (SFT) ----------------------------------------------------------
# Rows of a dataset=hf split that hold `messages` (a list of {role, content} turns) or `prompt` and
# `completion` are SFT examples (trl's formats): each is tokenized whole with a mask of its answer's
# tokens, and rows are made of whole examples, never one cut between rows.


def sft_rows(cfg):
    """Whether dataset=hf's rows are SFT examples: the first
    training row holds messages, or prompt and completion."""
    if cfg.dataset != "hf" or cfg.hf_streaming:
        return False
    split = _hf_split(cfg, "hf_split")
    first = split[0] if len(split) else {}
    return cfg.text_key not in first and (
        "messages" in first or {"prompt", "completion"} <= set(first)
    )


# What a template's {% generation %} blocks render (what the model writes, as trl's training
# templates mark it) comes back between these private-use characters when asked for (marked=True).
ANSWER_MARKS = ("\ue000", "\ue001")
_UNMARKED = {ord(c): None for c in ANSWER_MARKS}
# Appended to a turn's content to find where the whole conversation renders that turn's end.
_END_PROBE = "\ue002"
# The seconds one row may take to render and tokenize: data preparation runs before the watchdog.
ROW_SECONDS = 10


def chat_renderer(template, special, date, where):
    """A chat template as transformers renders it: (messages, add_generation_prompt, marked=False)
    -> text. jinja2's sandbox with trim_blocks, lstrip_blocks, loop controls, {% generation %}
    blocks (marked: kept between ANSWER_MARKS), raise_exception, tojson, and strftime_now at `date`
    (the run's chat_date, so a resume renders what the first run did; '' = today). Compiled at its
    first use: one that does not compile is one line naming `where`, its file."""

    @functools.cache
    def compiled():
        return _compiled_template(template, date, where)

    def render(messages, prompt, marked=False):
        text = compiled().render(messages=messages, add_generation_prompt=prompt, **special)
        return text if marked else text.translate(_UNMARKED)

    return render


def _compiled_template(template, date, where):
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """{% generation %} ... {% endgeneration %}: its output between ANSWER_MARKS."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("mark"), [], [], body).set_lineno(line)

        def mark(self, caller):
            return ANSWER_MARKS[0] + caller() + ANSWER_MARKS[1]

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = (
        lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
            x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
        )
    )
    day = time.strptime(date, "%Y-%m-%d") if date else time.localtime()
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda f: time.strftime(f, day)
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"{where}: the chat template does not compile (line {e.lineno}: {e.message}); fix it, "
            "or give tokenizer_path= a tokenizer whose template does"
        ) from None


@contextlib.contextmanager
def _bounded(seconds, message):
    """The block, stopped with DataError(message) past `seconds` (a timer signal, so only on the
    main thread; elsewhere it runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(*_):
        raise DataError(message)

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _kind(value):
    """A JSON value's kind in words, with a glimpse of it: what a wrong row holds instead."""
    kinds = {bool: "true or false", int: "a number", float: "a number", list: "a list"}
    kinds.update({dict: "an object", str: "text", type(None): "null"})
    return f"{kinds.get(type(value), type(value).__name__)} ({json.dumps(value, default=str)[:40]})"


def _turns(messages, where, key="messages"):
    """messages checked to be a list of {role, content} turns with text content; else the one turn
    and field that is not, with what it holds."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key} is {_kind(messages)}, expected a list of turns")
    for j, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise DataError(f'{where}: {key}[{j}] is {_kind(turn)}, expected {{"role", "content"}}')
        for field in ("role", "content"):
            if not isinstance(turn.get(field), str):
                held = _kind(turn[field]) if field in turn else "missing"
                raise DataError(f"{where}: {key}[{j}].{field} is {held}, expected text")
    return messages


def chat_spans(messages, render, first, where):
    """[(text, is_answer)] of a conversation rendered whole by its chat template; the answers are
    the assistant turns from index `first` on, each where the whole conversation renders it, from
    the end of the generation prompt that precedes it through its end-of-turn token (the model
    learns to stop). A template with {% generation %} blocks marks them itself; else a turn ends
    where the template renders the end of its content, and what it writes after content ends a
    turn (the text after a last turn's content): so templates that render earlier turns otherwise
    once later ones follow (Qwen3's drops their reasoning) are marked as well. One that hides its
    turns from both is refused, naming the turn."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if not answers:
        raise DataError(
            f"{where}: no assistant turn to learn from (roles: {[m['role'] for m in messages]})"
        )
    if render is None:
        raise DataError(
            f"{where}: chat rows go through the tokenizer's chat template, and it has none "
            "(tokenizer_config.json chat_template, chat_template.jinja): give prompt/completion "
            "text rows, or tokenizer_path= a tokenizer with a template"
        )
    try:
        whole, cuts = _marked_answers(messages, answers, render, where) or _found_answers(
            messages, answers, render, where
        )
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception, ...)
        raise DataError(f"{where}: the chat template failed ({first_line(e, limit=120)})") from None
    spans, at = [], 0
    for start, end in cuts:
        spans += [(whole[at:start], False), (whole[start:end], True)]
        at = end
    return spans + [(whole[at:], False)]


def _marked_answers(messages, answers, render, where):
    """(the whole text, (start, end) of each answer) from the template's {% generation %} blocks,
    the k-th the k-th assistant turn's; None for a template without them."""
    marked = render(messages, False, marked=True)
    if ANSWER_MARKS[0] not in marked:
        return None
    out, blocks, at, opened = [], [], 0, 0
    for piece in re.split(f"([{''.join(ANSWER_MARKS)}])", marked):
        if piece == ANSWER_MARKS[0]:
            opened = at
        elif piece == ANSWER_MARKS[1]:
            blocks.append((opened, at))
        else:
            out.append(piece)
            at += len(piece)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(blocks) != len(turns):
        raise DataError(
            f"{where}: the chat template's generation blocks mark {len(blocks)} answers for "
            f"{len(turns)} assistant turns; fix the template's {{% generation %}} markers"
        )
    return "".join(out), [cut for i, cut in zip(turns, blocks) if i in answers]


def _found_answers(messages, answers, render, where):
    """(the whole text, (start, end) of each answer): each starts where the prompt before it,
    with its generation prompt, ends, and ends where the conversation up to it ends, or, for a
    template that renders that prefix otherwise inside the whole, where _turn_end finds it."""
    whole, cuts, at = render(messages, False), [], 0
    for i in answers:
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        prefix = through.startswith(before) and whole.startswith(through)
        end = len(through) if prefix else _turn_end(messages, i, whole, render)
        if not (whole.startswith(before) and at <= len(before) <= end):
            raise DataError(
                f"{where}: the chat template renders turn {i} differently inside the whole "
                "conversation, so its answer cannot be marked; give prompt/completion rows"
            )
        cuts.append((len(before), end))
        at = end
    return whole, cuts


def _turn_end(messages, i, whole, render):
    """Where the whole conversation ends assistant turn i: the end of its content, found by a probe
    appended to it, then what the template writes after a last turn's content (its end-of-turn).
    -1 where the probe is not found once, or the probed rendering is not the whole plus it."""
    probed = [*messages[:i], {**messages[i], "content": messages[i]["content"] + _END_PROBE}]
    marked, alone = render(probed + messages[i + 1 :], False), render(probed, False)
    if marked.count(_END_PROBE) != 1 or alone.count(_END_PROBE) != 1:
        return -1
    if marked.replace(_END_PROBE, "") != whole:
        return -1
    end, trailer = marked.index(_END_PROBE), alone[alone.index(_END_PROBE) + 1 :]
    return end + len(trailer) if whole.startswith(trailer, end) else -1


def _common_prefix(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def sft_example(record, tok, cfg, where):
    """One SFT record -> (token ids, 1 where the token is an answer's) as int32 / bool arrays, or
    None for one surely longer than a row (max_target_length) by its bytes alone, left untokenized
    (a 100 MB line would take minutes and tens of GB). messages go through the chat template
    (which writes bos and end-of-turn tokens itself), a conversational prompt/completion (lists of
    turns) too, only the completion's turns answers; text prompt/completion as trl tokenizes it:
    bos + the two as one text + eos, the answer starting where those tokens leave the prompt's own
    (a prompt ending in a space gives its space to the answer's first token, as the whole text
    tokenizes at inference). A DataError names the row and what is wrong."""
    # datasets fills in None for a column other rows have
    record = {k: v for k, v in record.items() if v is not None}
    limit = 4 * (cfg.max_target_length + 1) * tok.max_token_bytes  # bytes: surely too long
    with _bounded(
        ROW_SECONDS,
        f"{where}: took over {ROW_SECONDS}s to render and tokenize (a chat template that loops?)",
    ):
        if "messages" in record or isinstance(record.get("prompt"), list):
            if "messages" in record:
                turns, first = _turns(record["messages"], where), 0
            else:
                turns = _turns(record["prompt"], where, "prompt")
                turns, first = (
                    turns + _turns(record.get("completion"), where, "completion"),
                    len(turns),
                )
            spans = chat_spans(turns, tok.render, first, where)
            if sum(len(text.encode()) for text, _ in spans) > limit:
                return None
            return _spans_example(spans, tok, where)
        if "prompt" not in record and "completion" not in record:
            raise DataError(
                f"{where}: an SFT row holds messages, or prompt and completion (this one has "
                f"{sorted(record)})"
            )
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                held = _kind(record[key]) if key in record else "missing"
                raise DataError(f"{where}: {key} is {held}, expected text (or a list of turns)")
        if len((record["prompt"] + record["completion"]).encode()) > limit:
            return None
        return _text_example(record["prompt"], record["completion"], tok)


def _spans_example(spans, tok, where):
    ids, answer = [], []
    for text, is_answer in spans:
        piece = tok.encode(text)
        if is_answer and not piece:
            raise DataError(f"{where}: an empty answer (nothing to learn)")
        ids, answer = ids + piece, answer + [is_answer] * len(piece)
    return np.asarray(ids, np.int32), np.asarray(answer, bool)


def _text_example(prompt, completion, tok):
    bos = [tok.bos_id] if tok.bos_id is not None else []
    ids = bos + tok.encode(prompt + completion)
    ids += [tok.eos_id] if ids[-1:] != [tok.eos_id] else []  # a completion ending in eos keeps one
    start = _common_prefix(bos + tok.encode(prompt), ids)
    return np.asarray(ids, np.int32), np.arange(len(ids)) >= start


class _Plan:
    """One lane's rows, planned as they are asked for: the lane's examples in order (`ids`, an
    iterator), each row filled greedily with whole examples while the next fits (packing) or
    holding one. Past the last example (a finite number of epochs) a row is empty: padding, which
    weighs nothing in the loss."""

    def __init__(self, ids, lengths, length, packing):
        self.ids = ids
        self.lengths = lengths
        self.length = length
        self.packing = packing
        self.rows = []
        self.open = []
        self.used = 0

    def __getitem__(self, k):
        while len(self.rows) <= k and self._one_more():
            pass
        return self.rows[k] if k < len(self.rows) else []

    def __len__(self):  # every row (a finite plan only)
        while self._one_more():
            pass
        return len(self.rows)

    def _one_more(self):
        for i in self.ids:
            pairs = self.lengths[i] - 1
            full = self.open and (not self.packing or self.used + pairs > self.length)
            if full:
                self.rows.append(self.open)
            self.open, self.used = ([i], pairs) if full else (self.open + [i], self.used + pairs)
            if full:
                return True
        if self.open:
            self.rows.append(self.open)
            self.open = []
            return True
        return False


class SFTData(_Data):
    """dataset=hf rows that are SFT examples (sft_rows): tokenized once at the start with the
    run's tokenizer (the model's: load_hf's or tokenizer_path), an example longer than a row
    skipped and counted in the log. Lane r of R packs (or pads), in order, the examples at
    positions r, r + R, ... of one order shuffled per epoch from the seed, planned from their
    lengths (_Plan): its state is a row number, so a resume on any process count is exact, and
    epochs=N reads every example exactly N times (epoch_steps; a resume with another epochs is one
    line). The loss counts the answers' tokens (completion_only; else every token); eval the
    held-out rows' the same way, all of them by default (whole_eval; eval_size says how many), and
    eval_examples holds their prompts and answers."""

    whole_eval = True

    def __init__(self, cfg, process_index, process_count, log=None):
        super().__init__(cfg, process_index, process_count, log)
        if not tokenizer_source(cfg):
            raise DataError(
                "SFT rows (messages, or prompt and completion) need the model's tokenizer: set "
                "load_hf= (a checkpoint with its tokenizer) or tokenizer_path="
            )
        self.tokenizer = tok = load_tokenizer(tokenizer_source(cfg), cfg)
        train = _hf_split(cfg, "hf_split")
        # the rows' numbers in their files, for the errors
        train_rows = held_rows = np.arange(len(train))
        if held_out(cfg):
            held = _hf_split(cfg, "hf_eval_split")
            held_rows = np.arange(len(held))
        else:  # every 32nd row (~3%, the same every time) held out
            train_rows, held_rows = train_rows[train_rows % 32 > 0], train_rows[::32]
            train, held = train.select(train_rows), train.select(held_rows)
        # what the ids mean, and how rows are cut (a template's date too, where it reads one); the
        # epochs the lanes' orders are planned for
        tokenizer = hashlib.sha1(tok.files[tok.primary]).hexdigest()
        dated = cfg.chat_date if "strftime_now" in (tok.chat_template or "") else ""
        self.data_identity = _hf_identity(
            cfg,
            len(train),
            self.kind.lower(),
            tokenizer,
            cfg.completion_only,
            cfg.packing,
            self.length,
            dated,
        )
        self.identity = f"{self.data_identity}/epochs={cfg.epochs}"
        self.train_tokens, self.train_ids = self._encoded(train, train_rows, "hf_split")
        eval_key = "hf_eval_split" if held_out(cfg) else "hf_split"
        eval_tokens, eval_ids = self._encoded(held, held_rows, eval_key)
        self.eval_ids = eval_ids
        mine = eval_ids[
            process_index::process_count
        ]  # each process its share of the held-out examples
        plan = _Plan(iter(mine), [self._length(x) for x in eval_tokens], self.length, self.packs)
        self.eval_rows = [plan[k] for k in range(len(plan))]
        self.eval_tokens = eval_tokens
        self.eval_examples = self._eval_examples(eval_tokens, eval_ids)
        weights = [self._row([eval_tokens[i]])["loss_mask"].sum() for i in eval_ids]
        self.eval_size = {"rows": len(eval_ids), "tokens": float(sum(weights))}
        self._plans = {}

    def _encoded(self, split, rows, key):
        """Every example of a split tokenized ([(ids, answer mask)], empty for one left untokenized
        as surely too long), and the indices of those that fit a row. `rows`: their numbers in the
        files (errors name them)."""
        cfg = self.cfg
        tok = self.tokenizer
        where = split_name(cfg, key)
        start = time.perf_counter()
        out = [
            self._example(split[i], tok, cfg, f"{where}: row {rows[i]}") for i in range(len(split))
        ]
        unread = sum(example is None for example in out)
        out = [self.empty if example is None else example for example in out]
        fits = [i for i, x in enumerate(out) if 0 < self._length(x) <= self.length + 1]
        longest = max((self._length(x) for x in out), default=0)
        if len(out) > len(fits):
            untokenized = (
                f"; {unread} of them by their bytes alone, not tokenized" if unread else ""
            )
            self.log(
                f"skipped {len(out) - len(fits)} of {len(out)} examples of {where} longer than "
                f"max_target_length={self.length} tokens (the longest tokenized: {longest}"
                f"{untokenized}); raise max_target_length to keep them"
            )
        if not fits:
            shortest = min((self._length(x) for x in out if self._length(x) > 0), default=0)
            raise DataError(
                f"{where}: no example fits max_target_length={self.length} (the shortest has "
                f"{shortest or 'more'} tokens); raise it"
            )
        segments = [s for i in fits for s in self._segments([out[i]])]
        self.log(
            f"{where}: {len(fits)} {self.kind} examples, {sum(len(ids) for ids, _ in segments):,} "
            f"tokens, {sum(int(answer.sum()) for _, answer in segments):,} of them answers "
            f"({time.perf_counter() - start:.1f}s)"
        )
        return out, np.asarray(fits)

    # What an example is, for the rows: SFT's is (token ids, answer mask), one segment of a row.
    kind = "SFT"
    packs = property(lambda self: self.cfg.packing)
    empty = (np.zeros(0, np.int32), np.zeros(0, bool))

    def _example(self, record, tok, cfg, where):
        return sft_example(record, tok, cfg, where)

    def _length(self, example):
        """Its tokens as a row counts them: each of its positions, plus one."""
        return len(example[0])

    def _segments(self, examples):
        """The (ids, answer mask) segments of a row holding these examples, in order."""
        return examples

    def _eval_examples(self, tokens, ids):
        """The held-out (prompt tokens, answer text) pairs that eval_answers scores."""
        return [self._prompt_and_answer(*tokens[i]) for i in ids]

    def _resumable(self, state, local_rows):
        """Lanes planned for another number of epochs would skip or repeat examples: one line."""
        source = (state or {}).get("source", "")
        if source == self.data_identity:  # written before the epochs were part of it
            state = {**state, "source": self.identity}
        elif source.rpartition("/epochs=")[0] == self.data_identity and source != self.identity:
            epochs = source.rpartition("/epochs=")[2]
            raise DataError(
                f"epochs={self.cfg.epochs}: this run's checkpoint planned its data for epochs="
                f"{epochs}, and another count would read some examples once and others more "
                f"often; resume with epochs={epochs}, or train on in a new run_name with "
                "load_params=RUN_DIR"
            )
        return super()._resumable(state, local_rows)

    def _prompt_and_answer(self, ids, answer):
        """(the tokens before the last answer, that answer's text up to the token that ends it)."""
        first = last = np.flatnonzero(answer)[-1]
        while first > 0 and answer[first - 1]:
            first -= 1
        answer = until_stop(ids[first : last + 1].tolist(), self.tokenizer.stop_ids)
        return ids[:first], self.tokenizer.decode(answer)

    def plan(self, row, rows, epochs):
        """Lane `row` of `rows`: its rows of example ids (a _Plan, endless when epochs is 0)."""
        if (row, rows, epochs) not in self._plans:
            order = grain.MapDataset.range(len(self.train_ids)).shuffle(seed=self.cfg.seed).repeat()
            positions = itertools.count(row, rows)
            if epochs:
                positions = range(row, epochs * len(self.train_ids), rows)
            lengths = [self._length(x) for x in self.train_tokens]
            ids = (self.train_ids[order[k]] for k in positions)
            self._plans[row, rows, epochs] = _Plan(ids, lengths, self.length, self.packs)
        return self._plans[row, rows, epochs]

    def epoch_steps(self, rows, accum, epochs):
        """The steps that read every training example `epochs` times with `rows` lanes and `accum`
        rows of each a step: the longest lane's rows (the others end with padding)."""
        return max(1, -(-max(len(self.plan(r, rows, epochs)) for r in range(rows)) // accum))

    def _lane(self, row, rows):
        plan = self.plan(row, rows, self.cfg.epochs)
        row_of = lambda k: self._row([self.train_tokens[i] for i in plan[k]])
        return grain.MapDataset.range(sys.maxsize).map(row_of).to_iter_dataset(_READ)

    def _row(self, examples):
        """One row of whole examples (segments 1, 2, ...;
        positions restart in each), padded with segment 0."""
        L, row = (
            self.length,
            {
                k: np.zeros(self.length, np.int32)
                for k in ("inputs", "targets", "segment_ids", "positions")
            },
        )
        row["loss_mask"], at = np.zeros(L, np.float32), 0
        for segment, (ids, answer) in enumerate(self._segments(examples), 1):
            n = len(ids) - 1
            row["inputs"][at : at + n], row["targets"][at : at + n] = ids[:-1], ids[1:]
            row["segment_ids"][at : at + n], row["positions"][at : at + n] = segment, np.arange(n)
            row["loss_mask"][at : at + n] = answer[1:] if self.cfg.completion_only else 1.0
            at += n
        return row

    def eval_batches(self, local_rows, n):
        """The held-out examples in order, one pass, packed
        as training packs; batches past them are padding."""
        rows = [self._row([self.eval_tokens[i] for i in r]) for r in self.eval_rows]
        every = max(-(-len(rows) // local_rows), 1)
        n = every if n is None else min(n, every)  # one pass at most; None: all of it
        return [
            _stack(
                rows[b * local_rows : (b + 1) * local_rows], local_rows, self.length, self.fields
            )
            for b in range(n)
        ]


# ---- Preference pairs (task=dpo): trl's formats, a pair to a row ---------------------------------


def dpo_pair(record, tok, cfg, where):
    """One preference row -> ((chosen ids, answer mask), (rejected ids, answer mask)), tokenized as
    trl's DPOTrainer (1.16) does, or None for one surely longer than a row by its bytes. Text rows:
    bos + prompt + chosen + eos as one text (eos added unless chosen ends in it), the rejected
    alike; conversational rows (prompt a list of turns, chosen / rejected lists of assistant turns)
    through the chat template whole, the prompt rendered with the generation prompt. The answer
    starts where both whole texts' tokens leave the prompt's own. Rows without a prompt share
    theirs: the turns (or characters) chosen and rejected have in common (a space before the split
    goes to the answers), as trl's extract_prompt. A DataError names the row and what is wrong."""
    record = {k: v for k, v in record.items() if v is not None}
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(
                f"{where}: a preference row holds chosen and rejected (and a prompt unless they "
                f"share it); this one has {sorted(record)}"
            )
    if "prompt" not in record:
        record = {**record, **_shared_prompt(record["chosen"], record["rejected"])}
    chat = isinstance(record["prompt"], list)
    for key in ("prompt", "chosen", "rejected"):
        if chat:
            _turns(record[key], where, key)
        elif not isinstance(record[key], str):
            raise DataError(f"{where}: {key} is {_kind(record[key])}, expected text like prompt")
    limit = 4 * (cfg.max_target_length + 1) * tok.max_token_bytes
    if len(json.dumps([record[k] for k in ("prompt", "chosen", "rejected")])) > limit:
        return None
    with _bounded(ROW_SECONDS, f"{where}: took over {ROW_SECONDS}s to render and tokenize"):
        if chat:
            if tok.render is None:
                raise DataError(
                    f"{where}: conversational pairs go through the tokenizer's chat template, and "
                    "it has none: give text rows, or tokenizer_path= a tokenizer with a template"
                )
            prompt = tok.encode(tok.render(record["prompt"], True))
            wholes = [tok.encode(tok.render(record["prompt"] + record[k], False)) for k in SIDES]
        else:
            bos = [tok.bos_id] if tok.bos_id is not None else []
            eos = tok.special.get("eos_token") or ""
            prompt = bos + tok.encode(record["prompt"])
            wholes = []
            for key in SIDES:
                text = (
                    record[key][: -len(eos)] if eos and record[key].endswith(eos) else record[key]
                )
                wholes.append(bos + tok.encode(record["prompt"] + text) + [tok.eos_id])
    start = min(_common_prefix(prompt, ids) for ids in wholes)
    return tuple((np.asarray(ids, np.int32), np.arange(len(ids)) >= start) for ids in wholes)


SIDES = ("chosen", "rejected")


def _shared_prompt(chosen, rejected):
    """trl's extract_prompt: the prompt is what chosen and rejected start with alike (turns, or
    characters; a space just before they part goes to both answers). Where one is a prefix of the
    other, trl leaves their last shared item to both answers; so does this."""
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), n - 1)
    if cut < n and chosen[cut] != rejected[cut] and cut and chosen[cut - 1] == " ":
        cut -= 1
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


class DPOData(SFTData):
    """task=dpo's rows: preference pairs read as SFT rows are (dataset=hf, held-out rows, epochs,
    exact resume), one pair a row: chosen as segment 1, rejected as segment 2, each from position
    0, their answers' tokens in loss_mask. per_device_batch counts pairs, as trl's batch size does,
    and max_target_length holds both sequences of a pair. A full fine-tune's rows carry the
    reference log-probabilities (model.dpo_prepare computes them once): `reference` holds each
    side's at its first position, zero elsewhere (and everywhere with LoRA, whose reference is the
    base)."""

    kind = "DPO"
    packs = False
    fixed: ClassVar[dict] = {"packing": False, "completion_only": True}
    empty = (SFTData.empty, SFTData.empty)
    fields: ClassVar[dict] = {**FIELDS, "reference": np.float32}

    def _example(self, record, tok, cfg, where):
        return dpo_pair(record, tok, cfg, where)

    def _length(self, pair):
        return len(pair[0][0]) + len(pair[1][0]) - 1

    def _segments(self, pairs):
        return [side for pair in pairs for side in pair[:2]]

    def _eval_examples(self, tokens, ids):
        return []

    def _row(self, pairs):
        row = super()._row(pairs)
        row["reference"] = np.zeros(self.length, np.float32)
        first = np.flatnonzero(np.diff(row["segment_ids"], prepend=0) > 0)
        refs = [value for pair in pairs for value in (pair[2] if len(pair) > 2 else (0.0, 0.0))]
        row["reference"][first] = refs
        return row

    def reference_rows(self, local_rows, held_only=False):
        """The pairs whose reference this process computes (its share of train's, unless held_only,
        then of the held-out), as batches of a row each, made as they are read; `example` numbers
        each row's pair: train's by index, the held-out's after them (-1: padding)."""
        train = [] if held_only else list(self.train_ids)
        numbers = [*train, *(len(self.train_tokens) + np.asarray(self.eval_ids, int))]
        mine = numbers[self.process_index :: self.process_count]
        count = max(1, -(-len(mine) // local_rows))
        return _Lazy(
            count, lambda b: self._numbered(mine[b * local_rows : (b + 1) * local_rows], local_rows)
        )

    def _numbered(self, numbers, local_rows):
        T = len(self.train_tokens)
        pair = lambda n: self.train_tokens[n] if n < T else self.eval_tokens[n - T]
        rows = [
            {**self._row([pair(n)]), "example": np.full(self.length, n, np.int32)} for n in numbers
        ]
        batch = _stack(rows, local_rows, self.length, {**self.fields, "example": np.int32})
        batch["example"][len(rows) :] = -1
        return batch

    def pairs_digest(self, held_only=False):
        """A SHA-1 of the pairs' tokens and answer masks (the held-out's alone, or train's too):
        what a stored reference was computed on."""
        digest = hashlib.sha1()
        for pair in ([] if held_only else self.train_tokens) + self.eval_tokens:
            for ids, answer in pair[:2]:
                digest.update(ids.tobytes() + answer.tobytes() + b"|")
        return digest.hexdigest()

    def with_reference(self, train, held):
        """Each pair's (chosen, rejected) reference log-probabilities from now on: [train examples,
        2] and [held-out examples, 2], by index (rows that do not fit are never read)."""
        self.train_tokens = [
            (*p[:2], tuple(map(float, r))) for p, r in zip(self.train_tokens, train)
        ]
        self.eval_tokens = [(*p[:2], tuple(map(float, r))) for p, r in zip(self.eval_tokens, held)]


class _Lazy:
    """A sequence of n items made as each is read (fn(k))."""

    def __init__(self, n, fn):
        self.n = n
        self.fn = fn

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        if not 0 <= k < self.n:
            raise IndexError(k)
        return self.fn(k)


# ---- Sudoku: the rules, defined once -------------------------------------------------------------
# Grids are 81 digits in row-major order, 0 = blank. Each cell lies in three units (its row, column
# and box, numbered 0..26); two cells are peers when they share a unit. The solver below, the CSV
# checks, eval scoring and the ToT search (model.py) all read the rules from these tables.

# [81, 3]
UNITS = np.array(
    [[i // 9, 9 + i % 9, 18 + (i // 27) * 3 + (i % 9) // 3] for i in range(SUDOKU_LEN)]
)
# bool[81, 81]
PEERS = (UNITS[:, None, :] == UNITS[None, :, :]).any(-1) & ~np.eye(SUDOKU_LEN, dtype=bool)
# [27 units, 81 cells]
MEMBERS = (UNITS[None, :, :] == np.arange(27)[:, None, None]).any(-1).astype(np.float32)


def digits_seen(grids_NL):
    """bool[..., L, 9]: digit d+1 already stands in a peer of the cell (placing it there
    breaks a rule). Takes numpy or jax arrays (their own array namespace), so data checks and
    jitted search share it."""
    xp = grids_NL.__array_namespace__()
    onehot_NLC = (grids_NL[..., None] == xp.arange(1, 10)).astype(xp.float32)  # blank -> all zeros
    # a matmul, not einsum: numpy's einsum does not use BLAS (28x)
    return PEERS.astype(np.float32) @ onehot_NLC > 0


def legal_digits(grids_NL):
    """bool[..., L, 9]: digit d+1 may go in the cell (it is blank and no peer holds d+1)."""
    return (grids_NL == 0)[..., None] & ~digits_seen(grids_NL)


def dead_end(grids_NL):
    """bool[N]: no completion obeys the rules: a digit repeats in a unit, a blank cell has no digit
    left, or a digit missing from a unit has no cell left in it."""
    xp = grids_NL.__array_namespace__()
    g_NL = grids_NL.astype(xp.int32)
    seen_NLC, blank_NL = digits_seen(g_NL), g_NL == 0
    clash_NL = (
        xp.take_along_axis(seen_NLC, xp.maximum(g_NL - 1, 0)[..., None], axis=-1)[..., 0]
        & ~blank_NL
    )
    in_unit = lambda x_NLC: MEMBERS @ xp.astype(x_NLC, xp.float32) > 0
    homeless_NUC = ~in_unit(g_NL[..., None] == xp.arange(1, 10)) & ~in_unit(legal_digits(g_NL))
    return xp.any(clash_NL | (blank_NL & xp.all(seen_NLC, axis=-1)), axis=-1) | xp.any(
        homeless_NUC, axis=(-2, -1)
    )


def solved(grids_NL):
    """bool[N]: complete, and no digit repeats in a row, column or box."""
    return (grids_NL > 0).all(axis=-1) & ~dead_end(grids_NL)


def by_singles(grids_NL):
    """The grids with every naked single (a blank with one legal digit) and hidden single (a digit
    with one legal cell in a unit) filled in, again and again until none is left: what a solver
    finishes without search."""
    g_NL = np.array(grids_NL, np.int32)
    while True:
        legal_NLC = legal_digits(g_NL)
        # a digit with one place left in the unit
        alone_NUC = MEMBERS @ legal_NLC.astype(np.float32) == 1
        pick_NLC = legal_NLC & (
            (legal_NLC.sum(-1, keepdims=True) == 1) | (MEMBERS.T @ alone_NUC.astype(np.float32) > 0)
        )
        if not pick_NLC.any():
            return g_NL
        g_NL = np.where(pick_NLC.any(-1), pick_NLC.argmax(-1) + 1, g_NL)


# ---- Sudoku: solver and generator ----------------------------------------------------------------

_CELL_UNITS = [tuple(int(u) for u in units) for units in UNITS]  # plain ints: the solver's hot loop
_ALL_DIGITS = 0b1111111110  # bit d set = digit d allowed


def _search(grid, limit):
    """Backtracking over bitmasks (one per unit), most-constrained cell first (naked singles only,
    no other deduction). Returns (first solution, count <= limit, guesses: the cells it branched at,
    with two or more digits to try, before it stopped)."""
    g = list(grid)
    used = [0] * 27
    guesses = [0]
    for i, v in enumerate(g):
        if v:
            bit, (r, c, b) = 1 << v, _CELL_UNITS[i]
            if (used[r] | used[c] | used[b]) & bit:
                return None, 0, 0  # the givens already clash
            used[r], used[c], used[b] = used[r] | bit, used[c] | bit, used[b] | bit
    empty = [i for i in range(81) if not g[i]]

    def solutions():  # in search order, found as they are read: reading stops after `limit`
        best = -1
        best_count = 10
        best_mask = 0
        for i in empty:
            if not g[i]:
                r, c, b = _CELL_UNITS[i]
                mask = _ALL_DIGITS & ~(used[r] | used[c] | used[b])
                if (count := mask.bit_count()) < best_count:
                    best = i
                    best_count = count
                    best_mask = mask
                    if count <= 1:
                        break
        if best < 0:
            yield list(g)
            return
        guesses[0] += best_count > 1
        r, c, b = _CELL_UNITS[best]
        while best_mask:
            bit = best_mask & -best_mask
            best_mask ^= bit
            g[best] = bit.bit_length() - 1
            used[r], used[c], used[b] = used[r] | bit, used[c] | bit, used[b] | bit
            yield from solutions()
            used[r], used[c], used[b] = used[r] ^ bit, used[c] ^ bit, used[b] ^ bit
            g[best] = 0

    found = list(itertools.islice(solutions(), limit))
    return (found[0] if found else None), len(found), guesses[0]


def solve(grid):
    """(solution as uint8[81] or None, number of solutions counted up to 2) for an 81-digit grid."""
    solution, count, _guesses = _search([int(v) for v in np.asarray(grid).reshape(81)], limit=2)
    return (None if solution is None else np.asarray(solution, np.uint8)), count


def search_guesses(grid):
    """How hard a puzzle is for a plain search: the cells the backtracking above branches at (two
    or more digits left, naked singles filled) while it finds the solution and proves it unique.
    Generated minimal puzzles: median 30; the top95 list of hard puzzles: median 697."""
    return _search([int(v) for v in np.asarray(grid).reshape(81)], limit=2)[2]


def generate_sudoku(n, blanks, seed, stream="train", start=0, min_guesses=0):
    """(puzzles uint8[n, 81], solutions uint8[n, 81]), each puzzle with exactly one solution.

    Cells are blanked in random order while the solution stays unique, until `blanks` blanks or
    no cell can go (blanks=81 gives minimal puzzles); a list of blanks is taken in turn, puzzle i
    with blanks[i % len(blanks)]. min_guesses: a minimal puzzle is drawn again until the plain
    search needs that many guesses (search_guesses; 256 keeps about 1 in 16). Puzzle i depends
    only on (stream, seed, i), its blanks and min_guesses; `start`: the first i.
    """
    q = np.zeros((n, 81), np.uint8)
    a = np.zeros((n, 81), np.uint8)
    blanks = np.atleast_1d(blanks)
    for i in range(start, start + n):
        hard = min_guesses if blanks[i % len(blanks)] == 81 else 0
        for draw in itertools.count():
            name = f"sudoku/{stream}/{seed}/{i}" + (f"/{draw}" if draw else "")
            puzzle, solution = _dig(random.Random(name), blanks[i % len(blanks)])
            if not hard or _search(puzzle, limit=2)[2] >= hard:
                break
        q[i - start], a[i - start] = puzzle, solution
    return q, a


def _dig(rng, blanks):
    """One random solved grid and a puzzle of it: cells blanked in rng's order while the solution
    stays unique, until `blanks` blanks or no cell can go."""
    # The three diagonal boxes share no row or column,
    # so any filling of them completes to a grid.
    boxes = np.zeros((9, 9), np.int64)
    for b in range(3):
        boxes[3 * b : 3 * b + 3, 3 * b : 3 * b + 3] = np.reshape(
            rng.sample(range(1, 10), 9), (3, 3)
        )
    solution = _search(boxes.ravel().tolist(), limit=1)[0]
    puzzle = list(solution)
    for cell in rng.sample(range(81), 81):
        if puzzle.count(0) == blanks:
            break
        puzzle[cell] = 0
        if _search(puzzle, limit=2)[1] > 1:
            puzzle[cell] = solution[cell]  # that blank would allow a second solution
    return puzzle, solution


def augment(q, a, rng):
    """The same validity-preserving shuffle of puzzle q and solution a (digit grids, 0 = blank).

    Relabels digits, permutes bands and the rows inside each band, stacks and the columns inside
    each stack, and transposes half the time. rng is a numpy Generator.
    """
    digits = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.uint8)  # blank stays blank
    order = lambda: (
        rng.permutation(3)[:, None] * 3 + np.stack([rng.permutation(3) for _ in range(3)])
    ).reshape(9)
    # the rows' order drawn first, then the columns'
    index_99 = order()[:, None] * 9 + order()[None, :]
    index = (index_99.T if rng.random() < 0.5 else index_99).reshape(81)
    return digits[np.asarray(q)[index]], digits[np.asarray(a)[index]]


# ---- Sudoku: CSV files (public sudoku-extreme layout: source,q,a,rating) -------------------------


def read_sudoku_csv(path, key="dataset_path"):
    """(puzzles uint8[N, 81], solutions uint8[N, 81]) from a CSV, with or without a header, '.' or
    '0' for blanks; any bad row is a DataError naming its line."""
    if not epath.Path(path).is_file():
        raise DataError(
            f"{key}={path!r}: file not found (a CSV with header source,q,a,rating; "
            "make one with `python data.py make-sudoku OUT.csv`)"
        )
    # a local file or gs://
    with (
        epath.Path(path).open("rb") as raw,
        io.TextIOWrapper(raw, newline="") as f,
    ):
        reader = csv.reader(f)
        try:
            puzzles, solutions, lines = _csv_grids(path, reader)
        except UnicodeDecodeError:
            raise DataError(
                f"{key}={path!r}: not a text CSV (compressed? decompress it first)"
            ) from None
        except csv.Error as e:  # e.g. a field longer than the csv module's limit: not a puzzle file
            raise DataError(f"{path}:{reader.line_num}: {e}") from None
    if not puzzles:
        raise DataError(f"{key}={path!r}: no puzzles in the file")
    q, a = (
        (np.frombuffer("".join(grids).encode("ascii"), np.uint8) - ord("0")).reshape(-1, 81)
        for grids in (puzzles, solutions)
    )
    clash = ((q != 0) & (q != a)).any(axis=1)
    # bounded memory
    bad = clash | ~np.concatenate([solved(a[i : i + 65536]) for i in range(0, len(a), 65536)])
    if bad.any():
        i = int(bad.argmax())
        raise DataError(
            f"{path}:{lines[i]}: solution a "
            + (
                "disagrees with a given digit of q"
                if clash[i]
                else "is not a valid Sudoku grid (a row, column or box repeats a digit)"
            )
        )
    return q, a


def _csv_grids(path, reader):
    """(puzzle strings, solution strings, their line numbers) of a CSV reader's rows, each row
    checked. A header names its columns with one of the spellings in use; without one, columns are
    read by position as the TRM reference does: the public layout source,question,answer,rating (or
    a bare puzzle,solution pair)."""
    puzzles = []
    solutions = []
    lines = []
    first = next(reader, [])
    names = [c.strip().lower() for c in first]
    named = [
        (names.index(q), names.index(a))
        for q, a in (("q", "a"), ("question", "answer"), ("puzzle", "solution"))
        if q in names and a in names
    ]
    if first and not named and not any(len(c.strip()) == 81 for c in first):
        raise DataError(
            f"{path}:1: the header names no puzzle and solution columns (use q,a or "
            "question,answer; public layout: source,question,answer,rating)"
        )
    # the first row is data without a header
    iq, ia = named[0] if named else (1, 2) if len(first) >= 3 else (0, 1)
    # a blank line is no row
    for row in filter(None, itertools.chain([] if named else [first], reader)):
        where = f"{path}:{reader.line_num}"
        if len(row) <= max(iq, ia):
            raise DataError(f"{where}: {len(row)} columns, expected at least {max(iq, ia) + 1}")
        q, a = row[iq].strip(), row[ia].strip()
        for name, text, allowed in (("q", q, ".0123456789"), ("a", a, "123456789")):
            if len(text) != 81:
                raise DataError(f"{where}: {name} has {len(text)} characters, expected 81")
            if illegal := set(text) - set(allowed):
                raise DataError(
                    f"{where}: {name} has illegal character {min(illegal)!r} (allowed: {allowed})"
                )
        puzzles.append(q.replace(".", "0"))
        solutions.append(a)
        lines.append(reader.line_num)
    return puzzles, solutions, lines


def parse_grid(text):
    """A puzzle typed on the command line (81 characters row by row, spaces and newlines ignored,
    '.' or '0' for blanks) -> int32[81] digits, or None if it is not one."""
    text = text.replace("\n", "").replace(" ", "")
    if len(text) != SUDOKU_LEN or any(c not in ".0123456789" for c in text):
        return None
    return np.array([0 if c == "." else int(c) for c in text], np.int32)


def write_sudoku_csv(path, q, a):
    """Writes puzzles and solutions (digit grids) in the public layout; blanks become '.'."""
    rows = (
        [
            "generated",
            "".join(map(str, puzzle)).replace("0", "."),
            "".join(map(str, solution)),
            0,
        ]  # 0: unrated
        for puzzle, solution in zip(np.asarray(q), np.asarray(a))
    )
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(itertools.chain([["source", "q", "a", "rating"]], rows))


def _puzzles(cfg, split, log=None):
    """(puzzles, solutions) of the train or eval split: its
    CSV file if set, else generated once into cache_dir."""
    key, n = (
        ("dataset_path", cfg.sudoku_train_puzzles)
        if split == "train"
        else ("eval_path", cfg.sudoku_eval_puzzles)
    )
    if getattr(cfg, key):
        return read_sudoku_csv(getattr(cfg, key), key)
    mix = "-".join(map(str, cfg.sudoku_blanks))  # 45, or 45-81 for a mix
    hard = cfg.sudoku_min_guesses
    path = os.path.join(
        cfg.cache_dir,
        "sudoku",
        f"{split}_seed{cfg.seed}_blanks{mix}{f'_guesses{hard}' if hard else ''}_n{n}"
        f"_v{_SUDOKU_GEN_VERSION}.npz",
    )
    with _locked(cfg.cache_dir):
        if not os.path.exists(path):
            with _announced(log, f"generating {n} {split} puzzles with {mix} blanks"):
                q, a = generate_sudoku(n, cfg.sudoku_blanks, cfg.seed, split, 0, hard)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _save(path, lambda f: np.savez(f, q=q, a=a))
    with np.load(path) as f:
        return f["q"], f["a"]


def _sudoku_batch(q, a, rows):
    """Token batch from digit grids (blank 0 -> 1, digit d ->
    d + 1); rows past len(q) are padding (loss_mask 0)."""
    return _stack(
        [_full_row(np.asarray(x, np.int32) + 1, np.asarray(y, np.int32) + 1) for x, y in zip(q, a)],
        rows,
        SUDOKU_LEN,
    )


class SudokuData(_Data):
    """Puzzle -> solution pairs, from CSV files or the built-in generator."""

    eval_all = True
    fixed: ClassVar[dict] = {"vocab_size": SUDOKU_VOCAB, "max_target_length": SUDOKU_LEN}

    def __init__(self, cfg, process_index, process_count, log=None):
        super().__init__(cfg, process_index, process_count, log)
        self.vocab_size, self.length = SUDOKU_VOCAB, SUDOKU_LEN
        self.train_q, self.train_a = _puzzles(cfg, "train", log)
        self.eval_q, self.eval_a = _puzzles(cfg, "eval", log)
        # a separate seed stream makes overlap unlikely; this makes it impossible
        if not cfg.eval_path:
            seen = {s.tobytes() for s in self.train_a}
            keep = np.array([s.tobytes() not in seen for s in self.eval_a], bool)
            self.eval_q, self.eval_a = self.eval_q[keep], self.eval_a[keep]
        blanks = ",".join(map(str, cfg.sudoku_blanks))
        self.identity = (
            f"sudoku {cfg.dataset_path}"
            if cfg.dataset_path
            else (
                f"sudoku generated: {cfg.sudoku_train_puzzles} puzzles, {blanks} blanks, "
                + (f">= {hard} guesses, " if (hard := cfg.sudoku_min_guesses) else "")
                + f"seed {cfg.seed}"
            )
        )
        self._order = (
            grain.MapDataset.range(len(self.train_q))
            .shuffle(seed=cfg.seed)
            .repeat()
            .map_with_index(self._example)
        )

    def _example(self, position, rid):
        q, a = self.train_q[rid], self.train_a[rid]
        # seeded by position (epoch, record), so a resumed run draws the same shuffles
        if self.cfg.augment:
            q, a = augment(
                q, a, np.random.default_rng([self.cfg.seed, position // len(self.train_q), rid])
            )
        return _full_row(q.astype(np.int32) + 1, a.astype(np.int32) + 1)

    def eval_batches(self, local_rows, n=None):
        """n batches (None: enough for the whole eval set), fixed order, unaugmented. Batch i
        of the whole system holds puzzles i * rows onward in file order, process p its p-th
        share of them, so the gathered answers come back in file order; rows past the end are
        padding (loss_mask 0)."""
        rows = local_rows * self.process_count
        n = min(-(-len(self.eval_q) // rows), n or math.inf)  # one pass at most
        starts = [i * rows + self.process_index * local_rows for i in range(n)]
        return [
            _sudoku_batch(
                self.eval_q[s : s + local_rows], self.eval_a[s : s + local_rows], local_rows
            )
            for s in starts
        ]


# ---- entry points --------------------------------------------------------------------------------


def make_dataset(cfg, process_index=0, process_count=1, log=None, source=None):
    """The dataset this process reads: its share of the records, in a seed-determined order. `log`
    (a print function, or None for silence) hears about the slow one-time preparations. `source`: a
    task's own data (model.Task.dataset), in place of the text pipelines; every kind is made as
    source(cfg, process_index, process_count, log)."""
    try:
        os.makedirs(cfg.cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cache_dir={cfg.cache_dir}: cannot create it "
            f"({e.strerror}); choose a writable cache_dir"
        ) from None
    kinds = {
        "synthetic": SyntheticData,
        "hf": StreamData if cfg.hf_streaming else TextData,
    }  # else files, stdlib, tfds
    kind = SFTData if not source and sft_rows(cfg) else source or kinds.get(cfg.dataset, TextData)
    if cfg.epochs and not hasattr(kind, "epoch_steps"):
        raise DataError(
            f"epochs={cfg.epochs} counts passes over SFT examples (dataset=hf rows with messages, "
            "or prompt and completion) or preference pairs; other data runs for steps="
        )
    return kind(cfg, process_index, process_count, log)


def def_questions(count, seed):
    """Questions with exact answers about the standard library's one-line `def`s with plain
    parameters: (question, answer, the other answer the same line gives), the function's name or
    its last parameter asked, shuffled by `seed`: make-chat's and make-pairs' rows."""
    plain = re.compile(r"^[ \t]*def (\w+)\(([\w ,*]*\w[\w ,*]*)\):", re.MULTILINE)
    lines = sorted(
        {
            m.group(0).strip()
            for f in _stdlib_files()
            for m in plain.finditer(pathlib.Path(f).read_text(errors="replace"))
        }
    )
    questions = []
    for line in lines:
        name, params = plain.match(line).groups()
        last = [p.strip(" *") for p in params.split(",") if p.strip(" *")][-1]
        questions += [
            (f"What is the name of the function defined by `{line}`?", name, last),
            (f"What is the last parameter of `{line}`?", last, name),
        ]
    random.Random(seed).shuffle(questions)
    if len(questions) < count:
        raise DataError(
            f"--count {count}: the standard library gives {len(questions)} questions; ask for fewer"
        )
    return questions[:count], len(questions), len(lines)


def make_chat(out, count, seed):
    """SFT rows (prompt, completion) with exact answers (def_questions). The task the README
    fine-tunes the default run's model on (it read these files as code; it has never answered a
    question)."""
    questions, asked, lines = def_questions(count, seed)
    with open(out, "w") as f:
        f.writelines(
            json.dumps({"prompt": f"Question: {q}\nAnswer: ", "completion": a}) + "\n"
            for q, a, _ in questions
        )
    print(
        f"wrote {count} prompt/completion rows (of {asked} questions about {lines} def lines) to "
        f"{out}"
    )


def make_pairs(out, count, seed):
    """Preference rows (prompt, chosen, rejected) of make-chat's questions (the same seed: the same
    questions in the same order): chosen the answer, rejected the line's other answer (its last
    parameter where its name is asked, and the other way), a mistake near the right one."""
    questions, asked, lines = def_questions(count, seed)
    with open(out, "w") as f:
        f.writelines(
            json.dumps({"prompt": f"Question: {q}\nAnswer: ", "chosen": a, "rejected": other})
            + "\n"
            for q, a, other in questions
        )
    print(f"wrote {count} preference rows (of {asked} questions about {lines} def lines) to {out}")


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="data.py", description="Data utilities.")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser(
        "make-chat", help="write SFT rows (prompt, completion) about the stdlib's functions"
    )
    chat.add_argument("out")
    chat.add_argument("--count", type=int, default=4000)
    chat.add_argument("--seed", type=int, default=0)
    pairs = commands.add_parser(
        "make-pairs",
        help="write preference rows (prompt, chosen, rejected) of make-chat's questions",
    )
    pairs.add_argument("out")
    pairs.add_argument("--count", type=int, default=4000)
    pairs.add_argument("--seed", type=int, default=0)
    make = commands.add_parser(
        "make-sudoku", help="write generated puzzles as a CSV in the public layout"
    )
    make.add_argument("out")
    make.add_argument("--count", type=int, default=1000)
    make.add_argument("--blanks", type=int, default=45, help="81 = minimal puzzles (hardest)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument(
        "--needs-search",
        action="store_true",
        help="only puzzles naked and hidden singles cannot finish",
    )
    make.add_argument(
        "--min-guesses",
        type=int,
        default=0,
        help="with --blanks 81: only puzzles a plain search needs this many guesses for "
        "(256: hard, as public hard lists are)",
    )
    args = parser.parse_args(argv)
    if args.command == "make-chat":
        return make_chat(args.out, args.count, args.seed)
    if args.command == "make-pairs":
        return make_pairs(args.out, args.count, args.seed)
    start = time.perf_counter()
    tried = 0
    q = np.zeros((0, 81), np.uint8)
    a = np.zeros((0, 81), np.uint8)
    while len(q) < args.count:  # the stream's puzzles in order, each kept or not by itself
        # Own stream: a file made with seed S never repeats
        # the generated train set of a run with seed S.
        more_q, more_a = generate_sudoku(
            args.count - len(q), args.blanks, args.seed, "file", tried, args.min_guesses
        )
        keep, tried = (
            ~solved(by_singles(more_q)) if args.needs_search else slice(None),
            tried + len(more_q),
        )
        q, a = np.concatenate([q, more_q[keep]]), np.concatenate([a, more_a[keep]])
    write_sudoku_csv(args.out, q, a)
    guesses = np.median([search_guesses(puzzle) for puzzle in q])
    print(
        f"wrote {args.count} puzzles ({(q == 0).sum(1).mean():.1f} blanks on average, a plain "
        f"search's median guesses {guesses:.0f}) to {args.out} in "
        f"{time.perf_counter() - start:.1f}s"
    )


# ==================================================================================================
# Storage: every path, input or output, goes through etils' epath (what orbax uses), so each may be
# local or gs://bucket/... (gcsfs underneath, no TensorFlow). GCS has no append and no file locks:
# append() composes objects, and a run owns a gs:// directory through a lease object (BucketLease).
# The pipelines above read their files through `stored`; train.py keeps its run directory here.
# ==================================================================================================

# ---- paths: local or gs:// -----------------------------------------------------------------------

# What a disk can raise; a bucket adds gcsfs's HTTP and credential errors (use_gcs).
STORAGE_ERRORS = (OSError,)
# Whether this process writes the run's files (train.py: process 0 of a multi-host run only).
MAIN = True
# Run directory -> whether it is still the one this run opened (train.py fills it).
HELD = {}
# Names tensorstore (orbax's array writer) reads as a URL on gs://: it cuts a query (?) or fragment
# (#) and decodes %XX, so arrays would land beside the run directory, not in it.
URL_MANGLED = re.compile(r"[?#%]")


class WriteError(Exception):
    """The run directory refused a write (read-only, full, gone): the run stops with one line; what
    was written before stays."""


def remote(path):
    return "://" in str(path)


def stored(path):
    """epath.Path of a local path (absolute: orbax writes
    it into its metadata) or a gs:// one (as given)."""
    if remote(path):
        use_gcs()
    return epath.Path(path if remote(path) else os.path.abspath(os.path.expanduser(path)))


def use_gcs():
    """gcsfs, loaded by the first gs:// path (its import costs a local run half a second); from then
    on its HTTP and credential errors count as storage errors."""
    global STORAGE_ERRORS
    from gcsfs.retry import HttpError
    from google.auth.exceptions import GoogleAuthError

    STORAGE_ERRORS = (OSError, HttpError, GoogleAuthError)


def gcs():
    """The gcsfs file system epath itself uses (fsspec
    keeps one instance, so both see one listings cache)."""
    import fsspec

    use_gcs()
    return fsspec.filesystem("gs")


def storage_reason(e):
    """An error from a disk or a bucket as a short reason,
    with any URL's query string (tokens, signatures) cut."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
    text = re.sub(r"(https?://[^\s?]+)\?\S*", r"\1", text)
    return re.sub(r"(?i)(token|signature|key)=[^\s&]+", r"\1=...", text)


# ---- files: read, written, appended to, set aside ------------------------------------------------


def read_json(path, what=None):
    """A JSON file (local or gs://) as an object; a DataError naming the file if it is damaged."""
    try:
        value = json.loads(stored(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(
            f"{path}: not valid JSON ({first_line(e, typed=False, limit=100)})"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"{path}: holds a JSON {type(value).__name__}, not the object {what or 'expected'}"
        )
    return value


def check_held(path):
    """A run holds the directory it opened, not its path: one moved away, or replaced by another
    (a disk's by its inode, a bucket's by the run's lease on it), stops the run before it writes
    into what is there now."""
    path = path if remote(path) else os.path.abspath(path)  # orbax names its directory absolutely
    for run_dir, still_ours in HELD.items():
        if (path == run_dir or path.startswith(run_dir.rstrip("/") + "/")) and not still_ours():
            raise WriteError(
                f"{run_dir} was moved or replaced under this run: stopped without writing into "
                "what is there now (what the run wrote went with its directory)"
            )


def write(path, content):
    """Writes `content` (text or bytes) as the whole of `path` (on the MAIN process); a refusal
    stops the run in one line."""
    check_held(path)
    if MAIN:
        try:
            stored(path).write_bytes(content if isinstance(content, bytes) else content.encode())
        except STORAGE_ERRORS as e:
            raise WriteError(f"{path}: cannot write it ({storage_reason(e)})") from None


def append(path, text):
    """Adds text to the end of `path`. A bucket has no append, and rewriting the object each time
    would upload O(N^2) bytes over a run: the new text goes up as its own object, then GCS
    composes the two server-side."""
    check_held(path)
    try:
        if not remote(path):
            with open(path, "a") as f:
                f.write(text)
            return
        part = f"{path}.part"
        gcs().pipe_file(part, text.encode())
        gcs().merge(path, [path, part])
        gcs().rm_file(part)
    except STORAGE_ERRORS as e:
        raise WriteError(
            f"{path}: cannot write ({storage_reason(e)}); the checkpoints written are intact"
        ) from None


def set_aside(path, tag):
    """Renames path to path.TAG-TIME (never deletes it); returns the new name."""
    new = f"{path}.{tag}-{time.strftime('%Y%m%d-%H%M%S')}"
    stored(path).rename(stored(new))
    return new


def check_credentials(paths):
    """gs:// paths ({key: path}) need Google credentials: asked for once, up front, instead of a 401
    from a background write (gcsfs would fall back to anonymous access silently). An emulator
    (STORAGE_EMULATOR_HOST) needs none."""
    used = [key for key, path in paths.items() if remote(path)]
    if not used or os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    import google.auth

    use_gcs()
    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise WriteError(
            f"{used[0]}={paths[used[0]]}: no Google credentials found ({storage_reason(e)}); on a "
            "Cloud TPU VM the VM's service account is used, elsewhere run `gcloud auth "
            "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
        ) from None


# ---- the run directory's lock: one run at a time, on a disk or in a bucket -----------------------


def holder_line():
    return (
        f"process {os.getpid()} on {socket.gethostname()} "
        f"since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )


class BucketLease:
    """One owner per gs:// run directory. GCS has no file locks, but it creates an object only if
    absent (ifGenerationMatch=0): RUN_DIR/.lock is made that way and names its holder and a lease
    expiry, which the live run renews every LEASE_SECONDS / 3 (rewriting it conditional on the
    generation it last wrote). A killed run stops renewing: once its lease has run out, or at once
    on the same host when its process is gone, the next run takes the lock over, again conditional
    on the generation it read, so two newcomers cannot both win."""

    LEASE_SECONDS = 60

    def __init__(self, path, log=print):
        self.path = path
        self.host = socket.gethostname()
        self.lost = None
        self.log = log
        self.holder, self.stop = holder_line(), threading.Event()

    def acquire(self):
        """'' once held, else who holds it. A lease object
        that is not the JSON a run writes is taken over."""
        try:
            self.generation = self.put(0)
        except FileExistsError:
            generation = gcs().info(self.path)["generation"]
            try:
                old = json.loads(gcs().cat_file(self.path))
                live = old["until"] > time.time() and not (
                    old["host"] == self.host and not pid_alive(old["pid"])
                )
            except (ValueError, TypeError, KeyError):
                old, live = {"holder": "an unreadable lease object"}, False
            if live:
                return old["holder"]
            # a stale lease: FileExistsError if another run just took it
            self.generation = self.put(generation)
            self.log(
                f"took over the lock of {old['holder']} (its lease "
                "ran out, its process is gone, or it was unreadable)"
            )
        threading.Thread(target=self.renew, daemon=True).start()
        return ""

    def put(self, if_generation):
        """Writes the lease object only if its generation is
        still `if_generation` (0: absent); the new one."""
        body = json.dumps(
            {
                "holder": self.holder,
                "pid": os.getpid(),
                "host": self.host,
                "until": time.time() + self.LEASE_SECONDS,
            }
        ).encode()
        bucket, key = self.path.removeprefix("gs://").split("/", 1)
        multipart = (
            b"--==0==\nContent-Type: application/json\n\n"
            + json.dumps({"name": key}).encode()
            + b"\n--==0==\nContent-Type: application/json\n\n"
            + body
            + b"\n--==0==--"
        )
        out = gcs().call(
            "POST",
            f"{gcs()._location}/upload/storage/v1/b/{bucket}/o",
            uploadType="multipart",
            ifGenerationMatch=str(if_generation),
            data=multipart,
            json_out=True,
            headers={"Content-Type": 'multipart/related; boundary="==0=="'},
        )
        return out["generation"]

    def renew(self):
        while not self.stop.wait(self.LEASE_SECONDS / 3):
            try:
                self.generation = self.put(self.generation)
            except Exception as e:  # noqa: BLE001 - taken over (FileExistsError) or unreachable
                self.lost = storage_reason(e)
                self.log(
                    f"WARNING: {self.path}: could not renew this "
                    f"run's lease on its directory ({self.lost})"
                )
                return

    def close(self):
        """Ends the lease: deleted, waiting a few seconds at most (a bucket gone away would keep
        gcsfs retrying for half a minute; the lease then just runs out)."""
        self.stop.set()
        if not self.lost:
            done = threading.Thread(target=self.release, daemon=True)
            done.start()
            done.join(5)

    def release(self):
        # a bucket gone away: the lease runs out by itself
        with contextlib.suppress(*STORAGE_ERRORS):
            gcs().rm_file(self.path)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def own(run_dir, log=print):
    """The MAIN process takes the run directory's lock for the whole run: on a disk
    RUN_DIR/.lock, locked with flock (the kernel drops it when the process ends, however it
    ends), its holder written inside; in a bucket a BucketLease. Returns (the lock or None, '' or
    who holds it already)."""
    if not MAIN:
        return None, ""
    if remote(run_dir):
        lock = BucketLease(os.path.join(run_dir, ".lock"), log)
        return lock, lock.acquire()
    lock = open(os.path.join(run_dir, ".lock"), "a+")  # noqa: SIM115 - held for the whole run
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        return None, holder
    lock.truncate(0)
    lock.write(holder_line() + "\n")
    lock.flush()
    return lock, ""


def held(run_dir, lock):
    """How check_held tells the run directory is still this
    run's: its lease (a bucket), or its inode (a disk)."""
    if remote(run_dir):
        return lambda: not (lock and lock.lost)

    def inode():
        with contextlib.suppress(OSError):
            return os.stat(run_dir).st_dev, os.stat(run_dir).st_ino

    first = inode()
    return lambda: inode() == first


# ---- the paths a config names, checked before anything runs --------------------------------------

PATH_KEYS = (
    "output_dir",
    "load_params",
    "load_hf",
    "export_dir",
    "dataset_path",
    "eval_path",
    "tokenizer_path",
    "hf_data_files",
    "hf_eval_files",
    "compile_cache_dir",
)


def paths_of(cfg):
    """{key: path} of every path key: what needs credentials,
    and what tensorstore must be able to name."""
    return {key: getattr(cfg, key) for key in PATH_KEYS}


def check_paths(cfg):
    """Every path the user typed must exist, whatever else the run does (a resumable run
    directory would otherwise hide a mistyped load_params). Data paths may be globs; any
    of them may be on gs://."""
    for key, path in {
        **paths_of(cfg),
        "run_name": cfg.run_name,
    }.items():  # names orbax cannot write as given
        if "\\" in path and key in ("run_name", "output_dir"):  # into a JSON spec, unescaped
            raise DataError(
                f"{key}={path}: the checkpoint library cannot write "
                "under a path with a backslash; choose a name without one"
            )
        if remote(cfg.output_dir if key == "run_name" else path) and URL_MANGLED.search(path):
            raise DataError(
                f"{key}={path}: tensorstore reads a gs:// path as a URL (it cuts ? and # and "
                "decodes %XX), so arrays would land outside it; choose a name without ?, # or %"
            )
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise DataError(
            f"wandb_project={cfg.wandb_project}: wandb is not installed: "
            "pip install wandb==0.31.0 (or set wandb_project=)"
        )
    check_credentials(paths_of(cfg))
    # array_record's own file layer (no TensorFlow) and flock: local only
    for key in (
        "data_dir",
        "cache_dir",
    ):
        if remote(getattr(cfg, key)):
            raise DataError(
                f"{key}={getattr(cfg, key)}: prepared datasets are read through a local file "
                "layer; give a local directory (copy the data down with `gcloud storage cp -r`, or "
                "mount the bucket with gcsfuse)"
            )
    is_dir, _is_file = lambda p: stored(p).is_dir(), lambda p: stored(p).is_file()
    matches = lambda pattern: bool(expand(pattern))
    listed = lambda files: all(matches(f.strip()) for f in files.split(",") if f.strip())
    # a hub id is fetched first (or is one line saying why not)
    hf_folder = lambda p: is_dir(hf_dir(p))
    wanted = {
        "load_params": is_dir,
        "load_hf": hf_folder,
        "tokenizer_path": lambda p: stored(p).exists(),
        "data_dir": is_dir,
        "dataset_path": matches,
        "eval_path": matches,
        "hf_data_files": listed,
        "hf_eval_files": listed,
    }
    for key, exists in wanted.items():
        value = getattr(cfg, key)
        if value and not exists(value):
            what = (
                "no such directory"
                if exists in (is_dir, hf_folder)
                else "matches no files"
                if any(c in value for c in "*?[,")
                else "no such file"
            )
            raise DataError(f"{key}={value}: {what}; fix the path (or set {key}= to leave it out)")
    if cfg.load_params and not checkpoint_steps(cfg.load_params)[1]:
        raise DataError(
            f"load_params={cfg.load_params}: no checkpoint there; give a run directory, its "
            "checkpoints/ directory or one checkpoints/STEP directory"
        )


def checkpoint_steps(path):
    """load_params=PATH (a run directory, its checkpoints/ directory, or one step directory in it)
    -> (the checkpoints directory, the steps found there)."""
    path = path.rstrip("/")
    if stored(os.path.join(path, "checkpoints")).is_dir():
        path = os.path.join(path, "checkpoints")
    if os.path.basename(path).isdigit() and stored(path).is_dir():
        return os.path.dirname(path), [int(os.path.basename(path))]
    found = stored(path).iterdir() if stored(path).is_dir() else []
    return path, sorted(int(d.name) for d in found if d.name.isdigit())


# ---- the run directory: made, cleared for a new run, its metrics resumed -------------------------


def unwritable(cfg, run_dir, e):
    """output_dir refusing a write: the user's to fix on a local
    disk (DataError), a fault in a bucket (WriteError)."""
    kind = WriteError if remote(run_dir) else DataError
    return kind(
        f"output_dir={cfg.output_dir}: cannot write in {run_dir} "
        f"({storage_reason(e)}); choose a writable output_dir"
    )


def make_run_dir(cfg, run_dir, log):
    """output_dir/run_name made (local or gs://); one that refuses is `unwritable`."""
    bucket = "/".join(run_dir.split("/")[:3])  # gs://NAME
    try:
        # gcsfs would create the bucket a typo names
        if remote(run_dir) and not stored(bucket).exists():
            raise WriteError(
                f"output_dir={cfg.output_dir}: bucket {bucket} does not exist or these "
                "credentials cannot see it; create it (gcloud storage buckets create "
                f"{bucket}) or fix output_dir"
            )
        stored(run_dir).mkdir(parents=True, exist_ok=True)
    except STORAGE_ERRORS as e:
        raise unwritable(cfg, run_dir, e) from None


def prepare_training(cfg, run_dir, log, barrier=lambda: None):
    """mode=train: resume=false moves an earlier run's checkpoints and metrics aside (renamed, never
    deleted) so the new run starts clean, as keep_damaged_config does a damaged config.yml; then
    (`barrier`: once every host is past that) checkpoints/ is made and written once, now rather
    than at the first save."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    try:
        for name in ("checkpoints", "metrics.jsonl") if not cfg.resume and MAIN else ():
            if stored(os.path.join(run_dir, name)).exists():
                moved = set_aside(os.path.join(run_dir, name), "replaced")
                log(f"resume=false: moved the earlier {name} aside to {os.path.basename(moved)}")
        if MAIN:
            keep_damaged_config(run_dir, log)
        # before the barrier, so before any host makes checkpoints/ (in a bucket a host could see
        # the one another is making as a file); resume=false has moved it aside, whatever it was
        if cfg.resume and stored(checkpoints).is_file():
            raise DataError(
                f"{checkpoints} is a file, where the run keeps its checkpoints: move it away"
            )
        barrier()
        stored(checkpoints).mkdir(parents=True, exist_ok=True)
        probe = stored(checkpoints) / f".writable-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except STORAGE_ERRORS as e:
        raise unwritable(cfg, run_dir, e) from None


def resume_metrics(run_dir, step, log=print):
    """A run starting at `step`: its metrics.jsonl keeps the rows up to it (none from a fresh
    start), and a bucket's run drops the TensorBoard event files written past it (a local run's are
    read up to the newest row). Returns the newest step a run before had logged: the steps from
    `step` to it are done again (goodput's badput 'redone')."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = metrics_rows(path, log) if step else []
    write(path, "".join(line for at, line in rows if at <= step))
    for f in stored(run_dir).glob("events.out.tfevents.steps-*") if remote(run_dir) else ():
        if int(f.name.split("-")[1]) > step:
            f.unlink()
    return max((at for at, _ in rows), default=0)


def metrics_rows(path, log=print):
    """[(step, line)] of a metrics.jsonl. A last line that is no row is a write cut short (a kill,
    a crash): dropped with a warning. A line no row before it is damage: the file is kept aside
    (renamed, never deleted) and the run goes on with the rows it could read. The checkpoint, not
    this log, is what a resume needs, so a damaged log stops nothing: a stop would fail every
    restart a scheduler makes, and moving the file away by hand would lose its rows for good."""
    try:
        lines = stored(path).read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    rows = [metrics_row(line) for line in lines]
    shown = lambda line: repr(line[:60].decode(errors="replace"))
    if rows and rows[-1] is None:
        log(f"WARNING: {path}: dropped its last line, written only in part: {shown(lines[-1])}")
        rows.pop()
    if None in rows:
        bad = rows.index(None)
        moved = set_aside(path, "damaged")
        rows = [r for r in rows if r]
        log(
            f"WARNING: {path}: line {bad + 1} is not a metrics row ({shown(lines[bad])}); kept "
            f"the file aside as {os.path.basename(moved)} and went on with its {len(rows)} "
            "readable rows"
        )
    return rows


def metrics_row(line):
    """(step, the line as text) of one line of metrics.jsonl, or None: not whole (no newline), not
    UTF-8, not JSON, or not an object with an integer step."""
    try:
        text = line.decode()
        row = json.loads(text) if text.endswith("\n") else None
    except (ValueError, RecursionError):  # json's errors and bytes not UTF-8 are ValueErrors
        row = None
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return (step, text)


def move_up(local_dir, pattern, run_dir, name=None):
    """Local files (local_dir/pattern, ** recursive) moved into run_dir at their relative path,
    or all as `name`: how what the profiler and TensorBoard can write only locally reaches a
    bucket's run directory."""
    for f in glob.glob(os.path.join(local_dir, pattern), recursive=True):
        if os.path.isfile(f):
            with open(f, "rb") as local:
                write(os.path.join(run_dir, name or os.path.relpath(f, local_dir)), local.read())
            os.remove(f)


# ---- metrics: metrics.jsonl, TensorBoard and W&B -------------------------------------------------


def open_wandb(cfg, run_dir):
    """The run's W&B run, the same one across resumes (its id is kept in RUN_DIR/wandb_id),
    with the resolved config. WANDB_MODE=offline writes it under RUN_DIR/wandb for `wandb
    sync` later (a bucket's run: under the system's temporary directory, since wandb writes
    only to a local disk)."""
    import wandb

    path = os.path.join(run_dir, "wandb_id")
    try:
        run_id = stored(path).read_text().strip() if stored(path).exists() else os.urandom(6).hex()
    except UnicodeDecodeError:
        run_id = ""
    if not re.fullmatch(r"[a-z0-9]{1,64}", run_id):
        raise DataError(
            f"{path}: not a W&B run id (a run writes 12 hex digits there); restore it to keep "
            "logging to the same W&B run, or delete it to start a new one"
        )
    write(path, run_id + "\n")
    local = (
        os.path.join(tempfile.gettempdir(), "wandb", cfg.run_name) if remote(run_dir) else run_dir
    )
    os.makedirs(local, exist_ok=True)
    # wandb's core keeps its logs in its cache directory (~/.cache/wandb) and, where it cannot make
    # that (a home that is not writable), prints them on stderr instead, line after line: then the
    # cache goes beside the run.
    cache = os.environ.get("WANDB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "wandb"
    )
    with contextlib.suppress(OSError):
        os.makedirs(cache, exist_ok=True)
    if not os.access(cache, os.W_OK):
        os.environ["WANDB_CACHE_DIR"] = os.path.join(local, "wandb-cache")
    try:
        return wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            id=run_id,
            resume="allow",
            name=cfg.run_name,
            dir=local,
            config=cfg.model_dump(mode="json"),
            settings=wandb.Settings(silent=True, console="off"),
        )
    except Exception as e:  # noqa: BLE001 - not logged in, no network, a project it cannot write
        raise DataError(
            f"wandb_project={cfg.wandb_project}: W&B refused the run ({first_line(e)}): log "
            "in with `wandb login` (or set WANDB_API_KEY), log offline with "
            "WANDB_MODE=offline, or set wandb_project="
        ) from None


def quiet_libraries():
    """Library noise off stderr, for what the trainer reports in one line: orbax and tfds narrate
    through absl warnings (a local build as a download, our per-glob builder config); reading a
    damaged checkpoint, the tensorstore reads orbax left in flight fail later, each logged by
    asyncio and raised once more from its abandoned coroutine or into a closed event loop; a refused
    write leaves orbax's write coroutines unawaited, which Python reports at exit."""
    # orbax logs a failed save it raises to us as well
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    # retries and fallbacks: what matters, we say once
    for name in (
        "gcsfs",
        "fsspec",
        "google.auth",
        "wandb",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    hook = sys.unraisablehook
    orbax_read = lambda u: "orbax" in getattr(getattr(u.object, "cr_code", None), "co_filename", "")
    # a full disk: TensorBoard's writer thread and its exit cleanup fail again after our one line
    board = lambda obj: "tensorboardX" in getattr(obj, "__module__", "")
    full = lambda u: isinstance(u.exc_value, OSError) and board(u.object)
    sys.unraisablehook = lambda u: (
        None if str(u.exc_value) == "Event loop is closed" or orbax_read(u) or full(u) else hook(u)
    )
    thread_hook = threading.excepthook
    threading.excepthook = lambda a: (
        None if issubclass(a.exc_type, OSError) and board(a.thread) else thread_hook(a)
    )


def host_rss_gb():
    """This process's peak resident memory, GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def open_files():
    """File descriptors this process holds (Linux; -1 elsewhere): flat over a long run."""
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1


def device_peak_memory_gb(device):
    """A device's peak memory in use, GiB (None where the backend does not say)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None


def short_line(m, steps, shown):
    """The metrics row as the line a person reads: progress, loss, speed, time left, and the eval
    when there is one. The whole row (grad norm, learning rate, memory, data wait, ...) is in
    metrics.jsonl and TensorBoard; `shown`: the task's (metric, format) pairs."""
    parts = [f"step {m['step']}/{steps}", f"loss {m['loss']:.4f}"]
    if "tokens_per_sec" in m:
        eta = int(m["step_seconds"] * (steps - m["step"]))
        parts += [
            f"{m['tokens_per_sec']:,.0f} tokens/s",
            f"MFU {m['mfu']:.1%}",
            f"ETA {eta // 3600}h{eta // 60 % 60:02d}m"
            if eta >= 3600
            else f"ETA {eta // 60}m{eta % 60:02d}s",
        ]
    return "  ".join(parts + [fmt.format(m[k], m=m) for k, fmt in shown if k in m])


def summary_writer(log_dir):
    """tensorboardX's writer on a local directory, tensorboardX imported on first use. It imports
    boto3 and google.cloud.storage where they are installed, to write s3:// and gs:// itself (0.17 s
    to 0.25 s of every start, 2026-12-05); it is handed local directories only (a bucket's event
    file goes up through the storage layer), so it goes without the two (kept_out)."""
    with kept_out("boto3", "google.cloud.storage"):
        from tensorboardX import SummaryWriter
    return SummaryWriter(log_dir)


class MetricsWriter:
    """The run's metrics rows, on the MAIN process, to metrics.jsonl, TensorBoard (tensorboardX, no
    TensorFlow) and W&B. Rows reach the run directory at flush(): after every row on a disk, before
    each checkpoint on a bucket (an event file per flush there). A resume drops rows past its
    checkpoint; W&B cannot: it gets rows once saved."""

    def __init__(self, cfg, run_dir, start_step, log=print):
        self.main = MAIN
        self.remote = remote(run_dir)
        self.run_dir = run_dir
        self.rows = []
        self.unsent = []
        self.wandb = None
        self.redone_to = 0  # the newest step a run before this one logged
        if self.main:
            self.wandb = open_wandb(cfg, run_dir) if cfg.wandb_project else None
            self.redone_to = resume_metrics(run_dir, start_step, log)
            self.tb_dir = tempfile.mkdtemp(prefix="tensorboard-") if self.remote else run_dir
            self.tb = summary_writer(self.tb_dir)

    def write(self, m):
        if not self.main:
            return
        # a NaN (a metric not measured) would make TensorBoard warn on stderr
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, m["step"])
        self.rows.append(m)
        self.unsent += [m] if self.wandb else []
        if not self.remote:
            self.flush()

    def flush(self, saved=False):
        """The rows since the last flush into the run directory (a bucket's event file goes
        up closed, whole); with `saved` (a checkpoint holds every row so far) the rows not
        yet sent go to W&B too."""
        for m in self.unsent if saved else ():
            self.wandb.log({k: v for k, v in m.items() if k != "step"}, step=m["step"])
        self.unsent = [] if saved else self.unsent
        # taken first: rows a failed write could not land are not tried again
        rows = self.rows
        self.rows = []
        if not rows:  # only process 0 has any
            return
        append(
            os.path.join(self.run_dir, "metrics.jsonl"), "".join(json.dumps(m) + "\n" for m in rows)
        )
        try:
            self.tb.flush()
        except OSError as e:  # TensorBoard's event file, on a disk that filled up
            raise WriteError(
                f"{self.event_file()}: TensorBoard's event file cannot be written "
                f"({storage_reason(e)}); the checkpoints written are intact"
            ) from None
        if self.remote:
            self.tb.close()
            move_up(
                self.tb_dir,
                "events.out.tfevents.*",
                self.run_dir,
                f"events.out.tfevents.steps-{rows[0]['step']:010d}-{rows[-1]['step']:010d}",
            )
            self.tb = summary_writer(self.tb_dir)

    def event_file(self):
        """The event file this run writes: the newest in tb_dir (a resumed run's directory
        holds one per run before it)."""
        files = glob.glob(os.path.join(self.tb_dir, "events.out.tfevents.*"))
        return max(files, key=os.path.getmtime, default=self.tb_dir)

    def close(self):
        """The last rows written, TensorBoard's file closed. A run already ending on an error
        (a full disk) says that one: a write failing again here stays silent."""
        if not self.main:
            return
        failing = sys.exc_info()[1] is not None
        try:
            self.flush()
            self.tb.close()
        except WriteError:
            if not failing:
                raise
        except OSError as e:  # TensorBoard's event file
            if not failing:
                raise WriteError(f"{self.run_dir}: cannot write ({storage_reason(e)})") from None
        finally:
            if self.remote:  # a bucket's local staging of event files
                shutil.rmtree(self.tb_dir, ignore_errors=True)
            if self.wandb:
                self.wandb.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
