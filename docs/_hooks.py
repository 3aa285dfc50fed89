"""mkdocs hook: the benchmarks' result files (``benchmarks/results/``) become part of the site.

The performance page links to them as ``../benchmarks/results/NAME``, the path that is right when
the page is read in the repository; in the site they sit at ``benchmarks/results/NAME`` under the
root, so that link is rewritten for the build.
"""

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"


def on_files(files, config):
    for path in sorted((ROOT / RESULTS).iterdir()):
        if path.is_file():
            files.append(File(f"{RESULTS}/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(f"](../{RESULTS}/", f"]({RESULTS}/")
