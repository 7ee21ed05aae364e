"""data.py: text sources and packing, per-host shares, exact resume, Sudoku generation and CSV checks."""

import json
import os
import subprocess
import sys
import threading

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    HF,
    ROOT,
    SUDOKU,
    TEXT,
    VOCAB,
    config,
    dataset,
    documents_text,
    write_corpus,
    write_parquet,
)

import data
import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "train", 12, "train", 0)
    write_corpus(root / "eval", 4, "eval", 1)
    return root


def files_cfg(tmp_path, corpus, *overrides):
    """The TEXT preset reading the module's corpus, read ahead; key=value overrides, a later key wins."""
    return config(
        tmp_path,
        f"dataset_path={corpus}/train/*.txt",
        f"eval_path={corpus}/eval/*.txt",
        "prefetch=2",
        *overrides,
        preset=TEXT,
    )


def documents(batches, eos):
    """Rebuilds whole token documents from packed batches, checking the packing on the way."""
    docs, current = [], []
    for b in batches:
        assert np.array_equal(b["loss_mask"] > 0, b["segment_ids"] > 0)  # padding never counts
        for r in range(b["inputs"].shape[0]):
            seg = b["segment_ids"][r]
            used = seg[
                seg > 0
            ]  # segments fill the row from the left, in order; padding only at the end
            assert np.all(np.diff(used) >= 0) and not seg[len(used) :].any()
            for s in range(1, seg.max() + 1):
                idx = np.flatnonzero(seg == s)
                assert np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))  # contiguous
                assert np.array_equal(
                    b["positions"][r, idx], np.arange(len(idx))
                )  # restarts per segment
                inputs, targets = b["inputs"][r, idx], b["targets"][r, idx]
                assert np.array_equal(inputs[1:], targets[:-1])  # targets are the next tokens
                if current:  # a continued document picks up at the previous piece's last target
                    assert inputs[0] == current[-1]
                else:
                    current = [int(inputs[0])]
                current += targets.tolist()
                assert eos not in current[:-1]  # no piece runs past its document's end
                if targets[-1] == eos:
                    docs.append(current)
                    current = []
    return docs


def lanes(batches):
    """Each row's stream (a lane: row r of every batch) as 1-row batches, for documents()."""
    return [
        [{k: v[r : r + 1] for k, v in b.items()} for b in batches]
        for r in range(len(batches[0]["inputs"]))
    ]


def rest_of_epoch(ds, it, rows, first=0, limit=500):
    """Batches until every lane of `it` (rows first, first + 1, ... of `rows`) reads epoch 1: grain's packing state
    names the lane's next record, at position lane + next_index x rows of the shuffled order."""
    batches = []
    while (
        min(
            (s["parent_state"]["next_index"] * rows + first + j) // len(ds.train_texts)
            for j, s in enumerate(it.state())
        )
        == 0
    ):
        assert len(batches) < limit, "the iterator never reached epoch 1"
        batches.append(next(it))
    return batches


# ---- text ---------------------------------------------------------------------------------------


def test_files_build_tokenizer_and_cache_reuse(tmp_path, corpus, monkeypatch):
    cfg = files_cfg(tmp_path, corpus)
    ds = dataset(cfg)
    assert ds.vocab_size == VOCAB and len(ds.train_texts) == 12 and len(ds.eval_texts) == 4
    text = ds.train_texts[0]
    assert ds.tokenizer.decode(ds.tokenizer.encode(text)) == text  # code layout survives
    batch = next(iter(ds.eval_batches(2, 1)))
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "inputs": ((2, 32), "int32"),
        "targets": ((2, 32), "int32"),
        "segment_ids": ((2, 32), "int32"),
        "positions": ((2, 32), "int32"),
        "loss_mask": ((2, 32), "float32"),
    }
    stamps = {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, fs in os.walk(cfg.cache_dir)
        for f in fs
    }
    assert any(p.endswith(".model") for p in stamps) and any("array_record" in p for p in stamps)

    def no_training(*args):
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(data, "_train_tokenizer", no_training)
    again = dataset(cfg)
    assert again.train_texts[0] == text
    after = {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, fs in os.walk(cfg.cache_dir)
        for f in fs
        if f != ".lock"
    }
    assert after == {p: t for p, t in stamps.items() if not p.endswith(".lock")}  # nothing rebuilt

    # Another glob is another dataset: it gets its own prepared copy.
    other = dataset(
        files_cfg(
            tmp_path,
            corpus,
            f"dataset_path={corpus}/train/train0*.txt",
            f"tokenizer_path={next(p for p in stamps if p.endswith('.model'))}",
        )
    )
    assert len(other.train_texts) == 10


def test_held_out_split_without_eval_path(tmp_path, corpus):
    ds = dataset(files_cfg(tmp_path, corpus, "eval_path="))
    train = {ds.train_texts[i] for i in range(len(ds.train_texts))}
    held = {ds.eval_texts[i] for i in range(len(ds.eval_texts))}
    assert held and not train & held and len(train) + len(held) == 12


def test_packing_reproduces_documents_and_pads(tmp_path, corpus):
    ds = dataset(files_cfg(tmp_path, corpus))
    n = 40  # far more than the 4 eval documents fill: one pass, no batch of padding alone
    batches = ds.eval_batches(3, n)
    docs = documents(batches, ds.tokenizer.eos_id)
    expected = [ds.encode(ds.eval_texts[i]).tolist() for i in ds.eval_records]
    assert docs == expected
    assert len(docs) == 4 and max(len(d) for d in docs) > 32  # some document spans rows
    assert any(b["segment_ids"].max() > 1 for b in batches)  # some row holds several documents
    assert len(batches) < n and batches[-1]["loss_mask"].any()
    assert all(
        np.array_equal(a[k], b[k]) for a, b in zip(batches, ds.eval_batches(3, n)) for k in a
    )


def test_pack_small_example():
    docs = grain.MapDataset.source(
        [np.array([2, 10, 11, 3]), np.array([2, 20, 3])]
    ).to_iter_dataset()
    rows = list(data._pack(docs, length=4))
    batch = data._stack(rows, 2, 4)
    assert batch["inputs"].tolist() == [[2, 10, 11, 2], [20, 0, 0, 0]]
    assert batch["targets"].tolist() == [[10, 11, 3, 20], [3, 0, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 0, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0], [0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert len(rows) == 2  # the documents ran out


def test_two_hosts_read_disjoint_records_covering_all(tmp_path, corpus):
    """Host p of 2 reads lanes 2p, 2p+1 of 4: lane r reads the shuffled order's positions r, r + 4, r + 8."""
    cfg = files_cfg(tmp_path, corpus)
    hosts = [dataset(cfg, p, 2) for p in range(2)]
    seen = []
    for p, host in enumerate(hosts):  # the first epoch of each host holds exactly its own documents
        it = host.train_iter(2)
        batches = rest_of_epoch(host, it, 4, first=2 * p)
        it.close()
        docs = [d for lane in lanes(batches) for d in documents(lane, host.tokenizer.eos_id)[:3]]
        expected = [host._order[j].tolist() for j in range(12) if j % 4 in (2 * p, 2 * p + 1)]
        assert sorted(docs) == sorted(expected)
        seen += docs
    everything = [hosts[0].encode(hosts[0].train_texts[i]).tolist() for i in range(12)]
    assert sorted(seen) == sorted(everything)


@pytest.mark.parametrize("prefetch,source", [(0, "files"), (3, "files"), (3, "hf")])
def test_text_resume_is_exact(tmp_path, corpus, prefetch, source):
    """From text files and from a Hugging Face dataset (local parquet, random access): a resumed iterator
    hands out exactly the batches the uninterrupted one does, on into the next epoch."""
    if source == "files":
        cfg = files_cfg(tmp_path, corpus, f"prefetch={prefetch}")
    else:
        write_parquet(str(tmp_path / "train.parquet"), 12, "train", 0)
        cfg = config(
            tmp_path, f"hf_data_files={tmp_path}/train.parquet", f"prefetch={prefetch}", preset=HF
        )
    ds = dataset(cfg)
    it = ds.train_iter(3)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.state()))
    reference = rest_of_epoch(ds, it, 3) + [next(it) for _ in range(3)]  # on into the next epoch
    it.close()
    resumed = ds.train_iter(3, state={"lanes": state, "source": ds.identity})
    for want in reference:
        got = next(resumed)
        assert all(np.array_equal(want[k], got[k]) for k in want)
    resumed.close()


def test_hf_dataset_held_out_split_and_text_key(tmp_path):
    """dataset=hf without hf_eval_split holds a fixed share of the records out of training (disjoint, the
    same every time); a text_key the records lack is one line naming it."""
    write_parquet(str(tmp_path / "d.parquet"), 200, "doc", 0)
    cfg = config(tmp_path, f"hf_data_files={tmp_path}/d.parquet", preset=HF)
    ds = dataset(cfg)
    train, held = (
        [ds.train_texts[i] for i in range(len(ds.train_texts))],
        [ds.eval_texts[i] for i in range(len(ds.eval_texts))],
    )
    assert 0 < len(held) < 20 and len(train) + len(held) == 200 and not set(train) & set(held)
    assert held == [dataset(cfg).eval_texts[i] for i in range(len(held))]
    with pytest.raises(
        data.DataError, match="text_key='body' is not a feature of the records .*'id', 'text'"
    ):
        dataset(config(tmp_path, f"hf_data_files={tmp_path}/d.parquet", "text_key=body", preset=HF))


def test_hf_stream_reads_every_document_once_and_resumes_there(tmp_path):
    """dataset=hf with hf_streaming: each process reads its share of the stream (disjoint, all of it together)
    in the stream's order, packed into its rows, epoch after epoch; a stream resumed from a saved position
    hands out exactly the rows an uninterrupted one does (no document read twice, none skipped), also across
    an epoch's end. A resume on another process count is refused in one line."""
    write_parquet(str(tmp_path / "d.parquet"), 8, "doc", 0)
    cfg = config(
        tmp_path,
        f"hf_data_files={tmp_path}/d.parquet",
        "hf_streaming=true",
        "eval_batches=0",
        "prefetch=2",
        preset=HF,
    )
    ds = dataset(cfg)
    want = [ds.encode(t).tolist() for t in documents_text(8, "doc", 0)]
    it = ds.train_iter(2)
    first = [next(it) for _ in range(3)]
    state = {"lanes": json.loads(json.dumps(it.state())), "source": ds.identity}
    rest = [next(it) for _ in range(40)]
    it.close()
    docs = documents(first + rest, ds.tokenizer.eos_id)
    assert len(docs) > 16 and docs == (want * 3)[: len(docs)], (
        "every document once an epoch, in order"
    )
    resumed = ds.train_iter(2, state=state)
    for batch in rest:
        got = next(resumed)
        assert all(np.array_equal(batch[k], got[k]) for k in batch)
    resumed.close()
    shares = []
    for p in range(2):
        host = dataset(cfg, p, 2).train_iter(1)
        shares.append(documents([next(host) for _ in range(40)], ds.tokenizer.eos_id)[:4])
        host.close()
    assert sorted(map(tuple, shares[0] + shares[1])) == sorted(map(tuple, want))
    with pytest.raises(
        data.DataError, match="a streaming run resumes on the process count that wrote it"
    ):
        dataset(cfg, 0, 2).train_iter(1, state={"lanes": state["lanes"][:2], "source": ds.identity})


def test_tfds_data_source_with_mock_data(tmp_path, corpus):
    import tensorflow_datasets as tfds

    tokenizer = dataset(files_cfg(tmp_path, corpus)).tokenizer.files["tokenizer.model"]
    (tmp_path / "tok.model").write_bytes(tokenizer)
    tfds_args = [
        "dataset=tfds",
        "tfds_name=imdb_reviews",
        "eval_split=test",
        "text_key=text",
        f"tokenizer_path={tmp_path}/tok.model",
        f"vocab_size={VOCAB}",
        "max_target_length=16",
        "prefetch=1",
    ]
    cfg = config(tmp_path, *tfds_args, preset=())
    with tfds.testing.mock_data(num_examples=6):
        ds = dataset(cfg)
        it = ds.train_iter(2)
        batches = [next(it) for _ in range(6)]
        it.close()
    assert len(ds.train_texts) == 6 and any(
        documents(lane, ds.tokenizer.eos_id) for lane in lanes(batches)
    )
    with tfds.testing.mock_data(num_examples=6), pytest.raises(data.DataError, match="text_key"):
        next(dataset(config(tmp_path, *tfds_args, "text_key=nope", preset=())).train_iter(2))


def test_kept_out_modules_fail_to_import_inside_and_import_after():
    """data.kept_out, in a fresh interpreter: inside, a module not yet imported fails to import (a
    library's optional import goes without it) and one already imported stays; afterwards both import.
    train's import of flax goes without IPython so (where IPython is installed, it stays unimported)."""
    code = """
import json, sys, data
with data.kept_out("colorsys", "json"):
    try:
        import colorsys
    except ImportError:
        print("colorsys refused")
    import json as again
    print("json kept", again is json)
import colorsys
print("colorsys after", colorsys.hsv_to_rgb(0, 0, 1))
import train
print("IPython imported", "IPython" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == [
        "colorsys refused",
        "json kept True",
        "colorsys after (1, 1, 1)",
        "IPython imported False",
    ], out


def test_default_stdlib_dataset(tmp_path):
    ds = dataset(config(tmp_path, preset=()))
    assert ds.vocab_size == 1024 and len(ds.train_texts) > 100 and len(ds.eval_texts) > 5
    it = ds.train_iter(2)
    batch = next(it)
    it.close()
    assert batch["inputs"].shape == (2, 256) and batch["loss_mask"].all()


def test_synthetic_global_batch_does_not_depend_on_process_count(tmp_path):
    cfg = config(
        tmp_path, "vocab_size=50", "max_target_length=16"
    )  # the LM preset: synthetic tokens
    one = dataset(cfg).train_iter(8)
    two = [dataset(cfg, p, 2).train_iter(4) for p in range(2)]
    for _ in range(3):
        whole, halves = next(one), [next(it) for it in two]
        for k in whole:
            assert np.array_equal(whole[k], np.concatenate([h[k] for h in halves]))
    assert whole["inputs"].max() < 50 and np.array_equal(
        whole["inputs"][:, 1:], whole["targets"][:, :-1]
    )
    assert one.state() == [{"next_index": 3}] * 8


def test_user_errors_name_the_key(tmp_path, corpus):
    cases = [
        (f"dataset_path={tmp_path}/nothing/*.txt", "dataset_path="),
        (f"eval_path={tmp_path}/none*.txt", "eval_path="),
        (f"tokenizer_path={tmp_path}/missing.model", "tokenizer_path="),
        ("vocab_size=100000", "vocab_size=100000"),
    ]
    for override, key in cases:
        with pytest.raises(data.DataError, match=key):
            dataset(files_cfg(tmp_path, corpus, override))
    with pytest.raises(data.DataError, match="tfds_name="):
        dataset(config(tmp_path, "dataset=tfds", "tfds_name=no_such_dataset_xyz", preset=()))
    with pytest.raises(data.DataError, match="dataset_path="):
        dataset(config(tmp_path, f"dataset_path={tmp_path}/missing.csv", preset=SUDOKU))


@pytest.mark.parametrize(
    "source, text, why",
    [
        ("files", "", "every file is empty"),
        ("files", " \n\t\n   \n", "the text is only whitespace"),
        (
            "files",
            "word " * 4000,
            (
                "no line breaks in 20,000 characters (sentencepiece takes lines of up to 16,000): "
                "break the text into lines"
            ),
        ),
        (
            "files",
            "\0".join(["one record"] * 2000),
            (
                "NUL-separated text with no line breaks in 21,999 characters "
                "(sentencepiece takes lines of up to 16,000): break the text into "
                "lines"
            ),
        ),
        ("hf", "", "every record's text (text_key='text') is empty"),
    ],
    ids=["empty", "whitespace", "one long line", "NUL-separated", "hf empty"],
)
def test_a_corpus_without_usable_text_says_why(tmp_path, source, text, why):
    """Text the tokenizer cannot train on stops the run in one line naming the files and why (sentencepiece
    itself would blame vocab_size, naming no file)."""
    if source == "files":
        for k in range(3):
            (tmp_path / f"{k}.txt").write_text(text)
        where, cfg = (
            f"dataset_path='{tmp_path}/*.txt'",
            config(tmp_path, f"dataset_path={tmp_path}/*.txt", preset=TEXT),
        )
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [text] * 40}), str(tmp_path / "d.parquet"))
        where, cfg = (
            f"hf_data_files='{tmp_path}/d.parquet'",
            config(tmp_path, f"hf_data_files={tmp_path}/d.parquet", preset=HF),
        )
    with pytest.raises(data.DataError) as e:
        train.run(cfg, jax.devices()[:1])
    assert f"error: {e.value}".splitlines() == [
        f"error: {where}: no text to train the tokenizer on: {why}"
    ]


def test_vocab_mismatch(tmp_path, corpus):
    model = dataset(files_cfg(tmp_path, corpus)).tokenizer.files["tokenizer.model"]
    (tmp_path / "tok.model").write_bytes(model)
    with pytest.raises(
        data.DataError, match=f"vocab_size=512 .*tok.model.* set vocab_size={VOCAB}"
    ):
        dataset(
            files_cfg(tmp_path, corpus, "vocab_size=512", f"tokenizer_path={tmp_path}/tok.model")
        )


def test_prefetch_thread_errors_reraise_and_close_stops():
    def row(i):
        if i == 1:
            raise ValueError("broken record")
        return {"x": i}

    it = data.Batches([grain.MapDataset.range(3).map(row).to_iter_dataset(data._READ)], prefetch=2)
    assert next(it)["x"].tolist() == [0] and it.state() == [{"next_index": 1}]
    with pytest.raises(ValueError, match="broken record"):
        next(it)
    it.close()
    before = set(threading.enumerate())
    forever = data.Batches(
        [grain.MapDataset.range(sys.maxsize).map(lambda i: {"x": i}).to_iter_dataset(data._READ)],
        prefetch=2,
    )
    next(forever)
    started = set(threading.enumerate()) - before
    forever.close()
    assert started and not any(t.is_alive() for t in started)


def test_wait_seconds_is_time_blocked_on_data(monkeypatch):
    """wait_seconds (the trainer logs it as data wait) is the time next() spent blocked on the producer:
    all of the production without prefetch; with prefetch ahead of a slower consumer, the first batch's
    production and nothing after it, none of the consumer's own time. data.py's clock is a fake one, moved
    only by the work the test stands for (making a row: 0.05 s; the consumer's step: 0.12 s), and each row
    is made only once the test lets it, so every wait is exact, whatever the machine's scheduling."""

    class Clock:
        def __init__(self):
            self.now, self.lock, self.on_read = 0.0, threading.Lock(), None

        def perf_counter(self):
            hook, self.on_read = self.on_read, None
            if hook:  # the first read inside next(): let the producer start now
                hook()
            with self.lock:
                return self.now

        def work(self, seconds):
            with self.lock:
                self.now += seconds

    clock = Clock()
    monkeypatch.setattr(
        data, "time", clock
    )  # data.py's `time` alone; JAX and grain keep the real one
    allowed, made = [threading.Event() for _ in range(4)], [threading.Event() for _ in range(4)]

    def row(i):
        assert allowed[i].wait(timeout=10), f"row {i} never allowed"
        clock.work(0.05)
        made[i].set()
        return {"i": i}

    batches = lambda: [grain.MapDataset.range(4).map(row).to_iter_dataset(data._READ)]  # one lane
    for e in allowed:
        e.set()
    it = data.Batches(batches(), prefetch=0)
    for i in range(4):
        assert next(it)["i"].tolist() == [i]
    assert it.wait_seconds == pytest.approx(4 * 0.05)  # each next() ran the producer
    it.close()

    for e in allowed + made:
        e.clear()
    it = data.Batches(batches(), prefetch=2)
    try:
        clock.on_read = allowed[0].set  # the first batch is made while next() waits for it
        assert next(it)["i"].tolist() == [0]
        first = it.wait_seconds
        assert first == pytest.approx(0.05)
        for i in range(1, 4):
            clock.work(
                0.12
            )  # the consumer's "train step", longer than a batch takes: meanwhile ...
            allowed[i].set()
            assert made[i].wait(timeout=10), (
                f"batch {i} was not made ahead of next()"
            )  # ... the next is ready
            assert next(it)["i"].tolist() == [i]
    finally:
        for e in allowed:
            e.set()
        it.close()
    # Unhidden, these three batches would cost 0.15 s of waiting; the consumer's own 0.36 s must not count.
    assert it.state() == [{"next_index": 4}] and it.wait_seconds == first, (first, it.wait_seconds)


# ---- Sudoku -------------------------------------------------------------------------------------


def brute_force_count(grid, limit=2):
    """Independent of data.py: plain sets, first cell with fewest candidates, counts up to `limit`."""
    g = list(grid)
    empties = [i for i in range(81) if g[i] == 0]
    if not empties:
        return 1

    def candidates(i):
        r, c = divmod(i, 9)
        b = (r // 3) * 27 + (c // 3) * 3
        used = {g[r * 9 + k] for k in range(9)} | {g[k * 9 + c] for k in range(9)}
        used |= {g[b + dr * 9 + dc] for dr in range(3) for dc in range(3)}
        return [d for d in range(1, 10) if d not in used]

    cell = min(empties, key=lambda i: len(candidates(i)))
    count = 0
    for d in candidates(cell):
        g[cell] = d
        count += brute_force_count(g, limit - count)
        if count >= limit:
            break
    return count


def grid_ok(a):
    rows = [a[r * 9 : (r + 1) * 9] for r in range(9)]
    cols = [a[c::9] for c in range(9)]
    boxes = [
        [a[(br * 3 + i) * 9 + bc * 3 + j] for i in range(3) for j in range(3)]
        for br in range(3)
        for bc in range(3)
    ]
    return all(sorted(u) == list(range(1, 10)) for u in rows + cols + boxes)


def peers_of(i):
    """Independent of data.py: the 20 other cells sharing cell i's row, column or box."""
    r, c = divmod(i, 9)
    return {
        j
        for j in range(81)
        if j != i and (j // 9 == r or j % 9 == c or (j // 27, j % 9 // 3) == (r // 3, c // 3))
    }


def test_sudoku_rules_match_plain_python():
    """data.py's rule tables and checks (the solver, CSV checks, eval scoring and ToT search read them)
    agree with the plain-Python helpers above, on numpy arrays and on jax arrays under jit."""
    assert [set(np.flatnonzero(data.PEERS[i])) for i in range(81)] == [
        peers_of(i) for i in range(81)
    ]
    assert (data.PEERS.sum(axis=1) == 20).all()

    q, a = data.generate_sudoku(4, 45, seed=3)
    swapped = a.copy()
    swapped[:, [0, 1]] = swapped[
        :, [1, 0]
    ]  # two different digits of row 0 swap: their columns repeat
    blank = a.copy()
    blank[:, 40] = 0
    wall = np.zeros(
        (1, 81), a.dtype
    )  # cell 0 sees 1..8 in its row and 9 in its column: no digit left,
    wall[0, 1:9], wall[0, 27] = range(1, 9), 9  # though no given repeats
    homeless = np.zeros(
        (1, 81), a.dtype
    )  # row 0 lacks a 9 and has no cell left for it (columns 7 and 8
    homeless[0, :7], homeless[0, 34], homeless[0, 62] = (
        range(1, 8),
        9,
        9,
    )  # hold one), though its blanks
    grids = np.concatenate([a, swapped, blank, q, wall, homeless])  # can still take an 8
    assert brute_force_count(wall[0].tolist()) == 0 and all(
        brute_force_count(g) == 1 for g in q.tolist()
    )
    assert brute_force_count(homeless[0].tolist()) == 0
    assert all(8 not in {homeless[0, j] for j in peers_of(i)} for i in (7, 8))

    # peers' digits, scanned in plain Python: digit d+1 is seen at cell i when a peer holds it
    seen = np.array(
        [
            [[d + 1 in {g[j] for j in peers_of(i)} for d in range(9)] for i in range(81)]
            for g in grids.tolist()
        ]
    )
    expect = {
        "solved": [grid_ok(g) for g in grids.tolist()],
        "dead_end": [False] * 4 + [True] * 4 + [False] * 4 + [False] * 4 + [True, True],
        "digits_seen": seen,
    }
    assert (
        expect["solved"] == [True] * 4 + [False] * 14
    )  # the helpers see what the cases were built for
    checks = lambda g: {
        "solved": data.solved(g),
        "dead_end": data.dead_end(g),
        "digits_seen": data.digits_seen(g),
    }
    for got in (checks(grids), jax.jit(checks)(jnp.asarray(grids))):
        for key, want in expect.items():
            assert np.array_equal(np.asarray(got[key]), want), key


def test_generated_puzzles_have_exactly_one_solution():
    q, a = data.generate_sudoku(12, 45, seed=7)
    assert np.array_equal(q, data.generate_sudoku(12, 45, seed=7)[0])  # reproducible
    assert ((q == 0).sum(axis=1) == 45).all()
    for puzzle, solution in zip(q.tolist(), a.tolist()):
        assert grid_ok(solution) and all(p in (0, s) for p, s in zip(puzzle, solution))
        assert brute_force_count(puzzle) == 1
    minimal_q, _minimal_a = data.generate_sudoku(2, 81, seed=7)
    for puzzle in minimal_q.tolist():
        assert brute_force_count(puzzle) == 1 and (np.array(puzzle) == 0).sum() > 45
        for i in range(81):  # minimal: no given can go without a second solution appearing
            if puzzle[i]:
                assert brute_force_count(puzzle[:i] + [0] + puzzle[i + 1 :]) == 2
    assert data.solve(q[0])[1] == 1 and np.array_equal(data.solve(q[0])[0], a[0])
    assert data.solve(np.zeros(81))[1] == 2 and data.solve([1, 1] + [0] * 79) == (None, 0)


def test_make_sudoku_needs_search_keeps_the_puzzles_singles_cannot_finish(tmp_path):
    """Naked and hidden singles (data.by_singles) never write a wrong digit; they finish some minimal puzzles, not
    all. make-sudoku --needs-search writes, of the file stream's minimal puzzles in order, those singles leave
    unfinished: each with one solution, none finished by singles, the same puzzles as the plain stream's."""
    q, a = data.generate_sudoku(30, 81, seed=5, stream="file")
    filled = data.by_singles(q)
    assert (
        np.all((filled == 0) | (filled == a)) and (filled > 0).sum() > (q > 0).sum()
    )  # right digits, and some
    finished = data.solved(filled)
    assert 0 < finished.sum() < len(q) - 8, finished.sum()
    assert data.solved(
        data.by_singles(data.generate_sudoku(10, 30, seed=5)[0])
    ).all()  # 30 blanks: singles suffice
    data.main(
        [
            "make-sudoku",
            str(tmp_path / "hard.csv"),
            "--count",
            "8",
            "--blanks",
            "81",
            "--seed",
            "5",
            "--needs-search",
        ]
    )
    hard_q, hard_a = data.read_sudoku_csv(str(tmp_path / "hard.csv"))
    assert np.array_equal(hard_q, q[~finished][:8]) and np.array_equal(hard_a, a[~finished][:8])
    assert not data.solved(data.by_singles(hard_q)).any() and all(
        data.solve(p)[1] == 1 for p in hard_q
    )


def test_min_guesses_draws_minimal_puzzles_as_hard_as_asked(tmp_path):
    """generate_sudoku(min_guesses=K) and make-sudoku --min-guesses K: every minimal puzzle needs at
    least K guesses of the plain search (counted independently below), puzzles already that hard are
    the ones min_guesses=0 makes, 45-blank puzzles are untouched; each keeps one solution."""

    def guesses(grid):  # a plain recursive count: branch cells while proving the solution unique
        count, found = [0], []

        def visit(g):
            legal = data.legal_digits(g)
            blank = np.flatnonzero(g == 0)
            if not len(blank):
                found.append(g)
                return len(found) >= 2
            cell = blank[np.argmin(legal[blank].sum(-1))]  # fewest digits left, first in order
            count[0] += int(legal[cell].sum() > 1)
            return any(
                visit(np.where(np.arange(81) == cell, d + 1, g))
                for d in np.flatnonzero(legal[cell])
            )

        visit(np.asarray(grid, np.int64))
        return count[0]

    plain, _ = data.generate_sudoku(6, (45, 81), seed=3)
    hard, hard_a = data.generate_sudoku(6, (45, 81), seed=3, min_guesses=100)
    counts = [guesses(p) for p in hard[1::2]]
    assert min(counts) >= 100 and counts == [data.search_guesses(p) for p in hard[1::2]]
    assert np.array_equal(hard[::2], plain[::2])  # 45 blanks: as before
    for p, was in zip(hard[1::2], plain[1::2]):  # a plain puzzle already as hard is kept
        assert np.array_equal(p, was) == (data.search_guesses(was) >= 100)
    assert all(data.solve(p)[1] == 1 for p in hard) and (data.solve(hard[1])[0] == hard_a[1]).all()
    data.main(
        [
            "make-sudoku",
            str(tmp_path / "h.csv"),
            "--count",
            "3",
            "--blanks",
            "81",
            "--min-guesses",
            "200",
        ]
    )
    assert (
        min(data.search_guesses(p) for p in data.read_sudoku_csv(str(tmp_path / "h.csv"))[0]) >= 200
    )


def test_a_list_of_blanks_is_taken_in_turn(tmp_path):
    """sudoku_blanks=45,81: puzzle i has blanks[i % 2], the same puzzle the single value would make there."""
    q, _a = data.generate_sudoku(4, (30, 81), seed=7)
    assert ((q[::2] == 0).sum(axis=1) == 30).all() and ((q[1::2] == 0).sum(axis=1) > 45).all()
    assert np.array_equal(q[1::2], data.generate_sudoku(4, 81, seed=7)[0][1::2])
    assert config(tmp_path, preset=SUDOKU).sudoku_blanks == (45,)  # base.yml's single 45
    cfg = config(
        tmp_path,
        "sudoku_blanks=30,81",
        "sudoku_train_puzzles=4",
        "sudoku_eval_puzzles=2",
        preset=SUDOKU,
    )
    assert cfg.sudoku_blanks == (30, 81)
    assert np.array_equal(
        dataset(cfg).train_q, data.generate_sudoku(4, (30, 81), cfg.seed)[0]
    )  # via its cache


def test_sudoku_dataset_train_eval_disjoint(tmp_path, monkeypatch):
    real = data.generate_sudoku

    def overlapping(n, blanks, seed, stream="train", start=0, min_guesses=0):
        q, a = real(n, blanks, seed, stream)  # the eval stream repeats three train grids
        if stream == "eval":
            tq, ta = real(3, blanks, seed, "train")
            q, a = np.concatenate([tq, q]), np.concatenate([ta, a])
        return q, a

    monkeypatch.setattr(data, "generate_sudoku", overlapping)
    cfg = config(
        tmp_path,
        "sudoku_train_puzzles=20",
        "sudoku_eval_puzzles=8",
        "sudoku_blanks=40",
        preset=SUDOKU,
    )
    ds = dataset(cfg)
    assert (
        ds.vocab_size == 11 and len(ds.train_q) == 20 and len(ds.eval_q) == 8
    )  # the 3 repeats dropped
    train = {s.tobytes() for s in ds.train_a}
    assert not any(s.tobytes() in train for s in ds.eval_a)
    batch = ds.eval_batches(4, 3)[0]
    assert (
        batch["inputs"].shape == (4, 81)
        and batch["inputs"].min() >= 1
        and batch["targets"].min() >= 2
    )
    assert np.array_equal(batch["inputs"][0], ds.eval_q[0] + 1) and batch["loss_mask"].all()
    assert (
        np.array_equal(batch["positions"][0], np.arange(81)) and (batch["segment_ids"] == 1).all()
    )


def test_augment_keeps_puzzles_valid():
    q, a = data.generate_sudoku(2, 45, seed=1)
    outputs = set()
    for s in range(20):
        q2, a2 = data.augment(q[0], a[0], np.random.default_rng(s))
        assert grid_ok(a2.tolist()) and data.solved(a2[None])[0]
        assert (q2 == 0).sum() == 45
        assert ((q2 == 0) | (q2 == a2)).all()  # givens still agree with the solution
        assert data.solve(q2)[1] == 1 and np.array_equal(data.solve(q2)[0], a2)
        outputs.add(a2.tobytes())
    assert len(outputs) == 20


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sudoku_resume_is_exact(tmp_path, prefetch):
    cfg = config(
        tmp_path,
        "sudoku_train_puzzles=10",
        "sudoku_eval_puzzles=4",
        "sudoku_blanks=30",
        f"prefetch={prefetch}",
        preset=SUDOKU,
    )
    ds = dataset(cfg)
    it = ds.train_iter(4)
    for _ in range(3):
        next(it)
    state = it.state()
    reference = [next(it) for _ in range(6)]  # crosses epochs (10 puzzles, 4 per batch)
    it.close()
    resumed = ds.train_iter(
        4, state={"lanes": json.loads(json.dumps(state)), "source": ds.identity}
    )
    assert all(
        np.array_equal(want[k], got[k])
        for want in reference
        for got in [next(resumed)]
        for k in want
    )
    resumed.close()
    for b in reference:
        for qi, ai in zip(b["inputs"] - 1, b["targets"] - 1):
            assert data.solved(ai[None])[0] and ((qi == 0) | (qi == ai)).all()


def test_sudoku_csv_roundtrip_and_cli(tmp_path):
    out = tmp_path / "made.csv"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data.py"),
            "make-sudoku",
            str(out),
            "--count",
            "3",
            "--blanks",
            "40",
            "--seed",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    q, a = data.read_sudoku_csv(str(out))
    assert (
        out.read_text().startswith("source,q,a,rating\n")
        and q.shape == (3, 81)
        and ((q == 0).sum(1) == 40).all()
    )
    data.write_sudoku_csv(str(tmp_path / "copy.csv"), q, a)
    q2, a2 = data.read_sudoku_csv(str(tmp_path / "copy.csv"))
    assert np.array_equal(q, q2) and np.array_equal(a, a2)
    cfg = config(tmp_path, f"dataset_path={out}", f"eval_path={tmp_path}/copy.csv", preset=SUDOKU)
    assert len(dataset(cfg).eval_q) == 3


@pytest.mark.parametrize(
    "layout", ["public q,a", "question,answer", "no header", "bare pairs, 0 for blanks"]
)
def test_sudoku_csv_layouts_in_use(tmp_path, layout):
    """The published Sudoku-Extreme files (source,question,answer,rating), copies without a header (read by
    position, as the TRM reference does) or as bare puzzle,solution pairs, and our own q,a files."""
    q, a = data.generate_sudoku(3, 40, 1)
    data.write_sudoku_csv(str(tmp_path / "ours.csv"), q, a)
    lines = (tmp_path / "ours.csv").read_text().splitlines()
    text = {
        "public q,a": lines,
        "question,answer": ["source,question,answer,rating"] + lines[1:],
        "no header": lines[1:],
        "bare pairs, 0 for blanks": [
            "".join(map(str, x)) + "," + "".join(map(str, y)) for x, y in zip(q, a)
        ],
    }
    (tmp_path / "in.csv").write_text("\n".join(text[layout]) + "\n")
    q2, a2 = data.read_sudoku_csv(str(tmp_path / "in.csv"))
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(a2, a)


GOOD_A = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
GOOD_Q = GOOD_A[:40].replace("5", ".").replace("3", "0") + "." * 41


@pytest.mark.parametrize(
    "q, a, problem",
    [
        (GOOD_Q[:80], GOOD_A, "q has 80 characters"),
        (GOOD_Q, GOOD_A + "1", "a has 82 characters"),
        ("x" + GOOD_Q[1:], GOOD_A, "illegal character 'x'"),
        (GOOD_Q, "0" + GOOD_A[1:], "illegal character '0'"),
        ("9" + GOOD_Q[1:], GOOD_A, "disagrees with a given"),
        ("." * 81, GOOD_A[1] + GOOD_A[0] + GOOD_A[2:], "not a valid Sudoku grid"),
    ],
)
def test_malformed_csv_rows_name_the_line(tmp_path, q, a, problem):
    path = tmp_path / "bad.csv"
    path.write_text(
        f"source,q,a,rating\nok,{GOOD_Q},{GOOD_A},3\nbad,{q},{a},1\nok,{GOOD_Q},{GOOD_A},0\n"
    )
    with pytest.raises(data.DataError, match=f"bad.csv:3: .*{problem}"):
        data.read_sudoku_csv(str(path))


def test_preparing_new_text_files_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    """The first run on new files prepares them as a tfds dataset: the system's temporary directory is as it was.
    Before: every preparation left an empty tmp*tfds directory there (tfds looking for the dataset's metadata in its
    bucket)."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    write_corpus(tmp_path / "new", 6, "new", 3)
    ds = dataset(config(tmp_path, f"dataset_path={tmp_path}/new/*.txt", preset=TEXT))
    assert len(ds.train_texts) + len(ds.eval_texts) == 6
    assert os.listdir(scratch) == []


def test_text_files_copied_elsewhere_are_the_same_data(tmp_path, corpus):
    """A corpus copied to another directory (new modification times, as a copy to another host makes) is the same
    prepared dataset, its identity and record order the same, so a checkpoint's data position resumes on it;
    a changed file is other data."""
    import shutil

    shutil.copytree(corpus, tmp_path / "copy")
    for f in (tmp_path / "copy").rglob("*.txt"):
        os.utime(f, (f.stat().st_mtime + 3600, f.stat().st_mtime + 3600))
    here, there = (dataset(files_cfg(tmp_path, root)) for root in (corpus, tmp_path / "copy"))
    assert here.identity == there.identity
    assert [here.train_texts[i] for i in range(12)] == [there.train_texts[i] for i in range(12)]
    first = min((tmp_path / "copy" / "train").glob("*.txt"))
    first.write_text(first.read_text() + "more\n")
    assert dataset(files_cfg(tmp_path, tmp_path / "copy")).identity != here.identity
