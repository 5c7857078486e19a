"""`Sampler`: the paged-attention generation engine the runtime calls every RL step.

    sampler = Sampler(model, SamplerConfig(page_size=16, max_slots=128, max_seq_len=64))
    outs = sampler.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=32))
    outs[i].completions[j].tokens / .logprobs / .finish_reason / .policy_versions / .num_preemptions
    sampler.update_weights(new_params)      # after each optimizer step; never recompiles
    sampler.stats()

The host loop (`step`) alternates bookkeeping (`sampling/scheduler.py`, `sampling/allocator.py`) with
device calls (`sampling/engine.py`): admit whole groups and prefill each prompt once (the group's
other members get the prompt's full pages shared and the partial last page copied), reserve pages for
the next chunk, run up to K decode steps in one jitted while_loop, read tokens and logprobs back once,
retire finished sequences (their pages return to the pool) and admit new ones.

A chunk ends early where the page-table width bucket would grow (after min_chunk_steps), so each
step gathers at most about twice the key columns it needs; with `release_slots` (continuous
admission) also once the first waiting group's worth of slots has freed (after min_chunk_steps),
so a freed slot idles at most until then instead of to the chunk's end.

Shapes that reach the compiler are bucketed: decode is [max_slots] x page-table widths in the
sequence min_table_width * table_width_growth^i (powers of two by default), the last one capped at
ceil(max_seq_len / page_size); prefill is power-of-two rows x power-of-two lengths (>= min_prefill_len).
Everything else (sampling settings, lengths, step limits, stop ids) is a traced argument.

On a mesh with a `data` axis D > 1 dividing max_slots the page pool is split over `data` by default
(SamplerConfig.kv_pool, sampling/sharding.py): slot b and its pages live in shard b // (max_slots / D),
a GRPO group is admitted into one shard, and prefill rows / fork copies are laid out in D blocks of
equal (bucketed) size. `config.num_pages` counts the global pool: ceil(num_pages / D) per shard.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.rollout import resolve_attention
from rpeg_jax.sampling import engine
from rpeg_jax.sampling.allocator import ShardedPages
from rpeg_jax.sampling.forward import choose_forward
from rpeg_jax.sampling.scheduler import Scheduler, Sequence
from rpeg_jax.sampling.sharding import SamplerSharding, mesh_of
from rpeg_jax.sampling.stops import StopMatcher
from rpeg_jax.sampling.types import Completion, RequestOutput, SamplerConfig, SamplingParams
from rpeg_jax.sampling.weights import CompileCounter, ParamSignature, as_params
from rpeg_jax.shapes import admission as policy
from rpeg_jax.shapes.buckets import TableWidths, pow2ceil

_COMPILES = CompileCounter()


class Sampler:
    """Generation engine over one model shape; see the module docstring."""

    def __init__(
        self,
        model: nnx.Module,
        config: SamplerConfig | None = None,
        *,
        tokenizer: Any = None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        cfg = config or SamplerConfig()
        cfg.validate()
        mcfg = model.cfg
        backend = jax.default_backend()
        cfg.check_backend(backend, mcfg.head_size)  # before anything is placed or compiled
        self.cfg, self.model_cfg, self.tokenizer = cfg, mcfg, tokenizer
        self.max_seq_len = cfg.max_seq_len or mcfg.max_position_embeddings
        if self.max_seq_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"{cfg.config_path}.max_seq_len",
                self.max_seq_len,
                f"exceeds model.max_position_embeddings={mcfg.max_position_embeddings}",
            )
        per_seq = -(-self.max_seq_len // cfg.page_size)
        graphdef, params = as_params(model)
        self.sharding = SamplerSharding(mesh or mesh_of(params), mcfg.num_kv_heads, cfg.max_slots, cfg.kv_pool)
        d = self.sharding.pool_shards
        slots = cfg.max_slots // d
        # num_pages is the GLOBAL count (every shard's null page included); each shard gets an equal
        # ceil(num_pages / D) pages (the total is rounded up to a multiple of D).
        per_shard = (
            -(-cfg.num_pages // d)
            if cfg.num_pages
            else (1 + slots * per_seq + math.ceil(cfg.watermark * slots * per_seq))
        )
        if per_shard - 1 < per_seq:  # one line naming the run's key (rollout.num_pages), before compiling
            where = f"; {per_shard} per shard of the pool split over data={d}" if d > 1 else ""
            raise ConfigError(
                f"{cfg.config_path}.num_pages",
                cfg.num_pages or per_shard * d,
                f"cannot hold one sequence of max_seq_len={self.max_seq_len} tokens "
                f"({per_seq} pages of {cfg.page_size} + the null page{where})",
            )
        # (shape checks above run before anything is compiled; placing params moves no data)
        params = self.sharding.place_params(params)
        self._signature = ParamSignature.of(params)
        experts = self.sharding.expert_layout(params)  # a mixture's experts split over mesh axes
        self._fwd = choose_forward(cfg.forward, graphdef, mcfg, rows=cfg.max_slots, experts=experts)
        self._routed = any(mcfg.sparse_layers)  # MoE: record every token's experts (Completion.experts)
        # What the device functions read: the params themselves (model forward; the caller must not
        # donate them afterwards) or per-layer copies (split forward).
        self._weights = self._fwd.prepare(params)
        self._attention = resolve_attention(cfg.attention, backend, page_size=cfg.page_size, head_dim=mcfg.head_size)
        # the kernel's shard_map over kv-head shards (sampling/kernel_attention.py)
        self._heads_mesh = self.sharding.mesh if self._attention == "kernel" and self.sharding.heads_sharded else None
        self.num_pages = per_shard * d  # global, with the D null pages
        self.pages_per_shard = per_shard
        # The widest table any sequence needs; the last width bucket is capped here, not rounded up
        # (a rounded-up last bucket made the final chunk's attention read up to ~2x the columns).
        self.max_width = per_seq
        self.widths = TableWidths(cfg.page_size, per_seq, cfg.min_table_width, cfg.table_width_growth)
        self.eos_ids = tuple(cfg.eos_token_ids if cfg.eos_token_ids is not None else mcfg.end_ids)
        kv_dtype = jnp.dtype(cfg.kv_dtype or mcfg.dtype)
        self.pools = engine.make_pools(
            mcfg.num_layers,
            self.num_pages,
            cfg.page_size,
            mcfg.num_kv_heads,
            mcfg.head_size,
            kv_dtype,
            self.sharding.pools,
        )
        self.alloc = ShardedPages(d, per_shard, cfg.page_size, cfg.max_slots, debug=cfg.debug_checks)
        self.sched = Scheduler(self.alloc, math.ceil(cfg.watermark * (per_shard - 1)))
        self.version, self._pending = 0, None
        self._calls = 0
        self._stats = dict(
            new_tokens=0,
            prefill_tokens=0,
            chunks=0,
            decode_steps=0,
            pages_peak=0,
            shard_pages_peak=0,
            recompiles=0,
            xla_compiles=0,
            generate_s=0.0,
            last_tokens_per_s=0.0,
            page_copies=0,
            busy_slot_steps=0,  # decode steps x slots that produced a token (occupancy = busy / slot_steps)
            slot_steps=0,
        )

    # ---- public API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | None = None,
        *,
        prompt_ids: Seq[int] | None = None,
        lengths: Seq[Seq[int]] | None = None,
        sample_offset: int = 0,
    ) -> list[RequestOutput]:
        """Sample params.n completions of every prompt; returns one RequestOutput per prompt.
        `prompt_ids` (default 0..len-1) name each prompt's random stream together with params.seed;
        `lengths[i][j]` (optional) caps completion j of prompt i below params.max_new_tokens.
        `sample_offset`: the completions are samples sample_offset .. sample_offset + n - 1 of each
        prompt (a sample's stream is (seed, prompt id, sample index)), so a process generating part
        of a group gets the tokens those samples have in a generate of the whole group."""
        t0 = time.perf_counter()
        seqs = self.submit(prompts, params, prompt_ids=prompt_ids, lengths=lengths, sample_offset=sample_offset)
        while any(s.finish_reason is None for s in seqs):
            self.step()
        dt = time.perf_counter() - t0
        n_new = sum(len(s.tokens) for s in seqs)
        self._stats["generate_s"] += dt
        self._stats["last_tokens_per_s"] = n_new / dt if dt > 0 else 0.0
        return self._outputs(prompts, seqs)

    def submit(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | None = None,
        *,
        prompt_ids: Seq[int] | None = None,
        lengths: Seq[Seq[int]] | None = None,
        keep: bool = False,
        sample_offset: int = 0,
    ) -> list[Sequence]:
        """Queue prompts (streaming use: then call `step()` until the sequences finish; `abort`
        takes queued or running sequences back out). `keep`: a sequence that finishes is paused, its
        slot and KV held, for `resume` (append tokens, e.g. an episode's observation, and sample on)
        or `release`. `sample_offset`: as in `generate`."""
        params = params or SamplingParams()
        params.validate()
        if not 0 <= int(sample_offset) < 2**31 - params.n:
            raise ValueError(f"generate: sample_offset={sample_offset} must be in [0, 2**31 - n)")
        prompts = [list(map(int, p)) for p in prompts]
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
        if len(prompt_ids) != len(prompts):
            raise ValueError(f"generate: prompt_ids has {len(prompt_ids)} entries for {len(prompts)} prompts")
        seed = params.seed if params.seed is not None else self.cfg.seed + self._calls
        self._calls += 1
        opts = _Options.build(self, params, seed)
        for i, p in enumerate(prompts):
            self._check_prompt(i, p, params)
        news = [[params.max_new_tokens] * params.n for _ in prompts] if lengths is None else lengths
        if len(news) != len(prompts):
            raise ValueError(f"generate: lengths has {len(news)} entries for {len(prompts)} prompts")
        for i, row in enumerate(news):
            if len(row) != params.n or not all(1 <= int(n) <= params.max_new_tokens for n in row):
                raise ValueError(
                    f"generate: lengths[{i}]={list(row)}: need {params.n} lengths in [1, max_new_tokens="
                    f"{params.max_new_tokens}]"
                )
        all_seqs = []
        for i, p in enumerate(prompts):
            seqs = [
                Sequence(
                    request=i,
                    sample_index=int(sample_offset) + j,
                    prompt=p,
                    end=len(p) + int(news[i][j]),
                    opts=(opts, prompt_ids[i]),
                    keep=keep,
                )
                for j in range(params.n)
            ]
            self.sched.submit(seqs)
            all_seqs += seqs
        return all_seqs

    def resume(
        self, seq: Sequence, append: Seq[int], params: SamplingParams | None = None, *, prompt_id: int
    ) -> Sequence:
        """Continue a paused sequence (submitted with keep, finished): `append` (e.g. an episode's
        observation ids) goes after its tokens and a new sequence samples on from there with `params`
        (n = 1; the random stream of `prompt_id`, sample 0). Its KV stays in its slot: only its last
        token and `append` are prefilled (at the next step, before waiting groups are admitted), not
        the sequence again; it is paused again when it finishes (keep). Returns the new sequence,
        whose prompt is seq's prompt + tokens + append."""
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:
            raise ValueError(f"resume: sampling_params.n={params.n}: a resumed sequence is one sample")
        prompt = seq.known() + [int(t) for t in append]
        seed = params.seed if params.seed is not None else self.cfg.seed + self._calls
        self._calls += 1
        opts = _Options.build(self, params, seed)
        self._check_prompt(0, prompt, params)
        new = Sequence(
            request=seq.request,
            sample_index=0,
            prompt=prompt,
            end=len(prompt) + params.max_new_tokens,
            opts=(opts, int(prompt_id)),
            keep=seq.keep,
            experts=seq.experts,
        )
        self.sched.resume(seq, new)
        return new

    def release(self, seq: Sequence) -> None:
        """A paused sequence's slot and KV pages go back (it will not be resumed)."""
        self.sched.release(seq)

    def step(self) -> list[Sequence]:
        """Admit, prefill, run one decode chunk, retire finished sequences; returns them."""
        if self._pending is not None and not self.sched.running:
            self._swap(*self._pending)
        if self._pending is None:
            self._prefill(self.sched.admit(self.cfg.chunk_steps))
        k, _ = self.sched.reserve(self.cfg.chunk_steps)
        k = self._align_chunk(k)
        self._stats["pages_peak"] = max(self._stats["pages_peak"], self.alloc.num_used)
        self._stats["shard_pages_peak"] = max(self._stats["shard_pages_peak"], *self.alloc.used_per_shard())
        done = self._decode(k) if k else []
        if self._pending is not None and not self.sched.running:
            self._swap(*self._pending)  # the old weights' last sequences just finished
        return done

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Swap in new weights (same tree, shapes, dtypes, shardings: no recompile; else ValueError).
        In-flight sequences follow config.on_weight_update: "finish" (default) lets them finish with
        the old weights before the new ones serve anything; "recompute" drops their KV and
        recomputes it with the new weights; "continue" swaps at once, the sequences go on from the
        KV the old weights made (partial rollout). Tokens so far keep their versions."""
        _, new = as_params(params)
        new = self.sharding.place_params(new)
        self._signature.check(new)
        version = self.version + 1 if version is None else int(version)
        if not self.sched.running or self.cfg.on_weight_update == "continue":
            self._swap(new, version)
        elif self.cfg.on_weight_update == "recompute":
            self.sched.preempt_all()
            self._swap(new, version)
        else:
            self._pending = (new, version)

    def abort(self, seqs: Seq[Sequence]) -> None:
        """Take sequences out of the engine, queued or running (their slots and pages are freed);
        finished ones are left as they are. Their finish_reason becomes "abort"."""
        self.sched.abort([s for s in seqs if s.finish_reason is None])

    def stats(self) -> dict:
        """Throughput, page usage, preemptions and compile counts so far. Page counts exclude the
        null pages; with a sharded pool `shard_pages_*` are per shard (`shard_pages_peak`: the
        fullest shard's peak, `pages_peak`: the peak of the sum)."""
        s = dict(self._stats)
        shards = self.alloc.num_shards
        s.update(
            pages_total=self.num_pages - shards,
            pages_used=self.alloc.num_used,
            page_usage=self.alloc.num_used / (self.num_pages - shards),
            pool_shards=shards,
            shard_pages_total=self.pages_per_shard - 1,
            shard_pages_used=self.alloc.used_per_shard(),
            preemptions=self.sched.num_preemptions,
            policy_version=self.version,
            tokens_per_s=s["new_tokens"] / s["generate_s"] if s["generate_s"] > 0 else 0.0,
        )
        return s

    # ---- snapshots (checkpoints of an engine with sequences in flight) --------------------------
    def snapshot(self, seqs: Seq[Sequence]) -> tuple[dict, dict]:
        """The engine's whole state: (host state as JSON, host arrays: "k_pages", "v_pages" the KV
        of the pages in use, [L, K, n, S, E], in the order of `used_pages`; "tokens", "logprobs",
        "versions" every sequence's generated ones, concatenated in the order of `seqs`).
        `seqs`: every sequence the caller holds that is queued, running, or finished in a group
        still in flight; the state names them by their index in `seqs` (`restore` returns them in
        that order). With the KV pages, the scheduler's queues and slots, the allocator's pages and
        every sequence's tokens, logprobs, versions and random stream (seed, prompt id, sample id)
        restored, decoding continues bit-exactly: nothing is re-prefilled. Only the pages in use
        are saved: a free page (the null page included) is never read unmasked (attention selects
        its columns away, sampling/paged_attention.py), so what it holds changes nothing. The
        weights are not saved: under continuous admission (on_weight_update continue/recompute,
        never a pending swap) the next step installs the newest actor before any decode."""
        if self._pending is not None:
            raise RuntimeError("Sampler.snapshot: a weight swap is pending (on_weight_update=finish)")
        index = {id(s): i for i, s in enumerate(seqs)}
        held = [s for g in (*self.sched.waiting, *self.sched.running) for s in g.seqs]
        held += [*self.sched.paused, *(s for s, _ in self.sched.resuming)]
        missing = [s for s in held if id(s) not in index]
        if missing:
            raise RuntimeError(f"Sampler.snapshot: {len(missing)} sequences in the engine are not in `seqs`")
        opts, opt_index = [], {}
        for s in seqs:
            if id(s.opts[0]) not in opt_index:
                opt_index[id(s.opts[0])] = len(opts)
                opts.append({"params": _params_json(s.opts[0].params), "seed": s.opts[0].seed})
        state = {
            "version": self.version,
            "calls": self._calls,
            "stats": dict(self._stats),
            "opts": opts,
            "seqs": [s.state(opt_index[id(s.opts[0])]) for s in seqs],
            "sched": self.sched.state(index),
            "alloc": self.alloc.state(),
        }
        used = self.used_pages()
        idx = np.zeros(pow2ceil(max(len(used), 1)), np.int32)  # bucketed: few compiled gathers
        idx[: len(used)] = used
        pages = jax.device_get(_take_pages(self.pools, jnp.asarray(idx)))
        arrays = {
            "k_pages": pages[0][:, :, : len(used)],
            "v_pages": pages[1][:, :, : len(used)],
            # every sequence's generated tokens, logprobs (float32: exact) and versions, concatenated
            "tokens": np.array([t for s in seqs for t in s.tokens], np.int32),
            "logprobs": np.array([x for s in seqs for x in s.logprobs], np.float32),
            "versions": np.array([v for s in seqs for v in s.versions], np.int32),
        }
        return state, arrays

    def used_pages(self) -> np.ndarray:
        """Global page ids (shard * pages_per_shard + local id) of the pages in use, shard by shard."""
        per = [d * self.pages_per_shard + np.flatnonzero(a.refcount > 0) for d, a in enumerate(self.alloc.allocs)]
        return np.concatenate(per).astype(np.int32)

    def restore(self, state: dict, arrays: dict) -> list[Sequence]:
        """Continue from `snapshot`'s (state, arrays); returns the sequences in the order given to it.
        Call it on a fresh Sampler of the same settings (its free pages are zero). The arrays may be
        longer than the state says (padded to another process's length: runtime/resume.py)."""
        opts = [
            _Options.build(self, SamplingParams(**_params_from(o["params"])), int(o["seed"])) for o in state["opts"]
        ]
        self.alloc.load(state["alloc"])
        used = self.used_pages()
        want = (*self.pools[0].shape[:2], len(used), *self.pools[0].shape[3:])
        arrays = {k: np.asarray(v) for k, v in arrays.items()}  # (the page axis may be padded: cut)
        for name in ("k_pages", "v_pages"):
            x = arrays[name]
            if x.ndim != 5 or x.shape[2] < len(used) or x.shape[:2] + x.shape[3:] != want[:2] + want[3:]:
                raise ValueError(f"Sampler.restore: {name} is {x.shape}, the snapshot's allocator holds {want}")
            if x.dtype != self.pools[0].dtype:
                raise ValueError(f"Sampler.restore: {name} is {x.dtype}, this pool's is {self.pools[0].dtype}")
            arrays[name] = x[:, :, : len(used)]
        ends = np.cumsum([0] + [int(d["generated"]) for d in state["seqs"]])
        if any(arrays[k].ndim != 1 or len(arrays[k]) < ends[-1] for k in ("tokens", "logprobs", "versions")):
            raise ValueError(f"Sampler.restore: the snapshot's sequences hold {ends[-1]} tokens, its arrays fewer")
        cut = lambda k, i, cast: [cast(x) for x in arrays[k][ends[i] : ends[i + 1]].tolist()]  # noqa: E731
        seqs = [
            Sequence.from_state(d, opts, cut("tokens", i, int), cut("logprobs", i, float), cut("versions", i, int))
            for i, d in enumerate(state["seqs"])
        ]
        self.version, self._pending, self._calls = int(state["version"]), None, int(state["calls"])
        self._stats.update(state["stats"])
        self.sched.load(state["sched"], seqs)
        n = pow2ceil(max(len(used), 1))
        idx = np.full(n, self.num_pages, np.int32)  # padding: out of range, dropped
        idx[: len(used)] = used
        pad = lambda x: np.concatenate([np.asarray(x), np.zeros((*want[:2], n - len(used), *want[3:]), x.dtype)], 2)  # noqa: E731
        self.pools = _put_pages(self.pools, jnp.asarray(idx), pad(arrays["k_pages"]), pad(arrays["v_pages"]))
        return seqs

    # ---- device calls -------------------------------------------------------------------------
    def _device(self, fn, *args, **kw):
        before, backend = _COMPILES.count, _COMPILES.backend
        out = fn(*args, **kw)
        self._stats["recompiles"] += _COMPILES.count - before  # jit cache misses (traces)
        self._stats["xla_compiles"] += _COMPILES.backend - backend
        return out

    def _prefill(self, plan) -> None:
        d, mesh = self.alloc.num_shards, self.sharding.shard_mesh
        todo = [(slot, t, 0) for slot, t in plan.rows] + list(plan.appends)  # appends: after cached KV
        if todo:
            # D blocks of r_b rows, block i = shard i's rows (the row axis is split over `data`).
            per = [[(slot, t, a) for slot, t, a in todo if self.alloc.shard(slot) == i] for i in range(d)]
            r_b = pow2ceil(max(max(len(p) for p in per), -(-self.cfg.min_prefill_rows // d)))
            longest = max(len(t) for _, t, _ in todo)
            t_b = pow2ceil(max(self.cfg.min_prefill_len, longest))
            reach = max(a + len(t) for _, t, a in todo)  # the table covers every row's last position
            w_b = min(pow2ceil(-(-max(t_b, reach) // self.cfg.page_size)), pow2ceil(self.max_width))
            tokens = np.zeros((d * r_b, t_b), np.int32)
            lengths = np.zeros((d * r_b,), np.int32)
            starts = np.zeros((d * r_b,), np.int32)
            table = np.zeros((d * r_b, w_b), np.int32)
            for i, rows in enumerate(per):
                for r, (slot, toks, a) in enumerate(rows, start=i * r_b):
                    tokens[r, : len(toks)], lengths[r], starts[r] = toks, len(toks), a
                    table[r] = self.alloc.table([slot], w_b)[0]
            out = self._device(
                engine.prefill,
                self._fwd,
                self._weights,
                self.pools,
                *self.sharding.put_rows(tokens, lengths, table, starts),
                mesh=mesh,
                heads_sharded=self.sharding.heads_sharded,
                routed=self._routed,
            )
            if self._routed:
                self.pools, experts = out
                self._record_prefill(plan, per, r_b, np.asarray(jax.device_get(experts)))
            else:
                self.pools = out
            self._stats["prefill_tokens"] += int(lengths.sum())
        if plan.copies:
            per = [[(src, dst) for sh, src, dst in plan.copies if sh == i] for i in range(d)]
            n = pow2ceil(max(len(p) for p in per))
            src = np.zeros((d * n,), np.int32)
            dst = np.full((d * n,), self.pages_per_shard, np.int32)  # out of range: dropped
            for i, pairs in enumerate(per):
                if pairs:
                    src[i * n : i * n + len(pairs)], dst[i * n : i * n + len(pairs)] = zip(*pairs)
            self.pools = self._device(engine.fork_pages, self.pools, *self.sharding.put_pages(src, dst), mesh=mesh)
            self._stats["page_copies"] += len(plan.copies)

    def _decode(self, k: int) -> list[Sequence]:
        seqs = self.sched.running_seqs()
        st = self._decode_state(seqs, k)
        self.pools, res = self._device(
            engine.decode_chunk,
            self._fwd,
            self._weights,
            self.pools,
            st,
            jnp.int32(k),
            self._release(),
            chunk=self.cfg.chunk_steps,
            attention=self._attention,
            block_pages=self.cfg.block_pages,
            mesh=self.sharding.shard_mesh,
            heads_sharded=self.sharding.heads_sharded,
            interpret=self.cfg.kernel_interpret and self._attention == "kernel",
            heads_mesh=self._heads_mesh,
            routed=self._routed,
        )
        toks, logps, steps, experts = jax.device_get((res.tokens_KxB, res.logprobs_KxB, res.steps, res.experts_KxBxSxK))
        steps = int(np.max(steps))  # one count per shard with a sharded pool (shards loop on their own)
        self._stats["chunks"] += 1
        self._stats["decode_steps"] += int(steps)
        self._stats["slot_steps"] += int(steps) * self.cfg.max_slots
        self._stats["busy_slot_steps"] += int((toks[:steps] >= 0).sum())
        done = []
        for s in seqs:
            col = toks[:steps, s.slot]
            n = int((col >= 0).sum())
            s.tokens += col[:n].tolist()
            s.logprobs += logps[:n, s.slot].tolist()
            s.versions += [self.version] * n
            if experts is not None:  # the experts of the n inputs this chunk ran (positions pos .. pos+n-1)
                run, old = experts[:n, s.slot], s.pos - n
                s.experts = run if s.experts is None else np.concatenate([s.experts[:old], run])
            before = len(s.tokens)
            reason = s.opts[0].finish_reason(s, n)  # may truncate at a stop sequence
            self._stats["new_tokens"] += n - (before - len(s.tokens))
            if reason is not None:
                self.sched.finish(s, reason)
                done.append(s)
        return done

    def _record_prefill(self, plan, per, r_b: int, experts) -> None:
        """Store the prefilled positions' experts on their sequences (a fresh group's prompt, run once
        in its first slot, is every member's; an append goes after the positions before its start)."""
        by_slot = {s.slot: (g, s) for g in plan.groups for s in g.seqs}
        for i, rows in enumerate(per):
            for r, (slot, toks, a) in enumerate(rows, start=i * r_b):
                g, s = by_slot[slot]
                rec = experts[r, : len(toks)]
                if a:
                    s.experts = np.concatenate([s.experts[:a], rec])
                    continue
                for t in g.seqs if g.fresh else [s]:
                    t.experts = rec.copy()

    def _release(self):
        """decode_chunk's early exit: (min steps, slots freed) = (min_chunk_steps, the first waiting
        group's size) with release_slots and a group waiting; else never (slots > max_slots)."""
        release = self.cfg.release_slots and self._pending is None
        first = [len(self.sched.waiting[0].seqs)] if self.sched.waiting else []
        return np.array(policy.release_rule(release, first, self.cfg.min_chunk_steps, self.cfg.max_slots), np.int32)

    def _running_ends(self) -> tuple[np.ndarray, np.ndarray]:
        seqs = self.sched.running_seqs()
        return np.array([s.pos for s in seqs], np.int64), np.array([s.end for s in seqs], np.int64)

    def _width(self, k: int) -> int:
        """Page-table width bucket covering k more steps of every running sequence."""
        return self.widths.pages(*self._running_ends(), k)

    def _align_chunk(self, k: int) -> int:
        """End the chunk where the width bucket would grow (after at least min_chunk_steps), so
        every step gathers at most ~2x the columns it needs instead of the chunk's final width."""
        return self.widths.align(*self._running_ends(), k, self.cfg.min_chunk_steps)

    def _decode_state(self, seqs: list[Sequence], k: int) -> engine.DecodeState:
        b, cfg = self.cfg.max_slots, self.cfg
        w = self._width(k)
        a = dict(
            token=np.zeros(b, np.int32),
            pos=np.zeros(b, np.int32),
            active=np.zeros(b, bool),
            end=np.zeros(b, np.int32),
            stop=np.full((b, cfg.max_stop_ids), -1, np.int32),
            temp=np.zeros(b, np.float32),
            top_k=np.zeros(b, np.int32),
            top_p=np.ones(b, np.float32),
            min_p=np.zeros(b, np.float32),
            seed=np.zeros(b, np.int32),
            pid=np.zeros(b, np.int32),
            sid=np.zeros(b, np.int32),
        )
        for s in seqs:
            o, pid = s.opts
            i = s.slot
            a["token"][i], a["pos"][i], a["active"][i], a["end"][i] = s.known()[-1], s.pos, True, s.end
            a["stop"][i, : len(o.stop_ids)] = o.stop_ids
            a["temp"][i], a["top_k"][i], a["top_p"][i], a["min_p"][i] = o.temperature, o.top_k, o.top_p, o.min_p
            a["seed"][i], a["pid"][i], a["sid"][i] = o.seed, pid, s.sample_index
        table = self.alloc.table(range(b), w)
        return self.sharding.put_state(
            engine.DecodeState(
                a["token"],
                a["pos"],
                a["active"],
                a["end"],
                table,
                a["stop"],
                a["temp"],
                a["top_k"],
                a["top_p"],
                a["min_p"],
                a["seed"],
                a["pid"],
                a["sid"],
            )
        )

    # ---- helpers ------------------------------------------------------------------------------
    def _swap(self, params, version: int) -> None:
        self.version, self._pending = version, None
        self._weights = self._device(self._fwd.prepare, params)

    def _check_prompt(self, i: int, p: list[int], params: SamplingParams) -> None:
        v = self.model_cfg.vocab_size
        if not p:
            raise ValueError(f"generate: prompts[{i}] is empty (a prompt needs at least one token, e.g. bos)")
        if min(p) < 0 or max(p) >= v:
            raise ValueError(
                f"generate: prompts[{i}] has token ids outside [0, vocab_size={v}): min {min(p)}, max {max(p)}"
            )
        if len(p) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"generate: prompts[{i}] length {len(p)} + max_new_tokens={params.max_new_tokens} "
                f"exceeds sampler.max_seq_len={self.max_seq_len}"
            )

    def _outputs(self, prompts, seqs: list[Sequence]) -> list[RequestOutput]:
        outs = [RequestOutput(prompt_index=i, prompt_tokens=list(p)) for i, p in enumerate(prompts)]
        for s in seqs:
            outs[s.request].completions.append(
                Completion(
                    tokens=np.asarray(s.tokens, np.int32),
                    logprobs=np.asarray(s.logprobs, np.float32),
                    finish_reason=s.finish_reason,
                    policy_versions=np.asarray(s.versions, np.int32),
                    num_preemptions=s.preemptions,
                    sample_index=s.sample_index,
                    experts=self.experts_of(s),
                )
            )
        for o in outs:
            o.completions.sort(key=lambda c: c.sample_index)
        return outs

    def experts_of(self, s: Sequence):
        """[prompt + tokens, S, k] experts of the sequence's tokens (-1 where never run); None for a
        dense model."""
        if not self._routed:
            return None
        n = len(s.prompt) + len(s.tokens)
        out = np.full((n, sum(self.model_cfg.sparse_layers), self.model_cfg.num_experts_per_tok), -1, np.int16)
        rec = s.experts if s.experts is not None else out[:0]
        m = min(n, len(rec))
        out[:m] = rec[:m]
        return out


class _Options:
    """Resolved per-request settings shared by the request's sequences."""

    def __init__(self, params: SamplingParams, seed: int, stop_ids: tuple[int, ...], matcher: StopMatcher):
        self.params = params  # what a snapshot saves (Sampler.snapshot), built again on restore
        self.temperature, self.top_k, self.top_p, self.min_p = (
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
        )
        self.seed, self.stop_ids, self.matcher = seed, stop_ids, matcher

    @classmethod
    def build(cls, sampler: Sampler, params: SamplingParams, seed: int) -> "_Options":
        v = sampler.model_cfg.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < v:
                raise ValueError(f"sampling_params.stop_token_ids: {t} outside [0, vocab_size={v})")
        ids = tuple(dict.fromkeys((() if params.ignore_eos else sampler.eos_ids) + tuple(params.stop_token_ids)))
        if len(ids) > sampler.cfg.max_stop_ids:
            raise ValueError(
                f"sampling_params.stop_token_ids: {len(ids)} stop ids (with eos) exceed "
                f"sampler.max_stop_ids={sampler.cfg.max_stop_ids}"
            )
        if not -(2**31) <= seed < 2**31:
            raise ValueError(f"sampling_params.seed={seed}: must fit in int32")
        return cls(params, seed, ids, StopMatcher(params.stop, sampler.tokenizer))

    def finish_reason(self, s: Sequence, n_new: int) -> str | None:
        """'stop' / 'length' / None for a sequence that just received n_new tokens (may truncate it
        at a stop sequence, dropping what the device sampled after it)."""
        cut = self.matcher.find(s.tokens, n_new)
        if cut is not None:
            del s.tokens[cut:], s.logprobs[cut:], s.versions[cut:]
            return "stop"
        if n_new and s.tokens[-1] in self.stop_ids:
            return "stop"
        if len(s.prompt) + len(s.tokens) >= s.end:
            return "length"
        return None


@jax.jit
def _take_pages(pools, idx):
    return tuple(jnp.take(p, idx, axis=2) for p in pools)


def _put_pages(pools, idx, k, v):
    """Pages idx of both pools set to k, v (idx >= the pool's pages: dropped); the pools keep their layout."""
    fn = jax.jit(_set_pages, donate_argnums=0, out_shardings=tuple(p.sharding for p in pools))
    return fn(pools, idx, k, v)


def _set_pages(pools, idx, k, v):
    return pools[0].at[:, :, idx].set(k, mode="drop"), pools[1].at[:, :, idx].set(v, mode="drop")


def _params_json(p: SamplingParams) -> dict:
    """A SamplingParams as JSON (tuples as lists; `_params_from` reads it back)."""
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def _params_from(d: dict) -> dict:
    tup = lambda v: tuple(tuple(x) if isinstance(x, list) else x for x in v)  # noqa: E731
    return {k: tup(v) if isinstance(v, list) else v for k, v in d.items()}
