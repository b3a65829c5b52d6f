"""SGLang's vocabulary: the HTTP requests and answers, and the server's command line.

Kept apart from the engine (`sglang_engine.py`) so that the one place that must change
with a new SGLang version is small, pure and checked against the pinned schema.

Written against SGLang 0.5.23 (the pinned schema is `tests/rollout/sglang_schema.json`,
extracted from the wheel by `tools/sglang_schema.py`). Endpoints used:

- `POST /generate` `{"input_ids", "sampling_params", "return_logprob": true, "rid"}`, plus
  `"image_data": ["data:image/png;base64,...", ...]` for a prompt with images (one data URL
  per image, in the order of the prompt's image placeholders; `GenerateReqInput.image_data`,
  decoded by SGLang's `load_image`) ->
  `{"output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort"},
  "output_token_logprobs": [[logprob, token_id, text], ...], "weight_version",
  "weight_versions": [{"version", "start", "end"}, ...]}}`; HTTP 400 when the prompt and
  `max_new_tokens` exceed the context length, or when `SamplingParams.verify()` refuses the
  `sampling_params` (`min_new_tokens` above `max_new_tokens`: the client caps it).
- `POST /pause_generation {"mode": "abort"}` (requests in flight come back aborted with their
  partial output; new ones wait inside the server), `POST /continue_generation`
- `POST /abort_request` `{"rid": "", "abort_all": true}`
- `POST /update_weights_from_disk` `{"model_path", "weight_version"}`,
  `POST /init_weights_update_group` `{"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"}`, `POST /destroy_weights_update_group
  {"group_name"}`, `POST /update_weights_from_distributed` `{"names", "dtypes", "shapes",
  "group_name", "flush_cache", "weight_version"}`: `{"success", "message"}`, HTTP 400 on
  failure
- `GET /ping` (liveness without generating: `/health` generates one token and answers 503
  while the server is paused), `GET /model_info` (`weight_version`)
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.image_bytes import read_header
from services.core.types import SamplingParams, StopReason


class SGLangError(RuntimeError):
    """The SGLang server answered with an error or not at all."""


def sampling_to_sglang(
    s: SamplingParams, max_new_tokens: int, min_new_tokens: int
) -> dict[str, Any]:
    """Our sampling settings in SGLang's `sampling_params` vocabulary.

    `min_new_tokens` is capped at `max_new_tokens`: SGLang's `SamplingParams.verify()`
    refuses a larger one (HTTP 400 "min_new_tokens must be in [0, max_new_tokens]"), and the
    budget of a request can be below the minimum asked for, when `max_tokens` caps it near
    the end of the context or a resubmission after an interruption has only the rest left.
    """
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min(min_new_tokens, max_new_tokens),
        "temperature": 0.0 if s.is_greedy else s.temperature,
        "top_p": s.top_p,
        "top_k": -1 if s.top_k <= 0 else s.top_k,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        "no_stop_trim": True,
        "frequency_penalty": s.frequency_penalty,
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = int(s.seed)
    return out


def launch_command(
    model_path: str, host: str, port: int, tp_size: int, launch_args: Mapping[str, Any]
) -> list[str]:
    """`python -m sglang.launch_server ...`; `launch_args` keys become `--key-name value`
    (True -> a bare flag, False/None -> omitted)."""
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
    ]
    for key, value in launch_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        else:
            cmd.extend([flag, str(value)])
    return cmd


BASE_WEIGHT_VERSION = 0
"""Flywheel's version of the weights a server was launched with (SGLang reports
`"default"` for them unless launched with `--weight-version`)."""


class ContextOverflowError(SGLangError):
    """SGLang refused a request longer than the model's context (HTTP 400)."""


def server_version(value: Any) -> int | None:
    """Flywheel version of a server's `weight_version` string: an integer string is that
    version; `"default"` (or any other non-integer label) is the launch weights, version 0;
    absent (an older server) is unknown (None)."""
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        return BASE_WEIGHT_VERSION


def token_versions(meta: Mapping[str, Any], n_tokens: int, fallback: int) -> list[int]:
    """The version of each of a piece's `n_tokens` output tokens, as the server reports
    them: `weight_versions` spans (`[start, end)` per version) when present, else
    `weight_version` for all of them, else `fallback` (a server that reports neither)."""
    out = [fallback] * n_tokens
    spans = meta.get("weight_versions")
    if spans:
        for span in spans:
            v = server_version(span.get("version"))
            lo, hi = int(span.get("start", 0)), min(int(span.get("end", n_tokens)), n_tokens)
            for i in range(lo, hi):
                out[i] = fallback if v is None else v
        return out
    v = server_version(meta.get("weight_version"))
    return out if v is None else [v] * n_tokens


def answer_json(path: str, r: Any) -> Any:
    """The JSON of an answer; SGLang's failures (HTTP 4xx/5xx, `{"success": false,
    "message"}` or `{"error": {"message"}}`) raise `SGLangError` with the server's words."""
    if r.status_code >= 400:
        raise SGLangError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
    try:
        return r.json()
    except ValueError:
        return {}


def meta_info(data: Any) -> Mapping[str, Any]:
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    return data.get("meta_info") or {} if isinstance(data, dict) else {}


def image_data(images: Sequence[bytes]) -> list[str]:
    """`/generate`'s `image_data` for one prompt: each encoded image as a `data:` URL.

    SGLang takes, per image, a URL, a server-side file path, or base64 text (with or without
    a `data:` prefix; `srt/utils/common.py` `get_image_bytes`). Paths would need a volume
    the server mounts and URLs a server to fetch from, so the bytes travel inline; the
    `data:` prefix names the format, and a `ValueError` names an image that is neither PNG
    nor JPEG before the server sees it."""
    urls = []
    for data in images:
        fmt = read_header(data).format
        urls.append(f"data:image/{fmt};base64,{base64.b64encode(data).decode('ascii')}")
    return urls


def parse_generate_response(data: Any) -> tuple[list[int], list[float], StopReason]:
    """Token ids, their logprobs and the finish type of one `/generate` answer."""
    if isinstance(data, list):  # a batch answer for one prompt
        if len(data) != 1:
            raise SGLangError(f"/generate returned {len(data)} results for one prompt")
        data = data[0]
    meta = data.get("meta_info", {})
    triples = meta.get("output_token_logprobs") or []
    ids = [int(t[1]) for t in triples]
    lps = [float(t[0]) for t in triples]
    if not triples and data.get("output_ids"):
        raise SGLangError("/generate returned tokens without logprobs (return_logprob ignored?)")
    if data.get("output_ids") is not None and list(data["output_ids"]) != ids:
        raise SGLangError("/generate output_ids and output_token_logprobs disagree")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"/generate finish_reason {finish!r} is not stop/length/abort")
    return ids, lps, kind  # type: ignore[return-value]
