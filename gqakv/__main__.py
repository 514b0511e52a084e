"""``python -m gqakv ...`` is the ``gqakv`` command."""

from .tools.cli import main

raise SystemExit(main())
