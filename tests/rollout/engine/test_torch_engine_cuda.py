"""The torch engine on CUDA (skipped without a GPU; the same code path runs on CPU in
test_torch_engine.py). Tolerance: float32 on GPU (TF32 off) agrees with a fresh forward to
~1e-6; logprobs are compared with atol=1e-4 to allow other reduction orders of GPU kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.weights.manifest import make_manifest, named_parameters_for_update
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from tests.rollout.conftest import load_model
from tests.rollout.engine.test_torch_engine import PROMPTS

pytestmark = pytest.mark.gpu


@pytest.fixture
async def cuda_engine(tiny_model_dir: Path):  # noqa: ANN201
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = TorchEngine(tiny_model_dir, max_batch_size=4, device="cuda")
    await eng.start()
    yield eng
    await eng.stop()


async def test_cuda_greedy_and_logprobs_match_the_model(
    cuda_engine: TorchEngine, tiny_model_dir: Path
) -> None:
    model = load_model(tiny_model_dir).cuda()
    for p in PROMPTS[:3]:
        c = await cuda_engine.agenerate(
            p, SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
        )
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p], device="cuda"),
                do_sample=False,
                max_new_tokens=12,
                min_new_tokens=12,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            logits = (
                model(torch.tensor([p + c.output_ids], device="cuda"))
                .logits[0, len(p) - 1 : -1]
                .float()
            )
        assert c.output_ids == ref
        expected = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(c.output_ids, device="cuda")[:, None]
        )[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected.cpu(), rtol=0, atol=1e-4)


async def test_cuda_update_from_cpu_tensors(
    cuda_engine: TorchEngine, other_model_dir: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))  # CPU tensors, as received
    r = await cuda_engine.update_weights_from_tensors(sd, make_manifest(sd, 1))
    assert r.ok, r.message
    got = cuda_engine.current_weights()
    assert all(torch.equal(got[k].cpu(), v) for k, v in sd.items())
