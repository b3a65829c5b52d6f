"""A PEP 503 package index from a folder of wheels, for offline image builds.

    python tools/wheel_index.py WHEELS OUT            # OUT/<project>/<wheel> + index pages
    python tools/wheel_index.py WHEELS OUT --serve 8765   # ... and serve OUT on 127.0.0.1

Fill WHEELS with `pip download --only-binary=:all: -d WHEELS torch==2.13.0` on a machine that
has the CPU wheel (pip resolves torch's own dependencies too), then build the images with
`TORCH_INDEX_URL=http://127.0.0.1:8765/` and the build network `host` (docs/deploy.md,
"Offline image builds"). Only the standard library; serves until interrupted.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import quote


def project_of(wheel: str) -> str:
    """The normalized project name of a wheel file name (PEP 503: runs of -_. become -)."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def _page(title: str, links: list[tuple[str, str]]) -> str:
    anchors = "\n".join(f'<a href="{quote(h)}">{html.escape(t)}</a><br>' for h, t in links)
    return f"<!DOCTYPE html>\n<html><head><title>{title}</title></head><body>\n{anchors}\n</body></html>\n"


def build_index(wheels: Path, out: Path) -> dict[str, list[str]]:
    """Copy every wheel of `wheels` into `out/<project>/` and write the index pages."""
    projects: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name = project_of(wheel.name)
        (out / name).mkdir(parents=True, exist_ok=True)
        target = out / name / wheel.name
        if not target.exists():
            shutil.copy2(wheel, target)
        projects.setdefault(name, []).append(wheel.name)
    for name, files in projects.items():
        (out / name / "index.html").write_text(_page(name, [(f, f) for f in files]))
    (out / "index.html").write_text(_page("simple", [(f"{n}/", n) for n in sorted(projects)]))
    return projects


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="folder of .whl files")
    parser.add_argument("out", type=Path, help="where the index is written")
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve it on 127.0.0.1:PORT")
    args = parser.parse_args(argv)
    projects = build_index(args.wheels, args.out)
    if not projects:
        print(f"error: no wheel in {args.wheels}", file=sys.stderr)
        return 2
    print(f"index of {len(projects)} projects in {args.out}", flush=True)
    if args.serve is not None:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(args.out))
        with http.server.ThreadingHTTPServer(("127.0.0.1", args.serve), handler) as server:
            print(f"serving http://127.0.0.1:{server.server_address[1]}/", flush=True)
            server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
