"""`python -m pipeline ...` is the `pipeline` command."""

from __future__ import annotations

from pipeline.cli import main

raise SystemExit(main())
