"""Supervised fine-tuning on chat transcripts (train.mode=sft; issue 32 item 6), and SFT then RL
(train.mode=sft_then_rl).

    summary = train_sft(cfg)        # rpeg train with train.mode=sft (cli/train.py)
    summary = sft_then_rl(cfg)      # SFT in <run_dir>/sft, export to <run_dir>/sft/model, RL in <run_dir>/rl

What a step does: sft.batch_size conversations (an epoch's shuffled order, from train.seed; the step
alone decides which, so a resumed run sees the same ones) are packed first-fit-decreasing into rows of
sft.max_len tokens (shapes/packing.first_fit_decreasing, the packer of the RL update: a segment per
conversation, positions restarting at 0, attention causal within a segment), the rows rounded up to a
multiple of the devices and to a power of two (few compiled shapes), sharded over every device (data
parallel, parameters replicated), and one AdamW step (optim section, sft.lr) is taken on the token-mean
cross-entropy of the assistant tokens (data/sft.py: its mask) over the whole batch:

    loss = - sum_t mask[t] * log p(ids[t] | ids[<t] of its conversation) / sum_t mask[t]

sft.stop_loss ends the run at the first step where the mean sft/loss of the last STOP_WINDOW steps is
below it (sft.steps: the most): that step is checkpointed and evaluated as the last one, and the run is
done (run again, it trains nothing). A measured stop, not a step count: where a transition (the copy
of the agentic preset) happens depends on seeds and float noise (bench/NOTES.md, session 24). The
window's losses are in every checkpoint's meta (recent_loss), so a resumed run stops where the
uninterrupted one does.

A run directory as RL's: config.yaml, metrics.jsonl (sft/loss, sft/tokens, sft/lr, sft/grad_norm, ...),
checkpoints/ (orbax, the same items: train = {actor, actor_opt}, so `rpeg export` and runtime/evaluation
read them as an RL run's), eval/step_N.jsonl (eval.path, every sft.eval_every steps and after the last).
train.resume=auto continues from the newest checkpoint exactly (the optimizer state is in it, the batch
is a function of the step).

Warm-starting RL: model.path = an exported SFT run (`rpeg export --run-dir <sft run> --out DIR`, which
sft_then_rl does itself), a Hugging Face directory like any other. One process only for now.

Called by: cli/train.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rpeg_jax.config.base import ConfigError, to_dict
from rpeg_jax.config.files import write_atomic
from rpeg_jax.config.run import RunConfig, dump_yaml, from_dict
from rpeg_jax.data.chat import load_prompt_format
from rpeg_jax.data.sft import Example, read_transcripts
from rpeg_jax.data.tokenizer import load_tokenizer
from rpeg_jax.models.logprobs import chunked_logprobs
from rpeg_jax.rl.optimizer import current_lr, make_optimizer
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.metrics import MetricsWriter
from rpeg_jax.shapes.packing import first_fit_decreasing

log = logging.getLogger("rpeg_jax")

STOP_WINDOW = 10  # steps whose mean sft/loss sft.stop_loss compares (sft/loss_recent)


# ---- batches (numpy, host) ---------------------------------------------------------------------
def batch_indices(n: int, batch: int, step: int, seed: int, shuffle: bool) -> np.ndarray:
    """The conversations of SFT step `step` (0-based): positions step*batch.. of the concatenated
    epochs, each epoch a permutation drawn from (seed, epoch) (or the file order)."""
    out = []
    for pos in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(pos, n)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        out.append(int(order[i]))
    return np.asarray(out, np.int64)


def pack(examples: list[Example], row_len: int, row_multiple: int = 1) -> dict[str, np.ndarray]:
    """Packed rows [N, row_len] of the examples: tokens, positions (restarting per conversation),
    segment ids (1.. per row, 0 padding) and weight (1 where the token is a trained target of the
    token before it in the same conversation). N: the rows first-fit-decreasing needs, rounded up to
    a power of two times row_multiple."""
    bins = first_fit_decreasing([len(e) for e in examples], row_len)
    need = -(-len(bins) // row_multiple)
    n = row_multiple * (1 << max(0, (need - 1).bit_length()))
    tok = np.zeros((n, row_len), np.int32)
    pos = np.zeros((n, row_len), np.int32)
    seg = np.zeros((n, row_len), np.int32)
    tgt = np.zeros((n, row_len), np.float32)
    for r, items in enumerate(bins):
        c = 0
        for s, i in enumerate(items, start=1):
            e = examples[i]
            L = len(e)
            tok[r, c : c + L] = e.ids
            pos[r, c : c + L] = np.arange(L)
            seg[r, c : c + L] = s
            tgt[r, c + 1 : c + L] = e.mask[1:]  # the first token of a conversation has no prediction
            c += L
    return {"tokens": tok, "positions": pos, "segments": seg, "weights": tgt}


# ---- the loss (device) -------------------------------------------------------------------------
def token_logprobs(model, tokens, positions, segments):
    """[N, T] log p(tokens[:, t] | the row's tokens before t in its segment); column 0 is 0."""
    h, _ = model.hidden(tokens, positions, segments)
    lp, _ = chunked_logprobs(h[:, :-1], model.output_matrix(), tokens[:, 1:])
    return jnp.pad(lp, ((0, 0), (1, 0)))


def sft_loss(model, batch) -> tuple[jax.Array, jax.Array]:
    """(token-mean cross-entropy over the weighted targets, their count)."""
    lp = token_logprobs(model, batch["tokens"], batch["positions"], batch["segments"])
    w = batch["weights"]
    n = jnp.sum(w)
    return -jnp.sum(w * lp) / jnp.maximum(n, 1.0), n


def make_step(graphdef, tx):
    def step(params, opt_state, batch):
        def loss_fn(p):
            return sft_loss(nnx.merge(graphdef, p), batch)

        (loss, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "sft/loss": loss,
            "sft/tokens": n,
            "sft/grad_norm": optax.tree.norm(grads),
            "sft/lr": current_lr(opt_state),
        }
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


# ---- the run -----------------------------------------------------------------------------------
def load_examples(cfg: RunConfig, tokenizer) -> tuple[list[Example], dict[str, int]]:
    fmt = load_prompt_format(cfg.data, model_path=cfg.model.path)
    if fmt.template is None:
        where = ", ".join(fmt.looked_in) or "nowhere: data.tokenizer and model.path are unset"
        raise ConfigError(
            "data.chat_template", cfg.data.chat_template, f"SFT renders conversations with one; none found ({where})"
        )
    examples, skipped = read_transcripts(cfg.sft, fmt.template, tokenizer)
    top = max(max(e.ids) for e in examples)
    if top >= cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size, f"the tokenizer gives id {top} in {cfg.sft.path}: too small"
        )
    return examples, skipped


def _model(cfg: RunConfig):
    from rpeg_jax.models import Transformer, load_hf

    if cfg.model.path:
        model = load_hf(cfg.model.path, dtype=cfg.model.param_dtype)
        model.cfg = dataclasses.replace(cfg.model, value_head=False)
        return model
    return Transformer(dataclasses.replace(cfg.model, value_head=False), rngs=nnx.Rngs(params=cfg.train.seed))


def train_sft(cfg: RunConfig, *, on_step=None, keep_state: bool = False) -> dict[str, Any]:
    """cfg.sft.steps SFT steps, or fewer with sft.stop_loss (module doc), resuming from the run
    directory's newest checkpoint when train.resume=auto. Returns {"steps", "interrupted",
    "stopped_on_loss", "run_dir", "loss"} (+ "state" with keep_state)."""
    from rpeg_jax.runtime.trainer import StopSignals, check_run_dir

    with StopSignals() as stop:  # SIGINT / SIGTERM: stop after the step in flight, its checkpoint saved
        return _train_sft(cfg, stop, check_run_dir, on_step, keep_state)


def _train_sft(cfg: RunConfig, stop, check_run_dir, on_step, keep_state: bool) -> dict[str, Any]:

    if jax.process_count() > 1:
        raise ConfigError("train.mode", cfg.train.mode, "SFT runs on one process for now")
    check_run_dir(cfg)
    s, d = cfg.sft, cfg.train.run_dir
    tokenizer = load_tokenizer(cfg.data)
    examples, skipped = load_examples(cfg, tokenizer)
    evaluator = None
    if cfg.eval.enabled:
        from rpeg_jax.runtime.evaluation import Evaluator

        evaluator = Evaluator.for_run(cfg)
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), ("data",))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    model = _model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, replicated)
    tx = make_optimizer(dataclasses.replace(cfg.optim, lr=s.lr or cfg.optim.lr), s.steps)
    opt_state = jax.device_put(tx.init(params), replicated)
    if evaluator is not None:
        evaluator.on(graphdef, mesh, lambda p: p)
    os.makedirs(d, exist_ok=True)
    ckpt = Checkpointer(os.path.join(d, "checkpoints"), keep=cfg.train.keep_checkpoints, cleanup_tmp=True)
    start, recent = 0, []
    try:
        latest = ckpt.latest_step() if cfg.train.resume == "auto" else None
        if latest is not None:
            train, meta, _ = ckpt.restore(latest, {"actor": params, "actor_opt": opt_state})
            params, opt_state, start = train["actor"], train["actor_opt"], int(meta["step"])
            recent = [float(x) for x in meta.get("recent_loss", [])][-STOP_WINDOW:]
            log.info("SFT: resumed from step %d (%s)", start, ckpt.directory)
        stopped = _loss_stop(s.stop_loss, recent)
        if stopped:
            log.info("SFT: step %d met sft.stop_loss (%g): nothing to train", start, s.stop_loss)
        write_atomic(os.path.join(d, "config.yaml"), dump_yaml(cfg))
        log.info(
            "SFT: %d conversations (%d assistant tokens of %d) from %s; skipped %s",
            len(examples),
            sum(sum(e.mask) for e in examples),
            sum(len(e) for e in examples),
            s.path,
            {k: v for k, v in skipped.items() if v} or "none",
        )
        step_fn = make_step(graphdef, tx)
        writer = MetricsWriter(
            d,
            tensorboard=cfg.train.tensorboard,
            progress=cfg.train.progress,
            total_steps=s.steps,
            start_step=start,
            log_every=cfg.train.log_every,
        )
        loss = float("nan")
        try:
            done = start
            for t in range(start, start if stopped else s.steps):
                if stop.agreed():
                    log.warning("SFT: stopped by %s after step %d; run the same command to resume", stop.signal_name, t)
                    if t > start:
                        ckpt.save(t, {"actor": params, "actor_opt": opt_state}, _meta(t, recent))
                    break
                t0 = time.perf_counter()
                idx = batch_indices(len(examples), s.batch_size, t, cfg.train.seed, s.shuffle)
                host = pack([examples[i] for i in idx], s.max_len, len(devices))
                batch = {k: jax.device_put(v, rows) for k, v in host.items()}
                params, opt_state, m = step_fn(params, opt_state, batch)
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                loss = m["sft/loss"]
                if not np.isfinite(loss):
                    from rpeg_jax.runtime.trainer import TrainingStopped

                    raise TrainingStopped(f"SFT step {t + 1}: non-finite loss")
                m["sft/rows"] = float(host["tokens"].shape[0])
                m["sft/fill"] = float((host["segments"] > 0).mean())
                m["timing_s/step"] = time.perf_counter() - t0
                recent = [*recent, loss][-STOP_WINDOW:]
                m["sft/loss_recent"] = float(np.mean(recent))
                stopped = _loss_stop(s.stop_loss, recent)
                if stopped:
                    log.info(
                        "SFT: step %d: mean loss of the last %d steps %.4g < sft.stop_loss %g: stopping",
                        t + 1,
                        STOP_WINDOW,
                        m["sft/loss_recent"],
                        s.stop_loss,
                    )
                last = t + 1 == s.steps or stopped
                if evaluator is not None and (last or (s.eval_every and (t + 1) % s.eval_every == 0)):
                    m.update(evaluator.run(t + 1, params))
                writer.write(t + 1, m, last=last)
                if on_step is not None:
                    on_step(t + 1, m)
                if last or (s.checkpoint_every and (t + 1) % s.checkpoint_every == 0):
                    ckpt.save(t + 1, {"actor": params, "actor_opt": opt_state}, _meta(t + 1, recent))
                done = t + 1
                if stopped:
                    break
        finally:
            writer.close()
    finally:
        ckpt.close()
    out = {"steps": done, "interrupted": done < s.steps and not stopped, "stopped_on_loss": stopped, "run_dir": d}
    out["loss"] = loss
    if keep_state:
        out["state"] = {"actor": params, "actor_opt": opt_state}
    return out


def _loss_stop(threshold: float | None, recent: list[float]) -> bool:
    """sft.stop_loss met: a full window of losses whose mean is below the threshold."""
    return threshold is not None and len(recent) == STOP_WINDOW and float(np.mean(recent)) < threshold


def _meta(step: int, recent: list[float]) -> dict[str, Any]:
    return {"step": step, "mode": "sft", "recent_loss": list(recent)}


def rl_after_sft(cfg: RunConfig, model_dir: str) -> RunConfig:
    """The RL half of train.mode=sft_then_rl: the same config, train.mode=rl, run_dir <run_dir>/rl,
    model.path = the exported SFT policy (its tokenizer and chat template beside it)."""
    data = to_dict(cfg)
    model = {k: v for k, v in data["model"].items() if k in ("dtype", "param_dtype", "attention", "remat")}
    data["model"] = {**model, "path": model_dir}
    data["train"] = {**data["train"], "mode": "rl", "run_dir": os.path.join(cfg.train.run_dir, "rl")}
    data["data"] = {**data["data"], "tokenizer": None}  # the export's tokenizer.json (config/run.py)
    return from_dict(data)


def sft_then_rl(cfg: RunConfig, rl_train, **kw) -> dict[str, Any]:
    """SFT in <run_dir>/sft, its last step exported to <run_dir>/sft/model, then `rl_train` (the RL
    trainer) on rl_after_sft(cfg). Run again, each half resumes (or is skipped when it is done)."""
    from rpeg_jax.runtime.export import export

    sft_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, mode="sft", run_dir=os.path.join(cfg.train.run_dir, "sft"))
    )
    sft = train_sft(sft_cfg)
    if sft["interrupted"]:
        return {"sft": sft, "interrupted": True, "steps": 0, "run_dir": cfg.train.run_dir}
    model_dir = os.path.join(sft_cfg.train.run_dir, "model")
    step, _ = export(sft_cfg.train.run_dir, model_dir, overwrite=True)
    log.info("SFT: step %d exported to %s; RL starts from it", step, model_dir)
    rl = rl_train(rl_after_sft(cfg, model_dir), **kw)
    return {**rl, "sft": sft}


__all__ = ["batch_indices", "pack", "rl_after_sft", "sft_loss", "sft_then_rl", "token_logprobs", "train_sft"]
