"""bench/generate.py's --attention / --kernel-interpret: the sampler runs with the attention asked for
(the Pallas kernel through the interpreter on CPU), every record carries it, and a kernel without
the interpreter off a GPU is refused naming the flag. The workload is model T shrunk (4 prompts x 8
new tokens) and the machine limits are a fixed stand-in: the limits are not under test here."""

import json
import os
import sys

import jax
import pytest
from helpers import load_file

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
LIMITS = dict(matmul_flops=1e11, bandwidth_bytes_s=1e10, bw_read=1e10, bw_rowsum=1e10, bw_gemv=1e10, bw_copy=1e10)


@pytest.fixture(scope="module")
def gen():
    sys.path.insert(0, BENCH)  # generate.py imports naive_generate from its folder
    try:
        yield load_file("bench_generate", os.path.join(BENCH, "generate.py"))
    finally:
        sys.path.remove(BENCH)


@pytest.fixture
def small(gen, monkeypatch):
    """A shrunk G1-T-greedy, fixed limits, and the attention each Sampler resolved to."""
    monkeypatch.setitem(gen.WORKLOADS, "G1-T-small", ("tiny", 4, 16, 1, 8, 0.0, "matmul"))
    monkeypatch.setattr(gen, "measure_limits", lambda dtype: dict(LIMITS))
    seen = []

    class Recording(gen.Sampler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append((self._attention, self.cfg.kernel_interpret))

    monkeypatch.setattr(gen, "Sampler", Recording)
    return seen


@pytest.mark.parametrize(
    "flags,attention,interpret",
    [
        (["--attention", "gather"], "gather", False),
        # slow (session 24's trim): the kernel itself is tested in tests/test_kernel_attention.py
        pytest.param(["--attention", "kernel", "--kernel-interpret"], "kernel", True, marks=pytest.mark.slow),
    ],
)
def test_records_carry_the_attention_the_sampler_ran(gen, small, tmp_path, flags, attention, interpret):
    out = tmp_path / "g.json"
    argv = ["--workloads", "G1-T-small", "--reps", "1", "--data", "1", "--json", str(out), *flags]
    assert gen.main(argv) == 0
    assert small == [(attention, interpret)]
    recs = json.loads(out.read_text())
    assert [r["variant"] for r in recs] == ["rpeg", "naive"]
    rpeg, naive = recs
    fields = ("attention", "attention_resolved", "kernel_interpret")
    assert [rpeg[k] for k in fields] == [attention, attention, interpret]
    assert [naive[k] for k in fields] == ["dense", "dense", False]
    assert all(r["new_tokens_per_s"] > 0 and r["limit_fraction"] > 0 for r in recs)


def test_auto_resolves_per_backend(gen, small, tmp_path):
    out = tmp_path / "g.json"
    gen.main(["--workloads", "G1-T-small", "--reps", "1", "--data", "1", "--no-naive", "--json", str(out)])
    (rec,) = json.loads(out.read_text())
    want = {"cpu": "chunk", "gpu": "kernel"}[jax.default_backend()]
    assert (rec["attention"], rec["attention_resolved"]) == ("auto", want)
    assert small == [(want, False)]


def test_bad_attention_flags_name_the_flag(gen, small):
    with pytest.raises(SystemExit, match="--attention kernel: .*--kernel-interpret"):
        gen.main(["--workloads", "G1-T-small", "--attention", "kernel"])
    with pytest.raises(SystemExit, match="--attention: unknown 'flash'"):
        gen.main(["--workloads", "G1-T-small", "--attention", "gather,flash"])
    assert small == []  # refused before any sampler was built
