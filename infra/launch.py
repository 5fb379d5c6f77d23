"""`accelerate launch` for batch systems: `python -m infra.launch <accelerate launch arguments>`.

SLURM's `--signal=USR1@180` (and `scancel --signal=USR1`) signal every process of the job step:
the training processes catch SIGUSR1, agree, save and exit 0 (infra.checkpoint.SaveSchedule), but
the launcher in between, torch elastic's agent under `accelerate launch`, has no handler, and
Python's default for SIGUSR1 ends it at once. This launcher ignores SIGUSR1 and is otherwise
`accelerate launch`. The training processes inherit the ignore until the recipe installs its own
handler, a second or so into start-up.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    from accelerate.commands.accelerate_cli import main as accelerate

    sys.argv = ["accelerate", "launch", *sys.argv[1:]]
    accelerate()


if __name__ == "__main__":
    main()
