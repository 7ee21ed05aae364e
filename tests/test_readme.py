"""The README's key table agrees with base.yml: every key it lists exists there with the default it shows."""

import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def flatten(d, prefix=""):
    """base.yml's nested sections as dotted keys: {'trm': {'T': 2}} -> {'trm.T': 2}."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def normalise(value, like=None):
    """A default as a value: YAML-parsed, '1e-3' as a float, None/null/'' alike, '1,-1,1' as a list."""
    if isinstance(value, str):
        text = value.strip().strip("`").strip()
        value = (
            yaml.safe_load(f"[{text}]")
            if isinstance(like, list) and not text.startswith("[")
            else yaml.safe_load(text)
        )
    if isinstance(value, str):
        try:
            value = float(value) if value not in ("None", "") else None
        except ValueError:
            pass
    return value


def readme_key_table(text):
    """{key: default cell} of the table whose header row is `| key | default | meaning |`."""
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if re.match(r"^\|\s*key\s*\|\s*default\s*\|", line)),
        None,
    )
    assert start is not None, "README has no table with the header | key | default | meaning |"
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        key, default = [c.strip() for c in line.strip("|").split("|")][:2]
        rows[key.strip("`")] = default
    return rows


def test_readme_key_table_defaults_equal_base_yml():
    base = flatten(yaml.safe_load((ROOT / "base.yml").read_text()))
    rows = readme_key_table((ROOT / "README.md").read_text())
    assert len(rows) >= 20, f"README key table has {len(rows)} rows"
    assert not set(rows) - set(base), (
        f"README keys not in base.yml: {sorted(set(rows) - set(base))}"
    )
    wrong = {
        k: (d, base[k]) for k, d in rows.items() if normalise(d, base[k]) != normalise(base[k])
    }
    assert not wrong, f"README default != base.yml (README, base.yml): {wrong}"
