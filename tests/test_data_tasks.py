"""Built-in tasks: records re-derived independently from their prompts; determinism by seed."""

import re

import pytest

from rpeg_jax.config import DataConfig
from rpeg_jax.config.data import BUILTIN_TASKS
from rpeg_jax.data.tasks import TASKS, make_records


def test_task_names_match_config():
    assert tuple(sorted(TASKS)) == tuple(sorted(BUILTIN_TASKS))


@pytest.mark.parametrize("name,letter", [("copy", "c"), ("reverse", "r"), ("sort", "s")])
def test_string_tasks_from_prompt(name, letter):
    recs = make_records(DataConfig(task=name, num_examples=300, min_digits=2, max_digits=6, seed=3))
    lengths = set()
    for rec in recs:
        m = re.fullmatch(letter + r"(\d+)=", rec["prompt"])
        assert m, rec["prompt"]
        s = m.group(1)
        lengths.add(len(s))
        want = {"copy": s, "reverse": "".join(reversed(list(s))), "sort": "".join(sorted(s, key=int))}[name]
        assert rec["answer"] == want and rec["task"] == name
    assert lengths == {2, 3, 4, 5, 6}  # uniform over the range: 300 draws hit every length


def test_add_task_from_prompt():
    recs = make_records(DataConfig(task="add", num_examples=300, min_digits=2, max_digits=2, seed=1))
    for rec in recs:
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", rec["prompt"]).groups()
        assert len(a) == len(b) == 2 and a[0] != "0" and b[0] != "0"  # R1: two 2-digit operands
        assert int(rec["answer"]) == int(a) + int(b)


def test_records_deterministic_by_seed_and_split():
    cfg = DataConfig(task="reverse", num_examples=50, seed=7)
    a, b = make_records(cfg), make_records(cfg)
    assert a == b
    assert [r["prompt"] for r in make_records(DataConfig(task="reverse", num_examples=50, seed=8))] != [
        r["prompt"] for r in a
    ]
    assert [r["prompt"] for r in make_records(cfg, "eval")] != [r["prompt"] for r in a]
    assert len({r["id"] for r in a}) == 50


def test_max_prompt_chars_bounds_generated_prompts():
    for name, task in TASKS.items():
        cfg = DataConfig(task=name, num_examples=200, min_digits=4, max_digits=4)
        assert max(len(r["prompt"]) for r in make_records(cfg)) == task.max_prompt_chars(4)
