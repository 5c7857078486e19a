"""`rpeg calibrate [--profile cpu|h200|...] [--out PATH] [--quick]`: measure this machine, fit the
profile's efficiency factors (costmodel/calibrate.py), save the fitted profile (what `rpeg plan` and
`pipeline.plan: auto` use under `costmodel.calibration=cached`; the default plans with the shipped one).
"""

from __future__ import annotations

import dataclasses
import os

from rpeg_jax.costmodel.calibrate import CLOCKS, calibrate, fit_saved_points
from rpeg_jax.costmodel.devices import force_cpu_devices
from rpeg_jax.costmodel.hardware import calibrated_path, load_hardware, save_hardware


def add_arguments(p) -> None:
    p.add_argument("--profile", default=None, help="base profile to fit (default: cpu on CPU, h200 on GPU)")
    p.add_argument("--out", default=None, help="where to save (default ~/.cache/rpeg_jax/hardware/<profile>.yaml)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (tests)")
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices for the collective benchmark")
    p.add_argument("--no-stages", action="store_true", help="micro-benchmarks only (skip the stage-level fit)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall (default; a quiet machine) or cpu (process CPU seconds, robust to others' load)",
    )
    p.add_argument(
        "--points",
        default=None,
        help="stage measurements of the real code to fit too (JSON of costmodel/fit.py points; "
        "default <profile>.points.json beside the saved profile when present, written by "
        "bench/costmodel_validate.py --calibrate)",
    )


def run(args) -> int:
    force_cpu_devices(args.devices)  # before JAX starts: the collective benchmark needs them
    import jax

    on_gpu = jax.default_backend() == "gpu"
    name = args.profile or ("h200" if on_gpu else "cpu")
    base = load_hardware(name, calibrated=False)
    prof = calibrate(base, args.quick, stages=not args.no_stages, clock=args.clock)
    out = args.out or calibrated_path(name)
    points = args.points or os.path.splitext(calibrated_path(name))[0] + ".points.json"
    if os.path.isfile(points):  # real stage measurements on this machine: fit them too
        alt = dataclasses.replace(base, host_cores=1) if args.clock == "cpu" else base
        prof = fit_saved_points(prof, points, args.clock, alt)
    path = save_hardware(prof, out)
    d, e = prof.device, prof.efficiency
    print(
        f"calibrated {name} on {jax.default_backend()} ({len(jax.local_devices())} devices): "
        f"peak {d.peak_flops / 1e9:.1f} GFLOP/s, memory {d.memory_bw / 1e9:.1f} GB/s, "
        f"dispatch {e.dispatch_s * 1e6:.0f} us, layer {e.layer_s * 1e6:.1f} us, "
        f"loop step {e.decode_step_s * 1e6:.1f} us, link {prof.node.link_bw / 1e9:.2f} GB/s, "
        f"elementwise x{e.elementwise_factor:.2f}, backward x{e.backward_factor:.2f}, fsdp gather {e.fsdp_gather}, "
        f"synthetic fit MAPE {100 * prof.calibrated.get('stage_fit_mape', float('nan')):.1f}%, stage points fit MAPE "
        f"{100 * prof.calibrated.get('fit_time_mape', float('nan')):.1f}% -> {path}"
    )
    return 0
