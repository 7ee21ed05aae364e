"""The code is formatted as the field formats Python, and train.py reads as its docstring promises: the
trainer first (Part 1), what a pod needs beyond it after a `# Part 2` banner."""

import ast
import io
import pathlib
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("train.py", "model.py", "data.py")


def ruff(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def code_lines(path):
    """The line numbers holding code: no blank lines, comments or docstrings."""
    src = path.read_text()
    tree = ast.parse(src)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        first = body[0] if isinstance(node, kinds) and body else None
        value = first.value if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            docs.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in (*skip, tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return sorted(lines - docs)


def test_ruff_format_at_100_columns_and_ruff_check_are_clean():
    formatted = ruff("format", "--check", "--line-length", "100", *SOURCES, "tests")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    checked = ruff("check", *SOURCES, "tests")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_style_check_catches_an_unformatted_line(tmp_path):
    (tmp_path / "packed.py").write_text("import os\n\n\ndef f(a,b): return os.sep,a+b\n")
    assert ruff("format", "--check", "--line-length", "100", "packed.py", cwd=tmp_path).returncode
    (tmp_path / "unused.py").write_text("import os\n")
    assert ruff("check", "unused.py", cwd=tmp_path).returncode


@pytest.mark.parametrize("name", SOURCES)
def test_no_line_is_wider_than_100_columns_and_no_tuple_is_a_statement(name):
    path = ROOT / name
    wide = [i + 1 for i, row in enumerate(path.read_text().splitlines()) if len(row) > 100]
    assert not wide, f"{name}: lines wider than 100 columns: {wide[:10]}"
    tree = ast.parse(path.read_text())
    tuples = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Tuple)
    ]
    assert not tuples, (
        f"{name}: tuples written as statements for their side effects at lines {tuples}"
    )


def test_train_py_opens_with_the_trainer_and_reaches_part_2_through_a_few_entry_points():
    path = ROOT / "train.py"
    rows = path.read_text().splitlines()
    tree = ast.parse(path.read_text())
    part2 = next(i + 1 for i, row in enumerate(rows) if row.startswith("# Part 2"))
    part1_code = [n for n in code_lines(path) if n < part2]
    assert len(part1_code) <= 700, f"Part 1 has {len(part1_code)} code lines"
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defs["make_train_step"].lineno <= 350
    for name in ("make_mesh", "build", "train_loop", "train", "run", "main"):
        assert defs[name].lineno < part2, f"{name} belongs to the trainer, Part 1"
    later = {name for name, node in defs.items() if node.lineno > part2}
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.lineno > part2:
            later |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    used = {
        n.id
        for node in tree.body
        if node.lineno < part2
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and n.id in later
    }
    assert len(used) <= 12, f"Part 1 uses {len(used)} names of Part 2: {sorted(used)}"
    for name in used:  # each entry point says what it does in one line
        doc = ast.get_docstring(defs[name], clean=False) if name in defs else None
        assert doc and "\n" not in doc, f"{name}: give Part 2's entry point a one-line docstring"


def test_a_task_is_at_most_twelve_fields_and_the_lm_loss_reads_params_and_a_batch():
    """What train.py reads of a task stays small (issue 85): the LM's loss takes (cfg, graph, params, batch) and
    returns (summed loss, sums); what only the puzzle heads keep (the carry, the EMA) is in Task.own."""
    import inspect

    import model as model_lib

    assert len(model_lib.Task._fields) <= 12, model_lib.Task._fields
    for task in model_lib.TASKS.values():
        assert list(inspect.signature(task.loss).parameters) == ["cfg", "graph", "params", "mb"]
    assert model_lib.LM.own == model_lib.Own() and model_lib.SUDOKU.own.eval_weights == "ema"
