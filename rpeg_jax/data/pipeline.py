"""The prompt pipeline: records -> grain MapDataset (shuffle, repeat, batch, shard) -> PromptBatch.

    pipe = build_pipeline(cfg, shard_index=jax.process_index(), shard_count=jax.process_count())
    batch = next(pipe)                      # PromptBatch: this process's share of one RL step
    state = pipe.get_state()                # JSON-serialisable; save it with the checkpoint
    pipe.set_state(state)                   # a restored pipeline yields exactly the same batches

Order of operations, all on grain's random-access MapDataset so the iterator state is one
index: shuffle (data.seed; grain reshuffles every epoch with seed + epoch) -> repeat
(data.num_epochs, None = forever) -> batch of data.prompts_per_step records (batches run across
epoch boundaries; only a final partial batch is dropped) -> the process keeps its contiguous
slice [i·P/n, (i+1)·P/n) of every global batch. The global batch at step t is therefore the
same for any number of processes, the state is the same on every process, and a run resumed
on a different number of processes still sees the same data.

Prompts are rendered with the chat template when one is in effect (data/chat.py; the record's
"prompt" is then the rendered text, tokenized with no special tokens added, since the template
writes its own bos), else tokenized as text (bos first when data.add_bos and the tokenizer has one),
and checked against data.max_prompt_len when the pipeline is built, before anything is compiled.

Called by: the runtime (start-up, every step, checkpoints); tests.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import grain
import numpy as np

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.data import DataConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.data.chat import PromptError, PromptFormat, load_prompt_format
from rpeg_jax.data.jsonl import read_jsonl
from rpeg_jax.data.tasks import make_records
from rpeg_jax.data.tokenizer import CharTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger("rpeg_jax")
STATE_FORMAT = "rpeg_jax.data.pipeline/1"
_FINGERPRINT_KEYS = (
    "task",
    "path",
    "split",
    "seed",
    "shuffle",
    "num_epochs",
    "prompts_per_step",
    "num_records",
    "digest",
)


COLUMNS = ("id", "prompt", "prompt_tokens", "answer")  # record fields a PromptBatch holds as columns of their own


def other_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A record's fields besides COLUMNS ("prompt_messages" among them): a PromptBatch's records
    column, and the `record` a reward's Sample carries."""
    return {k: v for k, v in record.items() if k not in COLUMNS}


@dataclass(frozen=True)
class PromptBatch:
    """One step's prompts on this process (P/n of them, n = shard_count)."""

    step: int  # global batch index t (0-based) this came from
    epoch: float  # records consumed / dataset size, at the start of this batch
    ids: tuple[str, ...]
    prompts: tuple[str, ...]  # prompt texts as the model sees them (chat template applied: prompt_text)
    prompt_tokens: tuple[tuple[int, ...], ...]  # token ids, bos first when the tokenizer has one
    answers: tuple[str | None, ...]
    records: tuple[dict[str, Any], ...]  # each record's other fields (task, operands, JSONL extras)

    def __len__(self) -> int:
        return len(self.ids)

    def record(self, i: int) -> dict[str, Any]:
        """Prompt i's record as load_records made it (the columns and the other fields), e.g. what an
        environment starts an episode from (env.base.Environment.start)."""
        cols = {"id": self.ids[i], "prompt": self.prompts[i], "prompt_tokens": list(self.prompt_tokens[i])}
        return {**self.records[i], **cols, "answer": self.answers[i]}


def left_pad(prompt_tokens: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """Left-pad prompts to `length` columns (the rollout layout): tokens_BxP, positions_BxP
    (0 at each prompt's first token, 0 on padding) and segment_ids_BxP (1 real, 0 pad), int32."""
    B = len(prompt_tokens)
    tokens = np.full((B, length), pad_id, np.int32)
    positions = np.zeros((B, length), np.int32)
    segments = np.zeros((B, length), np.int32)
    for b, toks in enumerate(prompt_tokens):
        n = len(toks)
        if n > length:
            raise ValueError(f"prompt {b} has {n} tokens, more than the {length} columns given")
        if n:
            tokens[b, length - n :] = toks
            positions[b, length - n :] = np.arange(n)
            segments[b, length - n :] = 1
    return tokens, positions, segments


def _check_tokenizer(cfg: RunConfig, tok: Tokenizer) -> None:
    m = cfg.model
    if isinstance(tok, CharTokenizer):
        if m.vocab_size < tok.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                m.vocab_size,
                f"the character tokenizer (data.tokenizer=null) needs >= {tok.vocab_size}",
            )
    elif tok.vocab_size > m.vocab_size:  # with model.path the vocabulary is the checkpoint's (config/hf.py)
        vocab = f"model.path={m.path}'s vocab_size" if m.path else "model.vocab_size"
        raise ConfigError(
            "data.tokenizer",
            cfg.data.tokenizer,
            f"has {tok.vocab_size} tokens, more than {vocab}={m.vocab_size}",
        )
    if tok.eos_id not in m.end_ids:  # e.g. Llama 3: config.json's eos is <|end_of_text|>, the tokenizer's <|eot_id|>
        ids = f"model.eos_id={m.eos_id}" + (f", model.eos_ids={list(m.eos_ids)}" if m.eos_ids else "")
        raise ConfigError(
            "model.eos_id",
            m.eos_id,
            f"the tokenizer's eos id is {tok.eos_id}, not {ids}; set model.eos_id={tok.eos_id}",
        )


def load_records(
    cfg: DataConfig,
    tok: Tokenizer,
    split: str = "train",
    *,
    model_path: str | None = None,
    fmt: PromptFormat | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """(records with "prompt_tokens", skipped counts) for a built-in task or a JSONL file. fmt: how
    prompts become text (default: load_prompt_format(cfg, model_path), which auto finds the template
    beside data.tokenizer or in model_path)."""
    bos = [tok.bos_id] if cfg.add_bos and tok.bos_id is not None else []
    fmt = load_prompt_format(cfg, model_path) if fmt is None else fmt

    def encode_prompt(text: str) -> list[int]:
        return bos + tok.encode(text)

    if cfg.task == "jsonl":
        return read_jsonl(cfg.path, cfg, encode_prompt, fmt, tok.encode)
    records = make_records(cfg, split)
    for rec in records:
        if fmt.template is not None:
            try:
                rec["prompt"], rec["prompt_messages"] = fmt.render_prompt(rec["prompt"], "prompt")
            except PromptError as e:
                raise ConfigError("data.chat_template", fmt.template.source, f"task {cfg.task!r}: {e}") from None
            rec["prompt_tokens"] = tok.encode(rec["prompt"])
        else:
            rec["prompt_tokens"] = encode_prompt(rec["prompt"])
        if len(rec["prompt_tokens"]) > cfg.max_prompt_len:
            raise ConfigError(
                "data.max_prompt_len",
                cfg.max_prompt_len,
                f"task {cfg.task!r} with data.max_digits={cfg.max_digits} makes prompts of "
                f"{len(rec['prompt_tokens'])} tokens (e.g. {rec['prompt']!r})",
            )
    return records, {}


def with_data_prompt_len(cfg: RunConfig) -> RunConfig:
    """The config with costmodel.prompt_len set to the longest prompt of the run's JSONL file, as the
    run renders and tokenizes it (chat template, bos), when the cost model would otherwise price
    every prompt at the data.max_prompt_len cap (a JSONL task, costmodel.prompt_len not given).
    Unchanged otherwise (a built-in task's lengths are known; a given prompt_len is the user's)."""
    import dataclasses

    if cfg.data.task != "jsonl" or cfg.costmodel.prompt_len is not None or not cfg.data.path:
        return cfg
    tok = load_tokenizer(cfg.data)
    records, _ = load_records(cfg.data, tok, model_path=cfg.model.path)
    lengths = [len(r["prompt_tokens"]) for r in records]
    if not lengths:
        return cfg
    longest = max(lengths)
    log.info(
        "cost model: prompts priced at %d tokens, the longest of the %d in %s (median %d; data.max_prompt_len=%d)",
        longest,
        len(lengths),
        cfg.data.path,
        int(np.median(lengths)),
        cfg.data.max_prompt_len,
    )
    return dataclasses.replace(cfg, costmodel=dataclasses.replace(cfg.costmodel, prompt_len=longest))


def _digest(records: list[dict]) -> str:
    h = hashlib.sha256()
    for rec in records:
        h.update(f"{rec['id']}\x00{rec['prompt']}\x00{rec['answer']}\x01".encode())
    return h.hexdigest()[:16]


class PromptPipeline:
    """An iterator of PromptBatch with get_state/set_state (see the module doc)."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        records: list[dict],
        *,
        shard_index: int,
        shard_count: int,
        skipped: dict[str, int] | None = None,
        split: str = "train",
    ):
        P = cfg.prompts_per_step
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
        if P % shard_count:
            raise ConfigError(
                "data.prompts_per_step", P, f"must be divisible by the number of processes ({shard_count})"
            )
        epochs = cfg.num_epochs
        if epochs is not None and len(records) * epochs < P:
            raise ConfigError(
                "data.prompts_per_step",
                P,
                f"exceeds the {len(records)} records x data.num_epochs={epochs} available: not one batch",
            )
        self.cfg, self.tokenizer, self.records = cfg, tokenizer, records
        self.skipped = dict(skipped or {})  # bad JSONL lines skipped, by reason (data.on_bad_record=skip)
        self.shard_index, self.shard_count = shard_index, shard_count
        self.per_shard = P // shard_count
        self.fingerprint = {
            "task": cfg.task,
            "path": cfg.path,
            "split": split,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
            "num_epochs": epochs,
            "prompts_per_step": P,
            "num_records": len(records),
            "digest": _digest(records),
        }
        lo = shard_index * self.per_shard
        ds = grain.MapDataset.source(records)
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat(epochs)
        ds = ds.batch(P, drop_remainder=True, batch_fn=list)
        self.dataset = ds.map(lambda batch: batch[lo : lo + self.per_shard])
        self._iter = self._new_iterator()
        self._step = 0

    def _new_iterator(self):
        # In-memory records: no reader threads (grain's advice for data already in memory).
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        return iter(self.dataset.to_iter_dataset(options))

    def __iter__(self) -> PromptPipeline:
        return self

    def __next__(self) -> PromptBatch:
        recs = next(self._iter)  # StopIteration after the last full batch of a finite run
        step = self._step
        self._step += 1
        P = self.cfg.prompts_per_step
        return PromptBatch(
            step=step,
            epoch=step * P / len(self.records),
            ids=tuple(r["id"] for r in recs),
            prompts=tuple(r["prompt"] for r in recs),
            prompt_tokens=tuple(tuple(r["prompt_tokens"]) for r in recs),
            answers=tuple(r["answer"] for r in recs),
            records=tuple(other_fields(r) for r in recs),
        )

    @property
    def num_records(self) -> int:
        return len(self.records)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state; identical on every process (it counts global batches)."""
        return {
            "format": STATE_FORMAT,
            "step": self._step,
            "grain": self._iter.get_state(),
            "fingerprint": dict(self.fingerprint),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the data it was saved with must be the same."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a data pipeline state (expected format {STATE_FORMAT!r})")
        saved = state["fingerprint"]
        for name in _FINGERPRINT_KEYS:
            if saved.get(name) != self.fingerprint[name]:
                field = (
                    name
                    if name in DataConfig.__dataclass_fields__
                    else ("path" if self.cfg.task == "jsonl" else "num_examples")
                )  # num_records, digest
                key = f"data.{field}"
                raise ConfigError(
                    key,
                    self.fingerprint[name],
                    f"the data iterator state being restored was "
                    f"saved with {name}={saved.get(name)!r}; a resumed run needs the same data",
                )
        self._iter = self._new_iterator()
        self._iter.set_state(state["grain"])
        self._step = int(state["step"])


def build_pipeline(
    cfg: RunConfig, *, shard_index: int, shard_count: int, split: str = "train", tokenizer: Tokenizer | None = None
) -> PromptPipeline:
    """The prompt pipeline a run config asks for, validated (tokenizer vs model, prompt lengths,
    bad records) before anything is compiled. The runtime passes each generating process's data shard
    (graph/processes.share_of: its rank among the generating processes, or with more processes than
    prompts the prompt its group of processes shares)."""
    tok = tokenizer or load_tokenizer(cfg.data)
    _check_tokenizer(cfg, tok)
    records, skipped = load_records(cfg.data, tok, split, model_path=cfg.model.path)
    return PromptPipeline(
        cfg.data, tok, records, shard_index=shard_index, shard_count=shard_count, skipped=skipped, split=split
    )


__all__ = ["PromptBatch", "PromptPipeline", "build_pipeline", "left_pad", "load_records"]
