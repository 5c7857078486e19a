"""`rpeg calibrate [--profile cpu|h200|...] [--out PATH] [--quick]`: measure this machine and save the
fitted profile (what `rpeg plan` and `pipeline.plan: auto` use under `costmodel.calibration=cached`;
the default plans with the shipped one). rpeg_jax/calibration/ says what is measured and fitted:
micro-benchmarks, a synthetic decoder, then stage points of the real model, update and sampler
(the CALIBRATION configurations; a few minutes on a 2-core CPU, --quick about a minute).
"""

from __future__ import annotations

import dataclasses
import os

from rpeg_jax.costmodel.devices import force_cpu_devices
from rpeg_jax.costmodel.hardware import calibrated_path, load_hardware, save_hardware

CLOCK_NAMES = ("cpu", "wall")  # rpeg_jax.calibration.CLOCKS (imported after the devices are forced)


def add_arguments(p) -> None:
    p.add_argument("--profile", default=None, help="base profile to fit (default: cpu on CPU, h200 on GPU)")
    p.add_argument("--out", default=None, help="where to save (default ~/.cache/rpeg_jax/hardware/<profile>.yaml)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, repeats and stage configurations")
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices (collectives and stage meshes)")
    p.add_argument(
        "--no-stages", action="store_true", help="micro-benchmarks only (no synthetic decoder, no real stages)"
    )
    p.add_argument(
        "--no-real-stages",
        action="store_true",
        help="skip measuring the real model/update/sampler stages (fit saved points beside the profile if any)",
    )
    p.add_argument(
        "--clock",
        choices=CLOCK_NAMES,
        default="wall",
        help="wall (default; a quiet machine) or cpu (process CPU seconds, robust to others' load)",
    )
    p.add_argument(
        "--points",
        default=None,
        help="fit these saved stage points (JSON of costmodel/fit.py points) instead of measuring them",
    )


def run(args) -> int:
    force_cpu_devices(args.devices)  # before JAX starts: the collective benchmark and meshes need them
    import jax

    from rpeg_jax.calibration import calibrate, fit_saved_points, measure_stage_points, save_points

    on_gpu = jax.default_backend() == "gpu"
    name = args.profile or ("h200" if on_gpu else "cpu")
    if args.points and not os.path.isfile(args.points):
        raise SystemExit(f"rpeg calibrate: --points {args.points}: no such file")
    base = load_hardware(name, calibrated=False)
    prof = calibrate(base, args.quick, stages=not args.no_stages, clock=args.clock)
    out = args.out or calibrated_path(name)
    points = args.points or os.path.splitext(out)[0] + ".points.json"
    if not (args.no_stages or args.no_real_stages or args.points):
        print(f"measuring the real stages ({'quick set' if args.quick else 'calibration set'}) ...", flush=True)
        pts = measure_stage_points(base.kind, args.quick, args.clock)
        save_points(points, args.clock, pts, [os.getloadavg()[0]])
    if not args.no_stages and os.path.isfile(points):  # real stage measurements on this machine: fit them
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
        f"{100 * prof.calibrated.get('fit_time_mape', float('nan')):.1f}% "
        f"({int(prof.calibrated.get('stage_points', 0))} points) -> {path}"
    )
    return 0
