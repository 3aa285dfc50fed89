"""griffe extension for the API reference.

- The twins' docstrings name shared sections as ``{name}`` lines (``mha_spec.docstrings``); griffe
  reads the source, so the sections are put in here as ``docstrings.fill`` puts them in at import.
- An ``Args:`` entry may name several arguments, and when their names run over a line (``a, b, c,``
  then ``d: ...`` indented below) this joins them into one ``a, b, c, d: ...`` line, which the
  Google-style parser reads as one entry. The docstrings themselves stay as written.
"""

import re

import griffe

from mha_spec import docstrings

# a line of names only, ending with a comma, then the rest of the names and the colon, indented
_SPLIT_NAMES = re.compile(r"^( *)((?:\w+, )*\w+,)\n +(?=(?:\w+, )*\w+:)", re.MULTILINE)


class JoinArgumentNames(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SPLIT_NAMES.sub(r"\1\2 ", docstrings.expand(obj.docstring.value))
