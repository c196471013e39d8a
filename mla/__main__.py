"""`python -m mla ...`: runs the command line, whose code lives in mla/cli.py.

The code sits in a module of its own because `python -m mla` runs this file as `__main__`, and
the processes that `--tp` spawns do not import `__main__` again: a rank function defined here
could not be found by name in them, one in `mla.cli` can.
"""

from mla.cli import main

if __name__ == "__main__":
    main()
