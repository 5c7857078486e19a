"""Per-program XLA options for the training / scoring stage programs (opt-in; CPU only).

    from rpeg_jax.runtime import xla_flags
    jax.jit(fn, compiler_options=xla_flags.train_compiler_options())

Why: on the 2-core CPU box XLA:CPU's YNNPACK fusions (on by default in JAX 0.10) run the training
programs' GEMMs ([4096, 256] x [256, 768] and their gradients) at ~150 GFLOP/s against ~260 for
Eigen's, but the sampler's decode GEMVs are much faster with them (G1-T-greedy 9.4-11.6k tok/s with
YNNPACK, 6.4-8.5k with it off process-wide). So YNNPACK can be turned off per program, for the
stage programs graph/compile.py jits (updates, logprob / value / reference passes), while the
sampler keeps XLA's defaults. Measured on 2026-11-30 (bench/NOTES.md, R1), 5 interleaved pairs:
the reference pass faster in 5 of 5 (0.20 -> 0.16 s), R1-b in 4 of 5 (median 1.18 -> 1.12 s),
R1-a in 3 of 5 (0.97 -> 0.96 s); the update program alone in 6 of 7 pairs (one process). Not a
win in every pair, so it is opt-in, not a default:

    RPEG_TRAIN_NO_YNN=1     turn YNNPACK off in the stage programs (CPU backend only)

`train_compiler_options()` returns {} (XLA's defaults) unless RPEG_TRAIN_NO_YNN=1 and the default
backend is the CPU; also {} when XLA_FLAGS names the flag (a process-wide choice wins). A
process-wide `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` also slows the sampler down
(see the numbers above), which is why there is no process-wide default here.

Called by: runtime/setup.py (RuntimeContext.compiler_options, passed to graph/compile.py's jit).
"""

from __future__ import annotations

import os

YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"  # empty value: no YNNPACK fusions (Eigen dots)
OPT_IN = "RPEG_TRAIN_NO_YNN"


def train_compiler_options(env=None) -> dict[str, str]:
    """{XLA DebugOptions field: value} for the stage programs; {} = XLA's defaults (see above)."""
    env = os.environ if env is None else env
    if env.get(OPT_IN, "0") != "1":
        return {}
    named = {tok.split("=", 1)[0].lstrip("-") for tok in env.get("XLA_FLAGS", "").split()}
    if YNN_FLAG in named:
        return {}
    import jax

    return {YNN_FLAG: ""} if jax.default_backend() == "cpu" else {}
