"""``interp-serve``: steered and instrumented models behind vLLM's own OpenAI-compatible server.

Owns the ``serve:`` settings, the request's ``interp`` object, named vectors at run time and the hooks into vLLM's
app (one middleware, the ``/v1/interp/vectors`` routes, the engine client's ``generate``). Imports the compiler
modules below every kind (``compile.requests``, ``compile.steering``'s building blocks, ``payload``); nothing imports it.
"""
