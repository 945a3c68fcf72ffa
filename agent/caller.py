"""The folder `run.sh` was called from: Python runs from the repository, yet relative paths on
run.sh's command line (and in MODEL_CONFIG, WEIGHT_DIR, AGENT_WORKSPACE) are the caller's. The
agent's and the server's entry points enter it first. Standard library only: it runs before the
packages run.sh may have failed to install are imported."""
from __future__ import annotations

import os
import sys

CALLER_DIR_VARIABLE = "RUN_SH_CALLER_DIR"   # set by run.sh
EXIT_BAD_INPUT = 2


def enter_callers_folder() -> None:
    """chdir into the caller's folder where run.sh named one (the variable is consumed: nothing
    started later sees it). One `error:` line and exit 2 where it cannot be entered: read from the
    repository instead, a relative workspace would be written there."""
    caller = os.environ.pop(CALLER_DIR_VARIABLE, None)
    if not caller:
        return
    try:
        os.chdir(caller)
    except OSError as e:
        print(f"error: the folder run.sh was called from cannot be entered: {caller} ({e.strerror})", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
