"""The admin side: the signed command protocol, the loop that serves commands, bulk redrive, imports,
and the client the CLI speaks through."""
