"""The rollout-vs-trainer logprob gap in bf16 (issue 20): the sampler's logprob of each token it
generated against the trainer's forward logprob of the same token (`token_logprobs` over the
rollout layout), for the tests' tiny model, with model.dtype=bfloat16 / model.param_dtype=float32
(fp32 master weights, bf16 matmuls and KV cache) and the float32 control.

    python bench/bf16_gap.py [--prompts 16] [--samples 4] [--new 24] [--seeds 3]

gap = trainer logprob - sampler logprob per generated token (nats); ratio = exp(gap), the
importance weight π_train/π_behav the learner would see at k = 0 if it took the sampler's
logprobs as π_old (rl.tis_cap / rl.behav_weight_cap bound it). Prints one table row per
(dtype, temperature): tokens, mean |gap|, p99 and max |gap|, mean gap (bias), and the ratio's range.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rpeg_jax.config import model_preset  # noqa: E402
from rpeg_jax.models import init_model, token_logprobs  # noqa: E402
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams  # noqa: E402

CFG = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, max_seq_len=64, min_prefill_len=32, min_prefill_rows=8)


def gaps(model, prompts, params: SamplingParams) -> np.ndarray:
    """Signed trainer - sampler logprob of every generated token (float64, flat)."""
    outs = Sampler(model, CFG).generate(prompts, params)
    rows = [(o.prompt_tokens, c) for o in outs for c in o.completions]
    P, R = max(len(p) for p, _ in rows), max(len(c.tokens) for _, c in rows)
    tok, pos, seg = (np.zeros((len(rows), P + R), np.int32) for _ in range(3))
    behav, mask = np.zeros((len(rows), R)), np.zeros((len(rows), R), bool)
    for i, (p, c) in enumerate(rows):
        n = len(c.tokens)
        tok[i, P - len(p) : P], tok[i, P : P + n] = p, c.tokens
        pos[i, P - len(p) : P + n] = np.arange(len(p) + n)
        seg[i, P - len(p) : P + n] = 1
        behav[i, :n], mask[i, :n] = c.logprobs, True
    targets = np.concatenate([tok[:, 1:], np.zeros((len(tok), 1), np.int32)], axis=1)
    logp, _ = token_logprobs(
        model,
        *(jnp.asarray(x) for x in (tok, pos, seg, targets)),
        start=P - 1,
        length=R,
        temperature=params.temperature,
    )
    assert logp.dtype == jnp.float32
    return (np.asarray(logp, np.float64) - behav)[mask]


def stats(g: np.ndarray) -> dict:
    a = np.abs(g)
    return dict(
        tokens=int(g.size),
        mean_abs=float(a.mean()),
        p99_abs=float(np.quantile(a, 0.99)),
        max_abs=float(a.max()),
        bias=float(g.mean()),
        ratio_min=float(np.exp(g.min())),
        ratio_max=float(np.exp(g.max())),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--seeds", type=int, default=3, help="model seeds (one random tiny model each)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, int(rng.integers(2, 17))).tolist() for _ in range(args.prompts)]
    print(
        f"jax {jax.__version__} on {jax.default_backend()}; tiny model (D=256, L=4, H=4, K=2, V=128), "
        f"{args.prompts} prompts x {args.samples} samples x {args.new} tokens x {args.seeds} model seeds"
    )
    print(f"bf16 eps = {float(jnp.finfo(jnp.bfloat16).eps):.3g}")
    head = f"{'compute':>9} {'T':>4} {'tokens':>6} {'mean|gap|':>10} {'p99|gap|':>9} {'max|gap|':>9}"
    head += f" {'bias':>9} {'exp(gap) range':>18}"
    print(head)
    for dtype in ("bfloat16", "float32"):
        for temp in (1.0, 0.7):
            g = np.concatenate(
                [
                    gaps(
                        init_model(model_preset("tiny", dtype=dtype, param_dtype="float32"), seed=s),
                        prompts,
                        SamplingParams(
                            n=args.samples, temperature=temp, max_new_tokens=args.new, seed=4 + s, ignore_eos=True
                        ),
                    )
                    for s in range(args.seeds)
                ]
            )
            st = stats(g)
            print(
                f"{dtype:>9} {temp:>4} {st['tokens']:>6} {st['mean_abs']:>10.2e} {st['p99_abs']:>9.2e} "
                f"{st['max_abs']:>9.2e} {st['bias']:>+9.1e} {st['ratio_min']:>8.4f}-{st['ratio_max']:.4f}"
            )


if __name__ == "__main__":
    main()
