"""SFT on chat transcripts (issue 32 item 6; rpeg_jax/data/sft.py, rpeg_jax/runtime/sft.py).

- The assistant-token mask, token by token, equals transformers' apply_chat_template(...,
  return_assistant_tokens_mask=True) on the Qwen2.5 template with {% generation %} blocks
  (tests/fixtures/make_sft_fixture.py wrote the reference), and the ids are that rendering's.
- The packed SFT loss equals a float64 numpy cross-entropy over the masked targets of each
  conversation run alone (unpacked, its own forward), token-mean over the batch.
- A train.mode=sft run lowers the loss, writes checkpoints that `rpeg export` exports, resumes
  exactly (2+2 steps == 4 steps), and an RL run starts from the export (model.path).
- Bad input is one line naming the key.
"""

import json
import os

import jax
import numpy as np
import pytest
from helpers import TINY

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.data.chat import ChatTemplate
from rpeg_jax.data.jsonl import DataError
from rpeg_jax.data.sft import encode_conversation
from rpeg_jax.data.tokenizer import HFTokenizer
from rpeg_jax.env import Environment, Episode, StepResult

HERE = os.path.dirname(__file__)
QWEN = os.path.join(HERE, "fixtures", "chat", "qwen2_5")
EXPECTED = os.path.join(HERE, "fixtures", "sft", "expected.json")


def cases():
    with open(EXPECTED) as f:
        return json.load(f)["cases"]


def qwen():
    with open(os.path.join(QWEN, "chat_template.jinja")) as f:
        return ChatTemplate("qwen2_5", f.read()), HFTokenizer(os.path.join(QWEN, "tokenizer.json"))


@pytest.mark.parametrize("i", range(5))
def test_mask_equals_transformers_assistant_mask(i):
    template, tok = qwen()
    c = cases()[i]
    ex = encode_conversation(template, tok, c["messages"], c.get("tools"))
    assert list(ex.ids) == c["input_ids"]
    assert list(ex.mask) == c["assistant_masks"]
    assert sum(ex.mask) > 0


def test_mask_control_a_shifted_mask_fails():  # the comparison above can fail: a mask off by one differs
    template, tok = qwen()
    c = cases()[2]
    ex = encode_conversation(template, tok, c["messages"], c.get("tools"))
    assert list(ex.mask[1:]) + [0] != c["assistant_masks"]


def write_transcripts(path, n=24):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for k in range(n):
            c = cases()[k % 5]
            rec = {"messages": c["messages"]}
            if "tools" in c:
                rec["tools"] = c["tools"]
            f.write(json.dumps(rec) + "\n")
    return str(path)


def sft_overrides(tmp_path, *more):
    return [
        *TINY,
        f"data.tokenizer={QWEN}/tokenizer.json",
        "model.vocab_size=512",
        "model.max_position_embeddings=640",
        "model.eos_id=2",
        "model.bos_id=0",
        "model.pad_id=0",
        "train.mode=sft",
        f"sft.path={write_transcripts(tmp_path / 'conv.jsonl')}",
        "sft.max_len=640",
        "sft.batch_size=6",
        "sft.steps=4",
        "sft.lr=3e-3",
        f"train.run_dir={tmp_path / 'sft'}",
        *more,
    ]


def test_packed_loss_equals_float64_numpy_cross_entropy(tmp_path):
    from flax import nnx

    from rpeg_jax.data.tokenizer import load_tokenizer
    from rpeg_jax.models import Transformer
    from rpeg_jax.runtime import sft

    cfg = load_config(None, sft_overrides(tmp_path))
    tok = load_tokenizer(cfg.data)
    examples, _ = sft.load_examples(cfg, tok)
    batch = [examples[i] for i in (0, 1, 2, 3, 4, 1)]  # short ones share rows
    host = sft.pack(batch, 640)
    assert host["tokens"].shape[0] < len(batch)  # packed: fewer rows than conversations
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=3))
    graphdef, state = nnx.split(model)
    # compiled as the trainer compiles it (run eagerly, every op of the loss compiled on its own)
    loss_of = jax.jit(lambda state, batch: sft.sft_loss(nnx.merge(graphdef, state), batch))
    loss, n = loss_of(state, {k: jax.numpy.asarray(v) for k, v in host.items()})

    total, count = 0.0, 0
    # each conversation alone, its own forward, float64 softmax. One compiled forward: each row is
    # right-padded to the longest (causal attention: padding after a token never changes its logits);
    # run eagerly, the model compiled every op once per conversation length (this test: 471 XLA compiles
    # with both eager, 36 with both compiled).
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    width = max(len(e) for e in batch)
    for e in batch:
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(e)] = e.ids
        logits = np.asarray(forward(state, ids)[0, : len(e)], np.float64)  # [L, V]
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for t in range(1, len(e)):
            if e.mask[t]:
                total -= logp[t - 1, e.ids[t]]
                count += 1
    assert int(n) == count == sum(sum(e.mask[1:]) for e in batch)
    np.testing.assert_allclose(float(loss), total / count, rtol=2e-5)


@pytest.mark.slow  # two compiles of the step: ~70 s on the loaded 2-core machine
def test_one_device_and_eight_devices_take_the_same_step(tmp_path):
    """The data-parallel SFT step (rows sharded over 8 devices, parameters replicated) equals the same
    step on one device, to float32 rounding."""
    import dataclasses

    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from rpeg_jax.data.tokenizer import load_tokenizer
    from rpeg_jax.models import Transformer
    from rpeg_jax.rl.optimizer import make_optimizer
    from rpeg_jax.runtime import sft

    assert len(jax.devices()) == 8  # tests/conftest.py
    cfg = load_config(None, sft_overrides(tmp_path))
    examples, _ = sft.load_examples(cfg, load_tokenizer(cfg.data))
    host = sft.pack([examples[i] for i in (0, 1, 0, 1, 0, 1)], 160, 8)  # the two short conversations
    graphdef, params0 = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(params=1)), nnx.Param)
    tx = make_optimizer(dataclasses.replace(cfg.optim, lr=1e-3), 4)
    out = []
    for devices in (jax.devices()[:1], jax.devices()):
        mesh = Mesh(np.asarray(devices), ("data",))
        rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        params = jax.device_put(jax.tree.map(np.asarray, params0), rep)
        opt = jax.device_put(tx.init(params), rep)
        batch = {k: jax.device_put(v, rows) for k, v in host.items()}
        params, opt, m = sft.make_step(graphdef, tx)(params, opt, batch)
        out.append((float(m["sft/loss"]), [np.asarray(x) for x in jax.tree.leaves(params)]))
    (l1, p1), (l8, p8) = out
    np.testing.assert_allclose(l1, l8, rtol=1e-5)
    for a, b in zip(p1, p8):
        np.testing.assert_allclose(a, b, atol=2e-5)


def params_of(state):
    return [np.asarray(x) for x in jax.tree.leaves(state["actor"])]


def test_sft_run_learns_resumes_exactly_and_exports_and_stops_on_loss(tmp_path, monkeypatch):
    from rpeg_jax.runtime import sft
    from rpeg_jax.runtime.export import export
    from rpeg_jax.runtime.metrics import read_metrics

    full = sft.train_sft(load_config(None, sft_overrides(tmp_path / "a")), keep_state=True)
    losses = [m["sft/loss"] for m in read_metrics(os.path.join(tmp_path / "a" / "sft", "metrics.jsonl"))]
    assert len(losses) == 4 and losses[-1] < losses[0], losses

    b = tmp_path / "b"
    sft.train_sft(load_config(None, sft_overrides(b, "sft.checkpoint_every=2", "sft.steps=2")))
    # the same run asked for 4 steps continues from its step-2 checkpoint (schedule: sft.steps=4 both)
    resumed = sft.train_sft(load_config(None, sft_overrides(b)), keep_state=True)
    for x, y in zip(params_of(full["state"]), params_of(resumed["state"])):
        np.testing.assert_array_equal(x, y)  # the batch of a step is a function of the step

    # sft.stop_loss (window 2 here): the run stops at the first step whose last two losses' mean is below
    # the threshold, computed here from the full run's losses (the reference); its losses are the full
    # run's up to there, and run again it trains nothing
    monkeypatch.setattr(sft, "STOP_WINDOW", 2)
    means = [(losses[k - 2] + losses[k - 1]) / 2 for k in (2, 3, 4)]  # after steps 2, 3, 4
    assert means[1] < means[0], means
    thr = (means[0] + means[1]) / 2
    want = next(k for k, m in zip((2, 3, 4), means) if m < thr)
    c = tmp_path / "c"
    stopped = sft.train_sft(load_config(None, sft_overrides(c, f"sft.stop_loss={thr!r}")))
    assert stopped["steps"] == want < 4 and stopped["stopped_on_loss"] and not stopped["interrupted"]
    rows = read_metrics(os.path.join(c, "sft", "metrics.jsonl"))
    assert [m["sft/loss"] for m in rows] == losses[:want]
    assert rows[-1]["sft/loss_recent"] == pytest.approx(means[want - 2], rel=1e-6)
    again = sft.train_sft(load_config(None, sft_overrides(c, f"sft.stop_loss={thr!r}")))
    assert again["steps"] == want and again["stopped_on_loss"]
    assert len(read_metrics(os.path.join(c, "sft", "metrics.jsonl"))) == want

    out = str(tmp_path / "model")
    step, files = export(str(tmp_path / "a" / "sft"), out)
    assert step == 4 and "model.safetensors" in files and "tokenizer.json" in files

    from rpeg_jax.models import load_hf

    loaded = load_hf(out)
    from flax import nnx

    for x, y in zip(
        params_of(full["state"]), [np.asarray(v) for v in jax.tree.leaves(nnx.split(loaded, nnx.Param)[1])]
    ):
        np.testing.assert_array_equal(x, y)  # the export holds the SFT policy


def test_rl_warm_starts_from_an_exported_sft_run(tmp_path):
    from rpeg_jax.runtime import sft
    from rpeg_jax.runtime.export import export

    sft.train_sft(load_config(None, sft_overrides(tmp_path, "sft.steps=1")))
    out = str(tmp_path / "model")
    export(str(tmp_path / "sft"), out)
    from rpeg_jax.runtime.trainer import train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {k}+{k}?", "answer": str(2 * k)}) + "\n" for k in range(8))
    )
    rl = [o for o in TINY if not o.startswith("model.")]
    cfg = load_config(
        None,
        [
            *rl,
            f"model.path={out}",
            "data.task=jsonl",
            f"data.path={prompts}",
            "data.max_prompt_len=64",
            "train.steps=1",
            f"train.run_dir={tmp_path / 'rl'}",
        ],
    )
    assert cfg.model.path == out and cfg.data.tokenizer == os.path.join(out, "tokenizer.json")
    r = train(cfg, keep_state=True)
    assert r["steps"] == 1


def test_sigterm_stops_sft_at_a_step_boundary_with_its_checkpoint(tmp_path):
    import signal

    from rpeg_jax.runtime import sft
    from rpeg_jax.runtime.checkpoint import Checkpointer

    def term_after_two(step, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    out = sft.train_sft(load_config(None, sft_overrides(tmp_path)), on_step=term_after_two)
    assert out["steps"] == 2 and out["interrupted"]
    ckpt = Checkpointer(os.path.join(tmp_path, "sft", "checkpoints"), async_save=False)
    try:
        assert ckpt.all_steps() == [2]
    finally:
        ckpt.close()


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="sft.path"):
        load_config(None, ["train.mode=sft"])
    with pytest.raises(ConfigError, match="sft.max_len"):
        load_config(None, sft_overrides(tmp_path, "sft.max_len=100000"))
    with pytest.raises(ConfigError, match=r"sft.stop_loss.*-0.1"):
        load_config(None, sft_overrides(tmp_path, "sft.stop_loss=-0.1"))
    with pytest.raises(ConfigError, match="train.mode"):
        load_config(None, ["train.mode=sft", "sft.path=x.jsonl", "data.chat_template=none"])


def test_bad_transcripts_name_file_and_line(tmp_path):
    from rpeg_jax.data.sft import read_transcripts

    template, tok = qwen()
    cfg = load_config(None, sft_overrides(tmp_path)).sft
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    import dataclasses

    with pytest.raises(DataError, match=r"bad.jsonl:1: .*no assistant message"):
        read_transcripts(dataclasses.replace(cfg, path=str(p)), template, tok)
    p.write_text("{not json\n" + json.dumps({"messages": cases()[0]["messages"]}) + "\n")
    got, skipped = read_transcripts(dataclasses.replace(cfg, path=str(p), on_bad_record="skip"), template, tok)
    assert len(got) == 1 and skipped["bad_json"] == 1
    p.write_text(json.dumps({"messages": cases()[0]["messages"]}) + "\n")
    with pytest.raises(DataError, match="sft.max_len=10"):
        read_transcripts(dataclasses.replace(cfg, path=str(p), max_len=10, on_bad_record="error"), template, tok)


# ---- the agentic preset's files and the eval file of episodes ----------------------------------
ROOT = os.path.dirname(HERE)
AGENTIC = os.path.join(ROOT, "configs", "agentic")


def test_agentic_files_are_what_make_data_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", os.path.join(AGENTIC, "make_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(n for n in os.listdir(AGENTIC) if n != "make_data.py" and not n.startswith("__"))
    for n in names:
        with open(tmp_path / n, "rb") as a, open(os.path.join(AGENTIC, n), "rb") as b:
            assert a.read() == b.read(), n


def test_agentic_transcript_is_the_episode_rendering(monkeypatch):
    """An SFT transcript of the preset is token for token what an RL episode of the tools environment
    builds when the policy writes the same turns (prompt + turns + observations, env/session.py, the
    calculator run for real), and its mask is 1 on exactly the tokens the policy samples there, plus
    the <|im_end|> after the call (the episode's turn ends at </tool_call>; the template's end of turn
    is then an observation token)."""
    from rpeg_jax.data.chat import load_prompt_format
    from rpeg_jax.data.sft import encode_conversation
    from rpeg_jax.env.runner import EnvRunner

    monkeypatch.chdir(ROOT)  # the preset's paths are relative to the repository
    cfg = load_config(os.path.join(ROOT, "configs", "agentic.yaml"))
    tok = HFTokenizer(cfg.data.tokenizer)
    template = load_prompt_format(cfg.data).template
    runner = EnvRunner.build(cfg, tok)
    with open(cfg.sft.path) as f:
        conv = json.loads(f.readline())
    ex = encode_conversation(template, tok, conv["messages"], conv["tools"])
    user, call, result, answer = conv["messages"]
    s = runner.start({"id": "x", "prompt": user["content"], "answer": answer["content"]})
    out = runner.end_turn(s, tok.encode(call["content"]), "call")
    assert not out.done and tok.decode(out.observation_ids).count(result["content"]) == 1
    out = runner.end_turn(s, tok.encode(answer["content"]) + [tok.eos_id], "stop")
    assert out.done and out.reward == 1.0
    runner.close()
    episode = list(s.prompt_ids) + s.response_ids()
    newline = tok.encode("\n")
    assert list(ex.ids) == episode + newline  # the template's newline after the last <|im_end|>
    sampled = [0] * len(s.prompt_ids) + s.response_mask() + [0]
    diff = [t for t, (a, b) in enumerate(zip(ex.mask, sampled)) if a != b]
    assert len(diff) == 1 and ex.ids[diff[0]] == tok.eos_id and ex.ids[diff[0] - 1] == tok.encode("</tool_call>")[0]


class TwoTurns(Environment):
    """A tool result after the first turn, reward 0.5 after the second (the eval file test's)."""

    def start(self, record):
        return TwoTurnsEpisode(record, self.prompt_messages(record))


class TwoTurnsEpisode(Episode):
    def respond(self, turn):
        if self.stats.turns >= 2:
            return StepResult(reward=0.5, done=True)
        return StepResult(observations=({"role": "tool", "content": "7"},))


def test_evaluation_with_an_environment_writes_the_turns(tmp_path, monkeypatch):
    """eval/step_N.jsonl of a run with an environment: per sample the messages its episode added (the
    assistant's turns and the tool result between them), scored by the episode's reward."""
    from flax import nnx
    from jax.sharding import Mesh

    from rpeg_jax.models import Transformer
    from rpeg_jax.runtime.evaluation import Evaluator

    monkeypatch.chdir(ROOT)
    cfg = load_config(
        os.path.join(ROOT, "configs", "agentic.yaml"),
        [
            *[o for o in TINY if o.split("=")[0].split(".")[0] in ("model",)],
            "env.name=test_sft:TwoTurns",
            "env.tools=[]",
            "rollout.stop_token_ids=[0]",  # the model below writes only id 0: every turn is one token
            "eval.max_prompts=3",
            "eval.n=2",
            "eval.temperature=0",
            f"train.run_dir={tmp_path}",
        ],
    )
    ev = Evaluator.for_run(cfg)
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=0))
    model.lm_head[...] = np.zeros(model.lm_head.shape, np.float32)  # all logits 0: greedy writes id 0
    graphdef, params = nnx.split(model, nnx.Param)
    ev.on(graphdef, Mesh(np.asarray(jax.devices()[:1]), ("data",)), lambda p: p)
    m = ev.run(5, params)
    assert m["val-core/eval/reward/mean@2"] == 0.5 and m["val-aux/env/turns/mean"] == 2.0, m
    with open(os.path.join(tmp_path, "eval", "step_5.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    assert len(lines) == 3
    for line in lines:
        assert line["scores"] == [0.5, 0.5] and len(line["episodes"]) == 2
        for ep in line["episodes"]:
            assert [msg["role"] for msg in ep] == ["assistant", "tool", "assistant"]
            assert ep[1]["content"] == "7"


@pytest.mark.slow  # ~1-3 min on 2 cores: SFT, an export, an RL step on tool episodes, an evaluation
def test_sft_then_rl_runs_the_agentic_preset_end_to_end(tmp_path, monkeypatch):
    """configs/agentic.yaml as `make run` runs it (train.mode=sft_then_rl), cut to a model and steps a
    test can afford: SFT in <run_dir>/sft, its export in <run_dir>/sft/model, RL from that export on
    tool episodes in <run_dir>/rl, and the RL eval file with the episodes' turns."""
    from rpeg_jax.cli.train import train

    monkeypatch.chdir(ROOT)
    small = [o for o in TINY if o.startswith("model.")]
    cfg = load_config(
        os.path.join(ROOT, "configs", "agentic.yaml"),
        [
            *small,
            "sft.steps=2",
            "sft.batch_size=4",
            "train.steps=1",
            "data.prompts_per_step=2",
            "rl.group_size=2",
            "eval.max_prompts=2",
            "eval.every=1",
            "eval.before_train=false",
            "train.progress=false",
            "train.tensorboard=false",
            f"train.run_dir={tmp_path}",
        ],
    )
    rc, result = train(cfg)
    assert rc == 0 and result["steps"] == 1 and result["sft"]["steps"] == 2
    assert os.path.isfile(os.path.join(tmp_path, "sft", "model", "model.safetensors"))
    rl = load_config(os.path.join(tmp_path, "rl", "config.yaml"))
    assert rl.model.path == os.path.join(str(tmp_path), "sft", "model") and rl.train.mode == "rl"
    with open(os.path.join(tmp_path, "rl", "metrics.jsonl")) as f:
        m = json.loads(f.readline())
    assert m["env/turns/mean"] >= 1 and "val-core/eval/reward/mean@1" in m
    with open(os.path.join(tmp_path, "rl", "eval", "step_1.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    assert len(lines) == 2 and all(ep and ep[0]["role"] == "assistant" for x in lines for ep in x["episodes"])
