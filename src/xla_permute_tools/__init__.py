"""Command-line tools on top of the library: the self-test table, doctor and bench."""
