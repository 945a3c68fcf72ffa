"""`python3 -m agent`: the same as `bash run.sh` once Python and the packages are there."""
import sys

from agent.cli import main

sys.exit(main())
