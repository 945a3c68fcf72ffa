"""`python3 -m agent`: the same as `bash run.sh` once Python and the packages are there."""
import sys

from agent.caller import enter_callers_folder

enter_callers_folder()   # relative paths on run.sh's command line are the caller's

try:
    from agent.cli import main
except ModuleNotFoundError as e:  # run.sh could not install it (offline?): say so in one line
    print(f"error: missing Python package '{e.name}' (pip install -r requirements.txt)", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:   # Ctrl-C while the agent's modules (torch) import: had been a traceback
    print("interrupted before the run started; nothing written", file=sys.stderr)
    sys.exit(130)   # agent.cli's EXIT_INTERRUPTED, which did not finish importing

sys.exit(main())
