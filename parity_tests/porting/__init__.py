"""Comparing a whole PyTorch model with its JAX/Flax port, module by module.

``compare(torch_model, flax_model, *inputs, mapping=None)`` runs both on the same inputs, records
every submodule's inputs and outputs on both sides, pairs the modules by name and reports for
each the error it inherits and the error it adds, naming the first module that adds too much.
``compare_gradients``, ``compare_step`` and ``compare_decoding`` take the same models;
``save_reference``/``load_reference`` keep the PyTorch side for a machine without PyTorch;
``suggest_mapping``/``print_suggestion`` propose the ``mapping`` for a port whose names differ;
``compare_training`` trains a copy of each model and compares them step by step.
Importing this package imports neither framework; each function imports what it runs.
"""

from parity_tests.porting.core import compare
from parity_tests.porting.decoding import compare_decoding
from parity_tests.porting.gradients import compare_gradients, compare_step
from parity_tests.porting.recording import Recording
from parity_tests.porting.reference import load_reference, record, save_reference
from parity_tests.porting.report import ModuleResult, Report
from parity_tests.porting.suggest import Suggestion, print_suggestion, suggest_mapping
from parity_tests.porting.training import TrainingReport, compare_training

__all__ = [
    "ModuleResult", "Recording", "Report", "Suggestion", "TrainingReport", "compare", "compare_decoding",
    "compare_gradients", "compare_step", "compare_training", "load_reference", "print_suggestion", "record",
    "save_reference", "suggest_mapping",
]
