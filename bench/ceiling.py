"""Ceilings: the highest `limit_fraction` G1 and R1 could reach on this machine if everything but
the matrix products (and, for the bandwidth-bound S, the weight reads) cost nothing.

    python bench/ceiling.py --json out.json [--reps 7] [--workloads G1-T-greedy,G1-T-grpo,G1-S-greedy,R1-a]

Why: bench/generate.py and bench/rl_step.py report the fraction of the machine's limit a whole run
reaches (the targets this project aims at: 75% on G1-T and G1-S, 0.67 on R1). A fraction is bounded by
the products the run cannot avoid. This script times exactly those products, each alone, compiled
by XLA as the runtime's programs are, and prints the fraction the run would reach if they were all
it did. It measures the limits with the same definitions, in the same process:
- G1 (`generate.measure_limits`): the 1536^3 float32 matmul rate and the best 1 GiB streaming read;
- R1 (`rl_step.MatmulRate`): the best of 1024^3, 2048^3 and the model's own GEMM shapes.

Floors (seconds; best of `--reps`):
- G1-T (batch 64) / G1-T-grpo (batch 128): one decode step's weight products (fused q/k/v, o, fused
  gate/up, down, LM head) in a `fori_loop` of 32 steps, on one device and on a data mesh of every
  CPU device (each device its share of the batch, as bench/generate.py runs it; the better one
  counts), plus the K/V bytes at the workload's mean context at the better of the 1 GiB read rate
  and the read rate of an array of that size (which stays in the last-level cache).
- G1-S (batch 8, one device): the 8-row products over all of S's weights but the embedding, in the
  fastest of three forms XLA:CPU compiles (x @ W, x @ W^T as the sampler stores it, and multiply +
  minor-axis reduce), plus K/V bytes at the read bandwidth.
- R1-a: every dot_general of the R1-a update program (bench/update_ab.build, group-shared prompt;
  collected from its jaxpr, each compiled and timed alone with its own shapes and dimension
  numbers), plus 32 decode steps' weight products at batch 128. `ceiling` uses the program's own
  products (padding included); `ceiling_useful` prices only the useful FLOPs (rollouts.step_flops)
  at the measured rates of those products: the bound for an implementation with no padding either.
  `*_best_layout`: each 2-D product in the fastest of its four operand layouts (transposes free:
  not a layout one program can have, an upper bound). `*_consistent`: the products as one program
  could store them, every activation token-major (the model's layout) or every activation
  feature-major, the weights and weight gradients either way (update_dots, consistent_layouts).
  The useful FLOPs come from update_ab's synthetic batch (90% of responses full length), ~4% more
  than a real R1-a rollout; `ceiling_useful*` is not affected (it prices the same useful FLOPs).

Pessimistic by a few percent (measured by review): the decode loops slice the fused q/k/v and
gate/up outputs and add the results back (~40-60 us of a ~2 ms T step, 2-3%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as G  # noqa: E402  (forces one CPU device per core before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rpeg_jax.config.model import model_preset  # noqa: E402
from rpeg_jax.runtime.rollout import stats as rollouts  # noqa: E402

DECODE_STEPS = 32


def cached_read_bytes_s(nbytes: int, reps: int) -> float:
    """The best read rate of a float32 array of `nbytes` (the K/V of one decode step: small enough to
    stay in the last-level cache between steps, so it may be read faster than the 1 GiB probe)."""
    x = jnp.ones((max(1, nbytes // 4),), jnp.float32)
    return nbytes / G.best_time(jax.jit(jnp.sum), x, reps=reps)


def weight_shapes(cfg) -> list[tuple[int, int]]:
    """[in, out] of every weight product of one decode step (q/k/v and gate/up fused, as the sampler runs them)."""
    d, e, f = cfg.hidden_size, cfg.head_size, cfg.intermediate_size
    h, k = cfg.num_heads, cfg.num_kv_heads
    per_layer = [(d, (h + 2 * k) * e), (h * e, d), (d, 2 * f), (f, d)]
    return per_layer * cfg.num_layers + [(d, cfg.vocab_size)]


def decode_gemm_seconds(cfg, batch: int, devices: int, reps: int) -> float:
    """Seconds per decode step of the weight products alone, batch split over `devices` (data mesh)."""
    mesh = jax.make_mesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:devices]
    )
    rng = np.random.default_rng(0)
    shapes = weight_shapes(cfg)
    ws = [jax.device_put((rng.standard_normal(s) * 0.02).astype(np.float32), NamedSharding(mesh, P())) for s in shapes]
    x = jax.device_put(rng.standard_normal((batch, cfg.hidden_size)).astype(np.float32), NamedSharding(mesh, P("data")))
    f = cfg.intermediate_size

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=False)
    def steps(ws, x):
        def body(_, h):
            for j in range(cfg.num_layers):
                qkv, o, gu, dn = ws[4 * j : 4 * j + 4]
                a = (h @ qkv)[:, : o.shape[0]] @ o
                m = (h @ gu)[:, :f] @ dn
                h = h + 1e-3 * (a + m)
            return h + 1e-3 * (h @ ws[-1])[:, :1]

        return jax.lax.fori_loop(0, DECODE_STEPS, body, x)

    return G.best_time(steps, ws, x, reps=reps) / DECODE_STEPS


def gemv_seconds(cfg, rows: int, reps: int) -> tuple[float, str]:
    """(seconds, form) of the fastest `rows`-row product over every weight of one decode step."""
    rng = np.random.default_rng(0)
    shapes = weight_shapes(cfg)
    w_io = [jnp.asarray((rng.standard_normal(s) * 0.02).astype(np.float32)) for s in shapes]
    x = jnp.asarray(rng.standard_normal((rows, max(i for i, _ in shapes))).astype(np.float32))
    forms = {
        "x@W": (w_io, lambda h, w: h[:, : w.shape[0]] @ w),
        "x@W^T": (None, lambda h, w: jnp.einsum("bi,oi->bo", h[:, : w.shape[1]], w)),
        "mul+reduce": (None, lambda h, w: (w[:, None, :] * h[None, :, : w.shape[1]]).sum(-1).T),
    }
    best = (float("inf"), "")
    for name, (ws, prod) in forms.items():
        if ws is None:  # [out, in], the sampler's transposed storage
            ws = [jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in w_io]

        def run(ws, x, prod=prod):
            acc = x
            for w in ws:
                y = prod(acc, w)
                acc = acc + 1e-9 * jnp.pad(y, ((0, 0), (0, max(0, acc.shape[1] - y.shape[1]))))[:, : acc.shape[1]]
            return acc

        t = G.best_time(jax.jit(run), ws, x, reps=reps)
        best = min(best, (t, name))
        del ws
    return best


def _as_mk_kn(a, b, dn):
    """(a as [M, K], b as [K, N]) of a 2-D product with no batch dims; None for any other product."""
    (lc, rc), (lb, _) = dn
    if lb or a.ndim != 2 or b.ndim != 2:
        return None
    return (a if lc[0] == 1 else a.T), (b if rc[0] == 0 else b.T)


def _stored(x, transposed: bool):
    """`x`, or a row-major copy of its transpose (the operand stored the other way)."""
    return jnp.asarray(np.ascontiguousarray(np.asarray(x).T)) if transposed else x


def _matrix_layouts(a, b, dn) -> tuple[list, int]:
    """For a 2-D product (no batch dims): the four ways to store its operands, [M, K] or [K, M] and
    [K, N] or [N, K], each as (a', b', dimension numbers) computing the same [M, N] result, and the
    index of the one the product came with. Any other product: only its own layout."""
    mk_kn = _as_mk_kn(a, b, dn)
    if mk_kn is None:
        return [(a, b, dn)], 0
    a_mk, b_kn = mk_kn
    out = []
    for a_t in (False, True):
        for b_t in (False, True):
            out.append(
                (_stored(a_mk, a_t), _stored(b_kn, b_t), ((((0,) if a_t else (1,)), ((1,) if b_t else (0,))), ((), ())))
            )
    (lc, rc), _ = dn
    return out, 2 * (tuple(lc) == (0,)) + (tuple(rc) == (1,))


def consistent_layouts(a, b, dn, min_rows: int) -> dict:
    """For a 2-D product (no batch dims) of the update: the ways to store it that a whole program
    could use, per activation layout. An axis of at least `min_rows` is a token-row axis (the
    caller passes one more than the largest weight dimension); operands and results with one are
    activations, the rest weights. "token-major" stores every 2-D activation [rows, features] (the
    model's layout), "feature-major" [features, rows]; a weight (small: its transpose is nearly
    free) and a weight gradient may be stored either way, chosen per product. Returns {mode:
    [(lhs, rhs, dimension numbers, result transposed)]}: each computes the product's [M, N] result,
    or its transpose [N, M] (as rhs^T lhs^T) where the mode stores the result the other way. Any
    other product (batched, e.g. attention): {} (the caller prices it in its own layout in both
    modes). An operand or result whose two axes both look like token rows is an error."""
    mk_kn = _as_mk_kn(a, b, dn)
    if mk_kn is None:
        return {}
    a_mk, b_kn = mk_kn
    (m, k), n = a_mk.shape, b_kn.shape[1]
    for x, y, what in ((m, k, "lhs"), (k, n, "rhs"), (m, n, "result")):
        if x >= min_rows and y >= min_rows:
            raise ValueError(
                f"consistent_layouts: the {what} [{x}, {y}] has two token-row-sized axes "
                f"(>= {min_rows}): which one is the tokens is ambiguous"
            )
    rows = next((x for x in (m, k, n) if x >= min_rows), -1)  # at most one size can be the tokens'
    a_st = {t: _stored(a_mk, t) for t in (False, True)}  # a [M, K] / [K, M]
    b_st = {t: _stored(b_kn, t) for t in (False, True)}  # b [K, N] / [N, K]
    out = {}
    for mode, rows_first in (("token-major", True), ("feature-major", False)):
        opts = []
        for a_t in (False, True):  # a stored [M, K] or [K, M]
            if rows in (m, k) and ((a_t and k == rows) or (not a_t and m == rows)) != rows_first:
                continue
            for b_t in (False, True):  # b stored [K, N] or [N, K]
                if rows in (k, n) and ((not b_t and k == rows) or (b_t and n == rows)) != rows_first:
                    continue
                for o_t in (False, True):  # the result [M, N] or [N, M]
                    if rows in (m, n) and ((not o_t and m == rows) or (o_t and n == rows)) != rows_first:
                        continue
                    aa, bb = a_st[a_t], b_st[b_t]
                    ca, cb = (0 if a_t else 1), (1 if b_t else 0)
                    opts.append(
                        (bb, aa, (((cb,), (ca,)), ((), ())), True)
                        if o_t
                        else (aa, bb, (((ca,), (cb,)), ((), ())), False)
                    )
        out[mode] = opts
    return out


def update_dots(cfg_overrides: list[str], reps: int) -> dict:
    """Every dot_general the R1-a update program executes, each timed alone: total seconds in the
    layouts the program's jaxpr gives them (`seconds`) and in the fastest of the four operand
    layouts of each 2-D product (`seconds_best_layout`: the transposes free, as everything but the
    products is here; XLA:CPU's products contracting the 4096 token rows of both operands, the
    weight gradients, run at ~150-210 GFLOP/s against ~230-290 in the standard layout), and FLOPs.
    `seconds_by_layout`: the products as a whole program could store them (`consistent_layouts`:
    every activation token-major, or every activation feature-major, each product at its fastest
    choice of weight and result orientation); `seconds_consistent` is the faster of the two. The
    fastest-layout total needs no such consistency: a weight gradient wants its token operands
    feature-major while the forward that produced them stored them token-major, so the transposes
    it counts as free are real copies of 4096-row activations."""
    import update_ab as U

    from rpeg_jax.config import load_config

    cfg = load_config(None, cfg_overrides)
    fn, params, opt = U.build(cfg, U.G)
    batch = U.r1_batch()
    jaxpr = jax.make_jaxpr(fn)(params, opt, batch, jax.random.key(0))
    found: Counter = Counter()
    dims = {}

    def walk(jp, times: int):
        for eq in jp.eqns:
            name = eq.primitive.name
            if name == "dot_general":
                key = (eq.invars[0].aval.shape, eq.invars[1].aval.shape, repr(eq.params["dimension_numbers"]))
                found[key] += times
                dims[key] = eq.params["dimension_numbers"]
            if name in ("while", "cond"):
                raise NotImplementedError(
                    f"update_dots: a {name} in the update program (its trip count "
                    "is not static): count its products by hand"
                )
            inner = times * (eq.params["length"] if name == "scan" else 1)
            for p in eq.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr, inner)
                    elif hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(jaxpr.jaxpr, 1)
    # Token rows: any axis longer than every weight axis (the packed rows of the group-shared
    # prompt and the B x R response rows of the LM head alike); consistent_layouts checks that no
    # operand has two such axes.
    min_rows = 1 + max(max(x.shape, default=0) for x in jax.tree.leaves(params))
    if not any(max(k[0] + k[1]) >= min_rows for k in found):
        raise ValueError(
            f"update_dots: no product has an axis of >= {min_rows} token rows: the activation "
            "test of consistent_layouts does not apply"
        )
    rng = np.random.default_rng(0)
    cache: dict = {}

    def timed(aa, bb, d) -> float:  # same shapes and dimension numbers: the same product
        key = (aa.shape, bb.shape, repr(d))
        if key not in cache:
            cache[key] = G.best_time(jax.jit(lambda x, y, d=d: jax.lax.dot_general(x, y, d)), aa, bb, reps=reps)
        return cache[key]

    seconds = seconds_best = flops = 0.0
    by_mode = {"token-major": 0.0, "feature-major": 0.0}
    for key, n in found.items():
        a_shape, b_shape, _ = key
        dn = dims[key]
        a = jnp.asarray(rng.standard_normal(a_shape).astype(np.float32))
        b = jnp.asarray(rng.standard_normal(b_shape).astype(np.float32))
        layouts, own = _matrix_layouts(a, b, dn)
        times = [timed(aa, bb, d) for aa, bb, d in layouts]
        modes = consistent_layouts(a, b, dn, min_rows)
        for mode in by_mode:
            by_mode[mode] += n * (min(timed(aa, bb, d) for aa, bb, d, _ in modes[mode]) if modes else times[own])
        out_shape = jax.eval_shape(lambda x, y: jax.lax.dot_general(x, y, dn), a, b).shape
        contracted = np.prod([a_shape[i] for i in dn[0][0]])
        seconds += n * times[own]
        seconds_best += n * min(times)
        flops += n * 2.0 * np.prod(out_shape) * contracted
    stats = rollouts.token_stats({k: batch[k] for k in ("versions_BxR", "response_mask_BxR", "segment_ids_BxS")})
    mode = min(by_mode, key=by_mode.get)
    return {
        "cfg": cfg,
        "seconds": seconds,
        "seconds_best_layout": seconds_best,
        "flops": flops,
        "seconds_by_layout": by_mode,
        "seconds_consistent": by_mode[mode],
        "consistent_layout": mode,
        "dots": sum(found.values()),
        "stats": stats,
    }


def kv_step_bytes(name: str) -> int:
    """K/V bytes one decode step of G1 workload `name` reads at its mean context (float32)."""
    preset, prompts, plen, n, new, _, _ = G.WORKLOADS[name]
    return int(prompts * n * (plen + new / 2) * G.kv_bytes_per_token(model_preset(preset), 4))


def floors(wanted: list[str], n_dev: int, reps: int, r1: dict | None) -> dict:
    """One round of every floor (seconds), keyed by workload."""
    out = {}
    for name in ("G1-T-greedy", "G1-T-grpo"):
        if name in wanted:
            preset, prompts, _, n, _, _, _ = G.WORKLOADS[name]
            cfg = model_preset(preset)
            out[name] = {d: decode_gemm_seconds(cfg, prompts * n, d, reps) for d in sorted({1, n_dev})}
            out[name + ":kv_read"] = cached_read_bytes_s(kv_step_bytes(name), reps)
    if "G1-S-greedy" in wanted:
        out["G1-S-greedy"] = gemv_seconds(model_preset("small"), 8, reps)
    if r1 is not None:
        out["R1-a"] = {d: decode_gemm_seconds(r1["cfg"].model, 128, d, reps) * DECODE_STEPS for d in sorted({1, n_dev})}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="floors: the best of this many rounds; limits: the "
        "best of a probe before every round and one after the last",
    )
    ap.add_argument("--workloads", default="G1-T-greedy,G1-T-grpo,G1-S-greedy,R1-a")
    args = ap.parse_args(argv)
    wanted = args.workloads.split(",")
    n_dev = jax.device_count()
    r1 = None
    if "R1-a" in wanted:
        import rl_step as R

        r1_probe = R.MatmulRate(reps=args.reps)
        r1 = update_dots(R.R1 + R.WORKLOADS["R1-a"], args.reps)
    probes, rounds = [], []
    for i in range(args.rounds + 1):
        lim = G.measure_limits(jnp.float32)
        lim["r1_matmul_flops"] = r1_probe.measure() if r1 is not None else None
        probes.append(lim)
        print(
            f"probe {i}: G1 matmul {lim['matmul_flops'] / 1e9:.1f} GFLOP/s, read bandwidth "
            f"{lim['bandwidth_bytes_s'] / 1e9:.1f} GB/s"
            + (f", R1 matmul {lim['r1_matmul_flops'] / 1e9:.1f}" if r1 is not None else ""),
            flush=True,
        )
        if i < args.rounds:
            rounds.append(floors(wanted, n_dev, args.reps, r1))
    mm = max(p["matmul_flops"] for p in probes)
    bw = max(p["bandwidth_bytes_s"] for p in probes)
    print(
        f"limits (best of {len(probes)}): matmul {mm / 1e9:.1f} GFLOP/s, read bandwidth {bw / 1e9:.1f} GB/s; "
        f"{n_dev} CPU devices"
    )
    records = []
    for name in ("G1-T-greedy", "G1-T-grpo"):
        if name not in wanted:
            continue
        preset, prompts, plen, n, new, _, _ = G.WORKLOADS[name]
        cfg, batch = model_preset(preset), prompts * n
        mean_ctx = plen + new / 2
        flops_tok, _ = G.work_per_token(cfg, batch, mean_ctx, 4)
        kv_bytes = kv_step_bytes(name)
        kv_rate = max(bw, max(r[name + ":kv_read"] for r in rounds))  # from cache if faster than DRAM
        t_gemm = {d: min(r[name][d] for r in rounds) for d in rounds[0][name]}
        d_best = min(t_gemm, key=t_gemm.get)
        limit_s = batch * flops_tok / mm
        floor = t_gemm[d_best] + kv_bytes / kv_rate
        rec = dict(
            workload=name,
            target=0.75,
            limit_kind="matmul",
            limit_step_s=limit_s,
            gemm_step_s={str(d): t for d, t in t_gemm.items()},
            devices=d_best,
            kv_bytes=kv_bytes,
            kv_read_bytes_s=kv_rate,
            kv_read_s=kv_bytes / kv_rate,
            floor_step_s=floor,
            ceiling=limit_s / floor,
            ceiling_gemm_only=limit_s / t_gemm[d_best],
        )
        records.append(rec)
        print(
            f"{name}: limit {limit_s * 1e3:.2f} ms/step; weight GEMMs "
            + ", ".join(f"{d} dev {t * 1e3:.2f} ms" for d, t in t_gemm.items())
            + f"; K/V at {mean_ctx:.0f} ctx {kv_bytes / 1e6:.1f} MB at {kv_rate / 1e9:.0f} GB/s = "
            f"{kv_bytes / kv_rate * 1e3:.2f} ms"
            f" -> ceiling {rec['ceiling']:.2f} (GEMMs only {rec['ceiling_gemm_only']:.2f}; target 0.75)"
        )
    if "G1-S-greedy" in wanted:
        preset, prompts, plen, n, new, _, _ = G.WORKLOADS["G1-S-greedy"]
        cfg, batch = model_preset(preset), prompts * n
        _, bytes_step = G.work_per_token(cfg, batch, plen + new / 2, 4)
        weight_bytes = sum(i * o for i, o in weight_shapes(cfg)) * 4
        t_w, form = min(r["G1-S-greedy"] for r in rounds)
        limit_s = bytes_step / bw
        floor = t_w + (bytes_step - weight_bytes) / bw
        rec = dict(
            workload="G1-S-greedy",
            target=0.75,
            limit_kind="bandwidth",
            limit_step_s=limit_s,
            weight_product_s=t_w,
            weight_product_form=form,
            weight_read_gb_s=weight_bytes / t_w / 1e9,
            floor_step_s=floor,
            ceiling=limit_s / floor,
        )
        records.append(rec)
        print(
            f"G1-S-greedy: limit {limit_s * 1e3:.1f} ms/step ({bytes_step / 1e6:.0f} MB); 8-row products over "
            f"{weight_bytes / 1e6:.0f} MB of weights: {t_w * 1e3:.1f} ms ({form}, {weight_bytes / t_w / 1e9:.1f} GB/s)"
            f" -> ceiling {rec['ceiling']:.2f} (target 0.75)"
        )
    if r1 is not None:
        rate = max(p["r1_matmul_flops"] for p in probes)
        cfg, stats = r1["cfg"], r1["stats"]
        t_gen = {d: min(r["R1-a"][d] for r in rounds) for d in rounds[0]["R1-a"]}
        gen_best = min(t_gen.values())
        useful = rollouts.step_flops(cfg, stats, cfg.pipeline.staleness)
        gen_useful = rollouts.generation_flops(cfg, stats)
        gen_rate = 128 * 2 * sum(i * o for i, o in weight_shapes(cfg.model)) * DECODE_STEPS / gen_best
        upd_rate = r1["flops"] / r1["seconds"]
        limit_s = useful / rate
        floor = r1["seconds"] + gen_best
        floor_useful = (useful - gen_useful) / upd_rate + gen_useful / gen_rate
        floor_layout = r1["seconds_best_layout"] + gen_best
        floor_useful_layout = (useful - gen_useful) / (r1["flops"] / r1["seconds_best_layout"]) + gen_useful / gen_rate
        floor_consistent = r1["seconds_consistent"] + gen_best
        floor_useful_consistent = (useful - gen_useful) / (
            r1["flops"] / r1["seconds_consistent"]
        ) + gen_useful / gen_rate
        rec = dict(
            workload="R1-a",
            target=0.67,
            limit_kind="matmul",
            matmul_flops_per_s=rate,
            useful_flops=useful,
            limit_step_s=limit_s,
            update_dots=r1["dots"],
            update_dot_flops=r1["flops"],
            update_dots_s=r1["seconds"],
            generation_gemm_s=gen_best,
            generation_gemm_s_by_devices={str(d): t for d, t in t_gen.items()},
            floor_step_s=floor,
            ceiling=limit_s / floor,
            floor_useful_s=floor_useful,
            ceiling_useful=limit_s / floor_useful,
            update_dots_best_layout_s=r1["seconds_best_layout"],
            floor_best_layout_s=floor_layout,
            ceiling_best_layout=limit_s / floor_layout,
            ceiling_useful_best_layout=limit_s / floor_useful_layout,
            update_dots_by_layout_s=r1["seconds_by_layout"],
            consistent_layout=r1["consistent_layout"],
            floor_consistent_s=floor_consistent,
            ceiling_consistent=limit_s / floor_consistent,
            ceiling_useful_consistent=limit_s / floor_useful_consistent,
        )
        records.append(rec)
        print(
            f"R1-a: matmul {rate / 1e9:.1f} GFLOP/s; useful {useful / 1e9:.1f} GFLOP -> limit {limit_s:.3f} s; "
            f"update: {r1['dots']} dots, {r1['flops'] / 1e9:.1f} GFLOP in {r1['seconds']:.3f} s "
            f"({upd_rate / 1e9:.0f} GFLOP/s); generation GEMMs {gen_best:.3f} s ({gen_rate / 1e9:.0f} GFLOP/s) "
            f"-> ceiling {rec['ceiling']:.2f}, useful-only {rec['ceiling_useful']:.2f}; every product in its "
            f"fastest layout: dots {r1['seconds_best_layout']:.3f} s -> ceiling {rec['ceiling_best_layout']:.2f}, "
            f"useful-only {rec['ceiling_useful_best_layout']:.2f}; consistent layouts (token-major "
            f"{r1['seconds_by_layout']['token-major']:.3f} s, feature-major "
            f"{r1['seconds_by_layout']['feature-major']:.3f} s) -> ceiling {rec['ceiling_consistent']:.2f}, "
            f"useful-only {rec['ceiling_useful_consistent']:.2f} (target 0.67)"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"probes": probes, "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
