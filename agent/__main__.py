"""`python3 -m agent`: the same as `bash run.sh` once Python and the packages are there."""
import os
import sys

# run.sh runs Python from the repository: relative paths on its command line are the caller's.
_caller = os.environ.pop("RUN_SH_CALLER_DIR", None)
if _caller:
    try:
        os.chdir(_caller)
    except OSError as e:   # read from the repository instead, a relative workspace would be written there
        print(f"error: the folder run.sh was called from cannot be entered: {_caller} ({e.strerror})", file=sys.stderr)
        sys.exit(2)

try:
    from agent.cli import main
except ModuleNotFoundError as e:  # run.sh could not install it (offline?): say so in one line
    print(f"error: missing Python package '{e.name}' (pip install -r requirements.txt)", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
