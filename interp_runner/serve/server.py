"""vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``: its engine client, ``build_app``,
``init_app_state`` and ``serve_http``) with the interp hooks added: the engine client's ``generate``
(``engine_hook``), the middleware innermost in the app and the vector routes (``http``). SIGTERM shuts it down
cleanly (uvicorn's handler; exit 0)."""

from __future__ import annotations

import signal

from interp_runner.serve.engine_hook import InterpEngine
from interp_runner.serve.http import InterpMiddleware, ServeState, vector_routes
from interp_runner.serve.named import NamedVectors
from interp_runner.serve.settings import Prepared

STATUS = "interp_status"


class PluginNotActive(RuntimeError):
    pass


async def check_plugin(engine, num_layers: int, expected: str) -> str:
    """vLLM swallows plugin load errors: every worker must run our ops, of the plugin code the server was
    configured with (``expected``: its fingerprint), before the server takes a request. Returns the model runner
    the workers run ("v1" | "v2")."""
    statuses = await engine.collective_rpc(STATUS)
    for rank, status in enumerate(statuses):
        if not status.get("loaded"):
            raise PluginNotActive(f"interp plugin is not active on worker {rank}: {status}")
        if not status["runner_planned"]:
            raise PluginNotActive(f"worker {rank} uses a model runner the interp planner does not drive")
        if status["plugin"] != expected:
            raise PluginNotActive(f"worker {rank} runs plugin {status['plugin']}, this code is {expected}")
        if len(status["instrumented_layers"]) != num_layers:
            raise PluginNotActive(f"worker {rank} instrumented {len(status['instrumented_layers'])} of "
                                  f"{num_layers} layers")
    return statuses[0]["model_runner"]


async def serve(args, prepared: Prepared) -> None:
    from starlette.middleware import Middleware
    from vllm import envs
    from vllm.entrypoints.launcher import serve_http
    from vllm.entrypoints.openai.api_server import (
        build_app, build_async_engine_client, init_app_state, setup_server,
    )
    from vllm.entrypoints.serve.utils.server_utils import get_uvicorn_log_config

    def interrupt_start(*_) -> None:  # SIGTERM before uvicorn has its handlers: stop starting
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_start)
    listen_address, sock = setup_server(args, reuse_port=False)
    settings = prepared.settings
    async with build_async_engine_client(args) as engine_client:
        runner = await check_plugin(engine_client, prepared.served.facts.num_layers, prepared.plugin)
        print(f"interp-serve: interp ops active on every worker, vLLM's {runner.upper()} model runner", flush=True)
        hook = InterpEngine(engine_client)
        named = NamedVectors(settings.max_vectors)
        for name, vec in prepared.named.items():
            named.add(name, vec, replace=False)
        from interp_runner.payload import vector_key

        await hook.register({**prepared.global_vectors, **{vector_key(v): v for v in prepared.named.values()}})
        state = ServeState(settings, prepared.served, prepared.tokenizer, named, hook, prepared.global_steer,
                           prepared.global_vectors)
        tasks = await engine_client.get_supported_tasks()
        app = build_app(args, tasks, engine_client.model_config)
        app.include_router(vector_routes(state))
        app.user_middleware.append(Middleware(InterpMiddleware, state=state))  # innermost: behind the API key
        app.middleware_stack = app.build_middleware_stack()  # vLLM's build_app has built it already
        await init_app_state(engine_client, app.state, args, tasks)
        kwargs = {}
        log_config = get_uvicorn_log_config(args)
        if log_config is not None:
            kwargs["log_config"] = log_config
        shutdown = await serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host, port=args.port,
            log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count, **kwargs,
        )
    try:
        await shutdown
    finally:
        sock.close()


def run(args, prepared: Prepared) -> None:
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    uvloop.run(serve(args, prepared))
