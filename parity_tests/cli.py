"""``mha-parity``: cross-framework verification from the command line.

``mha-parity verify`` runs the default grid (every mask form, self- and cross-attention,
grouped and multi-query heads, float64/float32/bfloat16) through both frameworks and the float64
oracle, shows a progress bar, then a table; ``--json PATH`` writes a report. The exit code is 1
when any case fails. With ``--weights FILE`` it runs the same cases on a user's checkpoint,
loaded into both frameworks. ``mha-parity convert IN OUT --to {flax,torch}`` converts a
checkpoint file and checks the result bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from parity_tests import harness  # NumPy only; the frameworks are imported when a case runs


def _verify(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 cases need it; float32 ones are unaffected
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if sys.stdout.isatty() else 100)
    if args.weights:
        from parity_tests import ports

        checkpoint = ports.read(args.weights, **_naming(args))
        try:
            ports.check_loads(checkpoint)
        except AssertionError as error:
            console.print(f"[red]FAILED[/]: {error}")
            return 1
        console.print(f"loaded into both frameworks, bit for bit: {checkpoint.describe()}")
        cases = ports.cases(checkpoint, args.dtype, args.mask)
        run = lambda case: ports.run_case(checkpoint, case, jit=args.jit, seed=args.seed)  # noqa: E731
    else:
        cases = [
            c for c in harness.default_grid()
            if (not args.dtype or c.dtype in args.dtype) and (not args.mask or c.mask in args.mask)
        ]
        run = lambda case: harness.run_case(case, jit=args.jit, seed=args.seed)  # noqa: E731
    results = []
    start = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(cases))
        for case in cases:
            progress.update(task, description=case.id)
            results.append(run(case))
            progress.advance(task)
    elapsed = time.perf_counter() - start
    failed = _print_table(console, results, elapsed)
    if args.json:
        report = {"cases": [r.as_json() for r in results], "passed": not failed, "seconds": elapsed}
        if args.weights:
            report["weights"] = checkpoint.describe()
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"report written to {args.json}")
    return 1 if failed else 0


def _print_table(console, results: list[harness.Result], elapsed: float) -> list[harness.Result]:
    """The table of the default run; returns the failed results."""
    from rich.table import Table

    table = Table(title=f"mha-parity verify: {len(results)} cases, {elapsed:.1f} s")
    for column in ("case", "dtype", "max abs error", "relative error", "gradient error", "pass"):
        left = column in ("case", "dtype")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for r in results:
        c = r.case
        table.add_row(
            f"{c.config.name}/{c.mask}", c.dtype, f"{r.max_abs:.2e}", f"{r.rel:.2e}",
            f"{r.grad:.2e}", "[green]yes[/]" if r.passed else "[red]NO[/]",
        )
    console.print(table)
    failed = [r for r in results if not r.passed]
    tolerances = ", ".join(f"{d} {f:.0e}/{g:.0e}" for d, (f, g) in harness.TOLERANCES.items())
    console.print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed "
        f"(tolerances forward/gradient: {tolerances})"
    )
    return failed


def _convert(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 weights stay float64
    from parity_tests import ports

    if os.path.exists(args.output) and not args.force:
        raise FileExistsError(f"{args.output} exists; pass --force to overwrite it")
    checkpoint = ports.read(args.input, **_naming(args))
    ports.write(checkpoint, args.output, args.to)
    try:
        ports.check_written(checkpoint, args.output, args.to)
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    print(f"read {checkpoint.describe()}")
    print(f"wrote {args.output} for {args.to}: {len(checkpoint.state)} tensors, read back bit for bit in both frameworks")
    return 0


def _naming(args: argparse.Namespace) -> dict:
    return dict(layout=args.layout, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                prefix=args.prefix, ignore=tuple(args.ignore or ()))


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout", metavar="NAME",
        help="naming scheme of a .safetensors file: mha_torch (default), torch_mha, hf, bert, "
             "fused_qkv, or flax (Flax parameter names; the default for .msgpack)",
    )
    parser.add_argument("--num-heads", type=int, metavar="N", help="query heads (needed for PyTorch names)")
    parser.add_argument("--num-kv-heads", type=int, metavar="N", help="key/value heads (default: --num-heads)")
    parser.add_argument("--prefix", default="", help="read only keys starting with this, e.g. encoder.layer.0.attention.")
    parser.add_argument("--ignore", action="append", metavar="NAME",
                        help="leave out keys under the prefix starting with NAME (repeatable)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-parity", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="run the cross-framework verification grid")
    verify.add_argument("--json", metavar="PATH", help="write a JSON report")
    verify.add_argument("--dtype", action="append", choices=harness.DTYPES,
                        help="only this dtype (repeatable)")
    verify.add_argument("--mask", action="append", choices=harness.MASKS, help="only this mask form (repeatable)")
    verify.add_argument("--jit", action="store_true", help="run the JAX side under jax.jit")
    verify.add_argument("--seed", type=int, default=0, help="random weights and inputs (default 0)")
    verify.add_argument("--weights", metavar="FILE",
                        help="a checkpoint (.safetensors or flax .msgpack) to verify instead of random weights")
    _add_checkpoint_arguments(verify)
    convert = commands.add_parser("convert", help="convert a checkpoint file and check the result")
    convert.add_argument("input", metavar="IN", help=".safetensors (PyTorch or Flax names) or flax .msgpack")
    convert.add_argument("output", metavar="OUT", help=".safetensors, or .msgpack for --to flax")
    convert.add_argument("--to", required=True, choices=("flax", "torch"), help="the framework OUT is for")
    convert.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    _add_checkpoint_arguments(convert)
    args = parser.parse_args(argv)
    try:
        return _verify(args) if args.command == "verify" else _convert(args)
    except (ValueError, TypeError, OSError) as error:  # a bad file or argument: say so, no traceback
        print(f"mha-parity {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
