"""The SRE's console (`rdq console`): a local web app that is an admin client like the CLI; pages, not text."""
