"""rpeg_jax: RL post-training of reasoning language models as one SPMD JAX program.

The RL step is a data-centric graph (the RLM Pipeline Execution Graph, RPEG), rewritten by
structural passes, planned by an analytical cost model, compiled stage by stage into jitted
programs, and run by a small runtime that places each stage's inputs in its mesh layout.
See README.md and docs/design.md.
"""

__version__ = "0.1.0"
