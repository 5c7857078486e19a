"""Algorithm builders: a RunConfig -> the synchronous RPEG of one RL step (GRPO or PPO).

Called by `rpeg graph`, the planner (costmodel) and the runtime. The built graph is the plain
synchronous, colocated, unfused form; graph/passes.py rewrites it per `cfg.pipeline`.

Sizes (Graph.sizes): N prompts per step, G group size, B = N*G sequences, P prompt length
(data.max_prompt_len), R response length (rollout.max_new_tokens), S = P + R.
GRPO: generate, reward, [ref_forward when β > 0], old_forward, advantage, actor_update,
weight_sync. PPO adds critic_forward and critic_update (and the critic's state).
"""

from __future__ import annotations

from rpeg_jax.config.model import ModelConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.graph.ir import (
    DataNode,
    DataSpec,
    Graph,
    GraphError,
    ModelDims,
    Op,
    Stage,
    StageKind,
    StageOptions,
    StateKind,
    StateNode,
    Workload,
)

K = StageKind
ADAM_STATE_BYTES = 8  # m and v in float32 per parameter


def model_dims(m: ModelConfig, role: str, value_head: bool | None = None) -> ModelDims:
    vh = m.value_head if value_head is None else value_head
    n = m.num_params() + ((m.hidden_size + 1) if vh and not m.value_head else 0)
    return ModelDims(
        role=role,
        num_params=n,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_size,
        intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size,
        param_dtype=m.param_dtype,
        dtype=m.dtype,
        value_head=vh,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok if m.num_experts else 0,
        expert_size=m.expert_size if m.num_experts else 0,
        sparse_layers=sum(m.sparse_layers),
    )


def sizes_of(cfg: RunConfig) -> dict[str, int]:
    n, gs = cfg.data.prompts_per_step, cfg.rl.group_size
    p, r = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    return {"N": n, "G": gs, "B": n * gs, "P": p, "R": r, "S": p + r}


# data node name -> (dims, dtype, logical axes)
DATA = {
    "completions": (("B", "S"), "int32", ("batch", "seq")),  # prompt + response tokens
    "behav_logp": (("B", "R"), "float32", ("batch", None)),  # sampler's logprobs (π_behav)
    "old_logp": (("B", "R"), "float32", ("batch", None)),  # proximal / old policy (π_old)
    "ref_logp": (("B", "R"), "float32", ("batch", None)),
    "values": (("B", "R"), "float32", ("batch", None)),
    "rewards": (("B",), "float32", ("batch",)),
    "advantages": (("B", "R"), "float32", ("batch", None)),
    "returns": (("B", "R"), "float32", ("batch", None)),
}


def spec(name: str, sizes: dict[str, int]) -> DataSpec:
    dims, dtype, axes = DATA[name]
    return DataSpec(dims, tuple(sizes[d] for d in dims), dtype, axes)


class _Builder:
    """Small helper so each builder reads as a list of stages with their ports."""

    def __init__(self, cfg: RunConfig, algorithm: str):
        self.cfg, self.sizes = cfg, sizes_of(cfg)
        self.g = Graph(
            sizes=self.sizes, attrs={"algorithm": algorithm, "staleness": 0, "placement": "colocated", "passes": []}
        )
        self.actor = model_dims(cfg.model, "actor")

    def work(self, op: Op, models=(), **kw) -> Workload:
        s = self.sizes
        return Workload(
            op=op, models=tuple(models), n_seqs=s["B"], prompt_len=s["P"], response_len=s["R"], group_size=s["G"], **kw
        )

    def state(self, kind: StateKind, nbytes: int = 0, **kw) -> None:
        self.g.add(StateNode(kind.value, kind, bytes=nbytes, **kw))

    def stage(
        self,
        kind: StageKind,
        work: Workload,
        reads=(),
        writes=(),
        ins=(),
        outs=(),
        options: StageOptions = StageOptions(),
    ):
        """reads: (state, offset); writes: states (at t+1); ins/outs: data node names."""
        g = self.g
        g.add(Stage(kind.value, kind, workload=work, options=options))
        for st, off in reads:
            g.connect(st, kind.value, offset=off)
        for st in writes:
            g.connect(kind.value, st, offset=1)
        for d in outs:
            g.add(DataNode(d, spec(d, self.sizes)))
            g.connect(kind.value, d, port=d)
        for d in ins:
            g.connect(d, kind.value, port=d, expect=spec(d, self.sizes))


def build_graph(cfg: RunConfig) -> Graph:
    """The synchronous RPEG for `cfg.rl.algorithm`, validated."""
    if cfg.rl.algorithm == "grpo":
        return build_grpo(cfg)
    if cfg.rl.algorithm == "ppo":
        return build_ppo(cfg)
    raise GraphError("rl.algorithm", f"no builder for {cfg.rl.algorithm!r} (grpo | ppo)")


def build_grpo(cfg: RunConfig) -> Graph:
    """GRPO: group-normalised advantages, no critic; reference forward only when β > 0."""
    b = _common(cfg, "grpo", critic=False)
    return _finish(b)


def build_ppo(cfg: RunConfig) -> Graph:
    """PPO: critic forward for values, GAE advantages and returns, critic update; reference."""
    b = _common(cfg, "ppo", critic=True)
    return _finish(b)


def _common(cfg: RunConfig, algorithm: str, critic: bool) -> _Builder:
    b, rl = _Builder(cfg, algorithm), cfg.rl
    actor, use_ref = b.actor, rl.kl_coef > 0
    b.state(StateKind.ACTOR, actor.param_bytes)
    b.state(StateKind.ACTOR_OPT, actor.num_params * ADAM_STATE_BYTES)
    b.state(StateKind.ROLLOUT_WEIGHTS, actor.param_bytes)
    b.state(StateKind.DATA_ITERATOR)
    b.stage(
        K.GENERATE,
        b.work(Op.GENERATE, [actor], heads=("logp",)),
        reads=[("rollout_weights", 0), ("data_iterator", 0)],
        writes=["data_iterator"],
        outs=["completions", "behav_logp"],
    )
    b.stage(K.REWARD, b.work(Op.HOST), ins=["completions"], outs=["rewards"])
    if use_ref:
        ref = model_dims(cfg.model, "reference")
        b.state(StateKind.REFERENCE, ref.param_bytes, frozen=True)
        b.stage(
            K.REF_FORWARD,
            b.work(Op.FORWARD, [ref], heads=("logp",)),
            reads=[("reference", 0)],
            ins=["completions"],
            outs=["ref_logp"],
        )
    b.stage(
        K.OLD_FORWARD,
        b.work(Op.FORWARD, [actor], heads=("logp",)),
        reads=[("actor", 0)],
        ins=["completions"],
        outs=["old_logp"],
    )
    adv_ins, adv_outs = ["completions", "rewards"], ["advantages"]
    if critic:
        cdims = model_dims(cfg.critic_model, "critic")
        b.state(StateKind.CRITIC, cdims.param_bytes)
        b.state(StateKind.CRITIC_OPT, cdims.num_params * ADAM_STATE_BYTES)
        b.stage(
            K.CRITIC_FORWARD,
            b.work(Op.FORWARD, [cdims], heads=("values",)),
            reads=[("critic", 0)],
            ins=["completions"],
            outs=["values"],
        )
        adv_ins.append("values")
        adv_outs.append("returns")
        if rl.kl_in_reward and use_ref:
            adv_ins += ["old_logp", "ref_logp"]
    b.stage(K.ADVANTAGE, b.work(Op.ELEMENTWISE), ins=adv_ins, outs=adv_outs)
    upd_ins = ["completions", "old_logp", "advantages"]
    if rl.tis_cap is not None:
        upd_ins.append("behav_logp")
    if use_ref and not rl.kl_in_reward:
        upd_ins.append("ref_logp")
    heads = ("logp", "entropy") if rl.entropy_coef > 0 else ("logp",)
    train = dict(epochs=rl.ppo_epochs, minibatches=rl.minibatches)
    b.stage(
        K.ACTOR_UPDATE,
        b.work(Op.TRAIN, [actor], heads=heads, **train),
        reads=[("actor", 0), ("actor_opt", 0)],
        writes=["actor", "actor_opt"],
        ins=upd_ins,
        options=StageOptions(tis=rl.tis_cap is not None),
    )
    if critic:
        b.stage(
            K.CRITIC_UPDATE,
            b.work(Op.TRAIN, [cdims], heads=("values",), **train),
            reads=[("critic", 0), ("critic_opt", 0)],
            writes=["critic", "critic_opt"],
            ins=["completions", "values", "returns"],
        )
    return b


def _finish(b: _Builder) -> Graph:
    b.stage(
        K.WEIGHT_SYNC,
        b.work(Op.TRANSFER, [b.actor], bytes_moved=b.actor.param_bytes),
        reads=[("actor", 1)],
        writes=["rollout_weights"],
    )
    return b.g.validate()
