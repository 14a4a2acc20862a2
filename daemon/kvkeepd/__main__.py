"""`python -m kvkeepd` runs the daemon, as `kvkeep serve` does."""

from kvkeepd.cli import main

main()
