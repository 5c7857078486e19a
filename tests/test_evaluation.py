"""Held-out evaluation (runtime/evaluation.py, `rpeg eval`): verl's val-core metrics recomputed in
float64 from the per-prompt files, greedy evaluation against the sampler itself, the schedule
(before train, every k, the end), training left exactly as without evaluation, `rpeg eval` on a
checkpoint reproducing the run's, and bad inputs as one line with exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import TINY, run

from rpeg_jax.cli import main
from rpeg_jax.data.rewards import register_reward

SOURCES = ("sums", "more_sums")


def graded(sample) -> float:
    """A reward that a random policy earns in steps of 0.5 (so mean@N and pass@N are not trivially 0)."""
    return (ord(sample.completion[0]) % 3) / 2 if sample.completion else 0.0


register_reward("eval_test_graded", overwrite=True)(graded)


def write_eval_file(path, n=5, answers=True):
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 * i + 1, 7 * i + 2
            rec = {"prompt": f"{a}+{b}=", "data_source": SOURCES[i % 2]}
            if answers:
                rec["answer"] = str(a + b)
            f.write(json.dumps(rec) + "\n")
    return str(path)


def eval_overrides(path, **kw):
    base = {"path": path, "every": 2, "before_train": "true", "n": 4, "temperature": 1.0}
    return [f"eval.{k}={v}" for k, v in {**base, **kw}.items()]


BASE = TINY + ["data.task=add", "data.reward=eval_test_graded"]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """3 steps, evaluation before training, every 2 steps and at the end, checkpoints at 2 and 3."""
    d = tmp_path_factory.mktemp("evaluated")
    path = write_eval_file(d / "held_out.jsonl")
    over = BASE + eval_overrides(path) + ["train.checkpoint_every=2"]
    return run(d, "run", over, steps=3), over + [f"train.run_dir={d / 'run'}"]


def test_schedule_files_and_metric_steps(evaluated):
    r, _ = evaluated
    files = sorted(os.listdir(os.path.join(r.run_dir, "eval")))
    assert files == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    with_eval = [m["step"] for m in r.metrics if any(k.startswith("val-core/") for k in m)]
    assert with_eval == [0, 2, 3]
    assert [m["step"] for m in r.metrics] == [0, 1, 2, 3]
    assert not any(k.startswith("actor/") for k in r.metrics[0])  # step 0 is the evaluation alone


def test_metrics_equal_float64_recomputation_from_the_files(evaluated):
    r, _ = evaluated
    by_step = {m["step"]: m for m in r.metrics}
    rewards_seen = set()
    for step in (0, 2, 3):
        lines = read_jsonl(os.path.join(r.run_dir, "eval", f"step_{step}.jsonl"))
        assert [ln["prompt_text"] for ln in lines] == [f"{3 * i + 1}+{7 * i + 2}=" for i in range(5)]
        assert [ln["answer"] for ln in lines] == [str(10 * i + 3) for i in range(5)]
        for ln in lines:  # the scores are the reward of the written completions
            assert len(ln["completions"]) == len(ln["scores"]) == 4
            assert ln["scores"] == [graded(type("S", (), {"completion": c})) for c in ln["completions"]]
            rewards_seen.update(ln["scores"])
        for src in SOURCES:
            s = np.array([ln["scores"] for ln in lines if ln["data_source"] == src], np.float64)
            mean = s.mean(axis=1).mean()
            solved = np.mean([max(row) >= 1.0 for row in s])
            assert by_step[step][f"val-core/{src}/reward/mean@4"] == pytest.approx(mean, rel=0, abs=1e-12)
            assert by_step[step][f"val-core/{src}/reward/pass@4"] == pytest.approx(solved, rel=0, abs=1e-12)
    assert {0.0, 1.0} <= rewards_seen  # the checks above saw unsolved and solved samples
    # at temperature 1 the samples of a prompt differ (the greedy test's positive control)
    lines = read_jsonl(os.path.join(r.run_dir, "eval", "step_0.jsonl"))
    assert any(len(set(ln["completions"])) > 1 for ln in lines)


def test_one_sample_has_mean_only_per_source():
    from rpeg_jax.runtime.evaluation import val_metrics

    got = val_metrics(["a", "b", "a"], np.array([[1.0], [0.5], [0.0]]), 1.0)
    assert got == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 0.5}  # no pass@1


def test_greedy_evaluation_equals_the_greedy_sampler(tmp_path):
    from flax import nnx

    from rpeg_jax.config import load_config
    from rpeg_jax.data.tokenizer import CharTokenizer, completion_ids
    from rpeg_jax.models import Transformer
    from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

    path = write_eval_file(tmp_path / "held_out.jsonl")
    over = BASE + eval_overrides(path, temperature=0.0, n=3, every=0, max_prompts=3)
    r = run(tmp_path, "greedy", over, steps=0)  # step 0 only: the initial policy
    lines = read_jsonl(os.path.join(r.run_dir, "eval", "step_0.jsonl"))
    assert [ln["prompt_text"] for ln in lines] == ["1+2=", "4+9=", "7+16="]  # the file's first 3 of 5
    cfg = load_config(None, over)
    graphdef, _ = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(params=0)), nnx.Param)
    model = nnx.merge(graphdef, r.state["actor"])
    tok = CharTokenizer()
    sampler = Sampler(model, SamplerConfig(max_slots=2, max_seq_len=cfg.data.max_prompt_len + 6))
    prompts = [[tok.bos_id] + tok.encode(ln["prompt_text"]) for ln in lines]
    outs = sampler.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=123))
    want = [tok.decode(completion_ids(o.completions[0].tokens.tolist(), tok.eos_id)) for o in outs]
    for ln, w in zip(lines, want, strict=True):
        assert ln["completions"] == [w, w, w]
    assert any(want)  # not all empty


def _training_only(r):
    """The training records (step >= 1) without the evaluation's metrics."""
    drop = ("val-", "timing_s/testing")
    return [{k: v for k, v in m.items() if not k.startswith(drop)} for m in r.metrics if m["step"]]


@pytest.mark.parametrize(
    "structure",
    [
        ["pipeline.staleness=0"],
        ["pipeline.staleness=1"],
        pytest.param(  # 12 s (session 24's trim); k1 shows evaluation leaves an asynchronous run as it was
            ["pipeline.staleness=1", "rollout.admission=continuous", "rollout.max_slots=24"], marks=pytest.mark.slow
        ),
    ],
    ids=["k0", "k1", "k1-continuous"],
)
def test_evaluation_does_not_perturb_training(tmp_path, structure):
    """Under continuous admission sequences stay in the training engine across step boundaries,
    where the evaluation runs: it must not touch them."""
    from helpers import assert_same_run

    path = write_eval_file(tmp_path / "held_out.jsonl")
    common = BASE + structure
    plain = run(tmp_path, "plain", common, steps=3)
    ev = run(tmp_path, "eval", common + eval_overrides(path, every=1), steps=3)
    assert sorted(os.listdir(os.path.join(ev.run_dir, "eval"))) == [f"step_{s}.jsonl" for s in range(4)]
    if "rollout.admission=continuous" in structure:  # groups were in flight at the boundaries
        assert all(m["rollout/in_flight"] > 0 for m in plain.metrics)
    a, b = plain._replace(metrics=_training_only(plain)), ev._replace(metrics=_training_only(ev))
    assert_same_run(a, b, atol=0)


def test_rpeg_eval_reproduces_the_runs_evaluation(evaluated, tmp_path, capsys):
    r, over = evaluated
    by_step = {m["step"]: m for m in r.metrics}
    for step, args in ((2, ["--step", "2"]), (3, []), (0, ["--step", "0"])):  # no --step: the newest
        out = tmp_path / f"again_{step}.jsonl"
        assert main(["eval", *args, "--out", str(out), *over]) == 0
        printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert printed["step"] == step
        assert read_jsonl(out) == read_jsonl(os.path.join(r.run_dir, "eval", f"step_{step}.jsonl"))
        core = {k: v for k, v in by_step[step].items() if k.startswith("val-core/")}
        assert len(core) == 4 and {k: printed[k] for k in core} == core
    # without --out: beside the run's own record, never over it
    own = os.path.join(r.run_dir, "eval", "step_3.jsonl")
    before = open(own).read()
    assert main(["eval", *over]) == 0
    assert open(own).read() == before
    assert read_jsonl(os.path.join(r.run_dir, "eval", "step_3.rpeg_eval.jsonl")) == read_jsonl(own)


def _one_line_exit_2(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for s in needles:
        assert s in err, err
    return err


def test_bad_inputs_are_one_line_exit_2(evaluated, tmp_path, capsys):
    _, over = evaluated
    bare = write_eval_file(tmp_path / "no_answers.jsonl", answers=False)
    for cmd in ("eval", "train"):
        _one_line_exit_2([cmd, *BASE, *eval_overrides(bare), f"train.run_dir={tmp_path / cmd}"], capsys, bare, "answer")
    assert not os.path.exists(tmp_path / "train")  # refused before anything was written
    _one_line_exit_2(["eval", *over, "eval.n=0"], capsys, "eval.n=0")
    _one_line_exit_2(["eval", "--step", "1", *over], capsys, "--step=1", "checkpoints")
    _one_line_exit_2(["eval", *BASE, f"eval.path={tmp_path / 'none.jsonl'}"], capsys, "eval.path", "not found")
    _one_line_exit_2(["eval", *BASE, "eval.every=2"], capsys, "eval.every=2", "eval.path")


def test_message_prompts_are_evaluated_as_rendered_by_the_chat_template(tmp_path):
    """An instruct checkpoint (model.path, its chat_template.jinja): prompt_text is the template's
    rendering, equal to transformers' apply_chat_template text (tests/fixtures/chat/expected.json)."""
    from fixtures.checkpoint import write_qwen2_checkpoint

    with open(os.path.join(os.path.dirname(__file__), "fixtures", "chat", "expected.json"), encoding="utf-8") as f:
        expected = json.load(f)
    names = ("user", "system_user")
    ckpt = write_qwen2_checkpoint(tmp_path / "ckpt", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    path = tmp_path / "chat_eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": expected["conversations"][n], "answer": "42"}) + "\n" for n in names))
    over = [
        f"model.path={ckpt}",
        "data.task=jsonl",
        f"data.path={path}",
        "data.prompts_per_step=2",
        "data.max_prompt_len=96",
        "rl.group_size=2",
        "rollout.max_new_tokens=4",
        "train.tensorboard=false",
        "train.progress=false",
        "pipeline.plan=manual",
        *eval_overrides(str(path), every=0, n=2),
    ]
    r = run(tmp_path, "chat", over, steps=0)
    lines = read_jsonl(os.path.join(r.run_dir, "eval", "step_0.jsonl"))
    want = [expected["families"]["qwen2_5"]["cases"][n]["generation"]["text"] for n in names]
    assert [ln["prompt_text"] for ln in lines] == want
    by_step = {m["step"]: m for m in r.metrics}
    assert "val-core/chat_eval/reward/pass@2" in by_step[0]
