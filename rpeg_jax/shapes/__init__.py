"""The shapes floor: every rule that both the program and the cost model follow, written once.

Pure Python and NumPy (no JAX, no other rpeg_jax package): the sampler, the runtime, the learner,
the cost model and the benchmarks import these functions instead of keeping copies in sync by
comment. What lives here:

    buckets    page-table width buckets and the decode chunk's alignment to them; the response and
               prompt length bucket; pow2ceil
    packing    first-fit-decreasing packing of sequences into rows, and the row / token quanta of a
               packed update
    logits     the logits budget: how many positions' logits one chunk of the LM head materialises
    flops      one FLOP model of the transformer (per layer matmuls, LM head, causal attention), of
               one generation and of one training pass
    admission  the continuous-admission policy's pure decisions: top-up, FIFO admission, the
               decode chunk's early release, the staleness bound, the step's batch

tests/test_layers.py keeps this package at the bottom: it imports nothing from rpeg_jax and no
device library, and every other package may import it.
"""
