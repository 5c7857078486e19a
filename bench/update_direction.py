"""Does one actor update point the way its advantages say? (issue 34, "Done when" 1's diagnosis)

    python bench/update_direction.py --peer-python /tmp/torchvenv/bin/python --out /tmp/ud \
        [--config configs/finetune.yaml] [key.sub=value ...]

Runs `rpeg train` for ONE step of the given preset (the runtime's own path: sampler, reward,
advantages, the actor update) with a checkpoint after it, and keeps the actor update's input batch
(tokens, masks, advantages, the reference logprobs). Then, in the peer venv, Hugging Face transformers scores
that batch's response tokens under the initial model (model.path) and under the step-1 policy
(`rpeg export`), and this script reports:

  parity     |transformers logp(step 0) - the run's reference logp| over response tokens (the
             reference is the initial model; the behaviour logp where a run has no reference)
  dJ         sum over response tokens of A * (logp1 - logp0), over the token count: the change of
             the surrogate the update maximises (first order: lr * sum |g| > 0 for a sign-like
             Adam step). It must be > 0.
  pos/neg    per response with A > 0 (A < 0): the mean of its summed (logp1 - logp0), and how many
             moved the right way (gained; lost). Zero-advantage rows are reported apart.

An independent scorer (transformers, not our model code) judges the step, so a sign error anywhere
on the path (reward, advantages, loss, gradient, optimizer, the weights written back) shows here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

PEER = r"""
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
batch = np.load(sys.argv[1])
out = {}
for name, path in (("logp0", sys.argv[2]), ("logp1", sys.argv[3])):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    toks, segs, mask = batch["tokens_BxS"], batch["segment_ids_BxS"], batch["response_mask_BxR"]
    B, S = toks.shape
    R = mask.shape[1]
    lp = np.zeros((B, R), np.float64)
    with torch.no_grad():
        for b in range(B):
            keep = np.nonzero(segs[b])[0]
            ids = torch.tensor(toks[b, keep][None].astype(np.int64))
            logits = model(ids).logits[0].double()
            logz = torch.log_softmax(logits, -1)
            # response position r sits at token column S - R + r; its logit at the column before
            for r in range(R):
                if mask[b, r] > 0:
                    col = S - R + r
                    i = int(np.searchsorted(keep, col))
                    lp[b, r] = float(logz[i - 1, toks[b, col]])
    out[name] = lp
np.savez(sys.argv[4], **out)
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "finetune.yaml"))
    ap.add_argument("--peer-python", required=True, help="a python with torch and transformers")
    ap.add_argument("--out", required=True, help="work directory (the run, the batch, the export)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    run_dir = os.path.join(a.out, "run")
    batch_path = os.path.join(a.out, "batch.npz")

    from rpeg_jax.runtime import host_memory

    host_memory.keep_freed_memory()
    import jax

    from rpeg_jax import cli
    from rpeg_jax.runtime import kernels

    real = kernels._actor_batch
    kept = {}

    def save(host):
        if not kept:
            kept.update({k: np.asarray(v) for k, v in host.items()})
            np.savez(batch_path, **kept)

    def keeping(inputs, ctx):
        batch = real(inputs, ctx)  # traced inside the update's jit: the host copy comes by callback
        jax.debug.callback(save, {k: v for k, v in batch.items() if hasattr(v, "shape")})
        return batch

    kernels._actor_batch = keeping
    overrides = list(a.overrides) + [
        "train.steps=1",
        f"train.run_dir={run_dir}",
        "train.checkpoint_every=1",
        "train.resume=never",
        "eval.every=0",
        "eval.before_train=false",
    ]
    rc = cli.main(["train", "--config", a.config, *overrides])
    if rc not in (0, None) or not kept:
        raise SystemExit(f"rpeg train rc={rc}, batch kept: {bool(kept)}")
    hf1 = os.path.join(a.out, "hf1")
    rc = cli.main(["export", "--run-dir", run_dir, "--step", "1", "--out", hf1, "--overwrite"])
    if rc not in (0, None):
        raise SystemExit(f"rpeg export rc={rc}")
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as fh:
        cfg = yaml.safe_load(fh)
    base = cfg["model"]["path"]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(PEER)
    scores = os.path.join(a.out, "scores.npz")
    subprocess.run([a.peer_python, fh.name, batch_path, base, hf1, scores], check=True)
    report(dict(np.load(batch_path)), dict(np.load(scores)))


def report(batch, scores):
    mask = batch["response_mask_BxR"].astype(np.float64)
    lp0, lp1 = scores["logp0"], scores["logp1"]
    if "advantages_BxR" not in batch:
        raise SystemExit(f"the actor update's batch has no advantages_BxR (keys: {sorted(batch)})")
    adv = batch["advantages_BxR"].astype(np.float64)
    seq_adv = (adv * mask).sum(1) / np.maximum(mask.sum(1), 1)
    res = {"rows": int(mask.shape[0]), "response_tokens": int(mask.sum())}
    for k in ("ref_logp_BxR", "behav_logp_BxR"):  # the reference is the initial model: logp0 again
        if k in batch:
            d = np.abs(lp0 - batch[k]) * mask
            res["parity"] = {"vs": k, "max": float(d.max()), "mean": float(d.sum() / mask.sum())}
            break
    delta = (lp1 - lp0) * mask
    res["dJ"] = float((adv * delta).sum() / mask.sum())
    seq = delta.sum(1)
    for name, sel, right in (("pos", seq_adv > 1e-9, seq > 0), ("neg", seq_adv < -1e-9, seq < 0)):
        res[name] = {
            "n": int(sel.sum()),
            "mean_dlogp_seq": float(seq[sel].mean()) if sel.any() else None,
            "moved_right": int((right & sel).sum()),
        }
    zero = np.abs(seq_adv) <= 1e-9
    res["zero"] = {"n": int(zero.sum()), "mean_dlogp_seq": float(seq[zero].mean()) if zero.any() else None}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
