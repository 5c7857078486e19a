"""The paged sampler's greedy decoding of the Qwen3 and Qwen3-MoE fixtures equals transformers' own
full-forward greedy (issue 33): hf/<name>/greedy.npz holds the tokens transformers chose by
recomputing the whole sequence at every step (tests/fixtures/make_greedy_fixtures.py), so this
compares against the other implementation, not our own forward (tests/test_sampler.py and
tests/test_sampler_moe.py compare with our plain forward)."""

import os

import numpy as np
import pytest

from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FIXED = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
BASE = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **FIXED)


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_greedy_equals_transformers_full_forward_greedy(name):
    f = np.load(os.path.join(HF, name, "greedy.npz"))
    assert f["margins"].min() > 2e-4  # no step that a logit difference within the 1e-4 parity could flip
    prompts = [row[:n].tolist() for row, n in zip(f["prompts"], f["lengths"])]
    model = load_hf(os.path.join(HF, name))
    new = f["tokens"].shape[1]
    outs = Sampler(model, BASE).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    got = [o.completions[0].tokens.tolist() for o in outs]
    assert got == f["tokens"].tolist()
    assert len({tuple(t) for t in got}) > 1  # the prompts lead to different continuations
