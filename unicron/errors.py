"""Exceptions shared by the commands.

:class:`UsageError` is bad input from the user: the command prints its message as one line
on stderr and exits with code 2 (DESIGN.md, exit codes). Every command module raises it
instead of printing and exiting itself, so the rule lives in one place (:mod:`unicron.cli`).
"""


class UsageError(ValueError):
    """Bad usage or bad input; the message is one line naming what is wrong."""
