"""rpeg_jax.costmodel: the analytical performance model and the planner (no JAX, no devices).

    from rpeg_jax.costmodel.planner import choose_plan, search, predicted_stage_times
    plan = choose_plan(cfg, num_devices, hardware, processes)  # graph.plan.Plan; plan.predicted has
                                                     # step_time_s, memory_per_gpu_gb, utilization, stage_s, settings
    cfg, changed = graph.plan.config_for_plan(cfg, plan)   # pipeline knobs + rl.micro_batches, model.remat, ...
    res = search(cfg, n, hardware, processes)        # chosen, runners_up, baselines (verl_like, real_like)
    from rpeg_jax.costmodel.pricing import best_by_groups, predict_run, price
    alts = best_by_groups(cfg, n, hardware, processes)   # the best plan of every device-group option
    pred = price(cfg, plan, hardware, processes)         # the model's prediction for a given Plan
    pred = predict_run(cfg, "cpu", 1)                    # ... for the run cfg describes (benchmarks)

Unset arguments come from the config (costmodel.hardware: auto, costmodel.num_devices) and else
from the devices JAX sees (costmodel/devices.py): the runtime calls choose_plan(cfg, n) and gets
the profile of its device kind, the calibrated copy when `rpeg calibrate` saved one, and
jax.process_count() processes.

Modules: hardware (profiles as data, configs/hardware/*.yaml), devices (the run's devices ->
profile), shape (FLOPs/bytes/memory of a model), comm (collectives per hierarchy level, resharding),
lengths (response-length model, decode schedule, the continuous engine's simulation), stages (time
and memory per stage kind), candidates (plan tables), schedule (step simulation over device groups),
types (Context, Prediction, SearchResult), planner (search, baselines), pricing (a given plan, the
best per device-group option), report (+ the "why"), fit (stage measurements as data, least-squares
fit of a profile), microfit (the fit of micro-benchmarks and a synthetic decoder). The measurements
behind `rpeg calibrate` run JAX and live outside this package, in rpeg_jax/calibration/;
devices.local_devices is the only code here that imports JAX (inside a function). `rpeg plan` and
`rpeg calibrate` are in rpeg_jax/cli/.
"""
