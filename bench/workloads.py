"""The RL workloads of bench/WORKLOADS.md as config overrides, in one place: bench/rl_step.py runs
R1 and R2 on one process, bench/r2_mp.py runs R2 on two (R2-MP). Imports nothing (no JAX), so a
script that sets up its own devices can import it first."""

R1 = [
    "data.task=add",
    "data.min_digits=2",
    "data.max_digits=2",
    "data.prompts_per_step=16",
    "rl.group_size=8",
    "rollout.max_new_tokens=32",
    "rollout.temperature=1.0",
    "optim.lr=1e-4",
    "optim.warmup_steps=0",
    "model.preset=tiny",
    "pipeline.plan=manual",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.tensorboard=false",
    "train.resume=never",
]
WORKLOADS = {
    "R1-a": ["rl.algorithm=grpo", "rl.kl_coef=0.0"],
    "R1-b": ["rl.algorithm=grpo", "rl.kl_coef=0.04"],
    "R1-c": ["rl.algorithm=ppo", "rl.kl_coef=0.0"],
    # R1-a with a long tail: every sequence ignores eos and stops at its own length, lognormal
    # (median 24, sigma 1.0) clipped to [4, 256] (runtime/rollout/continuous.forced_lengths). The update packs
    # its sequences (train.pack_sequences, verl's use_remove_padding): padded to the 256 cap, the
    # update alone took ~2/3 of the async step (session 11), which no asynchrony hides. The sampler's
    # page-table width buckets grow by 1.25, not 2: every slot's table is read to the bucket above the
    # longest sequence in flight, and with the tail always in flight a 2x bucket reads ~1.4x the
    # columns it needs (session 17: generation -11% at k = 1, -16% at k = 2, -2% sync).
    "R2": [
        "rl.algorithm=grpo",
        "rl.kl_coef=0.0",
        "rollout.max_new_tokens=256",
        "rollout.forced_lengths=[24,1.0,4,256]",
        "train.pack_sequences=true",
        "rollout.table_width_growth=1.25",
    ],
}
