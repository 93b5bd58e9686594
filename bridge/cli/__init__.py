"""`rdq`: the command line — its parser and verbs, tables, bulk redrive, import, `dlq tail`, `make demo`.
`rdq = bridge.cli:main` and `python -m bridge.cli` are its two doors."""

from bridge.cli.main import main

__all__ = ["main"]
