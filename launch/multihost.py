"""Launch training on one or many processes: parse, initialise the distributed runtime, run.

    python launch/multihost.py --config configs/default.yaml train.steps=10       # one process
    python launch/multihost.py --config X --local-processes 2 --local-devices 4    # 2 local CPU processes
    srun python launch/multihost.py --config X                                     # SLURM (one task per GPU)
    python launch/multihost.py --config X --coordinator host0:1234 --num-processes 8 --process-id $I

Where coordinator / number of processes / process id come from (flags, config `distributed.*`,
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, SLURM) and how a lost process is
reported: rpeg_jax/sharding/distributed.py. Exit codes: 0 ok, 2 bad config (one line naming key and
value), 3 initialisation failed, 75 a peer process was lost, 128 + N for signal N (SIGINT, SIGTERM)
before training started (one line; rpeg_jax/cli/train.py), else the training's own failure.
Only process 0 logs and writes metrics (the runtime asks `is_primary()`); every process runs the
same program and takes part in checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rpeg_jax.cli import train as train_command  # noqa: E402  (--config, --result-json, overrides; train)
from rpeg_jax.config import ConfigError, load_config  # noqa: E402
from rpeg_jax.costmodel.space import continuous_on_processes  # noqa: E402
from rpeg_jax.sharding import distributed as dist  # noqa: E402

EXIT_CONFIG, EXIT_INIT = 2, 3


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/multihost.py", description=__doc__.splitlines()[0])
    train_command.add_arguments(p)
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (overrides distributed.coordinator)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--local-processes", type=int, default=0, help="start N processes on this machine (CPU, gloo)")
    p.add_argument("--local-devices", type=int, default=4, help="CPU devices per local process")
    return p.parse_args(argv)


def with_flags(cfg, args):
    """Flags win over the config's `distributed` section (validated again)."""
    d = cfg.distributed
    flags = {
        k: v
        for k, v in (
            ("coordinator", args.coordinator),
            ("num_processes", args.num_processes),
            ("process_id", args.process_id),
        )
        if v is not None
    }
    d = dataclasses.replace(d, **flags)
    d.validate("distributed")
    return dataclasses.replace(cfg, distributed=d)


def child_command(argv: list[str]) -> list[str]:
    """This script's argv without the local-spawn flags (the children get coordinator flags)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--local-processes", "--local-devices"):
            skip = True
            continue
        if a.startswith("--local-processes=") or a.startswith("--local-devices="):
            continue
        out.append(a)
    return [sys.executable, os.path.abspath(__file__)] + out


def main(argv: list[str] | None = None) -> int:
    train_command.stop_early_on_signals("rpeg launch")  # outside the training loop: one line, not a bare -15
    try:
        return _main(argv)
    except train_command.StoppedEarly as e:
        return train_command.report_early_stop(e, "rpeg launch")


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    try:
        cfg = with_flags(load_config(args.config, args.overrides), args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return EXIT_CONFIG
    d = cfg.distributed
    if args.local_processes > 1 and cfg.rollout.admission == "continuous":  # said once, not by every child
        why = continuous_on_processes(args.local_processes)
        print(str(ConfigError("rollout.admission", "continuous", why)), file=sys.stderr)
        return EXIT_CONFIG
    if args.local_processes:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # spawn_local passes Ctrl-C on to the children
        return dist.spawn_local(
            child_command(argv), args.local_processes, args.local_devices, grace_s=d.heartbeat_timeout_s + 30
        )
    try:
        spec = dist.resolve_spec(d.coordinator, d.num_processes, d.process_id)
        dist.initialize(spec, d.heartbeat_timeout_s, d.initialization_timeout_s, d.cpu_collectives, d.bind_address)
    except dist.DistributedInitError as e:
        print(f"rpeg launch: {e}", file=sys.stderr)
        return EXIT_INIT
    train_command.setup_logging(spec.process_id, spec.num_processes)
    watchdog = (
        dist.Watchdog(spec.process_id, spec.num_processes, d.heartbeat_timeout_s).start()
        if spec.multi and d.watchdog
        else None
    )
    try:
        rc, _ = train_command.train(cfg, args.result_json, spec.process_id, who=f"rpeg: process {spec.process_id}")
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        rc = EXIT_CONFIG
    except Exception:
        if watchdog is not None:  # a failed collective usually means a lost peer: let the watchdog name it
            watchdog.await_verdict(d.heartbeat_timeout_s + 2 * watchdog.interval)
            watchdog.stop(clean=False)
        raise
    if watchdog is not None:
        watchdog.stop(clean=True)
    if spec.multi:
        import jax

        jax.distributed.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
