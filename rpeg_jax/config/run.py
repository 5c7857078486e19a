"""The run config: all sections composed, loaded from YAML presets plus `a.b=c` overrides.

    cfg = load_config("configs/default.yaml", ["rl.kl_coef=0.04", "train.steps=10"])

Presets may name a base with `base: other.yaml` (resolved relative to the file). `model.path`
(`critic.path`) fills that section from the checkpoint's config.json (config/hf.py) before
validation. Validation is complete before anything is compiled; errors are `ConfigError` (one
line: key and value).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from rpeg_jax.config.base import ConfigError, build, check, suggest, to_dict
from rpeg_jax.config.costmodel import CostModelConfig
from rpeg_jax.config.data import DataConfig
from rpeg_jax.config.distributed import DistributedConfig
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.config.eval import EvalConfig
from rpeg_jax.config.hf import resolve_checkpoint
from rpeg_jax.config.model import LoraConfig, ModelConfig, resolve_preset
from rpeg_jax.config.optim import OptimConfig
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.registry import load_plugins
from rpeg_jax.config.rl import RLConfig
from rpeg_jax.config.rollout import RolloutConfig
from rpeg_jax.config.sft import SFTConfig
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.config.train import TrainConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.yaml")


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")  # a dotted module name


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig | None = None  # PPO critic shape; None -> the actor's shape with a value head
    data: DataConfig = field(default_factory=DataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic_optim: OptimConfig | None = None  # None -> optim
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    costmodel: CostModelConfig = field(default_factory=CostModelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # the episode's environment and tools (agentic RL)
    sft: SFTConfig = field(default_factory=SFTConfig)  # supervised fine-tuning (train.mode=sft / sft_then_rl)
    plugins: tuple[str, ...] = ()  # the user's modules, imported when the config is loaded: they register
    #   rewards, sharding rules and tactics, environments, tools and kernels (config/registry.py)

    def validate(self, path: str = "") -> None:
        """Checks that span sections (each section validated itself already)."""
        m, r, d, p = self.model, self.rl, self.data, self.pipeline
        need = d.max_prompt_len + self.rollout.max_new_tokens
        check(
            need <= m.max_position_embeddings,
            "rollout.max_new_tokens",
            self.rollout.max_new_tokens,
            f"data.max_prompt_len + rollout.max_new_tokens = {need} exceeds "
            f"model.max_position_embeddings={m.max_position_embeddings}",
        )
        check(
            not (m.num_experts > 0 and self.sharding.axis_types == "explicit"),
            "sharding.axis_types",
            self.sharding.axis_types,
            "a mixture of experts (model.num_experts > 0) runs with auto axis types only: its token sort "
            "over the batch-sharded tokens has no explicit layout (models/moe.py)",
        )
        batch = d.prompts_per_step * r.group_size
        if r.forward_micro_batches > 1 and batch % p.pieces == 0:  # pieces: checked by the graph pass
            piece = batch // p.pieces
            check(
                piece % r.forward_micro_batches == 0,
                "rl.forward_micro_batches",
                r.forward_micro_batches,
                f"a scoring forward's batch of {piece} sequences (data.prompts_per_step x rl.group_size"
                + (f" / pipeline.pieces={p.pieces}" if p.pieces > 1 else "")
                + ") does not split into that many equal micro-batches",
            )
        if self.env.name == "tools":
            check(
                d.chat_template != "none",
                "env.name",
                self.env.name,
                "tool calls and results are rendered by the chat template; data.chat_template=none gives none",
            )
        if self.env.name != "single_turn":  # runtime/rollout/episodes.py, continuous.py
            check(
                r.filter_groups == "none",
                "env.name",
                self.env.name,
                "multi-turn episodes run without rl.filter_groups (for now)",
            )
        if self.train.mode != "rl":
            check(
                self.sft.path is not None,
                "sft.path",
                None,
                f"train.mode={self.train.mode} trains on chat transcripts: give their JSONL file",
            )
            check(
                d.chat_template != "none",
                "train.mode",
                self.train.mode,
                "SFT renders conversations with the chat template; data.chat_template=none gives none",
            )
            check(
                self.sft.max_len <= m.max_position_embeddings,
                "sft.max_len",
                self.sft.max_len,
                f"exceeds model.max_position_embeddings={m.max_position_embeddings}",
            )
        if p.share_actor_critic:
            check(r.algorithm == "ppo", "pipeline.share_actor_critic", True, "needs a critic: set rl.algorithm=ppo")
        if self.rollout.admission == "continuous":
            check(
                p.staleness >= 1,
                "rollout.admission",
                "continuous",
                "sequences run on across weight updates, so it needs a staleness bound: set pipeline.staleness >= 1",
            )
            check(
                p.pieces == 1,
                "rollout.admission",
                "continuous",
                f"a step's batch is the first groups to complete; pipeline.pieces={p.pieces} "
                f"(streamed pieces) needs admission=step",
            )
        if self.rollout.decode_ahead and self.pipeline.plan != "auto":  # (auto: the planner offers split plans only)
            check(
                p.placement == "split",
                "rollout.decode_ahead",
                True,
                f"overlaps generation with the update on disjoint device groups: needs pipeline.placement=split "
                f"(placement={p.placement})",
            )
        for sid in self.rollout.stop_token_ids:
            check(
                0 <= sid < m.vocab_size,
                "rollout.stop_token_ids",
                sid,
                f"must be in [0, model.vocab_size={m.vocab_size})",
            )
        if r.overlong == "soft_penalty":
            check(
                r.overlong_buffer < self.rollout.max_new_tokens,
                "rl.overlong_buffer",
                r.overlong_buffer,
                f"must be < rollout.max_new_tokens={self.rollout.max_new_tokens} (the penalty ramps over the "
                f"last overlong_buffer tokens before the cap)",
            )
        if r.kl_in_reward:
            check(
                r.algorithm == "ppo",
                "rl.kl_in_reward",
                True,
                "per-token KL in the reward needs GAE: set rl.algorithm=ppo",
            )
        if p.elide_old_forward and p.staleness > 0:
            check(
                False,
                "pipeline.elide_old_forward",
                True,
                f"with pipeline.staleness={p.staleness} the proximal policy must be recomputed",
            )
        if m.lora.rank:
            check(
                not p.share_actor_critic,
                "model.lora.rank",
                m.lora.rank,
                "a shared actor-critic backbone trains its value head in full; LoRA needs a separate critic "
                "(pipeline.share_actor_critic=false)",
            )
            check(
                self.train.offload != "optimizer+reference",
                "train.offload",
                self.train.offload,
                "with model.lora the reference is the actor's frozen base, already on the device; "
                "use train.offload=optimizer",
            )
        if self.critic is not None:
            check(
                self.critic.lora.rank == 0,
                "critic.lora.rank",
                self.critic.lora.rank,
                "LoRA trains the actor only (model.lora); the critic trains in full",
            )
        if self.train.offload == "optimizer+reference":  # the reference exists only with β > 0
            check(
                r.kl_coef > 0,
                "train.offload",
                self.train.offload,
                "there is no reference model to offload with rl.kl_coef=0; use train.offload=optimizer",
            )
        if self.train.pack_sequences:
            check(
                self.sharding.axis_types != "explicit",
                "train.pack_sequences",
                True,
                "packing gathers rows across the batch, which sharding.axis_types=explicit does not "
                "support yet; use sharding.axis_types=auto or train.pack_sequences=false",
            )
        self._check_moe()
        self._check_one_step_rewrites()

    def _check_moe(self) -> None:
        """rl.router_aux_loss / rl.routing act on a Qwen3-MoE model's routers, through the update's
        forward (plain or packed), from the single-turn sampler's records."""
        m, r = self.model, self.rl
        moe = m.num_experts > 0
        if r.router_aux_loss > 0:
            why = "the load-balancing loss needs a mixture-of-experts model (model.num_experts > 0)"
            check(moe, "rl.router_aux_loss", r.router_aux_loss, why)
        if r.routing == "replay":
            why = "routing replay needs a mixture-of-experts model (model.num_experts > 0)"
            check(moe, "rl.routing", r.routing, why)
            why = "the multi-turn episode driver records no experts yet: routing replay needs env.name=single_turn"
            check(self.env.name == "single_turn", "rl.routing", r.routing, why)
        self._check_expert_split()

    def _check_expert_split(self) -> None:
        """A rule set that splits the experts over mesh axes (sharding.train_rules /
        generate_rules = fsdp_expert, ...) needs the product of those axes' sizes to divide
        model.num_experts; checked here for the sizes the config fixes (an axis of -1 is checked
        when its mesh is resolved, runtime/placement.py)."""
        from rpeg_jax.config.sharding import expert_axes

        s, x = self.sharding, self.model.num_experts
        if x <= 0:
            return
        gen_key = "sharding.generate_mesh" if s.generate_mesh else "sharding.mesh"
        for rules_key, rules, mesh_key, mesh in (
            ("sharding.train_rules", s.train_rules, "sharding.mesh", s.mesh),
            ("sharding.generate_rules", s.generate_rules, gen_key, s.generate_mesh or s.mesh),
        ):
            axes = expert_axes(rules, s) or ()
            sizes = [mesh.get(a, 1) for a in axes]
            if not axes or -1 in sizes:
                continue
            ways = 1
            for n in sizes:
                ways *= n
            check(
                x % ways == 0,
                f"{mesh_key}.{axes[0]}" if len(axes) == 1 else mesh_key,
                sizes[0] if len(axes) == 1 else dict(mesh),
                f"{rules_key}={rules} splits the model.num_experts={x} experts over {'x'.join(axes)} = {ways} "
                f"devices (expert parallelism): must divide {x}",
            )

    def _check_one_step_rewrites(self) -> None:
        """pipeline.proximal_from_update / values_from_critic_update are exact only when the update
        takes ONE optimizer step per batch (its first forward is at the scoring pass's parameters)."""
        p, r = self.pipeline, self.rl
        for knob in ("proximal_from_update", "values_from_critic_update"):
            if not getattr(p, knob):
                continue
            for name in ("ppo_epochs", "minibatches"):
                v = getattr(r, name)
                check(
                    v == 1,
                    f"rl.{name}",
                    v,
                    f"pipeline.{knob}=true needs one optimizer step per batch "
                    f"(rl.ppo_epochs=1 and rl.minibatches=1); set it to 1 or turn the rewrite off",
                )
        if p.proximal_from_update:
            check(
                not p.elide_old_forward,
                "pipeline.proximal_from_update",
                True,
                "pick one source of π_old: pipeline.elide_old_forward (sampler's logprobs) or this",
            )
            check(
                not (r.kl_in_reward and r.kl_coef > 0),
                "pipeline.proximal_from_update",
                True,
                "rl.kl_in_reward needs π_old before the advantages (it is known only inside the update)",
            )
        if p.values_from_critic_update:
            check(
                r.algorithm == "ppo", "pipeline.values_from_critic_update", True, "needs a critic: set rl.algorithm=ppo"
            )
            if p.share_actor_critic:  # the shared update computes the advantages inside its loss
                check(
                    p.elide_old_forward or p.proximal_from_update,
                    "pipeline.values_from_critic_update",
                    True,
                    "with a shared backbone the values ride on old_forward; drop it first "
                    "(pipeline.proximal_from_update or elide_old_forward)",
                )
                check(
                    r.micro_batches == 1 or not r.whiten_advantages,
                    "rl.micro_batches",
                    r.micro_batches,
                    "a shared backbone's values rewrite whitens advantages per micro-batch; "
                    "use rl.micro_batches=1 or rl.whiten_advantages=false",
                )
            check(
                r.advantage_estimator == "gae",
                "pipeline.values_from_critic_update",
                True,
                f"the values feed GAE; rl.advantage={r.advantage_estimator!r}",
            )

    @property
    def critic_model(self) -> ModelConfig:
        base = self.critic if self.critic is not None else self.model
        return dataclasses.replace(base, value_head=True, lora=LoraConfig())  # the critic trains in full


def parse_value(text: str) -> Any:
    """A command-line override's value, read as YAML (numbers, bools, lists, null)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set `data[a][b]... = value` for dotted key 'a.b...' (creating mappings as needed)."""
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, "is a value, not a section")
        node = child
    node[parts[-1]] = value


def read_yaml(path: str, _seen: tuple[str, ...] = ()) -> dict:
    """Load a preset (yaml.safe_load), following `base:` chains."""
    if not os.path.exists(path) and os.path.exists(os.path.join(CONFIG_DIR, path)):
        path = os.path.join(CONFIG_DIR, path)
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "file not found")
    if path in _seen:
        raise ConfigError("base", path, "circular base chain")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError("--config", path, f"invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "must hold a mapping of sections")
    base = data.pop("base", None)
    if base is None:
        return data
    parent = read_yaml(os.path.join(os.path.dirname(path), base), _seen + (path,))
    return merge(parent, data)


def merge(a: dict, b: dict) -> dict:
    """Deep-merge b over a."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_dict(data: dict) -> RunConfig:
    """Build and validate a RunConfig from nested dicts (presets resolved)."""
    data = dict(data)
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    for name in data:
        if name not in sections:
            raise ConfigError(name, data[name], "unknown section" + suggest(name, sections))
    for name in ("model", "critic"):  # a checkpoint path defines the shape, else a preset may
        if isinstance(data.get(name), dict):
            given = data[name]
            data[name] = (
                resolve_checkpoint(given, name) if given.get("path") is not None else resolve_preset(given, name)
            )
    data = _checkpoint_tokenizer(data)
    cfg = build(RunConfig, data)
    for i, mod in enumerate(cfg.plugins):
        check(bool(_MODULE.match(mod)), f"plugins[{i}]", mod, "must be a dotted module name")
    load_plugins(cfg.plugins)  # before anything looks a registered name up
    if cfg.data.task == "jsonl" and "max_prompt_len" not in (data.get("data") or {}):
        cfg = _jsonl_prompt_len(cfg)
    return cfg


JSONL_PROMPT_LEN = 512  # verl's data.max_prompt_length default


def _jsonl_prompt_len(cfg: RunConfig) -> RunConfig:
    """data.max_prompt_len not given for a JSONL file (not read at config time): 512 tokens (verl's
    default), or what the model's positions leave beside rollout.max_new_tokens if fewer. Prompts
    are padded to the batch's longest, so a generous bound costs only the sampler's page budget."""
    room = cfg.model.max_position_embeddings - cfg.rollout.max_new_tokens
    n = max(1, min(JSONL_PROMPT_LEN, room))
    out = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_len=n))
    out.validate()
    return out


def _checkpoint_tokenizer(data: dict) -> dict:
    """data.tokenizer not given and model.path holds a tokenizer.json: that one (a checkpoint's
    tokenizer belongs to its embeddings; the built-in character tokenizer does not)."""
    model, section = data.get("model") or {}, data.get("data") or {}
    path = model.get("path") if isinstance(model, dict) else None
    if path is None or not isinstance(section, dict) or section.get("tokenizer") is not None:
        return data
    file = os.path.join(str(path), "tokenizer.json")
    return {**data, "data": {**section, "tokenizer": file}} if os.path.isfile(file) else data


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML preset (default: configs/default.yaml) + `key.sub=value` overrides -> RunConfig."""
    data = read_yaml(path or DEFAULT_CONFIG)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, None, "overrides are key.sub=value")
        dotted, text = item.split("=", 1)
        apply_override(data, dotted.strip(), parse_value(text))
    return from_dict(data)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
