"""Files the tool writes (converted checkpoints, JSON and Markdown reports, plots) replace what
stood at their path only once complete and read back: a failure leaves the old file as it was."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Callable


def write_atomically(out: str, write: Callable[[str], None], check: Callable[[str], None] | None = None) -> None:
    """Write ``out`` by ``write(path)`` into a temporary file in ``out``'s folder (with ``out``'s
    extension, which writers and readers go by), ``check(path)`` it (it raises if the file does not
    hold what it must), then rename it over ``out`` (``os.replace``). On any failure, an
    interrupt included, ``out`` is as it was and the temporary file is gone."""
    out = os.fspath(out)
    folder, name = os.path.split(os.path.abspath(out))
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix="".join(pathlib.Path(name).suffixes), dir=folder)
    os.close(fd)
    try:
        write(path)
        os.chmod(path, _mode(out))  # mkstemp's 0600 would otherwise replace the file's own mode
        if check is not None:
            check(path)
        os.replace(path, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        raise


def write_text(out: str, text: str) -> None:
    """``out`` holding ``text`` (UTF-8), read back byte for byte before it replaces ``out``."""
    data = text.encode()

    def check(path):
        if pathlib.Path(path).read_bytes() != data:
            raise OSError(f"{out}: the file written does not read back as written; {out} is left as it was")

    write_atomically(out, lambda path: pathlib.Path(path).write_bytes(data), check)


def _mode(out: str) -> int:
    """The permissions ``out`` has, or those a new file gets under the process's umask."""
    try:
        return os.stat(out).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
