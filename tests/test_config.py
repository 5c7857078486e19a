"""Configs: every preset under configs/ parses; bad configs are rejected by the real CLI with exit
status 2 and exactly one line on stderr naming the key and the value (no traceback)."""

import glob
import os
import subprocess
import sys

import pytest
import yaml

from rpeg_jax.config import DEFAULT_CONFIG, ConfigError, RunConfig, from_dict, load_config, to_dict
from rpeg_jax.config.run import CONFIG_DIR
from rpeg_jax.costmodel.hardware import HardwareProfile, load_hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAMLS = sorted(glob.glob(os.path.join(CONFIG_DIR, "**", "*.yaml"), recursive=True))
NOT_RUN_CONFIGS = ("hardware",)  # configs/hardware/*.yaml are cost-model hardware profiles


# presets that need what the user gives (a checkpoint, data): the test gives the fixtures'
GIVEN = {
    "finetune.yaml": ["model.path=tests/fixtures/hf/qwen2_tiny", "rollout.max_new_tokens=64", "data.max_prompt_len=32"]
}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: os.path.relpath(p, CONFIG_DIR))
def test_every_preset_parses(path, tmp_path, monkeypatch):
    rel = os.path.relpath(path, CONFIG_DIR)
    with open(path) as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict) and data, f"{rel} must hold a non-empty mapping"
    if rel.split(os.sep)[0] in NOT_RUN_CONFIGS:  # a hardware profile: validated as one
        assert isinstance(load_hardware(path), HardwareProfile)
        return
    given = GIVEN.get(rel, [])
    if given:
        monkeypatch.chdir(os.path.dirname(CONFIG_DIR))  # the fixture paths are relative to the repository
        (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
        given = given + [f"data.path={tmp_path / 'train.jsonl'}"]
    cfg = load_config(path, given)
    assert isinstance(cfg, RunConfig)
    assert from_dict(to_dict(cfg)) == cfg  # the resolved config reloads to itself


def test_presets_resolve_to_what_they_say():
    """No --config means configs/default.yaml; ppo.yaml (`base: default.yaml`) is the default with
    exactly its own keys changed."""
    assert load_config() == load_config(DEFAULT_CONFIG)
    with open(os.path.join(CONFIG_DIR, "ppo.yaml")) as f:
        data = yaml.safe_load(f)
    assert data.pop("base") == os.path.basename(DEFAULT_CONFIG)
    own = [f"{section}.{k}={v}" for section, values in data.items() for k, v in values.items()]
    ppo = load_config(os.path.join(CONFIG_DIR, "ppo.yaml"))
    assert ppo == load_config(None, own) != load_config()
    assert ppo.rl.algorithm == "ppo" and ppo.critic_optim.lr == 1e-3


def test_default_is_the_tiny_model_on_a_builtin_task():
    cfg = load_config()
    m = cfg.model
    assert (
        m.vocab_size,
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.intermediate_size,
        m.max_position_embeddings,
    ) == (128, 4, 256, 4, 2, 768, 512)  # model T of bench/WORKLOADS.md
    assert cfg.data.task in ("add", "copy", "reverse", "sort") and cfg.data.tokenizer is None
    assert load_config(None, ["rl.group_size=4", "optim.lr=3e-4"]).rl.group_size == 4


# (test id, extra CLI args, key the line must name, value text the line must contain, extra text)
BAD = [
    ("unknown-key", ["model.hiden_size=3"], "model.hiden_size", "3", "did you mean 'hidden_size'"),
    ("unknown-section", ["modle.num_layers=2"], "modle", "'num_layers': 2", "did you mean 'model'"),
    ("wrong-type", ["rl.group_size=abc"], "rl.group_size", "'abc'", "must be an integer"),
    ("wrong-type-bool", ["data.shuffle=maybe"], "data.shuffle", "'maybe'", "true or false"),
    ("out-of-range", ["rollout.temperature=-1"], "rollout.temperature", "-1", "must be >= 0"),
    ("infinite-lr", ["optim.lr=inf"], "optim.lr", "inf", "must be a finite number"),  # `lr > 0` alone passed it
    ("nan-float", ["rl.kl_coef=.nan"], "rl.kl_coef", "nan", "must be a finite number"),
    ("table-growth", ["rollout.table_width_growth=1.0"], "rollout.table_width_growth", "1.0", "must be > 1"),
    ("bad-literal", ["data.on_bad_record=ignore"], "data.on_bad_record", "'ignore'", "must be one of"),
    ("heads-not-dividing-hidden", ["model.num_heads=3"], "model.num_heads", "3", "must divide hidden_size=256"),
    ("kv-heads-not-dividing-heads", ["model.num_kv_heads=3"], "model.num_kv_heads", "3", "must divide num_heads"),
    ("grpo-group-size-1", ["rl.algorithm=grpo", "rl.group_size=1"], "rl.group_size", "1", "must be >= 2"),
    (
        "prompt-plus-new-over-max-positions",
        ["rollout.max_new_tokens=600"],
        "rollout.max_new_tokens",
        "600",
        "exceeds model.max_position_embeddings=512",
    ),
    (
        "share-actor-critic-with-grpo",
        ["rl.algorithm=grpo", "pipeline.share_actor_critic=true"],
        "pipeline.share_actor_critic",
        "True",
        "rl.algorithm=ppo",
    ),
    ("split-placement-without-sizes", ["pipeline.placement=split"], "pipeline.split_sizes", "[]", "two positive sizes"),
    ("unknown-model-preset", ["model.preset=huge"], "model.preset", "'huge'", "unknown preset"),
    ("qwen3-without-qk-norm", ["model.arch=qwen3"], "model.qk_norm", "False", "model.arch=qwen3 normalises q and k"),
    ("qk-norm-on-llama", ["model.qk_norm=true"], "model.qk_norm", "True", "needs model.arch=qwen3 (not llama)"),
    (
        "qwen3-with-biases",
        ["model.preset=qwen3-0.6b", "model.qkv_bias=true"],
        "model.qkv_bias",
        "True",
        "model.arch=qwen3 has no q/k/v biases",
    ),
    ("bad-mesh-axis", ["sharding.mesh.pipe=2"], "sharding.mesh.pipe", "2", "unknown mesh axis"),
    ("unknown-task", ["data.task=revers"], "data.task", "'revers'", "did you mean 'reverse'"),
    ("min-over-max-digits", ["data.max_digits=4", "data.min_digits=6"], "data.min_digits", "6", "max_digits=4"),
    ("jsonl-without-path", ["data.task=jsonl"], "data.path", "None", "required when data.task=jsonl"),
    ("override-without-equals", ["rl.group_size"], "rl.group_size", "None", "key.sub=value"),
    ("value-not-section", ["rl.group_size.x=1"], "rl.group_size", "8", "is a value, not a section"),
    ("missing-file", ["--config", "no/such/preset.yaml"], "--config", "'no/such/preset.yaml'", "file not found"),
    ("bad-yaml-file", ["--config", "{BAD_YAML}"], "--config", "bad.yaml", "invalid YAML"),
    ("yaml-not-a-mapping", ["--config", "{LIST_YAML}"], "--config", "list.yaml", "must hold a mapping"),
]


@pytest.fixture(scope="module")
def subst(tmp_path_factory):
    """The bad YAML files of BAD, by placeholder."""
    tmp = tmp_path_factory.mktemp("configs")
    (tmp / "bad.yaml").write_text("model:\n  preset: tiny\n  hidden_size: [256\n")
    (tmp / "list.yaml").write_text("- model\n- data\n")
    return {"{BAD_YAML}": str(tmp / "bad.yaml"), "{LIST_YAML}": str(tmp / "list.yaml")}


@pytest.fixture(scope="module")
def cli_results(subst):
    """Run every bad config through `python -m rpeg_jax.cli config` concurrently (one process each)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {}
    for case_id, args, *_ in BAD:
        args = [subst.get(a, a) for a in args]
        cmd = [sys.executable, "-m", "rpeg_jax.cli", "config"] + args
        procs[case_id] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for case_id, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[case_id] = (p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("case_id,args,key,value,why", BAD, ids=[c[0] for c in BAD])
def test_bad_config_rejected_by_cli(cli_results, case_id, args, key, value, why):
    rc, stdout, stderr = cli_results[case_id]
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, (rc, stderr)
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith(f"config error: {key}="), line  # names the key ...
    assert value in line[len(f"config error: {key}=") :], line  # ... and the value
    assert why in line, line
    assert stdout == ""


@pytest.mark.parametrize("case_id,args,key,value,why", BAD, ids=[c[0] for c in BAD])
def test_bad_config_fails_because_of_its_bad_argument(subst, case_id, args, key, value, why):
    """The positive control of each BAD case: without its last argument (a `--config FILE` pair
    counts as one) the config loads, and with it load_config raises the ConfigError of `key`, so
    the rejection above comes from that argument, not from the rest of the command line."""
    args = [subst.get(a, a) for a in args]
    bad = args[-2:] if args[-2:-1] == ["--config"] else args[-1:]
    good = args[: -len(bad)]
    assert "--config" not in good
    assert isinstance(load_config(None, good), RunConfig)
    with pytest.raises(ConfigError) as e:
        load_config(bad[1], good) if bad[0] == "--config" else load_config(None, good + bad)
    assert e.value.key == key and why in e.value.why, str(e.value)


def test_good_config_through_cli():
    r = subprocess.run(
        [sys.executable, "-m", "rpeg_jax.cli", "config", "rl.group_size=4", "data.task=sort"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    printed = from_dict(yaml.safe_load(r.stdout))
    assert printed == load_config(None, ["rl.group_size=4", "data.task=sort"])


def test_rollout_kv_pool_reaches_the_sampler_and_the_cost_model():
    from rpeg_jax.config import ConfigError
    from rpeg_jax.costmodel.context import make_context
    from rpeg_jax.costmodel.hardware import load_hardware
    from rpeg_jax.sampling.types import SamplerConfig

    for pool in ("sharded", "replicated"):
        cfg = load_config(None, [f"rollout.kv_pool={pool}"])
        assert SamplerConfig.from_rollout(cfg.rollout, max_slots=8).kv_pool == pool
        assert make_context(cfg, 8, load_hardware("gh200", calibrated=False)).st.kv_replicated == (pool == "replicated")
    with pytest.raises(ConfigError, match="rollout.kv_pool"):
        load_config(None, ["rollout.kv_pool=mirrored"])


@pytest.mark.parametrize(
    "override,names",
    [
        ("costmodel.attention=flash", "model.attention"),
        ("costmodel.kv_pool=replicated", "rollout.kv_pool"),
        ("pipeline.microbatches=2", "pipeline.pieces"),
    ],
)
def test_a_removed_key_names_the_key_to_set(override, names):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert "\n" not in msg and override.split("=")[0] in msg and names in msg
