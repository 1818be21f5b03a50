"""The `lucegen` command line: build, specs, doctor, bench, tune (and run, serve, plan)."""
from __future__ import annotations

import argparse
import sys
import time

from .model.config import ConfigError, load_config
from .plan import add_parser as register_plan
from .serve import register as register_run_serve
from .spec import SpecError, all_specs, load_spec, match_device


def cmd_build(args: argparse.Namespace) -> int:
    from .codegen.build import build, resource_table
    from .kernels import all_units
    spec = load_spec(args.spec)
    model = load_config(args.model)
    t0 = time.perf_counter()
    result = build(spec, model, all_units(spec, model), arch=args.arch)
    cached = sum(u.cached for u in result.units)
    print(f"lucegen build: spec {spec.name} ({result.arch}), model {model.name}: {len(result.units)} units, "
          f"{len(result.kernels)} kernels ({cached} units from cache) in {time.perf_counter() - t0:.2f} s")
    print(f"  -> {result.directory}/manifest.json\n")
    print(resource_table(result))
    spills = [k.name for k in result.kernels if k.spill_stores or k.spill_loads]
    if spills:
        print(f"\nwarning: register spills in {', '.join(spills)}", file=sys.stderr)
    return 0


def cmd_specs(args: argparse.Namespace) -> int:
    rows = [("spec", "arch", "SMs", "memory", "bandwidth", "megakernel", "DDTree", "KV")]
    for s in all_specs():
        c, t = s.chip, s.tuning
        rows.append((s.name, c.arch, str(c.sm_count), f"{c.memory_bytes / 2**30:.0f} GiB",
                     f"{c.read_gbs:.0f} GB/s", f"{t.megakernel.blocks}x{t.megakernel.threads}",
                     str(t.ddtree.budget), t.kv_format))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .codegen import nvrtc
    from .runtime import driver
    from .spec import supported_archs
    ok = True
    try:
        print(f"NVRTC        {nvrtc.version()}  (archs: {', '.join(supported_archs())})")
        print(f"CUDA headers {'; '.join(nvrtc.include_dirs())}")
    except Exception as e:
        ok = False
        print(f"NVRTC        unusable: {e}")
    try:
        info = driver.device_info()
    except driver.NoDriverError as e:
        print(f"driver       none: {e}")
        print("GPU          none (build works; running kernels needs an NVIDIA GPU)")
        return 0 if ok else 1
    spec = match_device(info.arch, info.sm_count, info.memory_bytes)
    print(f"driver       CUDA {info.driver_version}")
    print(f"GPU          {info.name}, {info.arch}, {info.sm_count} SMs, {info.memory_bytes / 2**30:.0f} GiB, "
          f"L2 {info.l2_bytes >> 20} MiB")
    print(f"spec         {spec.path if spec else 'none matches: emulate one with --arch ' + info.arch}")
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path
    from .bench.engines import bench_device
    from .bench.results import Recorder
    generation = args.suite in ("speculative", "prompts")  # on any engine backend; the others on the GPU
    rec = Recorder(gpu=bench_device(args.backend if generation else "cuda"),
                   out=Path(args.results) if args.results else None)
    if args.suite == "gemv":
        from .bench import gemv
        gemv.run(rec, tune=args.tune)
    elif args.suite == "prefill":
        from .bench import prefill
        prefill.run(rec, models=(args.model,) if args.model else prefill.MODELS,
                    lengths=tuple(args.lengths) if args.lengths else prefill.LENGTHS)
    elif args.suite == "qgemv":
        from .bench import qgemv
        qgemv.run(rec, tune_knobs=args.tune)
    elif args.suite == "decode":
        from .bench import decode
        decode.run(rec)
    elif args.suite == "energy":
        from .bench import energy
        energy.run(rec)
    elif args.suite == "speculative":
        from .bench import speculative
        speculative.run(rec, args.model or "tiny", args.backend, args.draft, args.budget or speculative.BUDGET,
                        args.tokens or speculative.TOKENS)
    elif args.suite == "prompts":
        from .bench import prompts
        if not args.model or not args.set:
            print("lucegen bench prompts: --set and --model are required", file=sys.stderr)
            return 2
        try:
            prompts.run(rec, args.set, args.model, args.mode, args.backend, draft=args.draft, budget=args.budget,
                        limit=args.limit, max_tokens=args.tokens)
        except ValueError as e:  # a bad option, model or draft: the message names it
            print(f"lucegen bench prompts: {e}", file=sys.stderr)
            return 2
    elif args.suite == "tree":
        from .bench import tree
        tree.run(rec)
    elif args.suite == "decode-gguf":
        from .bench import decode_gguf
        decode_gguf.run(rec, kv_format=args.kv)
    print(f"results appended to {rec.out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .engine.loader import default_model
    from .runtime import NoDriverError
    from .tune import tune
    try:  # every bad option, spec or model is a ValueError naming it (the cuda backend with no GPU: NoDriverError)
        options = {k: getattr(args, k) for k in ("budgets", "tokens", "prompts") if getattr(args, k) is not None}
        return tune(args.spec, args.model or str(default_model()), args.backend, args.draft, repeat=args.repeat,
                    write=args.write, **options)
    except (ValueError, NoDriverError) as e:
        print(f"lucegen tune: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lucegen", description="LLM inference kernels generated per chip")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render and compile every kernel for a spec and a model")
    b.add_argument("--spec", default="h200", help="specs/<chip>.yaml or a bare chip name (default h200)")
    b.add_argument("--model", default=None, help="bundled model name, config.json or checkpoint folder "
                                                 "(default qwen3.5-0.8b)")
    b.add_argument("--arch", default=None, help="compile for this arch instead of the spec's (emulation)")
    b.set_defaults(fn=cmd_build)
    sub.add_parser("specs", help="list the chip specs").set_defaults(fn=cmd_specs)
    sub.add_parser("doctor", help="check NVRTC, headers, driver and GPU").set_defaults(fn=cmd_doctor)
    bench = sub.add_parser("bench", help="benchmarks on this machine's GPU; results go to results/<gpu>.jsonl")
    bench.add_argument("suite", choices=["gemv", "qgemv", "prefill", "decode", "decode-gguf", "energy",
                                         "speculative", "prompts", "tree"])
    bench.add_argument("--results", default=None, help="append to this JSONL file instead of results/<gpu>.jsonl")
    bench.add_argument("--tune", action="store_true", help="gemv, qgemv: also sweep the kernels' tuning knobs and "
                       "print a table")
    bench.add_argument("--kv", default=None, choices=["bf16", "q8_0", "q4_0", "tq3_0"],
                       help="decode-gguf: the KV cache's format (default: the spec's tuning.kv_format)")
    g = bench.add_argument_group("speculative and prompts (any engine backend)")
    g.add_argument("--backend", default="cuda", help="engine backend: cuda (the default) or numpy (records go to "
                                                     "results/cpu.jsonl)")
    g.add_argument("--model", default=None, help="checkpoint folder, .gguf or hub id; 'tiny' makes the tiny "
                                                 "test checkpoint (default for speculative)")
    g.add_argument("--draft", default=None, help="DFlash draft folder (prompts: needed by --mode chain/ddtree; "
                                                 "speculative: its per-part cost)")
    g.add_argument("--budget", type=int, default=None, help="DDTree nodes per target pass (default 22)")
    g.add_argument("--tokens", type=int, default=None, help="output tokens per generation (speculative: default "
                                                            "64; prompts: at most this, else each prompt's)")
    g.add_argument("--set", choices=["humaneval", "gsm8k", "math500"], default=None, help="prompts: the set")
    g.add_argument("--mode", choices=["ar", "chain", "ddtree"], default="ar", help="prompts: decoding mode")
    g.add_argument("--limit", type=int, default=None, help="prompts: the first N prompts of the set only")
    bench.add_argument("--lengths", type=int, nargs="+", default=None, help="prefill: prompt lengths (default 520 "
                                                                            "4096 32768); --model: one model")
    bench.set_defaults(fn=cmd_bench)
    t = sub.add_parser("tune", help="measure speculative tok/s against the DDTree budget here; --write puts the "
                                    "best into the spec")
    t.add_argument("--spec", required=True, help="specs/<chip>.yaml or a bare chip name: the file --write changes")
    t.add_argument("--model", default=None, help="checkpoint folder, .gguf or hub id; 'tiny' makes the tiny test "
                                                 "checkpoint (default: the bundled tiny-pycode target)")
    t.add_argument("--draft", default=None, help="DFlash draft folder (default: none, an oracle of the target's own "
                                                 "output)")
    t.add_argument("--backend", default="cuda", help="engine backend: cuda (the default) or numpy")
    t.add_argument("--budgets", type=int, nargs="+", default=None, help="the budgets to measure (default 2 4 7 8 "
                                                                        "15 16 23 31 32 63 64)")
    t.add_argument("--tokens", type=int, default=None, help="output tokens per prompt (default 96)")
    t.add_argument("--prompts", type=int, default=None, help="short code prompts, 1 to 6 (default 6)")
    t.add_argument("--repeat", type=int, default=1, help="runs per prompt and budget, the median kept (default 1)")
    t.add_argument("--write", action="store_true", help="write the best budget into the spec file")
    t.set_defaults(fn=cmd_tune)
    register_run_serve(sub)  # run, serve
    register_plan(sub)  # plan
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (SpecError, ConfigError) as e:
        print(f"lucegen: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
