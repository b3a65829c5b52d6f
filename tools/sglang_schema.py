"""Extract the part of SGLang's HTTP contract Flywheel uses into a pinned JSON file.

SGLang's request classes cannot be imported here (their modules import torch, zmq, msgspec
and GPU kernels), so this reads the wheel's source with `ast` instead: the fields (name,
annotation, default, required) of each request/response class in
`sglang/srt/managers/io_struct.py` and `sglang/api/v1/api_types.py` (the generated JSON
contract `/generate` is checked against), and the method and body class of each route in
`sglang/srt/entrypoints/http_server.py`, and the source of the rule `/generate` applies to
`sampling_params` (`SamplingParams.__post_init__` and `SamplingParams.verify` in
`sglang/srt/sampling/sampling_params.py`, with the module constants and helpers they use),
which the stand-in runs as it is. The result, `tests/rollout/sglang_schema.json`, is what
the stand-in server and the client tests are held to.

    python tools/sglang_schema.py --src DIR_OR_WHEEL            # print
    python tools/sglang_schema.py --src DIR_OR_WHEEL --write    # update the pinned file
    python tools/sglang_schema.py --src DIR_OR_WHEEL --check    # exit 1 when it differs

`--src` is an unpacked wheel (the folder holding `sglang/`) or the `.whl` itself
(`pip download sglang==VERSION --no-deps -d DIR`); `FLYWHEEL_SGLANG_SRC` is its default.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / "tests" / "rollout" / "sglang_schema.json"

IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
# What `/generate` runs on `sampling_params` before it queues a request
# (`tokenizer_manager.py` `_create_tokenized_object`: construct, normalize, verify);
# `normalize` (stop strings, needing the tokenizer) is left out.
SAMPLING_METHODS = ("__post_init__", "verify")
SAMPLING_HELPERS = ("get_request_reasoning_end_token_ids",)

IO_CLASSES = (
    "GenerateReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "AbortReq",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput",
    "InitWeightsUpdateGroupReqInput",
    "InitWeightsUpdateGroupReqOutput",
    "DestroyWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqOutput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromDistributedReqOutput",
    "UpdateWeightVersionReqInput",
)
API_CLASSES = ("GenerateRequest", "SamplingParams")
ROUTES = (
    "/generate",
    "/ping",
    "/health",
    "/ready",
    "/model_info",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weight_version",
)


# The requirements of the wheel that the GPU image must match (deploy/docker/Dockerfile.gpu
# runs Flywheel's trainer on SGLang's torch: one NCCL build for both sides of a group).
PINNED_REQUIRES = ("torch", "transformers")


def _requires(metadata: str) -> dict[str, Any]:
    """The wheel's own pins of `PINNED_REQUIRES` and the CUDA extras (`[cu13]`, ...) of its
    unconditional `Requires-Dist` lines, from its METADATA."""
    pins: dict[str, str] = {}
    cuda: set[str] = set()
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:  # part of an optional extra, not what `pip install sglang` gets
            continue
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*([^;]*)", req)
        if m is None:
            continue
        name = m.group(1).lower().replace("_", "-")
        if name in PINNED_REQUIRES:
            pins[name] = m.group(3).strip()
        cuda.update(re.findall(r"\bcu\d+\b", m.group(2) or ""))
    return {"pins": {k: pins[k] for k in PINNED_REQUIRES if k in pins}, "cuda_extras": sorted(cuda)}


class Source:
    """Files of an unpacked wheel or of a `.whl`."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.zip = zipfile.ZipFile(src) if src.is_file() else None

    def read(self, rel: str) -> str:
        if self.zip is not None:
            return self.zip.read(rel).decode()
        return (self.src / rel).read_text()

    def version(self) -> str:
        names = self.zip.namelist() if self.zip is not None else os.listdir(self.src)
        for name in names:
            m = re.match(r"sglang-([0-9][^/]*)\.dist-info", name)
            if m:
                return m.group(1)
        raise SystemExit(f"no sglang-*.dist-info in {self.src}: pass the unpacked wheel")

    def metadata(self) -> str:
        return self.read(f"sglang-{self.version()}.dist-info/METADATA")


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _own_fields(cls: ast.ClassDef) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        annotation = ast.unparse(node.annotation)
        if annotation.startswith("ClassVar"):
            continue
        default = None if node.value is None else ast.unparse(node.value)
        if default is not None and default.startswith("field("):
            call = node.value
            assert isinstance(call, ast.Call)
            kws = {k.arg: ast.unparse(k.value) for k in call.keywords}
            default = kws.get("default", kws.get("default_factory"))
        out[name] = {"type": annotation, "default": default, "required": default is None}
    return out


def _fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, dict[str, Any]]:
    """Fields of `name` with those of its bases defined in the same module, bases first."""
    cls = classes[name]
    fields: dict[str, dict[str, Any]] = {}
    for base in cls.bases:
        base_name = ast.unparse(base).split("[")[0]
        if base_name in classes:
            fields.update(_fields(classes, base_name))
    fields.update(_own_fields(cls))
    return fields


def _unknown_keys(cls: ast.ClassDef) -> str | None:
    doc = ast.get_docstring(cls) or ""
    m = re.search(r"unknown keys (rejected|ignored)", doc)
    return m.group(1) if m else None


def _routes(tree: ast.Module) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = None
        for arg in node.args.args:
            if arg.arg == "obj" and arg.annotation is not None:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
                    assert isinstance(ann.slice, ast.Tuple)
                    ann = ann.slice.elts[0]
                body = ast.unparse(ann)
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call) or not isinstance(dec.func, ast.Attribute):
                continue
            kind = dec.func.attr
            if kind not in ("get", "post", "api_route") or not dec.args:
                continue
            if not isinstance(dec.args[0], ast.Constant):
                continue
            path = dec.args[0].value
            if path not in ROUTES:
                continue
            if kind == "api_route":
                methods = next(
                    (ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"),
                    ["GET"],
                )
            else:
                methods = [kind.upper()]
            out[path] = {"methods": sorted(methods), "body": body, "handler": node.name}
    return out


def _sampling_rule(tree: ast.Module) -> dict[str, Any]:
    """The source of SGLang's sampling-parameter check: the class's field defaults, the
    methods in `SAMPLING_METHODS`, the helpers they call and the module constants they
    read (each as `ast.unparse` writes it)."""
    cls = _classes(tree)["SamplingParams"]
    methods = {
        n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in SAMPLING_METHODS
    }
    helpers = {
        n.name: n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name in SAMPLING_HELPERS
    }
    missing = [m for m in (*SAMPLING_METHODS, *SAMPLING_HELPERS) if m not in {**methods, **helpers}]
    if missing:
        raise SystemExit(f"not found in {SAMPLING_PARAMS}: {missing}")
    defaults = {
        node.target.id: ast.unparse(node.value)
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.value is not None
    }
    used = {
        n.id
        for f in (*methods.values(), *helpers.values())
        for n in ast.walk(f)
        if isinstance(n, ast.Name)
    } | {n.id for v in defaults.values() for n in ast.walk(ast.parse(v)) if isinstance(n, ast.Name)}
    constants = {
        node.targets[0].id: ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in used
        and isinstance(node.value, (ast.Constant, ast.BinOp))
    }
    return {
        "module": SAMPLING_PARAMS,
        "class": "SamplingParams",
        "constants": constants,
        "defaults": defaults,
        "helpers": {name: ast.unparse(helpers[name]) for name in SAMPLING_HELPERS},
        "methods": {name: ast.unparse(methods[name]) for name in SAMPLING_METHODS},
    }


def extract(src: Path) -> dict[str, Any]:
    source = Source(src)
    io_classes = _classes(ast.parse(source.read(IO_STRUCT)))
    api_classes = _classes(ast.parse(source.read(API_TYPES)))
    classes: dict[str, Any] = {}
    for name in IO_CLASSES:
        classes[name] = {"module": IO_STRUCT, "fields": _fields(io_classes, name)}
    for name in API_CLASSES:
        classes[f"api.v1.{name}"] = {
            "module": API_TYPES,
            "fields": _fields(api_classes, name),
            "unknown_keys": _unknown_keys(api_classes[name]),
        }
    routes = _routes(ast.parse(source.read(HTTP_SERVER)))
    missing = [r for r in ROUTES if r not in routes]
    if missing:
        raise SystemExit(f"routes not found in {HTTP_SERVER}: {missing}")
    return {
        "generated_by": "tools/sglang_schema.py -- do not edit; rerun it with --write",
        "sglang_version": source.version(),
        "requires": _requires(source.metadata()),
        "classes": classes,
        "routes": {r: routes[r] for r in ROUTES},
        "sampling_params": _sampling_rule(ast.parse(source.read(SAMPLING_PARAMS))),
    }


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=os.environ.get("FLYWHEEL_SGLANG_SRC"))
    ap.add_argument("--out", default=str(PINNED))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the pinned file")
    mode.add_argument("--check", action="store_true", help="fail when the pinned file differs")
    args = ap.parse_args(argv)
    if not args.src:
        ap.error("--src (or FLYWHEEL_SGLANG_SRC) is required: the unpacked sglang wheel")
    text = render(extract(Path(args.src)))
    out = Path(args.out)
    if args.write:
        out.write_text(text)
        return 0
    if args.check:
        old = out.read_text() if out.is_file() else ""
        if old == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(out), "extracted")
        )
        print(f"{out} differs from {args.src}: rerun with --write and review the diff")
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
