"""User handlers and the examples. Importing this package registers them (engine.handler_modules: [handlers]).

Add your own module here (or anywhere importable) and list it in `engine.handler_modules`:

    from bridge.registry import handler

    @handler("charge-payment", version="v3")
    def charge(ctx):  # sync handlers run in a thread pool; `async def` ones on the loop
        ...
"""

from handlers import examples as examples
