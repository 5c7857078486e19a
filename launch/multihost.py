"""Launch training on one or many processes: `rpeg train` (rpeg_jax/cli/train.py) as a script, for
`make run` and schedulers that start a file.

    python launch/multihost.py --config configs/default.yaml train.steps=10       # one process
    python launch/multihost.py --config X --local-processes 2 --local-devices 4    # 2 local CPU processes
    srun python launch/multihost.py --config X                                     # SLURM
    python launch/multihost.py --config X --coordinator host0:1234 --num-processes 8 --process-id $I

Flags, exit codes and where the process settings come from: rpeg_jax/cli/train.py.
"""

import sys

from rpeg_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
