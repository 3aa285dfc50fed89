"""``mha-parity``: cross-framework verification from the command line.

``mha-parity verify`` runs the built-in grid (every mask form, self- and cross-attention,
grouped and multi-query heads, float64/float32/bfloat16) through both frameworks and the
float64 oracle, forward and gradients: by default a covering grid, in which every pair of
configuration, mask form, dtype and implementation runs, and with ``--grid full`` every
implementation on every case. JAX's persistent compilation cache (``--compile-cache``, on
unless ``--no-compile-cache``) lets a second run read its compiled programs back. With
``--weights FILE`` it loads a checkpoint into both frameworks, compares them with the
implementation the weights came from (``--layout`` names it, else the file's keys show it;
``--source`` says how many heads it has) and then runs the grid on the checkpoint's weights.
With ``--config config.json --weights FILE`` it verifies each attention layer of a
transformers model (``from_hf`` in both frameworks against the layer of transformers' own
model, one row per layer). ``mha-parity convert IN OUT --to {flax,torch}`` converts a
checkpoint file and checks the result bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from parity_tests.tool import cases as grids
from parity_tests.tool import compile_cache, files, harness, workers  # the frameworks are imported when a case runs

EXIT_CODES = """exit codes:
  0  every comparison passed
  1  a comparison failed (a case beyond its tolerance, our modules against the source, or a
     framework holding other bits than the file after loading)
  2  bad arguments, an unreadable or unfitting file, or a framework not installed (the message says which)"""

# What verify and convert import, and the extra that installs each.
FRAMEWORKS = (("jax", "jax"), ("flax", "jax"), ("torch", "torch"))

IMPLEMENTATIONS = [
    "mha_jax.MultiHeadAttention (nnx; implementations xla and blockwise)",
    "mha_torch.MultiHeadAttention (implementations math and sdpa)",
    "the float64 NumPy oracle",
]


def _verify(args: argparse.Namespace) -> int:
    directory = None if args.no_compile_cache else args.compile_cache or compile_cache.default_directory()
    with compile_cache.using(directory):
        return _verify_model(args) if args.config else _verify_grid(args, directory)


def _verify_grid(args: argparse.Namespace, cache: str | None) -> int:
    """The built-in grid, or a checkpoint's (``--weights``); ``cache``: the compilation cache's
    directory, or None."""
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 cases need it; float32 ones are unaffected
    from parity_tests.tool import report

    dtypes = args.dtype or list(harness.DTYPES)
    sections: dict[str, list[harness.Result]] = {}
    start = time.perf_counter()
    if args.weights:
        from parity_tests.tool import ports, sources

        checkpoint = ports.read(args.weights, **_naming(args))
        source = sources.build(checkpoint, args.source)
        c = checkpoint.config()
        notes = list(source.notes) if source else [
            "the file is in mha_torch's own names: our two modules are the source, "
            "compared with each other and the oracle"]
        compared = source.name if source and source.build else None
        header = report.Header(
            f"mha-parity verify --weights {checkpoint.path}: our modules against "
            f"{compared or 'each other'} and the float64 oracle",
            implementations=IMPLEMENTATIONS, source=compared or "not built (see the note)",
            weights=checkpoint.describe(),
            shapes=_shapes(c), seed=args.seed, notes=notes,
        )
        report.Printer(header)
        try:
            ports.check_loads(checkpoint)
        except AssertionError as error:
            print(f"FAILED: {error}")
            return 1
        print("loaded into both frameworks, bit for bit")
        cases = ports.cases(checkpoint, args.dtype, args.mask)
        masks = [m for m in _source_masks() if not args.mask or m in args.mask] if source and source.build else []
        if masks:
            # the grid runs in its worker processes while this one compares with the source
            alongside = args.workers > 1 and not sys.stdout.isatty()
            grid = _in_background(cases, checkpoint.state, args, cache) if alongside else None
            sections["against the source"] = _against_source(checkpoint, source, dtypes, masks, args.seed)
            if grid:
                sections["the twins and the oracle"] = grid()
                return _finish(args, header, sections, start, checkpoint)
        weights = checkpoint.state
    else:
        cases, header = _builtin_grid(args, cache)
        weights = None
        report.Printer(header)
    with report.Printer(None, total=len(cases)) as printer:
        sections["the twins and the oracle"] = workers.run_cases(
            cases, weights=weights, jit=args.jit, seed=args.seed, workers=args.workers, done=printer.done,
            compile_cache=cache)
    return _finish(args, header, sections, start, checkpoint if args.weights else None)


def _builtin_grid(args: argparse.Namespace, cache: str | None):
    """The built-in grid's cases (covering, or ``--grid full``; of the masks and dtypes asked
    for) and the report's header for them."""
    from parity_tests.tool import report

    full = grids.full_grid(args.mask, args.dtype)
    cases = full if args.grid == "full" else grids.covering_grid(args.mask, args.dtype)
    header = report.Header(
        "mha-parity verify: mha_jax against mha_torch and the float64 oracle, the built-in grid",
        implementations=IMPLEMENTATIONS,
        shapes="".join(f"\n    {c.name}: {_shapes(c)}" for c in harness.CONFIGS.values()), seed=args.seed,
        notes=[_grid_note(args.grid, cases, full), _cache_note(cache)],
    )
    return cases, header


def _verify_model(args: argparse.Namespace) -> int:
    """``--config``: each layer of a transformers model against ours, one row per layer."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("mha-parity verify: error: --config builds the model with transformers, which is not installed "
              "(pip install \"transformers>=5\")", file=sys.stderr)
        return 2
    from parity_tests.tool import models

    start = time.perf_counter()
    source = models.load(args.config, args.weights)
    c = source.model.config
    print(f"mha-parity verify --config {args.config}: each attention layer of transformers' "
          f"{type(source.model).__name__} against mha_torch.from_hf and mha_jax.from_hf")
    print(f"  weights: {', '.join(source.files)} ({len(source.state)} tensors; not in the model: "
          f"{len(source.unexpected)}, model weights not in them: {len(source.missing)}"
          + (f", e.g. {source.missing[0]}" if source.missing else "") + ")")
    print(f"  inputs: batch {models.BATCH}, length {models.LENGTH}, the rows starting at positions {models.OFFSETS} "
          f"and ending in {models.PADDING} padded tokens, {'causal' if models.is_causal(source) else 'bidirectional'}; "
          f"seed {args.seed}; hidden {c.hidden_size}, "
          f"{c.num_attention_heads} heads")
    print(f"  compared: the output and the gradients of the input and of every weight; ours against the source "
          f"in float32 (tolerance {models.SOURCE_TOLERANCE:.0e}), JAX against PyTorch in float64 "
          f"(tolerance {models.TWINS_TOLERANCE:.0e}); relative errors (norm of the difference / norm)", flush=True)

    def done(r):
        print(f"layer {r.layer} ({r.attention}): {'passed' if r.passed else 'FAILED'}; worst "
              + ", ".join(f"{k} {v:.1e}" for k, v in r.errors.items()), flush=True)

    _, results = models.verify(args.config, args.weights, layers=args.layer, seed=args.seed, done=done, source=source)
    failed = [r for r in results if not r.passed]
    elapsed = time.perf_counter() - start
    print("\n".join(summary(results, elapsed)))
    if args.json:
        files.write_text(args.json, json.dumps({"config": args.config, "weights": source.files, "passed": not failed,
                                                "seconds": elapsed, "layers": [r.as_json() for r in results]},
                                               indent=1))
        print(f"JSON report written to {args.json}")
    return 1 if failed else 0


def summary(results: list, elapsed: float) -> list[str]:
    """The closing lines of ``verify --config``: a line per failed layer naming each comparison beyond its tolerance
    (and its worst tensor), then the count."""
    failed = [r for r in results if not r.passed]
    lines = [f"FAILED: layer {r.layer}: " + "; ".join(
        f"{k} {v:.2e}" + (f" (worst: {r.worst[k]})" if k in r.worst else "") for k, v in r.failures().items())
        for r in failed]
    return lines + [f"{len(results)} layer{'' if len(results) == 1 else 's'} in {elapsed:.1f} s: "
                    + ("every comparison passed" if not failed else f"{len(failed)} FAILED")]


def _grid_note(grid: str, cases: list[harness.Case], full: list[harness.Case]) -> str:
    if grid == "full":
        return f"the full grid: every implementation on each of its {len(full)} cases"
    return (f"the covering grid: {len(cases)} of the full grid's {len(full)} cases, each with one JAX and one PyTorch "
            "implementation or more beside the oracle, so that every pair of configuration, mask form, dtype and "
            "implementation runs at least once; --grid full runs every implementation on every case")


def _cache_note(cache: str | None) -> str:
    return f"JAX's compilation cache: {cache} (--no-compile-cache: off)" if cache else "JAX's compilation cache: off"


def _in_background(cases, weights, args, cache):
    """Start the grid in a thread (its cases run in ``args.workers`` processes); returns a
    function that waits for its results."""
    import threading

    from parity_tests.tool import report

    box: dict = {}
    printer = report.Printer(None, total=len(cases))

    def run():
        try:
            box["results"] = workers.run_cases(cases, weights=weights, jit=args.jit, seed=args.seed,
                                               workers=args.workers, done=printer.done, compile_cache=cache)
        except BaseException as error:  # handed to the waiting thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["results"]

    return wait


def _finish(args, header, sections, start, checkpoint) -> int:
    """The tables, the totals and the files asked for; the exit code."""
    from parity_tests.tool import report

    elapsed = time.perf_counter() - start
    printer = report.Printer(None)
    failed = []
    for title, section in sections.items():
        failed += printer.table(section, title=f"{title}: ")
    print(f"{sum(map(len, sections.values()))} cases in {elapsed:.1f} s: "
          + ("every comparison passed" if not failed else f"{len(failed)} FAILED"))
    if args.json:
        out = {"header": header.lines(), "passed": not failed, "seconds": elapsed,
               "cases": [r.as_json() for r in sections["the twins and the oracle"]]}
        if "against the source" in sections:
            out["source_cases"] = [r.as_json() for r in sections["against the source"]]
        if checkpoint is not None:
            out["weights"] = checkpoint.describe()
        files.write_text(args.json, json.dumps(out, indent=1))
        print(f"JSON report written to {args.json}")
    if args.report:
        written = report.write_markdown(args.report, header, sections)
        print(f"Markdown report written to {', '.join(written)}")
    return 1 if failed else 0


def _source_masks():
    from parity_tests.tool import callables

    return callables.MASKS


def _against_source(checkpoint, source, dtypes, masks, seed) -> list[harness.Result]:
    """Our modules (loaded by our loaders) and the source (loaded by its own) on the same inputs."""
    from parity_tests.tool import callables, ports, report

    c = checkpoint.config()

    def ours(framework):
        def build(dtype):
            layer = ports.build_ours(checkpoint, dtype)[0 if framework == "jax" else 1]
            return lambda q, kv, mask: layer(q, kv, mask=mask)
        return framework, build

    inputs = callables.Inputs(
        c.num_heads, c.in_features, q_len=c.q_len,
        kv_len=None if c.self_attention else c.kv_len, in_kv_features=c.in_kv_features,
    )
    implementations = {"source": (source.framework, source.build), "jax": ours("jax"), "torch": ours("torch")}
    with report.Printer(None, total=len(dtypes) * len(masks)) as printer:
        return callables.compare(
            implementations, inputs, out_features=c.out_features or c.in_features, dtypes=dtypes, masks=masks,
            seed=seed,
            weights=checkpoint.state, num_kv_heads=c.kv_heads, name="source", done=printer.done,
        )


def _shapes(c: harness.Config) -> str:
    kv = f", kv_len {c.kv_len}, key/value features {c.in_kv_features}" if not c.self_attention else " (self-attention)"
    return (f"batch {c.batch}, q_len {c.q_len}{kv}, features {c.in_features}, {c.num_heads} heads, "
            f"{c.kv_heads} key/value heads, qkv {c.qkv_features or c.in_features}, "
            f"out {c.out_features or c.in_features}")


def _convert(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 weights stay float64
    from parity_tests.tool import ports

    if os.path.exists(args.output) and not args.force:
        raise FileExistsError(f"{args.output} exists; pass --force to overwrite it")
    checkpoint = ports.read(args.input, **_naming(args))
    try:
        ports.write(checkpoint, args.output, args.to)  # read back bit for bit before it replaces OUT
    except AssertionError as error:
        print(f"FAILED: {error}; {args.output} is left as it was", file=sys.stderr)
        return 1
    print(f"read {checkpoint.describe()}")
    print(f"wrote {args.output} for {args.to}: {len(checkpoint.state)} tensors, "
          "read back bit for bit in both frameworks")
    return 0


def _naming(args: argparse.Namespace) -> dict:
    return dict(layout=args.layout, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                prefix=args.prefix, ignore=tuple(args.ignore or ()), mapping=_mapping(args.mapping))


def _mapping(pairs: list[str] | None) -> dict[str, str] | None:
    """``--mapping OURS=THEIRS`` pairs (repeatable, or comma-separated) as ``from_torch``'s ``mapping``."""
    if not pairs:
        return None
    entries = [entry for pair in pairs for entry in pair.split(",") if entry]
    wrong = [entry for entry in entries if entry.count("=") != 1]
    if wrong:
        raise ValueError(f"--mapping takes OURS=THEIRS (e.g. k_proj=wk), got {', '.join(map(repr, wrong))}")
    return dict(entry.split("=") for entry in entries)


def cli_words(message: str) -> str:
    """A loader's message in the command line's words: ``--prefix``, not ``prefix=``."""
    for python, flag in (("num_kv_heads", "--num-kv-heads"), ("num_heads", "--num-heads")):
        message = re.sub(rf"(?<![\w-]){python}=", f"{flag} ", message)
        message = re.sub(rf"(?<![\w.-]){python}\b", flag, message)
    for python, flag in (("prefix", "--prefix"), ("ignore", "--ignore"), ("layout", "--layout")):
        message = re.sub(rf"(?<![\w-]){python}=", flag, message)
    message = message.replace("or mapping= for another naming scheme", "or, for another naming scheme, --mapping")
    message = re.sub(r"^mapping: ", "--mapping: ", message)
    return re.sub(r"state_dict \(layout ", "the file (--layout ", message)


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout", metavar="NAME",
        help="naming scheme of the file: mha_torch, torch_mha, hf, bert, fused_qkv, or flax (Flax parameter "
             "names; always for .msgpack); default: the one the keys (under --prefix) show",
    )
    parser.add_argument(
        "--mapping", action="append", metavar="OURS=THEIRS",
        help="another naming scheme: the file's name of each projection (q_proj, k_proj, v_proj, out_proj, or "
             "qkv_proj for a fused one), e.g. q_proj=wq,k_proj=wk,v_proj=wv,out_proj=wo (repeatable); the source "
             "is the implementation the file's keys show",
    )
    parser.add_argument("--num-heads", type=int, metavar="N", help="query heads (needed for PyTorch names)")
    parser.add_argument("--num-kv-heads", type=int, metavar="N", help="key/value heads (default: --num-heads)")
    parser.add_argument("--prefix", default="",
                        help="read only keys starting with this, e.g. encoder.layer.0.attention.")
    parser.add_argument("--ignore", action="append", metavar="NAME",
                        help="leave out keys under the prefix starting with NAME (repeatable)")


def missing_frameworks() -> str | None:
    """What to install when a framework is missing (a JAX-only or PyTorch-only install), else None."""
    import importlib.util

    missing = [name for name, _ in FRAMEWORKS if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    extras = sorted({extra for name, extra in FRAMEWORKS if name in missing})
    return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
            f"(the mha-parity[{', '.join(extras)}] extra): verify and convert run both frameworks; "
            "install them with pip install \"mha-parity[parity]\"")


def _parser() -> argparse.ArgumentParser:
    """``mha-parity`` and its subcommands: verify, convert and compare."""
    from parity_tests.porting import command as porting  # a whole model against its port (NumPy only here)

    parser = argparse.ArgumentParser(prog="mha-parity", description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_verify_parser(commands)
    _add_convert_parser(commands)
    porting.add_parser(commands, EXIT_CODES)
    return parser


def _add_verify_parser(commands) -> None:
    verify = commands.add_parser(
        "verify", help="run the cross-framework verification grid", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Our JAX and PyTorch modules against each other and the float64 oracle on the built-in grid, "
                    "or on a checkpoint (--weights), then also against the implementation the checkpoint came from.",
    )
    verify.add_argument("--json", metavar="PATH", help="write a JSON report")
    verify.add_argument("--report", metavar="PATH",
                        help="write a Markdown report (tables, and a plot per dtype of error against tolerance when "
                             "matplotlib can be imported)")
    verify.add_argument("--dtype", action="append", choices=harness.DTYPES,
                        help="only this dtype (repeatable; the covering grid covers the pairs of what is left)")
    verify.add_argument("--mask", action="append", choices=harness.MASKS,
                        help="only this mask form (repeatable; the covering grid covers the pairs of what is left)")
    verify.add_argument("--grid", choices=("covering", "full"),
                        help="the built-in grid: covering (the default: every pair of configuration, mask form, "
                             "dtype and implementation at least once) or full (every implementation on every case)")
    cache = verify.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR",
                       help="JAX's persistent compilation cache (default: $MHA_PARITY_COMPILE_CACHE, else "
                            "$XDG_CACHE_HOME/mha-parity/jax, else ~/.cache/mha-parity/jax)")
    cache.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh and keep nothing")
    verify.add_argument("--jit", action="store_true",
                        help="run the JAX xla side under jax.jit too (blockwise always is)")
    verify.add_argument("--seed", type=int, default=0, help="random weights and inputs (default 0)")
    verify.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), metavar="N",
                        help="processes running the grid's cases (default: 2, or 1 on one core)")
    verify.add_argument("--weights", metavar="FILE",
                        help="a checkpoint (.safetensors or flax .msgpack) to verify instead of random weights")
    verify.add_argument("--source", metavar="SPEC",
                        help="with --weights, the model the weights came from: its Hugging Face config.json "
                             "(a config.json beside FILE is read without this), or module:function / file.py:function "
                             "returning the PyTorch model (the layer under --prefix is compared); without it the "
                             "source is built with --num-heads")
    verify.add_argument("--config", metavar="FILE",
                        help="a transformers model's config.json: with --weights (the whole model's .safetensors or "
                             "its model.safetensors.index.json), each attention layer is built by from_hf in both "
                             "frameworks and compared with the layer of transformers' model, one row per layer")
    verify.add_argument("--layer", type=int, action="append", metavar="N",
                        help="with --config, only layer N (repeatable; default: every attention layer)")
    _add_checkpoint_arguments(verify)


def _add_convert_parser(commands) -> None:
    convert = commands.add_parser("convert", help="convert a checkpoint file and check the result", epilog=EXIT_CODES,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_argument("input", metavar="IN", help=".safetensors (PyTorch or Flax names) or flax .msgpack")
    convert.add_argument("output", metavar="OUT", help=".safetensors, or .msgpack for --to flax")
    convert.add_argument("--to", required=True, choices=("flax", "torch"), help="the framework OUT is for")
    convert.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    _add_checkpoint_arguments(convert)


def _check_verify(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``: usage, message, exit code 2) the flags that cannot go together."""
    if args.source and not args.weights:
        parser.error("--source needs --weights")
    if args.config:
        if not args.weights:
            parser.error("--config needs --weights (the model's .safetensors or model.safetensors.index.json)")
        given = [flag for flag, value in (("--source", args.source), ("--layout", args.layout),
                                          ("--mapping", args.mapping), ("--num-heads", args.num_heads),
                                          ("--num-kv-heads", args.num_kv_heads),
                                          ("--prefix", args.prefix), ("--mask", args.mask), ("--dtype", args.dtype),
                                          ("--report", args.report)) if value]
        if given:
            parser.error(f"--config reads everything from the config; {', '.join(given)} cannot go with it")
    if args.grid and (args.weights or args.config):
        parser.error("--grid chooses the built-in grid; with --weights or --config every mask form and dtype runs")
    if args.layer and not args.config:
        parser.error("--layer needs --config")


def _compare(args: argparse.Namespace) -> int:
    from parity_tests.porting import command as porting

    return porting.run(args)


def _no_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    return None


@dataclass(frozen=True)
class _Command:
    """How ``main`` runs a subcommand: ``check(parser, args)`` refuses arguments that cannot go
    together (exit code 2), ``frameworks``: whether it needs JAX and PyTorch installed (exit code 2
    naming the extra when not), ``run(args)`` gives the exit code; an error of ``errors`` is
    printed, its message in the command line's words (``words``), as exit code 2 with no
    traceback (a bad file or argument)."""

    run: Callable[[argparse.Namespace], int]
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] = _no_check
    frameworks: bool = True
    errors: tuple[type[Exception], ...] = (ValueError, TypeError, OSError)
    words: Callable[[str], str] = cli_words


_COMMANDS = {
    "verify": _Command(_verify, check=_check_verify),
    "convert": _Command(_convert),
    # a whole model against its port: NumPy only, so no framework is required, and its messages are its own
    "compare": _Command(_compare, frameworks=False, errors=(ValueError, TypeError, OSError, ImportError), words=str),
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = _COMMANDS[args.command]
    command.check(parser, args)
    missing = missing_frameworks() if command.frameworks else None
    if missing:
        print(f"mha-parity {args.command}: error: {missing}", file=sys.stderr)
        return 2
    try:
        return command.run(args)
    except command.errors as error:
        print(f"mha-parity {args.command}: error: {command.words(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
