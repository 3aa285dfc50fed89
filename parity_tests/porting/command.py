"""``mha-parity compare``: a PyTorch model (or a saved reference) against its Flax port, from the
command line. The models, the inputs and the name mapping come from ``module:name`` or
``path/to/file.py:name`` (a callable is called without arguments: a factory)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

import numpy as np

from parity_tests.porting import (
    compare,
    compare_gradients,
    compare_step,
    compare_training,
    load_reference,
    print_suggestion,
    save_reference,
    suggest_mapping,
)

DESCRIPTION = ("A PyTorch model and its Flax port on the same inputs, module by module: the error each module adds "
               "and inherits, the first divergence, the outputs (logits: KL and top-k agreement); optionally the "
               "gradients and one AdamW step. The PyTorch side may be a reference saved earlier (--reference), "
               "where PyTorch is not installed.")


def add_parser(commands, epilog: str) -> None:
    parser = commands.add_parser("compare", help="compare a whole PyTorch model with its Flax port, module by module",
                                 description=DESCRIPTION, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flax", required=True, metavar="SPEC",
                        help="module:factory or file.py:factory returning the nnx model or a linen (module, variables)")
    parser.add_argument("--torch", metavar="SPEC", help="module:factory or file.py:factory returning the PyTorch model")
    parser.add_argument("--reference", metavar="DIR", help="a reference saved by --save-reference instead of --torch")
    parser.add_argument("--inputs", metavar="SPEC",
                        help="module:name or file.py:name: a tuple of NumPy arrays (or a factory returning one), "
                             "or an .npz file (its arrays in order); default with --reference: the reference's")
    parser.add_argument("--mapping", metavar="SPEC",
                        help="module:name of a dict: PyTorch name pattern -> JAX name; 'auto': the suggested one")
    parser.add_argument("--suggest-mapping", action="store_true",
                        help="print the mapping suggested from both models' module calls (a dict to paste), and stop")
    parser.add_argument("--mask-input", type=int, metavar="N",
                        help="compare only the positions where input N (an attention mask) is nonzero")
    parser.add_argument("--dtype", metavar="DTYPE", help="the dtype both sides must hold (default: PyTorch's)")
    parser.add_argument("--gradients", action="store_true", help="also compare the gradients of every parameter")
    parser.add_argument("--step", action="store_true", help="also compare every parameter after one AdamW step")
    parser.add_argument("--train", type=int, metavar="STEPS",
                        help="also train a copy of each model for STEPS steps on the inputs (next-token cross-entropy "
                             "of the logits, AdamW on both sides) and compare them after every step")
    parser.add_argument("--save-reference", metavar="DIR", help="save the PyTorch side (with --torch) to compare later")
    parser.add_argument("--json", metavar="PATH", help="write a JSON report")
    parser.add_argument("--report", metavar="PATH",
                        help="write a Markdown report (and a plot of error per module when matplotlib can be imported)")


def load(spec: str, flag: str):
    """The object ``module:name`` or ``file.py:name`` names; a callable is called (a factory)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag} must be module:name or file.py:name, got {spec!r}")
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise FileNotFoundError(f"{flag}: {where} does not exist")
        found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{flag}: {where} has no {name!r}")
    value = getattr(module, name)
    return value() if callable(value) else value


def _inputs(spec: str | None) -> tuple:
    if spec is None:
        return ()
    if spec.endswith(".npz"):
        with np.load(spec) as f:
            return tuple(f[k] for k in f.files)
    value = load(spec, "--inputs")
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _train(args: argparse.Namespace, flax_model, inputs: tuple, mapping):
    """``compare_training`` on a fresh PyTorch model, the inputs as its one batch."""
    return compare_training(load(args.torch, "--torch"), flax_model, [inputs], steps=args.train, mapping=mapping)


def run(args: argparse.Namespace) -> int:
    """The comparison the arguments ask for: prints the table; the exit code (0 passed, 1 failed).
    ``--suggest-mapping`` prints the suggested mapping instead (exit code 0)."""
    if (args.torch is None) == (args.reference is None):
        raise ValueError("give one of --torch (the PyTorch model) and --reference (a saved reference)")
    if args.reference and (args.save_reference or args.gradients or args.step or args.train):
        raise ValueError("--save-reference, --gradients, --step and --train run the PyTorch model: they need --torch")
    if args.train is not None and args.train < 1:
        raise ValueError(f"--train takes a number of steps of at least 1, got {args.train}")
    inputs = _inputs(args.inputs)
    if args.torch and not inputs:
        raise ValueError("--torch needs --inputs (the arrays both models are given)")
    torch_model = load(args.torch, "--torch") if args.torch else load_reference(args.reference)
    flax_model = load(args.flax, "--flax")
    if args.suggest_mapping:
        print_suggestion(torch_model, flax_model, *inputs)
        return 0
    mapping = args.mapping if args.mapping in (None, "auto") else load(args.mapping, "--mapping")
    if mapping == "auto" and (args.gradients or args.step or args.train):  # pairs their parameters too
        mapping = dict(suggest_mapping(torch_model, flax_model, *inputs))
    if args.save_reference:
        torch_model = save_reference(args.save_reference, torch_model, *inputs, dtype=args.dtype)
        print(f"reference saved in {args.save_reference}")
    given = inputs or torch_model.inputs
    valid = None
    if args.mask_input is not None:
        if not 0 <= args.mask_input < len(given):
            raise ValueError(f"--mask-input {args.mask_input}: there are {len(given)} inputs")
        valid = np.asarray(given[args.mask_input]) != 0
    report = compare(torch_model, flax_model, *inputs, mapping=mapping, dtype=args.dtype, valid=valid)
    print(report.table())
    out, passed = report.as_json(), report.passed
    for wanted, check in ((args.gradients, compare_gradients), (args.step, compare_step)):
        if wanted:
            extra = check(load(args.torch, "--torch"), flax_model, *inputs, mapping=mapping, valid=valid)
            print(extra.table())
            out[check.__name__.removeprefix("compare_")] = extra.as_json()
            passed = passed and extra.passed
    if args.train:
        training = _train(args, flax_model, inputs, mapping)
        print(training.table())
        out["training"] = training.as_json()
        passed = passed and training.passed
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(out, passed=passed), f, indent=1)
        print(f"JSON report written to {args.json}")
    if args.report:
        print(f"Markdown report written to {', '.join(report.markdown(args.report))}")
    failures = report.failures() + [f for extra in out.values() if isinstance(extra, dict)
                                    for f in extra.get("failures", [])]
    print("every comparison passed" if passed else "FAILED: " + ("; ".join(failures) or "see above"))
    return 0 if passed else 1
