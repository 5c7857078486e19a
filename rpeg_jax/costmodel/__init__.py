"""rpeg_jax.costmodel: the analytical performance model and the planner (no JAX, no devices).

    from rpeg_jax.costmodel.planner import choose_plan, search, predicted_stage_times, compare
    plan = choose_plan(cfg, num_devices, hardware)   # graph.plan.Plan; plan.predicted has step_time_s,
                                                     # memory_per_gpu_gb, utilization, stage_s, settings
    cfg = apply_plan_settings(cfg, plan)             # rl.micro_batches, model.remat, rollout.max_slots, pipeline
    res = search(cfg, n, hardware)                   # chosen, runners_up, baselines (verl_like, real_like)

Modules: hardware (profiles as data, configs/hardware/*.yaml), shape (FLOPs/bytes/memory of a
model), comm (collectives per hierarchy level, resharding), lengths (response-length model,
decode schedule), stages (time and memory per stage kind), candidates (plan tables), schedule
(step simulation over device groups), planner (search, baselines), report, cli (`rpeg plan`),
calibrate (`rpeg calibrate`, the only module that imports JAX, inside its functions).
"""
