"""The `lucegen run` and `lucegen serve` subcommands."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

# The engine and the HTTP stack are imported when a command runs, so other subcommands start fast.


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="generate from a prompt, streaming the text; speeds at the end (stderr)")
    _model_arguments(run)
    run.add_argument("--prompt", required=True, help="the prompt text")
    run.add_argument("--chat", action="store_true", help="send the prompt as a user message through the "
                                                         "model's chat template")
    run.add_argument("--thinking", action="store_true", help="with --chat: let the model think first")
    run.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default 256)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0, help="0 (the default) keeps every token")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    run.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens whatever comes")
    run.set_defaults(fn=cmd_run)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions)")
    _model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                                                       "(default: $LUCEGEN_API_KEY; none when unset)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use "
                                                                 "(default: the model's folder or file name)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(fn=cmd_serve)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF snapshot folder, .gguf file or hub model id (default: the "
                                                 "bundled tiny-pycode target, lucegen/models/tiny-pycode)")
    p.add_argument("--backend", default="numpy", help="numpy (the default: the reference, slow) or cuda")
    p.add_argument("--max-context", type=int, default=None, help="tokens of prompt + output (default: the "
                                                                 "model's max_position_embeddings)")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the model's folder)")
    p.add_argument("--spec", default=None, help="chip spec of the cuda backend (specs/<chip>.yaml or a name)")
    p.add_argument("--draft", default=None, help="DFlash draft folder for speculative decoding")
    p.add_argument("--budget", type=int, default=None, help="with --draft: draft tree nodes per target pass "
                                                             "(default: the spec's DDTree budget, else 22)")
    p.add_argument("--chain", action="store_true", help="with --draft: verify the draft's top-1 chain, not a tree")


def _load(args: argparse.Namespace):
    from ..engine.loader import default_model, load_model
    if args.model is None:
        args.model = str(default_model())
    return load_model(args.model, args.backend, max_context=args.max_context, spec=args.spec, draft=args.draft,
                      budget=args.budget, chain=args.chain, tokenizer=args.tokenizer)


def cmd_run(args: argparse.Namespace) -> int:
    from ..engine.generate import check_request, generate
    from ..engine.sampling import SamplingParams
    try:  # every error of the set-up is a ValueError naming what was wrong
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        engine, tokenizer = _load(args)
        prompt = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                enable_thinking=args.thinking) if args.chat else args.prompt)
        prompt_ids = tokenizer.encode(prompt)
        max_tokens = check_request(engine, prompt_ids, args.max_tokens)
    except ValueError as e:
        print(f"lucegen run: {e}", file=sys.stderr)
        return 2
    try:
        result = generate(engine, tokenizer, prompt_ids, max_tokens, sampling, args.stop,
                          ignore_eos=args.ignore_eos, on_text=lambda text: print(text, end="", flush=True))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print()
    print(f"prompt: {result.prompt_tokens} tokens, {result.prefill_tps:.1f} tok/s | output: "
          f"{result.completion_tokens} tokens, {result.decode_tps:.1f} tok/s | finish: {result.finish_reason}"
          + (f" | {result.tokens_per_pass:.2f} tokens per target pass" if args.draft else ""), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.loader import model_name
    from .app import create_app
    api_key = args.api_key or os.environ.get("LUCEGEN_API_KEY") or None
    try:
        engine, tokenizer = _load(args)
    except ValueError as e:
        print(f"lucegen serve: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or model_name(args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if not api_key and not _is_loopback(args.host):
        print(f"lucegen serve: warning: {args.host} is reachable from other machines and no --api-key is set",
              file=sys.stderr)
    print(f"lucegen serve: {name} ({args.backend} backend, context {engine.max_context} tokens) at "
          f"http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)
    uvicorn.run(create_app(engine, tokenizer, name, api_key), host=args.host, port=args.port,
                log_level=args.log_level)
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
