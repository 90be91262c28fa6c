"""A training script that fails at start-up, on every start: its import does not exist."""

import no_such_module_xyz  # noqa: F401

print("unreachable")
