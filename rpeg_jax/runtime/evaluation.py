"""Held-out evaluation: the policy of a step samples eval.n completions of every eval prompt, the run's
reward scores them, and verl's validation metrics come out (verl: val_before_train, test_freq).

    ev = Evaluator.for_run(cfg)                 # reads and checks the eval file (before anything compiles)
    ev.on(graphdef, mesh, to_rollout)           # the actor's model and the generation layout
    metrics = ev.run(step, actor_params)        # writes <run_dir>/eval/step_<step>.jsonl (process 0)

Metrics, for each source (a record's `data_source` field, else the eval file's stem), N = eval.n and
r_ij the reward of sample j of prompt i (verl's trainer/ppo/metric_utils.process_validation_metrics):
  val-core/<source>/reward/mean@N  = mean_i mean_j r_ij (verl's mean@N exactly);
  val-core/<source>/reward/pass@N  = mean_i [max_j r_ij >= eval.pass_threshold], N > 1 only: the
      share of prompts that any of their N samples solves. Not verl's best@N/mean, which is a
      bootstrap estimate (1000 resamples with replacement) of E[max of N rewards] and is
      below max_j r_ij; pass@N with n = N samples needs no estimator.
  val-aux/reward/errors            = samples whose reward raised (scored 0, as in training);
  timing_s/testing                 = seconds the evaluation took (verl's name).
Results per prompt go to <run_dir>/eval/step_<step>.jsonl, one line per prompt in file order: id,
data_source, prompt_text (the prompt as rendered for the model, a chat template applied),
completions (decoded text, cut where the sampler stopped), answer, scores.
With an environment (env.name other than single_turn) every sample is an episode, run as training
runs them (sampling/episodes.EpisodeDriver, rollout.max_new_tokens its token budget): its score is
the episode's reward, its prompt_text the episode's first prefill (with tools, the template's
rendering with their schemas), its completion every token after the prompt decoded (the turns and the
observations between them), and the line also has `episodes`: for each sample the messages it
added after the prompt (the assistant's turns with their calls, the tool results), and
`val-aux/env/...` the environment's metrics (turns, tool calls, tool errors, truncated).

Evaluation disturbs nothing that training depends on, so a run with it is exactly the run without:
it runs at step boundaries (no stage in flight) on its own Sampler, built for each evaluation from
the actor's current params (`Placement.to_rollout`, a copy) and dropped after it. The training
sampler keeps its KV pool, queue, in-flight sequences (continuous admission keeps sequences running
across steps) and weights version; the eval sampler has the same engine settings
(runtime/setup.sampler_config), so its programs are the training sampler's compiled ones, and its
KV pool is a second one of the same size while the evaluation runs. The eval prompts come from
their own file (the training data iterator is not touched) and the sampling seed is its own
constant stream of train.seed, the same at every step: at eval.temperature > 0 two steps are
compared on common random numbers. Every process evaluates every prompt (the same result on each);
process 0 writes.

Called by: runtime/trainer.py (at step boundaries), cli/eval.py (`rpeg eval`, on a checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.files import write_atomic
from rpeg_jax.config.run import RunConfig
from rpeg_jax.data.jsonl import DataError, get_field
from rpeg_jax.data.pipeline import load_records
from rpeg_jax.data.rewards import make_samples, resolve_reward, score
from rpeg_jax.data.tokenizer import load_tokenizer
from rpeg_jax.runtime.setup import sampler_config
from rpeg_jax.sampling import Sampler, SamplingParams

RECORD_KEYS = ("id", "prompt", "prompt_tokens", "answer")  # a record's own fields; the rest (prompt_messages
#   included) go to the reward, as the training pipeline passes them


def eval_seed(base: int) -> int:
    """The evaluation sampler's seed: one stream of train.seed (each prompt's is (seed, prompt index))."""
    return (base * 1_000_003 + 7_654_321) % (2**31 - 1)


def due(cfg: RunConfig, step: int) -> bool:
    """Whether the boundary after `step` completed steps evaluates: every eval.every steps and after
    the last (verl: test_freq > 0 and (step % test_freq == 0 or the last step))."""
    every = cfg.eval.every
    return cfg.eval.enabled and every > 0 and (step % every == 0 or step == cfg.train.steps)


def val_metrics(sources: list[str], scores_PxN: np.ndarray, threshold: float) -> dict[str, float]:
    """verl's val-core metrics of rewards [prompts, N] per source (module docstring)."""
    scores = np.asarray(scores_PxN, np.float64)
    n = scores.shape[1]
    out = {}
    for src in dict.fromkeys(sources):
        s = scores[[i for i, x in enumerate(sources) if x == src]]
        out[f"val-core/{src}/reward/mean@{n}"] = float(s.mean(axis=1).mean())
        if n > 1:
            out[f"val-core/{src}/reward/pass@{n}"] = float((s >= threshold).any(axis=1).mean())
    return out


def _check_answers(path: str, field: str) -> None:
    """An eval file none of whose records has the answer field is one error naming file and field."""
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
                get_field(obj, field)
                return
            except (ValueError, KeyError):
                continue
    why = f"no record has the answer field {field!r} (data.answer_field): evaluation needs answers"
    raise DataError(path, None, why)


def load_eval_records(cfg: RunConfig, tokenizer) -> list[dict]:
    """The eval prompts (the first eval.max_prompts), read like training JSONL (data.* fields, chat
    template, data.max_prompt_len, data.on_bad_record), each with its `data_source`."""
    e, d = cfg.eval, cfg.data
    if not os.path.isfile(e.path):
        raise ConfigError("eval.path", e.path, "file not found")
    if d.answer_field is None:
        raise ConfigError("data.answer_field", None, f"evaluation ({e.path}) scores against answers: set the field")
    _check_answers(e.path, d.answer_field)
    records, _ = load_records(dataclasses.replace(d, task="jsonl", path=e.path), tokenizer, model_path=cfg.model.path)
    records = records[: e.max_prompts] if e.max_prompts else records
    stem = os.path.splitext(os.path.basename(e.path))[0]
    for r in records:
        r["data_source"] = str(r.get("data_source") or stem)
    return records


def _after_prompt(messages: list[dict]) -> list[dict]:
    """An episode's messages from its first assistant turn on (what the policy and the tools added)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return list(messages[first:])


class Evaluator:
    """Evaluation of one run config's eval set (module docstring): built before anything compiles
    (the eval file is read and checked then), told the policy's layout by `on`, then `run` per step."""

    def __init__(self, cfg: RunConfig, tokenizer, reward: tuple[str, Any], chief: bool = True):
        self.cfg, self.tokenizer, self.chief = cfg, tokenizer, chief
        self.reward_name, self.reward_fn = reward
        self.records = load_eval_records(cfg, tokenizer)
        if cfg.env.name != "single_turn":  # episode prompts render the tool schemas: check them too
            from rpeg_jax.env.runner import EnvRunner

            runner = EnvRunner.build(cfg, tokenizer)
            try:
                runner.check_prompt_lengths(self.records, cfg.data.max_prompt_len, cfg.eval.path)
            finally:
                runner.close()
        self.sampler_config = dataclasses.replace(sampler_config(cfg), release_slots=False)
        slots = self.sampler_config.max_slots
        if cfg.eval.n > slots:  # a prompt's samples are admitted together
            raise ConfigError("eval.n", cfg.eval.n, f"exceeds the sampler's {slots} slots (rollout.max_slots)")
        r = cfg.rollout
        self.params = dataclasses.replace(
            SamplingParams.from_rollout(r, n=cfg.eval.n, seed=eval_seed(cfg.train.seed)),
            temperature=cfg.eval.temperature,
            ignore_eos=r.ignore_eos,  # rollout.forced_lengths (a benchmark's) does not apply
        )
        self.graphdef = self.mesh = self.to_rollout = None

    def on(self, graphdef, mesh, to_rollout) -> Evaluator:
        """The policy's model graphdef and the generation layout: its mesh and the reshard of training-
        layout params into it (runtime/placement.py Placement.generate.mesh / to_rollout)."""
        self.graphdef, self.mesh, self.to_rollout = graphdef, mesh, to_rollout
        return self

    @classmethod
    def for_run(cls, cfg: RunConfig) -> Evaluator | None:
        """The run's evaluator (None without eval.path), with the run's tokenizer and reward."""
        if not cfg.eval.enabled:
            return None
        return cls(cfg, load_tokenizer(cfg.data), resolve_reward(cfg.data), chief=jax.process_index() == 0)

    def path(self, step: int) -> str:
        return os.path.join(self.cfg.train.run_dir, "eval", f"step_{step}.jsonl")

    def run(self, step: int, actor_params, out: str | None = None) -> dict[str, float]:
        """Evaluate the policy `actor_params` (training layout) as of step `step`; returns the metrics
        and writes the per-prompt results to `out` (default: <run_dir>/eval/step_<step>.jsonl)."""
        t0 = time.perf_counter()
        model = nnx.merge(self.graphdef, self.to_rollout(actor_params))
        sampler = Sampler(model, self.sampler_config, tokenizer=self.tokenizer, mesh=self.mesh)
        if self.cfg.env.name != "single_turn":
            return self._run_episodes(step, sampler, out, t0)
        outs = sampler.generate([r["prompt_tokens"] for r in self.records], self.params)
        stops = (*sampler.eos_ids, *self.params.stop_token_ids)  # where the sampler stops a sequence
        del sampler, model  # its KV pool goes with it
        n = self.cfg.eval.n
        comps = [c.tokens.tolist() for o in outs for c in o.completions]
        samples = make_samples(
            [r["prompt"] for r in self.records],
            [r["answer"] for r in self.records],
            [{k: v for k, v in r.items() if k not in RECORD_KEYS} for r in self.records],
            comps,
            self.tokenizer,
            group_size=n,
            stop_ids=stops,
        )
        rewards, errors = score(samples, self.reward_fn, self.cfg.data.reward_on_error, self.reward_name)
        scores = rewards.reshape(len(self.records), n)
        if self.chief:
            self._write(out or self.path(step), samples, scores)
        metrics = val_metrics([r["data_source"] for r in self.records], scores, self.cfg.eval.pass_threshold)
        metrics["val-aux/reward/errors"] = float(errors)
        metrics["timing_s/testing"] = time.perf_counter() - t0
        return metrics

    def _run_episodes(self, step: int, sampler, out: str | None, t0: float) -> dict[str, float]:
        """Every eval prompt's eval.n samples as episodes of the run's environment (module doc)."""
        from rpeg_jax.env.runner import EnvRunner
        from rpeg_jax.sampling.episodes import EpisodeDriver

        runner = EnvRunner.build(self.cfg, self.tokenizer)
        try:
            drv = EpisodeDriver(sampler, runner, self.params, max_total_tokens=self.cfg.rollout.max_new_tokens)
            res = drv.run(self.records, group=self.cfg.eval.n)
            env_metrics = runner.metrics([r.session.stats for r in res])
        finally:
            runner.close()
        del sampler
        n = self.cfg.eval.n
        scores = np.asarray([r.reward for r in res], np.float64).reshape(len(self.records), n)
        if self.chief:
            lines = []
            for i, r in enumerate(self.records):
                mine = res[i * n : (i + 1) * n]
                added = [_after_prompt(e.session.episode.messages) for e in mine]
                line = {
                    "id": r["id"],
                    "data_source": r["data_source"],
                    "prompt_text": mine[0].session.prompt_text or r["prompt"],  # with an episode's tools rendered in
                    "completions": [self.tokenizer.decode(e.response_ids) for e in mine],
                    "episodes": added,
                    "answer": r["answer"],
                    "scores": [float(x) for x in scores[i]],
                }
                lines.append(json.dumps(line) + "\n")
            write_atomic(out or self.path(step), "".join(lines))
        metrics = val_metrics([r["data_source"] for r in self.records], scores, self.cfg.eval.pass_threshold)
        metrics.update({f"val-aux/{k}": v for k, v in env_metrics.items() if k.startswith("env/")})
        metrics["val-aux/reward/errors"] = float(sum(int(e.session.stats.errors.get("env_exception", 0)) for e in res))
        metrics["timing_s/testing"] = time.perf_counter() - t0
        return metrics

    def _write(self, path: str, samples, scores: np.ndarray) -> None:
        n = scores.shape[1]
        lines = []
        for i, r in enumerate(self.records):
            line = {
                "id": r["id"],
                "data_source": r["data_source"],
                "prompt_text": r["prompt"],
                "completions": [s.completion for s in samples[i * n : (i + 1) * n]],
                "answer": r["answer"],
                "scores": [float(x) for x in scores[i]],
            }
            lines.append(json.dumps(line) + "\n")
        write_atomic(path, "".join(lines))
