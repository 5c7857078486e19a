"""The grain prompt pipeline: determinism by seed, epochs, sharding, iterator state save/restore."""

import itertools
import json

import numpy as np
import pytest

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.data.pipeline import build_pipeline, left_pad


def _pipe(*overrides, shard_index=0, shard_count=1):
    cfg = load_config(None, list(overrides))
    return build_pipeline(cfg, shard_index=shard_index, shard_count=shard_count)


def _take(pipe, n):
    return list(itertools.islice(pipe, n))


def _ids(batches):
    return [b.ids for b in batches]


def test_batch_contents():
    pipe = _pipe("data.prompts_per_step=4")
    b = next(pipe)
    assert len(b) == 4 and b.step == 0 and b.epoch == 0.0
    for prompt, toks, ans, rec in zip(b.prompts, b.prompt_tokens, b.answers, b.records):
        assert toks == (1,) + tuple(ord(c) for c in prompt)  # bos, then one id per character
        assert ans == prompt[1:-1][::-1] and rec == {"task": "reverse", "digits": prompt[1:-1]}
    assert next(pipe).step == 1


def test_shuffle_determinism_by_seed():
    a = _ids(_take(_pipe("data.seed=5"), 4))
    assert a == _ids(_take(_pipe("data.seed=5"), 4))
    assert a != _ids(_take(_pipe("data.seed=6"), 4))
    ordered = _take(_pipe("data.shuffle=false", "data.prompts_per_step=4"), 2)
    assert _ids(ordered) == [
        tuple(f"reverse/train/{i}" for i in range(4)),
        tuple(f"reverse/train/{i}" for i in range(4, 8)),
    ]


def test_epochs_cover_all_records_and_reshuffle():
    pipe = _pipe("data.num_examples=10", "data.prompts_per_step=4", "data.num_epochs=3")
    batches = list(pipe)
    assert len(batches) == 7  # 30 records -> 7 full batches, the final 2 dropped
    flat = [i for b in batches for i in b.ids]
    everything = sorted(f"reverse/train/{i}" for i in range(10))
    assert sorted(flat[:10]) == everything and sorted(flat[10:20]) == everything
    assert flat[:10] != flat[10:20]  # each epoch shuffled differently
    assert [b.epoch for b in batches[:3]] == [0.0, 0.4, 0.8]
    with pytest.raises(StopIteration):
        next(pipe)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharding_partitions_each_global_batch(n):
    full = _take(_pipe("data.prompts_per_step=12", "data.num_examples=40"), 6)
    shards = [
        _take(_pipe("data.prompts_per_step=12", "data.num_examples=40", shard_index=i, shard_count=n), 6)
        for i in range(n)
    ]
    for t, batch in enumerate(full):
        parts = [s[t] for s in shards]
        assert all(len(p) == 12 // n and p.step == t for p in parts)
        assert sum((p.ids for p in parts), ()) == batch.ids  # contiguous slices in shard order
        assert sum((p.prompt_tokens for p in parts), ()) == batch.prompt_tokens
        seen = [set(p.ids) for p in parts]
        assert all(not (seen[i] & seen[j]) for i in range(n) for j in range(i + 1, n))  # disjoint
        # global position k of this step is read by exactly one shard (coverage)
        assert sorted(i for p in parts for i in p.ids) == sorted(batch.ids)


def _round_trip(state):
    return json.loads(json.dumps(state))  # the state must survive JSON (checkpoint metadata)


@pytest.mark.parametrize("skip", [0, 2, 5])
def test_state_restore_gives_identical_next_batches(skip):
    # 10 records, 4 per step: step 2 (records 8..11) and step 4 (16..19) cross epoch boundaries
    args = ("data.num_examples=10", "data.prompts_per_step=4")
    pipe = _pipe(*args)
    _take(pipe, skip)
    state = _round_trip(pipe.get_state())
    want = _take(pipe, 6)
    restored = _pipe(*args)
    _take(restored, 3)  # a pipeline somewhere else entirely
    restored.set_state(state)
    got = _take(restored, 6)
    assert got == want  # ids, tokens, answers, step and epoch
    assert [b.step for b in got] == list(range(skip, skip + 6))


def test_state_restore_with_another_shard_count():
    args = ("data.num_examples=10", "data.prompts_per_step=4")
    pipe = _pipe(*args)
    _take(pipe, 3)
    state = _round_trip(pipe.get_state())
    want = _take(pipe, 3)
    halves = []
    for i in range(2):
        p = _pipe(*args, shard_index=i, shard_count=2)
        p.set_state(state)
        halves.append(_take(p, 3))
    for t in range(3):
        assert halves[0][t].ids + halves[1][t].ids == want[t].ids


def test_state_from_other_data_is_rejected():
    state = _pipe("data.seed=1").get_state()
    with pytest.raises(ConfigError, match=r"data.seed=2: .*saved with seed=1"):
        _pipe("data.seed=2").set_state(state)
    state = _pipe().get_state()
    with pytest.raises(ConfigError, match=r"data.num_examples=100: .*saved with num_records=4096"):
        _pipe("data.num_examples=100").set_state(state)
    with pytest.raises(ConfigError, match=r"data.num_examples=.*saved with digest="):
        _pipe("data.max_digits=4").set_state(state)  # same size, other records
    with pytest.raises(ValueError, match="not a data pipeline state"):
        _pipe().set_state({"next_index": 3})


def test_config_errors_before_anything_runs():
    with pytest.raises(
        ConfigError, match=r"data.prompts_per_step=6: must be divisible by the number of processes \(4\)"
    ):
        _pipe("data.prompts_per_step=6", shard_count=4)
    with pytest.raises(ConfigError, match=r"data.prompts_per_step=16: exceeds the 5 records x data.num_epochs=2"):
        _pipe("data.num_examples=5", "data.num_epochs=2")
    with pytest.raises(ConfigError, match=r"model.vocab_size=64: the character tokenizer .* needs >= 128"):
        _pipe("model.vocab_size=64")
    with pytest.raises(ConfigError, match=r"model.eos_id=3: the tokenizer's eos id is 2"):
        _pipe("model.eos_id=3")


def test_jsonl_pipeline_exposes_skip_counts(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"q": f"{i}+{i}=", "a": 2 * i}) for i in range(6)] + ["{oops", json.dumps({"a": 1})]
    path.write_text("\n".join(lines) + "\n")
    pipe = _pipe(
        "data.task=jsonl",
        f"data.path={path}",
        "data.prompt_field=q",
        "data.answer_field=a",
        "data.on_bad_record=skip",
        "data.prompts_per_step=3",
        "data.shuffle=false",
    )
    assert pipe.num_records == 6 and pipe.skipped["bad_json"] == 1 and pipe.skipped["missing_field"] == 1
    b = next(pipe)
    assert b.prompts == ("0+0=", "1+1=", "2+2=") and b.answers == ("0", "2", "4")


def test_left_pad_by_hand():
    tokens, positions, segments = left_pad([(1, 5, 6), (1,), ()], 4, pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 1, 5, 6], [0, 0, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(positions, [[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(segments, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
    assert tokens.dtype == positions.dtype == segments.dtype == np.int32
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens"):
        left_pad([(1, 2, 3)], 2, pad_id=0)
