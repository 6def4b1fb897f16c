"""One module per ``nereus`` subcommand (see nereus/cli.py)."""
