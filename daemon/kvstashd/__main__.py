"""`python -m kvstashd` runs the daemon, as `kvstash serve` does."""

from kvstashd.cli import main

main()
