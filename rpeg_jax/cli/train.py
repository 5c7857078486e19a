"""`rpeg train`: the one training entry point, on one process or many.

    rpeg train --config configs/default.yaml train.steps=10                    # one process
    rpeg train --config X --local-processes 2 --local-devices 4                # 2 local CPU processes (gloo)
    srun rpeg train --config X                                                 # SLURM (one task per node)
    rpeg train --config X --coordinator host0:1234 --num-processes 8 --process-id $I

launch/multihost.py (`make run`) is this command. Where coordinator / number of processes /
process id come from (flags, config `distributed.*`, JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, SLURM) and how a lost process is reported: rpeg_jax/runtime/distributed.py. Only
process 0 logs and writes metrics; every process runs the same program and takes part in
checkpoints.

Every way a run ends is one line on stderr and an exit status: 0 done (or stopped at a step
boundary by a signal: runtime/trainer.py), 1 an expected failure (a damaged checkpoint, a full
disk, a non-finite loss, ...), 2 a bad config, 3 the distributed runtime did not start, 75 a peer
process was lost, 130 a second Ctrl-C, 128 + the signal's number for
SIGINT or SIGTERM outside the training loop (`stop_early_on_signals`): before training started
(imports, config, the distributed runtime's start-up: no step ran, nothing was written) or after it
ended (every checkpoint committed).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import sys
import threading

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.run import load_config
from rpeg_jax.runtime import distributed as dist


class StoppedEarly(BaseException):
    """SIGINT or SIGTERM before training started (a BaseException: nothing on the way up should
    swallow it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def stop_early_on_signals(who: str) -> None:
    """SIGINT and SIGTERM outside the trainer's own handlers (runtime/trainer.StopSignals, which stop
    at the next step boundary). Before training: StoppedEarly is raised (`report_early_stop`: one
    line, exit 128 + N); the signal is also kept in `handle.pending`, which StopSignals adopts
    should the exception have been swallowed (raised inside a garbage-collection callback, say).
    After training (StopSignals sets `handle.trained` on its way out, every checkpoint committed):
    one line and exit 128 + N at once, not a traceback from whatever shut-down code was running."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        name = signal.Signals(signum).name
        if handle.trained:
            print(f"{who}: stopped by {name} after training ended: every checkpoint is committed", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + signum)
        handle.pending.append(signum)
        raise StoppedEarly(signum)

    handle.pending, handle.trained = [], False
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handle)
    previous = sys.unraisablehook

    def unraisable(u):  # a StoppedEarly Python could not raise: kept in handle.pending, said by the trainer
        if not isinstance(u.exc_value, StoppedEarly):
            previous(u)

    sys.unraisablehook = unraisable


def report_early_stop(e: StoppedEarly, who: str) -> int:
    print(
        f"{who}: stopped by {e} during start-up, before any training step: nothing was written; "
        "run the same command to start",
        file=sys.stderr,
    )
    return 128 + e.signum


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("--result-json", default=None, help="process 0 writes training's returned dict here")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    add_launch_arguments(p)


EXIT_FAILED, EXIT_STOPPED_AT_ONCE = 1, 130  # 130 = 128 + SIGINT, as a shell reports Ctrl-C


def train(cfg, result_json: str | None = None, process_id: int = 0, who: str = "rpeg train") -> tuple[int, dict | None]:
    """Run training: (exit code, the returned dict as plain JSON values, also written to
    `result_json` by process 0). An expected failure, or a second Ctrl-C (the first one stops at
    the next step boundary, runtime/trainer.py), is reported in one line on stderr."""
    from rpeg_jax.runtime.trainer import expected_failures
    from rpeg_jax.runtime.trainer import train as run_training

    try:
        if cfg.train.mode == "rl":
            result = plain(run_training(cfg))
        else:  # supervised fine-tuning on chat transcripts, and RL after it (runtime/sft.py)
            from rpeg_jax.runtime import sft

            out = sft.train_sft(cfg) if cfg.train.mode == "sft" else sft.sft_then_rl(cfg, run_training)
            result = plain(out)
    except expected_failures() as e:
        print(f"{who}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED, None
    except KeyboardInterrupt:
        print(f"{who}: stopped at once by a second Ctrl-C; the newest committed checkpoint is kept", file=sys.stderr)
        return EXIT_STOPPED_AT_ONCE, None
    except OSError as e:  # the run directory's own files (metrics, trace, evaluation records); checkpoints: DiskFull
        if e.errno != errno.ENOSPC:
            raise
        print(
            f"{who}: no space left on device writing {e.filename or cfg.train.run_dir}; the newest committed "
            f"checkpoint in {cfg.train.run_dir}/checkpoints is kept: free space and run the same command to resume",
            file=sys.stderr,
        )
        return EXIT_FAILED, None
    if result_json and process_id == 0:
        with open(result_json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return 0, result


def plain(x):
    """`x` with JSON values only (scalar arrays as numbers, anything else as its repr)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def setup_logging(process_id: int = 0, num_processes: int = 1) -> None:
    """What a run prints: rpeg_jax's own lines (process 0 at INFO, the others' warnings), and only
    warnings from the libraries (orbax logs every save and restore step at INFO through absl)."""
    prefix = f"[p{process_id}] " if num_processes > 1 else ""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rpeg_jax").setLevel(logging.INFO if process_id == 0 else logging.WARNING)


EXIT_CONFIG, EXIT_INIT = 2, 3


def add_launch_arguments(p) -> None:
    """The process flags of `rpeg train` (and launch/multihost.py)."""
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (overrides distributed.coordinator)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--local-processes", type=int, default=0, help="start N processes on this machine (CPU, gloo)")
    p.add_argument("--local-devices", type=int, default=4, help="CPU devices per local process")


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


def child_command(args) -> list[str]:
    """`rpeg train` for one local process: the config and overrides (spawn_local adds the
    coordinator flags)."""
    out = ["--config", args.config] if args.config else []
    out += ["--result-json", args.result_json] if args.result_json else []
    return [sys.executable, "-m", "rpeg_jax.cli", "train", *out, *args.overrides]


def main(argv: list[str] | None = None) -> int:
    """`rpeg train` from its arguments (launch/multihost.py calls this)."""
    from rpeg_jax.cli import main as rpeg

    return rpeg(["train", *(sys.argv[1:] if argv is None else argv)])


def run(args) -> int:
    stop_early_on_signals("rpeg train")  # outside the training loop: one line, not a bare -15
    try:
        return _run(args)
    except StoppedEarly as e:
        return report_early_stop(e, "rpeg train")


def _run(args) -> int:
    try:
        cfg = with_flags(load_config(args.config, args.overrides), args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return EXIT_CONFIG
    d = cfg.distributed
    if args.local_processes:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # spawn_local passes Ctrl-C on to the children
        return dist.spawn_local(
            child_command(args), args.local_processes, args.local_devices, grace_s=d.heartbeat_timeout_s + 30
        )
    try:
        spec = dist.resolve_spec(d.coordinator, d.num_processes, d.process_id)
        dist.initialize(spec, d.heartbeat_timeout_s, d.initialization_timeout_s, d.cpu_collectives, d.bind_address)
    except dist.DistributedInitError as e:
        print(f"rpeg train: {e}", file=sys.stderr)
        return EXIT_INIT
    setup_logging(spec.process_id, spec.num_processes)
    watchdog = (
        dist.Watchdog(spec.process_id, spec.num_processes, d.heartbeat_timeout_s).start()
        if spec.multi and d.watchdog
        else None
    )
    try:
        who = f"rpeg: process {spec.process_id}" if spec.multi else "rpeg train"
        rc, result = train(cfg, args.result_json, spec.process_id, who=who)
        if result is not None and not spec.multi:
            print(json.dumps(result))
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
