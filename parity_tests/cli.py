"""``mha-parity``: cross-framework verification from the command line.

``mha-parity verify`` runs the default grid (every mask form, self- and cross-attention,
grouped and multi-query heads, float64/float32/bfloat16) through both frameworks and the float64
oracle, shows a progress bar, then a table; ``--json PATH`` writes a report. The exit code is 1
when any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from parity_tests import harness  # NumPy only; the frameworks are imported when a case runs


def _verify(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 cases need it; float32 ones are unaffected
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    cases = [
        c for c in harness.default_grid()
        if (not args.dtype or c.dtype in args.dtype) and (not args.mask or c.mask in args.mask)
    ]
    console = Console(width=None if sys.stdout.isatty() else 100)
    results = []
    start = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(cases))
        for case in cases:
            progress.update(task, description=case.id)
            results.append(harness.run_case(case, jit=args.jit, seed=args.seed))
            progress.advance(task)
    elapsed = time.perf_counter() - start

    table = Table(title=f"mha-parity verify: {len(cases)} cases, {elapsed:.1f} s")
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
    if args.json:
        report = {"cases": [r.as_json() for r in results], "passed": not failed, "seconds": elapsed}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"report written to {args.json}")
    return 1 if failed else 0


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
    args = parser.parse_args(argv)
    if args.command == "verify":
        return _verify(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
