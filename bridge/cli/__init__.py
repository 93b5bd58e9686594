"""`rdq`: the command line — the parser and verbs (`main`), tables, bulk redrive, import, `dlq tail`, and
`make demo`. `rdq = bridge.cli:main` and `python -m bridge.cli` are its two doors."""

from bridge.cli.main import main

__all__ = ["main"]
