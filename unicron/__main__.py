"""``python -m unicron`` is the ``unicron`` command."""

from unicron.cli import main

raise SystemExit(main())
