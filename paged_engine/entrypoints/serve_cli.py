"""``paged-engine serve MODEL_DIR``: the flags of the OpenAI-compatible server, checked (with
the engine's) before the model loads, and the command itself.

The server's dependencies (the ``server`` extra) are imported only by ``cmd_serve``: the
other commands, and ``--help``, work without them, and a missing one is named before any
model loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

from paged_engine.entrypoints.cli_args import HelpFormatter, add_engine_args, positive
from paged_engine.entrypoints.dp_args import add_dp_args, check_dp_args
from paged_engine.entrypoints.settings import (
    API_KEY_ENV,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    TOOL_CALL_PARSERS,
    ServerSettings,
)
from paged_engine.ray_support import end_ray

SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")
"""What ``pip install 'paged_engine[server]'`` brings (pydantic comes with fastapi)."""
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model directory over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) on one engine, in the style of `vllm serve`.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="a Hugging Face-format model directory, or a .gguf file")
    g = p.add_argument_group("server")
    add = g.add_argument
    add("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    add("--port", type=int, default=8000, help="TCP port; 0 picks a free one (logged)")
    add(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health",
    )
    add("--served-model-name", default=None, metavar="NAME", help="the model id clients send")
    add(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="a Jinja chat template, or a file holding one, for models without one",
    )
    add("--enable-auto-tool-choice", action="store_true", help='chat\'s tool_choice "auto"')
    tool_help = "how calls are read from the text: hermes, <tool_call>{json}</tool_call> (Qwen)"
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None, help=tool_help)
    add(
        "--max-queue",
        type=positive,
        default=1024,
        metavar="N",
        help="sequences held at once, queued or running (a prompt counts n); a request "
        "that would pass it is answered 503, one that alone needs more 400",
    )
    add(
        "--max-prompt-chars",
        type=positive,
        default=None,
        metavar="N",
        help="the longest text prompt or conversation, refused (400) before tokenizing "
        "(default: max_model_len times the tokenizer's longest token)",
    )
    add(
        "--max-request-body-bytes",
        type=positive,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="N",
        help="the largest request body; a larger one is answered 413 before it is parsed",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before being aborted; "
        "the process exits at most 3 s later",
    )
    add("--log-level", default="info", choices=list(LOG_LEVELS), help="uvicorn's log level")
    add(
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="where the engine steps: a process of its own (HTTP, tokenizing and streaming "
        "do not share its GIL) or a thread of the server's process",
    )
    add_dp_args(add)
    add(
        "--engine-core-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --engine-core process: restart a core that died, N times at most; "
        "past that the server exits with status 1",
    )
    add_engine_args(p)
    p.set_defaults(fn=cmd_serve, parser=p)


def _chat_template(value: str | None) -> str | None:
    """The template text: a file's contents when ``value`` names a file, else ``value``
    itself when it looks like a template; a path that does not exist is refused."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def check_serve_args(a: argparse.Namespace) -> None:
    """Resolve and check the server flags into ``a.settings`` (ValueError naming the flag);
    also that the server's dependencies are installed."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"serve needs the server extra: pip install 'paged_engine[server]' "
            f"({', '.join(missing)} not installed)"
        )
    check_dp_args(a)
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if a.engine_core_restarts < 0:
        raise ValueError(f"--engine-core-restarts must be >= 0, got {a.engine_core_restarts}")
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        a.settings = ServerSettings(
            served_model_name=a.served_model_name or str(a.model),
            host=a.host,
            port=a.port,
            api_key=key,
            chat_template=_chat_template(a.chat_template),
            max_queue=a.max_queue,
            shutdown_timeout=a.shutdown_timeout,
            log_level=a.log_level,
            max_prompt_chars=a.max_prompt_chars,
            max_request_body_bytes=a.max_request_body_bytes,
            tool_call_parser=a.tool_call_parser if a.enable_auto_tool_choice else None,
        )
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def cmd_serve(a: argparse.Namespace, fields: dict[str, Any], params: object) -> int:
    code = _serve_core(a, fields) if a.engine_core == "process" else _serve_thread(a, fields)
    _exit_now(code)
    return code  # not reached


def _serve_thread(a: argparse.Namespace, fields: dict[str, Any]) -> int:
    from paged_engine import LLM
    from paged_engine.cpu_bind import thread_core_cpu_bind
    from paged_engine.entrypoints.server_runtime import run_server
    from paged_engine.llm import MULTIPROCESSING_ENV

    os.environ[MULTIPROCESSING_ENV] = "0"  # --engine-core thread: the engine is in here
    fields = {**fields, "cpu_bind": thread_core_cpu_bind(fields.get("cpu_bind"))}
    llm = LLM(a.model, **fields)
    try:
        return run_server(llm, a.settings, model_root=str(a.model))
    finally:
        llm.close()


def _serve_core(a: argparse.Namespace, fields: dict[str, Any]) -> int:
    """The engine in core processes, here and on other hosts (``dp_remote``), or only
    the cores (``--headless``); the API process loads the tokenizer, not the weights."""
    from paged_engine.cpu_bind import default_cpu_bind, serve_cpu_bind
    from paged_engine.entrypoints.core_process import CoreSpec
    from paged_engine.entrypoints.dp_client import DPClient, stop_all
    from paged_engine.entrypoints.dp_headless import run_headless
    from paged_engine.entrypoints.dp_ray import RayReplicas
    from paged_engine.entrypoints.dp_remote import ReplicaError, launch_replicas
    from paged_engine.entrypoints.server_runtime import run_core_server
    from paged_engine.llm import model_dir_of
    from paged_engine.platform import default_num_threads, threads_per_rank
    from paged_engine.utils.model_config import ModelConfig
    from paged_engine.utils.tokenizer import load_tokenizer

    if a.dp_local > 1:  # the replicas share this machine's cores, as TP ranks do
        threads = fields.get("num_threads") or default_num_threads()
        fields = {**fields, "num_threads": threads_per_rank(threads, a.dp_local)}
    if a.dp_local >= 1:  # each local core's ranks get their CPUs here (replica_spec)
        tp = fields.get("tensor_parallel_size") or 1
        threads = threads_per_rank(fields.get("num_threads") or default_num_threads(), tp)
        bind = serve_cpu_bind(fields.get("cpu_bind", default_cpu_bind()), a.dp_local, tp, threads)
        fields = {**fields, "cpu_bind": bind}
    model_dir = model_dir_of(a.model)  # a .gguf file is converted here, once
    spec = CoreSpec(str(model_dir), fields, a.settings.max_step_failures)
    address = (a.data_parallel_address, a.data_parallel_rpc_port)
    timeout = a.data_parallel_connect_timeout
    if a.headless:
        return run_headless(spec, a.dp_local, address, timeout)
    tokenizer = load_tokenizer(model_dir, ModelConfig.load(model_dir).hf_config)
    ray_replicas = RayReplicas(spec, a.dp_ray, connect_timeout=timeout) if a.dp_ray else None
    try:
        if ray_replicas is not None:
            cores = ray_replicas.launch()
        else:
            cores = launch_replicas(
                spec,
                a.dp_local,
                a.dp_remote,
                address=address,
                restarts=a.engine_core_restarts,
                connect_timeout=timeout,
            )
    except ReplicaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        client = DPClient(cores) if len(cores) > 1 or ray_replicas else cores[0]
        return run_core_server(client, tokenizer, a.settings, model_root=str(a.model))
    finally:
        stop_all(cores, 1.0)
        if ray_replicas is not None:
            ray_replicas.close()


def _exit_now(code: int) -> None:
    # The interpreter's own exit would now collect every object the model and the engine
    # made (a full garbage collection: seconds under load, past the shutdown bound). The
    # server has shut down and the workers are closed: flush and end the process here.
    end_ray()  # os._exit skips Ray's own shutdown (a local Ray would outlive this process)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
