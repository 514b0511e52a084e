"""The error a subcommand raises for a bad command-line value (``gqakv.tools.cli`` prints it as
one ``gqakv: error: ...`` line and exits 2)."""


class UsageError(ValueError):
    """A bad command-line value, raised by a subcommand with a message naming the flag."""
