"""Handlers outside the bridge process: the remote-worker server (TCP / Unix socket), its Python
client, and the HTTP handler."""
