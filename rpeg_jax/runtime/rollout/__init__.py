"""The rollout path: from the prompt stream to a scored rollout batch in the training layout.

    prompts.py     StepPrompts (the data iterator's state), RolloutBuffer (bounded asynchrony)
    sources.py     RolloutSource: step / filtered (DAPO dynamic sampling) / continuous, chosen once
    continuous.py  the engine that outlives the step (rollout.admission=continuous)
    engine.py      RolloutEngine: what a source asks of generation (the Sampler today)
    layout.py      sampler rows -> the [B, P + R] rollout layout and its host columns
    scoring.py     rewards (also dynamic sampling's), the overlong penalty, truncation
    stats.py       token statistics: the staleness check, the step's useful FLOPs

Called by: runtime/kernels.py (generate, reward), runtime/setup.py, runtime/trainer.py,
runtime/resume.py. The policy's decisions (admission, buckets) are shapes/'s.
"""
