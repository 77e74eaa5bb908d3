"""``python -m xla_permute demo | doctor | bench``: the workshop's command line, run as its own
program (the library never imports the workshop)."""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "xla_permute_tools", *sys.argv[1:]])
